"""The writer: passes are written while the next step computes (when a core is free).

One thread per capture takes finished passes from a queue, waits for their
device-to-host copies and statistics (one CUDA event per pass), and writes the
sidecar and then the pass file, each atomically. Memory held by queued passes is bounded: at the cap, ``submit``
waits for the writer.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tdinspect.errors import CaptureWriteError
from tdinspect.numerics.checksum import checksum_hex
from tdinspect.store.format import pass_filename, save_pass, sidecar_filename, write_sidecar
from tdinspect.store.rawpass import layout


@dataclass
class PendingPass:
    """One finished step, waiting to be written."""

    index: int
    folder: Path
    header: dict[str, Any]
    keys: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor | None] = field(default_factory=list)
    stats: list[torch.Tensor | None] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    ready: Any = None  # a CUDA event to wait on before reading host copies
    host_stats: torch.Tensor | None = None  # stats gathered on device, copied once per step
    checksums: list[torch.Tensor | None] = field(default_factory=list)
    host_checksums: torch.Tensor | None = None  # likewise for checksums
    # checksum_dim: entry index -> (dim, one fingerprint per row, on the device); host copies
    row_checksums: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    host_row_checksums: torch.Tensor | None = None
    nbytes: int = 0

    def facts(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(meta, stored)``: the pass's sidecar facts and its stored tensors by key (host
        copies, waited for)."""
        if self.ready is not None:
            self.ready.synchronize()
        gathered = iter(self.host_stats.tolist()) if self.host_stats is not None else None
        rows = [None if stat is None else next(gathered) for stat in self.stats]
        entries = {"key": self.keys, **self.columns, "stats": rows}
        if self.host_checksums is not None:
            digests = iter(self.host_checksums.tolist())
            entries["checksum"] = [None if c is None else checksum_hex(next(digests)) for c in self.checksums]
        if self.host_row_checksums is not None:
            entries["checksum_rows"] = _rows_column_of(self)
        meta = {**self.header, "pass": self.index, "entries": entries}
        if self.header.get("stats_only"):
            return meta, {}
        return meta, {k: t for k, t, keep in zip(self.keys, self.tensors, self.columns["stored"]) if keep}

    def write(self, fsync: bool) -> None:
        write_pass(self.folder, self.index, *self.facts(), fsync=fsync)


def write_pass(
    folder: Path, index: int, meta: dict[str, Any], stored: dict[str, torch.Tensor], *, fsync: bool = False
) -> None:
    """Write one pass into ``folder``: its sidecar, then its pass file (unless statistics only),
    each atomically; the sidecar is bound to the complete pass file before that takes its name."""
    sidecar = folder / sidecar_filename(index)
    if meta.get("stats_only"):
        write_sidecar(sidecar, meta, fsync=fsync)
        return
    # where each tensor's bytes lie in the archive: analysis reads them without unpickling
    places = layout(stored)
    if places is not None:
        where = dict(zip(stored, places))
        meta = {**meta, "entries": {**meta["entries"], "raw": [where.get(k) for k in meta["entries"]["key"]]}}
    try:
        save_pass(
            folder / pass_filename(index),
            stored,
            fsync=fsync,
            before_replace=lambda tmp: write_sidecar(sidecar, meta, fsync=fsync, pass_file=tmp),
        )
    except BaseException:
        sidecar.unlink(missing_ok=True)  # no sidecar of a pass that was never written
        raise


