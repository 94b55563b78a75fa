"""Captures a re-run notebook cell left open: closed by the capture that replaces them.

``cap = tdinspect.capture(model, DIR)`` (or ``capture_ops(DIR).start()``) in a cell run
twice leaves the first capture unreachable but recording: its hooks (or dispatch mode)
record every later forward too, twice the work, its pass growing in memory and never
written. The new capture closes each earlier one still open outside a ``with`` that
writes into the same folder (a re-run's signature), writing what it held; one into
another folder may be meant (one per filter) and stays, with a warning that both
record. Captures in ``with`` blocks are nested on purpose and never listed here.

Examples
--------
>>> same_folder("dumps/run", "./dumps/run")
True
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any


def _identity(dump_dir) -> str | None:
    return None if dump_dir is None else os.path.realpath(os.fspath(dump_dir))


def same_folder(a, b) -> bool:
    """Whether two dump folders are one, whatever the spelling (``None``: no folder)."""
    return _identity(a) == _identity(b)


def close_reruns(
    earlier: Iterable[Any],
    dump_dir,
    what: str,
    *,
    closable: Callable[[Any], bool] = lambda old: True,
    unclosable: str = "",
    stacklevel: int = 2,
) -> None:
    """Close each of ``earlier`` (captures still open outside a ``with``) that writes into
    ``dump_dir``, warning once each; warn of the others.

    ``what`` names them in the warnings (``"capture of this Llama"``); ``closable(old)``
    says whether one can be closed now, ``unclosable`` why not (an op capture's mode
    under other modes). ``stacklevel`` is the caller's, for ``warnings.warn``.
    """
    level = stacklevel + 1
    for old in list(earlier):
        folder = old.folder
        if not same_folder(old.config.dump_dir, dump_dir):
            warnings.warn(
                f"tdinspect: an earlier {what} into {folder} is still open outside a "
                f"`with`: both record (close it with .close() if it is a re-run "
                f"cell's)",
                RuntimeWarning,
                stacklevel=level,
            )
        elif not closable(old):
            warnings.warn(
                f"tdinspect: an earlier {what} (into {folder}) is still recording "
                f"outside a `with`, {unclosable}: close() it, or it records "
                f"everything twice",
                RuntimeWarning,
                stacklevel=level,
            )
        else:
            old.close()
            warnings.warn(
                f"tdinspect: closed the earlier {what} still open outside a `with` "
                f"(into {folder}; a re-run cell?): it records no more, and what it "
                f"had recorded is written",
                RuntimeWarning,
                stacklevel=level,
            )
