"""DumpSet: a dump (many ranks, many passes) as an xarray cube ``op × call × pass``.

.. warning::
   ``call`` is 0-based: the bare key (``model.expert``) is call 0 and
   ``model.expert::call2`` is call 2. ``pass`` is the step number
   (``pass00003.pt`` is pass 3). ``order`` is the position of an entry inside
   its pass: the true execution order, since calls of different ops
   interleave. Combinations that never ran are NaN, not errors.

Examples
--------
>>> ds = DumpSet.open("sample_dumps/float32")                 # doctest: +SKIP
>>> ds.to_xarray()["absmax"].sel(op="model.lm_head")          # doctest: +SKIP
>>> ds.tensor("model.expert", call=2, pass_=0)                # doctest: +SKIP
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from tdinspect.compare.cube import call_axis
from tdinspect.errors import DumpFormatError, RunsNote
from tdinspect.naming import parse_key, split_call, split_module_path
from tdinspect.numerics.stats import STAT_NAMES
from tdinspect.report import human_bytes
from tdinspect.store.format import vanished
from tdinspect.store.passindex import PassIndex
from tdinspect.store.runs import list_runs, select_run
from tdinspect.util.parallel import map_in_waves
from tdinspect.util.terminal import warn

if TYPE_CHECKING:
    import xarray as xr

    from tdinspect.compare.diff import Diff


def _stats_of(pi: PassIndex) -> np.ndarray:
    return pi.ensure_stats()


class DumpSet:
    """One dump: its passes indexed, its tensors on disk until asked for.

    Build with :meth:`open`. Select with :meth:`sel` and :meth:`filter`,
    compare with :meth:`diff`.

    Attributes
    ----------
    path : Path
        What was opened.
    """

    def __init__(
        self,
        path: Path,
        passes: dict[tuple[int, int], PassIndex],
        *,
        op_pattern: re.Pattern | None = None,
        client: Any = None,
        skipped=(),
    ):
        self.path = Path(path)
        self._passes = dict(sorted(passes.items(), key=lambda kv: (kv[0][1], kv[0][0])))
        self._ranks: tuple[int, ...] | None = None  # the passes never change: computed once
        self._pass_numbers: tuple[int, ...] | None = None
        self._op_pattern = op_pattern
        self.client = client
        self.skipped = list(skipped)
        self.run = None  # the Run opened (tdinspect.store.runs.Run), set by open()
        self._cube: xr.Dataset | None = None

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def coerce(cls, source: DumpSet | str | os.PathLike, *, client: Any = None) -> DumpSet:
        """``source`` itself when it is a DumpSet, else :meth:`open` of that path.

        Examples
        --------
        >>> ds = DumpSet.coerce("dumps/run_a")                      # doctest: +SKIP
        >>> DumpSet.coerce(ds) is ds                                 # doctest: +SKIP
        True
        """
        if isinstance(source, cls):
            return source
        return cls.open(os.fspath(source), client=client)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        run: int | str | None = None,
        on_error: str = "raise",
        client: Any = None,
        dims: dict[str, str] | None = None,
    ) -> DumpSet:
        """Open a dump folder, a rank folder, or one pass file; reads metadata only.

        Parameters
        ----------
        path : str or Path
        run : int or str, optional
            Which run of a folder holding several (a capture never merges into an
            earlier one; see :mod:`tdinspect.store.runs`): the newest by default, with a
            one-line :class:`~tdinspect.store.runs.RunWarning` saying so; ``-2`` the one
            before, ``0`` the oldest, or a run id or rank folder name.
            :meth:`runs` lists them.
        on_error : {"raise", "warn"}
            What to do with a pass that cannot be read: stop with an error
            naming the file, or skip it with a warning (listed in ``skipped``).
        client : dask.distributed.Client, optional
            Run per-pass work (statistics, diffs) on this cluster.
        dims : dict, optional
            ``{regex: dims spec}`` (``"b s h(tp)"``, :mod:`tdinspect.align.dims`)
            for entries whose name matches; they override dims recorded at
            capture (dumps written by other tools have none).

        Raises
        ------
        DumpFormatError
            For a missing or empty path, a folder that is not a dump, two
            folders of one rank, or (``on_error="raise"``) a damaged pass.

        Examples
        --------
        >>> ds = DumpSet.open("sample_dumps/float32")   # doctest: +SKIP
        >>> ds.ops[:2]                                  # doctest: +SKIP
        ['model.embed', 'model.layers.0.ln1']
        """
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error={on_error!r}: expected 'raise' or 'warn'")
        rules = None
        if dims:
            from tdinspect.align.dims import DimsRules

            rules = DimsRules(dims, what="DumpSet.open(dims=...)")
        chosen, runs = select_run(path, run)
        if run is None and len(runs) > 1:
            warn(
                f"tdinspect: {path} holds {len(runs)} runs; opened the newest, "
                f"{chosen.describe()} (run=-2 opens the one before; DumpSet.runs(path) "
                "lists them)",
                RunsNote,
                stacklevel=2,
            )
        folders = chosen.folders
        passes: dict[tuple[int, int], PassIndex] = {}
        skipped = []
        for folder in folders:
            for idx, files in folder.passes.items():
                try:
                    try:
                        pi = PassIndex.read(folder.rank, files)
                    except FileNotFoundError as exc:  # removed after the folder was listed
                        raise DumpFormatError(vanished(exc.filename or folder.path)) from None
                except DumpFormatError as exc:
                    # a sidecar alone that does not read is not a pass being written (sidecars
                    # appear whole, by a rename): a damaged or edited statistics-only pass
                    if on_error == "raise":
                        raise
                    skipped.append(str(exc))
                    warn(f"skipping unreadable pass: {exc}", RuntimeWarning, stacklevel=2)
                    continue
                if files.tensors is None and not pi.stats_only:
                    continue  # sidecar written, pass file not yet: a pass in progress
                if rules is not None:
                    pi.dims = [rules.lookup(split_call(k)[0]) or d for k, d in zip(pi.keys, pi.dims)]
                passes[(folder.rank, idx)] = pi
        if not passes:
            raise DumpFormatError(
                f"{path}: no readable pass" + (f" ({len(skipped)} skipped)" if skipped else "")
            )
        ds = cls(Path(path), passes, client=client, skipped=skipped)
        ds.run = chosen
        return ds

    @classmethod
    def from_memory(cls, passes: Iterable[dict], *, client: Any = None) -> DumpSet:
        """A dump held in memory: what ``capture(..., memory=True)`` kept (``cap.dumpset``).

        Parameters
        ----------
        passes : iterable of dict
            One plain dict per pass, as a memory capture hands them (``cap.passes``):
            ``{"rank": int, "pass": int, "meta": facts of its sidecar, "tensors": {key: tensor}}``.
            Passes of several captures (one per rank) make one DumpSet of several ranks.

        Raises
        ------
        DumpFormatError
            When no pass is given, or two have the same rank and number.

        Examples
        --------
        >>> with tdinspect.capture(model, memory=True) as cap:       # doctest: +SKIP
        ...     model(x); cap.step()
        >>> ds = DumpSet.from_memory(cap.passes)                     # doctest: +SKIP
        >>> ds.diff("dumps/run_a").first_divergence()                 # doctest: +SKIP
        """
        from tdinspect.store.format import sidecar_in_memory
        from tdinspect.store.memorypass import WHERE, MemoryPass

        held: dict[tuple[int, int], MemoryPass] = {}
        by_rank: dict[int, dict[int, MemoryPass]] = {}
        for item in sorted(passes, key=lambda p: (p["rank"], p["pass"])):
            rank, index = int(item["rank"]), int(item["pass"])
            where = f"{WHERE}/rank{rank}/pass{index}"
            if (rank, index) in held:
                raise DumpFormatError(f"{where}: two passes of rank {rank} numbered {index}")
            earlier = by_rank.setdefault(rank, {})
            pi = MemoryPass.held(rank, sidecar_in_memory(item["meta"], where), item["tensors"], earlier)
            held[(rank, index)] = earlier[index] = pi
        if not held:
            raise DumpFormatError(f"{WHERE}: no pass held (was step() called inside the capture?)")
        return cls(Path(WHERE), held, client=client)

    @staticmethod
    def runs(path: str | os.PathLike) -> list:
        """The runs a dump folder holds, oldest first (:func:`tdinspect.store.runs.list_runs`).

        Examples
        --------
        >>> [r.describe() for r in DumpSet.runs("dumps/run_a")]   # doctest: +SKIP
        ['rank0_pid1 (started 2026-11-30 17:31:02, 2 passes)', 'rank0_pid1_run2 (...)']
        """
        return list_runs(path)

    # -- what is in it -------------------------------------------------------------------
    def _keep(self, key: str) -> bool:
        return self._op_pattern is None or bool(self._op_pattern.search(split_call(key)[0]))

    def keeps(self, key: str) -> bool:
        """Whether entry ``key`` (with or without ``::callN``) is in this DumpSet's selection
        (:meth:`filter`, :meth:`sel` by op); every entry of an unfiltered one is."""
        return self._keep(key)

    @property
    def op_pattern(self) -> re.Pattern | None:
        """The pattern an entry name must ``search``-match to be kept (``None``: every entry)."""
        return self._op_pattern

    @property
    def pass_map(self) -> MappingProxyType[tuple[int, int], PassIndex]:
        """``(rank, pass) -> PassIndex`` of the indexed passes, ordered by (pass, rank); read-only.

        Examples
        --------
        >>> DumpSet.open("dumps/run_a").pass_map.get((0, 3))   # doctest: +SKIP
        """
        return MappingProxyType(self._passes)

    def pass_indexes(self) -> list[PassIndex]:
        """The indexed passes, ordered by (pass, rank)."""
        return list(self._passes.values())

    def get_pass(self, pass_: int, rank: int | None = None) -> PassIndex:
        rank = self.ranks[0] if rank is None else rank
        try:
            return self._passes[(rank, pass_)]
        except KeyError:
            raise KeyError(
                f"{self.path}: no pass {pass_} for rank {rank} (passes: {self.passes}, ranks: {self.ranks})"
            ) from None

    @property
    def ranks(self) -> list[int]:
        """Ranks present, sorted (a new list; computed once: a diff of 8,000 passes rebuilt it
        64,004 times, 33 s of its time)."""
        if self._ranks is None:
            self._ranks = tuple(sorted({r for r, _ in self._passes}))
        return list(self._ranks)

    @property
    def passes(self) -> list[int]:
        """Pass numbers present, sorted (a new list; computed once, as :attr:`ranks`)."""
        if self._pass_numbers is None:
            self._pass_numbers = tuple(sorted({p for _, p in self._passes}))
        return list(self._pass_numbers)

    @property
    def ops(self) -> list[str]:
        """Entry names (keys without ``::callN``) in execution order of first appearance."""
        seen: dict[str, None] = {}
        for pi in self._passes.values():
            for key in pi.keys:
                base = split_call(key)[0]
                if base not in seen and self._keep(key):
                    seen[base] = None
        return list(seen)

    @property
    def level(self) -> str:
        """``"module"`` or ``"op"`` (``"mixed"`` if passes differ)."""
        levels = {pi.level for pi in self._passes.values()}
        return levels.pop() if len(levels) == 1 else "mixed"

    @property
    def stats_only(self) -> bool:
        """Whether any pass holds statistics without tensors."""
        return any(pi.stats_only for pi in self._passes.values())

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the dump describes (stored entries)."""
        total = 0
        for pi in self._passes.values():
            for shape, dtype, stored in zip(pi.shape, pi.dtype, pi.stored):
                if stored and shape is not None and dtype:
                    total += int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
        return total

    def n_entries(self) -> int:
        return sum(sum(1 for k in pi.keys if self._keep(k)) for pi in self._passes.values())

    # -- tensors --------------------------------------------------------------------------
    def tensor(self, op: str, call: int = 0, pass_: int = 0, rank: int | None = None):
        """The tensor of one entry, read lazily (memory-mapped) from its pass file.

        Parameters
        ----------
        op : str
            The entry name without ``::callN`` (``"model.layers.0.attn"``);
            a full key with ``::callN`` also works.
        call : int
            0-based call number.
        pass_ : int
            Pass (step) number.
        rank : int, optional
            Needed when the dump has several ranks.
        """
        base, key_call = split_call(op)
        call = key_call or call
        key = base if call == 0 else f"{base}::call{call}"
        if rank is None and len(self.ranks) > 1:
            raise ValueError(f"{self.path} has ranks {self.ranks}: pass rank=")
        pi = self.get_pass(pass_, rank)
        if key not in pi.position:
            raise KeyError(_no_entry(self.path, key, pass_, self.ops))
        return pi.tensor(key)

    # -- selection -----------------------------------------------------------------------
    def sel(
        self,
        *,
        op: str | Iterable[str] | None = None,
        pass_: int | Iterable[int] | None = None,
        rank: int | Iterable[int] | None = None,
    ) -> DumpSet:
        """A smaller DumpSet: some ops (exact names, without ``::callN``), passes and/or ranks.

        Raises
        ------
        KeyError
            When a name in ``op`` is not an entry of the passes kept (naming it, with the
            closest names), or no pass is kept, as xarray's ``sel`` does.

        Examples
        --------
        >>> DumpSet.open("dumps/run_a").sel(op="model.lm_head", pass_=[0, 1])   # doctest: +SKIP
        """

        def as_set(v):
            return None if v is None else ({v} if isinstance(v, (int, str)) else set(v))

        ops, ps, rs = as_set(op), as_set(pass_), as_set(rank)
        passes = {
            k: v for k, v in self._passes.items() if (ps is None or k[1] in ps) and (rs is None or k[0] in rs)
        }
        if not passes:
            raise KeyError(
                f"{self.path}: selection matches no pass (passes {self.passes}, ranks {self.ranks})"
            )
        pattern = self._op_pattern
        if ops is not None:
            held = set(_names(passes, pattern))
            missing = [o for o in ops if o not in held]
            if missing:  # as xarray's sel: a label that is not there is an error, never "nothing"
                raise KeyError(_no_name(self.path, missing, list(_names(passes, pattern))))
            pattern = re.compile("^(?:" + "|".join(re.escape(o) for o in ops) + r")\Z")
            if self._op_pattern is not None:
                pattern = _both(self._op_pattern, pattern)
        return self._derived(passes, pattern)

    def filter(self, regex: str) -> DumpSet:
        """A DumpSet keeping entries whose name ``re.search``-matches ``regex``.

        Raises
        ------
        ValueError
            When ``regex`` is not a regular expression.
        KeyError
            When it matches no entry of this DumpSet (a typo compared nothing, and
            "nothing diverged" must never be read off an empty selection).

        Examples
        --------
        >>> DumpSet.open("dumps/run_a").filter("layers[.]0[.]").ops[:1]   # doctest: +SKIP
        ['model.layers.0.ln1']
        """
        try:
            pattern = re.compile(regex)
        except re.error as exc:
            raise ValueError(f"invalid regex {regex!r}: {exc}") from None
        if self._op_pattern is not None:
            pattern = _both(self._op_pattern, pattern)
        if next(_names(self._passes, pattern), None) is None:
            shown = self.ops
            held = (
                f"{', '.join(map(repr, shown[:5]))}{', ...' if len(shown) > 5 else ''}" if shown else "none"
            )
            raise KeyError(f"{self.path}: filter {regex!r} matches no entry (entries: {held})")
        return self._derived(self._passes, pattern)

    def _derived(self, passes, pattern) -> DumpSet:
        ds = DumpSet(self.path, passes, op_pattern=pattern, client=self.client)
        ds.run = self.run
        return ds

    # -- the cube -----------------------------------------------------------------------
    def ensure_stats(self, progress: bool | None = None) -> None:
        """Compute statistics for passes without sidecars (a progress bar: see :mod:`tdinspect.util.progress`)."""
        todo = [pi for pi in self._passes.values() if pi.stats is None]
        if not todo:
            return
        from tdinspect.util.progress import bar

        results = map_in_waves(_stats_of, todo, client=self.client)
        for pi, stats in bar(zip(todo, results), progress, total=len(todo), desc="statistics"):
            pi.stats = stats

    def entries(self, progress: bool | None = None):
        """A long-format ``pandas.DataFrame``: one row per entry of every pass."""
        import pandas as pd

        self.ensure_stats(progress)
        rows = []
        for (rank, p), pi in self._passes.items():
            for i, key in enumerate(pi.keys):
                if not self._keep(key):
                    continue
                base, call = split_call(key)
                rows.append(
                    (
                        rank,
                        p,
                        base,
                        call,
                        i,
                        key,
                        pi.dtype[i],
                        _shape_str(pi.shape[i]),
                        pi.module_type[i],
                        *pi.stats[i].tolist(),
                    )
                )
        return pd.DataFrame(
            rows,
            columns=[
                "rank",
                "pass",
                "op",
                "call",
                "order",
                "key",
                "dtype",
                "shape",
                "module_type",
                *STAT_NAMES,
            ],
        )

    def to_xarray(self, progress: bool | None = None) -> xr.Dataset:
        """The cube: dims ``op``, ``call``, ``pass`` (and ``rank`` when several).

        Variables are the statistics of :mod:`tdinspect.numerics.stats` and ``order``;
        coordinates along ``op`` are parsed from the names (``module``,
        ``aten``, ``stack``, ``layer``, ``leaf``, ``module_type``, ``level``,
        ``dtype``, ``shape``).
        """
        if self._cube is None:
            self.ensure_stats(progress)
            self._cube = self._build_cube()
        return self._cube

    def _build_cube(self) -> xr.Dataset:
        ops = self.ops
        op_ix = {o: i for i, o in enumerate(ops)}
        ranks, passes = self.ranks, self.passes
        r_ix = {r: i for i, r in enumerate(ranks)}
        p_ix = {p: i for i, p in enumerate(passes)}
        first: dict[str, tuple] = {}
        idx, rows, orders = [], [], []
        for (rank, p), pi in self._passes.items():
            for i, key in enumerate(pi.keys):
                base, call = split_call(key)
                j = op_ix.get(base)
                if j is None or not self._keep(key):
                    continue
                idx.append((r_ix[rank], j, call, p_ix[p]))
                rows.append(i)
                orders.append(pi)
                first.setdefault(base, (pi, i))
        calls, call_ix = call_axis([c for _, _, c, _ in idx])
        shape = (len(ranks), len(ops), len(calls), len(passes))
        data = np.full((len(STAT_NAMES) + 1,) + shape, np.nan)
        if idx:
            ix = tuple(np.asarray(idx).T)
            ix = ix[:2] + (call_ix,) + ix[3:]
            stats = np.stack([pi.stats[i] for pi, i in zip(orders, rows)])
            data[(slice(None, len(STAT_NAMES)),) + ix] = stats.T
            data[(len(STAT_NAMES),) + ix] = np.asarray(rows, dtype=np.float64)
        dims = ("rank", "op", "call", "pass")
        variables = {name: (dims, data[k]) for k, name in enumerate(STAT_NAMES)}
        variables["order"] = (dims, data[len(STAT_NAMES)])
        coords = {"rank": ranks, "op": ops, "call": calls, "pass": passes}
        coords.update(_op_coords(ops, first))
        import xarray as xr  # lazily: the CLI's answers need no cube (0.26 s)

        ds = xr.Dataset(
            variables,
            coords=coords,
            attrs={"path": str(self.path), "level": self.level, "stats_only": int(self.stats_only)},
        )
        return ds.isel(rank=0, drop=True) if len(ranks) == 1 else ds

    # -- lining up ----------------------------------------------------------------------
    def unshard(self) -> DumpSet:
        """A logical dump without the rank dim: sharded tensors reassembled when read.

        Uses each rank's recorded parallel coordinates and each entry's dims
        (``capture(..., dims=...)`` or ``DumpSet.open(..., dims=...)``); entries
        without dims must be identical on every rank. See
        :mod:`tdinspect.align.unshard`.

        Examples
        --------
        >>> DumpSet.open("dumps/tp2").unshard().ranks      # doctest: +SKIP
        [0]
        """
        from tdinspect.align.unshard import unshard

        return self._derived(unshard(self._passes, self.path, stats_only=self.stats_only), self._op_pattern)

    def concat(self, over: str = "call", dim: int | str = 1) -> DumpSet:
        """A logical dump whose entries are put end to end over calls or passes along ``dim``.

        A decode run (a prefill call, then one call per token; or a pass per
        token) then compares with one full-sequence forward of the same
        tokens. ``dim`` is an int or a name in the entries' dims. See
        :mod:`tdinspect.align.concat`.

        Examples
        --------
        >>> DumpSet.open("dumps/generate").concat("call", dim=1)     # doctest: +SKIP
        """
        from tdinspect.align.concat import concat

        return self._derived(concat(self._passes, over, dim, where=self.path), self._op_pattern)

    def narrow(self, dim: int | str, start: int, length: int) -> DumpSet:
        """A logical dump keeping ``length`` positions from ``start`` along ``dim`` of each entry.

        Examples
        --------
        >>> DumpSet.open("dumps/forward").narrow(1, 0, 20)           # doctest: +SKIP
        """
        from tdinspect.align.concat import narrow

        return self._derived(narrow(self._passes, dim, start, length), self._op_pattern)

    # -- comparing ------------------------------------------------------------------------
    def diff(self, other: DumpSet | str | os.PathLike, *, tokens: bool = False, **kwargs) -> Diff:
        """Compare against ``other``; this DumpSet is the reference (``y``).

        See :class:`tdinspect.compare.diff.Diff` for the keyword arguments; ``baseline``
        (a run of the trusted implementation in B's precision: an error budget) may be a
        DumpSet or a path. ``tokens=True`` (or a spec's ``tokens``) lines the runs up token by
        token, by (request, position), whatever their packing, padding or passes
        (:class:`tdinspect.compare.tokens.TokenDiff`; both sides need ``dump.step(tokens=...)``).

        Examples
        --------
        >>> div = DumpSet.open("a").diff("b").first_divergence()   # doctest: +SKIP
        >>> DumpSet.open("ref64").diff("port32", baseline="ref32").verdict()  # doctest: +SKIP
        >>> DumpSet.open("hf").diff("engine", tokens=True).first_divergence()   # doctest: +SKIP
        """
        other = DumpSet.coerce(other, client=self.client)
        spec = kwargs.get("spec")
        if tokens or getattr(spec, "tokens", False) or (isinstance(spec, dict) and spec.get("tokens")):
            from tdinspect.compare.tokens import TokenDiff

            return TokenDiff(self, other, **kwargs)
        from tdinspect.compare.diff import Diff

        return Diff(self, other, **kwargs)  # a baseline path is opened there, with A's client

    def first_nonfinite(self):
        """The first output holding NaN or Inf, in (pass, execution order), or ``None``.

        Read from the statistics (computed for passes without sidecars); at op
        level says whether the op's recorded inputs already held NaN/Inf. See
        :mod:`tdinspect.compare.health`.

        Examples
        --------
        >>> DumpSet.open("dumps/run_a").first_nonfinite()     # doctest: +SKIP
        NonFinite(model.layers.1.mlp.down (call 0, pass 2): 3 NaN and 0 Inf of 2048 elements)
        """
        from tdinspect.compare.health import first_nonfinite

        return first_nonfinite(self)

    def not_stored(self) -> list[tuple[int, int, str, str]]:
        """``(rank, pass, key, reason)`` of every tensor capture could not store (a meta or
        fake tensor, a wrapper subclass...): recorded with its shape and dtype only.

        Examples
        --------
        >>> DumpSet.open("dumps/run_a").not_stored()     # doctest: +SKIP
        [(0, 0, 'model.meta_head', 'meta tensor: no data')]
        """
        return [
            (rank, p, key, reason)
            for (rank, p), pi in self._passes.items()
            for key, reason in zip(pi.keys, pi.skipped or ())
            if isinstance(reason, str) and self._keep(key)
        ]

    # -- display --------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        calls = max((split_call(k)[1] for pi in self._passes.values() for k in pi.keys), default=0)
        return {
            "path": str(self.path),
            "level": self.level,
            "ops": len(self.ops),
            "max_calls": calls + 1,
            "passes": len(self.passes),
            "ranks": self.ranks,
            "entries": self.n_entries(),
            "bytes": self.nbytes,
            "stats_only": self.stats_only,
            "skipped": len(self.skipped),
            "failed": [pi.index for pi in self._passes.values() if pi.failed],
            "not_stored": len(self.not_stored()),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"DumpSet({s['path']!r}: {s['level']} level, {s['ops']} ops x up to "
            f"{s['max_calls']} calls x {s['passes']} passes, ranks {s['ranks']}, "
            f"{s['entries']} entries, {human_bytes(s['bytes'])}"
            + (", statistics only" if s["stats_only"] else "")
            + (f", {s['skipped']} passes skipped" if s["skipped"] else "")
            + (f", passes {s['failed']} cut short by an error" if s["failed"] else "")
            + (f", {s['not_stored']} tensors not stored (ds.not_stored())" if s["not_stored"] else "")
            + ")"
        )

    def _repr_html_(self) -> str:
        from tdinspect.report import dumpset_html

        return dumpset_html(self)