def _rows_column_of(p: PendingPass) -> list[dict | None]:
    """The ``checksum_rows`` column: per entry ``{"dim": d, "rows": [16 hex digits, ...]}`` or
    ``None``, from the one host copy of the pass's row fingerprints."""
    flat = iter(p.host_row_checksums.tolist())
    out: list[dict | None] = [None] * len(p.keys)
    for i in sorted(p.row_checksums):
        dim, rows = p.row_checksums[i]
        out[i] = {"dim": dim, "rows": [checksum_hex(next(flat)) for _ in range(rows.numel())]}
    return out


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``, if any: torch's zip writer reports a full disk as
    ``unexpected pos 704 vs 598``, the ``ENOSPC`` only in its ``__context__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _interrupt(exc: BaseException) -> KeyboardInterrupt | None:
    """The ``KeyboardInterrupt`` behind ``exc``, if any: raised inside a file's ``write`` called
    by torch's zip writer, it comes out as torch's ``RuntimeError`` with the interrupt in its
    ``__context__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _write_error(item: PendingPass, exc: BaseException) -> CaptureWriteError:
    cause = _os_error(exc)
    reason = (
        f"{os.strerror(cause.errno)} ({type(exc).__name__}: {exc})"
        if cause is not None and cause is not exc
        else f"{type(exc).__name__}: {exc}"
    )
    error = CaptureWriteError(
        f"writing pass {item.index} into {item.folder} failed: {reason}; "
        "capture stopped, earlier passes are complete"
    )
    error.__cause__ = exc
    return error


def default_threaded() -> bool:
    """Write in a background thread only when a core is free for it.

    The model's intra-op threads (OpenMP) wait for their slowest member at
    every parallel region: a writer thread competing with them for a core
    slows the forward pass several times over (measured on 2 cores with 2
    intra-op threads: 55 -> 300 ms a step). With no spare core, writing in
    ``step()`` itself costs less in total (2.5x vs 2.9x on the benchmark
    transformer). With a spare core (GPU servers, or intra-op threads below
    the core count) the thread overlaps writing with the next step.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return torch.cuda.is_available() or cores > torch.get_num_threads()


class AsyncWriter:
    """A writer thread with a byte cap on what waits in its queue.

    Parameters
    ----------
    max_pending_bytes : int
        ``submit`` blocks while more than this many bytes wait (a single pass
        larger than the cap is still accepted when the queue is empty).
    fsync : bool
        ``fsync`` each file before its rename (survives power loss, slower).
    on_written : callable, optional
        Called with a pass's host tensors once they are on disk.
    threaded : bool, optional
        Write in a background thread (default: :func:`default_threaded`), or
        in ``submit`` itself.
    """

    def __init__(
        self,
        max_pending_bytes: int = 2 << 30,
        fsync: bool = False,
        on_written=None,
        threaded: bool | None = None,
    ):
        self.max_pending_bytes = max_pending_bytes
        self.threaded = default_threaded() if threaded is None else threaded
        self.on_written = on_written
        self.fsync = fsync
        self.error: CaptureWriteError | None = None
        self._queue: queue.Queue[PendingPass | None] = queue.Queue()
        self._pending = 0  # bytes queued or being written
        self._items = 0  # passes queued or being written
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tdinspect-writer", daemon=True)
        if self.threaded:
            self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(item)
            finally:
                with self._cond:
                    self._pending -= item.nbytes
                    self._items -= 1
                    self._cond.notify_all()

    def _write(self, item: PendingPass) -> None:
        try:
            if self.error is None:
                item.write(self.fsync)
                if self.on_written is not None:
                    self.on_written(item.tensors)  # the host buffers can be reused
        except BaseException as exc:  # noqa: BLE001 - reported to the capturing thread
            interrupt = _interrupt(exc)
            if interrupt is not None and not self.threaded:
                # Ctrl-C during an inline write is the user's, not a write error, even when
                # torch's zip writer reported it as its own (`unexpected pos 1216 vs 1110`)
                if interrupt is exc:
                    raise
                raise KeyboardInterrupt(*interrupt.args) from exc
            self.error = _write_error(
                item, KeyboardInterrupt("interrupted") if interrupt is not None else exc
            )

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def submit(self, item: PendingPass) -> None:
        """Queue a pass; waits while the queue holds more than the byte cap."""
        self.raise_if_failed()
        if not self.threaded:
            self._write(item)
            self.raise_if_failed()
            return
        with self._cond:
            while self._pending > 0 and self._pending + item.nbytes > self.max_pending_bytes:
                self._cond.wait()
            self._pending += item.nbytes
            self._items += 1
        self._queue.put(item)

    def flush(self) -> None:
        """Wait until everything queued is written; raise a write error if one happened."""
        with self._cond:
            while self._items > 0:
                self._cond.wait()
        self.raise_if_failed()

    def close(self) -> None:
        """Write what is queued and stop the thread."""
        if self.threaded and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.raise_if_failed()
