"""Non-tensor arguments of recorded op calls: what they were, and where two sides differ.

Op-level capture with ``inputs=True`` writes each call's arguments to the
sidecar (``call_args``): tensors by key, scalars, shapes, dtypes by value. Two
runs whose tensors agree can still differ there (RMSNorm's ``eps`` 1e-6 vs
1e-4 reaches ``aten.add.Tensor`` as ``other``); :func:`arg_difference` names
the first such argument and both values. Names come from the operator's schema,
looked up by name in torch's registry (nothing is resolved or run).

Examples
--------
>>> describe_args({"aten": "aten.add.Tensor", "spec": None, "leaves": [{"t": "x"}, 1e-06]})
[('self', 'tensor x'), ('other', '1e-06')]
"""

from __future__ import annotations

import functools
from typing import Any

from torch.utils._pytree import tree_unflatten, treespec_loads


@functools.lru_cache(maxsize=512)
def _arg_names(aten: str) -> tuple[str, ...]:
    """Positional argument names of ``aten.op.overload`` from torch's schema registry."""
    import torch

    try:
        ns, op, overload = aten.split(".")
        schema = torch._C._get_schema(f"{ns}::{op}", "" if overload == "default" else overload)
        return tuple(a.name for a in schema.arguments)
    except (ValueError, RuntimeError):
        return ()


def _show(leaf: Any) -> str:
    if isinstance(leaf, dict):
        if "t" in leaf:
            return f"tensor {leaf['t']}" if leaf["t"] else "tensor (not recorded)"
        if "f" in leaf:
            return str(leaf["f"])
        for k in ("dtype", "layout", "memory_format"):
            if k in leaf:
                return f"torch.{leaf[k]}"
        if "device" in leaf:
            return f"device {leaf['device']!r}"
        if "complex" in leaf:  # a sidecar is data: show what is there, whatever its shape
            c = leaf["complex"]
            ok = isinstance(c, list) and len(c) == 2 and all(type(v) in (int, float) for v in c)
            return repr(complex(*c)) if ok else str(c)
        return str(leaf.get("repr", leaf))
    return repr(leaf)


@functools.lru_cache(maxsize=256)
def _spec(text: str):
    return treespec_loads(text)


def _arguments(call_args: dict, keys: bool = True) -> list[tuple[str, Any]]:
    """``[(name, value)]`` of a recorded call; values are leaves shown as text (nested for
    lists); ``keys=False`` shows every tensor as ``"tensor"`` (keys differ between runs)."""
    leaves = call_args.get("leaves") or []
    shown = [_show(v) if keys or not (isinstance(v, dict) and "t" in v) else "tensor" for v in leaves]
    names = _arg_names(str(call_args.get("aten", "")))
    spec = call_args.get("spec")
    try:
        args, kwargs = tree_unflatten(shown, _spec(spec)) if spec else (shown, {})
    except Exception:  # a spec torch cannot read: one argument per leaf, by position
        args, kwargs = shown, {}
    out = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)]
    return out + list(kwargs.items())


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_text(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return str(value)


def describe_args(call_args: dict | None) -> list[tuple[str, str]]:
    """``[(argument name, value as text)]`` of one recorded op call (empty when none)."""
    if not call_args:
        return []
    return [(name, _text(v)) for name, v in _arguments(call_args)]


def arg_difference(ca: dict | None, cb: dict | None) -> str:
    """The first non-tensor argument that differs between two recorded calls, as a reason
    (``"argument 'other' of aten.add.Tensor: 1e-06 vs 0.0001"``); ``""`` when none does or a
    side recorded no arguments."""
    if not ca or not cb or ca.get("leaves") == cb.get("leaves"):
        return ""
    aten = str(ca.get("aten", ""))
    xa, xb = dict(_arguments(ca, keys=False)), dict(_arguments(cb, keys=False))
    for name in list(xa) + [n for n in xb if n not in xa]:
        va, vb = xa.get(name), xb.get(name)
        if va != vb:
            return (
                f"argument {name!r} of {aten}: {_text(va) if va is not None else '(absent)'} vs "
                f"{_text(vb) if vb is not None else '(absent)'}"
            )
    return ""
