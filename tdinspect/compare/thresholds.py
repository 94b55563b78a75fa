"""Thresholds and the divergence rule: which rows diverge, and why, in words.

:class:`Thresholds` gives each row its threshold (``"auto"`` from its dtypes
and the coarsest one upstream, :func:`upstream_of`; a number; or by entry
name); :func:`divergent` is the one rule that says which rows diverge, and
:func:`reason_of` / :func:`divergence_of` turn a divergent row into its reason
and its :class:`Divergence`. Diff's answers and live comparison use them alike.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tdinspect.compare.rule import NONFINITE
from tdinspect.naming import split_call
from tdinspect.numerics.metrics import (
    AUTO,
    Metric,
    auto_rule,
    auto_threshold,
    dtype_named,
    metric,
    unit_roundoff,
)
from tdinspect.util.terminal import visible

BEFORE = 5  # entries listed before a divergence
# the reasons of structural rows whose numbers were compared (judged by their numbers' rule,
# never set aside): NaN/Inf on one side, and an op that ran with other non-tensor arguments
# (tdinspect.align.args.arg_difference: "argument 'other' of aten.add.Tensor: 1e-06 vs 1e-05")
COMPARED_REASONS = (NONFINITE, "argument ")


@dataclass
class Divergence:
    """The first entry (in the reference's execution order) past a threshold.

    Attributes
    ----------
    op : str
        Entry name without ``::callN``.
    call, pass_, rank : int
        Where it is (0-based call).
    key : str
        The on-disk key (with ``::callN``).
    metric : str
    value : float
        The metric's value (NaN for a structural divergence without one).
    threshold : float
        The threshold actually used for this entry (``"auto"`` resolved).
    reason : str
        Why it counts: ``"rel_diff 5.08e-05 > 1.49e-08 (auto: float32)"`` (an
        ``"auto"`` threshold and where it came from), ``"rel_diff 0.0158 > 0.001"``
        (a number given), ``"shape [2, 3] vs [3, 2]"``,
        ``"only in B"``, ``"NaN/Inf on one side (12 elements)"``...
    order : float
        Its position in the reference pass.
    before : list of (key, value)
        The entries just before it in the same pass and their metric values.
    """

    op: str
    call: int
    pass_: int
    rank: int
    key: str
    metric: str
    value: float
    threshold: float
    reason: str
    order: float
    structural: bool = False
    before: list[tuple[str, float]] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict, repr=False)
    structural_entries: Any = field(default=None, repr=False)

    def __repr__(self) -> str:
        text = (
            f"Divergence({self.key} pass {self.pass_}"
            + (f" rank {self.rank}" if self.rank else "")
            + f": {self.reason}"
        )
        se = self.structural_entries
        if se is not None and len(se):
            shown = "; ".join(f"{k}: {r}" for k, r in zip(se["key"][:3], se["reason"][:3]))
            text += (
                f"; {len(se)} structural entries set aside ({shown}" + ("; ..." if len(se) > 3 else "") + ")"
            )
        return visible(text + ")")  # names from files: printed by a REPL, never terminal controls

    def _repr_html_(self) -> str:
        from tdinspect.report import divergence_html

        return divergence_html(self)


OUTCOMES = ("diverges", "matches", "incomplete")


@dataclass(frozen=True)
class Verdict:
    """A comparison's answer: one of three outcomes, never two.

    Attributes
    ----------
    outcome : {"diverges", "matches", "incomplete"}
        ``"diverges"``: :attr:`divergence` is the first divergent entry.
        ``"matches"``: every entry of both sides (after both sides' selections) was compared
        and none passed its threshold (entries named by ``allow_uncompared`` may have been
        left out), and at least one was compared.
        ``"incomplete"``: nothing diverged among the entries compared, but others were set
        aside (``structural="report"``: one side only, unmatched, another shape) or never
        compared (not stored, a transform a statistics-only dump cannot apply), or nothing
        was compared at all (the selections share no entry, every entry was allowed):
        :attr:`gap` says which and where the comparison stopped.
    divergence : Divergence or None
        The first divergence (``"diverges"`` only).
    gap : str
        What was not compared (the first few, with their reasons) and, when the reference's
        last entries were among them, where the comparison stops; ``""`` unless incomplete.
    compared : int
        Entries compared in numbers (of the passes read: a divergence stops at its pass),
        one-sided copies of an earlier call checked against it included (a recompute).
        ``compared + uncompared + allowed`` accounts for every entry the passes read hold
        on either side after both selections (a pair counts once).
    uncompared : int
        Entries set aside or never compared that no ``allow_uncompared`` pattern names.
    allowed : int
        Entries set aside or never compared that ``allow_uncompared`` names.
    stopped : dict or None
        :meth:`tdinspect.Diff.uncompared_after` (the reference's tail not compared), or None.

    Examples
    --------
    >>> v = DumpSet.open("ref").diff("port", mapping="map.yaml").verdict(structural="report")  # doctest: +SKIP
    >>> v.outcome, v.text                                                                       # doctest: +SKIP
    ('incomplete', 'incomplete: no divergence among the 42 entries compared, but 4 were not ...')
    """

    outcome: str
    divergence: Divergence | None = None
    gap: str = ""
    compared: int = 0
    uncompared: int = 0
    allowed: int = 0
    stopped: dict | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome={self.outcome!r}: expected one of {OUTCOMES}")
        if self.outcome == "matches" and (self.compared < 1 or self.uncompared):
            # the ledger's rule: all compared or allowed, and at least one compared
            raise ValueError(
                f"a verdict of {self.compared} entries compared and {self.uncompared} not is never "
                "'matches' (it is 'incomplete')"
            )

    @property
    def text(self) -> str:
        """The verdict in one line: ``diverges: KEY (pass P): REASON``, ``matches: ...`` or
        ``incomplete: ...`` (names from files escaped)."""
        if self.divergence is not None:
            d = self.divergence
            where = f"pass {d.pass_}" + (f", rank {d.rank}" if d.rank else "")
            return visible(f"diverges: {d.key} ({where}): {d.reason}")
        allowed = f" ({self.allowed} left out by allow_uncompared)" if self.allowed else ""
        if self.outcome == "matches":
            return f"matches: all {self.compared} entries compared, none past its threshold{allowed}"
        if not self.compared:
            return visible(f"incomplete: nothing was compared: {self.gap}{allowed}")
        return visible(
            f"incomplete: no divergence among the {self.compared} entries compared, but {self.gap}{allowed}"
        )

    def __str__(self) -> str:
        return self.text


class Thresholds:
    """The threshold of each row: ``"auto"`` (the default), a number, or ``{regex: value}``.

    ``"auto"`` (or ``None``) derives a row's threshold from its ``dtype_a`` and
    ``dtype_b`` (:func:`tdinspect.numerics.metrics.auto_threshold`, the one rule); a
    number is used for every row; a dict gives the value of the first regex
    matching the entry name (a value may be ``"auto"``), ``"auto"`` where none
    matches. Call it on a row (a mapping with ``op``, ``dtype_a``,
    ``dtype_b``) for the number; :meth:`of_rows` gives a whole frame's.

    Examples
    --------
    >>> t = Thresholds("auto", "rel_diff")
    >>> t({"op": "model.fc", "dtype_a": "torch.float32", "dtype_b": "torch.float32"})
    1.4901161193847656e-08
    >>> Thresholds({"fc": 1e-3}, "rel_diff").source({"op": "model.fc", "dtype_a": "", "dtype_b": ""})
    ''
    """

    def __init__(self, threshold, metric_name: str):
        self.metric = metric(metric_name)
        self.spec = AUTO if threshold is None else threshold
        self.fixed: float | None = None
        self.rules: list[tuple[re.Pattern, float | None]] = []  # None: "auto"
        if isinstance(threshold, str) and threshold != AUTO:
            raise ValueError(
                f"threshold={threshold!r}: expected 'auto', a number or a {{regex: number}} dict"
            )
        if isinstance(threshold, dict):
            self.rules = [
                (_valid_regex(k), None if v == AUTO else _valid_threshold(v, k, self.metric))
                for k, v in threshold.items()
            ]
        elif threshold is not None and threshold != AUTO:
            if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
                raise TypeError(
                    f"threshold must be 'auto', a number or a {{regex: number}} dict, got {threshold!r}"
                )
            self.fixed = _valid_threshold(threshold, metric=self.metric)
        self._cache: dict[tuple, tuple[float, str]] = {}

    def lookup(self, op: str, dtype_a, dtype_b, upstream="") -> tuple[float, str]:
        """``(threshold, source)`` of one entry: source ``""`` for a number given,
        ``"auto: <dtype>"``, ``"auto: <dtype> upstream"`` or ``"default"`` for ``"auto"``.
        ``upstream``: the coarsest floating dtype the pair's data has been through
        (:func:`upstream_of`), used when it is coarser than the entry's own."""
        if self.fixed is not None:
            return self.fixed, ""
        key = (op, dtype_a, dtype_b, upstream) if self.rules else (dtype_a, dtype_b, upstream)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._resolve(op, dtype_a, dtype_b, upstream)
        return hit

    def _resolve(self, op, dtype_a, dtype_b, upstream) -> tuple[float, str]:
        for pattern, value in self.rules:
            if pattern.search(op):
                if value is not None:
                    return value, ""
                break
        value, source = auto_threshold(self.metric.name, dtype_a or "", dtype_b or "")
        if not source.startswith("auto: ") or not upstream:
            return value, source
        own = max(unit_roundoff(dtype_a), unit_roundoff(dtype_b))
        # an integer result is exact whatever it was computed from; a float one carries
        # the error of the coarsest rounding its inputs went through
        if own and (unit_roundoff(upstream) or 0.0) > own:
            return auto_threshold(self.metric.name, upstream, upstream)[0], f"auto: {upstream} upstream"
        return value, source

    @staticmethod
    def _args(row) -> tuple:
        return (row["op"], row.get("dtype_a", ""), row.get("dtype_b", ""), row.get("upstream", "") or "")

    def __call__(self, row) -> float:
        return self.lookup(*self._args(row))[0]

    def source(self, row) -> str:
        """Where ``row``'s threshold came from (``""``: a number given)."""
        return self.lookup(*self._args(row))[1]

    def of_rows(self, rows: pd.DataFrame) -> np.ndarray:
        """The thresholds of a frame's rows (vectorised over distinct names and dtypes)."""
        n = len(rows)
        if self.fixed is not None:
            return np.full(n, self.fixed)
        da, db = rows["dtype_a"].to_numpy(object), rows["dtype_b"].to_numpy(object)
        up = rows["upstream"].to_numpy(object) if "upstream" in rows else np.full(n, "", object)
        ops = rows["op"].to_numpy(object) if self.rules else np.full(n, "", object)
        return np.fromiter((self.lookup(o, a, b, u)[0] for o, a, b, u in zip(ops, da, db, up)), float, n)

    def explain(self, row, value: float) -> str | None:
        """A divergent row's reason in this threshold's own words, or ``None`` for the usual
        ``metric value > threshold (source)`` (a baseline's budget says how many times the
        baseline's error it is: :class:`tdinspect.compare.baseline.Budget`)."""
        return None

    def given(self) -> str:
        """The threshold as given, short: ``1e-05``, ``auto``, ``fc=0.001, else auto``.

        Examples
        --------
        >>> Thresholds({"fc": 1e-3, "norm": "auto"}, "rel_diff").given()
        'fc=0.001, norm=auto, else auto'
        """
        if self.fixed is not None:
            return f"{self.fixed:g}"
        if not self.rules:
            return "auto"
        return (
            ", ".join(f"{p.pattern}={'auto' if v is None else f'{v:g}'}" for p, v in self.rules)
            + ", else auto"
        )

    def describe(self, rows: pd.DataFrame | None = None) -> str:
        """The threshold in words: the number, or ``auto (rule; dtype value, ...)`` with the
        values of the dtypes in ``rows``."""
        if self.fixed is not None:
            return self.given()
        rule = auto_rule(self.metric.name)
        values = {}
        if rows is not None and len(rows):
            up = rows["upstream"] if "upstream" in rows else [""] * len(rows)
            auto = Thresholds(AUTO, self.metric.name)
            for a, b, u in dict.fromkeys(zip(rows["dtype_a"], rows["dtype_b"], up)):
                value, source = auto.lookup("", a, b, u or "")
                if source.startswith("auto: "):
                    values.setdefault(source[6:], value)
        shown = "; ".join(f"{d} {_thr_text(v)}" for d, v in values.items())
        return f"{self.given()} ({rule}" + (f": {shown}" if shown else "") + ")"


SCALE_ONLY = frozenset({"float8_e8m0fnu"})  # exponent-only formats: block scales, never data


def scale_only(dtype: str) -> bool:
    """Whether ``dtype`` (``"torch.float8_e8m0fnu"`` or ``"float8_e8m0fnu"``) only scales other data.

    Such a tensor has no mantissa, so its "unit roundoff" (0.5) says nothing of the precision
    of the values it scales: it must not set the upstream precision of what follows.

    Examples
    --------
    >>> scale_only("torch.float8_e8m0fnu"), scale_only("torch.float8_e4m3fn")
    (True, False)
    """
    return dtype.removeprefix("torch.") in SCALE_ONLY


def upstream_of(dtype_a, dtype_b) -> np.ndarray:
    """The coarsest floating dtype each row's data has been through (names, ``""``: none).

    ``dtype_a`` and ``dtype_b`` are the two sides' dtypes of one (rank, pass),
    in execution order: for each side, the coarsest floating dtype among its
    entries up to and including the row (a cumulative maximum of the unit
    roundoff), and of the two sides the coarser. Integer, bool and unknown
    dtypes do not count, nor do scale-only dtypes (:func:`scale_only`: an MX block's
    exponent scales carry no data's precision). A float32 op on a bfloat16 model's values (an
    upcast RMSNorm, a rotary buffer) gets ``"bfloat16"``.

    Examples
    --------
    >>> upstream_of(["torch.bfloat16", "torch.float32"], ["torch.float32", "torch.float32"]).tolist()
    ['bfloat16', 'bfloat16']
    """
    da, db = np.asarray(dtype_a, object), np.asarray(dtype_b, object)
    n = len(da)
    if not n:
        return np.array([], object)
    codes, distinct = pd.factorize(np.concatenate([da, db]))
    u = np.array(
        [
            (unit_roundoff(d) or 0.0) if isinstance(d, str) and d and not scale_only(d) else 0.0
            for d in distinct
        ]
        + [0.0]
    )  # code -1 (missing): 0
    name_of = {0.0: ""}
    for d, ud in zip(distinct, u.tolist()):
        if ud:
            dt = dtype_named(d)
            name_of.setdefault(ud, str(dt.to_real() if dt.is_complex else dt).removeprefix("torch."))
    per_row = u[codes]
    up = np.maximum(np.maximum.accumulate(per_row[:n]), np.maximum.accumulate(per_row[n:]))
    us = np.array(sorted(name_of))
    return np.array([name_of[x] for x in us.tolist()], object)[np.searchsorted(us, up)]


def threshold_fn(threshold, metric_name: str) -> Thresholds:
    """The per-row threshold of ``threshold`` for ``metric_name`` (see :class:`Thresholds`)."""
    return threshold if isinstance(threshold, Thresholds) else Thresholds(threshold, metric_name)


def _thr_digits(value: float, digits: int) -> int:
    """At least ``digits``, and enough to tell ``value`` from 1 (cosine's ``1 - u/4``)."""
    while digits < 17 and value != 1 and float(f"{value:.{digits}g}") == 1:
        digits += 1
    return digits


def _thr_text(value: float) -> str:
    """A threshold with the digits that make it the number used: 3 significant digits
    (``1.49e-08``, ``75.3``, as the reasons show), and 3 of ``1 - value`` near 1
    (cosine's ``0.999878``, not ``0.9999``)."""
    if 0.9 < value < 1:
        return f"{value:.{min(17, 3 + math.floor(-math.log10(1 - value)))}g}"
    if 1 < abs(value) < 1e15 and value != int(value):  # sqnr_db: one decimal, 162.6 dB
        return f"{value:.{max(3, len(str(int(abs(value)))) + 1)}g}"
    return f"{value:.{_thr_digits(value, 3)}g}"


def divergent(m, values, thresholds, structural, explained) -> np.ndarray:
    """Which rows diverge (a boolean array; scalars work too): the one rule every answer uses.

    Structural problems always do; rows with another reason (never compared,
    e.g. uninitialized) never do; the rest when their metric passes the
    threshold in its bad direction, or could not be computed (NaN: never a
    silent pass).
    """
    values, thresholds = np.asarray(values, float), np.asarray(thresholds, float)
    with np.errstate(invalid="ignore"):
        over = values > thresholds if m.higher_is_worse else values < thresholds
    return np.asarray(structural, bool) | ((over | np.isnan(values)) & ~np.asarray(explained, bool))


def set_aside(structural, reasons) -> np.ndarray:
    """Which rows ``structural="report"`` sets aside (a boolean array): those that differ in
    structure (one side only, unmatched, another shape, a transform that failed, an entry that
    cannot be assembled), not those whose numbers were compared and still count as structural
    (:data:`COMPARED_REASONS`: NaN/Inf on one side, an op called with other arguments: a
    divergence in either mode). The one rule of :class:`~tdinspect.Diff` and live comparison."""
    reasons = np.asarray(reasons, object)
    compared = np.fromiter(
        (isinstance(r, str) and r.startswith(COMPARED_REASONS) for r in reasons.ravel()), bool, reasons.size
    ).reshape(reasons.shape)
    return np.asarray(structural, bool) & ~compared


# the reason of a one-sided call compared with an earlier call of its own side (a recompute,
# tdinspect.compare.replicas): compared in numbers, judged by its metric like a pair
REPLICA = "compared with "


def explained(reasons) -> np.ndarray:
    """Which rows have a reason that is not judged by their metric (a boolean array): every
    reason but a replica's (:data:`REPLICA`), which was compared in numbers."""
    reasons = np.asarray(reasons, object)
    flat = reasons.ravel()
    return np.fromiter(
        (isinstance(r, str) and r != "" and not r.startswith(REPLICA) for r in flat), bool, flat.size
    ).reshape(reasons.shape)


# reasons of rows not compared that need no comparison: an uninitialized tensor holds no value
# (torch.empty), an entry unchanged since a pass was compared there
NOT_NEEDED = ("uninitialized", "unchanged since pass", "compared as tied: ")  # the last: compare/routing.py


def never_compared(structural, reasons) -> np.ndarray:
    """Which rows were never compared though they hold values (a boolean array): not
    structural, with a reason (a tensor not stored on either side, a transform a
    statistics-only dump cannot apply), other than :data:`NOT_NEEDED`."""
    reasons = np.asarray(reasons, object)
    flat = reasons.ravel()
    out = np.fromiter(
        (isinstance(r, str) and r != "" and not r.startswith(NOT_NEEDED + (REPLICA,)) for r in flat),
        bool,
        flat.size,
    ).reshape(reasons.shape)
    return out & ~np.asarray(structural, bool)


def allowed_patterns(patterns) -> list[re.Pattern]:
    """``allow_uncompared`` as compiled regexes: ``None``, one regex or a list of them."""
    if patterns is None:
        return []
    if isinstance(patterns, (str, re.Pattern)):
        patterns = [patterns]
    out = []
    for p in patterns:
        if isinstance(p, re.Pattern):
            out.append(p)
            continue
        out.append(allowed_pattern(p))
    return out


def allowed_pattern(p) -> re.Pattern:
    """One ``allow_uncompared`` regex, compiled; an empty one is refused (``ValueError``): it
    names every entry (an unset shell variable, ``--allow-uncompared ""``), so a B missing
    most of A's entries answered "matches"; ``".*"`` says so on purpose."""
    if isinstance(p, str) and not p.strip():
        raise ValueError(
            f"allow_uncompared {p!r}: an empty pattern would allow every entry; name the entries "
            "(e.g. 'rotary_emb'), or give '.*' to allow all of them"
        )
    try:
        return re.compile(p)
    except (re.error, TypeError) as exc:
        raise ValueError(f"allow_uncompared {p!r}: not a regular expression ({exc})") from None


def allowed_rows(patterns: list[re.Pattern], ops, keys_b, keys=None) -> np.ndarray:
    """Which rows an ``allow_uncompared`` regex names: ``re.search`` on the entry name (A's or
    B's, without ``::callN``) or on the key as a verdict prints it (``keys``: A's key, or B's
    for a B-only row; and B's key), ``::callN`` included, so that ``"::call1"`` or
    ``r"fc1::call1$"`` names that call alone.

    Examples
    --------
    >>> import re
    >>> allowed_rows([re.compile("::call1")], ["fc1", "fc1"], ["fc1", "fc1::call1"], ["fc1", "fc1::call1"]).tolist()
    [False, True]
    """
    ops = list(ops)
    if not patterns:
        return np.zeros(len(ops), bool)
    keys = [""] * len(ops) if keys is None else keys
    return np.fromiter(
        (
            any(
                p.search(a) or (k and p.search(k)) or (b and (p.search(split_call(b)[0]) or p.search(b)))
                for p in patterns
            )
            for a, b, k in zip(
                (str(o) for o in ops), (str(k or "") for k in keys_b), (str(k or "") for k in keys)
            )
        ),
        bool,
        len(ops),
    )


def slice_hits(rows: pd.DataFrame, m, thresholds, explained, thr_fn) -> np.ndarray:
    """Which rows diverge by their worst slice (``slice_<metric>``, :mod:`tdinspect.numerics.slices`):
    the rule of the whole (:func:`divergent`, the same threshold) applied to each slice of a
    pair made of slices (decode calls, ranks, token rows). A slice not judged (NaN: the pair is
    not made of slices, or that metric has none) never diverges by itself; thresholds that are
    not a rule of dtypes (a baseline's budget, set by the baseline's whole error) leave the
    slices unjudged."""
    col = f"slice_{m.name}"
    if col not in rows or not getattr(thr_fn, "per_slice", True):
        return np.zeros(len(rows), bool)
    values = rows[col].to_numpy(float)
    with np.errstate(invalid="ignore"):
        over = values > thresholds if m.higher_is_worse else values < thresholds
    return over & ~np.isnan(values) & ~np.asarray(explained, bool)


def judged_value(row, m, thr: float, thr_fn=None) -> tuple[float, bool]:
    """``(value, from a slice)``: the row's metric, or its worst slice's where only that
    passes ``thr`` (:func:`slice_hits`)."""
    value = row[m.name]
    sliced = row.get(f"slice_{m.name}", math.nan) if hasattr(row, "get") else math.nan
    if (
        getattr(thr_fn, "per_slice", True)
        and value is not None
        and not math.isnan(value)
        and not m.diverges(value, thr)
        and sliced is not None
        and not math.isnan(sliced)
        and m.diverges(sliced, thr)
    ):
        return float(sliced), True
    return value, False


def reason_of(row, m, thr_fn) -> str:
    """The reason text of a row :func:`divergent` marked (with where an ``"auto"``
    threshold came from: ``rel_diff 5.08e-05 > 1.49e-08 (auto: float32)``); a row that
    diverges by a slice only says so (``... in a slice (the whole: rel_diff 2.9e-09)``)."""
    if row["structural"]:
        return row["reason"]
    copy = _replica_of(row)
    value = row[m.name]
    if value is None or math.isnan(value):
        return f"{copy}{m.name} could not be computed"
    thr_fn = threshold_fn(thr_fn, m.name)
    value, sliced = judged_value(row, m, thr_fn(row), thr_fn)
    if sliced:
        whole = dict(row)
        whole[m.name] = value
        return f"{reason_of(whole, m, thr_fn)} in a slice (the whole: {m.name} {row[m.name]:.3g})"
    own = thr_fn.explain(row, value)
    if own:
        return copy + own
    return copy + _past(m, thr_fn, row, value)


def _replica_of(row) -> str:
    """``B's fc1::call1 differs from its call 0 (a recompute?): `` for a one-sided copy
    compared with its own side's earlier call (:mod:`tdinspect.compare.replicas`), else ``""``."""
    reason = row.get("reason", "")
    if not (isinstance(reason, str) and reason.startswith(REPLICA)):
        return ""
    side, call = reason[len(REPLICA) :].split(": ", 1)[0].split("'s call ")
    return f"{side}'s {row['key']} differs from its call {call} (a recompute?): "


def _past(m, thr_fn, row, value) -> str:
    """``metric value > threshold (source)`` of a row past its threshold."""
    thr, source = thr_fn.lookup(*thr_fn._args(row))
    op = ">" if m.higher_is_worse else "<"
    q = digits_apart(value, thr)
    if not source:  # a number given: as it was written (never rounded to 1)
        return f"{m.name} {value:.{q}g} {op} {thr:.{_thr_digits(thr, 6)}g}"
    return f"{m.name} {value:.{q}g} {op} {thr:.{q}g} ({source})"


def digits_apart(value: float, thr: float) -> int:
    """Significant digits (at least 3) that show ``value`` and ``thr`` apart, and neither
    as 1 unless it is: ``cosine 0.99999773 < 0.99999999``."""
    for p in range(3, 18):
        q = _thr_digits(thr, p)
        if f"{value:.{q}g}" != f"{thr:.{q}g}":
            return q
    return q


def divergence_of(row: dict, m, thr_fn, before: list, listed=None, located: str = "") -> Divergence:
    """The :class:`Divergence` of a divergent row; ``before``: ``(key, value)`` of the entries
    just before it; ``listed``: structural entries set aside (``structural="report"``);
    ``located``: which parts of an assembled entry differ."""
    return Divergence(
        row["op"],
        int(row["call"]),
        int(row["pass"]),
        int(row["rank"]),
        row["key"],
        m.name,
        float(judged_value(row, m, thr_fn(row), thr_fn)[0]),
        thr_fn(row),
        reason_of(row, m, thr_fn) + located,
        float(row["order"]),
        bool(row["structural"]),
        before,
        row,
        listed,
    )


# the thresholds a metric's values can meet: outside, every entry diverges (a negative rel_diff,
# a cosine above 1) or none can (a cosine below -1)
_RANGES = {"cosine": (-1.0, 1.0), "equal": (0.0, 1.0)}


def _valid_threshold(value, pattern: str | None = None, metric: Metric | None = None) -> float:
    where = f"threshold for {pattern!r}" if pattern is not None else "threshold"
    try:
        if isinstance(value, bool):  # float(True) is 1.0
            raise TypeError
        out = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: 10**400
        raise ValueError(f"{where}: expected a number a float can hold, got {str(value)[:40]!r}") from None
    if math.isnan(out):
        raise ValueError(f"{where}: NaN compares false with everything (nothing would diverge)")
    if metric is None:
        return out
    low, high = _RANGES.get(metric.name, (0.0 if metric.higher_is_worse else -math.inf, math.inf))
    if not low <= out <= high:
        raise ValueError(
            f"{where}={value!r}: {metric.name} takes thresholds from {low:g} to {high:g} (outside, "
            f"{'every entry or none' if metric.name in _RANGES else 'every entry, identical ones too,'} "
            "would diverge)"
        )
    return out


def _valid_regex(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"threshold regex {pattern!r}: {exc}") from None
