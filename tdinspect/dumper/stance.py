"""Dynamo's ``force_eager`` stance while captures of compiled models are open.

The stance is one setting for the whole process; ``torch.compiler.set_stance``
restores, on exit, what was set when it was made. Two captures each holding
their own ``set_stance`` and closed in the order they were opened left
``force_eager`` on for good (every compiled model then ran eagerly). Here the
captures share one counter: the first sets the stance, the last to leave
restores what was there before it, whatever the order they close in.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_holders: set[int] = set()  # tokens of the open holders
_restore = None  # the set_stance object of the first holder: its __exit__ restores the prior stance
_next = 0


def hold_eager() -> int:
    """Run compiled models eagerly until :func:`release` of the token returned."""
    global _restore, _next
    import torch

    with _lock:
        if not _holders:
            _restore = torch.compiler.set_stance("force_eager")  # sets it now
        _next += 1
        _holders.add(_next)
        return _next


def release(token: int | None) -> None:
    """Give up a hold (a second release of the same token does nothing); the last one
    restores the stance of before the first."""
    global _restore
    with _lock:
        if token not in _holders:
            return
        _holders.discard(token)
        if not _holders and _restore is not None:
            restore, _restore = _restore, None
            restore.__exit__(None, None, None)


def held() -> int:
    """How many holds are open (tests)."""
    return len(_holders)
