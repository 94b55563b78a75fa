"""The recorder: one pass of entries, call numbering, host copies, hand-off to the writer.

Module-level and op-level capture both record through a :class:`Recorder`, so
naming, layout, statistics, ``stats_only`` and the writer are one mechanism.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

from tdinspect.dumper.kinds import is_plain, prepare, safe_stats, shape_of
from tdinspect.dumper.memory import MemoryStore
from tdinspect.dumper.writer import AsyncWriter, PendingPass
from tdinspect.errors import ConfigError, TokenLayoutError
from tdinspect.naming import make_key, split_call
from tdinspect.numerics.checksum import row_checksums, tensor_checksum
from tdinspect.numerics.stats import stats_and_checksum
from tdinspect.store.format import pass_filename, sidecar_filename
from tdinspect.store.runs import new_run_folder, release_run_folder
from tdinspect.store.tokenlayout import TokenLayout, check_layout

_LIVE: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    parent = os.getppid()
    for rec in list(_LIVE):
        rec._after_fork_in_child(parent)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def current_rank(coords: dict[str, list[int]] | None = None) -> int:
    """The process's rank: ``torch.distributed`` when initialised, else ``$RANK``, else
    the position of ``coords`` (``capture(parallel=...)``) in the grid of its axes, else 0.

    The last fallback lets one process that emulates the ranks of a sharded run, one
    capture each, write them as the ranks of one run (each its own ``rank<R>`` folder).
    """
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    if "RANK" in os.environ or not coords:
        try:
            return int(os.environ.get("RANK", "0"))
        except ValueError:
            return 0
    rank = 0
    for axis in sorted(coords):  # by name: the same order whatever order each rank gave
        index, size = coords[axis]
        rank = rank * size + index
    return rank


def grid_size(coords: dict[str, list[int]]) -> int | None:
    """How many ranks the grid of ``coords`` holds (``None`` without coordinates)."""
    return math.prod(size for _, size in coords.values()) if coords else None


def parallel_coords(parallel: dict | None) -> dict[str, list[int]]:
    """This process's coordinates ``{axis: [index, size]}``, checked.

    ``None``: tensor parallel over the ``torch.distributed`` world when it is
    initialised, else nothing (a single process).
    """
    if parallel is None:
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return {"tp": [dist.get_rank(), dist.get_world_size()]}
        return {}
    if not isinstance(parallel, dict):
        raise TypeError(f"parallel={parallel!r}: expected {{axis: (rank, size)}}, e.g. {{'tp': (0, 2)}}")
    out = {}
    for axis, coord in parallel.items():
        try:
            index, size = (int(v) for v in coord)
        except (TypeError, ValueError):
            raise ValueError(f"parallel[{axis!r}]={coord!r}: expected (rank, size)") from None
        if not (isinstance(axis, str) and axis.isidentifier()) or not 0 <= index < size:
            raise ValueError(f"parallel[{axis!r}]={coord!r}: need an axis name and 0 <= rank < size")
        out[axis] = [index, size]
    return out


class BufferPool:
    """Host buffers recycled from written passes, by (shape, dtype).

    A fresh 100 MB of copies per step costs page faults on every step (large
    allocations are returned to the OS when freed); reusing the buffers of a
    pass the writer has finished with avoids that. Holds at most ``limit``
    bytes.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, shape, dtype) -> torch.Tensor | None:
        with self._lock:
            bufs = self._free.get((tuple(shape), dtype))
            if not bufs:
                return None
            buf = bufs.pop()
            self._bytes -= buf.numel() * buf.element_size()
            return buf

    def give(self, tensors) -> None:
        with self._lock:
            for t in tensors:
                if (
                    t is None
                    or t.layout != torch.strided
                    or t.is_nested
                    or t.is_quantized
                    or t.device.type != "cpu"
                    or t.is_pinned()
                ):
                    continue
                size = t.numel() * t.element_size()
                if self._bytes + size > self.limit:
                    return
                self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)
                self._bytes += size


def host_copy(t: torch.Tensor, pool: BufferPool | None = None) -> tuple[torch.Tensor, bool]:
    """A private, compact CPU copy of ``t`` and whether it is still in flight.

    CPU tensors are copied (the model may later modify the original in place);
    a view is copied to its own compact storage, never saved with its whole
    base. CUDA tensors go to pinned memory with ``non_blocking=True``: the
    caller synchronises once per step.
    """
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type == "cpu":
        buf = pool.take(t.shape, t.dtype) if pool is not None else None
        if buf is None:
            return t.clone(memory_format=torch.contiguous_format), False
        return buf.copy_(t), False
    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        return buf, True
    return t.to("cpu"), False


