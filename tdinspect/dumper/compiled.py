"""Recording inside ``torch.compile``d graphs: hooks that dynamo traces into one custom op.

A forward hook run while dynamo traces a compiled model calls ``tdinspect::record``
with the tensors it would record, a *site* number (which capture, module and kind)
and the entry labels joined into one string. The op is registered as an ordered
effect (``torch._higher_order_ops.effects``), so dynamo keeps it in the graph,
AOTAutograd threads an effect token through it and inductor neither drops nor
reorders it: it runs, eagerly, at its place in the compiled graph on every call,
and its implementation hands the tensors to the same code the eager hooks use
(the recorder, live comparison, ``on_nonfinite``). The compiled code computes the
same values with and without it: the op reads its inputs and returns nothing.

Usage (what :class:`tdinspect.dumper.modules.ModuleCapture` does)::

    site = new_site(lambda labels, tensors: ...)  # called at graph run time
    hook = traced_hook(site, record_op(), lambda out: [("", out)], eager_hook)
    module.register_forward_hook(hook)

Dynamo does not guard compiled code on the hooks of submodules
(``torch._dynamo.config.skip_nnmodule_hook_guards``): code compiled before the capture
started never calls the hooks, so :func:`drop_compiled_code` makes dynamo compile anew,
and :data:`HOOK_GUARDS` has it guard on hooks while captures are open (another
instance of the same class, compiled without hooks, would otherwise share its graph
with the captured one, and the other way round).

Nothing here imports ``torch._dynamo`` until a compiled model is captured.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable

import torch

from tdinspect.dumper.stance import SharedHold

SEP = "\x1f"  # between labels in the op's string argument (never in a module name)
_NAMESPACE = "tdinspect"
_sites: dict[int, Callable[[list[str], list[torch.Tensor]], None]] = {}
_numbers = itertools.count(1)
_lock = threading.Lock()
_op = None


def record_op():
    """``torch.ops.tdinspect.record`` (``(int site, str labels, Tensor[] tensors) -> ()``),
    registered at the first call, as an ordered effect."""
    global _op
    with _lock:
        if _op is None:
            from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

            @torch.library.custom_op(f"{_NAMESPACE}::record", mutates_args=())
            def record(site: int, labels: str, tensors: list[torch.Tensor]) -> None:
                sink = _sites.get(site)
                if sink is not None:  # a closed capture's site: compiled code may outlive it
                    sink(labels.split(SEP) if labels else [""], list(tensors))

            @record.register_fake
            def _(site, labels, tensors):
                return None

            _register_effectful_op(record, _EffectType.ORDERED)
            _op = torch.ops.tdinspect.record.default
    return _op


def new_site(sink: Callable[[list[str], list[torch.Tensor]], None]) -> int:
    """A number for the op to call ``sink(labels, tensors)`` with, until :func:`drop_site`."""
    with _lock:
        n = next(_numbers)
        _sites[n] = sink
        return n


def drop_site(site: int) -> None:
    """The op's calls for ``site`` do nothing from now on."""
    _sites.pop(site, None)


def traced_hook(site: int, op, flatten: Callable, eager: Callable) -> Callable:
    """A forward hook: under dynamo's trace, one ``op`` call with the tensors
    ``flatten(output)`` gives (``[(label, tensor), ...]``); otherwise ``eager``."""

    def hook(module, args, output):
        if torch.compiler.is_compiling():
            items = flatten(output)
            op(site, SEP.join(k for k, _ in items), [t for _, t in items])
            return None
        return eager(module, args, output)

    return hook


def traced_pre_hook(site: int, op, flatten: Callable, eager: Callable) -> Callable:
    """A forward pre-hook (``with_kwargs=True``): under dynamo's trace, one ``op`` call
    with ``flatten(module, args, kwargs)``'s tensors; otherwise ``eager``."""

    def pre_hook(module, args, kwargs):
        if torch.compiler.is_compiling():
            items = flatten(module, args, kwargs)
            op(site, SEP.join(k for k, _ in items), [t for _, t in items])
            return None
        return eager(module, args, kwargs)

    return pre_hook


def drop_compiled_code() -> bool:
    """Make dynamo compile every frame anew at its next call (``torch._dynamo.reset``)
    when it has compiled anything in this process; whether it had.

    Compiled code holds no guard on the hooks of submodules, so code compiled
    before a capture would run without its hooks (and code compiled during one
    would go on calling the record op after it). Dynamo keeps its caches on code
    objects that all compiled modules share, so the reset is process-wide."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    from torch._dynamo.convert_frame import input_codes

    if not input_codes.seen:
        return False
    dynamo.reset()
    return True


def _guard_hooks():
    from torch._dynamo import config

    prior, config.skip_nnmodule_hook_guards = config.skip_nnmodule_hook_guards, False
    return lambda: setattr(config, "skip_nnmodule_hook_guards", prior)


# dynamo guards compiled code on module hooks while a capture in graph mode is open
HOOK_GUARDS = SharedHold(_guard_hooks)


class CompileCounter:
    """Graphs dynamo compiled, graph breaks and recompiles since :meth:`mark`
    (``torch._dynamo.utils.counters`` and ``guard_failures``), for a capture to report
    what it caused. Process-wide counts: other code compiling meanwhile counts too."""

    FIELDS = ("graphs", "graph_breaks", "recompiles")

    def __init__(self):
        self._at = self._now()

    @staticmethod
    def _now() -> dict[str, int]:
        from torch._dynamo.utils import counters, guard_failures

        return {
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            # a recompile is a cached graph whose guards failed: dynamo keeps why
            "recompiles": sum(map(len, guard_failures.values())),
        }

    def mark(self) -> None:
        self._at = self._now()

    def since(self) -> dict[str, int]:
        now = self._now()
        return {k: now[k] - self._at[k] for k in self.FIELDS}


def graph_break_reasons(limit: int = 3) -> list[str]:
    """The first lines of the latest graph-break reasons dynamo counted."""
    from torch._dynamo.utils import counters

    return [why.splitlines()[0] for why in list(counters["graph_break"])[-limit:]]