def _no_entry(path, key: str, pass_: int, ops: list[str]) -> str:
    """The message for an unknown entry, with the closest names (difflib)."""
    import difflib

    base = split_call(key)[0]
    close = (
        difflib.get_close_matches(base, ops, n=3, cutoff=0.5)
        or [o for o in ops if base.lower() in o.lower()][:3]
    )
    hint = (
        f"; did you mean {', '.join(map(repr, close))}?"
        if close
        else (f"; entries: {', '.join(map(repr, ops[:5]))}{', ...' if len(ops) > 5 else ''}")
    )
    if base in ops:
        hint = f" ({base!r} exists, but not this call in this pass)"
    return f"{path}: no entry {key!r} in pass {pass_}{hint}"


def _names(passes, pattern: re.Pattern | None):
    """The entry names (without ``::callN``) of ``passes`` that ``pattern`` keeps, each once."""
    seen: set[str] = set()
    for pi in passes.values():
        for key in pi.keys:
            base = split_call(key)[0]
            if base not in seen and (pattern is None or pattern.search(base)):
                seen.add(base)
                yield base


def _no_name(path, missing: list[str], ops: list[str]) -> str:
    """The message for names ``sel(op=...)`` does not find, with the closest ones (difflib)."""
    import difflib

    said = []
    for name in missing:
        base = split_call(name)[0]
        close = difflib.get_close_matches(base, ops, n=3, cutoff=0.5)
        if base != name and base in ops:
            said.append(f"{name!r} (names are without ::callN: {base!r})")
        else:
            said.append(f"{name!r}" + (f" (did you mean {', '.join(map(repr, close))}?)" if close else ""))
    return f"{path}: sel(op=...) names no entry: {'; '.join(said)}"


