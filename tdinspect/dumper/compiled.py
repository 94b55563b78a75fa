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

Outputs are measured in the graph where nothing but a copy is wanted of the tensor (no
live comparison, no checksums): the hook computes each tensor's statistics with
:func:`~tdinspect.numerics.stats.graph_stats`, inductor fuses those reductions with the
kernels that produce the tensors, and ``tdinspect::record_stats`` is handed one row of
statistics per entry (with its shape and dtype) and the tensors: stored when the capture keeps
them, measured again when a CPU row says they hold NaN or Inf, else let go. With statistics
only and nothing to check at once, the op leaves the entries to :func:`flush`, which records
them after the graph's kernels.

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

import collections
import itertools
import math
import sys
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from tdinspect.dumper.stance import SharedHold
from tdinspect.numerics.shapes import broadcast_dims
from tdinspect.numerics.stats import complete_graph_row, graph_stats

SEP = "\x1f"  # between labels in the op's string argument (never in a module name)
_NAMESPACE = "tdinspect"
_sites: dict[int, _Site] = {}
_pending: collections.deque = collections.deque()  # record_stats calls left for flush()
_numbers = itertools.count(1)
_lock = threading.Lock()
_lib = None
_op = None
_stats_op = None
# Recorded outputs' statistics computed inside the graph (fused by inductor); False: by
# the record op at run time, from the tensors (bench/compile.py measures both side by side).
# Read when a capture installs its hooks.
STATS_IN_GRAPH = True


class Measured(NamedTuple):
    """An entry whose statistics the compiled graph computed: what the recorder is
    handed instead of (or beside) the tensor."""

    shape: list[int]
    dtype: str  # as ``str(tensor.dtype)``: the sidecar's spelling
    row: torch.Tensor  # float64, ordered like tdinspect.numerics.stats.STAT_NAMES


def _library():
    """The ``tdinspect`` operator library, made at the first call.

    Operators defined on it directly (schema, one ``CompositeExplicitAutograd`` kernel),
    not with ``torch.library.custom_op``: the compiled graph calls them at every recorded
    module, and custom_op's Python autograd layer cost 14 µs a call against 4 µs.
    """
    global _lib
    if _lib is None:
        _lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    return _lib


