import sys

from tdinspect.cli import main

sys.exit(main())
