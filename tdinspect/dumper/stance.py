"""Process-wide settings held while captures are open: dynamo's ``force_eager`` stance.

A setting such as the stance is one for the whole process; ``torch.compiler.set_stance``
restores, on exit, what was set when it was made. Two captures each holding their own
``set_stance`` and closed in the order they were opened left ``force_eager`` on for good
(every compiled model then ran eagerly). Here the captures share one :class:`SharedHold`:
the first sets the setting, the last to leave restores what was there before it, whatever
the order they close in.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable


class SharedHold:
    """A setting on while any holder holds it.

    ``apply()`` sets it and returns the callable that restores what was there before.

    Examples
    --------
    >>> state = {"on": False}
    >>> def apply():
    ...     state["on"] = True
    ...     return lambda: state.update(on=False)
    >>> hold = SharedHold(apply)
    >>> a, b = hold.hold(), hold.hold()
    >>> hold.release(a); state["on"]
    True
    >>> hold.release(b); state["on"]
    False
    """

    _tokens = itertools.count(1)

    def __init__(self, apply: Callable[[], Callable[[], None]]):
        self._apply = apply
        self._lock = threading.Lock()
        self._holders: set[int] = set()
        self._restore: Callable[[], None] | None = None

    def hold(self) -> int:
        """Hold the setting (set now by the first holder); the token to release."""
        with self._lock:
            if not self._holders:
                self._restore = self._apply()
            token = next(self._tokens)
            self._holders.add(token)
            return token

    def release(self, token: int | None) -> None:
        """Give up a hold (a second release of the same token does nothing); the last one
        restores the setting of before the first."""
        with self._lock:
            if token not in self._holders:
                return
            self._holders.discard(token)
            if not self._holders and self._restore is not None:
                restore, self._restore = self._restore, None
                restore()

    def held(self) -> int:
        """How many holds are open (tests)."""
        return len(self._holders)


def _force_eager() -> Callable[[], None]:
    import torch

    stance = torch.compiler.set_stance("force_eager")  # sets it now
    return lambda: stance.__exit__(None, None, None)


EAGER = SharedHold(_force_eager)


def hold_eager() -> int:
    """Run compiled models eagerly until :func:`release` of the token returned."""
    return EAGER.hold()


def release(token: int | None) -> None:
    """Give up a :func:`hold_eager`; the last one restores the stance of before the first."""
    EAGER.release(token)


def held() -> int:
    """How many eager holds are open (tests)."""
    return EAGER.held()
