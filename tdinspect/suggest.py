r"""suggest_mapping: propose the rules that line two differently written runs up.

Evidence, strongest first, from one pass of each side (metadata, and tensors
where both sides stored them):

1. identical names with the same shape (no rule needed);
2. values: an A tensor equal (``rel_diff <= tol``) to a B tensor, or to a
   slice of one along one dim (a fused projection: ``qkv`` whose chunks are
   ``q``, ``k`` and ``v``), giving ``chunk(n, d)[i]`` or ``narrow(d, start, len)``;
   several equal candidates are resolved by execution order when the counts
   agree;
3. execution order and shapes between entries already paired, with module
   types where they agree.

Pairs below ``min_confidence`` are listed (``pairs``, ``used=False``), never
turned into rules. Per-layer pairs that share a pattern become one rule
(``model\.layers\.(\d+)\.self_attn\.q_proj`` -> ``model.blocks.\1.attn.qkv``)
when that rule gives exactly the proposed partner for every A entry it covers.

Examples
--------
>>> s = suggest_mapping(DumpSet.open("hf"), DumpSet.open("port"))   # doctest: +SKIP
>>> s.save("map.yaml"); s.pairs                                      # doctest: +SKIP
>>> DumpSet.open("hf").diff("port", mapping=s.rules)                # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tdinspect.align.mapping import Mapping
from tdinspect.naming import split_call
from tdinspect.numerics.metrics import compare_tensors
from tdinspect.util.terminal import visible

PAIR_COLUMNS = ["a", "b", "transform", "confidence", "evidence", "used"]
MAX_OFFSETS = 64


@dataclass
class _Side:
    """The call-0 entries of one pass: names, shapes, types, tensors on demand."""

    pi: Any
    names: list[str]
    index: list[int]
    loaded: dict | None = None
    _fp: dict = field(default_factory=dict)

    @classmethod
    def of(cls, pi) -> _Side:
        names, index = [], []
        for i, key in enumerate(pi.keys):
            base, call = split_call(key)
            if call == 0:
                names.append(base)
                index.append(i)
        return cls(pi, names, index)

    def shape(self, n: int) -> tuple:
        return tuple(self.pi.shape[self.index[n]] or ())

    def mtype(self, n: int) -> str:
        return self.pi.module_type[self.index[n]] or ""

    def has_tensor(self, n: int) -> bool:
        i = self.index[n]
        return (
            self.loaded is not None
            and not self.pi.uninitialized[i]
            and (self.pi.stored[i] or bool(self.pi.ref[i]))
        )

    def tensor(self, n: int) -> torch.Tensor:
        return self.pi.tensor(self.pi.keys[self.index[n]], self.loaded)

    def fingerprint(self, n: int, dim: int | None = None, start: int = 0, length: int = 0):
        """``(sum, l2 norm, numel)`` in float64 of the entry or of a slice of it (cached)."""
        k = (n, dim, start, length)
        if k not in self._fp:
            t = self.tensor(n)
            if dim is not None:
                t = t.narrow(dim, start, length)
            t = t.detach().to(torch.float64) if t.is_floating_point() else t.detach().double()
            s, q = float(t.sum()), float(t.pow(2).sum())
            self._fp[k] = (s, math.sqrt(q), t.numel()) if math.isfinite(s + q) else None
        return self._fp[k]


def _close(fa, fb, tol: float) -> bool:
    """A necessary condition for ``rel_diff(a, b) <= tol`` (no false negatives):
    ``|sum a - sum b| <= sqrt(n) ||a - b||`` and ``| ||a|| - ||b|| | <= ||a - b||``."""
    if fa is None or fb is None:
        return False
    d = math.sqrt(tol * (fa[1] ** 2 + fb[1] ** 2)) * (1 + 1e-9) + 1e-300
    return abs(fa[1] - fb[1]) <= d and abs(fa[0] - fb[0]) <= math.sqrt(fa[2]) * d


def _slice_spec(size_b: int, size_a: int, start: int, dim: int, ndim: int) -> str:
    d = dim - ndim  # from the end: robust to extra leading dims
    if size_b % size_a == 0 and start % size_a == 0:
        return f"chunk({size_b // size_a}, {d})[{start // size_a}]"
    return f"narrow({d}, {start}, {size_a})"


def _same_type(ta: str, tb: str) -> bool:
    if not ta or not tb:
        return False
    ta, tb = ta.rsplit(".", 1)[-1], tb.rsplit(".", 1)[-1]
    return ta == tb or ta.endswith(tb) or tb.endswith(ta)


class Suggestion:
    """The proposed mapping; use ``.rules`` as ``mapping=``.

    Attributes
    ----------
    rules : dict
        ``{a_regex: b_template | [b_template, transform]}`` built from the
        used pairs (pairs of identical names need no rule).
    pairs : pandas.DataFrame
        ``a``, ``b``, ``transform``, ``confidence``, ``evidence``, ``used``:
        every pair considered, low-confidence ones with ``used=False``.
    unmatched_a, unmatched_b : list of str
        Entry names (without ``::callN``) no used pair covers.
    """

    def __init__(
        self,
        rules: dict,
        pairs,
        unmatched_a: list[str],
        unmatched_b: list[str],
        a_path: str = "",
        b_path: str = "",
    ):
        self.rules, self.pairs = rules, pairs
        self.unmatched_a, self.unmatched_b = unmatched_a, unmatched_b
        self.a_path, self.b_path = a_path, b_path

    def to_yaml(self) -> str:
        """The rules as a mapping file, with what was not used as comments."""
        import yaml

        lines = [
            f"tdinspect suggest-mapping {self.a_path} {self.b_path}",
            f"{int(self.pairs['used'].sum())} pairs used, "
            f"{len(self.unmatched_a)} A and {len(self.unmatched_b)} B entries unmatched",
        ]
        body = yaml.safe_dump(self.rules, sort_keys=False, width=1000) if self.rules else "{}\n"
        tail = [
            f"listed, not used ({r.confidence:.2f}, {r.evidence}): {r.a} -> {r.b}"
            + (f" [{r.transform}]" if r.transform else "")
            for r in self.pairs[~self.pairs["used"]].itertuples()
        ]
        tail += [f"only in A: {n}" for n in self.unmatched_a]
        tail += [f"only in B: {n}" for n in self.unmatched_b]
        # names come from the dumps: one with a newline ended its comment and wrote a rule
        lines, tail = ([f"# {visible(t)}" for t in part] for part in (lines, tail))
        return "\n".join(lines) + "\n" + body + "\n".join(tail) + ("\n" if tail else "")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the rules to ``path`` (JSON for ``.json``, else YAML); returns the path."""
        import json

        from tdinspect.store.format import atomic_write

        path = Path(path)
        text = json.dumps(self.rules, indent=2) + "\n" if path.suffix == ".json" else self.to_yaml()
        atomic_write(path, lambda f: f.write(text.encode()))  # a failed write keeps the old file
        return path

    def __repr__(self) -> str:
        used = int(self.pairs["used"].sum())
        return (
            f"Suggestion({len(self.rules)} rules from {used} pairs; "
            f"{len(self.pairs) - used} listed, not used; unmatched: {len(self.unmatched_a)} in A, "
            f"{len(self.unmatched_b)} in B)"
        )

    def _repr_html_(self) -> str:
        from tdinspect.report import section, styled
        from tdinspect.util.terminal import html_text

        rules = "<br>".join(html_text(f"{k}: {v}") for k, v in self.rules.items()) or "(none)"
        return (
            "<div class='tdinspect'><b>Suggested mapping</b> "
            + html_text(repr(self))
            + section("rules", f"<code>{rules}</code>", count=len(self.rules), open_=True)
            + section("pairs", styled(self.pairs), count=len(self.pairs))
            + section("unmatched in A", html_text(", ".join(self.unmatched_a)), count=len(self.unmatched_a))
            + section("unmatched in B", html_text(", ".join(self.unmatched_b)), count=len(self.unmatched_b))
            + "</div>"
        )


