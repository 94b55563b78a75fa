"""Concat: decode steps put end to end, to meet a one-pass reference.

A decode run calls the model once for the prompt and once per new token
(calls of one pass, or one pass per token); a reference runs the whole
sequence once. ``concat(ds, over="call", dim=1)`` makes each entry one
tensor, its calls concatenated along dim 1 in call order (``over="pass"``:
its passes, in pass order), so the two compare entry by entry. ``narrow``
keeps a range of positions (the reference's tokens the decode run also fed).

Examples
--------
>>> decode = DumpSet.open("dumps/generate").concat("call", dim=1)      # doctest: +SKIP
>>> full = DumpSet.open("dumps/forward").narrow(1, 0, 20)              # doctest: +SKIP
>>> full.diff(decode).per_position("model.layers.0.self_attn[0]", dim=1)  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from typing import Any

from tdinspect.align.dims import parse_dims
from tdinspect.align.logical import LogicalPass, error, read
from tdinspect.errors import DimsError
from tdinspect.naming import make_key, split_call
from tdinspect.store.passindex import PassIndex


def parse_concat(value) -> tuple[str, int | str]:
    """``"pass:1"`` / ``"call:s"`` / ``("call", 1)`` -> ``(over, dim)``; a clear error otherwise."""
    if isinstance(value, str):
        over, sep, dim = value.partition(":")
        if not sep or not dim:
            raise ValueError(f"concat {value!r}: expected OVER:DIM, e.g. 'call:1' or 'pass:s'")
    else:
        try:
            over, dim = value
        except (TypeError, ValueError):
            raise ValueError(f"concat={value!r}: expected 'OVER:DIM' or (over, dim)") from None
    if over not in ("pass", "call"):
        raise ValueError(f"concat {value!r}: over must be 'pass' or 'call', not {over!r}")
    return over, as_dim(dim)


def as_dim(dim) -> int | str:
    """An int (``"1"``, ``"-2"`` read as ints) or a dims name."""
    if isinstance(dim, str) and dim.lstrip("-").isdigit():
        return int(dim)
    if not isinstance(dim, (int, str)) or isinstance(dim, bool):
        raise ValueError(f"dim={dim!r}: expected an int or a dims name such as 's'")
    return dim


def dim_index(dim: int | str, spec: str | None, ndim: int | None, key: str) -> int:
    """Where ``dim`` is in an entry's tensor; raises ``ValueError`` saying why not."""
    if isinstance(dim, int):
        if ndim is not None and not -ndim <= dim < ndim:
            raise ValueError(f"dim {dim} is out of range for {key!r} ({ndim} dims)")
        return dim % ndim if ndim else dim
    if spec is None:
        raise ValueError(
            f"dim {dim!r} needs dims for {key!r} (capture(dims=...) or "
            "DumpSet.open(dims=...)), or give dim as an int"
        )
    try:
        return parse_dims(spec).index(dim)
    except DimsError as exc:
        raise ValueError(str(exc)) from None


def names_dim(passes: dict[tuple[int, int], PassIndex], dim: int | str) -> bool:
    """Whether ``dim`` is an int some entry has (``-ndim <= dim < ndim``), or a name some entry's
    dims hold (``False`` for a typo such as ``--concat call:x`` or ``call:99999999999999999999``,
    which should be an error rather than every entry's reason: a divergence, exit 1)."""
    if not isinstance(dim, str):
        shapes = [s for pi in passes.values() for s in getattr(pi, "shape", None) or [None]]
        return any(not isinstance(s, (list, tuple)) or -len(s) <= dim < len(s) for s in shapes)
    for pi in passes.values():
        for spec in pi.dims:
            if spec is None:
                continue
            try:
                parse_dims(spec).index(dim)
                return True
            except DimsError:
                continue
    return False


