"""The key grammar: how an entry of a pass file is named, and how to parse it back.

A key names one captured tensor::

    key     := base [ "::call" N ]            N >= 1; the bare key is call 0
    base    := module [ "/" op ] { "[" label "]" }
    module  := dotted module path rooted at the capture root ("model.layers.0.o_proj")
    op      := aten overload name ("aten.native_layer_norm.default"), op-level capture only
    label   := outN | inN                     op-level: N-th tensor output / input (pytree order)
             | index | field                   module-level structured outputs
    Labels and module-name components escape ``% [ ] / :`` as ``%25 %5B %5D %2F %3A``
    (:func:`escape`), so distinct names always give distinct keys.
             | "in" label...                   module-level inputs (``capture(record=("inputs",))``)

Parameters, buffers and gradients (``capture(record=("params", "grads"))``)
are named by extending the module path, as ``named_parameters`` does:
``module.weight`` and ``module.weight.grad``; they parse as module paths, and
the sidecar's ``kind`` column says what an entry is.

Examples::

    model.layers.0.o_proj                            a module's tensor output, first call
    model.layers.0.attn::call2                       its third call in the same pass
    model.layers.0.attn[0]                           element 0 of a tuple output
    model.head[logits]                               field "logits" of a dict/dataclass output
    model.layers.0.ln1/aten.native_layer_norm.default[out0]
    model.layers.0.ln1/aten.native_layer_norm.default[in2]::call1
    model.layers.0.mlp.up[in][0]                     positional input 0 of a module
    model.layers.0.attn[in][mask]::call1             keyword input "mask", second call
    model.layers.0.mlp.up.weight                     a parameter
    model.layers.0.mlp.up.weight.grad                its gradient

Filters match ``base`` without the ``[label]`` part for module-level capture
(the module name) and ``module/op`` for op-level capture.

Examples
--------
>>> parse_key("model.layers.0.ln/aten.add.Tensor[in1]::call2")
KeyParts(base='model.layers.0.ln/aten.add.Tensor[in1]', call=2, module='model.layers.0.ln', op='aten.add.Tensor', labels=('in1',))
"""

from __future__ import annotations

import re
from typing import NamedTuple

from tdinspect.errors import KeyGrammarError

CALL_SEP = "::call"
INPUT_PREFIX = "[in]"  # module-level inputs: name[in][0], name[in][kwarg]
# \Z, never $: $ also matches before a final newline, which would drop it from a name
_KEY_RE = re.compile(r"^(?P<base>.*?)(?:::call(?P<call>[1-9]\d*))?\Z", re.S)
_BASE_RE = re.compile(r"^(?P<module>[^/\[\]]*)(?:/(?P<op>[^/\[\]]+))?(?P<labels>(?:\[[^\[\]]*\])*)\Z")
_LABEL_RE = re.compile(r"\[([^\[\]]*)\]")
_IO_RE = re.compile(r"^(out|in)(\d+)\Z")
_ESCAPED = re.compile(r"[%\[\]/:]")  # characters with a meaning in keys, and the escape itself
_UNESCAPE = re.compile(r"%(25|5B|5D|2F|3A)")


class KeyParts(NamedTuple):
    """A parsed key; see the module docstring for the grammar."""

    base: str
    call: int
    module: str
    op: str | None
    labels: tuple[str, ...]

    @property
    def io(self) -> str | None:
        """``"out"`` or ``"in"`` for op-level entries, else ``None``."""
        m = _IO_RE.match(self.labels[-1]) if self.labels else None
        return m.group(1) if m else None

    @property
    def index(self) -> int | None:
        """Position of an op-level input or output, else ``None``."""
        m = _IO_RE.match(self.labels[-1]) if self.labels else None
        return int(m.group(2)) if m else None

    @property
    def level(self) -> str:
        """``"op"`` for dispatch-level entries, ``"module"`` otherwise."""
        return "module" if self.op is None else "op"


_CALL_INSIDE = re.compile(r"::call\d")  # a call number belongs at the end of a key


def parse_key(key: str) -> KeyParts:
    """Split a key into base, call, module, op and labels.

    Raises
    ------
    ValueError
        If ``key`` does not follow the grammar (the message quotes it).
    """
    if not isinstance(key, str) or not key:
        raise KeyGrammarError(f"invalid key {key!r}: expected a non-empty string")
    m = _KEY_RE.match(key)
    base, call = m.group("base"), int(m.group("call") or 0)
    b = _BASE_RE.match(base)
    if b is None or _CALL_INSIDE.search(b.group("module") + (b.group("op") or "")):
        # a '::callN' before the labels ('m::call2[0]') read as part of the module's name
        raise KeyGrammarError(f"invalid key {key!r}: expected 'module[/op][label]...[::callN]'")
    labels = tuple(_LABEL_RE.findall(b.group("labels")))
    return KeyParts(base, call, b.group("module"), b.group("op"), labels)


def split_call(key: str) -> tuple[str, int]:
    """``(base, call)`` of any key, even one that breaks the rest of the grammar."""
    m = _KEY_RE.match(key)
    return m.group("base"), int(m.group("call") or 0)


def make_key(base: str, call: int) -> str:
    """The on-disk key of call ``call`` (0-based) of ``base``."""
    return base if call == 0 else f"{base}{CALL_SEP}{call}"


def escape(text: str) -> str:
    """``text`` with ``% [ ] / :`` percent-encoded, so that it cannot be read as key syntax.

    Reversible (:func:`unescape`) and hence injective: ``a/b``, ``a_b`` and
    ``a:b`` stay three names.

    Examples
    --------
    >>> escape("a/b"), escape("a_b"), escape("x[0]"), escape("a::call1")
    ('a%2Fb', 'a_b', 'x%5B0%5D', 'a%3A%3Acall1')
    """
    return _ESCAPED.sub(lambda m: f"%{ord(m.group()):02X}", text)


def unescape(text: str) -> str:
    """The text :func:`escape` was given."""
    return _UNESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)


def label(value: object) -> str:
    """The ``[label]`` of a structured-output position or field name (escaped)."""
    return "[" + escape(str(value)) + "]"


def module_key(root: str, name: str) -> str:
    """The key of the module ``name`` (as ``named_modules`` gives it) under ``root``; each
    component escaped, so a module named ``a::call1`` or ``x[0]`` cannot pass for the second
    call of ``a`` or the first output of ``x``."""
    return ".".join([root, *(escape(part) for part in name.split("."))]) if name else root


def split_module_path(module: str) -> tuple[str, int, str]:
    """``(stack, layer, leaf)`` of a dotted module path.

    The layer is the last all-digit component; the stack is the path before it,
    the leaf the path after it. Paths without a layer give ``("", -1, last)``.

    Examples
    --------
    >>> split_module_path("model.expert_stack.layers.3.self_attn.o_proj")
    ('model.expert_stack.layers', 3, 'self_attn.o_proj')
    """
    parts = module.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i]), ".".join(parts[i + 1 :])
    return "", -1, parts[-1]
