"""Replay: re-run one recorded op on its recorded inputs, in high precision.

Did this op introduce the error, or did it receive it? ``replay`` rebuilds the
op from an op-level dump captured with ``inputs=True`` (its recorded inputs
and non-tensor arguments), runs it again in float64 on the CPU (or the dtype
and device you give), and measures the recorded output against that re-run.
An op that computes correctly shows only its dtype's rounding error even when
its inputs were already wrong; an op that is itself wrong shows a large error.

Examples
--------
>>> r = replay("sample_dumps/ops_layernorm",
...            "model.LayerNorm/aten.native_layer_norm.default")   # doctest: +SKIP
>>> r.rel_diff                                                     # doctest: +SKIP
1.1e-06
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .format import DumpFormatError
from .metrics import compare_tensors
from .naming import make_key, parse_key, split_call


@dataclass
class ReplayResult:
    """The op's own error: recorded outputs against a high-precision re-run.

    Attributes
    ----------
    op : str
        The aten overload.
    key : str
        The ``[out0]`` key of the replayed call.
    outputs : list of dict
        Per recorded output: its key and the metrics of recorded vs re-run.
    """

    op: str
    key: str
    dtype: torch.dtype
    outputs: list[dict[str, Any]] = field(default_factory=list)

    def worst(self, metric: str = "rel_diff") -> float:
        values = [o[metric] for o in self.outputs if not math.isnan(o.get(metric, math.nan))]
        return max(values) if values else math.nan

    @property
    def rel_diff(self) -> float:
        """Largest ``rel_diff`` over the op's outputs."""
        return self.worst("rel_diff")

    @property
    def max_abs(self) -> float:
        return self.worst("max_abs")

    def _repr_html_(self) -> str:
        from .report import replay_html

        return replay_html(self)

    def __repr__(self) -> str:
        return (f"ReplayResult({self.key}: rel_diff={self.rel_diff:.3g}, max_abs={self.max_abs:.3g} "
                f"against a {str(self.dtype).removeprefix('torch.')} re-run)")


def _out0_key(key: str) -> str:
    base, call = split_call(key)
    parts = parse_key(base)
    if parts.op is None:
        raise ValueError(f"{key!r} is not an op-level key (expected 'module/aten.op.overload...')")
    return make_key(f"{parts.module}/{parts.op}[out0]", call)


def replay(source, key: str, pass_: int = 0, *, rank: int | None = None,
           dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> ReplayResult:
    """Re-run a recorded op on its recorded inputs and measure its own error.

    Parameters
    ----------
    source : DumpSet or path
        An op-level dump captured with ``capture_ops(..., inputs=True)``.
    key : str
        Any key of the op call (``module/aten.op.overload[outN]::callK``) or
        its site (``module/aten.op.overload``, ``::callK`` allowed).
    pass_ : int
    rank : int, optional
    dtype : torch.dtype
        Floating inputs are cast to it for the re-run (float64 by default).
    device : str or torch.device

    Returns
    -------
    ReplayResult
    """
    from .dumpset import DumpSet

    ds = source if isinstance(source, DumpSet) else DumpSet.open(os.fspath(source))
    pi = ds.get_pass(pass_, rank)
    out0 = _out0_key(key)
    i = pi.position.get(out0)
    if i is None:
        raise KeyError(f"{pi.path}: no op call {out0!r}")

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(dtype) if t.is_floating_point() else t

    loaded = pi.load()
    op, args, kwargs = pi.rebuild_args(i, loaded, cast=cast)
    rerun = [t for t in tree_flatten(op(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
    result = ReplayResult(str(op), out0, dtype)
    base, call = split_call(out0)
    prefix = base[: -len("[out0]")]
    for n, fresh in enumerate(rerun):
        k = make_key(f"{prefix}[out{n}]", call)
        j = pi.position.get(k)
        if j is None or pi.uninitialized[j]:
            continue
        try:
            recorded = pi.tensor(k, loaded)
        except DumpFormatError:
            continue
        row = compare_tensors(recorded.to(fresh.dtype) if recorded.is_floating_point() else recorded,
                              fresh.cpu())
        result.outputs.append({"key": k, **row})
    return result
