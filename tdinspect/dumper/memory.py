"""Capture to memory: passes kept in this process instead of written, then opened or saved.

``capture(model, memory=True)`` (or ``capture_ops(memory=True)``) records exactly what a
capture to a folder records, but each finished pass stays in memory, up to a limit
(``memory=True``: 2 GB of tensors; ``memory="8GB"`` or a byte count). An entry that would
cross the limit stops the capture with a :class:`~tdinspect.errors.CaptureMemoryError` naming
both; the pass in progress is dropped, the passes before it are kept::

    with tdinspect.capture(model, memory=True) as cap:
        model(x)
        cap.step()
    ds = cap.dumpset                 # a DumpSet, as DumpSet.open gives for a folder
    cap.save("dumps/run_a")          # the same files a capture to that folder writes

Capture to disk stays off unless a folder is given: a memory capture writes nothing until
:meth:`InMemory.save`. This module imports torch and the standard library only; the
DumpSet is built by :mod:`tdinspect.dumper.memory_open`, imported on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tdinspect.errors import CaptureMemoryError, ConfigError
from tdinspect.store.runs import new_run_folder, release_run_folder
from tdinspect.util.terminal import visible


def size_text(n: int) -> str:
    """``2147483648`` -> ``"2.0 GB"`` (powers of 1024, as :func:`tdinspect.report.human_bytes`)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


class MemoryStore:
    """The passes of one capture to memory, in the writer's place (``submit``, ``flush``,
    ``close``) of a :class:`~tdinspect.dumper.writer.AsyncWriter`.

    Parameters
    ----------
    limit : int
        Bytes of tensors the store may hold, the pass in progress included.
    """

    threaded = False

    def __init__(self, limit: int):
        self.limit = limit
        self.passes: list[dict[str, Any]] = []  # {"rank", "pass", "meta", "tensors"}, in order
        self.held = 0  # bytes of the tensors of the passes kept
        self.error = None

    def check(self, key: str, pass_index: int, pending: int, entry: int) -> None:
        """Raise when ``entry`` more bytes (the entry ``key``) would take what is held, with the
        ``pending`` bytes of the pass in progress, past the limit."""
        total = self.held + pending + entry
        if total <= self.limit:
            return
        kept = f"passes 0..{pass_index - 1} are kept (cap.dumpset)" if pass_index else "no pass is kept"
        raise CaptureMemoryError(
            visible(
                f"capture to memory: entry {key!r} of pass {pass_index} ({size_text(entry)}) would "
                f"hold {size_text(total)}, past memory={size_text(self.limit)}; the capture stopped, "
                f"pass {pass_index} was dropped and {kept}. Raise the limit (memory='8GB'), narrow "
                "filter=, record statistics only (stats_only=True) or capture to a folder"
            )
        )

    def submit(self, item) -> None:
        meta, stored = item.facts()
        self.passes.append({"rank": meta["rank"], "pass": item.index, "meta": meta, "tensors": stored})
        self.held += item.nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def raise_if_failed(self) -> None:
        pass

    def save(self, dump_dir: str | os.PathLike, *, if_exists: str = "refuse", fsync: bool = False) -> Path:
        """Write the passes held as a new run in ``dump_dir``, as a capture to that folder
        would have; returns the run's rank folder. See :meth:`InMemory.save`."""
        from tdinspect.dumper.writer import write_pass

        if if_exists not in ("refuse", "add", "overwrite"):
            raise ConfigError(f"if_exists={if_exists!r}: expected 'refuse', 'add' or 'overwrite'")
        if not self.passes:
            raise ConfigError("nothing to save: the capture kept no pass (was step() called?)")
        if not isinstance(dump_dir, (str, os.PathLike)) or not os.fspath(dump_dir):
            # Path("") is the working folder: an unset variable would have written there
            raise ConfigError(f"save({dump_dir!r}): expected a folder path; nothing written")
        root = Path(dump_dir)
        if os.path.lexists(root) and (root.is_symlink() or not root.is_dir()):
            raise ConfigError(f"save({str(root)!r}): not a folder (a file or a link); nothing written")
        if if_exists == "refuse" and root.is_dir() and any(root.iterdir()):
            shown = ", ".join(sorted(visible(p.name) for p in root.iterdir())[:3])
            raise ConfigError(
                f"save({str(root)!r}): the folder is not empty ({shown}...); nothing written. "
                "if_exists='add' writes a new run beside what is there, 'overwrite' replaces "
                "earlier runs (removing only files tdinspect wrote)"
            )
        first = self.passes[0]["meta"]
        world = 1
        for size in (first.get("parallel") or {}).values():
            world *= int(size[1])
        folder, _ = new_run_folder(
            root, int(first["rank"]), overwrite=if_exists == "overwrite", world=world if world > 1 else None
        )
        try:
            for item in self.passes:
                write_pass(folder, item["pass"], item["meta"], item["tensors"], fsync=fsync)
        finally:
            release_run_folder(folder)
        return folder