def _check_unit(name: str, value, low: float, high: float) -> None:
    """``ValueError`` unless ``value`` is a number from ``low`` to ``high`` (NaN compares false
    with everything: ``--min-confidence nan`` used no pair and said nothing)."""
    try:
        ok = not isinstance(value, bool) and low <= float(value) <= high
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name}={str(value)[:40]}: expected a number from {low:g} to {high:g}")


def suggest_mapping(
    a,
    b,
    *,
    pass_: int | None = None,
    rank: int | None = None,
    tol: float = 1e-6,
    min_confidence: float = 0.6,
    generalize: bool = True,
) -> Suggestion:
    """Propose mapping rules from ``a`` (reference) to ``b``; see the module docstring.

    Parameters
    ----------
    a, b : DumpSet or path
    pass_, rank : int, optional
        The pass and rank to learn from (default: the first both hold).
    tol : float
        Largest ``rel_diff`` at which two tensors count as the same values.
    min_confidence : float
        Pairs below it are listed, not used.
    generalize : bool
        Fold per-layer pairs into one rule with groups where that is exact.

    Returns
    -------
    Suggestion

    Examples
    --------
    >>> s = suggest_mapping("dumps/hf", "dumps/port")     # doctest: +SKIP
    >>> s.rules                                            # doctest: +SKIP
    {'model\\\\.model\\\\.layers\\\\.(\\\\d+)\\\\.self_attn\\\\.q_proj': ['model.blocks.\\\\1.attn.qkv', 'chunk(2, -1)[0]'], ...}
    """
    import pandas as pd

    from tdinspect.dumpset import DumpSet

    _check_unit("min_confidence", min_confidence, 0.0, 1.0)  # NaN: every pair "not used"
    _check_unit("tol", tol, 0.0, math.inf)
    a = DumpSet.coerce(a)
    b = DumpSet.coerce(b, client=a.client)
    common = sorted(set(a._passes) & set(b._passes), key=lambda k: (k[1], k[0]))
    if pass_ is not None or rank is not None:
        common = [k for k in common if (pass_ is None or k[1] == pass_) and (rank is None or k[0] == rank)]
    if not common:
        raise ValueError(
            f"{a.path} and {b.path} hold no common pass"
            + (f" (pass {pass_}, rank {rank})" if pass_ is not None or rank is not None else "")
        )
    A, B = _Side.of(a._passes[common[0]]), _Side.of(b._passes[common[0]])
    if not (A.pi.stats_only or B.pi.stats_only or A.pi.files.tensors is None or B.pi.files.tensors is None):
        A.loaded, B.loaded = A.pi.load(), B.pi.load()
    found = _match(A, B, tol)
    used = {n: p for n, p in found.items() if p[2] >= min_confidence}
    rows = [
        {
            "a": A.names[n],
            "b": B.names[j],
            "transform": t or "",
            "confidence": round(c, 3),
            "evidence": ev,
            "used": c >= min_confidence,
        }
        for n, (j, t, c, ev) in sorted(found.items())
    ]
    pairs = pd.DataFrame(rows, columns=PAIR_COLUMNS)
    partner = {A.names[n]: (B.names[j], t) for n, (j, t, c, _) in used.items()}
    rules = _rules(partner, A.names, set(B.names), generalize)
    taken = {B.names[j] for j, *_ in used.values()}
    return Suggestion(
        rules,
        pairs,
        [A.names[n] for n in range(len(A.names)) if n not in used],
        [x for x in B.names if x not in taken],
        str(a.path),
        str(b.path),
    )