def _cat(key: str, parts: list[tuple[Any, PassIndex, str, str]], dim) -> dict:
    """The plan of one entry from ``(src, pass, source key, label)`` parts, in order."""
    _, pi0, k0, _ = parts[0]
    i0 = pi0.position[k0]
    shape0 = pi0.shape[i0]
    try:
        d = dim_index(dim, pi0.dims[i0], None if shape0 is None else len(shape0), key)
    except ValueError as exc:
        return error(str(exc))
    if len(parts) == 1:
        return read(parts[0][0], k0)
    shapes = [pi.shape[pi.position[k]] for _, pi, k, _ in parts]
    # a part of fewer dims can still agree off dim d ([1] with [1, 8] at d=1): count dims too
    rest = {(len(s), tuple(s[:d] + s[d + 1 :])) if s is not None else None for s in shapes}
    if len(rest) != 1 or None in rest:
        seen = ", ".join(f"{label}: {s}" for (_, _, _, label), s in zip(parts, shapes))
        return error(f"shapes do not concatenate along dim {dim!r} ({seen})")
    return {
        "op": "cat",
        "dim": d,
        "parts": [read(src, k) for src, _, k, _ in parts],
        "zigzag": False,
        "labels": [label for *_, label in parts],
    }


def concat(
    passes: dict[tuple[int, int], PassIndex], over: str = "call", dim: int | str = 1, *, where: Any = "dump"
) -> dict:
    """Passes whose entries are concatenated over passes or calls along ``dim``.

    Returns ``{(rank, pass): LogicalPass}``; :meth:`tdinspect.DumpSet.concat` wraps it in
    a DumpSet.

    Parameters
    ----------
    passes : dict
        ``{(rank, pass): PassIndex}`` of a dump (:attr:`tdinspect.DumpSet.pass_map`).
    over : {"call", "pass"}
        ``"call"``: ``name``, ``name::call1``, ... of each pass become
        ``name``; ``"pass"``: each rank's passes become one pass (numbered
        as its first), entries matched by key.
    dim : int or str
        The dim to concatenate along, or its name in the entries' dims.
    where : str or Path
        The dump, named in warnings.

    Entries that cannot be concatenated (missing in some pass, shapes that
    do not fit) become structural divergences with the reason.

    Over calls at op level, an op that runs k times in each call of its module
    (a Llama's ``input_layernorm/aten.mul`` twice a decode step) becomes k
    entries, ``name``, ``name::call1``, ..., each the same run of every
    module call put end to end: they meet the k calls of a one-pass reference.
    Op dumps that do not record module calls (written before tdinspect did)
    put every call end to end, and a RuntimeWarning says so.
    """
    over, dim = parse_concat((over, dim))
    out = {}
    mixed = False  # an op's several runs per forward put end to end (no module calls recorded)
    if over == "pass":
        by_rank: dict[int, dict[int, PassIndex]] = {}
        for (rank, p), pi in passes.items():
            by_rank.setdefault(rank, {})[p] = pi
        for rank, ranks_passes in by_rank.items():
            order = dict.fromkeys(k for p in sorted(ranks_passes) for k in ranks_passes[p].keys)
            plans, first, dims = {}, {}, {}
            for key in order:
                have = [p for p in sorted(ranks_passes) if key in ranks_passes[p].position]
                first[key] = (have[0], ranks_passes[have[0]].position[key])
                dims[key] = ranks_passes[have[0]].dims[first[key][1]]
                lost = [p for p in ranks_passes if p not in have]
                plans[key] = (
                    error(f"in passes {have} only, not in {lost}")
                    if lost
                    else _cat(key, [(p, ranks_passes[p], key, f"pass {p}") for p in have], dim)
                )
            p0 = min(ranks_passes)
            out[(rank, p0)] = LogicalPass.build(
                rank,
                p0,
                ranks_passes,
                plans,
                first,
                dims=dims,
                what=f"passes {sorted(ranks_passes)} concatenated",
            )
    else:
        for (rank, p), pi in passes.items():
            calls: dict[str, list[tuple[int, str]]] = {}
            for key in pi.keys:
                base, call = split_call(key)
                calls.setdefault(base, []).append((call, key))
            made = []  # (position of its first part, name, plan)
            for base, found in calls.items():
                found.sort()
                numbers = [c for c, _ in found]
                at = pi.position[found[0][1]]
                if numbers != list(range(len(numbers))):
                    made.append((at, base, error(f"calls {numbers} (some are missing)")))
                    continue
                runs = _runs(pi, found)
                if isinstance(runs, str):
                    made.append((at, base, error(runs)))
                    continue
                if runs is None:  # no module call to group by: all end to end
                    mixed |= pi.level == "op" and pi.module_call is None and len(found) > 1
                    runs = [found]
                for i, run in enumerate(runs):
                    name = make_key(base, i)
                    made.append(
                        (
                            pi.position[run[0][1]],
                            name,
                            _cat(name, [(0, pi, k, f"call {c}") for c, k in run], dim),
                        )
                    )
            made.sort(key=lambda m: m[0])
            plans = {name: plan for _, name, plan in made}
            first = {name: (0, at) for at, name, _ in made}
            dims = {name: pi.dims[at] for at, name, _ in made}
            out[(rank, p)] = LogicalPass.build(
                rank, p, {0: pi}, plans, first, dims=dims, what=f"calls of pass {p} concatenated"
            )
    if mixed:
        warnings.warn(
            f"tdinspect: {where}: this op-level dump does not say which call of its "
            "module ran each op (written before tdinspect recorded it), so an op that "
            "runs several times in one forward (an RMSNorm's two aten.mul) has its "
            "different tensors put end to end: capture it again, or compare a decode "
            "run at module level",
            RuntimeWarning,
            stacklevel=3,
        )
    return out


