"""Opening a dump's files only when they are regular files.

A dump folder is data: a file named ``pass00001.pt``, ``pass00001.json`` or
``run.json`` may be a FIFO (opening it for reading blocks until a writer
comes: the reader hung forever), a device or a link to one (``/dev/zero``:
read to its end, it filled memory until ``MemoryError``, or the OOM killer),
or a folder, or a link leading anywhere (``private/weights.pt``: its tensors were printed
as the dump's). Every reader of a dump's files opens them through
:func:`open_regular`, which refuses anything but a regular file (links included) with a
:class:`NotRegularFile`, an ``OSError`` (so each reader's existing handling of
unreadable files applies and names the file). The file is checked by
``stat`` before it is opened (opening some devices acts on them) and again
by ``fstat`` once open (it is opened without blocking, so a FIFO swapped in
between is refused too).

Examples
--------
>>> import os, tempfile
>>> folder = tempfile.mkdtemp()
>>> os.mkfifo(os.path.join(folder, "pass00000.pt"))
>>> open_regular(os.path.join(folder, "pass00000.pt"))
Traceback (most recent call last):
...
tdinspect.util.regularfile.NotRegularFile: [Errno 22] not a regular file (a FIFO): '...pass00000.pt'
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFile(OSError):
    """A dump file that is a FIFO, a device, a socket or a folder (never opened to read)."""


def _refuse_unless_regular(mode: int, path: str | os.PathLike) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a file")
        raise NotRegularFile(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))


def check_regular(path: str | os.PathLike, *, links: bool = False) -> os.stat_result:
    """``os.stat(path)`` if it is a regular file; :class:`NotRegularFile` (or the ``OSError``
    of ``stat``) otherwise. A link is refused unless ``links`` (a dump's files are its own:
    tdinspect never writes links, and one could lead to any file the reader may open)."""
    st = os.stat(path) if links else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise NotRegularFile(
            errno.ELOOP, "a link (a dump is read from its own files, never through links)", os.fspath(path)
        )
    _refuse_unless_regular(st.st_mode, path)
    return st


def open_regular(path: str | os.PathLike, *, links: bool = False) -> BinaryIO:
    """``open(path, "rb")`` of a regular file; :class:`NotRegularFile` for anything else
    (for a link too, unless ``links``: a file the user named, such as a mapping file)."""
    check_regular(path, links=links)
    f = open(path, "rb", opener=_without_blocking if links else _without_blocking_or_links)
    try:
        _refuse_unless_regular(os.fstat(f.fileno()).st_mode, path)
        os.set_blocking(f.fileno(), True)
    except BaseException:
        f.close()
        raise
    return f


def _without_blocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY)


def _without_blocking_or_links(path: str, flags: int) -> int:
    # a link swapped in after the check above is refused by the kernel (ELOOP)
    return os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW)
