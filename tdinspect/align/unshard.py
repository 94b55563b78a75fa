"""Unshard: one logical dump from the ranks of a sharded run.

Each rank's parallel coordinates (``{"tp": [index, size], ...}``, recorded by
capture; for dumps without them, rank ``i`` of ``n`` is tensor-parallel
``(i, n)``) and each entry's dims spec (:mod:`tdinspect.align.dims`) say how a
logical tensor is put back together: concatenated along the dims tagged with
an axis, in that axis's rank order (zigzag for ``cp,zigzag``), summed over the
axes of a ``partial`` dim; a ``fused=`` dim segment by segment (every rank's
share of ``q``, then of ``k``...: the whole model's ``[q | k | v]``). Entries without dims must be identical on every
rank (replicated): the first rank's copy is taken, after checking it. So must the copies of an
entry with dims along the axes they do not shard (``dp``, a ``tp`` it is replicated over): each
is put together from its own ranks, and they are checked the same way. A pipeline stage
(``pp``) holds its own entries: they are read from its ranks, as if every rank held them.

Examples
--------
>>> ds = DumpSet.open("dumps/tp2", dims={r"q_proj$": "b s h(tp)"})   # doctest: +SKIP
>>> ds.unshard().tensor("model.layers.0.q_proj").shape               # doctest: +SKIP
torch.Size([1, 16, 64])
"""

from __future__ import annotations

from typing import Any

from tdinspect.align.dims import Dim, parse_dims
from tdinspect.align.logical import LogicalPass, error, read
from tdinspect.align.zigzag import local_lengths, merged_layout
from tdinspect.errors import DimsError, DumpFormatError
from tdinspect.store.passindex import PassIndex

PIPELINE = "pp"  # the axis of pipeline stages: each holds its own layers, under their own names


def coordinates(passes: dict[int, PassIndex]) -> dict[int, dict[str, list[int]]]:
    """``{rank: {axis: [index, size]}}`` for the ranks of one pass."""
    ranks = sorted(passes)
    out = {}
    for r in ranks:
        recorded = passes[r].parallel
        out[r] = (
            dict(recorded) if recorded else ({"tp": [ranks.index(r), len(ranks)]} if len(ranks) > 1 else {})
        )
    sizes: dict[str, int] = {}
    for r, coords in out.items():
        for axis, (_, size) in coords.items():
            if sizes.setdefault(axis, size) != size:
                raise DumpFormatError(
                    f"{passes[r].path}: rank {r} says {axis} size {size}, another rank says {sizes[axis]}"
                )
    return out


def _label(ranks: list[int], axis: str, i: int, size: int) -> str:
    who = ", ".join(str(r) for r in ranks)
    return f"rank {who} ({axis} {i} of {size})" if len(ranks) == 1 else f"ranks {who} ({axis} {i} of {size})"


def _stage_world(holders: list[int], coords: dict[int, dict[str, list[int]]]) -> list[int]:
    """The ranks an entry is expected on: every rank of the pipeline stages (``pp``) that
    hold it. A stage holds its own layers; the other stages' absence is no gap."""
    stages = {coords[r].get(PIPELINE, [0, 1])[0] for r in holders}
    return sorted(r for r in coords if coords[r].get(PIPELINE, [0, 1])[0] in stages)


def _replica_label(ranks: list[int], coords: dict, axes: list[str]) -> str:
    """``dp rank 1`` (or ``dp rank 1, tp rank 0``): a copy by its coordinates on ``axes``."""
    return ", ".join(f"{a} rank {coords[ranks[0]].get(a, [0, 1])[0]}" for a in axes)


def _missing(holders: list[int], world: list[int], why: str, coords: dict) -> dict:
    missing = [r for r in world if r not in holders]
    staged = any(PIPELINE in c for c in coords.values())
    hint = "" if staged else "; a pipeline stage? capture with parallel={'pp': (stage, stages)}"
    return error(f"{why} and only on ranks {holders} (not on {missing}){hint}")


