"""TokenDiff: two runs compared token by token, matched by (request, position).

``DumpSet.diff(other, tokens=True)`` builds a :class:`TokenDiff`: each side's token
layouts are planned (:func:`tdinspect.align.tokens.plan_tokens`, printable as
``d.tokens`` before any tensor is read), each side becomes one logical pass per request
(its rows gathered in position order), and the diff compares those with the one set of
metrics and the one divergence rule. Its answers speak of requests and positions: the
first divergence names the entry, the request and the first position past the threshold
(:class:`TokenDivergence`); :meth:`TokenDiff.per_position` gives the metric per
request and position. Tokens only one side computed make the verdict "incomplete".

Examples
--------
>>> d = DumpSet.open("dumps/hf").diff("dumps/engine", tokens=True)   # doctest: +SKIP
>>> d.first_divergence()                                             # doctest: +SKIP
TokenDivergence(model.model.layers.0.self_attn[0] request 1 position 6: rel_diff 0.0112 > 1.49e-08 (auto: float32))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from tdinspect.align.logical import LogicalPass, slices_of
from tdinspect.align.tokens import TokenPlan, plan_tokens, request_passes
from tdinspect.compare.diff import Diff
from tdinspect.compare.spec import CompareSpec
from tdinspect.compare.thresholds import Divergence, Verdict
from tdinspect.errors import AlignError
from tdinspect.util.terminal import visible

if TYPE_CHECKING:
    import xarray as xr


@dataclass(repr=False)
class TokenDivergence(Divergence):
    """A :class:`~tdinspect.compare.thresholds.Divergence` of a token-aligned diff.

    ``pass_`` is the request id; ``request`` says the same, and ``position`` is the first
    position of that request past the threshold in that entry (``-1`` for a structural
    divergence, which has no per-position values).
    """

    request: int = -1
    position: int = -1

    def __repr__(self) -> str:
        where = f"request {self.request}" + (f" position {self.position}" if self.position >= 0 else "")
        return visible(f"TokenDivergence({self.key} {where}: {self.reason})")


@dataclass(frozen=True)
class TokenVerdict(Verdict):
    """A :class:`~tdinspect.compare.thresholds.Verdict` whose text names request and position."""

    @property
    def text(self) -> str:
        d = self.divergence
        if isinstance(d, TokenDivergence):
            where = f"request {d.request}" + (f", position {d.position}" if d.position >= 0 else "")
            return visible(f"diverges: {d.key} ({where}): {d.reason}")
        return super().text


class TokenDiff(Diff):
    """A :class:`~tdinspect.compare.diff.Diff` of two runs lined up by (request, position).

    Parameters
    ----------
    a, b : DumpSet
        Reference and compared run; every pass needs a token layout
        (``dump.step(tokens=tdinspect.tokens(...))``).
    unshard : bool
        Reassemble ranks first (each rank's passes hold the same token rows).
    **kwargs
        As for :class:`~tdinspect.compare.diff.Diff` (``mapping``, ``allow_uncompared``,
        ``mode``...), except ``concat`` (the token plan lines passes up itself).

    Attributes
    ----------
    tokens : TokenPlan
        Which pass and row holds each (request, position) on each side.
    """

    token_aligned = True

    def __init__(self, a, b, *, spec=None, unshard: bool | None = None, **kwargs):
        if kwargs.get("concat") is not None:
            raise ValueError("tokens=True lines passes up by request and position: give no concat=")
        if kwargs.get("align", "name") not in (None, "name"):
            raise ValueError("tokens=True pairs entries by name (or mapping=): give no align=")
        given = CompareSpec.coerce(spec).replace(unshard=unshard)
        if given.concat is not None or given.align != "name":
            raise ValueError(
                "tokens=True lines passes up by request and position: no concat or align='sequence'"
            )
        unshard = given.unshard
        for side in (a, b):
            if side.stats_only:
                raise AlignError(
                    f"{side.path} is statistics-only: tokens=True gathers each request's token rows "
                    "from the tensors (capture without stats_only)"
                )
        if unshard:
            a, b = _unsharded(a), _unsharded(b)
        self.tokens: TokenPlan = plan_tokens(a.pass_map, b.pass_map, a.path, b.path)
        if not any(rp.positions for rp in self.tokens.requests.values()):
            raise AlignError(
                f"{a.path} and {b.path} hold no (request, position) in common: "
                + ("; ".join(self.tokens.one_sided) or "no tokens")
            )
        self.sources = (a, b)
        super().__init__(
            _like(a, request_passes(self.tokens, a.pass_map, "a")),
            _like(b, request_passes(self.tokens, b.pass_map, "b")),
            spec=dataclasses.replace(given, unshard=False, tokens=True),  # ranks already reassembled
            **kwargs,
        )
        self.spec = dataclasses.replace(self.spec, unshard=given.unshard)  # what the user asked for

    def verdict(self, threshold=None, metric=None, structural=None, *, allow_uncompared=None) -> Verdict:
        """As :meth:`Diff.verdict`; tokens one side computed make a match "incomplete", and a
        divergence is a :class:`TokenDivergence` naming request and position."""
        v = super().verdict(threshold, metric, structural, allow_uncompared=allow_uncompared)
        counts = {"compared": v.compared, "uncompared": v.uncompared, "allowed": v.allowed}
        if v.divergence is not None:
            div = self._divergence = self._token_divergence(v.divergence, metric, threshold)
            return TokenVerdict("diverges", div, **counts)
        gap = self.tokens.one_sided
        if gap:
            text = "tokens one side computed were never compared (" + "; ".join(gap) + ")"
            text = f"{v.gap}; {text}" if v.gap else text
            return TokenVerdict("incomplete", None, text, **counts, stopped=v.stopped)
        return TokenVerdict(v.outcome, None, v.gap, **counts, stopped=v.stopped)

    def _where(self, pass_: int, rank: int) -> str:
        """``request R``: a token-aligned diff's passes are its requests (ranks reassembled)."""
        return f"request {pass_}"

    def _token_divergence(self, div: Divergence, metric, threshold) -> TokenDivergence:
        request, position = div.pass_, -1
        if not div.structural:
            da = self.per_position(div.key, metric=metric, threshold=threshold).sel(request=request)
            values = da.sel(call=div.call).values if "call" in da.dims else da.values
            m = self._check_metric(metric)
            hits = [
                i for i, v in enumerate(values) if not np.isnan(v) and m.diverges(float(v), div.threshold)
            ]
            if hits:
                position = self.tokens.requests[request].positions[hits[0]]
        base = {f.name: getattr(div, f.name) for f in fields(Divergence)}
        if position >= 0:
            base["reason"] = f"{base['reason']}; from position {position} of request {request}"
        return TokenDivergence(**base, request=request, position=position)

    def _locate(self, row: dict, m, thr: float) -> str:
        """The token runs that differ (:meth:`Diff._locate`), after the shards (ranks, and
        segments of a fused dim) that differ where the runs come from unsharded passes."""
        by_token = super()._locate(row, m, thr)
        transform = self.mapping.partner(row["op"])[1] if self.mapping is not None else None
        for side, key in ((self.b, row["key_b"]), (self.a, row["key"])):
            parts = _shard_slices(side.pass_map.get((row["rank"], row["pass"])), key)
            if parts:
                bad = self._parts_differ(row, m, thr, parts, side is self.b, transform)[0]
                if bad:
                    return "; in " + ", ".join(bad) + by_token
        return by_token

    def summary(self, threshold=None, metric=None, structural=None, *, allow_uncompared=None) -> dict:
        """As :meth:`Diff.summary`, with ``tokens`` (the plan, one line per request) and the first
        divergence's ``request`` and ``position``."""
        out = super().summary(threshold, metric, structural, allow_uncompared=allow_uncompared)
        out["tokens"] = str(self.tokens).splitlines()
        div = out["first_divergence"]
        if div is not None:
            found = self._divergence  # the verdict super().summary() just gave
            div["request"], div["position"] = found.request, found.position
        return out

    def per_position(self, key: str, dim: int | str = 0, metric=None, threshold=None) -> xr.DataArray:
        """The metric of one entry per request and position (dims ``request``, ``call``,
        ``position``); the ``position`` coordinate is the token position when every request's
        compared positions start at 0 without a gap, else the index into
        ``d.tokens.requests[r].positions``, and the coordinate ``token_position``
        (``request`` × ``position``, -1 past a request's end) gives the position.

        Examples
        --------
        >>> d.per_position("model.model.layers.0.mlp").sel(request=1)   # doctest: +SKIP
        """
        da = super().per_position(key, dim, metric, threshold).rename({"pass": "request"})
        npos = da.sizes["position"]
        table = np.full((da.sizes["request"], npos), -1, dtype=np.int64)
        for i, r in enumerate(da["request"].values.tolist()):
            pos = self.tokens.requests[r].positions[:npos]
            table[i, : len(pos)] = pos
        return da.assign_coords(token_position=(("request", "position"), table))


def _shard_slices(pi, key: str) -> list[tuple[str, list[tuple[int, int]], int]]:
    """The shards' slices (:func:`slices_of`'s) in one request's gathered entry ``key``: where
    each of its token runs is read from an unsharded pass that concatenates the ranks along a
    dim past the token rows, the same in every run; else ``[]``."""
    node = pi.plans.get(key) if isinstance(pi, LogicalPass) else None
    todo, found = ([node] if node else []), None
    while todo:
        n = todo.pop()
        if n["op"] in ("narrow", "flat"):
            todo.append(n["part"])
            continue
        if n["op"] == "cat" and "src" not in n:
            todo.extend(n["parts"])
            continue
        if n["op"] != "read":
            return []
        src = pi.sources[n["src"]]
        plan = src.plans.get(n["key"]) if isinstance(src, LogicalPass) else None
        if plan is None or src.tokens is None:
            return []
        lead = len(src.tokens.shape) - 1  # the token dims, flattened into one when gathered
        parts = [(label, spans, dim - lead) for label, spans, dim in slices_of(plan, src.source_shape)]
        if len(parts) < 2 or any(dim < 1 for *_, dim in parts) or found not in (None, parts):
            return []
        found = parts
    return found or []


def _like(ds, passes):
    """A DumpSet of the same kind, path, selection and client over ``passes``."""
    return type(ds)(ds.path, passes, op_pattern=ds.op_pattern, client=ds.client)


def _unsharded(ds):
    """``ds.unshard()`` with each pass's token layout (the same on every rank, checked)."""
    if len(ds.ranks) == 1:
        return ds
    out = ds.unshard()
    for (_, p), pi in out.pass_map.items():
        if pi.tokens is not None:  # context parallel's ranks put together (align/zigzag.py)
            continue
        layouts = {ds.pass_map[(r, p)].tokens for r in ds.ranks if (r, p) in ds.pass_map}
        if len(layouts) != 1:
            raise AlignError(
                f"{ds.path}: pass {p}'s ranks record different token layouts: they cannot be unsharded"
            )
        pi.tokens = layouts.pop()
    return out
