"""Sphinx configuration: ``sphinx-build -W -b html docs docs/_build/html`` from the repository root.

The guides are Markdown (MyST). The notebooks live in ``notebooks/`` and are rendered with the
output they were committed with (``nb_execution_mode = "off"``): a build step below copies them
into ``docs/_notebooks/`` (ignored by git) so that they are not committed twice.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # autodoc imports the package from this checkout

import tdinspect  # noqa: E402

project = "tdinspect"
author = "the tdinspect developers"
copyright = "the tdinspect developers"  # noqa: A001 - Sphinx's name
release = version = tdinspect.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]

# --- notebooks: rendered as committed, never executed again ---------------------------------
nb_execution_mode = "off"
nb_merge_streams = True


def _copy_notebooks() -> None:
    """Copy ``notebooks/*.ipynb`` into ``docs/_notebooks/`` (a build artefact, not committed)."""
    target = DOCS / "_notebooks"
    target.mkdir(exist_ok=True)
    wanted = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    for old in target.glob("*.ipynb"):
        if old.name not in wanted:
            old.unlink()
    for name in sorted(wanted):
        src, dst = ROOT / "notebooks" / name, target / name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            shutil.copyfile(src, dst)  # unchanged files keep their mtime: no needless rebuild


_copy_notebooks()

# --- MyST --------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# --- API ---------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autosummary_generate = False
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True  # dataclass fields: documented once, by autodoc, not twice

# --- HTML --------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "tdinspect"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_static_path: list[str] = []


def _check_api_pages(app) -> None:
    """Every name of ``tdinspect.__all__`` is documented on an API page (a warning otherwise)."""
    from sphinx.util import logging

    text = "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
    documented = set(re.findall(r"^\.\. auto\w+:: tdinspect\.(\w+)", text, re.M))
    documented |= set(re.findall(r"^\.\. automodule:: tdinspect\.jupyter\.(plots)", text, re.M))
    documented = {"plot" if n == "plots" else n for n in documented}
    missing = [n for n in tdinspect.__all__ if n not in documented]
    if missing:
        logging.getLogger(__name__).warning("public names missing from docs/api/: %s", ", ".join(missing))


def setup(app):
    app.connect("builder-inited", _check_api_pages)
