"""MoE routing: top-k expert indices that differ only at near-ties, and the expert rows they gather.

A router picks each token's ``k`` experts by their scores. Two correct runs (float32 and
bfloat16) whose scores for two experts are nearly equal (0.2617 against 0.2616) may pick
them in another order, or pick the other one: the integer indices then differ, and compared
as numbers they "diverge". :func:`judge_routing` looks at each pass's rows after they are
compared:

- an integer ``[tokens, k]`` output whose module (same call) also returns float scores
  ``[tokens, experts]`` (a Hugging Face router's logits) is judged token by token: where A's and
  B's index differ, the two experts' scores must be within the coarser dtype's rule on *both*
  sides (``|s_i - s_j| <= 4u * max |s|`` of the token's row); if every difference is such a
  tie the row is compared as tied (its metrics those of B with the tied picks set to A's, its
  reason says where), else the row stays as it was: a divergence;
- the entries of the experts beside such a router (``<parent>.experts...``) gather token rows by
  the routing: where the two runs route differently, those rows are not the same tokens at the
  same places, and they are set aside with the reason ("set aside: routing differs"), never
  compared position by position. The verdict is then incomplete, never a false alarm and never
  a false "matches". The experts module's own output (``<parent>.experts``, recorded as a
  module with parameters of its own) is a row per token: it is compared on the tokens both
  runs route alike, so a fault in an expert is still named there.
"""

from __future__ import annotations

from typing import Any

import torch

from tdinspect.naming import parse_key
from tdinspect.numerics.metrics import TENSOR_METRICS, compare_tensors, unit_roundoff

TIED = "compared as tied: "  # a row whose integer picks differ only at near-ties (thresholds.NOT_NEEDED)
ROUTING = "set aside: routing differs"
UNITS = 4  # the "auto" rule's units of roundoff


def _parts(key: str):
    try:
        return parse_key(key)
    except ValueError:
        return None


def _is_int(dtype: str) -> bool:
    return unit_roundoff(dtype) == 0.0 and "bool" not in str(dtype)


def _scores_key(pi, key: str, shape) -> str | None:
    """The float ``[tokens, experts]`` output of ``key``'s module and call (the widest)."""
    me = _parts(key)
    if me is None or not me.labels:
        return None
    best = None
    for other, s, dt in zip(pi.keys, pi.shape, pi.dtype):
        p = _parts(other)
        if p is None or other == key or (p.module, p.call, p.op) != (me.module, me.call, me.op):
            continue
        ok = s is not None and len(s) == 2 and s[0] == shape[0] and (unit_roundoff(dt) or 0) > 0
        if ok and (best is None or s[1] > best[1]):
            best = (other, s[1])
    return None if best is None else best[0]


def tie_resolved(ia, ib, sa, sb, units: float = UNITS):
    """B's indices with each pick that differs from A's only at a near-tie set to A's, and the
    ties found ``[(token, slot, expert A, expert B, score A, score B)]``; ``None`` when some
    difference is no tie (or the scores cannot tell)."""
    if ia.shape != ib.shape or ia.dim() != 2 or sa.dim() != 2 or sa.shape != sb.shape:
        return None
    experts = sa.shape[1]
    if int(torch.maximum(ia.max(), ib.max())) >= experts or int(torch.minimum(ia.min(), ib.min())) < 0:
        return None
    u = max(unit_roundoff(sa.dtype) or 0.0, unit_roundoff(sb.dtype) or 0.0)
    a64, b64 = sa.double(), sb.double()
    tol = units * u * torch.maximum(a64.abs().amax(1), b64.abs().amax(1))
    out, ties = ib.clone(), []
    for t, j in (ia != ib).nonzero().tolist():
        ea, eb = int(ia[t, j]), int(ib[t, j])
        da, db = abs(float(a64[t, ea] - a64[t, eb])), abs(float(b64[t, ea] - b64[t, eb]))
        if da > tol[t] or db > tol[t]:
            return None
        out[t, j] = ea
        ties.append((t, j, ea, eb, float(a64[t, ea]), float(a64[t, eb])))
    return out, ties


def judge_routing(rows: list[dict[str, Any]], pa, pb, tensor_a, tensor_b, chunk: int) -> None:
    """Rewrite, in place, the rows of a pass's top-k index entries that differ only at near-ties,
    and set aside the rows of experts whose routing differs (see the module docstring).
    ``tensor_a(key)`` / ``tensor_b(key)`` read a side's tensor."""
    differing: dict[str, str] = {}  # parent module -> why the routing differs
    for row in rows:
        if row["structural"] or row["reason"] or not row["key_b"] or row.get("equal") == 1.0:
            continue
        if not (_is_int(row["dtype_a"]) and _is_int(row["dtype_b"])):
            continue
        shape = pa.shape[pa.position[row["key"]]] if row["key"] in pa.position else None
        if shape is None or len(shape) != 2:
            continue
        ka = _scores_key(pa, row["key"], shape)
        kb = _scores_key(pb, row["key_b"], shape)
        if ka is None or kb is None:
            continue
        ia, ib = tensor_a(row["key"]), tensor_b(row["key_b"])
        found = tie_resolved(ia, ib, tensor_a(ka), tensor_b(kb))
        if found is None:
            continue
        resolved, ties = found
        row.update(compare_tensors(resolved, ia, chunk=chunk))
        shown = "; ".join(
            f"token {t} slot {j}: expert {ea} / {eb}, scores {x:.4g} / {y:.4g}"
            for t, j, ea, eb, x, y in ties[:3]
        )
        more = f"; {len(ties) - 3} more" if len(ties) > 3 else ""
        row["reason"] = f"{TIED}{len(ties)} pick(s) differ only at near-ties of {ka}'s scores ({shown}{more})"
        parent = _parts(row["key"]).module.rsplit(".", 1)[0]
        why = f"{ROUTING}: {row['key']} picks other experts at near-ties ({shown}{more})"
        differing[parent] = (why, len(ia), {t for t, *_ in ties})
    if not differing:
        return
    for row in rows:
        p = _parts(row["key"])
        if p is None or row["reason"] or row["structural"]:
            continue
        for parent, (why, tokens, moved) in differing.items():
            if p.module == parent + ".experts" and _same_tokens(
                row, tokens, moved, tensor_a, tensor_b, chunk
            ):
                break  # the experts' combined output, per token: compared where the routing agrees
            if p.module.startswith(parent + ".experts"):
                row.update(structural=False, reason=f"{why}; its rows are gathered by that routing")
                row.update(dict.fromkeys(TENSOR_METRICS, float("nan")))  # position by position: meaningless
                break


def _same_tokens(row: dict[str, Any], tokens: int, moved: set, tensor_a, tensor_b, chunk: int) -> bool:
    """Compare, in ``row``, the experts' combined output (``[tokens, ...]``, a row per token) on
    the tokens both runs route alike; ``False`` (nothing changed) where it is not led by the
    router's ``tokens`` rows or every token was routed otherwise."""
    ya, xb = tensor_a(row["key"]), tensor_b(row["key_b"])
    if ya.dim() == 0 or ya.shape != xb.shape or ya.shape[0] != tokens or len(moved) >= tokens:
        return False
    keep = torch.ones(tokens, dtype=torch.bool)
    keep[sorted(moved)] = False
    row.update(compare_tensors(xb[keep], ya[keep], chunk=chunk))
    row.pop("nonfinite_mismatch", None)
    return True
