"""Diff: two dumps compared entry by entry, and the first place they part.

The engine and its answers: which (rank, pass) pairs there are, computing
them in waves (:mod:`tdinspect.compare.passes`), keeping their rows, and
answering from them (:meth:`Diff.first_divergence`, :meth:`Diff.summary`,
:meth:`Diff.table`, :meth:`Diff.plan`...). Which entries meet is
:mod:`~tdinspect.compare.pairing`, the per-pair rule :mod:`~tdinspect.compare.rule`,
the verdict :mod:`~tdinspect.compare.thresholds`; cubes and rankings are
:mod:`~tdinspect.compare.cube` and :mod:`~tdinspect.compare.growth`.

The first run is the reference (``y`` in relative metrics, and the execution
order that "first" refers to). Entries are matched by (rank, pass, op, call),
or, with ``align="sequence"``, by a sequence alignment of their signatures
(op, shape) within each pass, for op streams that do not line up by name
(a fused kernel on one side, its unfused ops on the other).

Structural divergences (present on one side only, shape mismatch, NaN/Inf
where the other side is finite, a rank or pass on one side only) always count
as divergences and carry a ``reason``; a dtype difference does not (that is
what precision comparisons are), and is shown with the ``_cast`` metrics.

Examples
--------
>>> d = DumpSet.open("runs/fp32").diff("runs/bf16")            # doctest: +SKIP
>>> d.first_divergence()                                       # doctest: +SKIP
Divergence(model.layers.2.mlp.down pass 0: rel_diff 0.0321 > 0.00098 (auto: bfloat16))
>>> d.first_divergence(threshold=1e-3)                         # doctest: +SKIP
Divergence(model.layers.2.mlp.down pass 0: rel_diff 0.0321 > 0.001)
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from tdinspect.align.fusedhint import cut_of, cuts_hint, fused_hint
from tdinspect.align.logical import LogicalPass, primary, slices_of
from tdinspect.align.mapping import mapped_key, quoted_rule
from tdinspect.compare import cube, entries, growth
from tdinspect.compare.baseline import FACTOR, LACKING, Budget
from tdinspect.compare.padhint import layouts_hint, pad_hint
from tdinspect.compare.pairing import assembled, layout, pairs
from tdinspect.compare.passes import PassJob, compare_pass, cut_short, pass_frame, rank_hint
from tdinspect.compare.passframes import PassFrames
from tdinspect.compare.rows import rows_text
from tdinspect.compare.rule import COLUMNS, STRUCTURAL_COLUMNS, apply_transform, problem_of
from tdinspect.compare.spec import CompareSpec
from tdinspect.compare.thresholds import (
    BEFORE,
    REPLICA,
    Divergence,
    Verdict,
    allowed_patterns,
    allowed_rows,
    divergence_of,
    divergent,
    explained,
    never_compared,
    reason_of,
    set_aside,
    slice_hits,
    threshold_fn,
)
from tdinspect.errors import DumpFormatError, UncomparedWarning
from tdinspect.naming import split_call
from tdinspect.numerics.metrics import AUTO, auto_rule, compare_tensors, metric, same_bits, stats_rel
from tdinspect.store.passindex import PassIndex
from tdinspect.util.parallel import default_wave, map_in_waves
from tdinspect.util.terminal import visible

if TYPE_CHECKING:
    import xarray as xr


def _same_partials(pi: LogicalPass, node: dict) -> bool:
    """Whether the ranks' partial sums of an unsharded entry hold the same bits: an output
    all-reduced inside the module (a row-parallel layer that reduces), not a partial sum."""
    loaded = pi.load()
    parts = [loaded.fetch(p["src"], p["key"]) for p in node["parts"] if p.get("op") == "read"]
    return len(parts) == len(node["parts"]) > 1 and all(
        t.shape == parts[0].shape and same_bits(parts[0], t) for t in parts[1:]
    )


class Diff:
    """Two dumps compared; the first is the reference.

    Parameters
    ----------
    a, b : DumpSet
        Reference and compared dump.
    align : {"name", "sequence"}
        Match entries by name, or by a sequence alignment of (op, shape)
        signatures per pass (honest lists of what did not match).
    client : dask.distributed.Client, optional
        Run the per-pass comparisons on this cluster (default: ``a.client``,
        else a local thread pool, :mod:`tdinspect.util.parallel`).
    chunk : int
        Elements converted at a time when a pair needs a dtype conversion or
        a copy (bounds memory for huge tensors).
    mode : {"auto", "tensor", "stats"}
        ``"stats"`` compares statistics only (the only choice when a side is
        statistics-only): relative difference of min, max, mean (on the
        reference's absmax) and l2 (:func:`tdinspect.numerics.metrics.stats_rel`).
    mapping : dict, path or Mapping, optional
        Pair differently named entries: ``{a_regex: b_template}`` or
        ``{a_regex: [b_template, transform]}`` rules, or a YAML/JSON file of
        them (see :mod:`tdinspect.align.mapping`); :meth:`plan` shows the
        pairs before any tensor is read.
    passes_in_flight : int, optional
        The memory knob: pass pairs computed together (default: twice the
        worker threads). Peak memory is about the imports (~260 MB) plus the
        pass files being compared at once (each worker maps one pair) plus
        a few MB of chunk buffers per worker, whatever the dump's size.
    unshard : bool
        Compare both sides' :meth:`DumpSet.unshard` (ranks reassembled).
    concat : str or (over, dim), optional
        ``"pass:1"``, ``"call:s"`` or ``("call", 1)``: compare both sides'
        :meth:`DumpSet.concat` (decode steps put end to end), after unsharding.
    spec : CompareSpec or dict, optional
        Every option of the comparison as one value (:class:`~tdinspect.compare.spec.CompareSpec`:
        the keywords below, plus ``structural``, ``metric``, ``threshold``); the keywords
        given override its fields. The diff keeps it as :attr:`spec`: its repr shows it, and
        every answer, view and the CLI use it where they are not told otherwise.
    structural, metric, threshold : optional
        The defaults of the answers (:meth:`first_divergence`, :meth:`verdict`...; default
        ``"diverge"``, ``rel_diff``, ``"auto"``).
    allow_uncompared : str or list of str, optional
        Regexes (``re.search`` on entry names, A's or B's, without ``::callN``) of
        entries that may be one-sided or never compared by design (a reference's
        ``rotary_emb`` a port computes inline): they never diverge for being one-sided
        and do not make :meth:`verdict` ``"incomplete"``. The answers take their own
        ``allow_uncompared`` too (used instead of this one).
    baseline : DumpSet, optional
        An error budget (:mod:`tdinspect.compare.baseline`): a run of the trusted
        implementation in B's working precision (the reference model in float32 against a
        float64 A). Paired with A by name (never through ``mapping``, which pairs B), and
        unsharded / concatenated as A is. Then B diverges where its error against A exceeds
        ``baseline_factor`` times the baseline's error against A at that entry (at least a
        few units of roundoff of the dtype), instead of the ``"auto"`` rule; a threshold
        given to an answer is used instead. Entries the baseline lacks are judged by
        ``"auto"`` and make the verdict incomplete.
    baseline_factor : float
        ``k`` of the budget (default 10: a correct port's rounding noise sits within about
        1x of the baseline's).

    Examples
    --------
    >>> d = Diff(DumpSet.open("a"), DumpSet.open("b"))   # doctest: +SKIP
    >>> d.first_divergence()                              # doctest: +SKIP
    """

    token_aligned = False  # a TokenDiff lines passes up by (request, position)

    def __init__(
        self,
        a,
        b,
        *,
        spec: CompareSpec | dict | None = None,
        align: str | None = None,
        client: Any = None,
        chunk: int = 1 << 18,
        mode: str = "auto",
        passes_in_flight: int | None = None,
        mapping: Any = None,
        unshard: bool | None = None,
        concat: str | tuple | None = None,
        allow_uncompared: str | list[str] | None = None,
        structural: str | None = None,
        metric: str | None = None,
        threshold: float | str | dict | None = None,
        baseline: Any = None,
        baseline_factor: float | None = None,
    ):
        # one value holds every option of the comparison; the keywords given override the spec's
        spec = CompareSpec.coerce(spec).replace(
            align=align,
            mapping=mapping,
            unshard=unshard,
            concat=concat,
            allow_uncompared=allow_uncompared,
            structural=structural,
            metric=metric,
            threshold=threshold,
            baseline=baseline,
            baseline_factor=baseline_factor,
        )
        if spec.tokens and not self.token_aligned:
            raise ValueError(
                "spec tokens=True: make the diff with DumpSet.diff(other, tokens=True) (a TokenDiff)"
            )
        self.spec = spec
        baseline = spec.baseline
        if isinstance(baseline, (str, os.PathLike)):  # a spec from flags or JSON names a folder
            try:
                baseline = type(a).coerce(baseline, client=a.client)
            except DumpFormatError as exc:  # "x: not a dump" named no argument: A's? B's?
                raise DumpFormatError(f"baseline {exc}") from None
        if spec.unshard:
            a, b = a.unshard(), b.unshard()
            baseline = baseline.unshard() if baseline is not None else None
        if spec.concat is not None:
            from tdinspect.align.concat import names_dim, parse_concat

            over, dim = parse_concat(spec.concat)
            if not (names_dim(a.pass_map, dim) or names_dim(b.pass_map, dim)):
                raise ValueError(
                    f"concat dim {dim!r}: no entry of either side has that many dims"
                    if isinstance(dim, int)
                    else f"concat dim {dim!r}: no entry of either side has dims naming it (capture(dims=...) "
                    "or DumpSet.open(dims=...)), or give dim as an int"
                )
            a, b = a.concat(over, dim), b.concat(over, dim)
            baseline = baseline.concat(over, dim) if baseline is not None else None
        self.mapping = spec.mapping
        if mode not in ("auto", "tensor", "stats"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'tensor' or 'stats'")
        self.a, self.b = a, b
        self.allow_uncompared = allowed_patterns(spec.allow_uncompared)
        self.align = spec.align
        self.client = client if client is not None else a.client
        self.chunk = chunk
        if passes_in_flight is not None and (
            isinstance(passes_in_flight, bool)
            or not isinstance(passes_in_flight, int)
            or passes_in_flight < 1
        ):  # 0 became the default, silently
            raise ValueError(f"passes_in_flight={passes_in_flight!r}: expected a whole number, 1 or more")
        self.passes_in_flight = passes_in_flight
        self.mode = "stats" if (a.stats_only or b.stats_only or mode == "stats") else "tensor"
        if self.mode == "stats" and mode == "tensor":
            raise ValueError("a side is statistics-only: tensors cannot be compared (mode='stats')")
        self.default_metric = (
            spec.metric if spec.metric is not None else ("stats_rel" if self.mode == "stats" else "rel_diff")
        )
        self._want_stats_rel = False  # tensor mode: statistics compared once that is asked for
        # one DataFrame per pass read, kept as typed columns until asked for (~560 B an
        # entry; row dictionaries took ~1.1 KB)
        self._results = PassFrames()
        self.passes_read: list[tuple[int, int]] = []
        self.baseline_factor = spec.baseline_factor
        self.baseline = None  # A against the baseline, by name: the budget's rows
        if baseline is not None:
            self.baseline = Diff(
                a, baseline, client=self.client, chunk=chunk, mode=mode, passes_in_flight=passes_in_flight
            )
        self._budgets: dict[str, Budget] = {}

    # -- jobs ---------------------------------------------------------------------------
    def _jobs(self) -> list[PassJob]:
        passes_a, passes_b = self.a.pass_map, self.b.pass_map
        keys = sorted(set(passes_a) | set(passes_b), key=lambda k: (k[1], k[0]))
        ranks_a, ranks_b = set(self.a.ranks), set(self.b.ranks)
        # each side's ranks, where it has more than the other (its peers are hinted as shards)
        more = [
            (s.pass_map, s.ranks) if len(s.ranks) > len(o.ranks) else None
            for s, o in ((self.a, self.b), (self.b, self.a))
        ]
        jobs = []
        for rank, p in keys:
            pa, pb = passes_a.get((rank, p)), passes_b.get((rank, p))
            reason = ""
            if rank not in ranks_b:
                reason = f"rank {rank} only in A" + rank_hint(pa)
            elif rank not in ranks_a:
                reason = f"rank {rank} only in B" + rank_hint(pb)
            elif pa is None or pb is None:
                reason = f"pass {p} only in {'A' if pb is None else 'B'}"
            jobs.append(
                PassJob(
                    rank,
                    p,
                    pa,
                    pb,
                    self.a.op_pattern,
                    self.align,
                    self.mode,
                    self.chunk,
                    reason,
                    self.mapping,
                    *_peers(more, rank, p, pa, pb),
                    pattern_b=self.b.op_pattern,
                )
            )
        return jobs

    def iter_passes(self, *, growing: bool = False) -> Iterator[tuple[tuple[int, int], pd.DataFrame]]:
        """``((rank, pass), rows)`` in order, computing (in waves) only what is not cached.

        ``rows`` is a DataFrame with :data:`COLUMNS`, in the pass's execution order.
        """
        for k in self._computed(growing):
            if self._want_stats_rel and self.mode == "tensor":
                self._fill_stats_rel(k, self._results[k])
            yield k, self._results[k]

    def _computed(self, growing: bool = False) -> Iterator[tuple[int, int]]:
        """Every ``(rank, pass)`` in order, once its rows are in ``_results`` (computed in
        waves where not cached), without building its frame."""
        jobs = self._jobs()
        todo = [j for j in jobs if (j.rank, j.pass_) not in self._results]
        computed = self._compute(todo, growing)
        for job in jobs:
            k = (job.rank, job.pass_)
            if k not in self._results:
                self._results[k] = pass_frame(next(computed))
                self.passes_read.append(k)
            yield k

    def _fill_stats_rel(self, k: tuple[int, int], rows: pd.DataFrame) -> None:
        """``stats_rel`` of compared tensor entries (from the sidecars' statistics, or
        computed from the tensors), filled once that metric is asked for."""
        todo = rows.index[
            rows["stats_rel"].isna().to_numpy()
            & ~rows["structural"].to_numpy(bool)
            & (rows["reason"].to_numpy(object) == "")
        ]
        if not len(todo):
            return
        pa, pb = self.a.pass_map[k], self.b.pass_map[k]
        for i in todo:
            sa = pa.stat_dict(pa.position[rows.at[i, "key"]])
            sb = pb.stat_dict(pb.position[rows.at[i, "key_b"]])
            rows.at[i, "stats_rel"] = stats_rel(sb, sa)

    def _compute(self, jobs: list[PassJob], growing: bool) -> Iterator[list[dict]]:
        limit = default_wave(self.client) if self.passes_in_flight is None else self.passes_in_flight
        if not growing:
            yield from map_in_waves(compare_pass, jobs, client=self.client, wave=limit)
            return
        start, wave = 0, 1  # 1, 2, 4, ... passes: an early divergence reads little
        while start < len(jobs):
            yield from map_in_waves(compare_pass, jobs[start : start + wave], client=self.client, wave=wave)
            start += wave
            wave = min(wave * 2, limit)

    def plan(self, pass_: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """Which A entry meets which B entry, through which transform: metadata only.

        Look at it before numbers are computed. One row per pair (and per
        one-sided entry) with ``rank``, ``pass``, ``a_key``, ``b_key``,
        ``transform``, ``rule`` (the mapping rule that paired it, ``""`` for
        identical names), ``shape_a``, ``shape_b`` (as stored), ``shape_b_after``
        (after the transform), ``status`` (``"ok"`` or the structural reason
        the diff will give), and ``assembled_a`` / ``assembled_b``: how an
        unsharded or concatenated entry is put together (``cat(dim 2: rank 0
        (tp 0 of 2), rank 1 (tp 1 of 2))``; ``""`` for a stored entry). With a
        ``baseline``, ``baseline``: the baseline's entry that sets the A entry's
        budget (paired by name; ``""`` when the baseline lacks it).
        ``attrs["spec"]`` is the diff's :class:`~tdinspect.compare.spec.CompareSpec`.

        Parameters
        ----------
        pass_, rank : int, optional
            Restrict to one pass / rank (default: the first pass, every rank).

        Examples
        --------
        >>> DumpSet.open("ref").diff("port", mapping="map.yaml").plan()   # doctest: +SKIP
        """
        passes = sorted(set(self.a.passes) | set(self.b.passes))
        pass_ = passes[0] if pass_ is None and passes else pass_
        out = []
        for job in self._jobs():
            if job.pass_ != pass_ or (rank is not None and job.rank != rank):
                continue
            pa, pb = job.a, job.b
            for ia, ib, _ in pairs(pa, pb, job.keep, job.align, job.mapping, job.keep_b):
                a_key = pa.keys[ia] if ia is not None else ""
                transform = job.transform(a_key) if ia is not None else None
                row = {
                    "rank": job.rank,
                    "pass": job.pass_,
                    "a_key": a_key,
                    "b_key": pb.keys[ib] if ib is not None else "",
                    "transform": transform.spec if transform is not None else "",
                    "rule": quoted_rule(self.mapping.rule_of(split_call(a_key)[0]))
                    if self.mapping is not None and ia is not None
                    else "",
                    "shape_a": pa.shape[ia] if ia is not None else None,
                    "shape_b": pb.shape[ib] if ib is not None else None,
                    "shape_b_after": None,
                    "status": "ok",
                    "assembled_a": assembled(pa, ia),
                    "assembled_b": assembled(pb, ib),
                }
                if ia is None or ib is None:
                    row["status"] = job.unmatched(ia, ib)
                elif problem_of(pa, ia, "A") or problem_of(pb, ib, "B"):
                    row["status"] = problem_of(pa, ia, "A") or problem_of(pb, ib, "B")
                else:
                    why, row["shape_b_after"] = layout(pa, ia, pb, ib, transform)
                    row["status"] = why or "ok"
                out.append(row)
        plan = pd.DataFrame(
            out,
            columns=[
                "rank",
                "pass",
                "a_key",
                "b_key",
                "transform",
                "rule",
                "shape_a",
                "shape_b",
                "shape_b_after",
                "status",
                "assembled_a",
                "assembled_b",
            ],
        )
        if self.baseline is not None:
            plan["baseline"] = self._baseline_keys(plan)
        plan.attrs["spec"] = self.spec  # what the pairs are made with (mapping, unshard, concat...)
        return plan

    def _baseline_keys(self, plan: pd.DataFrame) -> list[str]:
        """The baseline's entry each plan row's A entry meets (by name), ``""`` when it has none."""
        out = []
        for rank, p, a_key in zip(plan["rank"], plan["pass"], plan["a_key"]):
            pc = self.baseline.b.pass_map.get((rank, p))
            out.append(a_key if a_key and pc is not None and a_key in pc.position else "")
        return out

    # -- thresholds ---------------------------------------------------------------------
    def thresholds(self, threshold: float | str | dict | None = None, metric: str | None = None):
        """The per-row thresholds every answer of this diff applies (a
        :class:`~tdinspect.compare.thresholds.Thresholds`: ``of_rows``, ``describe``, ``given``).

        ``None`` is the spec's threshold for the spec's metric (another metric asked for
        without one: ``"auto"``); with a baseline, ``"auto"`` is the baseline's error budget.
        The views draw and colour with it, so they agree with :meth:`verdict`.

        Examples
        --------
        >>> diff.thresholds().describe()          # doctest: +SKIP
        'auto (rel_diff: float32 1.5e-08)'
        """
        return self._thresholds(threshold, self.default_metric if metric is None else metric)

    def _thresholds(self, threshold, metric_name: str):
        """:meth:`thresholds` of ``metric_name``: the spec's threshold when ``threshold`` is
        ``None``, the baseline's budget for ``"auto"`` with a baseline, else
        :func:`threshold_fn`'s."""
        if threshold is None and metric_name == self.default_metric:
            threshold = self.spec.threshold
        if self.baseline is None or not (
            threshold is None or (isinstance(threshold, str) and threshold == AUTO)
        ):
            return threshold_fn(threshold, metric_name)
        if metric_name not in self._budgets:
            self._budgets[metric_name] = Budget(self.baseline, metric_name, self.baseline_factor)
        return self._budgets[metric_name]

    def pass_rows(self, rank: int, pass_: int) -> pd.DataFrame | None:
        """The rows of one (rank, pass) (:data:`COLUMNS`), computed with the passes before it
        when not cached; ``None`` when neither side holds it."""
        for k in self._computed(growing=True):
            if k == (rank, pass_):
                return self._results[k]
        return None

    @staticmethod
    def _hits(rows: pd.DataFrame, m, thr_fn) -> np.ndarray:
        """Which rows diverge (a boolean array), by :func:`divergent`, whole or by a slice
        (:func:`~tdinspect.compare.thresholds.slice_hits`)."""
        thresholds, skip = thr_fn.of_rows(rows), explained(rows["reason"].to_numpy(object))
        hit = divergent(m, rows[m.name].to_numpy(float), thresholds, rows["structural"].to_numpy(bool), skip)
        return hit | slice_hits(rows, m, thresholds, skip, thr_fn)

    def _check_metric(self, metric_name):
        metric_name = self.default_metric if metric_name is None else metric_name
        self._want_stats_rel = self._want_stats_rel or metric_name == "stats_rel"
        if self.mode == "stats" and metric_name == "equal":
            for name, side in (("A", self.a), ("B", self.b)):
                if not any(_has_checksums(pi) for pi in side.pass_indexes()):
                    raise ValueError(_no_checksums(name, side))
        elif self.mode == "stats" and metric_name != "stats_rel":
            raise ValueError(
                f"this diff compares statistics only (a side is stats_only): "
                f"use metric='stats_rel' (or 'equal' with checksums), "
                f"not {metric_name!r}"
            )
        return metric(metric_name)

    def diverging(
        self, rows: pd.DataFrame, metric=None, threshold=None, structural=None, allow_uncompared=None
    ) -> np.ndarray:
        """Which of ``rows`` (a :meth:`table`) diverge, by the rule :meth:`verdict` applies:
        past their threshold or structural, less those ``structural="report"`` sets aside and
        those ``allow_uncompared`` names (defaults: the diff's :attr:`spec`)."""
        m = self._check_metric(metric)
        hit = self._hits(rows, m, self._thresholds(threshold, m.name))
        layout = self._layout_rows(rows)
        if (self.spec.structural if structural is None else structural) == "report":
            hit &= ~layout
        return hit & ~(self._allowed(rows, allow_uncompared) & (layout | self._never_rows(rows)))

    @staticmethod
    def _layout_rows(rows: pd.DataFrame) -> np.ndarray:
        """Rows that differ in structure (one-sided, unmatched, shape, transform), as opposed
        to numbers (NaN/Inf on one side, other arguments count as numbers): :func:`set_aside`."""
        return set_aside(rows["structural"].to_numpy(bool), rows["reason"].to_numpy(object))

    def structural_entries(self, progress: bool | None = None) -> pd.DataFrame:
        """Every entry that differs in structure rather than in numbers (reads every pass).

        Columns ``rank``, ``pass``, ``order``, ``key``, ``key_b``, ``reason``.
        """
        df = self.table(progress)
        return df[self._layout_rows(df)][STRUCTURAL_COLUMNS].reset_index(drop=True)

    def _allowed(self, rows: pd.DataFrame, allow_uncompared=None) -> np.ndarray:
        """Which rows ``allow_uncompared`` (default: the diff's) names."""
        patterns = self.allow_uncompared if allow_uncompared is None else allowed_patterns(allow_uncompared)
        return allowed_rows(
            patterns,
            rows["op"].to_numpy(object),
            rows["key_b"].to_numpy(object),
            rows["key"].to_numpy(object),
        )

    @staticmethod
    def _never_rows(rows: pd.DataFrame) -> np.ndarray:
        """Rows never compared though they hold values (:func:`never_compared`)."""
        return never_compared(rows["structural"].to_numpy(bool), rows["reason"].to_numpy(object))

    def uncompared_after(self, progress: bool | None = None, allow_uncompared=None) -> dict | None:
        """Where the comparison stops covering the reference: A entries set aside (one-sided,
        unmatched, reshaped) or never compared after the last A entry compared in numbers
        (reads every pass); those ``allow_uncompared`` names (default: the diff's) are
        not listed.

        ``first_divergence(structural="report")`` answering ``None`` says nothing of
        them: a port paired by a mapping that misses most of its entries (suggested
        from a port whose values already differ) compares a few entries and sets the
        rest aside. Entries set aside between compared ones (a reference's
        ``rotary_emb``) are not counted.

        Returns
        -------
        dict or None
            For the first (pass, rank) whose tail was not compared: ``pass``,
            ``rank``, ``last_compared`` (an A key, or None when none was),
            ``position`` (its 1-based place among the pass's A entries), ``of``
            (how many), ``after`` (the A keys set aside after it) and ``text``
            (a sentence); None when every pass's last A entry was compared.
        """
        df = self.table(progress)
        if not len(df):
            return None
        df = df.assign(
            layout=self._layout_rows(df) | self._never_rows(df), allowed=self._allowed(df, allow_uncompared)
        ).sort_values(["pass", "rank", "order"])
        for (p, rank), rows in df.groupby(["pass", "rank"], sort=True):
            pi = self.a.pass_map.get((rank, p))
            keys_a = set(pi.keys) if pi is not None else set()
            rows = rows[rows["key"].isin(keys_a)]  # B-only rows name B's entries
            if not len(rows):
                continue
            compared = np.flatnonzero(~rows["layout"].to_numpy(bool))
            last = int(compared[-1]) if len(compared) else -1
            tail = rows.iloc[last + 1 :]
            after = tail["key"][~tail["allowed"].to_numpy(bool)].tolist()
            if not after:
                continue
            shown = ", ".join(after[:3]) + (", ..." if len(after) > 3 else "")
            where = self._where(p, rank)
            if last < 0:
                text = (
                    f"no entry of A was compared in numbers ({where}): {len(after)} were set aside ({shown})"
                )
                key = None
            else:
                key = rows["key"].iloc[last]
                n = len(after)
                text = (
                    f"the comparison stops at {key} (A's entry {last + 1} of {len(rows)}, "
                    f"{where}): the {n} A {'entry' if n == 1 else 'entries'} after it "
                    f"{'was' if n == 1 else 'were'} set aside, not compared ({shown}); the "
                    f"runs may part there unseen"
                )
            return {
                "pass": int(p),
                "rank": int(rank),
                "last_compared": key,
                "position": last + 1,
                "of": int(len(rows)),
                "after": after,
                "text": text,
            }
        return None

    def rank_passes(self) -> list[tuple[int, int]]:
        """Every ``(rank, pass)`` the diff compares (either side's), in order of pass, then rank:
        metadata only; :attr:`passes_read` lists those computed so far."""
        return [(job.rank, job.pass_) for job in self._jobs()]

    def structural_read(self) -> pd.DataFrame:
        """The structural rows of the passes compared so far (nothing more is read): columns
        ``pass``, ``rank``, ``key``, ``reason``, in the order the passes were compared."""
        rows = [
            r
            for f in self._results.values()
            for r in f.loc[f["structural"], ["pass", "rank", "key", "reason"]].values.tolist()
        ]
        return pd.DataFrame(rows, columns=["pass", "rank", "key", "reason"])

    def one_sided(self) -> dict[str, dict[str, list]]:
        """What only one side holds, from metadata only (nothing is read).

        Returns
        -------
        dict
            ``{"ranks": {"A": [...], "B": [...]}, "passes": {...}, "entries": {...}}``: the
            rank and pass numbers only in A / only in B, sorted, and for entries, per side,
            ``((rank, pass), sorted names)`` of each (rank, pass) both sides hold where that
            side has entry names the other lacks (A's named by their partners under the
            diff's mapping), in order of pass, then rank. All lists empty when both sides
            hold the same ranks, passes and entry names (the reference's selection).

        Examples
        --------
        >>> DumpSet.open("a").diff("b").one_sided()["passes"]   # doctest: +SKIP
        {'A': [], 'B': [3]}
        """
        a, b = self.a, self.b
        out: dict[str, dict[str, list]] = {}
        for what, sa, sb in (("ranks", set(a.ranks), set(b.ranks)), ("passes", set(a.passes), set(b.passes))):
            out[what] = {"A": sorted(sa - sb), "B": sorted(sb - sa)}
        only: dict[str, list] = {"A": [], "B": []}
        passes_a, passes_b = a.pass_map, b.pass_map
        for key in sorted(set(passes_a) & set(passes_b), key=lambda k: (k[1], k[0])):
            ka = {k for k in passes_a[key].keys if a.keeps(k)}
            kb = {k for k in passes_b[key].keys if a.keeps(k) and b.keeps(k)}  # both selections
            if self.mapping is not None:  # pairs through the rules: A entries are named by their partners
                partner = {k: mapped_key(self.mapping, k) for k in ka}
                partner = {k: m for k, m in partner.items() if b.keeps(m)}
                ka = set(partner)
                only_a = {k for k, m in partner.items() if m not in passes_b[key].position}
                only_b = kb - set(partner.values())
            else:
                ka = {k for k in ka if b.keeps(k)}
                only_a, only_b = ka - kb, kb - ka
            for side, extra in (("A", only_a), ("B", only_b)):
                if extra:
                    only[side].append((key, sorted(extra)))
        out["entries"] = only
        return out

    def _where(self, pass_: int, rank: int) -> str:
        """``pass P``, with ``, rank R`` when the reference has several ranks."""
        return f"pass {pass_}" + (f", rank {rank}" if len(self.a.ranks) > 1 else "")

    # -- answers ------------------------------------------------------------------------
    def first_divergence(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        structural: str | None = None,
        *,
        allow_uncompared: str | list[str] | None = None,
    ) -> Divergence | None:
        """The earliest entry, in the reference's (pass, order), past ``threshold``.

        Passes are compared in order and the search stops at the first pass
        that diverges: a divergence in pass 0 reads pass 0 only. ``None`` is not
        "everything matched" when entries were set aside or never compared: an
        :class:`UncomparedWarning` says so then (:meth:`verdict` is the answer
        with its three outcomes).

        Parameters
        ----------
        threshold : "auto", float or {regex: float or "auto"}, optional
            ``"auto"`` (the default, also ``None``): each entry's from its two
            dtypes, ``u/4`` for ``rel_diff`` with ``u`` the unit roundoff of
            the coarser one (float32 1.5e-8, bfloat16 9.8e-4; see
            :mod:`tdinspect.numerics.metrics`); metrics without a dtype-derived scale
            (``max_abs``...) keep their fixed default. A number is used for
            every entry; a dict sets thresholds by entry name (first matching
            regex wins; ``"auto"`` where none matches).
        metric : str, optional
            ``rel_diff`` (default), ``max_abs``, ``mean_abs``, ``max_rel``,
            ``cosine`` and ``sqnr_db`` (diverge below), ``mismatch``,
            ``equal`` (diverges when 0); ``stats_rel`` for statistics-only.
        structural : {"diverge", "report"}
            ``"diverge"``: an entry on one side only, unmatched or of another
            shape is a divergence. ``"report"``: such entries are set aside and
            listed in ``Divergence.structural_entries`` (those of the passes
            read) and the repr; the answer is the first numerical divergence
            (``None`` when there is none: :meth:`structural_entries` lists them all;
            an :class:`UncomparedWarning` then says how many were set aside and
            names A entries set aside after the last one compared, see
            :meth:`uncompared_after`). An op called with other arguments, or
            NaN/Inf on one side, is a divergence in both modes.
        allow_uncompared : str or list of str, optional
            Entries that may be one-sided or never compared (default: the diff's; see
            :class:`Diff`): they never diverge for being one-sided, and no warning
            names them.

        Returns
        -------
        Divergence or None

        Raises
        ------
        DumpFormatError
            When a record the divergence was read from fails its CRC-32 (a
            damaged pass file: the "divergence" may be the damage).
        """
        v = self.verdict(threshold, metric, structural, allow_uncompared=allow_uncompared)
        if v.outcome == "incomplete":
            warnings.warn(
                visible(f"tdinspect: no numerical divergence, but {v.gap}"),  # names from the files
                UncomparedWarning,
                stacklevel=2,
            )
        return v.divergence

    def verdict(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        structural: str | None = None,
        *,
        allow_uncompared: str | list[str] | None = None,
    ) -> Verdict:
        """The answer with its three outcomes: diverges, matches or incomplete (a :class:`Verdict`).

        ``"matches"`` only when every entry of both sides was compared (or is named by
        ``allow_uncompared``) and none passed its threshold; ``"incomplete"`` when nothing
        diverged among those compared but others were set aside (``structural="report"``)
        or never compared: ``Verdict.gap`` says which and where the comparison stopped.
        No warning: a caller that shows it (:meth:`summary`, the CLI, a report) says it
        once, in its own words. Arguments as for :meth:`first_divergence`.

        Examples
        --------
        >>> v = diff.verdict(structural="report", allow_uncompared=r"rotary_emb")   # doctest: +SKIP
        >>> v.outcome                                                              # doctest: +SKIP
        'matches'
        """
        structural = self.spec.structural if structural is None else structural
        if structural not in ("diverge", "report"):
            raise ValueError(f"structural={structural!r}: expected 'diverge' or 'report'")
        m = self._check_metric(metric)
        thr_fn = self._thresholds(threshold, m.name)
        report = structural == "report"
        aside = []
        unseen: list[pd.DataFrame] = []  # the first rows not compared (named in the gap)
        counts = {"compared": 0, "uncompared": 0, "allowed": 0}
        best = None
        remaining: dict[int, int] = {}  # pass -> ranks not yet seen
        for job in self._jobs():
            remaining[job.pass_] = remaining.get(job.pass_, 0) + 1
        cut: list[str] = []  # passes an error cut short: what ran may agree, the pass never ended
        for (rank, p), rows in self.iter_passes(growing=True):
            remaining[p] -= 1
            cut += cut_short(self.a, self.b, rank, p, self._where)
            hit = self._hits(rows, m, thr_fn)
            layout, never = self._layout_rows(rows), self._never_rows(rows)
            named = self._allowed(rows, allow_uncompared)
            allowed = named & (layout | never)
            # compared in numbers, but not against the budget asked for: judged by "auto"
            lacking = thr_fn.lacking(rows) if isinstance(thr_fn, Budget) else np.zeros(len(rows), bool)
            if report:
                aside.append(rows[layout])
                hit &= ~layout
            hit &= ~allowed  # one-sided by design: never a divergence
            missed = ((layout & report) | never | lacking) & ~named
            counts["compared"] += int((~(layout | never | lacking)).sum())
            counts["uncompared"] += int(missed.sum())
            counts["allowed"] += int((named & (layout | never | lacking)).sum())
            if missed.any() and sum(map(len, unseen)) < 3:
                shown = rows[missed].head(3)
                unseen.append(shown.assign(reason=np.where(lacking[missed][:3], LACKING, shown["reason"])))
            hits = np.flatnonzero(hit)
            if len(hits):
                n = int(hits[0])
                cand = (float(rows["order"].iat[n]), rank, n, rows)
                if best is None or cand[:2] < best[:2]:
                    best = cand
            if best is not None and remaining[p] == 0:
                break  # every rank of the first divergent pass is in: later passes stay unread
        if best is None:
            if not counts["uncompared"] and not cut:
                if counts["compared"]:
                    return Verdict("matches", **counts)
                # the ledger holds nothing compared: never "matches"
                return Verdict("incomplete", None, self._nothing_compared(counts), **counts)
            stopped = self.uncompared_after(progress=False, allow_uncompared=allow_uncompared)
            gap = "; ".join(
                cut[:3] + ([self._gap_text(unseen, counts, stopped)] if counts["uncompared"] else [])
            )
            return Verdict("incomplete", None, gap, **counts, stopped=stopped)
        _, rank, n, rows = best
        row = rows.iloc[n].to_dict()
        if not row["structural"] and self.mode == "tensor":
            self._check_records(row)
        copy = str(row["reason"]).startswith(REPLICA)  # against its own side: no A and B parts
        located = (
            ("" if copy else self._layouts_hint(row))
            if row["structural"] or copy
            else self._locate(row, m, thr_fn(row)) + self._pad_hint(row, m, thr_fn(row))
        )
        earlier = rows.iloc[max(0, n - BEFORE) : n]
        listed = None
        if report:
            listed = pd.concat(aside, ignore_index=True) if aside else pd.DataFrame(columns=COLUMNS)
            listed = listed.sort_values(["pass", "order", "rank"])[STRUCTURAL_COLUMNS].reset_index(drop=True)
        div = divergence_of(
            row, m, thr_fn, list(zip(earlier["key"], earlier[m.name].astype(float))), listed, located
        )
        return Verdict("diverges", div, **counts)

    def _nothing_compared(self, counts: dict) -> str:
        """Why an answer without divergence compared no entry: an empty selection, or every
        entry allowed by ``allow_uncompared``."""
        if counts["allowed"]:
            return "every entry was one-sided or never compared"
        chosen = [
            f"{side}'s {ds.op_pattern.pattern!r}"
            for side, ds in (("A", self.a), ("B", self.b))
            if ds.op_pattern
        ]
        return "the selection matched nothing" + (
            f" (both selections keep no entry: {', '.join(chosen)})"
            if chosen
            else " (no entry on either side)"
        )

    def _gap_text(self, unseen: list[pd.DataFrame], counts: dict, stopped: dict | None) -> str:
        """What an incomplete verdict did not compare: how many, the first few with their
        reasons and where, and where the comparison stops covering the reference."""
        first = pd.concat(unseen, ignore_index=True).head(3)
        n = counts["uncompared"]
        shown = "; ".join(
            f"{key} ({self._where(p, rank)}): {reason}"
            for key, p, rank, reason in zip(first["key"], first["pass"], first["rank"], first["reason"])
        ) + ("; ..." if n > len(first) else "")
        text = f"{n} {'entry was' if n == 1 else 'entries were'} set aside or never compared ({shown})"
        return text if stopped is None else f"{stopped['text']}; in all, {text}"

    def _check_records(self, row: dict) -> None:
        """``DumpFormatError`` when a record the divergent ``row`` was read from fails its
        CRC-32: neither ``torch.load`` nor the record reader checks them, and a bit flipped on
        disk was answered as a divergence (``rel_diff 1`` at the entry holding it). One side
        after the other: with ISA-L's CRC (:mod:`tdinspect.store.crc`) two 4 MB records take about
        1 ms, less than starting the threads that checked them side by side before."""
        sides = [
            (pi, key)
            for pi, key in (
                (self.a.pass_map.get((row["rank"], row["pass"])), row["key"]),
                (self.b.pass_map.get((row["rank"], row["pass"])), row["key_b"]),
            )
            if isinstance(pi, PassIndex)
        ]  # not assembled ones (concat, unshard): other entries
        for pi, key in sides:
            bad = pi.damaged(key)
            if bad is not None:
                raise DumpFormatError(
                    f"{pi.files.tensors}: record {visible(bad)!r} (holding {visible(key)!r}) "
                    f"does not match its CRC-32: the file is damaged, and the divergence found "
                    f"at {visible(row['key'])!r} may be that damage (restore the file or "
                    "capture again)"
                )

    def _rows_located(self, row: dict, m) -> str:
        """For an entry with row fingerprints along its checksum dim on both sides (paired row
        by row, a batch of 4 against a batch of 1, or of one shape; :mod:`tdinspect.compare.rows`):
        which rows differ in their bits."""
        pa = self.a.pass_map.get((row["rank"], row["pass"]))
        pb = self.b.pass_map.get((row["rank"], row["pass"]))
        if pa is None or pb is None or not (pa.checksum_rows and pb.checksum_rows):
            return ""
        ia, ib = pa.position.get(row["key"]), pb.position.get(row["key_b"])
        if ia is None or ib is None:
            return ""
        text = rows_text(pa.shape[ia], pb.shape[ib], pa.checksum_rows[ia], pb.checksum_rows[ib])
        if text and m.name == "stats_rel" and list(pa.shape[ia]) != list(pb.shape[ib]):
            text += "; statistics of tensors of other shapes do not compare: metric='equal' compares the rows"
        return text

    def _locate(self, row: dict, m, thr: float) -> str:
        """For an assembled entry (unshard, concat): the parts (ranks, calls) that differ.

        A transformed B (a mapping rule's transform) is compared as the diff compares it:
        A's parts are slices of the transform's output, B's are followed through the
        transform (:func:`_part_masks`).
        """
        by_rows = self._rows_located(row, m)
        if by_rows:
            return by_rows
        transform = self.mapping.partner(row["op"])[1] if self.mapping is not None else None
        for side, key in ((self.b, row["key_b"]), (self.a, row["key"])):
            pi = side.pass_map.get((row["rank"], row["pass"]))
            node = primary(pi.plans[key]) if isinstance(pi, LogicalPass) and key in pi.plans else None
            if node and node["op"] == "sum" and _same_partials(pi, node):
                return (
                    f"; its {len(node['parts'])} partial sums ({', '.join(node['labels'])}) "
                    "are identical: already all-reduced? then it is replicated: give it "
                    "dims without 'partial'"
                )
            parts = slices_of(node, pi.source_shape) if node else []
            if len(parts) < 2:
                continue
            bad, ya, xb = self._parts_differ(row, m, thr, parts, side is self.b, transform)
            if bad is None:
                continue  # the transform does not only move elements: no slices to follow
            if bad:
                return "; in " + ", ".join(bad) + self._fused_hint(row, pi, key, node, side is self.b, ya, xb)
        return ""

    def _layouts_hint(self, row: dict) -> str:
        """A structural row of two passes with other token layouts: ``tokens=True`` (:mod:`.padhint`)."""
        pa = self.a.pass_map.get((row["rank"], row["pass"]))
        pb = self.b.pass_map.get((row["rank"], row["pass"]))
        if pa is None or pb is None or getattr(self, "token_aligned", False):
            return ""
        return layouts_hint(pa, pb)

    def _pad_hint(self, row: dict, m, thr: float) -> str:
        """Pad rows of two token-laid-out passes compared row by row (:mod:`.padhint`)."""
        pa = self.a.pass_map.get((row["rank"], row["pass"]))
        pb = self.b.pass_map.get((row["rank"], row["pass"]))
        if self.mode != "tensor" or pa is None or pb is None or getattr(self, "token_aligned", False):
            return ""
        if self.mapping is not None and self.mapping.partner(row["op"])[1] is not None:
            return ""  # a transform moves rows: the layouts no longer say which is which
        return pad_hint(pa, pb, row["key"], row["key_b"], m, thr, chunk=self.chunk)

    def _parts_differ(self, row: dict, m, thr: float, parts: list, b_side: bool, transform):
        """``(labels, A, B)``: ``"label: metric value"`` of each of one side's ``parts``
        (:func:`slices_of`'s, in that side's tensor of ``row``) past ``thr``, and the two
        tensors compared (B transformed). ``labels`` is ``None`` when the transform cannot
        be followed part by part."""
        ya = self.a.get_pass(row["pass"], row["rank"]).tensor(row["key"])
        xb = self.b.get_pass(row["pass"], row["rank"]).tensor(row["key_b"])
        masks = None
        if transform is not None:
            if b_side:
                masks = _part_masks(transform, xb.shape, parts, ya.shape)
                if masks is None:
                    return None, ya, xb
            xb, why = apply_transform(transform, xb, ya)
            if why:
                return None, ya, xb
        bad = []
        calls = all(str(label).startswith(("call ", "pass ")) for label, _, _ in parts)
        for n_part, (label, spans, dim) in enumerate(parts):
            if calls and masks is None:  # a decode step: which positions it fed
                first, n = spans[0]
                label = (
                    f"{label} (position {first})"
                    if n == 1
                    else f"{label} (positions {first}..{first + n - 1})"
                )
            if masks is not None:
                y, x = ya[masks[n_part]], xb[masks[n_part]]
            else:
                y = torch.cat([ya.narrow(dim, s, n) for s, n in spans], dim)
                x = torch.cat([xb.narrow(dim, s, n) for s, n in spans], dim)
            value = compare_tensors(x, y, chunk=self.chunk)[m.name]
            if m.diverges(value, thr):
                bad.append(f"{label}: {m.name} {value:.3g}")
        return bad, ya, xb

    def _fused_hint(self, row: dict, pi: LogicalPass, key: str, node: dict, b_side: bool, ya, xb) -> str:
        """For shards concatenated rank after rank: say when they may be a fused layout,
        from the values (:func:`~tdinspect.align.fusedhint.fused_hint`) or, through a
        mapping, from the reference's entries cut out of B's (:func:`cuts_hint`)."""
        if not node.get("axis") or node.get("zigzag") or len(node["parts"]) < 2:
            return ""  # fused already, context parallel's order, or a concat of calls
        dim, spec = node["dim"], pi.dims[pi.position[key]]
        n = len(node["parts"])
        transform = self.mapping.partner(row["op"])[1] if self.mapping is not None else None
        if transform is None:
            whole, mine = (ya, xb) if b_side else (xb, ya)
            return fused_hint(whole, list(mine.tensor_split(n, dim)), dim, spec)
        shape = pi.shape[pi.position[key]]  # B as assembled, before the rule's transform
        if not b_side or shape is None or shape[dim] % n:
            return ""
        pa = self.a.get_pass(row["pass"], row["rank"])
        b_base, cuts = split_call(row["key_b"])[0], {}
        for a_key in dict.fromkeys(split_call(k)[0] for k in pa.keys):
            partner, t = self.mapping.partner(a_key)
            if partner == b_base and t is not None:
                cut = cut_of(t, shape[dim], dim, len(shape))
                if cut is None:
                    return ""
                cuts[a_key] = cut
        return cuts_hint(cuts, n, shape[dim] // n, dim, spec)

    def per_position(
        self,
        key: str,
        dim: int | str = 1,
        metric: str | None = None,
        threshold: float | str | dict | None = None,
    ) -> xr.DataArray:
        """The metric of one entry along ``dim``: where along the tokens two runs part.

        One value per position for each pass and call (and rank) where both
        sides hold the entry, each what :func:`tdinspect.numerics.metrics.compare_tensors`
        gives for the two slices (the one metric definition), all positions
        computed in one vectorised pass
        (:func:`tdinspect.numerics.metrics_split.compare_positions`). A RoPE or KV-cache bug
        shows as error from the first decode position on; a layer bug as error
        everywhere.

        Parameters
        ----------
        key : str
            Entry name (without ``::callN``; every call is computed).
        dim : int or str
            The position dim, or its name in the entry's dims (``"s"``).
        metric, threshold : optional
            Default: the diff's metric at ``"auto"`` (from the entry's dtypes,
            as :meth:`first_divergence`).

        Returns
        -------
        xarray.DataArray
            Dims ``pass``, ``call``, ``position`` (``rank`` first when several);
            NaN where a call is shorter. ``attrs["first_position"]`` is the
            first position past the threshold (-1 when none);
            ``attrs["threshold"]`` the threshold used (the first call's, should
            calls differ in dtype) and ``attrs["threshold_source"]`` where it
            came from (``""``: given).

        Examples
        --------
        >>> da = full.diff(decode, concat="call:1").per_position("model.layers.0.mlp", dim=1)  # doctest: +SKIP
        >>> da.attrs["first_position"]                                                      # doctest: +SKIP
        16
        """
        m = self._check_metric(metric)
        if self.mode == "stats":
            raise ValueError("per_position compares tensors: a side is statistics-only")
        thr_fn = self._thresholds(threshold, m.name)
        return cube.per_position(
            self.iter_passes(), self.a, self.b, key, dim, m, thr_fn, self.mapping, self.chunk
        )

    def table(self, progress: bool | None = None) -> pd.DataFrame:
        """Every compared entry as a ``pandas.DataFrame`` (reads every pass).

        ``progress``: a bar when True; by default only in a terminal (see :mod:`tdinspect.util.progress`).
        """
        from tdinspect.util.progress import bar

        keys = list(bar(self._computed(), progress, total=len(self._jobs()), desc="diff"))
        if not (self._want_stats_rel and self.mode == "tensor"):
            whole = self._results.joined(keys)  # one frame, not one a pass and their concat
            if whole is not None:
                return whole
        frames = [f for _, f in self.iter_passes() if len(f)]  # cached now: nothing computed
        if not frames:
            return pd.DataFrame(columns=COLUMNS)
        return pd.concat(frames, ignore_index=True)

    def divergences(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        progress: bool | None = None,
        *,
        structural: str | None = None,
        allow_uncompared: str | list[str] | None = None,
    ) -> pd.DataFrame:
        """All divergent entries in execution order, with their reasons (a DataFrame).

        ``threshold``, ``structural`` and ``allow_uncompared`` as for :meth:`first_divergence`
        (default: the diff's :attr:`spec`); the column ``threshold`` holds each entry's."""
        m = self._check_metric(metric)
        thr_fn = self._thresholds(threshold, m.name)
        df = self.table(progress)
        df["threshold"] = thr_fn.of_rows(df)
        df["diverges"] = self.diverging(df, m.name, threshold, structural, allow_uncompared)
        df = df[df["diverges"]].sort_values(["pass", "order", "rank"]).reset_index(drop=True)
        df["why"] = [reason_of(r, m, thr_fn) for r in df.to_dict("records")]
        return df

    def growth(self, metric: str | None = None, progress: bool | None = None, *, all_entries: bool = False):
        """The entries that add error: how much each grows the largest error before it (per pass).

        ``growth = error / max(error of earlier entries)``: an op that
        *introduces* error stands out (large growth) from those that inherit
        it. Only entries whose error exceeds every earlier one (``added > 0``)
        are listed, unless ``all_entries``. ``cosine`` and ``sqnr_db`` are
        turned into errors (``1 - cosine``, ``10**(-sqnr/10)``) first.

        Examples
        --------
        >>> diff.growth().sort_values("growth", ascending=False).head(3)   # doctest: +SKIP
        """
        return growth.growth(self.table(progress), self._check_metric(metric).name, all_entries)

    def nearest(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        progress: bool | None = None,
    ) -> dict | None:
        """The entry that came closest to diverging: what to look at when nothing diverges.

        A real fault can stay under a threshold: ``rel_diff`` is second order in the
        error (a 1% scale error gives about 5e-5, under float16's ``"auto"`` 1.2e-4).
        The entry with the largest share of its threshold is named, with its
        :meth:`growth` (its error over the largest one before it in its pass: an
        entry that makes the error, not inherits it, stands out by orders of
        magnitude). Structural entries are left out (they always diverge).

        Returns
        -------
        dict or None
            ``key``, ``pass``, ``rank``, ``call``, ``value`` (the metric), ``threshold``,
            ``share`` (of the threshold, as errors: ``1 - cosine`` for cosine), ``growth``
            (``None`` for the first error of its pass) and ``text`` (a line saying all
            that); ``None`` when every entry is identical or has no threshold above 0.

        Examples
        --------
        >>> diff.nearest()["text"]   # doctest: +SKIP
        'model.model.layers.1.mlp.down_proj (pass 0): rel_diff 5e-05, 41% of its threshold 0.000122; 238x the largest error before it in its pass'
        """
        m = self._check_metric(metric)
        thr_fn = self._thresholds(threshold, m.name)
        return growth.nearest(self.table(progress), m, thr_fn, self._where)

    def introduced(self, metric: str | None = None, progress: bool = True) -> pd.DataFrame:
        """Modules ranked by the error they make themselves, largest first.

        Meant for a B run captured under ``tdinspect.graft(model, A,
        what="inputs")``: every grafted module received A's inputs, so the
        error of its output is its own, not inherited. (On an ordinary diff
        this ranks accumulated error instead.) Inputs, parameters and
        gradients are left out; a module's error is the largest over its
        outputs, calls and passes, structural problems counting as ``inf``.

        Returns
        -------
        pandas.DataFrame
            One row per module: ``module``, ``error`` (``1 - cosine`` and
            ``10**(-sqnr/10)`` for those metrics), ``key``, ``pass``, ``call``
            and ``reason`` of its worst entry.

        Examples
        --------
        >>> DumpSet.open("runs/a").diff("runs/b_grafted").introduced().head(3)  # doctest: +SKIP
        """
        m = self._check_metric(metric)
        return growth.introduced(self.table(progress), m, self.a)

    def health(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        progress: bool | None = None,
        *,
        allow_uncompared: str | list[str] | None = None,
    ) -> pd.DataFrame:
        """Every entry's health, in execution order: its error, its share of its threshold, its
        growth, NaN/Inf and one-sided (reads every pass).

        The table the module tree, the health table of the explorer and the dashboard, and
        ``tdinspect report`` show (:func:`tdinspect.compare.entries.health`); ``diverges`` is
        what :meth:`divergences` lists. Arguments as for :meth:`first_divergence`.

        Examples
        --------
        >>> diff.health().sort_values("share", ascending=False).head(3)   # doctest: +SKIP
        """
        m = self._check_metric(metric)
        patterns = self.allow_uncompared if allow_uncompared is None else allowed_patterns(allow_uncompared)
        table = self.table(progress)
        hit = self.diverging(table, m.name, threshold, allow_uncompared=allow_uncompared)
        return entries.health(table, m, self._thresholds(threshold, m.name), patterns, diverges=hit)

    def tree(
        self,
        threshold: float | str | dict | None = None,
        metric: str | None = None,
        progress: bool | None = None,
        *,
        allow_uncompared: str | list[str] | None = None,
    ):
        """The module tree: the hierarchy of the entry names, each node with the worst share of
        its threshold below it and its counts of diverging, one-sided and NaN/Inf entries
        (a :class:`~tdinspect.compare.tree.ModuleTree`; reads every pass).

        Its HTML repr needs no kernel or script (nested ``<details>`` with inline styles, the
        path to the first divergence open): a saved notebook shows it in nbviewer or an HTML
        export. Arguments as for :meth:`first_divergence`.

        Examples
        --------
        >>> diff.tree()                                   # doctest: +SKIP
        >>> diff.tree().node("model.layers.2").diverging   # doctest: +SKIP
        3
        """
        from tdinspect.compare.tree import ModuleTree

        m = self._check_metric(metric)
        df = self.health(threshold, m.name, progress, allow_uncompared=allow_uncompared)
        return ModuleTree(df, m.name, self.threshold_text(threshold, m.name))

    def by_rank_pass(self, threshold: float | str | dict | None = None, metric: str | None = None):
        """Per (rank, pass): how many entries diverge, the first of them and its reason.

        A ``pandas.DataFrame`` indexed by ``(rank, pass)`` with columns
        ``n_entries``, ``n_divergent``, ``first`` (key, ``""`` when none),
        ``why`` and ``worst`` (largest metric value): which ranks and steps
        part first, at a glance (reads every pass). ``threshold`` as for
        :meth:`first_divergence` (``"auto"`` by default).
        """
        m = self._check_metric(metric)
        thr_fn = self._thresholds(threshold, m.name)
        out = []
        for (rank, p), rows in self.iter_passes():
            hits = np.flatnonzero(self.diverging(rows, m.name, threshold))
            values = rows[m.name].to_numpy(float)
            values = values[~np.isnan(values)]
            worst = (values.max() if m.higher_is_worse else values.min()) if len(values) else math.nan
            first = rows.iloc[hits[0]].to_dict() if len(hits) else None
            out.append(
                {
                    "rank": rank,
                    "pass": p,
                    "n_entries": len(rows),
                    "n_divergent": len(hits),
                    "first": first["key"] if first else "",
                    "why": reason_of(first, m, thr_fn) if first else "",
                    "worst": float(worst),
                }
            )
        return pd.DataFrame(out).set_index(["rank", "pass"]).sort_index()

    def to_xarray(self) -> xr.Dataset:
        """Metrics as a Dataset with the reference cube's dims (``op``, ``call``, ``pass``[, ``rank``])."""
        attrs = {"a": str(self.a.path), "b": str(self.b.path), "mode": self.mode, "align": self.align}
        return cube.to_xarray(self.table(), attrs)

    def summary(
        self, threshold=None, metric=None, structural: str | None = None, *, allow_uncompared=None
    ) -> dict[str, Any]:
        """The verdict as a dict (what the CLI's ``--json`` prints): ``outcome``
        (``"diverges"``, ``"matches"``, ``"incomplete"``), ``verdict`` (its line, see
        :attr:`Verdict.text`), ``gap`` (what was not compared, ``""`` unless incomplete),
        ``compared`` / ``uncompared`` / ``allowed`` (entries), ``first_divergence`` (or
        None), ``nearest`` when nothing diverged, and with ``structural="report"`` the
        ``structural_entries`` and ``uncompared_after``. Arguments as for
        :meth:`first_divergence`."""
        v = self.verdict(threshold, metric, structural, allow_uncompared=allow_uncompared)
        div = v.divergence  # the gap is in the answer here: no warning
        name = div.metric if div else (self.default_metric if metric is None else metric)
        out = {
            "a": str(self.a.path),
            "b": str(self.b.path),
            "mode": self.mode,
            "align": self.align,
            "metric": name,
            "threshold": self.threshold_text(threshold, name),
            "spec": self.spec.to_dict(),
            "outcome": v.outcome,
            "verdict": v.text,
            "gap": v.gap,
            "compared": v.compared,
            "uncompared": v.uncompared,
            "allowed": v.allowed,
            "first_divergence": None
            if div is None
            else {
                "op": div.op,
                "call": div.call,
                "pass": div.pass_,
                "rank": div.rank,
                "key": div.key,
                "value": _num(div.value),
                "threshold": div.threshold,
                "reason": div.reason,
                "structural": div.structural,
            },
        }
        if div is None:
            out["nearest"] = self.nearest(threshold, name, progress=False)
        if (self.spec.structural if structural is None else structural) == "report":
            se = div.structural_entries if div is not None else self.structural_entries(False)
            out["structural_entries"] = se[["rank", "pass", "key", "key_b", "reason"]].to_dict("records")
            if div is None:
                out["uncompared_after"] = v.stopped
        return out

    def threshold_text(self, threshold=None, metric: str | None = None) -> str:
        """``threshold`` in words (:meth:`Thresholds.describe`), with the ``"auto"`` values of
        the dtypes compared so far."""
        read = [f for f in self._results.values() if len(f)]
        return self._thresholds(threshold, self.default_metric if metric is None else metric).describe(
            pd.concat(read) if read else None
        )

    def __repr__(self) -> str:
        return self.headline()

    def headline(self, metric: str | None = None, threshold="auto") -> str:
        """The repr, with the ``"auto"`` rule of ``metric`` (default: the diff's own) when
        ``threshold`` is ``"auto"`` (an explicit one is described by the caller)."""
        head = (
            f"Diff(A={str(self.a.path)!r} (reference), B={str(self.b.path)!r}, "
            f"mode={self.mode}, align={self.align}"
        )
        shown = dataclasses.replace(self.spec, align="name", baseline=None, baseline_factor=FACTOR).describe()
        if shown:  # align is said above, the baseline below
            head += f", {shown}"
        if self.baseline is not None:
            head += (
                f", baseline={str(self.baseline.b.path)!r} (budget: {self.baseline_factor:g}x its error "
                "against A)"
            )
            return head + ")"
        if threshold is not None and not (isinstance(threshold, str) and threshold == AUTO):
            return head + ")"
        return f"{head}, threshold: auto by default ({auto_rule(self.default_metric if metric is None else metric)}))"

    def _repr_html_(self) -> str:
        from tdinspect.report import diff_html

        return diff_html(self)


def _peers(more: list, rank: int, p: int, pa, pb) -> tuple[tuple, tuple]:
    """Each side's pass ``p`` in its other ranks, where that side has more ranks than the
    other (``more``: its ``(pass_map, ranks)``, else None; a tensor-parallel run against a
    smaller one): its shape mismatches are hinted as shards
    (:func:`tdinspect.compare.passes._hint_shards`); ``((), ())`` else. O(ranks) a pass."""
    if pa is None or pb is None:
        return (), ()
    out = []
    for side in more:
        if side is None:
            out.append(())
            continue
        pass_map, ranks = side
        found = (pass_map.get((r, p)) for r in ranks if r != rank)
        out.append(tuple(pi for pi in found if pi is not None))
    return out[0], out[1]


def _has_checksums(pi) -> bool:
    return bool(pi.checksum) and any(c is not None for c in pi.checksum)


def _no_checksums(name: str, side) -> str:
    """Why ``metric='equal'`` cannot compare a statistics-only side: never captured with
    checksums, or a derived dump (``narrow``, ``concat``, ``unshard``) of one that was: its
    entries are parts of stored tensors, and a checksum fingerprints a whole tensor."""
    derived = [pi for pi in side.pass_indexes() if isinstance(pi, LogicalPass)]
    if derived and any(_has_checksums(src) for pi in derived for src in pi.sources.values()):
        what = f" ({visible(derived[0].what)})" if derived[0].what else ""
        return (
            f"metric='equal' on a statistics-only diff compares checksums, and {name} ({side.path}) "
            f"is derived by narrow, concat or unshard{what} from a statistics-only run: its entries are parts or assemblies of the "
            "tensors captured, and a checksum fingerprints a whole tensor, so they have none. Compare "
            "the runs as captured; for one batch row against another run, capture both with "
            "checksum=True, checksum_dim=D (a fingerprint per row along D: rows are paired when "
            "shapes differ in D only)"
        )
    return (
        f"metric='equal' on a statistics-only diff compares checksums, and {name} ({side.path}) "
        "has none: capture it with checksum=True"
    )


def _num(v: float):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _part_masks(transform, shape, parts, out_shape) -> list[torch.Tensor] | None:
    """Where each part of B (``slices_of``'s spans in B's shape) lands after ``transform``:
    one boolean mask of ``out_shape`` per part, each element in exactly one. ``None`` when
    the transform does not only move elements (it computes, drops or repeats them)."""
    masks, seen = [], None
    for _label, spans, dim in parts:
        mark = torch.zeros(tuple(shape), dtype=torch.float32)
        for s, n in spans:
            mark.narrow(dim, s, n).fill_(1.0)
        try:
            out = transform(mark)
        except Exception:  # a user's callable: no masks, no rank named
            return None
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(out_shape):
            return None
        if not bool(((out == 0) | (out == 1)).all()):
            return None
        mask = out == 1
        seen = mask.to(torch.int64) if seen is None else seen + mask
        masks.append(mask)
    if seen is None or not bool((seen == 1).all()):
        return None
    return masks
