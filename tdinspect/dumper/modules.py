"""Module-level capture: forward hooks on selected modules, one pass file per step.

Usage::

    import tdinspect
    with tdinspect.capture(model, "dumps/run_a", filter=[r"layers\\.0\\.", r"\\.heads\\."]) as dump:
        for batch in batches:
            model(batch)
            dump.step()            # writes rank0_pid<P>/pass00000.pt (+ .json sidecar)

Each selected module's output is detached, copied to the host and stored
under its dotted name rooted at ``model``; structured outputs (tuples, lists,
dicts, dataclasses, HF ``ModelOutput``) store each tensor under
``name[label]...`` (see :mod:`tdinspect.naming`). A module called several
times in one step stores ``name``, ``name::call1``, ``name::call2``...

``record=`` adds what goes into a module besides what comes out::

    record=("inputs", "outputs", "params", "grads")
    model.layers.0.mlp.up.weight        parameters and buffers, at the module's first call of a pass
    model.layers.0.mlp.up[in][0]        positional input 0 (keyword inputs: [in][name])
    model.layers.0.mlp.up               the output, as before
    model.layers.0.mlp.up.weight.grad   the gradient, when backward has accumulated it

A parameter unchanged since the pass that stored it (same storage, same
version counter: nothing wrote to it) is not copied again: its entry refers to
that pass. The sidecar's ``kind`` column says what each entry is
(``input``, ``output``, ``param``, ``buffer``, ``grad``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path, tree_unflatten

from tdinspect.config import DumpConfig, FilterSpec, parse_memory, parse_record
from tdinspect.dumper import compiled as graphs
from tdinspect.dumper.checks import Guarded, HealthCheck, StopsOnCheck, live_options, open_live
from tdinspect.dumper.memory import InMemory
from tdinspect.dumper.recorder import Recorder, current_rank, failed_text, parallel_coords
from tdinspect.dumper.reruns import close_reruns
from tdinspect.dumper.stance import hold_eager, release
from tdinspect.errors import ConfigError
from tdinspect.naming import CALL_SEP, INPUT_PREFIX, label, make_key, module_key

# model -> its captures still open that no ``with`` holds (see ModuleCapture._close_stale)
_UNMANAGED: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet] = weakref.WeakKeyDictionary()


def _eager(fn):
    """``fn`` run eagerly even inside a ``torch.compile``d forward: dynamo does not trace it
    (tracing the recorder's statistics hit recompile limits and crashed the user's forward);
    the graph breaks at the hook instead.

    ``torch.compiler.disable`` imports dynamo (about a second), so it is applied only once
    dynamo is loaded: a process that never compiles never pays for it. A model compiled
    after the capture started (``torch.compile`` loads dynamo) meets a hook not yet
    disabled at its first trace: dynamo breaks the graph at the ``disable`` call, which
    then runs eagerly, as does the hook."""
    disabled = torch.compiler.disable(fn, recursive=True) if "torch._dynamo" in sys.modules else None

    def hook(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return hook


_PARAM = "\x1e"  # marks a parameter's or buffer's label in the record op's labels


def _own_tensors(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """``(kind, name, tensor)`` of the module's own parameters and buffers."""
    return [
        (kind, pname, tensor)
        for kind, items in (
            ("param", module.named_parameters(recurse=False)),
            ("buffer", module.named_buffers(recurse=False)),
        )
        for pname, tensor in items
        if tensor is not None
    ]


def path_label(path) -> str:
    """The ``[label]...`` of a pytree key path (``(SequenceKey(2), MappingKey("h"))`` -> ``[2][h]``)."""
    return "".join(
        label(
            k.idx
            if isinstance(k, SequenceKey)
            else k.key
            if isinstance(k, MappingKey)
            else k.name
            if isinstance(k, GetAttrKey)
            else k
        )
        for k in path
    )


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _cache_layers(obj: Any) -> list[tuple[Any, Any]] | None:
    """``[(keys, values), ...]`` of a KV cache (Hugging Face ``DynamicCache`` and kin: a
    ``layers`` list of objects with ``keys``/``values``, or older ``key_cache``/``value_cache``
    lists), found by shape of the object so that capture never imports transformers."""
    layers = getattr(obj, "layers", None)
    if (
        isinstance(layers, (list, tuple))
        and layers
        and all(
            hasattr(layer, "keys") and hasattr(layer, "values") and not isinstance(layer, Mapping)
            for layer in layers
        )
    ):
        return [(layer.keys, layer.values) for layer in layers]
    keys, values = getattr(obj, "key_cache", None), getattr(obj, "value_cache", None)
    if isinstance(keys, list) and isinstance(values, list) and len(keys) == len(values):
        return list(zip(keys, values))
    return None