def _both(a: re.Pattern, b: re.Pattern) -> re.Pattern:
    """One pattern that ``search``-matches where both do (picklable, unlike a closure)."""
    return re.compile(rf"^(?=[\s\S]*?(?:{a.pattern}))(?=[\s\S]*?(?:{b.pattern}))")


def _shape_str(shape) -> str:
    return "" if shape is None else "[" + ",".join(str(int(v)) for v in shape) + "]"


def _itemsize(dtype: str) -> int:
    import torch

    dt = getattr(torch, dtype.removeprefix("torch."), None)
    return dt.itemsize if isinstance(dt, torch.dtype) else 0


def _op_coords(ops: list[str], first: dict[str, tuple]) -> dict[str, tuple]:
    cols: dict[str, list] = {
        k: [] for k in ("module", "aten", "stack", "layer", "leaf", "module_type", "level", "dtype", "shape")
    }
    for op in ops:
        try:
            parts = parse_key(op)
            module, aten = parts.module, parts.op or ""
        except ValueError:
            module, aten = op, ""
        stack, layer, leaf = split_module_path(module)
        pi, i = first[op]
        cols["module"].append(module)
        cols["aten"].append(aten)
        cols["stack"].append(stack)
        cols["layer"].append(layer)
        cols["leaf"].append(leaf)
        cols["module_type"].append(pi.module_type[i] or "")
        cols["level"].append("op" if aten else "module")
        cols["dtype"].append((pi.dtype[i] or "").removeprefix("torch."))
        cols["shape"].append(_shape_str(pi.shape[i]))
    return {k: ("op", np.asarray(v, dtype=object if k != "layer" else np.int64)) for k, v in cols.items()}