def plan_entry(
    key: str,
    spec_text: str | None,
    holders: list[int],
    coords: dict[int, dict[str, list[int]]],
    shapes: dict[int, Any],
    checksums: dict[int, str | None] | None = None,
    layouts: dict[int, Any] | None = None,
) -> dict:
    """The plan of one logical entry from the ranks in ``holders`` that hold ``key``.

    An entry without dims is a replica: with every rank's checksum recorded
    (``capture(checksum=True)``) they settle it without reading; otherwise
    the copies are compared bitwise when read. An entry with dims is put
    together from each copy along the axes its dims do not shard (``dp``, a
    ``tp`` it is replicated over), and those copies are compared the same way
    (``dp rank 1 differs from dp rank 0``). Ranks of pipeline stages (``pp``)
    that do not hold the entry are not expected to. ``layouts`` (each rank's token layout):
    a zigzag dim that is their packed token dim is cut sequence by sequence
    (:mod:`tdinspect.align.zigzag`).
    """
    everyone = _stage_world(holders, coords)
    if spec_text is None:
        if len(holders) == 1 and len(everyone) == 1:
            return read(holders[0], key)
        if len(holders) < len(everyone):
            return _missing(holders, everyone, "no dims", coords)
        if len({tuple(shapes[r] or ()) for r in holders}) > 1:
            seen = ", ".join(f"rank {r}: {shapes[r]}" for r in holders)
            return error(f"no dims and shapes differ across ranks ({seen}); give it dims")
        sums = [(checksums or {}).get(r) for r in holders]
        if all(c is not None for c in sums):
            if len(set(sums)) == 1:
                return read(holders[0], key)
            seen = ", ".join(f"rank {r}: {c}" for r, c in zip(holders, sums))
            return error(
                f"no dims and not replicated: the ranks' checksums differ ({seen}); "
                "give the entry dims, e.g. dims={regex: 'b s h(tp)'}"
            )
        return {
            "op": "same",
            "parts": [read(r, key) for r in holders],
            "labels": [f"rank {r}" for r in holders],
        }
    try:
        spec = parse_dims(spec_text)
    except DimsError as exc:
        return error(str(exc))
    shape = shapes[holders[0]]
    if shape is not None and len(shape) != len(spec.dims):
        return error(
            f"dims {spec_text!r} names {len(spec.dims)} dims, the tensor has {len(shape)} ({list(shape)})"
        )
    steps = spec.sharded()
    axes = [s[2] for s in steps]

    def coord(r, axis):
        return coords[r].get(axis, [0, 1])

    def build(ranks: list[int], level: int) -> dict:
        if level == len(steps):
            if len(ranks) != 1:
                return error(f"ranks {ranks} hold the same shard of dims {spec_text!r}")
            return read(ranks[0], key)
        _, dim, axis, how, zigzag = steps[level]
        size = coord(ranks[0], axis)[1]
        held = {coord(r, axis)[0] for r in ranks}  # each in range(size) (checked on read)
        if len(held) < size:  # found without counting to the size a sidecar claims (10^12: a hang)
            lost = next(i for i in range(len(held) + 1) if i not in held)
            return error(f"dims {spec_text!r}: no rank holds {axis} shard {lost} of {size}")
        groups = [[r for r in ranks if coord(r, axis)[0] == i] for i in range(size)]
        parts = [build(g, level + 1) for g in groups]
        labels = [_label(g, axis, i, size) for i, g in enumerate(groups)]
        if spec.dims[dim].fused:
            return _fused(spec.dims[dim], dim, parts, labels, size, shapes[groups[0][0]])
        if len(parts) == 1:
            return parts[0]
        if how == "sum":
            return {"op": "sum", "parts": parts, "labels": labels}
        node = {"op": "cat", "dim": dim, "parts": parts, "zigzag": zigzag, "labels": labels, "axis": axis}
        if zigzag:
            lengths = _packed_lengths(dim, [g[0] for g in groups], layouts or {}, shapes)
            if isinstance(lengths, str):
                return error(f"dims {spec_text!r}: {lengths}")
            if lengths is not None:
                node["seqlens"] = lengths
        return node

    # the axes its dims do not shard, each of more than one rank: the ranks along them hold copies
    unnamed = sorted(
        {a for r in everyone for a, (_, size) in coords[r].items() if a not in axes and size > 1}
    )
    copies: dict[tuple, list[int]] = {}
    for r in everyone:
        copies.setdefault(tuple(coord(r, a)[0] for a in unnamed), [])
    for r in holders:
        copies[tuple(coord(r, a)[0] for a in unnamed)].append(r)
    if any(not g for g in copies.values()):
        return _missing(holders, everyone, f"dims {spec_text!r}", coords)
    groups = [copies[c] for c in sorted(copies)]
    try:
        built = [build(g, 0) for g in groups]
    except DimsError as exc:
        return error(f"{key}: dims {spec_text!r}: {exc}")
    if len(built) == 1:
        return built[0]
    varying = [a for i, a in enumerate(unnamed) if len({c[i] for c in copies}) > 1]
    labels = [_replica_label(g, coords, varying) for g in groups]
    for label, node in zip(labels, built):
        if node["op"] == "error":
            return error(f"{label}: {node['reason']}")
    sums = [[(checksums or {}).get(r) for r in _sources(node)] for node in built]
    if all(c is not None for row in sums for c in row):  # capture(checksum=True): settled unread
        bad = next((i for i, row in enumerate(sums) if row != sums[0]), None)
        if bad is None:
            return built[0]
        return error(
            f"replicas differ: {labels[bad]} differs from {labels[0]}: their checksums differ "
            f"(ranks {groups[bad]} against {groups[0]}); its dims do not shard {' and '.join(varying)}"
        )
    return {"op": "same", "parts": built, "labels": labels, "ranks": groups, "axes": varying}