def flatten_output(
    output: Any, prefix: str = "", dropped: dict[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` for every tensor in a module's output, in a stable order.

    A KV cache object (HF ``DynamicCache``) gives ``[i][key]`` and ``[i][value]`` per
    layer. Any other part that is neither a tensor nor plain data is not stored: with
    ``dropped``, its label and type are added there so the caller can say so.

    Examples
    --------
    >>> [k for k, _ in flatten_output((torch.ones(1), None, {"h": torch.ones(1)}))]
    ['[0]', '[2][h]']
    """
    if isinstance(output, torch.Tensor):
        yield prefix, output
        return
    leaves, _ = tree_flatten_with_path(output)
    for path, leaf in leaves:
        sub = prefix + path_label(path)
        if isinstance(leaf, torch.Tensor):
            yield sub, leaf
        elif isinstance(leaf, Mapping):  # mapping types pytree does not know (ModelOutput-like)
            for k, v in leaf.items():
                yield from flatten_output(v, sub + label(k), dropped)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for f in dataclasses.fields(leaf):
                yield from flatten_output(getattr(leaf, f.name), sub + label(f.name), dropped)
        elif (layers := _cache_layers(leaf)) is not None:
            for i, (keys, values) in enumerate(layers):
                yield from flatten_output(keys, sub + label(i) + label("key"), dropped)
                yield from flatten_output(values, sub + label(i) + label("value"), dropped)
        elif dropped is not None and not isinstance(leaf, _PLAIN):
            dropped[sub] = type(leaf).__name__


def map_tensors(obj: Any, fn, prefix: str = "") -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(label, t)``: the labels and order of
    :func:`flatten_output`, the structure kept (tuples, dicts, dataclasses, ``ModelOutput``).

    Examples
    --------
    >>> map_tensors((torch.ones(1), None, {"h": torch.ones(1)}), lambda k, t: k)
    ('[0]', None, {'h': '[2][h]'})
    """
    if isinstance(obj, torch.Tensor):
        return fn(prefix, obj)
    leaves, spec = tree_flatten_with_path(obj)
    out = []
    for path, leaf in leaves:
        sub = prefix + path_label(path)
        if isinstance(leaf, torch.Tensor):
            leaf = fn(sub, leaf)
        elif isinstance(leaf, Mapping):
            leaf = type(leaf)({k: map_tensors(v, fn, sub + label(k)) for k, v in leaf.items()})
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            leaf = dataclasses.replace(
                leaf,
                **{
                    f.name: map_tensors(getattr(leaf, f.name), fn, sub + label(f.name))
                    for f in dataclasses.fields(leaf)
                    if f.init
                },
            )
        out.append(leaf)
    return tree_unflatten(out, spec)


def flatten_inputs(args: tuple, kwargs: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` for every tensor a module is called with: positional
    arguments under ``[in][i]...``, keyword arguments under ``[in][name]...``.

    Examples
    --------
    >>> [k for k, _ in flatten_inputs((torch.ones(1), 3), {"mask": torch.ones(1)})]
    ['[in][0]', '[in][mask]']
    """
    yield from flatten_output(tuple(args), INPUT_PREFIX)
    yield from flatten_output(dict(kwargs), INPUT_PREFIX)


def unwrap_compiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """The model to hook, and whether any part of it is compiled: a ``torch.compile(m)``
    wrapper (outside or on a submodule) or an in-place ``m.compile()``. Hooks do not fire
    inside compiled graphs, so capture then runs the model eagerly."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
        return unwrap_compiled(inner)[0], True
    compiled = any(
        type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )
    return model, compiled


def eager_name(name: str) -> str:
    """``layers.0._orig_mod.proj`` -> ``layers.0.proj``: a compiled submodule's wrapper adds
    ``_orig_mod`` to the path, which would keep compiled and eager runs from lining up."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def owns_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters of its own (not only through its children)."""
    return any(p is not None for p in module._parameters.values())


def select_modules(model: nn.Module, predicate, root: str, modules: str) -> list[tuple[str, nn.Module]]:
    """The ``(dotted name, module)`` pairs to hook, in ``named_modules`` order, that pass the
    filter: with ``"leaves"``, the leaves and the modules with parameters of their own (Mixtral's
    ``experts``: 3-D expert weights and an ``act_fn`` child; ``nn.MultiheadAttention``), whose
    work no leaf records; with ``"all"``, every module."""
    if modules not in ("leaves", "all"):
        raise ConfigError(f"modules={modules!r}: expected 'leaves' or 'all'")
    chosen = []
    for name, mod in model.named_modules():
        full = module_key(root, eager_name(name))
        if modules == "leaves" and next(mod.children(), None) is not None and not owns_parameters(mod):
            continue
        if type(mod).__name__ == "OptimizedModule":  # its _orig_mod is hooked under this name
            continue
        try:
            keep = predicate(full, mod)
        except Exception as exc:
            raise ConfigError(f"filter raised {type(exc).__name__} on module {full!r}: {exc}") from exc
        if keep:
            chosen.append((full, mod))
    return chosen


class ModuleCapture(StopsOnCheck, InMemory):
    """A running module-level capture; made by :func:`capture`.

    Use it as a context manager, or call :meth:`close` yourself. When dumping
    is off (no directory in the arguments, config or environment) and no check
    is asked for, it installs nothing and every method is a no-op, so it can
    stay in an engine loop.

    Attributes
    ----------
    enabled : bool
        Whether hooks are installed (to write passes, to check, or both).
    folder : Path or None
        This process's ``rank<R>_pid<P>`` folder.
    names : list of str
        The hooked module names.
    compile_mode : {"graph", "eager"} or None
        How a compiled model is captured (see :func:`capture`'s ``compile``).
    compile_counts : dict
        Graphs dynamo compiled, graph breaks and recompiles while this capture ran
        (``{"graphs", "graph_breaks", "recompiles"}``; counted in graph mode).
    """

    def __init__(
        self,
        model: nn.Module | None,
        config: DumpConfig,
        *,
        root: str = "model",
        modules: str = "leaves",
        stats_only: bool = False,
        checksum: bool = False,
        max_pending_bytes: int = 2 << 30,
        fsync: bool = False,
        warn_unfired: bool = True,
        background_write: bool | None = None,
        on_nonfinite: str | None = None,
        parallel: dict | None = None,
        dims: dict[str, str] | None = None,
        compare_to=None,
        compare_options: dict | None = None,
        overwrite: bool = False,
        checksum_dim: int | None = None,
        memory=None,
        compile: str | None = None,
    ):
        if compile not in (None, "graph", "eager"):
            raise ConfigError(f"compile={compile!r}: expected 'graph' or 'eager'")
        self.config = config
        memory = memory_limit(memory, config, compare_to)
        rank = current_rank(parallel_coords(parallel))
        self.health = HealthCheck(on_nonfinite, rank) if on_nonfinite else None
        self.live = None
        self.enabled = (
            config.enabled or memory is not None or self.health is not None or compare_to is not None
        )
        self.folder = None
        self.names: list[str] = []
        self._containers: set[str] = set()
        self._handles: list[Any] = []
        self._fired: set[str] = set()
        self._stance = None
        self._warn_unfired = warn_unfired
        self._graph_warned = False
        self.record = config.record
        self._open_calls: dict[str, list[tuple[int, int]]] = {}  # name -> (pass, call) in flight
        self._params_seen: dict[str, tuple] = {}  # key -> (identity, pass stored, stats)
        self._on_step: list[Any] = []
        self.recorder: Recorder | None = None
        self.compile_mode: str | None = None  # "graph" or "eager" once hooks are installed
        self.compile_counts = dict.fromkeys(graphs.CompileCounter.FIELDS, 0)
        self._counter: graphs.CompileCounter | None = None
        self._sites: list[int] = []
        self._guards: int | None = None  # a hold of graphs.HOOK_GUARDS
        self._pass_modes: set[str] = set()
        if not self.enabled:
            return
        if not isinstance(model, nn.Module):
            raise TypeError(f"capture(model=...) needs an nn.Module, got {type(model).__name__}")
        model, compiled = unwrap_compiled(model)
        chosen = select_modules(model, config.predicate(), root, modules)
        if not chosen:
            sample = [module_key(root, n) for n, _ in list(model.named_modules())[:6]]
            raise ConfigError(
                f"the filter selects no module of {type(model).__name__}, so nothing "
                f"would be captured (filter={config.filter!r}, "
                f"filter_fn={config.filter_fn!r}); names look like {sample}"
            )
        self._close_stale(model)
        if compare_to is not None:  # dump_dir then holds the evidence only, not a full dump
            self.live = open_live(
                compare_to,
                evidence_dir=config.dump_dir if config.enabled else None,
                rank=rank,
                level="module",
                **(compare_options or {}),
            )
        write = config.enabled and self.live is None
        self.recorder = Recorder(
            config.dump_dir if write else None,
            level="module",
            stats_only=stats_only,
            checksum=checksum,
            checksum_dim=checksum_dim,
            max_pending_bytes=max_pending_bytes,
            fsync=fsync,
            background_write=background_write,
            parallel=parallel,
            dims=dims,
            overwrite=overwrite,
            memory=memory,
        )
        self.folder = self.recorder.folder
        self._memory, self.recorder.on_stop = self.recorder.memory, self._on_check_error
        self._compiled = compiled
        self.compile_mode = compile or ("graph" if compiled else "eager")
        try:
            self._install(chosen)
            if compiled and self.compile_mode == "eager":  # last: nothing after it can fail
                warnings.warn(
                    "tdinspect: the model is torch.compile'd; running it eagerly while "
                    "capturing (compile='eager'; compile='graph' records inside the "
                    "compiled graphs)",
                    stacklevel=3,
                )
                self._stance = hold_eager()
                weakref.finalize(self, release, self._stance)  # a capture dropped unclosed
            elif self.compile_mode == "graph":
                # code compiled before the hooks were added would never call them
                graphs.drop_compiled_code()
                if "torch._dynamo" in sys.modules:
                    self._guards = graphs.HOOK_GUARDS.hold()
                    weakref.finalize(self, graphs.HOOK_GUARDS.release, self._guards)
                    self._counter = graphs.CompileCounter()
        except BaseException:
            self.close(write_pending=False, warn=False)  # hooks removed, nothing left on
            raise
        self._model_ref = weakref.ref(model)
        _UNMANAGED.setdefault(model, weakref.WeakSet()).add(self)

    def _install(self, chosen) -> None:
        """The hooks on the chosen modules."""
        if self.live is not None:  # every recorded entry is compared (and may end the capture)
            self.recorder.observer = Guarded(self.live, self._on_check_error)
        # outputs carry an explicit kind once other kinds share the pass (default: no new column)
        self._out_extra = {} if self.record == ("outputs",) else {"kind": "output"}
        self._weights = {name: [id(t) for t in mod.parameters(recurse=False)] for name, mod in chosen}
        for name, mod in chosen:
            self.names.append(name)
            if type(mod).forward is torch.nn.Module.forward:  # ModuleList, ModuleDict: never called
                self._containers.add(name)
            mtype = type(mod).__name__
            if "inputs" in self.record or "params" in self.record:
                self._handles.append(
                    mod.register_forward_pre_hook(self._make_pre_hook(name, mtype), with_kwargs=True)
                )
            self._handles.append(mod.register_forward_hook(self._make_hook(name, mtype)))
            if "grads" in self.record:
                for pname, param in mod.named_parameters(recurse=False):
                    if param.requires_grad:
                        self._handles.append(
                            param.register_post_accumulate_grad_hook(
                                self._make_grad_hook(f"{name}.{pname}.grad", mtype)
                            )
                        )

    def _close_stale(self, model: nn.Module) -> None:
        """Close the earlier captures into the same folder still open outside any ``with``
        (a re-run cell's) whose modules this one hooks too; warn of those into another
        (:mod:`.reruns`). That is the captures of this model, of a submodule of it (the
        cell re-run with the whole model as root) and of a model holding it (the other way)."""
        mine = {id(m) for m in model.modules()}
        for root in list(_UNMANAGED.keys()):
            if root is model:
                what = f"capture of this {type(model).__name__}"
            elif id(root) in mine:
                what = f"capture of a {type(root).__name__} inside this {type(model).__name__}"
            elif any(m is model for m in root.modules()):
                what = f"capture of a {type(root).__name__} holding this {type(model).__name__}"
            else:
                continue
            close_reruns(_UNMANAGED.get(root, ()), self.config.dump_dir, what, stacklevel=4)

    def _make_pre_hook(self, name: str, module_type: str):
        record = self.record

        def pre_hook(module, args, kwargs):
            if self._under_graph_capture(args[0] if args else None):
                return None
            graphs.flush()  # entries a compiled graph left for later come first
            self._pass_modes.add("eager")
            params = _own_tensors(module) if "params" in record else ()
            inputs = flatten_inputs(args, kwargs) if "inputs" in record else ()
            self._begin_call(name, module_type, params, inputs)
            return None

        if self.compile_mode != "graph":
            return _eager(pre_hook)

        def traced(module, args, kwargs):  # dynamo traces this: labels and tensors only
            params = (
                [(f"{_PARAM}{kind}.{pname}", t) for kind, pname, t in _own_tensors(module)]
                if "params" in record
                else []
            )
            return params + (list(flatten_inputs(args, kwargs)) if "inputs" in record else [])

        def sink(labels, tensors, measured):
            if tensors and self._under_graph_capture(tensors[0]):
                return
            self._pass_modes.add("graph")
            params = [
                (*label[len(_PARAM) :].split(".", 1), t)
                for label, t in zip(labels, tensors)
                if label.startswith(_PARAM)
            ]
            inputs = [(k, t) for k, t in zip(labels, tensors) if not k.startswith(_PARAM)]
            self._begin_call(name, module_type, params, inputs)

        return graphs.traced_pre_hook(self._site(sink), graphs.record_op(), traced, _eager(pre_hook))

    def _site(self, sink, deferred: bool = False) -> int:
        site = graphs.new_site(sink, deferred=deferred)
        self._sites.append(site)
        return site

    def _begin_call(self, name: str, module_type: str, params, inputs) -> None:
        """A call of ``name`` starts: its number, then its parameters (first call of the
        pass) and inputs, given as ``(kind, name, tensor)`` and ``(label, tensor)``."""
        rec = self.recorder
        call = rec.next_call(name)
        # the forward hook of this call takes the same number (a stack: calls may nest)
        self._open_calls.setdefault(name, []).append((rec.pass_index, call))
        if "params" in self.record and call == 0:
            self._record_params(name, params, module_type)
        if "inputs" in self.record:
            suffix = "" if call == 0 else f"{CALL_SEP}{call}"
            for sub, tensor in inputs:
                rec.record(name + sub + suffix, tensor, module_type=module_type, kind="input")

    def _call_number(self, name: str) -> int:
        rec = self.recorder
        stack = self._open_calls.get(name)
        while stack:
            pass_index, call = stack.pop()
            if pass_index == rec.pass_index:  # a stale entry: that forward raised, or the pass ended
                return call
        return rec.next_call(name)

    def _make_hook(self, name: str, module_type: str):
        def hook(module, args, output):
            if self._under_graph_capture(output):
                return None
            graphs.flush()
            self._pass_modes.add("eager")
            dropped: dict[str, str] = {}
            self._end_call(name, module_type, flatten_output(output, dropped=dropped), dropped)
            return None

        if self.compile_mode != "graph":
            return _eager(hook)

        def sink(labels, tensors, measured):
            first = tensors[0] if measured is None else measured[0].row
            if first is not None and self._under_graph_capture(first):
                return
            self._pass_modes.add("graph")
            self._end_call(name, module_type, zip(labels, tensors), {}, measured)

        stats = self._stats_in_graph()
        return graphs.traced_hook(
            # statistics only, nothing to check at once: recorded after the graph's kernels
            self._site(sink, deferred=stats == "only" and self.health is None),
            graphs.record_op(),
            lambda out: list(flatten_output(out)),
            _eager(hook),
            stats=stats,
        )

    def _stats_in_graph(self) -> str | None:
        """What the compiled graph computes for the outputs it records (see
        :func:`~tdinspect.dumper.compiled.traced_hook`): their statistics, for a capture
        whose entries need nothing else from the tensor than a copy (none with live
        comparison or checksums, which read the tensor at run time)."""
        rec = self.recorder
        if (
            not graphs.STATS_IN_GRAPH
            or "outputs" not in self.record
            or rec.writer is None
            or self.live is not None
            or rec.checksum
            or rec.checksum_dim is not None
        ):
            return None
        return "only" if rec.stats_only else "with_tensors"

    def _end_call(self, name: str, module_type: str, items, dropped: dict[str, str], measured=None) -> None:
        """A call of ``name`` returned ``items`` (``(label, tensor)``): record and check them.
        ``measured``: their statistics, computed by a compiled graph (``tensor`` is ``None``
        with statistics only)."""
        rec, health = self.recorder, self.health
        self._fired.add(name)  # it ran, even if recording it fails below
        call = self._call_number(name)
        suffix = "" if call == 0 else f"{CALL_SEP}{call}"
        outputs = "outputs" in self.record
        for i, (sub, tensor) in enumerate(items):
            key = name + sub + suffix
            order = len(rec)
            if measured is not None:  # the graph computed the statistics: the check reads them
                row = rec.record_measured(
                    key, tensor, measured[i], module_type=module_type, **self._out_extra
                )
                if health is not None:
                    self._checked(health.check_row, key, row, pass_=rec.pass_index, order=order)
                continue
            # recorded first: its statistics' NaN/Inf counts spare the check a read
            row = rec.record(key, tensor, module_type=module_type, **self._out_extra) if outputs else None
            if health is not None:
                self._checked(health.check, key, tensor, pass_=rec.pass_index, order=order, row=row)
        if dropped:
            rec.note_dropped({name + sub + suffix: kind for sub, kind in dropped.items()})

    def _record_params(self, name: str, items, module_type: str) -> None:
        """Parameters and buffers of a module (``(kind, name, tensor)``): copied when they
        changed since last stored."""
        rec = self.recorder
        for kind, pname, tensor in items:
            key = f"{name}.{pname}"
            # same storage and version counter: nothing has written to it since
            ident = (tensor.data_ptr(), tensor._version, tensor.dtype, tuple(tensor.shape))
            seen = self._params_seen.get(key)
            if seen is not None and seen[0] == ident:
                rec.record_unchanged(
                    key, tensor, seen[2], of_pass=seen[1], module_type=module_type, kind=kind
                )
            else:
                rec.record(key, tensor, module_type=module_type, kind=kind)
                self._params_seen[key] = (ident, rec.pass_index, rec.facts(key))

    def _make_grad_hook(self, key: str, module_type: str):
        rec = self.recorder

        def grad_hook(param):
            if param.grad is None or self._under_graph_capture(param.grad):
                return
            graphs.flush()
            rec.record(make_key(key, rec.next_call(key)), param.grad, module_type=module_type, kind="grad")

        return grad_hook

    def _under_graph_capture(self, output: Any) -> bool:
        t = output if isinstance(output, torch.Tensor) else None
        if t is None or not t.is_cuda or not torch.cuda.is_current_stream_capturing():
            return False
        if not self._graph_warned:
            self._graph_warned = True
            warnings.warn(
                "tdinspect: hooks are running inside CUDA-graph capture; graph replays "
                "will not be dumped. Run eagerly while dumping "
                "(DumpConfig.use_cuda_graph).",
                RuntimeWarning,
                stacklevel=3,
            )
        return True

    def _annotate_pass(self) -> None:
        """Say in the pass's sidecar how a compiled model was captured (``compile``:
        ``mode``, and the graphs, graph breaks and recompiles dynamo counted during the
        pass), and warn of graph breaks and recompiles."""
        if not self._compiled and not (self._pass_modes - {"eager"}):
            return
        modes, self._pass_modes = self._pass_modes, set()
        mode = "mixed" if len(modes) > 1 else next(iter(modes), self.compile_mode)
        info: dict[str, Any] = {"mode": mode}
        if self._counter is None and "torch._dynamo" in sys.modules and self.compile_mode == "graph":
            self._counter = graphs.CompileCounter()  # dynamo loaded after the capture began
        elif self._counter is not None:
            counts = self._counter.since()
            self._counter.mark()
            info.update(counts)
            for k, v in counts.items():
                self.compile_counts[k] += v
            if counts["graph_breaks"] or counts["recompiles"]:
                reasons = graphs.graph_break_reasons() if counts["graph_breaks"] else []
                warnings.warn(
                    f"tdinspect: {counts['graph_breaks']} graph break(s) and "
                    f"{counts['recompiles']} recompile(s) while capturing pass "
                    f"{self.recorder.pass_index} of the compiled model"
                    + (f" (latest: {'; '.join(reasons)})" if reasons else ""),
                    RuntimeWarning,
                    stacklevel=4,
                )
        self.recorder.annotate(compile=info)

    def _on_check_error(self) -> None:
        """A check raised: leave the model as it was (hooks removed, no partial pass written)
        before the error leaves ``model(...)`` or ``step()``."""
        self.close(write_pending=False, warn=False)

    # -- public API -----------------------------------------------------------------------
    def step(self, failed: str | None = None, *, tokens=None):
        """End the current pass and write it (always, even when empty).

        With ``on_nonfinite``, flags kept on an accelerator are read here (one
        copy per step) and the first offending entry is reported.
        ``failed`` (an error's text) marks a pass cut short by an error, in its
        sidecar: what it holds ran before the error (``%%tdi_capture`` sets it
        when the cell raises). ``tokens`` (:func:`tdinspect.tokens`) records which
        request and position each token row of the pass holds, for
        ``DumpSet.diff(other, tokens=True)``.

        Returns
        -------
        Path or None
            The pass file being written, or ``None`` when dumping is off.
        """
        if not self.enabled or self.recorder is None:
            return None
        graphs.flush()
        for callback in self._on_step:
            callback()
        self.recorder.warn_if_empty(
            "no hook fired during this step. Was model.forward() called "
            "directly (hooks need model(...)), or did the model run under "
            "CUDA-graph replay or torch.compile?"
        )
        self._annotate_pass()
        path = self.recorder.step(failed, tokens)
        if self.health is not None:
            self._checked(self.health.end_pass)
        return path

    @property
    def unfired(self) -> list[str]:
        """Selected modules whose hook has not fired so far (work they did was not captured).

        ``nn.MultiheadAttention`` uses its ``out_proj`` weights without calling
        it, for example (its own output is recorded: it holds parameters of its own);
        capture with ``modules="all"`` to see other parents.
        Containers without a forward of their own (``ModuleList``,
        ``ModuleDict``) are never called, so never missing.
        """
        graphs.flush()
        return [n for n in self.names if n not in self._fired and n not in self._containers]

    def _why_unfired(self, name: str) -> str:
        """``name``, and the module that ran with its weights when one did (tied weights: T5's
        ``shared`` embedding is ``encoder.embed_tokens``'s; the copy that ran was captured)."""
        mine = set(self._weights.get(name, ()))
        ran = next(
            (n for n in self.names if n in self._fired and mine and mine <= set(self._weights.get(n, ()))),
            None,
        )
        return name if ran is None else f"{name} (its weights are {ran}'s, which ran)"

    def close(self, write_pending: bool = True, warn: bool = True, *, failed: str | None = None) -> None:
        """Write a pending non-empty pass, remove every hook, wait for the writer.

        ``failed`` (an error's text) marks that pending pass cut short, as :meth:`step` does."""
        if not self.enabled or self.recorder is None:
            return
        graphs.flush()
        self._forget()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._stance is not None:
            release(self._stance)  # the last capture open restores the stance of before
            self._stance = None
        if write_pending and len(self.recorder):
            self._annotate_pass()
        for site in self._sites:  # compiled code may outlive the capture: its calls do nothing
            graphs.drop_site(site)
        if self.compile_mode == "graph":  # the model's next call compiles without the record op
            graphs.HOOK_GUARDS.release(self._guards)
            graphs.drop_compiled_code()
        rec, self.recorder = self.recorder, None
        unfired = self.unfired
        rec.close(write_pending=write_pending, failed=failed)
        if warn and self._warn_unfired and unfired and rec.pass_index:
            shown = ", ".join(self._why_unfired(n) for n in unfired[:5]) + (
                " ..." if len(unfired) > 5 else ""
            )
            warnings.warn(
                f"tdinspect: {len(unfired)} selected module(s) never ran a hooked forward: {shown}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _forget(self) -> None:
        """Leave the registry of open captures outside a ``with``."""
        model = self._model_ref() if getattr(self, "_model_ref", None) else None
        if model is not None and model in _UNMANAGED:
            _UNMANAGED[model].discard(self)

    def __enter__(self) -> ModuleCapture:
        self._forget()  # a with block closes it: nesting captures is deliberate
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=failed_text(exc))

    def __repr__(self) -> str:
        if not self.enabled:
            return "ModuleCapture(disabled)"
        where = "memory" if self._memory is not None else self.folder
        return f"ModuleCapture({len(self.names)} modules -> {where})"


def memory_limit(memory, config: DumpConfig, compare_to=None) -> int | None:
    """The byte limit of a capture to memory (``None``: not one); a folder or a live comparison
    given as well is an error, never a silent choice between them."""
    limit = parse_memory(memory)
    if limit is not None and config.enabled:
        raise ConfigError(
            f"memory={memory!r} and a dump folder ({config.dump_dir}, from the arguments, the config "
            "or TDINSPECT_DUMP_DIR) were both given: capture to memory writes nothing until "
            ".save(folder); give one of them"
        )
    if limit is not None and compare_to is not None:
        raise ConfigError(f"memory={memory!r} and compare_to= were both given: give one of them")
    return limit


def resolve_config(dump_dir, filter, filter_fn, config, environ, record=None) -> DumpConfig:
    """Arguments over ``config``, then the environment over both."""
    base = config if config is not None else DumpConfig()
    changes = {}
    if record is not None:
        changes["record"] = parse_record(record)
    if dump_dir is not None:
        changes["dump_dir"] = dump_dir
    if filter is not None or filter_fn is not None:
        changes.update(filter=filter, filter_fn=filter_fn)
    cfg = dataclasses.replace(base, **changes) if changes else base
    return cfg.with_env(os.environ if environ is None else environ)


def capture(
    model: nn.Module | None = None,
    dump_dir: str | os.PathLike | None = None,
    *,
    filter: FilterSpec = None,
    filter_fn: str | None = None,
    config: DumpConfig | None = None,
    root: str = "model",
    modules: str = "leaves",
    stats_only: bool = False,
    checksum: bool = False,
    checksum_dim: int | None = None,
    max_pending_bytes: int = 2 << 30,
    fsync: bool = False,
    warn_unfired: bool = True,
    background_write: bool | None = None,
    on_nonfinite: str | None = None,
    compare_to=None,
    metric: str | None = None,
    threshold=None,
    on_divergence: str = "raise",
    mapping=None,
    record=None,
    structural: str = "diverge",
    on_uncompared: str = "warn",
    allow_uncompared=None,
    spec=None,
    parallel: dict | None = None,
    dims: dict[str, str] | None = None,
    overwrite: bool = False,
    memory=None,
    compile: str | None = None,
    environ=None,
) -> ModuleCapture:
    """Capture module outputs of ``model``, one pass file per :meth:`~ModuleCapture.step`.

    Parameters
    ----------
    model : nn.Module
        The model; ``torch.compile(model)``, ``model.compile()`` and compiled submodules are
        captured as ``compile`` says, under the eager run's names (no ``_orig_mod``).
    dump_dir : str or Path, optional
        Output directory. Without it (and without ``TDINSPECT_DUMP_DIR`` /
        ``PHYAI_DEBUG_TENSOR_DUMP_DIR``) capture is off and costs nothing.
    filter : regex, list of regexes, or callable, optional
        Which modules to record (``re.search`` on the dotted name, or
        ``(name, module) -> bool``). ``None`` records all.
    filter_fn : str, optional
        The predicate named as ``"pkg.mod:func"`` or ``"/path/file.py:func"``.
    config : DumpConfig, optional
        Settings kept by an engine; explicit arguments override its fields.
    root : str
        Name of the top module (``"model"``).
    modules : {"leaves", "all"}
        Hook the leaf modules and the modules holding parameters of their own (Mixtral's
        ``experts``, which compute with 3-D expert weights around an ``act_fn`` child), or
        every module. A parent's output is recorded when it returns, after its children's
        (execution order is the order outputs arrive).
    stats_only : bool
        Write statistics (sidecar) without tensors, for dumps too big for disk.
    checksum : bool
        Also store a bitwise fingerprint of every tensor (computed on its
        device, one int64 to the host; :mod:`tdinspect.numerics.checksum` states its
        collision rate), so that two ``stats_only`` runs can be checked for
        bitwise equality: ``diff.first_divergence(metric="equal")``.
    checksum_dim : int, optional
        With ``checksum``, also one fingerprint per index along this dim (a batch
        dim: :func:`tdinspect.numerics.checksum.row_checksums`), so that a batch-4
        run's row 0 compares bitwise with a batch-1 run: batch invariance without
        storing tensors (entries whose shapes differ only in this dim pair their
        rows; ``metric="equal"``).
    max_pending_bytes : int
        Host memory that queued passes may hold before ``step()`` waits.
    fsync : bool
        ``fsync`` each file before publishing it.
    warn_unfired : bool
        Warn at the end about selected modules that never ran.
    background_write : bool, optional
        Write passes in a background thread (overlapping the next step) or in
        ``step()``. Default: in the background when a CPU core is free for it.
    on_nonfinite : {"raise", "warn"}, optional
        Check every output for NaN/Inf (one fused reduction on its device),
        with or without a dump: ``"raise"`` raises
        :class:`tdinspect.NonFiniteError` naming the first offending module,
        call and pass (hooks removed, the unfinished pass not written);
        ``"warn"`` warns once per pass and goes on.
    compare_to : str, Path or DumpSet, optional
        A reference dump: every entry is compared with the reference's entry
        of the same key, call and pass as it is produced, with the metric
        definitions and the divergence rule of :class:`tdinspect.Diff`
        (statistics only when the reference holds statistics only; a missing
        reference entry is a structural divergence). ``dump_dir`` then holds
        only the evidence of the first divergence (see :mod:`tdinspect.dumper.live`);
        without it nothing is written.
    metric, threshold
        As for :meth:`tdinspect.Diff.first_divergence` (default ``rel_diff``
        at ``"auto"``: each entry's threshold from its two dtypes, float32
        1.5e-8, bfloat16 9.8e-4; a number for every entry; a ``{regex: value}``
        dict sets thresholds by name).
    on_divergence : {"raise", "warn", "record"}
        ``"raise"``: :class:`tdinspect.DivergenceError` at the first divergent
        entry, whose ``.divergence`` equals what
        ``DumpSet.open(compare_to).diff(full_dump).first_divergence()`` answers
        (hooks removed, nothing partial written). ``"warn"``: warn once per
        pass and go on. ``"record"``: go on and keep every entry's metrics
        (``capture.live.table()``; one CSV per pass in ``dump_dir/live/``).
    mapping : dict, path or Mapping, optional
        Rules pairing reference entries with this run's, as for :class:`tdinspect.Diff`.
    structural : {"diverge", "report"}
        As for :meth:`tdinspect.Diff.first_divergence`: ``"report"`` sets one-sided,
        unmatched and reshaped entries aside (``capture.live.set_aside``) and stops only
        at a numerical divergence (a port whose reference has entries it lacks).
    on_uncompared : {"warn", "raise"}
        At each ``step()`` (and ``close()`` writing a pending pass), entries set aside or
        never compared in the pass: one :class:`tdinspect.UncomparedWarning` naming the first
        few (the default), or :class:`tdinspect.errors.UncomparedError`;
        ``capture.live.verdict()`` is the answer so far (as :meth:`tdinspect.Diff.verdict`).
    allow_uncompared : str or list of str, optional
        Entries one-sided by design (regexes, as for :class:`tdinspect.Diff`): never a
        divergence for it, never reported.
    spec : CompareSpec, optional
        ``metric``, ``threshold``, ``mapping``, ``structural`` and ``allow_uncompared`` as
        one value (:class:`tdinspect.compare.spec.CompareSpec`, the ``spec`` of a Diff):
        the live comparison then is the one that Diff makes offline (giving those
        keywords as well is a ``TypeError``).
    record : str or sequence of str, optional
        What to record for each selected module: any of ``"inputs"``,
        ``"outputs"``, ``"params"``, ``"grads"`` (default ``("outputs",)``,
        or the config's; ``..._DUMP_RECORD`` overrides both). See the module
        docstring for the names.
    parallel : dict, optional
        This process's parallel coordinates, ``{"tp": (rank, size), "cp": ...}``,
        recorded so that :meth:`tdinspect.DumpSet.unshard` can reassemble
        sharded tensors. Default: the ``torch.distributed`` rank and world
        size as tensor parallel when it is initialised. Without
        ``torch.distributed`` or ``$RANK``, the coordinates also number the
        rank folder, so one process can capture each rank it emulates in turn.
    dims : dict, optional
        ``{regex: dims spec}`` per entry name, e.g. ``{r"q_proj$": "b s h(tp)"}``
        (grammar: :mod:`tdinspect.align.dims`); a bad spec is an error here.
    overwrite : bool
        Remove the earlier runs in ``dump_dir`` (with a one-line warning
        naming them; a run whose process is still running on this host is
        kept, and the warning says so). Without it they are kept: every capture is a new run in
        its own ``rank<R>_pid<P>[_runN]`` folder, and ``DumpSet.open`` opens
        the newest run (see :mod:`tdinspect.store.runs`).
    memory : bool, int or str, optional
        Keep the passes in memory instead of writing them: ``True`` holds up to 2 GB of
        tensors, ``"8GB"`` or a byte count sets the limit. Past it, a
        :class:`tdinspect.errors.CaptureMemoryError` names the limit and the entry that crossed
        it (the capture stops, its pass in progress dropped). ``cap.dumpset`` is then a
        :class:`tdinspect.DumpSet`, ``cap.save(folder)`` writes a normal dump
        (:mod:`tdinspect.dumper.memory`). Not with a dump folder or ``compare_to``.
    compile : {"graph", "eager"}, optional
        For a compiled model: ``"graph"`` (the default when the model is compiled) records
        what the compiled code computes, inside its graphs (a traced record op per hooked
        call, no graph break); ``"eager"`` runs the model eagerly while capturing. Each
        pass's sidecar says which (``compile``), with the graphs, graph breaks and
        recompiles dynamo counted during it; graph breaks and recompiles are warned of
        and summed in ``capture.compile_counts``. Graph mode makes dynamo compile anew at
        the start and at ``close()`` (its code caches are process-wide). See docs/compile.md.
    environ : mapping, optional
        The environment to overlay (``os.environ`` by default).

    Returns
    -------
    ModuleCapture

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> with capture(model, "/tmp/tdi_doc", filter=r"\\.0$") as dump:  # doctest: +SKIP
    ...     model(torch.randn(2, 4))
    ...     dump.step()
    >>> with capture(model, memory=True) as cap:                   # doctest: +SKIP
    ...     model(torch.randn(2, 4))
    ...     cap.step()
    >>> cap.dumpset.ops                                            # doctest: +SKIP
    ['model.0', 'model.1']
    """
    cfg = resolve_config(dump_dir, filter, filter_fn, config, environ, record)
    return ModuleCapture(
        model,
        cfg,
        root=root,
        modules=modules,
        stats_only=stats_only,
        checksum=checksum,
        checksum_dim=checksum_dim,
        max_pending_bytes=max_pending_bytes,
        fsync=fsync,
        warn_unfired=warn_unfired,
        background_write=background_write,
        on_nonfinite=on_nonfinite,
        parallel=parallel,
        dims=dims,
        compare_to=compare_to,
        compare_options=live_options(locals()),
        overwrite=overwrite,
        memory=memory,
        compile=compile,
    )