def _match(A: _Side, B: _Side, tol: float) -> dict[int, tuple]:
    """``{a_index: (b_index, transform or None, confidence, evidence)}``."""
    found: dict[int, tuple] = {}
    b_pos = {name: j for j, name in enumerate(B.names)}
    for n, name in enumerate(A.names):  # 1. same name, same shape
        j = b_pos.get(name)
        if j is not None and A.shape(n) == B.shape(j):
            found[n] = (j, None, 1.0, "same name and shape")
    _match_values(A, B, tol, found)
    _match_order(A, B, tol, found)
    return found


def _candidates(A: _Side, B: _Side, n: int, tol: float, by_shape, by_cut) -> list[tuple[int, str | None]]:
    """B entries (or slices of one along one dim) holding A entry ``n``'s values."""
    fa = A.fingerprint(n)
    if fa is None or fa[2] == 0:
        return []
    shape, ta, out = A.shape(n), None, []
    for j in by_shape.get(shape, ()):
        if B.has_tensor(j) and _close(fa, B.fingerprint(j), tol):
            ta = A.tensor(n) if ta is None else ta
            if compare_tensors(B.tensor(j), ta)["rel_diff"] <= tol:
                out.append((j, None))
    for d in range(len(shape)):
        for j in by_cut.get((d, shape[:d] + shape[d + 1 :]), ()):
            size_b, size_a = B.shape(j)[d], shape[d]
            if size_b <= size_a or not B.has_tensor(j):
                continue
            starts = sorted(set(range(0, size_b - size_a + 1, size_a)) | {size_b - size_a})[:MAX_OFFSETS]
            for start in starts:
                if _close(fa, B.fingerprint(j, d, start, size_a), tol):
                    ta = A.tensor(n) if ta is None else ta
                    if compare_tensors(B.tensor(j).narrow(d, start, size_a), ta)["rel_diff"] <= tol:
                        out.append((j, _slice_spec(size_b, size_a, start, d, len(shape))))
    return out