def failed_text(exc: BaseException | None) -> str | None:
    """The ``failed`` mark of a pass an exception cut short (``None``: none did): the error's
    type and text, as ``%%tdi_capture`` writes it, at most 300 characters."""
    if exc is None:
        return None
    return f"{type(exc).__name__}: {exc}"[:300]


class Recorder:
    """Entries of the current pass of one capture, written on :meth:`step`.

    Parameters
    ----------
    dump_dir : Path or None
        The dump directory; this process writes into ``rank<R>_pid<P>/`` below it.
        ``None``: nothing is copied or written (keys and call numbers only, for
        checks that run without a dump).
    level : {"module", "op"}
        Recorded in each sidecar.
    stats_only : bool
        Record statistics (computed at capture time) and no tensors.
    max_pending_bytes : int
        Cap on host memory held by passes waiting for the writer.
    fsync : bool
        ``fsync`` files before renaming them.
    background_write : bool, optional
        Write passes in a background thread; default: when a core is free
        for it (see :func:`tdinspect.dumper.writer.default_threaded`).
    parallel : dict, optional
        This process's parallel coordinates ``{axis: (rank, size)}`` (see
        :func:`parallel_coords`), written in each sidecar.
    dims : dict, optional
        ``{regex: dims spec}``: each entry whose name (without ``::callN``)
        matches gets a ``dims`` column (:mod:`tdinspect.align.dims`).
    checksum : bool
        Also record a bitwise fingerprint of each tensor, computed on its
        device (:func:`tdinspect.numerics.checksum.tensor_checksum`), in the sidecar's
        ``checksum`` column.
    checksum_dim : int, optional
        With ``checksum``, also one fingerprint per index along this dim
        (:func:`tdinspect.numerics.checksum.row_checksums`), in the sidecar's
        ``checksum_rows`` column: row 0 of a batch of 4 compares with a batch of 1.
    overwrite : bool
        Remove earlier runs in ``dump_dir`` (they are kept otherwise; this
        capture is a new run in its own folder either way, see
        :mod:`tdinspect.store.runs`).
    memory : int, optional
        Keep passes in memory, holding at most this many bytes of tensors
        (:mod:`tdinspect.dumper.memory`), instead of writing them (``dump_dir``
        is then ``None``).
    """

    def __init__(
        self,
        dump_dir: str | os.PathLike | None,
        *,
        level: str,
        stats_only: bool = False,
        max_pending_bytes: int = 2 << 30,
        fsync: bool = False,
        background_write: bool | None = None,
        parallel: dict | None = None,
        dims: dict[str, str] | None = None,
        checksum: bool = False,
        overwrite: bool = False,
        checksum_dim: int | None = None,
        memory: int | None = None,
    ):
        if checksum_dim is not None and (
            not checksum or isinstance(checksum_dim, bool) or not isinstance(checksum_dim, int)
        ):
            raise ConfigError(
                f"checksum_dim={checksum_dim!r}: an int (the dim whose rows get a fingerprint each), "
                "with checksum=True"
            )
        self.checksum_dim = checksum_dim
        self.parallel = parallel_coords(parallel)
        self.dims = None
        if dims:
            from tdinspect.align.dims import DimsRules  # stdlib-only: checks the specs now

            self.dims = DimsRules(dims, what="capture(dims=...)")
        self.rank = current_rank(self.parallel)
        self.level = level
        self.stats_only = stats_only
        self.checksum = checksum
        self.total_entries = 0
        self.pass_index = 0
        self.observer = None  # sees every entry and pass end (live comparison)
        self._dropped_said = False
        self.folder = self.writer = self.run = self._release = None
        self._lock = threading.Lock()  # threads calling the model record one at a time
        self._threads: dict[threading.Thread, int] = {}  # 0, 1, ... in order of first record
        self._forked_from: int | None = None  # set in a child forked while capturing
        self._said: set[str] = set()
        self.memory = self.on_stop = None  # on_stop: closes the capture when memory runs out
        if memory is not None:
            self.pool = None
            self.writer = self.memory = MemoryStore(memory)
            self._new_pass()
            _LIVE.add(self)
            return
        if dump_dir is None:
            self._new_pass()
            return
        self.folder, self.run = new_run_folder(
            dump_dir, self.rank, overwrite=overwrite, world=grid_size(self.parallel)
        )
        # once closed (or dropped unclosed), an overwrite=True may replace its run
        self._release = weakref.finalize(self, release_run_folder, self.folder)
        self.pool = BufferPool(limit=min(max_pending_bytes, 1 << 30))
        self.writer = AsyncWriter(
            max_pending_bytes, fsync, on_written=self.pool.give, threaded=background_write
        )
        self._calls: dict[str, int] = {}
        self._new_pass()
        _LIVE.add(self)

    def _after_fork_in_child(self, parent: int) -> None:
        """A child forked while this capture ran records nothing (its writer thread, locks
        and files belong to the parent), and says so once, at its first record or step."""
        self._forked_from = parent
        self._lock = threading.Lock()
        self.writer = None

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._said:
            self._said.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _forked_note(self) -> None:
        self._say_once(
            "fork",
            f"tdinspect: this process (pid {os.getpid()}) was forked from pid "
            f"{self._forked_from} while it captured into {self.folder}; the "
            "child captures nothing (the parent's capture goes on). Start a "
            "capture in the child to record it.",
        )

    def _thread_number(self) -> int:
        thread = threading.current_thread()  # the object, not its ident: idents are reused
        n = self._threads.get(thread)
        if n is None:
            n = self._threads[thread] = len(self._threads)
            if n == 1:
                self._say_once(
                    "threads",
                    "tdinspect: a second thread "
                    f"({threading.current_thread().name}) records into this capture; "
                    "entries keep distinct names (call numbers in arrival order) and the "
                    "sidecar's thread column says which thread made each",
                )
        return n

    def _new_pass(self) -> None:
        self._pass = PendingPass(
            self.pass_index,
            self.folder,
            {
                "rank": self.rank,
                "pid": os.getpid(),
                "level": self.level,
                "stats_only": self.stats_only,
                **({"parallel": self.parallel} if self.parallel else {}),
            },
            columns={"module_type": [], "shape": [], "dtype": [], "stored": []},
        )
        self._in_flight = False
        self._calls = {}
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._pass.keys)

    def annotate(self, **fields: Any) -> None:
        """Add ``fields`` to the current pass's sidecar header."""
        self._pass.header.update(fields)

    def note_dropped(self, parts: dict[str, str]) -> None:
        """Parts of outputs that are neither tensors nor plain data (not stored): listed in
        the pass's sidecar (``dropped``: {label: type}) and said once per capture."""
        self._pass.header.setdefault("dropped", {}).update(parts)
        if not self._dropped_said:
            self._dropped_said = True
            label, kind = next(iter(parts.items()))
            warnings.warn(
                f"tdinspect: output parts that are neither tensors nor plain data are "
                f"not stored (first: {label}, a {kind}); the sidecar lists them "
                f"under 'dropped'",
                RuntimeWarning,
                stacklevel=4,
            )

    def next_call(self, site: str) -> int:
        """0-based call number of ``site`` (a module name, or module/op) in this pass."""
        with self._lock:
            n = self._calls.get(site, -1) + 1
            self._calls[site] = n
            return n

    def record(
        self,
        key: str,
        tensor: torch.Tensor | None,
        *,
        module_type: str,
        store: bool = True,
        same_stats_as: str | None = None,
        **extra: Any,
    ) -> torch.Tensor | None:
        """Add one entry; ``tensor`` is copied (or reduced to statistics) now.

        Returns the entry's statistics (on the tensor's device; ``None`` when
        none were computed: no dump, an uninitialised or unmeasurable tensor),
        whose NaN/Inf counts spare the health check a read of its own.

        ``store=False`` keeps only metadata (an uninitialised output, or a
        reference to a tensor already recorded). ``same_stats_as`` names an
        entry of this pass holding the same elements (a reshape or transpose
        of it): its statistics are reused. ``extra`` becomes sidecar columns
        (missing values are ``null``).
        """
        return self._locked(
            extra, lambda: self._record(key, tensor, module_type, store, same_stats_as, extra)
        )

    def _locked(self, extra: dict, add):
        """``add()`` under the lock, the recording thread's number in ``extra`` (a forked
        child records nothing)."""
        if self._forked_from is not None:
            return self._forked_note()
        with self._lock:
            thread = self._thread_number()
            if thread:
                extra["thread"] = thread
            return add()

    def _record(self, key, tensor, module_type, store, same_stats_as, extra) -> torch.Tensor | None:
        p = self._pass
        if self.dims is not None:
            extra["dims"] = self.dims.lookup(split_call(key)[0])
        measured = tensor is not None and self.writer is not None and not extra.get("uninitialized")
        if self.observer is not None:
            self.observer.entry(
                key,
                tensor,
                pass_=self.pass_index,
                module_type=module_type,
                uninitialized=bool(extra.get("uninitialized")),
                call_args=extra.get("call_args"),
            )
        shared = None
        if same_stats_as is not None and same_stats_as in self._index:
            shared = p.stats[self._index[same_stats_as]]
        plain = measured and is_plain(tensor)
        stat = digest = None
        if plain and shared is None:
            # statistics now, while the tensor is hot in cache (on CUDA: on the device, no sync);
            # the writer thread, the bottleneck when full tensors go to disk, only writes.
            # With checksums: the checksum stays on the device; one int64 goes to the host at step()
            if self.checksum:
                try:
                    stat, digest = stats_and_checksum(tensor)
                except ArithmeticError:  # values statistics cannot scale (subnormal float64)
                    stat, digest = safe_stats(tensor), tensor_checksum(tensor)
            else:
                stat = safe_stats(tensor)
        elif self.checksum and measured:
            digest = self._checksum(key, tensor)
        if self.checksum_dim is not None and plain:
            rows = row_checksums(tensor, self.checksum_dim)
            if rows is not None:  # the entry's index once appended (under the lock)
                p.row_checksums[len(p.keys)] = (self.checksum_dim % tensor.dim(), rows)
        if shared is not None:
            self._append(key, tensor, None, shared, module_type, extra, digest)
            return shared
        if measured and not plain:
            return self._record_kind(key, tensor, module_type, store, extra, digest)
        copy = self._host_copy(key, tensor) if measured and store and not self.stats_only else None
        self._append(key, tensor, copy, stat, module_type, extra, digest)
        return stat

    def _checksum(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The fingerprint of a tensor of any kind (computed from a copy where it must be: the
        model's tensor is never changed), or ``None`` with a warning naming the entry (a meta
        tensor holds no data): the forward goes on and the pass is written, the entry's
        ``checksum`` null (``metric="equal"`` sets it aside, never calls it equal)."""
        try:
            return tensor_checksum(tensor)
        except Exception as exc:  # noqa: BLE001 - the model's forward must go on
            why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            self._say_once(
                f"checksum {split_call(key)[0]}",
                f"tdinspect: {key} has no checksum ({type(tensor).__name__}: {why}); its sidecar "
                "checksum is null, and metric='equal' sets it aside",
            )
            return None

    def _host_copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.memory is not None:
            self._check_memory(key, tensor.numel() * tensor.element_size())
        copy, in_flight = host_copy(tensor, self.pool)
        self._in_flight |= in_flight
        self._pass.nbytes += copy.numel() * copy.element_size()
        return copy

    def record_measured(
        self, key: str, tensor: torch.Tensor | None, measured, *, module_type: str, **extra: Any
    ) -> torch.Tensor | None:
        """Add one entry whose statistics were computed already: by a compiled graph
        (:class:`tdinspect.dumper.compiled.Measured`: ``shape``, ``dtype`` and ``row``).

        ``tensor`` is copied as :meth:`record` copies it, or ``None`` with statistics only.
        Only for a capture without live comparison, checksums or row checksums (those
        read the tensor: :meth:`record`). Returns the statistics row.
        """
        if tensor is not None and not is_plain(tensor):
            return self.record(key, tensor, module_type=module_type, **extra)
        return self._locked(extra, lambda: self._record_measured(key, tensor, measured, module_type, extra))

    def _record_measured(self, key, tensor, measured, module_type, extra) -> torch.Tensor | None:
        if self.dims is not None:
            extra["dims"] = self.dims.lookup(split_call(key)[0])
        keep = tensor is not None and self.writer is not None and not self.stats_only
        copy = self._host_copy(key, tensor) if keep else None
        row = measured.row if self.writer is not None else None
        self._append(
            key, tensor, copy, row, module_type, extra, shape=list(measured.shape), dtype=measured.dtype
        )
        return row

    def _record_kind(self, key, tensor, module_type, store, extra, digest) -> torch.Tensor | None:
        """A sparse, quantized, nested, expanded, subclass, meta or fake tensor (see
        :mod:`tdinspect.dumper.kinds`): stored in its own form, or skipped with the reason."""
        prep = prepare(tensor)
        copy = None
        if prep.data is not None and store and not self.stats_only:
            try:
                if is_plain(prep.data):
                    copy, in_flight = host_copy(prep.data, self.pool)
                    self._in_flight |= in_flight
                else:
                    copy = prep.data.clone().cpu()
                self._pass.nbytes += copy.numel() * copy.element_size()
            except Exception as exc:  # noqa: BLE001 - the model's forward must go on
                prep.skipped = f"copy failed ({type(exc).__name__}: {exc})"[:300]
            if copy is not None and self.memory is not None:
                self._pass.nbytes -= copy.numel() * copy.element_size()
                self._check_memory(key, copy.numel() * copy.element_size())
                self._pass.nbytes += copy.numel() * copy.element_size()
        if prep.storage:
            extra["storage"] = prep.storage
        if prep.skipped:
            extra["skipped"] = prep.skipped
            self._say_once(
                f"skipped {prep.skipped}",
                f"tdinspect: {key} not stored: {prep.skipped} (the sidecar says so)",
            )
        self._append(
            key, None, copy, prep.stats, module_type, extra, digest, shape=prep.shape, dtype=prep.dtype
        )
        return prep.stats

    def _check_memory(self, key: str, nbytes: int) -> None:
        """A capture to memory that ``nbytes`` more would take past its limit: drop the pass in
        progress, close the capture (``on_stop``), raise
        :class:`~tdinspect.errors.CaptureMemoryError` naming the limit and ``key``."""
        try:
            self.memory.check(key, self.pass_index, self._pass.nbytes, nbytes)
        except BaseException:
            self._new_pass()  # nothing half-kept: the pass in progress goes
            if self.on_stop is not None:
                self.on_stop()
            raise

    def record_unchanged(
        self, key: str, tensor: torch.Tensor, facts: tuple, *, of_pass: int, module_type: str, **extra: Any
    ) -> None:
        """Add an entry whose tensor is the one stored under ``key`` in pass ``of_pass``.

        Nothing is copied and nothing computed: ``facts`` (the statistics and
        checksum recorded then, from :meth:`facts`) are reused, and the
        sidecar holds a reference ``{"kind": "same", "of": key, "pass": of_pass}``.
        """
        if self._forked_from is not None:
            return self._forked_note()
        ref = {"kind": "same", "of": key, "pass": of_pass}
        with self._lock:
            if self.observer is not None:
                self.observer.entry(key, tensor, pass_=self.pass_index, module_type=module_type, ref=ref)
            self._append(key, tensor, None, facts[0], module_type, {**extra, "ref": ref}, facts[1])

    def facts(self, key: str) -> tuple:
        """``(statistics, checksum)`` of ``key`` in the current pass (device tensors or ``None``)."""
        i = self._index.get(key)
        return (None, None) if i is None else (self._pass.stats[i], self._pass.checksums[i])

    def _append(
        self, key, tensor, copy, stat, module_type, extra, digest=None, *, shape=None, dtype=None
    ) -> None:
        p = self._pass
        if key in self._index:  # never lose an entry to a name recorded twice: next free call
            base, call = split_call(key)
            while key in self._index:
                call += 1
                key = make_key(base, call)
            self._say_once(
                "dup",
                f"tdinspect: an entry was recorded twice under one name; the second is stored as {key!r}",
            )
        p.checksums.append(digest)
        if tensor is not None:
            shape, dtype = shape_of(tensor), str(tensor.dtype)
        n = len(p.keys)
        self._index[key] = n
        p.keys.append(key)
        p.tensors.append(copy)
        p.stats.append(stat)
        cols = p.columns
        cols["module_type"].append(module_type)
        cols["shape"].append(shape)
        cols["dtype"].append(dtype)
        cols["stored"].append(copy is not None)
        for name, value in extra.items():
            cols.setdefault(name, [None] * n).append(value)
        for values in cols.values():
            if len(values) == n:
                values.append(None)

    def step(self, failed: str | None = None, tokens: TokenLayout | None = None) -> Path | None:
        """End the pass: hand it to the writer (empty or not); returns its file's path.

        ``failed`` marks a pass cut short by an error (the sidecar's ``failed``
        field holds it): it holds what ran before the error. ``tokens`` (a
        :class:`~tdinspect.store.tokenlayout.TokenLayout`) is written as its ``tokens`` field.
        """
        if tokens is not None and not isinstance(tokens, TokenLayout):
            raise TypeError(f"step(tokens={tokens!r}): expected tdinspect.tokens(...)")
        if self._forked_from is not None:
            self._forked_note()
            return None
        with self._lock:
            if tokens is not None:
                self._check_tokens(tokens)
            return self._step(failed, tokens)

    def _check_tokens(self, tokens: TokenLayout) -> None:
        """A layout the reader would refuse (:func:`~tdinspect.store.tokenlayout.check_layout`,
        its own check), or one no entry of the pass fits, is refused before the pass is
        written (the pass stays open: call ``step`` again with the right one)."""
        check_layout(tokens.shape, tokens.segments, "step(tokens=...)")
        k = len(tokens.shape)
        shapes = [s for s in self._pass.columns["shape"] if s is not None]
        if shapes and not any(list(s[:k]) == list(tokens.shape) for s in shapes):
            seen = sorted({str(list(s)) for s in shapes})[:4]
            raise TokenLayoutError(
                f"step(tokens=...): its shape {list(tokens.shape)} ({tokens.rows} token rows) leads no "
                f"entry of pass {self.pass_index} (shapes {', '.join(seen)}, ...): give the leading dims "
                "of the pass's token-major tensors, e.g. shape=(1, T) for [1, T, hidden]"
            )

    def _step(self, failed: str | None, tokens: TokenLayout | None = None) -> Path | None:
        p = self._pass
        if tokens is not None:
            p.header = {**p.header, "tokens": tokens.to_json()}
        if self.observer is not None:
            self.observer.end_pass(self.pass_index)
        if self.writer is None:
            self.total_entries += len(p.keys)
            self.pass_index += 1
            self._new_pass()
            return None
        if failed:
            p.header = {**p.header, "failed": failed}
        if self.checksum_dim is not None and p.keys and not p.row_checksums:
            ranks = [len(s) for s in p.columns["shape"] if isinstance(s, list)]
            d = self.checksum_dim
            having = sum(-r <= d < r for r in ranks)
            self._say_once(
                "checksum_dim",
                f"tdinspect: checksum_dim={d}: pass {self.pass_index} has {having} "
                f"entr{'y' if having == 1 else 'ies'} with that dim, none of them a plain tensor (an "
                "expanded view, sparse, quantized, nested...): per-row fingerprints are taken of plain "
                "tensors only, so none was written"
                if having
                else f"tdinspect: checksum_dim={d}: no entry of pass {self.pass_index} has that "
                f"dim (they have {max(ranks, default=0)} dims at most), so no per-row fingerprints were "
                "written; give the batch dim of the outputs, e.g. checksum_dim=0",
            )
        p.host_stats = self._gathered([s if s is None else s.to(torch.float64) for s in p.stats])
        p.host_checksums = self._gathered(p.checksums)
        p.host_row_checksums = self._gathered([r for _, r in p.row_checksums.values()], torch.cat)
        if self._in_flight:
            p.ready = torch.cuda.Event()
            p.ready.record()
        path = (
            None
            if self.folder is None
            else self.folder / (sidecar_filename if self.stats_only else pass_filename)(self.pass_index)
        )
        try:
            self.writer.submit(p)
        finally:  # even when interrupted (Ctrl-C in an inline write): the next pass starts clean
            self.total_entries += len(p.keys)
            self.pass_index += 1
            self._new_pass()
        return path

    def _gathered(self, values: list, join=torch.stack) -> torch.Tensor | None:
        """The non-``None`` per-entry values stacked (or ``join``ed) into one host tensor
        (``None`` if none): one copy per pass, asynchronous from CUDA (``_in_flight``)."""
        present = [v for v in values if v is not None]
        if not present:
            return None
        stacked = join(present)
        if stacked.device.type != "cuda":
            return stacked.cpu()
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        self._in_flight = True
        return host

    def close(self, write_pending: bool = True, failed: str | None = None) -> None:
        """Write a pending non-empty pass (if asked; ``failed`` marks it cut short by that
        error), wait for the writer, stop it."""
        if self._forked_from is not None:
            return  # the writer is the parent's
        try:
            if write_pending and len(self):
                self.step(failed)
        finally:
            try:
                if self.writer is not None:
                    self.writer.close()
            finally:
                if self._release is not None:
                    self._release()  # closed: an overwrite=True may now replace its run
        if write_pending and self.observer is not None:
            self.observer.finish()  # the run is over: what it never reached (live comparison)

    def warn_if_empty(self, what: str) -> None:
        if not len(self):
            warnings.warn(
                f"tdinspect: pass {self.pass_index} captured nothing: {what}", RuntimeWarning, stacklevel=3
            )