def _runs(pi: PassIndex, found: list[tuple[int, str]]) -> list[list[tuple[int, str]]] | str | None:
    """An op's calls in one pass (``(call, key)`` in order) as its runs within each call of
    its module: ``runs[i]`` holds the ``i``-th run of every module call, in order (an
    RMSNorm's second ``aten.mul`` of each decode step). ``None`` where no module call ran
    them (module level; ops outside the model's forward or in backward; op dumps written
    before module calls were recorded); the reason when the module's calls ran the op a
    different number of times."""
    if pi.module_call is None:
        return None
    by_call: dict[int, list[tuple[int, str]]] = {}
    for c, k in found:
        m = pi.module_call[pi.position[k]]
        if m is None:
            return None
        by_call.setdefault(m, []).append((c, k))
    counts = [len(v) for v in by_call.values()]
    if len(set(counts)) > 1:
        return (
            f"runs {counts} times in calls {list(by_call)} of its module: its runs do not line up one to one"
        )
    return [list(run) for run in zip(*by_call.values())]


def narrow(passes: dict[tuple[int, int], PassIndex], dim: int | str, start: int, length: int) -> dict:
    """Passes keeping positions ``start .. start+length`` along ``dim`` of every entry.

    Returns ``{(rank, pass): LogicalPass}``; :meth:`tdinspect.DumpSet.narrow` wraps it.

    Entries too short, or without the named dim, become structural
    divergences with the reason.
    """
    dim = as_dim(dim)
    out = {}
    for (rank, p), pi in passes.items():
        plans, first, dims = {}, {}, {}
        for i, key in enumerate(pi.keys):
            first[key], dims[key] = (0, i), pi.dims[i]
            shape = pi.shape[i]
            try:
                d = dim_index(dim, pi.dims[i], None if shape is None else len(shape), key)
            except ValueError as exc:
                plans[key] = error(str(exc))
                continue
            if shape is None or shape[d] < start + length:
                plans[key] = error(
                    f"{key!r} has {None if shape is None else shape[d]} positions "
                    f"along dim {dim!r}, fewer than {start} + {length}"
                )
                continue
            plans[key] = {"op": "narrow", "dim": d, "start": start, "length": length, "part": read(0, key)}
        out[(rank, p)] = LogicalPass.build(
            rank,
            p,
            {0: pi},
            plans,
            first,
            dims=dims,
            what=f"positions {start}..{start + length} of dim {dim}",
        )
    return out
