"""Live comparison: each entry compared with the reference dump's entry as it is produced.

Made by ``tdinspect.capture(model, compare_to=REF, ...)`` and
``tdinspect.capture_ops(..., compare_to=REF)``; loaded only when
``compare_to`` is given. Entries meet by key (or through ``mapping=``, as in
:class:`~tdinspect.Diff`), same call and pass, and each pair goes through
:func:`tdinspect.compare.rule.compare_pair` and the divergence rule
:func:`tdinspect.compare.thresholds.divergent`: the numbers and the verdict are those a
:class:`~tdinspect.Diff` of the reference against a full dump of this run
gives. The first argument of a diff is the reference, so metrics treat the
reference as ``y``.

What is read: the reference's metadata when the capture starts, then one
pass file at a time, memory-mapped, while that pass runs. What is written:
nothing without ``dump_dir``; with it, at the first divergence, the evidence::

    <dump_dir>/evidence/ref/rank<R>_pid<P>/pass<NNNNN>.pt (+ .json)   the reference's entries
    <dump_dir>/evidence/run/rank<R>_pid<P>/pass<NNNNN>.pt (+ .json)   this run's entries

(the divergent entry and the ``before`` entries before it; folders of this comparison's own,
``rank<R>_pid<P>_run2``... when an earlier run, such as a re-run cell, wrote there; documented format:
``tdinspect diff <dump_dir>/evidence/ref <dump_dir>/evidence/run`` shows them),
and with ``on_divergence="record"`` one CSV per pass of every entry's row
(:data:`tdinspect.compare.rule.COLUMNS`) in ``<dump_dir>/live/pass<NNNNN>.csv``.

Known differences from an offline diff: reference entries this run never
produces are reported when the pass ends (``step()``), so a numeric
divergence produced earlier in the pass is raised first even if such a
missing entry comes before it in the reference's order. Reference passes this
run never reaches (the reference has passes 0-3, the run stops after pass 1)
are reported at ``close()`` as never compared (``on_uncompared``), whatever the
structural mode, and make :meth:`LiveCompare.verdict` incomplete: a run stopped
early is not a divergence (an offline diff says ``pass N only in A``, a
divergence unless ``structural="report"``).

Entries set aside (``structural="report"``) or never compared are reported when
their pass ends (``on_uncompared``: one :class:`~tdinspect.errors.UncomparedWarning`
per pass naming the first few, or :class:`~tdinspect.errors.UncomparedError`), but
for those ``allow_uncompared`` names; :meth:`LiveCompare.verdict` is the answer of
the passes compared so far, as :meth:`tdinspect.Diff.verdict` gives it offline.
"""

from __future__ import annotations

import csv
import functools
import io
import math
import os
import sys
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import torch

from tdinspect.align.mapping import Mapping, mapped_key
from tdinspect.compare.pairing import same_ref_pass
from tdinspect.compare.passes import PassJob
from tdinspect.compare.rule import COLUMNS, NOT_STORED, Side, compare_pair, new_row, side_of
from tdinspect.compare.spec import CompareSpec
from tdinspect.compare.thresholds import (
    BEFORE,
    Verdict,
    allowed_patterns,
    allowed_rows,
    divergence_of,
    divergent,
    never_compared,
    scale_only,
    set_aside,
    threshold_fn,
    upstream_of,
)
from tdinspect.dumper.kinds import is_plain, prepare
from tdinspect.dumper.writer import PendingPass
from tdinspect.dumpset import DumpSet
from tdinspect.errors import DivergenceError, UncomparedError, UncomparedWarning
from tdinspect.numerics.metrics import metric as metric_named
from tdinspect.numerics.metrics import unit_roundoff
from tdinspect.numerics.stats import STAT_NAMES, capture_stats
from tdinspect.store.format import atomic_write, rank_dirname, stats_row
from tdinspect.store.restore import restore
from tdinspect.store.runs import new_folder
from tdinspect.util.terminal import visible