def _sources(node: dict) -> list:
    """The ranks a plan reads, in its order."""
    if node["op"] == "read":
        return [node["src"]]
    return [src for p in node.get("parts", [node.get("part")]) if p for src in _sources(p)]


def _packed_lengths(dim: int, ranks: list[int], layouts: dict, shapes: dict) -> list[int] | str | None:
    """Each sequence's rows per cp rank when ``dim`` is the ranks' packed token dim (their
    layouts' last leading dim, the ones before it of size 1) and it holds several sequences;
    ``None`` for a whole-dim zigzag (no layouts, one sequence, a padded ``[batch, seq]``);
    a reason where the layouts cannot be a per-sequence zigzag."""
    found = [layouts.get(r) for r in ranks]
    if all(layout is None for layout in found):
        return None
    for r, layout in zip(ranks, found):
        shape = shapes.get(r)
        if layout is None or shape is None:
            continue
        lead = tuple(layout.shape)
        if len(lead) != dim + 1 or any(n != 1 for n in lead[:-1]) or tuple(shape[: dim + 1]) != lead:
            return None  # the zigzag dim is not the packed token dim: the whole dim is one sequence
    lengths = local_lengths(found)
    if isinstance(lengths, str) or len(lengths) > 1:
        return lengths
    return None


def _fused(d: Dim, dim: int, parts: list[dict], labels: list[str], size: int, shape) -> dict:
    """Segment by segment, each rank's share of it: ``[q_0 q_1 | k_0 k_1 | v_0 v_1]`` from
    ranks holding ``[q_r | k_r | v_r]``. A ``cat`` of ``narrow`` parts (labelled with the
    rank and the segment, so a fault is named with both); ``segments`` keeps the layout."""
    if shape is None:
        raise DimsError("the shard's shape is not recorded")
    width = shape[dim]
    cuts = d.segments(size, width)
    out_parts, out_labels, segments, start = [], [], [], 0
    for name, offset, w in cuts:
        for part, label in zip(parts, labels):
            out_parts.append({"op": "narrow", "dim": dim, "start": offset, "length": w, "part": part})
            out_labels.append(f"{label} {name}")
        segments.append([name, start, w * size, offset, w])
        start += w * size
    return {
        "op": "cat",
        "dim": dim,
        "parts": out_parts,
        "zigzag": False,
        "labels": out_labels,
        "segments": segments,
        "ranks": labels,
    }