def _match_values(A: _Side, B: _Side, tol: float, found: dict) -> None:
    if A.loaded is None or B.loaded is None:
        return
    taken_b = {j for j, t, *_ in found.values() if t is None}
    by_shape: dict[tuple, list[int]] = {}
    by_cut: dict[tuple, list[int]] = {}
    for j in range(len(B.names)):
        if j in taken_b:
            continue
        s = B.shape(j)
        by_shape.setdefault(s, []).append(j)
        for d in range(len(s)):
            by_cut.setdefault((d, s[:d] + s[d + 1 :]), []).append(j)
    groups: dict[tuple, list[int]] = {}
    for n in range(len(A.names)):
        if n in found or not A.has_tensor(n):
            continue
        cands = _candidates(A, B, n, tol, by_shape, by_cut)
        if len(cands) == 1:
            j, t = cands[0]
            found[n] = (j, t, 0.95 if t is None else 0.9, "values" if t is None else "values of a slice")
        elif cands:
            groups.setdefault(tuple(cands), []).append(n)
    for cands, ns in groups.items():  # equal values in several places: order decides, if counts agree
        if len(cands) == len(ns):
            ordered = sorted(cands, key=lambda c: B.index[c[0]])
            for n, (j, t) in zip(sorted(ns), ordered):
                found[n] = (j, t, 0.8, f"values (one of {len(cands)} equal) and order")
        else:
            for n in ns:
                j, t = cands[0]
                found[n] = (j, t, 0.3, f"values ambiguous: {len(cands)} equal candidates")


