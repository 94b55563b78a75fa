"""numba, loaded lazily and one way for every compiled loop of ``numerics``.

The modules holding compiled loops (:mod:`tdinspect.numerics.onepass_loops`,
:mod:`tdinspect.numerics.fused_loop`) import numba at their top; their callers reach them
only through :func:`load`, on the first input big enough to be worth it: numba takes
~0.2 s to import and its cached loops most of a second to load, which small dumps, the
CLI on them and capture never pay. Where numba is not installed the caller's torch or
numpy path serves silently; where it is installed but fails to import (a numba built for
another numpy, a broken llvmlite) the caller's path serves too, and a ``RuntimeWarning``
says so once per module, naming what serves instead.

Examples
--------
>>> isinstance(installed(), bool)
True
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import warnings

_loaded: dict[str, object] = {}  # module name -> the module, or None (unavailable)
_lock = threading.Lock()  # threads (dask's, capture's pool) reach the first big tensor together


def installed() -> bool:
    """Whether numba is installed (``find_spec``: without importing it)."""
    return importlib.util.find_spec("numba") is not None


def load(module: str, instead: str):
    """``tdinspect.numerics.<module>`` (a module importing numba), imported once per process;
    ``None`` where numba is missing or fails to load. A failure warns once (``RuntimeWarning``:
    ``tdinspect: numba failed to load (<error>); <instead>``)."""
    if module in _loaded:
        return _loaded[module]
    with _lock:
        if module not in _loaded:
            _loaded[module] = _import(module, instead)
    return _loaded[module]


def _import(module: str, instead: str):
    if not installed():
        return None
    try:
        return importlib.import_module(f"tdinspect.numerics.{module}")
    except Exception as exc:  # noqa: BLE001 - e.g. a numba built for another numpy
        warnings.warn(
            f"tdinspect: numba failed to load ({type(exc).__name__}: {exc}); {instead}",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
