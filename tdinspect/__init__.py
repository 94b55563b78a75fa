"""tdinspect: find the first operator where two runs of a PyTorch model part.

Capture (torch and the standard library only, safe on an engine's hot path)::

    with tdinspect.capture(model, "dumps/run_a") as dump:
        model(batch); dump.step()

Analysis (xarray, loaded on first use)::

    div = tdinspect.DumpSet.open("dumps/run_a").diff("dumps/run_b").first_divergence()

In Jupyter: ``%load_ext tdinspect``.
"""

from __future__ import annotations

import importlib as _importlib

from tdinspect.config import DumpConfig
from tdinspect.dumper.modules import capture
from tdinspect.errors import (
    CaptureWriteError,
    ConfigError,
    DivergenceError,
    DumpFormatError,
    GraftError,
    NonFiniteError,
    RunWarning,
    UncomparedWarning,
)
from tdinspect.naming import parse_key
from tdinspect.store.format import load_pass
from tdinspect.store.runs import list_runs
from tdinspect.store.tokenlayout import tokens

__version__ = "0.1.0"

# Analysis and views load lazily (PEP 562): importing tdinspect must not import
# xarray, pandas, matplotlib, IPython or dask.
_LAZY = {
    "capture_ops": ("tdinspect.dumper.ops", "capture_ops"),
    "graft": ("tdinspect.dumper.graft", "graft"),
    "DumpSet": ("tdinspect.dumpset", "DumpSet"),
    "Diff": ("tdinspect.compare.diff", "Diff"),
    "Divergence": ("tdinspect.compare.thresholds", "Divergence"),
    "Verdict": ("tdinspect.compare.thresholds", "Verdict"),
    "CompareSpec": ("tdinspect.compare.spec", "CompareSpec"),
    "replay": ("tdinspect.rerun", "replay"),
    "suggest_mapping": ("tdinspect.suggest", "suggest_mapping"),
    "explore": ("tdinspect.jupyter.widgets", "explore"),
    "dashboard": ("tdinspect.jupyter.dashboard", "dashboard"),
    "plot": ("tdinspect.jupyter.plots", None),
}

# The curated public API: what a user needs to capture, open, compare and look. Everything
# else is reachable from its module (tdinspect.dumper.modules.ModuleCapture,
# tdinspect.naming.KeyParts, tdinspect.errors.NonFinite, ...).
__all__ = [
    # capture
    "capture",
    "capture_ops",
    "DumpConfig",
    "graft",
    # read and compare
    "load_pass",
    "list_runs",
    "parse_key",
    "tokens",
    "DumpSet",
    "Diff",
    "Divergence",
    "Verdict",
    "CompareSpec",
    "replay",
    "suggest_mapping",
    # look
    "explore",
    "dashboard",
    "plot",
    # errors and warnings
    "ConfigError",
    "DumpFormatError",
    "CaptureWriteError",
    "DivergenceError",
    "NonFiniteError",
    "GraftError",
    "RunWarning",
    "UncomparedWarning",
]


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = _importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tdinspect' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | {"__version__"})  # public names only (completion lists these)


def load_ipython_extension(ipython) -> None:
    """``%load_ext tdinspect``: register the ``%tdi_*`` magics."""
    from tdinspect.jupyter.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext tdinspect``: remove the magics again."""
    from tdinspect.jupyter.magics import unload_ipython_extension as unload

    unload(ipython)
