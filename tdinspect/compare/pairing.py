"""Pairing: which A entry meets which B entry of a pass, from metadata alone.

By name (same key), through a :class:`~tdinspect.align.Mapping` (an A entry meets
the B entry its rule names, same call), or by a sequence alignment of
``(op, labels, shape)`` signatures; then whether a pair's layouts agree (shapes,
after a transform), whether both sides say an entry is unchanged since an
earlier pass (sidecar references), and how an assembled entry is put together.
Nothing here reads a tensor.
"""

from __future__ import annotations

import difflib
from typing import Any

from tdinspect.align.logical import LogicalPass, describe
from tdinspect.align.mapping import mapped_key
from tdinspect.errors import TransformError
from tdinspect.naming import parse_key, split_call
from tdinspect.store.passindex import PassIndex

ISLAND = 3  # a matched run shorter than this, with unmatched entries on both sides of it, is not trusted


def _signature(pi: PassIndex, i: int) -> tuple:
    """What sequence alignment pairs on: the op (or module type), its output labels and shape,
    and its phase: an op-level entry run by autograd's backward has no module call
    (``module_call`` None), one run in forward has one; a forward op never meets a backward one."""
    key = pi.keys[i]
    try:
        parts = parse_key(key)
        name = parts.op or (pi.module_type[i] or parts.module.rsplit(".", 1)[-1])
        labels = parts.labels
    except ValueError:
        name, labels = split_call(key)[0], ()
    phase = None if pi.module_call is None else pi.module_call[i] is None
    return (name, labels, tuple(pi.shape[i] or ()), phase)


def _trusted(blocks: list, na: int, nb: int) -> list:
    """The matching blocks of a sequence alignment, less the islands: a run of fewer than
    :data:`ISLAND` pairs with unmatched entries just before it and just after it, on both
    sides at one end at least, sits inside a stretch where the two op sequences differ (eager's
    ``_softmax`` against SDPA's fused kernel, forward and backward). There a signature is all
    that pairs it, and different computations share one (the ``detach`` autograd saves of
    eager's attention probabilities against SDPA's of its output, both ``[1, 4, 8, 8]``): its
    entries are left unmatched, never compared as partners."""
    blocks = [b for b in blocks if b.size]
    out = []
    for n, bl in enumerate(blocks):
        pa, pb = (blocks[n - 1].a + blocks[n - 1].size, blocks[n - 1].b + blocks[n - 1].size) if n else (0, 0)
        qa, qb = (blocks[n + 1].a, blocks[n + 1].b) if n + 1 < len(blocks) else (na, nb)
        before = (bl.a > pa) + (bl.b > pb)  # how many sides have unmatched entries just before
        after = (qa > bl.a + bl.size) + (qb > bl.b + bl.size)
        if bl.size < ISLAND and before and after and 2 in (before, after):
            continue
        out.append(bl)
    return out


def pairs(pa: PassIndex | None, pb: PassIndex | None, keep, align: str, mapping=None, keep_b=None):
    """``(i_a, i_b, order)`` triples: matched, A-only (i_b None), B-only (i_a None).

    With a :class:`~tdinspect.align.Mapping`, an A entry meets the B entry its
    rule names (same call); several A entries may meet one B entry.

    ``keep`` is A's selection, ``keep_b`` B's (default: A's): an entry is paired only
    when both keep it, each its own side's name (an A entry: A's name, and for B the
    name its partner has or would have there; a B entry: its name, for both), so that
    narrowing either side narrows the comparison (:meth:`tdinspect.DumpSet.filter`).
    """
    ka = [i for i, k in enumerate(pa.keys) if keep(k)] if pa else []
    kb = [j for j, k in enumerate(pb.keys) if keep(k)] if pb else []
    if keep_b is not None:
        named = mapping is not None and align != "sequence"
        ka = [i for i in ka if keep_b(mapped_key(mapping, pa.keys[i]) if named else pa.keys[i])]
        kb = [j for j in kb if keep_b(pb.keys[j])]
    if pa is None or pb is None:
        return [(i, None, float(i)) for i in ka] + [(None, j, float(j)) for j in kb]
    if align == "sequence":
        sa = [_signature(pa, i) for i in ka]
        sb = [_signature(pb, j) for j in kb]
        matcher = difflib.SequenceMatcher(None, sa, sb, autojunk=False)
        matched = {}
        for block in _trusted(matcher.get_matching_blocks(), len(sa), len(sb)):
            for t in range(block.size):
                matched[kb[block.b + t]] = ka[block.a + t]
        out = [(i, None, float(i)) for i in ka if i not in matched.values()]
        out += [(matched[j], j, float(matched[j])) for j in kb if j in matched]
    elif mapping is not None:
        out = [(i, pb.position.get(mapped_key(mapping, pa.keys[i])), float(i)) for i in ka]
        matched = {}
        for i, j, _ in out:
            if j is not None:
                matched.setdefault(j, i)
    else:
        out = [(i, pb.position.get(pa.keys[i]), float(i)) for i in ka]
        matched = {pb.position[pa.keys[i]]: i for i in ka if pa.keys[i] in pb.position}
    last = -0.5
    for j in kb:  # B-only entries go just after the reference entry that precedes them in B
        if j in matched:
            last = float(matched[j])
        else:
            out.append((None, j, last + 0.5))
    return sorted(out, key=lambda t: t[2])


def layout(pa: PassIndex, ia: int, pb: PassIndex, ib: int, transform) -> tuple[str, Any]:
    """``(structural reason or "", B shape after the transform)`` for a matched pair."""
    return layout_shapes(pa.shape[ia], pb.shape[ib], transform)


def layout_shapes(shape_a, shape_b, transform) -> tuple[str, Any]:
    """``(structural reason or "", B shape after the transform)`` of an A and a B shape (lists
    or ``None``); the reason names the transform when it changed B's shape or refused it."""
    shape_a, shape_b = list(shape_a or []), list(shape_b or [])
    if transform is None:
        return ("" if shape_a == shape_b else f"shape {shape_a} vs {shape_b}"), shape_b
    try:
        after = transform.out_shape(shape_b)
    except TransformError as exc:
        return str(exc), None
    if after is not None and after != shape_a:
        return f"shape {shape_a} vs {after} (B {shape_b} after {transform.spec!r})", after
    return "", after


def unchanged_since(pa: PassIndex, ia: int, pb: PassIndex, ib: int) -> int | None:
    """The pass both sides say this entry is unchanged since (a parameter), else ``None``."""
    return same_ref_pass(pa.ref[ia], pb.ref[ib])


def same_ref_pass(ra, rb) -> int | None:
    """The pass two sidecar references both point to (same entry), else ``None``."""
    if (
        ra
        and rb
        and ra.get("pass") is not None
        and ra.get("pass") == rb.get("pass")
        and ra.get("of") == rb.get("of")
    ):
        return ra["pass"]
    return None


def assembled(pi: PassIndex | None, i: int | None) -> str:
    """How an entry of an unsharded / concatenated side is put together (``""`` for a stored one)."""
    if not isinstance(pi, LogicalPass) or i is None:
        return ""
    return describe(pi.plans[pi.keys[i]])