def _cell(value: Any) -> Any:
    """A CSV cell that a spreadsheet shows as text: names come from files, and one starting
    with ``=``, ``+``, ``-``, ``@`` (or a tab or carriage return) would be read as a formula
    (``=HYPERLINK(...)``): such text is written after a ``'``, as OWASP advises."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


ACTIONS = ("raise", "warn", "record")
UNCOMPARED_ACTIONS = ("warn", "raise")
SHOWN = 3  # entries named in a pass's report of those not compared


def _as_read(t: torch.Tensor | None, uninitialized: bool):
    """``t`` as an offline diff reads it back from the dump: ``(tensor or None, () -> that
    tensor on the host, why it is not stored or "", shape, dtype, statistics or None)``.

    A plain tensor stays where it is: its statistics are computed there, as the recorder
    computes them, and it is copied to the host once, only when values are needed. A tensor
    that is not plain goes through :func:`~tdinspect.dumper.kinds.prepare`, as the recorder's
    does: dense, dequantized, nested parts joined, an expand as a view of its distinct
    elements, on the host."""
    if t is None or uninitialized:
        shape, dtype = (None, None) if t is None else (list(t.shape), str(t.dtype))
        return None, lambda: None, "", shape, dtype, None
    if is_plain(t):
        t = t.detach()
        # one host copy (to("cpu").contiguous() copies a transposed device tensor twice)
        return t, functools.cache(lambda: t.contiguous().to("cpu")), "", list(t.shape), str(t.dtype), None
    prep = prepare(t)
    if prep.skipped or prep.data is None:
        return None, lambda: None, prep.skipped or "no data", prep.shape, prep.dtype, prep.stats
    data = prep.data.to("cpu")
    if "expand" in (prep.storage or {}):
        host = data.clone().expand(prep.shape)  # never the 4 TB a 10^6 x 10^6 expand would be
    else:
        host = restore(data).contiguous()
    return host, lambda: host, "", prep.shape, prep.dtype, prep.stats


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a later in-place change of ``b`` may show in ``a`` (when unsure: yes)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return True


def _stats_as_dumped(stats: torch.Tensor) -> dict[str, float]:
    """The statistics a sidecar would give a reader (rounded as the writer rounds them)."""
    row = stats_row(stats.tolist())
    return dict(zip(STAT_NAMES, (math.nan if v is None else float(v) for v in row)))


def _first_outside() -> int:
    """The ``stacklevel`` of the first caller outside tdinspect, for a warning given by the
    function that calls this one (captures reach it through different depths)."""
    package = str(Path(__file__).resolve().parents[1])
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class LiveCompare:
    """The comparison state of one capture; see the module docstring.

    Parameters
    ----------
    reference : str or Path or DumpSet
        The reference dump (its first argument in an offline diff).
    metric, threshold
        As for :meth:`tdinspect.Diff.first_divergence` (``stats_rel`` and
        statistics-only comparison when the reference holds statistics only).
    on_divergence : {"raise", "warn", "record"}
    mapping : Mapping, dict or path, optional
        Rules pairing reference entries with this run's (see :class:`tdinspect.align.Mapping`).
    structural : {"diverge", "report"}
        As for :meth:`tdinspect.Diff.first_divergence`: ``"report"`` sets entries on one
        side only, unmatched or of another shape aside (listed in :attr:`set_aside`)
        instead of diverging there (a port whose reference has entries it lacks).
    on_uncompared : {"warn", "raise"}
        What to do when a pass ends with entries set aside or never compared (not named
        by ``allow_uncompared``): one :class:`~tdinspect.errors.UncomparedWarning` per pass
        naming the first few (the default), or :class:`~tdinspect.errors.UncomparedError`.
    allow_uncompared : str or list of str, optional
        Entries that may be one-sided or never compared by design, as for
        :class:`tdinspect.Diff`: never a divergence for it, never reported.
    evidence_dir : Path, optional
        Where evidence and records go (``dump_dir``); ``None`` writes nothing.
    rank : int
        This process's rank (which reference rank it meets).
    before : int
        Entries kept before a divergence (in ``Divergence.before`` and the evidence).
    """

    def __init__(
        self,
        reference,
        *,
        metric: str | None = None,
        threshold=None,
        on_divergence: str = "raise",
        mapping=None,
        evidence_dir=None,
        rank: int = 0,
        before: int = BEFORE,
        chunk: int = 1 << 18,
        level: str = "module",
        structural: str = "diverge",
        on_uncompared: str = "warn",
        allow_uncompared=None,
    ):
        if on_uncompared not in UNCOMPARED_ACTIONS:
            raise ValueError(f"on_uncompared={on_uncompared!r}: expected one of {UNCOMPARED_ACTIONS}")
        self.on_uncompared = on_uncompared
        self.allow = allowed_patterns(allow_uncompared)
        self.uncompared: list[dict[str, Any]] = []  # rows set aside or never compared, not allowed
        self.counts = {"compared": 0, "uncompared": 0, "allowed": 0}
        if on_divergence not in ACTIONS:
            raise ValueError(f"on_divergence={on_divergence!r}: expected one of {ACTIONS}")
        if structural not in ("diverge", "report"):
            raise ValueError(f"structural={structural!r}: expected 'diverge' or 'report'")
        self.report = structural == "report"
        self.set_aside: list[dict[str, Any]] = []  # structural rows, with structural="report"
        self.ref = reference if isinstance(reference, DumpSet) else DumpSet.open(reference)
        self.mode = "stats" if self.ref.stats_only else "tensor"
        name = metric if metric is not None else ("stats_rel" if self.mode == "stats" else "rel_diff")
        if self.mode == "stats" and name != "stats_rel":
            raise ValueError(
                f"compare_to={str(self.ref.path)!r} holds statistics only: "
                f"use metric='stats_rel', not {name!r}"
            )
        self.metric = metric_named(name)
        self.threshold = threshold_fn(threshold, name)
        self.action = on_divergence
        self.mapping = Mapping.coerce(mapping)
        self.evidence_dir = None if evidence_dir is None else Path(evidence_dir)
        self.rank, self.level, self.before, self.chunk = rank, level, before, chunk
        self.first = None  # the first Divergence
        self.evidence: Path | None = None
        self.made: list[Path] = []  # the folders this comparison made (rows, evidence)
        self._rows_folder: Path | None = None  # where record mode's CSVs go, made at the first
        self.rows: list[dict[str, Any]] = []  # every row so far ("record"); else this pass's
        self._pass: int | None = None
        self._reached: set[int] = set()  # passes this run produced or ended
        self._warned: set[int] = set()
        self.spec = CompareSpec(  # the one value an offline Diff of this comparison holds
            mapping=self.mapping,
            structural=structural,
            metric=metric,
            threshold=threshold,
            allow_uncompared=tuple(p.pattern for p in self.allow),
        )

    # -- per pass -----------------------------------------------------------------------
    def _open_pass(self, pass_: int) -> None:
        pi = self.ref.pass_map.get((self.rank, pass_))
        reason = ""
        if self.rank not in self.ref.ranks:
            reason = f"rank {self.rank} only in B"
        elif pi is None:
            reason = f"pass {pass_} only in B"
        self._pass, self._pi, self._loaded = pass_, pi, None
        self._reached.add(pass_)
        self._job = PassJob(
            self.rank, pass_, pi, None, None, "name", self.mode, self.chunk, reason, self.mapping
        )
        self._matched: set[int] = set()
        self._last = -0.5
        self._pass_rows: list[dict[str, Any]] = []
        self._pass_uncompared: list[dict[str, Any]] = []
        self._coarsest = {"dtype_a": (0.0, ""), "dtype_b": (0.0, "")}  # running, per side
        self._ring: deque = deque(maxlen=self.before + 1)  # (B key, host copy or None, A indices)
        self._partners: dict[str, list[int]] = {}
        if pi is not None:
            for i, key in enumerate(pi.keys):
                b_key = key if self.mapping is None else mapped_key(self.mapping, key)
                self._partners.setdefault(b_key, []).append(i)

    def _ref_files(self):
        if self._loaded is None:
            self._loaded = self._pi.load()  # memory-mapped; dropped when the pass ends
        return self._loaded

    def entry(
        self,
        key: str,
        tensor: torch.Tensor | None,
        *,
        pass_: int,
        uninitialized: bool = False,
        module_type: str = "",
        ref=None,
        call_args=None,
    ) -> None:
        """Compare one entry of this run (called as it is recorded); ``ref``: the sidecar
        reference of an entry unchanged since an earlier pass (a parameter)."""
        if pass_ != self._pass:
            self._open_pass(pass_)
        pi = self._pi
        data, host, skipped, shape, dtype, stats = _as_read(tensor, uninitialized)
        # statistics at most once, whatever the number of reference partners
        b_side = Side(
            shape,
            bool(uninitialized),
            functools.cache(lambda: _stats_as_dumped(capture_stats(data) if stats is None else stats)),
            host,
            f"B: {NOT_STORED}{skipped}" if skipped else "",
            call_args=call_args,
            dtype=dtype,
        )
        dtype_b = dtype or ""
        partners = self._partners.get(key, [])
        if not partners:
            row = new_row(self.rank, pass_, key, key, self._last + 0.5, "", dtype_b, shape)
            row.update(structural=True, reason=self._job.unmatched(None, 0))
            rows = [row]
        else:
            rows = []
            for ia in partners:
                self._matched.add(ia)
                self._last = float(ia)
                a_key = pi.keys[ia]
                row = new_row(self.rank, pass_, a_key, key, float(ia), pi.dtype[ia], dtype_b, pi.shape[ia])
                rows.append(row)
                same = None if ref is None or pi.uninitialized[ia] else same_ref_pass(pi.ref[ia], ref)
                if same is not None:
                    row["reason"] = f"unchanged since pass {same} (compared there)"
                    continue
                transform = None if self.mapping is None else self._job.transform(a_key)
                compare_pair(
                    row, side_of(pi, ia, self._ref_files, "A"), b_side, transform, self.mode, self.chunk
                )
        keep = host() if self.evidence_dir is not None and data is not None else None
        if keep is not None and _shares_memory(keep, tensor):
            keep = keep.clone()  # the model may change its output in place later
        self._ring.append((key, keep, module_type, partners))
        for row in rows:
            self._judge(row)

    def end_pass(self, pass_: int) -> None:
        """Reference entries this run never produced in the pass: structural, as in a diff."""
        if self._pass != pass_:
            self._open_pass(pass_)
        pi = self._pi
        missing = [] if pi is None else [i for i in range(len(pi.keys)) if i not in self._matched]
        try:
            for ia in missing:
                row = new_row(self.rank, pass_, pi.keys[ia], "", float(ia), pi.dtype[ia], "", pi.shape[ia])
                row.update(structural=True, reason=self._job.unmatched(ia, None))
                self._judge(row)
        finally:
            if self.action == "record" and self.evidence_dir is not None:
                self._saved(f"the rows of pass {pass_}", lambda: self._write_rows(pass_))
            self._pass, self._loaded = None, None
        self._report_uncompared(pass_)

    def finish(self) -> None:
        """At ``close()``: the reference's passes (of this rank) this run never reached, each
        entry never compared (unless ``allow_uncompared`` names it), reported once
        (``on_uncompared``). Nothing after a divergence: the verdict is that divergence."""
        if self.first is not None:
            return
        unreached = sorted(p for r, p in self.ref.pass_map if r == self.rank and p not in self._reached)
        rows = []
        for p in unreached:
            pi = self.ref.pass_map[(self.rank, p)]
            for i, key in enumerate(pi.keys):
                row = new_row(self.rank, p, key, "", float(i), pi.dtype[i], "", pi.shape[i])
                row["reason"] = f"pass {p} only in A: this run stopped before it"  # never compared
                if allowed_rows(self.allow, [row["op"]], [""], [key])[0]:
                    self.counts["allowed"] += 1
                    continue
                self.counts["uncompared"] += 1
                self.uncompared.append(row)
                rows.append(row)
        if not rows:
            return
        n, passes = len(rows), ", ".join(map(str, unreached))
        self._say_uncompared(
            f"tdinspect: live comparison: this run stopped before the reference's "
            f"pass{'es' if len(unreached) > 1 else ''} {passes}: their {n} "
            f"{'entry was' if n == 1 else 'entries were'} never compared",
            rows,
        )

    def _report_uncompared(self, pass_: int) -> None:
        """The pass's entries set aside or never compared: one warning, or an error."""
        rows = self._pass_uncompared
        if not rows:
            return
        n = len(rows)
        shown = "; ".join(f"{r['key']}: {r['reason']}" for r in rows[:SHOWN]) + ("; ..." if n > SHOWN else "")
        self._say_uncompared(
            f"tdinspect: live comparison, pass {pass_}: {n} "
            f"{'entry was' if n == 1 else 'entries were'} set aside or never compared ({shown})",
            rows,
        )

    def _say_uncompared(self, text: str, rows: list) -> None:
        """One :class:`UncomparedWarning` or :class:`UncomparedError` (``on_uncompared``)."""
        text += "; allow_uncompared= names those one-sided by design"
        if self.on_uncompared == "raise":
            raise UncomparedError(text, rows)
        # names from the files; said at the user's step() or close(), however deep it was called
        warnings.warn(visible(text), UncomparedWarning, stacklevel=_first_outside())

    def verdict(self) -> Verdict:
        """The answer of the passes compared so far, as :meth:`tdinspect.Diff.verdict` gives it
        for the reference against a full dump of this run (no ``stopped``: live comparison
        does not know the reference's tail until the run ends)."""
        if self.first is not None:
            return Verdict("diverges", self.first, **self.counts)
        if not self.counts["uncompared"] and self.counts["compared"]:
            return Verdict("matches", **self.counts)
        if not self.counts["uncompared"]:  # never "matches" on nothing compared
            return Verdict("incomplete", None, "no entry of the reference was compared yet", **self.counts)
        rows, n = self.uncompared, self.counts["uncompared"]
        shown = "; ".join(f"{r['key']} (pass {r['pass']}): {r['reason']}" for r in rows[:SHOWN]) + (
            "; ..." if n > SHOWN else ""
        )
        gap = f"{n} {'entry was' if n == 1 else 'entries were'} set aside or never compared ({shown})"
        return Verdict("incomplete", None, gap, **self.counts)

    # -- verdicts -----------------------------------------------------------------------
    def _judge(self, row: dict[str, Any]) -> None:
        earlier = self._pass_rows[-self.before :] if self.before else []
        row["upstream"] = self._upstream(row)
        self._pass_rows.append(row)
        if self.action == "record":
            self.rows.append(row)
        layout = bool(set_aside(row["structural"], row["reason"]))  # Diff._layout_rows
        never = bool(never_compared(row["structural"], row["reason"]))
        if (layout or never) and allowed_rows(self.allow, [row["op"]], [row["key_b"]], [row["key"]])[0]:
            self.counts["allowed"] += 1  # one-sided by design: never a divergence (as offline)
            return
        if (layout and self.report) or never:
            self.counts["uncompared"] += 1
            self.uncompared.append(row)
            self._pass_uncompared.append(row)
            if layout:
                self.set_aside.append(row)  # structure, not numbers
            return
        if not layout:
            self.counts["compared"] += 1
        m = self.metric
        if not divergent(m, row[m.name], self.threshold(row), row["structural"], row["reason"] != ""):
            return
        div = divergence_of(row, m, self.threshold, [(r["key"], float(r[m.name])) for r in earlier])
        if self.first is None:
            self.first = div
            if self.evidence_dir is not None:
                self.evidence = self._saved("the evidence", lambda: self._write_evidence(div))
        if self.action == "raise":
            raise DivergenceError(div, self.evidence)
        if self.action == "warn" and div.pass_ not in self._warned:
            self._warned.add(div.pass_)
            warnings.warn(
                visible(
                    f"tdinspect: live comparison, first divergence of pass "
                    f"{div.pass_}: {div.key} (call {div.call}): {div.reason}"
                ),
                RuntimeWarning,
                stacklevel=5,
            )  # names from the reference's files

    def _upstream(self, row: dict[str, Any]) -> str:
        """The coarsest floating dtype either side went through so far in this pass
        (:func:`tdinspect.compare.thresholds.upstream_of`, kept as a running maximum)."""
        for side in ("dtype_a", "dtype_b"):
            u = unit_roundoff(row[side]) if row[side] and not scale_only(row[side]) else None
            if u and u > self._coarsest[side][0]:
                self._coarsest[side] = (u, upstream_of([row[side]], [""])[0])
        return max(self._coarsest.values())[1]

    def table(self):
        """The rows compared so far as a ``pandas.DataFrame`` (:data:`~tdinspect.compare.rule.COLUMNS`);
        every pass with ``on_divergence="record"``, else the current pass."""
        import pandas as pd

        rows = self.rows if self.action == "record" else getattr(self, "_pass_rows", [])
        return pd.DataFrame(rows, columns=COLUMNS)

    # -- files ----------------------------------------------------------------------------
    def _saved(self, what: str, write):
        """``write()``'s result, or ``None`` with a warning when the disk refuses it (full, read
        only): the divergence is the result and is reported whatever happens to its files."""
        try:
            return write()
        except OSError as exc:
            warnings.warn(
                visible(
                    f"tdinspect: live comparison: {what} could not be written under {self.evidence_dir} ({exc})"
                ),
                RuntimeWarning,
                stacklevel=6,
            )
            return None

    def _write_rows(self, pass_: int) -> None:
        if self._rows_folder is None:  # this comparison's own (a re-run cell: live_run2)
            self._rows_folder = new_folder(self.evidence_dir, "live")
            self.made.append(self._rows_folder)
        folder = self._rows_folder
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: _cell(v) for k, v in row.items()} for row in self._pass_rows)
        atomic_write(folder / f"pass{pass_:05d}.csv", lambda f: f.write(text.getvalue().encode()))

    def _write_evidence(self, div) -> Path:
        """The divergent entry and those before it, both sides, as two small dumps."""
        root = self.evidence_dir / "evidence"
        ring = list(self._ring)
        run_keys = [k for k, _, _, _ in ring]
        run_tensors = [t for _, t, _, _ in ring]
        # folders of this comparison's own: evidence an earlier run wrote is never replaced
        # (a re-run cell has the same pid: its evidence replaced the first's, or mixed with it)
        self.made.append(new_folder(root / "run", rank_dirname(self.rank, os.getpid())))
        self._write_pass(
            self.made[-1],
            div.pass_,
            run_keys,
            run_tensors,
            [mt for _, _, mt, _ in ring],
            stats=None,
        )
        pi = self._pi
        if pi is not None:
            a_idx = [ia for _, _, _, partners in ring for ia in partners]
            if div.key in pi.position and pi.position[div.key] not in a_idx:
                a_idx.append(pi.position[div.key])  # an entry missing from this run
            stats_only = pi.stats_only or pi.files.tensors is None
            tensors = [
                None if stats_only or pi.uninitialized[i] else pi.tensor(pi.keys[i], self._ref_files())
                for i in a_idx
            ]
            self.made.append(new_folder(root / "ref", rank_dirname(self.rank, 0)))
            self._write_pass(
                self.made[-1],
                div.pass_,
                [pi.keys[i] for i in a_idx],
                tensors,
                [pi.module_type[i] for i in a_idx],
                stats=[pi.ensure_stats()[i].tolist() for i in a_idx] if stats_only else None,
                shapes=[pi.shape[i] for i in a_idx],
                dtypes=[pi.dtype[i] for i in a_idx],
                stats_only=stats_only,
            )
        return root

    def _write_pass(
        self,
        folder: Path,
        pass_: int,
        keys,
        tensors,
        module_types,
        *,
        stats,
        shapes=None,
        dtypes=None,
        stats_only: bool = False,
    ) -> None:
        shapes = shapes or [None if t is None else list(t.shape) for t in tensors]
        dtypes = dtypes or [None if t is None else str(t.dtype) for t in tensors]
        rows = stats if stats is not None else [None if t is None else capture_stats(t) for t in tensors]
        present = [torch.as_tensor(r, dtype=torch.float64) for r in rows if r is not None]
        p = PendingPass(
            pass_,
            folder,
            {
                "rank": self.rank,
                "pid": os.getpid(),
                "level": self.level,
                "stats_only": stats_only,
                "evidence": True,
            },
            keys=list(keys),
            tensors=list(tensors),
            stats=list(rows),
            columns={
                "module_type": list(module_types),
                "shape": list(shapes),
                "dtype": list(dtypes),
                "stored": [t is not None and not stats_only for t in tensors],
            },
            host_stats=torch.stack(present) if present else None,
        )
        p.write(fsync=False)
