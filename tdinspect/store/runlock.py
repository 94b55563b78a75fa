"""The lock a capture holds on its run folder while it writes there (standard library only).

A PID does not say who owns a run: two containers on one host both run their capture as
PID 1, so ``overwrite=True`` in one took the other's live run for its own earlier one and
removed it (passes 0-12 gone). A capture therefore holds an exclusive ``fcntl.flock`` on
``run.lock`` in its run folder from the moment the folder appears (the file is locked in
the temporary folder, before the rename that makes it a run folder) until it closes; the
kernel drops the lock when the process dies, so a crashed run never stays locked. Closing
the capture removes the file: a closed run holds its manifest and passes only.
``overwrite=True`` refuses a folder whose lock another capture holds (:func:`held`).
Where ``fcntl`` is missing (Windows), no lock is taken and the PID rule of
:mod:`tdinspect.store.runs` is all there is.

Examples
--------
>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> fd = take(folder)
>>> held(folder), release(fd), held(folder)
(True, None, False)
>>> release(take(folder), folder); held(folder) is None     # no lock file: a closed run
True
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILENAME = "run.lock"


def take(folder: Path) -> int | None:
    """Create ``folder/run.lock`` and hold an exclusive lock on it; returns its descriptor
    (give it to :func:`release`), or ``None`` where locks are not available."""
    if fcntl is None:
        return None
    fd = os.open(folder / LOCK_FILENAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def release(fd: int | None, folder: Path | None = None) -> None:
    """Drop the lock :func:`take` returned (closing the descriptor releases it); with
    ``folder``, remove its lock file first: a closed run holds only its manifest and passes."""
    if fd is None:
        return
    if folder is not None:
        try:
            os.unlink(folder / LOCK_FILENAME)
        except OSError:
            pass  # the folder was removed or moved: the descriptor still goes
    os.close(fd)


def held(folder: Path) -> bool | None:
    """Whether another open capture holds ``folder``'s lock (``True``), nobody does
    (``False``), or the folder has no lock file, or no locks can be taken (``None``: a run of
    an older tdinspect, or one whose lock cannot be opened: decide by other means)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder / LOCK_FILENAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # a lock this call took goes with it
    return False