def _match_order(A: _Side, B: _Side, tol: float, found: dict) -> None:
    """Pair what is left between anchors (pairs already found, in order) by shape and type."""
    anchors = sorted((n, p[0]) for n, p in found.items() if p[2] >= 0.8)
    taken = {p[0] for p in found.values()}
    bounds = [(-1, -1)] + anchors + [(len(A.names), len(B.names))]
    for (a0, b0), (a1, b1) in zip(bounds, bounds[1:]):
        if b1 <= b0:
            continue  # anchors out of order here: no order to go by
        ga = [n for n in range(a0 + 1, a1) if n not in found]
        gb = [j for j in range(b0 + 1, b1) if j not in taken]
        if not ga or not gb:
            continue
        sa, sb = [A.shape(n) for n in ga], [B.shape(j) for j in gb]
        whole = sa == sb  # the gap lines up one to one: stronger than a partial alignment
        sm = difflib.SequenceMatcher(None, sa, sb, autojunk=False)
        for block in sm.get_matching_blocks():
            for k in range(block.size):
                n, j = ga[block.a + k], gb[block.b + k]
                typed = _same_type(A.mtype(n), B.mtype(j))
                conf = (0.75 if typed else 0.5) if whole else (0.5 if typed else 0.35)
                ev = ("order, shape and module type" if typed else "order and shape") + (
                    "" if whole else " (partial alignment)"
                )
                if A.has_tensor(n) and B.has_tensor(j):
                    rd = compare_tensors(B.tensor(j), A.tensor(n))["rel_diff"]
                    if rd > tol:
                        conf, ev = 0.2, f"{ev}; values differ (rel_diff {rd:.2g})"
                found[n] = (j, None, conf, ev)
                taken.add(j)


def _generalize(a: str, b: str) -> tuple[str, str] | None:
    """``(a_regex, b_template)`` with the digit runs of ``a`` that reappear in ``b`` as groups
    (``norm1`` stays literal unless ``b`` holds its 1), or None when none does."""
    parts = re.split(r"(\d+)", a)
    in_b = set(re.findall(r"\d+", b))
    grouped = [v for v in parts[1::2] if v in in_b]
    if not grouped:
        return None
    pattern = "".join(r"(\d+)" if k % 2 and p in in_b else re.escape(p) for k, p in enumerate(parts))

    def sub(m):
        return "\\" + str(grouped.index(m.group(0)) + 1) if m.group(0) in grouped else m.group(0)

    template = re.sub(r"\d+", sub, b.replace("\\", "\\\\"))
    return pattern, template


def _rule_value(b: str, t: str | None):
    return [b, t] if t else b


def _rules(
    partner: dict[str, tuple[str, str | None]], a_names: list[str], b_names: set[str], generalize: bool
) -> dict[str, Any]:
    """Rules reproducing ``partner`` exactly on every A entry (identical names need none)."""
    need = {a: p for a, p in partner.items() if p != (a, None)}
    rules: dict[str, tuple[int, Any]] = {}  # pattern -> (position of its first A entry, value)
    pos = {a: k for k, a in enumerate(a_names)}
    done: set[str] = set()
    if generalize:
        groups: dict[tuple, list[str]] = {}
        for a, (b, t) in need.items():
            g = _generalize(a, b)
            if g is not None:
                groups.setdefault((*g, t), []).append(a)
        for (pattern, template, t), members in groups.items():
            if len(members) < 2:
                continue
            rx = re.compile(pattern)
            ok, covered = True, []
            for a in a_names:  # exact on everything it covers, and nothing it should not
                m = rx.fullmatch(a)
                if m is None:
                    continue
                want = partner.get(a)
                got = (m.expand(template), t)
                if want == got:
                    covered.append(a)
                elif not (want is None and got[0] not in b_names and a not in b_names):
                    ok = False
                    break
            if ok:
                rules[pattern] = (min(pos[a] for a in members), _rule_value(template, t))
                done.update(covered)
    for a, (b, t) in need.items():
        if a not in done:
            rules[re.escape(a)] = (pos[a], _rule_value(b.replace("\\", "\\\\"), t))
    ordered = {k: v for k, (_, v) in sorted(rules.items(), key=lambda kv: kv[1][0])}
    _check(ordered, partner, a_names)
    return ordered


def _check(rules: dict, partner: dict, a_names: list[str]) -> None:
    """The rules must give every used pair (a bug here would pair silently wrong)."""
    m = Mapping(rules)
    for a in a_names:
        if a in partner:
            b, t = m.partner(a)
            got = (b, t.spec if t is not None else None)
            if got != partner[a]:
                raise AssertionError(f"suggest_mapping: rules give {got} for {a!r}, expected {partner[a]}")
