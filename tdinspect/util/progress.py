"""Progress bars: in a terminal by default, in Jupyter only when asked.

A notebook saved with a progress *widget* shows it frozen (``diff: 0%``) or
as "Error displaying widget" once the kernel is gone, so analysis calls take
``progress=None`` (the default): a bar only when stderr is a terminal.
``progress=True`` asks for one anywhere (a widget in Jupyter, via
``tqdm.auto``); ``progress=False`` never shows one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable


def wanted(progress: bool | None) -> bool:
    """Whether to show a bar: ``progress`` if given, else whether stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


def bar(iterable: Iterable, progress: bool | None, *, total: int | None = None, desc: str = ""):
    """``iterable`` wrapped in a ``tqdm.auto`` bar when :func:`wanted`, else unchanged.

    Examples
    --------
    >>> list(bar(range(3), False))
    [0, 1, 2]
    """
    if not wanted(progress):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False)
