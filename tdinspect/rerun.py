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
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tdinspect.align.args import describe_args
from tdinspect.errors import DumpFormatError, ReplayRefused
from tdinspect.naming import make_key, parse_key, split_call
from tdinspect.numerics.metrics import compare_tensors
from tdinspect.util.terminal import visible


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
    args : list of (name, value)
        The recorded arguments of the call, as text (tensors by key).
    other_args : list of (name, value), optional
        The same call's recorded arguments in the other run (``replay(..., other=)``).
    """

    op: str
    key: str
    dtype: torch.dtype
    outputs: list[dict[str, Any]] = field(default_factory=list)
    args: list[tuple[str, str]] = field(default_factory=list)
    other_args: list[tuple[str, str]] | None = None

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
        from tdinspect.report import replay_html

        return replay_html(self)

    def __repr__(self) -> str:
        def shown(args):
            return ", ".join(f"{n}={v}" for n, v in args)

        text = (
            f"ReplayResult({self.key}: rel_diff={self.rel_diff:.3g}, max_abs={self.max_abs:.3g} "
            f"against a {str(self.dtype).removeprefix('torch.')} re-run; args: {shown(self.args)}"
        )
        if self.other_args is not None:
            text += f"; other run's args: {shown(self.other_args)}"
        return visible(text + ")")  # the key and arguments come from the dump


# operators refused whatever their schema says: they reach files, other devices' state,
# or copy into memory they did not allocate
DENIED = frozenset(
    {
        "from_file",
        "save",
        "load",
        "_copy_from",
        "_copy_from_and_resize",
        "copy",
        "copy_",
        "set_",
        "_set_from",
        "record_stream",
        "_print",
        "_assert_async",
        "_assert_scalar",
        "_local_scalar_dense",
        "_nested_tensor_from_mask",
        "_foobar",
        "_make_per_tensor_quantized_tensor",
    }
)
# string arguments that are a fixed choice (``gelu(approximate="tanh")``), never a path
STRING_CHOICES = frozenset(
    {
        "approximate",
        "rounding_mode",
        "reduce",
        "equation",
        "side",
        "indexing",
        "padding_mode",
        "mode",
        "interpolation_mode",
        "UPLO",
        "driver",
    }
)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


def safe_op(name: Any, where: str = "replay"):
    """The aten overload named ``name``, if running it can have no effect but its fresh outputs.

    The decision is read from the operator's schema: every argument is a
    plain input (no ``Tensor(a!)`` mutation, no alias of an argument, no
    ``out=``), no string argument except known fixed choices (a string can be
    a path), not random (``nondeterministic_seeded``: it moves the generator),
    in the ``aten`` namespace, and not on the short :data:`DENIED` list.

    Raises
    ------
    ReplayRefused
        Saying why, naming ``where`` (the file and entry).

    Examples
    --------
    >>> safe_op("aten.gelu.default")
    <OpOverload(op='aten.gelu', overload='default')>
    >>> safe_op("aten.from_file.default")                  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tdinspect.errors.ReplayRefused: replay: aten.from_file.default ... not run ...
    """
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or not all(_NAME.match(p) for p in parts) or parts[0] != "aten":
        raise ReplayRefused(f"{where}: {str(name)[:80]!r} is not an aten operator name: not run")
    _, op_name, overload = parts
    reason = None
    packet = getattr(torch.ops.aten, op_name, None) if op_name not in DENIED else None
    if op_name in DENIED:
        reason = "it is on the list of operators replay never runs"
    elif not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
        reason = "no such operator in this torch"
    else:
        op = getattr(packet, overload)
        schema = op._schema
        for arg in schema.arguments:
            if arg.alias_info is not None or arg.is_out:
                reason = f"its argument {arg.name!r} is written or aliased"
            elif "str" in str(arg.type) and arg.name not in STRING_CHOICES:
                reason = f"it takes a string {arg.name!r} (a path, perhaps)"
            if reason:
                break
        if reason is None and any(r.alias_info is not None for r in schema.returns):
            reason = "its output aliases an argument"
        if reason is None and torch.Tag.nondeterministic_seeded in op.tags:
            reason = "it is random (it would move the random generator and cannot repeat)"
        if reason is None:
            return op
    raise ReplayRefused(f"{where}: {name} is not run by replay: {reason}")


REPLAY_FACTOR = 64  # a re-run may make at most this many times the bytes of its inputs...
REPLAY_FLOOR_BYTES = 256 << 20  # ...or this many, whichever is more


def _refuse_outsized(op, args: Any, kwargs: dict, where: str) -> None:
    """Refuse a re-run whose outputs would be far larger than its inputs (sizes are the file's
    text: ``aten.new_zeros`` with a forged size asked for 34 GB). The outputs' sizes come from
    running the op on meta tensors first, which allocates nothing; a factory's ``device=`` is
    made ``"meta"`` too (``aten.ones([2**33], device="cpu")`` was made for real in that run,
    failed, and the real run went on to ask for 34 GB)."""
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    given = sum(t.numel() * t.element_size() for t in leaves)
    limit = max(REPLAY_FLOOR_BYTES, REPLAY_FACTOR * given)
    try:
        meta_args, meta_kwargs = tree_map(
            lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (args, kwargs)
        )
        if "device" in meta_kwargs:  # a factory (aten.ones([2**33]), device="cpu") made it for real
            meta_kwargs = {**meta_kwargs, "device": "meta"}
        outputs = tree_flatten(op(*meta_args, **meta_kwargs))[0]
    except Exception:  # noqa: BLE001 - no meta kernel: the real run says what is wrong
        return
    made = sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
    if made > limit:
        raise ReplayRefused(
            f"{where}: {op} would make {made} bytes from {given} bytes of inputs (at most {limit}): not run"
        )


def _out0_key(key: str) -> str:
    base, call = split_call(key)
    parts = parse_key(base)
    if parts.op is None:
        raise ValueError(f"{key!r} is not an op-level key (expected 'module/aten.op.overload...')")
    return make_key(f"{parts.module}/{parts.op}[out0]", call)


def replay(
    source,
    key: str,
    pass_: int = 0,
    *,
    rank: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    other=None,
    other_key: str | None = None,
) -> ReplayResult:
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
    other : DumpSet or path, optional
        The other run of a diff: its recorded arguments for the same call
        (``other_key``, default ``key``) are shown next to this run's
        (nothing of it is re-run).
    other_key : str, optional

    Returns
    -------
    ReplayResult

    Raises
    ------
    ReplayRefused
        If the recorded op could act beyond its own outputs (see :func:`safe_op`).
    """
    from tdinspect.dumpset import DumpSet

    ds = DumpSet.coerce(source)
    pi = ds.get_pass(pass_, rank)
    out0 = _out0_key(key)
    i = pi.position.get(out0)
    if i is None:
        raise KeyError(f"{pi.path}: no op call {out0!r}")

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(dtype) if t.is_floating_point() else t

    loaded = pi.load()
    spec = pi.call_args[i]
    if isinstance(spec, dict):  # refused before any argument is even decoded
        safe_op(spec.get("aten"), f"{pi.path}: entry {out0!r}")
    name, args, kwargs = pi.rebuild_args(i, loaded, cast=cast)
    op = safe_op(name, f"{pi.path}: entry {out0!r}")
    _refuse_outsized(op, args, kwargs, f"{pi.path}: entry {out0!r}")
    rerun = [t for t in tree_flatten(op(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
    result = ReplayResult(str(op), out0, dtype, args=describe_args(spec))
    if other is not None:
        ods = DumpSet.coerce(other)
        opi = ods.get_pass(pass_, rank)
        j = opi.position.get(_out0_key(other_key or key))
        if j is None:
            raise KeyError(f"{opi.path}: no op call {_out0_key(other_key or key)!r}")
        result.other_args = describe_args(opi.call_args[j])
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
        row = compare_tensors(
            recorded.to(fresh.dtype) if recorded.is_floating_point() else recorded, fresh.cpu()
        )
        result.outputs.append({"key": k, **row})
    return result