class InMemory:
    """What a capture to memory adds to a capture (:class:`~tdinspect.dumper.modules.ModuleCapture`,
    :class:`~tdinspect.dumper.ops.OpCapture`): ``passes``, ``dumpset`` and ``save``."""

    _memory: MemoryStore | None = None

    def _store(self) -> MemoryStore:
        if self._memory is None:
            raise ConfigError(
                "this capture writes to a folder (or nothing); capture(..., memory=True) keeps "
                "its passes in memory for .dumpset and .save()"
            )
        return self._memory

    @property
    def passes(self) -> list[dict[str, Any]]:
        """The passes kept so far, as plain dicts (:meth:`tdinspect.DumpSet.from_memory` takes them)."""
        return list(self._store().passes)

    @property
    def nbytes(self) -> int:
        """Bytes of tensors held by the passes kept."""
        return self._store().held

    @property
    def dumpset(self):
        """The passes kept so far as a :class:`tdinspect.DumpSet` (built on first use, and again
        after more steps). A pass still open is not in it: ``step()`` (or leaving the ``with``)
        ends it.

        Examples
        --------
        >>> with tdinspect.capture(model, memory=True) as cap:    # doctest: +SKIP
        ...     model(x); cap.step()
        >>> cap.dumpset.diff("dumps/run_a").first_divergence()    # doctest: +SKIP
        """
        from tdinspect.dumper.memory_open import open_memory

        store = self._store()
        cached = getattr(self, "_dumpset", None)
        if cached is None or cached[0] != len(store.passes):
            self._dumpset = (len(store.passes), open_memory(store.passes))
        return self._dumpset[1]

    def save(self, dump_dir: str | os.PathLike, *, if_exists: str = "refuse", fsync: bool = False) -> Path:
        """Write what this capture kept in memory as a normal dump: a new run in ``dump_dir``,
        the same pass files, sidecars and manifest a capture to that folder writes
        (``DumpSet.open(dump_dir)`` then equals :attr:`dumpset`).

        Parameters
        ----------
        dump_dir : str or Path
        if_exists : {"refuse", "add", "overwrite"}
            A folder that is not empty is refused by default (nothing written); ``"add"``
            writes a new run beside what is there (a capture per rank saved with ``"add"``
            makes one run of several rank folders); ``"overwrite"`` replaces earlier runs,
            removing only files tdinspect wrote (as ``capture(overwrite=True)``).
        fsync : bool
            ``fsync`` each file before it takes its name.

        Returns
        -------
        Path
            The run's rank folder (``dump_dir/rank0_pid<P>``).

        Examples
        --------
        >>> cap.save("dumps/run_a")                                    # doctest: +SKIP
        PosixPath('dumps/run_a/rank0_pid4242')
        """
        return self._store().save(dump_dir, if_exists=if_exists, fsync=fsync)