def _define(name: str, schema: str, kernel: Callable):
    """``torch.ops.tdinspect.<name>``: ``kernel`` on every device, a fake kernel that
    returns nothing, registered as an ordered effect."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    lib = _library()
    lib.define(f"{name}{schema} -> ()")
    lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{_NAMESPACE}::{name}", lambda *args: None, lib=lib)
    _register_effectful_op(f"{_NAMESPACE}::{name}", _EffectType.ORDERED)
    return getattr(torch.ops.tdinspect, name).default


def record_op():
    """``torch.ops.tdinspect.record`` (``(int site, str labels, Tensor[] tensors) -> ()``),
    registered at the first call, as an ordered effect."""
    global _op
    with _lock:
        if _op is None:

            def record(site: int, labels: str, tensors: list[torch.Tensor]) -> None:
                found = _sites.get(site)
                if found is not None:  # a closed capture's site: compiled code may outlive it
                    flush()  # what came before it first
                    found.sink(_split(labels), list(tensors), None)

            _op = _define("record", "(int site, str labels, Tensor[] tensors)", record)
    return _op


def record_stats_op():
    """``torch.ops.tdinspect.record_stats``: the record op for entries whose statistics the
    graph computed (``(int site, str labels, str dtypes, SymInt[] ranks, SymInt[] sizes,
    Tensor stats, Tensor[] tensors, bool store) -> ()``; ``stats`` is one row per entry
    (:func:`~tdinspect.numerics.stats.graph_stats`), ``tensors`` the entries' tensors, which
    the sink is handed when ``store``), registered at the first call, as an ordered effect.

    Runs between the graph's kernels, so it does as little as it can: it copies the rows
    (inductor reuses their buffer), measures a CPU row's tensor holding NaN or Inf
    (:func:`~tdinspect.numerics.stats.complete_graph_row`) while the tensor is alive, and,
    for a site that allows it, leaves the rest to :func:`flush` (Python run between the
    kernels of a compiled graph cost 20-30x what it costs after it, measured on CPU).
    """
    global _stats_op
    with _lock:
        if _stats_op is None:

            def record_stats(site, labels, dtypes, ranks, sizes, stats, tensors, store) -> None:
                found = _sites.get(site)
                if found is None:  # a closed capture's site
                    return
                if stats.device.type == "cpu":
                    rows = stats.tolist()
                    if not math.isfinite(sum(v for row in rows for v in row[:6])):
                        rows = [complete_graph_row(r, t).tolist() for r, t in zip(stats.unbind(0), tensors)]
                else:  # stays on the device (read at step): a copy, the buffer is reused
                    rows = stats.clone()
                call = (found.sink, labels, dtypes, ranks, sizes, rows, list(tensors) if store else None)
                if not store and found.deferred and threading.current_thread() is found.thread:
                    _pending.append(call)
                else:
                    flush()
                    _deliver(*call)

            _stats_op = _define(
                "record_stats",
                "(int site, str labels, str dtypes, SymInt[] ranks, SymInt[] sizes, Tensor stats, "
                "Tensor[] tensors, bool store)",
                record_stats,
            )
    return _stats_op


def _deliver(sink, labels, dtypes, ranks, sizes, rows, tensors) -> None:
    shapes, at = [], 0
    for rank in ranks:
        shapes.append(list(sizes[at : at + rank]))
        at += rank
    if isinstance(rows, list):
        rows = torch.tensor(rows, dtype=torch.float64).unbind(0)
    else:
        rows = rows.unbind(0)
    measured = [Measured(*m) for m in zip(shapes, dtypes.split(SEP), rows)]
    sink(_split(labels), tensors or [None] * len(measured), measured)


def flush() -> None:
    """Hand the sinks what record ops left for later (statistics only), in the order the
    compiled graphs ran them. A capture calls it before it records anything else and at
    ``step()``, so its entries keep their order."""
    while _pending:
        _deliver(*_pending.popleft())


def _split(labels: str) -> list[str]:
    return labels.split(SEP) if labels else [""]


class _Site(NamedTuple):
    sink: Callable
    deferred: bool
    thread: threading.Thread


def new_site(sink: Callable, *, deferred: bool = False) -> int:
    """A number for the record ops to call ``sink(labels, tensors, measured)`` with, until
    :func:`drop_site`. ``measured`` is ``None`` (the tensors are handed over), or a
    :class:`Measured` per entry (the graph computed their statistics; ``tensors`` then
    holds the tensors to store, or ``None`` each with statistics only).

    ``deferred``: statistics-only calls from the thread that made the site may reach
    ``sink`` later, at :func:`flush` (for a sink that does nothing the graph must wait for).
    """
    with _lock:
        n = next(_numbers)
        _sites[n] = _Site(sink, deferred, threading.current_thread())
        return n


def drop_site(site: int) -> None:
    """The op's calls for ``site`` do nothing from now on (nor do those left for
    :func:`flush`: the capture that flushes before it closes has none)."""
    found = _sites.pop(site, None)
    if found is not None and _pending:
        kept = [call for call in list(_pending) if call[0] is not found.sink]
        _pending.clear()
        _pending.extend(kept)


def traced_hook(site: int, op, flatten: Callable, eager: Callable, stats: str | None = None) -> Callable:
    """A forward hook: under dynamo's trace, one ``op`` call with the tensors
    ``flatten(output)`` gives (``[(label, tensor), ...]``); otherwise ``eager``.

    ``stats``: ``"only"`` or ``"with_tensors"`` compute the statistics of the tensors
    in the graph (:func:`~tdinspect.numerics.stats.graph_stats`, fused by inductor) and call
    :func:`record_stats_op` with them, and with the tensors for ``"with_tensors"``;
    ``None`` hands the tensors to ``op``, as does an output holding a tensor that the
    recorder stores in its own form (see :func:`in_graph`)."""
    stats_op = record_stats_op() if stats is not None else None  # registered before any trace

    def hook(module, args, output):
        if torch.compiler.is_compiling():
            items = flatten(output)
            labels = SEP.join(k for k, _ in items)
            tensors = [t for _, t in items]
            if stats is not None and tensors and all(map(in_graph, tensors)):
                _measured(stats_op, site, labels, tensors, stats == "with_tensors")
            else:
                op(site, labels, tensors)
            return None
        return eager(module, args, output)

    return hook


def in_graph(t: torch.Tensor) -> bool:
    """Whether the graph computes ``t``'s statistics: a dense tensor that is not a broadcast
    view (those the recorder measures and stores in their own form, as eagerly)."""
    return t.layout == torch.strided and not t.is_quantized and not broadcast_dims(t)


def _measured(op, site: int, labels: str, tensors: list[torch.Tensor], store: bool) -> None:
    rows = torch.stack([graph_stats(t) for t in tensors])
    sizes = [d for t in tensors for d in t.shape]
    dtypes = SEP.join(str(t.dtype) for t in tensors)
    # the tensors go too, stored or not: a CPU row of a tensor holding NaN or Inf is measured
    # from it (complete_graph_row)
    op(site, labels, dtypes, [t.dim() for t in tensors], sizes, rows, tensors, store)


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
            "recompiles": recompiles(guard_failures),
        }

    def mark(self) -> None:
        self._at = self._now()

    def since(self) -> dict[str, int]:
        now = self._now()
        return {k: now[k] - self._at[k] for k in self.FIELDS}


def recompiles(failures: dict) -> int:
    """Recompiles from dynamo's ``guard_failures`` (``{code: ["<frame>/<n>: reason", ...]}``).

    Each recompile of a frame checks, and records the failure of, every graph cached for it so
    far, so the failures grow as the square of the recompiles (a function recompiled at three new
    shapes: six failures). The k-th recompile is the first to see graph ``k - 1`` fail: the
    recompiles of a frame are the cached graphs whose guards ever failed.

    >>> recompiles({"f": ["0/0: x.size()[0] == 3", "0/1: ...", "0/0: ...", "0/2: ...", "0/1: ...", "0/0: ..."]})
    3
    """
    return sum(len({reason.split(":", 1)[0] for reason in found}) for found in failures.values())


def graph_break_reasons(limit: int = 3) -> list[str]:
    """The first lines of the latest graph-break reasons dynamo counted."""
    from torch._dynamo.utils import counters

    return [why.splitlines()[0] for why in list(counters["graph_break"])[-limit:]]
