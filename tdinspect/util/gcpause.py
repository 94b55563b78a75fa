"""The cyclic garbage collector paused while a block makes many objects that form no cycles.

Parsing a sidecar, or comparing a pass of 10⁵ small entries, makes hundreds of thousands of
lists, dicts and tuples that live on; the collections they trigger then walk every object
the process holds (an opened dump's metadata: a million of them for two passes of 10⁵
entries), which took as long as the work itself. :func:`paused` holds the collector off
for the block. Threads share the collector: it is paused while any of them is in such a
block, and switched back on (if it was on) when the last one leaves.

Examples
--------
>>> import gc
>>> with paused():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import contextlib
import gc
import threading

_LOCK = threading.Lock()
_inside = 0  # threads in a paused block
_resume = False  # whether the collector was on when the first of them came in


@contextlib.contextmanager
def paused():
    """The collector off for the ``with`` block (cyclic garbage made in it is collected
    by the collections after it)."""
    global _inside, _resume
    with _LOCK:
        if _inside == 0:
            _resume = gc.isenabled()
            gc.disable()
        _inside += 1
    try:
        yield
    finally:
        with _LOCK:
            _inside -= 1
            if _inside == 0 and _resume:
                gc.enable()