def unshard_pass(passes: dict[int, PassIndex]) -> LogicalPass:
    """One logical pass from the same pass of every rank."""
    coords = coordinates(passes)
    ranks = sorted(passes)
    order: dict[str, None] = {}
    for r in ranks:
        for k in passes[r].keys:
            order.setdefault(k, None)
    plans, first, dims = {}, {}, {}
    for key in order:
        holders = [r for r in ranks if key in passes[r].position]
        specs = {passes[r].dims[passes[r].position[key]] for r in holders}
        shapes = {r: passes[r].shape[passes[r].position[key]] for r in holders}
        checksums = {
            r: passes[r].checksum[passes[r].position[key]] if passes[r].checksum else None for r in holders
        }
        first[key] = (holders[0], passes[holders[0]].position[key])
        if len(specs) > 1:
            plans[key] = error(f"ranks disagree on its dims: {sorted(map(str, specs))}")
            continue
        spec = specs.pop()
        dims[key] = spec
        layouts = {r: passes[r].tokens for r in holders}
        plans[key] = plan_entry(key, spec, holders, coords, shapes, checksums, layouts)
    some = passes[ranks[0]]
    out = LogicalPass.build(
        0, some.index, dict(passes), plans, first, dims=dims, what=f"unsharded from ranks {ranks}"
    )
    out.tokens = _cp_layout(passes, coords, plans)
    return out


def _cp_layout(passes: dict[int, PassIndex], coords: dict, plans: dict):
    """The logical pass's token layout where its entries' packed token dim is put together
    sequence by sequence (a plan with ``seqlens``): every cp rank's rows where the plan puts
    them. ``None`` otherwise (a reader of token layouts takes the ranks' own, when they agree)."""
    lengths = next((n["seqlens"] for n in plans.values() if n.get("seqlens")), None)
    if lengths is None:
        return None
    by_cp: dict[int, set] = {}
    for r, pi in passes.items():
        index, _ = coords[r].get("cp", [0, 1])
        by_cp.setdefault(index, set()).add(pi.tokens)
    if any(len(found) != 1 for found in by_cp.values()) or sorted(by_cp) != list(range(len(by_cp))):
        return None
    try:
        return merged_layout([by_cp[i].pop() for i in range(len(by_cp))], lengths)
    except DumpFormatError:
        return None


def unshard(passes: dict[tuple[int, int], PassIndex], where: Any, *, stats_only: bool = False) -> dict:
    """The passes of one logical rank (0): ``passes``' ranks reassembled.

    Parameters
    ----------
    passes : dict
        ``{(rank, pass): PassIndex}`` of a dump (:attr:`tdinspect.DumpSet.pass_map`).
    where : str or Path
        The dump, named in errors.
    stats_only : bool
        Whether the dump holds statistics only (refused: there are no shards).

    Returns
    -------
    dict
        ``{(0, pass): LogicalPass}``: tensors are assembled when read, statistics
        recomputed from them. :meth:`tdinspect.DumpSet.unshard` wraps it in a DumpSet.

    Raises
    ------
    DumpFormatError
        For a statistics-only dump (there are no shards to put together) or
        ranks that disagree on an axis's size.
    """
    if stats_only:
        raise DumpFormatError(f"{where}: statistics-only dump: unshard needs the tensors")
    by_pass: dict[int, dict[int, PassIndex]] = {}
    for (rank, p), pi in passes.items():
        by_pass.setdefault(p, {})[rank] = pi
    return {(0, p): unshard_pass(group) for p, group in by_pass.items()}
