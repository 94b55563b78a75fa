"""Op-level capture: a ``TorchDispatchMode`` that records every aten op, forward and backward.

Usage::

    with tdinspect.capture_ops("dumps/ln_cpu", model=model, inputs=True) as dump:
        loss = model(x).sum(); loss.backward()
        dump.step()

Every aten op that runs inside the block (factory ops, copies, autograd's
backward ops) is recorded in execution order under the key
``<module>/<overload>[outN]`` (and ``[inN]`` for inputs with ``inputs=True``),
where ``<module>`` is the innermost module running it: during forward, the
module whose ``forward`` is on the stack; during backward, the module whose
forward created the autograd node being executed. Ops outside any module go
under the root (``model``). Repeated calls of the same op in the same module
are ``::call1``, ``::call2``... as in module-level capture.

What is stored (the sidecar says which, see :mod:`tdinspect.store.format`):

- outputs of every op; inputs too with ``inputs=True``, copied *before* the op
  runs, so in-place ops (``add_``) show the value they read;
- an input that is the output (or input) of an op already recorded in the
  same pass, unchanged since, is a reference (``ref = {"kind": "same"}``);
  a view op's output of a recorded tensor is a reference too
  (``{"kind": "view", "of": stored_key, "base": geometry, "view": geometry}``,
  a geometry being ``[sizes, strides, storage_offset]`` in the shared storage),
  rebuilt on load by re-indexing the stored tensor (:mod:`tdinspect.store.reindex`),
  never by running an operator;
- outputs of ``empty``-like ops are marked ``uninitialized`` and not stored;
- non-tensor arguments go in the sidecar (``call_args``) so an op can be
  rebuilt and re-run by :func:`tdinspect.replay`.

``trace=True`` prints one line per op as it runs::

    model.ln/aten.native_layer_norm.default  in: bf16[1,64,32] [-4.81, 4.91] ...  ->  out: bf16[1,64,32] [-4.78, 4.81] f32[1,64,1] [...] ...
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)
from torch.utils._pytree import tree_flatten, treespec_dumps

from tdinspect.config import DumpConfig, FilterSpec
from tdinspect.dumper.checks import HealthCheck, StopsOnCheck, any_nonfinite, live_options, open_live
from tdinspect.dumper.kinds import holds_no_data
from tdinspect.dumper.memory import InMemory
from tdinspect.dumper.modules import eager_name, memory_limit, resolve_config, unwrap_compiled
from tdinspect.dumper.recorder import Recorder, current_rank, failed_text, parallel_coords
from tdinspect.dumper.reruns import close_reruns
from tdinspect.dumper.stance import hold_eager, release
from tdinspect.errors import ConfigError
from tdinspect.naming import CALL_SEP, module_key
from tdinspect.store.format import encode_arg

_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
# views whose elements are exactly their base's (reordered): they share its statistics
_SAME_ELEMENTS = {
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "detach",
    "alias",
    "unsqueeze",
    "squeeze",
    "flatten",
    "view_as",
    "_reshape_alias",
    "unflatten",
}
# views that may reach storage outside their base's elements: stored, not referenced
_ANY_ELEMENTS = {torch.ops.aten.as_strided.default}
_META_KEY = "tdinspect_module"
_SHORT_DTYPE = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}


def _short(t: torch.Tensor) -> str:
    return f"{_SHORT_DTYPE.get(t.dtype, str(t.dtype).removeprefix('torch.'))}{list(t.shape)}"


def _range(t: torch.Tensor) -> str:
    if t.numel() == 0:
        return "(empty)"
    v = t.detach()
    if v.is_complex():
        v = v.abs()
    if not v.is_floating_point():
        v = v.to(torch.float64)
    elif v.element_size() < 2 or v.dtype in (torch.float16, torch.bfloat16):
        v = v.float()
    lo, hi = torch.aminmax(v.reshape(-1))
    return f"[{lo.item():.4g}, {hi.item():.4g}]"


class _ModuleTracker:
    """Names the module running now: a forward stack, and autograd-node labels for backward."""

    def __init__(self, root: str):
        self.root = root
        self.stack: list[tuple[str, nn.Module, int]] = []  # (name, module, its call number)
        self.calls: dict[str, int] = {}  # module name -> calls begun this pass
        self.types: dict[str, str] = {root: ""}
        self.handles: list[Any] = []
        self._names: dict[int, str] = {}
        self._pending_inputs: list[set] = []

    def attach(self, model: nn.Module | None) -> None:
        if model is not None:
            for name, mod in model.named_modules():
                # a compiled module's wrapper is skipped: its _orig_mod is named as eager
                self._names[id(mod)] = module_key(self.root, eager_name(name))
            self.types.update({self._names[id(m)]: type(m).__name__ for m in model.modules()})
        reg = nn.modules.module
        self.handles = [
            reg.register_module_forward_pre_hook(self._pre),
            reg.register_module_forward_hook(self._post),
        ]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _name_of(self, mod: nn.Module) -> str:
        name = self._names.get(id(mod))
        if name is None:  # a module outside the given model: name it by class under its parent
            parent = self.stack[-1][0] if self.stack else self.root
            name = f"{parent}.{type(mod).__name__}"
            self.types[name] = type(mod).__name__
        return name

    def _pre(self, mod, args):
        if type(mod).__name__ == "OptimizedModule":
            return
        name = self._name_of(mod)
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        self.stack.append((name, mod, call))
        self._pending_inputs.append(
            {
                t.grad_fn
                for t in tree_flatten(args)[0]
                if isinstance(t, torch.Tensor) and t.grad_fn is not None
            }
        )

    def _post(self, mod, args, output):
        if not self.stack or type(mod).__name__ == "OptimizedModule":
            return None
        name, _, _ = self.stack.pop()
        inputs = self._pending_inputs.pop()
        if torch.is_grad_enabled():
            self._label_graph(name, output, inputs)
        return None

    @staticmethod
    def _label_graph(name: str, output: Any, stop: set) -> None:
        """Label the autograd nodes this module created, for backward attribution."""
        todo = [
            t.grad_fn
            for t in tree_flatten(output)[0]
            if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        seen = set()
        inner = name + "."
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in stop:
                continue
            seen.add(node)
            if type(node).__name__ == "AccumulateGrad":
                continue
            label = node.metadata.get(_META_KEY)
            if label is None:
                node.metadata[_META_KEY] = name
            elif label != name and not label.startswith(inner):
                continue  # created by an earlier, unrelated module
            todo.extend(n for n, _ in node.next_functions)

    def current(self) -> tuple[str, int | None]:
        """The module running now and which of its calls in this pass this is (``None``
        in backward and outside any module)."""
        node = torch._C._current_autograd_node()
        if node is not None:
            return node.metadata.get(_META_KEY, self.root), None
        return self.stack[-1][::2] if self.stack else (self.root, None)


class _OpRecorderMode(TorchDispatchMode):
    def __init__(self, owner: OpCapture):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.owner._checked(self.owner._dispatch, func, args, kwargs or {})


# op captures started outside any ``with`` and not closed yet (see OpCapture._close_stale)
_UNMANAGED: weakref.WeakSet[OpCapture] = weakref.WeakSet()


class OpCapture(StopsOnCheck, InMemory):
    """A running op-level capture; made by :func:`capture_ops`.

    Push it with ``with`` (or :meth:`start` / :meth:`close`). When dumping is
    off it records nothing and costs nothing.
    """

    def __init__(
        self,
        config: DumpConfig,
        *,
        model: nn.Module | None = None,
        root: str = "model",
        inputs: bool = False,
        trace: bool | TextIO = False,
        stats_only: bool = False,
        max_pending_bytes: int = 2 << 30,
        fsync: bool = False,
        background_write: bool | None = None,
        on_nonfinite: str | None = None,
        parallel: dict | None = None,
        dims: dict[str, str] | None = None,
        compare_to=None,
        compare_options: dict | None = None,
        overwrite: bool = False,
        checksum: bool = False,
        checksum_dim: int | None = None,
        memory=None,
    ):
        self.config = config
        memory = memory_limit(memory, config, compare_to)
        self._rank = current_rank(parallel_coords(parallel))
        self.health = HealthCheck(on_nonfinite, self._rank) if on_nonfinite else None
        self._failed = False  # a check raised: ops run unrecorded until close()
        self._compare = (compare_to, compare_options or {}) if compare_to is not None else None
        self.live = None
        self.enabled = (
            config.enabled
            or memory is not None
            or bool(trace)
            or self.health is not None
            or compare_to is not None
        )
        self.inputs = inputs
        self.trace = (sys.stdout if trace is True else trace) or None
        # else dump_dir holds evidence only
        self._write = (config.enabled or memory is not None) and compare_to is None
        self._predicate = config.predicate() if self.enabled else None
        self._keep: dict[str, bool] = {}
        # identity -> (weak storage ref, key, uninitialized, root): ``root`` is the stored
        # entry holding this tensor's elements and that entry's geometry in the storage
        self._seen: dict[tuple, tuple[Any, str, bool, tuple]] = {}
        self._by_storage: dict[int, set] = {}
        self._writes: dict[Any, list] = {}
        self._specs: dict[Any, str] = {}
        self._mode: _OpRecorderMode | None = None
        self._tracker = _ModuleTracker(root)
        self._model = model
        self._stance = None
        self.recorder = None
        self.folder = None
        self._stats_only = stats_only
        self._writer_args = dict(
            max_pending_bytes=max_pending_bytes,
            fsync=fsync,
            background_write=background_write,
            parallel=parallel,
            dims=dims,
            overwrite=overwrite,
            checksum=checksum,
            checksum_dim=checksum_dim,
            memory=memory,
        )
        if config.enabled:  # bad coordinates or dims specs are errors here, not at start()
            parallel_coords(parallel)
            if dims:
                from tdinspect.align.dims import DimsRules

                DimsRules(dims, what="capture_ops(dims=...)")

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> OpCapture:
        """Begin recording (``with`` calls this)."""
        if not self.enabled or self._mode is not None:
            return self
        self._close_stale()
        if self._compare is not None and self.live is None:
            target, options = self._compare
            self.live = open_live(
                target,
                level="op",
                rank=self._rank,
                **options,
                evidence_dir=self.config.dump_dir if self.config.enabled else None,
            )
        if self._write or self.health is not None or self.live is not None:
            self.recorder = Recorder(
                self.config.dump_dir if self._write else None,
                level="op",
                stats_only=self._stats_only,
                **self._writer_args,
            )
            self.recorder.observer = self.live
            self.folder = self.recorder.folder
            self._memory = self.recorder.memory
        self._hold_eager()
        self._tracker.attach(self._model)
        self._mode = _OpRecorderMode(self)
        self._mode.__enter__()
        if not getattr(self, "_managed", False):
            _UNMANAGED.add(self)
        return self

    def _hold_eager(self) -> None:
        """Compiled code runs eagerly while ops are recorded: a compiled graph runs
        inductor's kernels, not aten ops, so what it computes is not recordable op by op.
        The eager decomposition is recorded instead, with a warning when the model is
        compiled (module-level ``capture`` records the compiled graph's values)."""
        if "torch._dynamo" not in sys.modules:  # nothing compiled in this process
            return
        if self._model is not None and unwrap_compiled(self._model)[1]:
            warnings.warn(
                "tdinspect: the model is torch.compile'd; capture_ops records the eager "
                "aten ops (the compiled graph runs fused kernels, not these ops). "
                "tdinspect.capture(model) records the compiled values module by module.",
                RuntimeWarning,
                stacklevel=4,
            )
        self._stance = hold_eager()

    def _close_stale(self) -> None:
        """Close the earlier op captures into the same folder still recording outside a
        ``with`` (a re-run cell's; :mod:`.reruns`). A mode leaves the stack from the top
        only: one under other modes is not closed, a warning says it is still open."""
        for old in [c for c in _UNMANAGED if c._mode is None]:
            _UNMANAGED.discard(old)
        close_reruns(
            _UNMANAGED,
            self.config.dump_dir,
            "op capture",
            closable=lambda old: _get_current_dispatch_mode_stack()[-1:] == [old._mode],
            unclosable="under other dispatch modes",
            stacklevel=3,
        )

    def step(self, failed: str | None = None, *, tokens=None):
        """End the pass and write it (always, even when empty); returns its path.

        ``failed`` marks a pass cut short by an error, and ``tokens`` its token layout,
        as for :meth:`ModuleCapture.step`.
        """
        if self.recorder is None:
            return None
        self.recorder.warn_if_empty("no aten op ran inside the capture block")
        self._tracker.calls.clear()
        self._seen.clear()
        self._by_storage.clear()
        with _disable_current_modes():  # the recorder's own ops are not the model's
            path = self._checked(self.recorder.step, failed, tokens)
            if self.health is not None:
                self._checked(self.health.end_pass)
            return path

    def _on_check_error(self) -> None:
        """A check raised: record nothing more and write no partial pass.

        The dispatch mode itself is popped by ``close()`` (``with`` calls it):
        it cannot leave the mode stack from inside its own dispatch.
        """
        self._failed = True
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.close(write_pending=False)

    def close(self, write_pending: bool = True, *, failed: str | None = None) -> None:
        """Stop recording, write a pending non-empty pass, wait for the writer (``failed``: the
        error that cut that pass short, marked in its sidecar as :meth:`step` does)."""
        _UNMANAGED.discard(self)
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            self._tracker.detach()
        if self._stance is not None:
            release(self._stance)
            self._stance = None
        rec, self.recorder = self.recorder, None
        if rec is not None:
            rec.close(write_pending=write_pending, failed=failed)

    def __enter__(self) -> OpCapture:
        self._managed = True  # a with block closes it: not a stale capture
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=failed_text(exc))

    def __repr__(self) -> str:
        where = "memory" if self._writer_args["memory"] is not None else self.folder
        return f"OpCapture({'-> ' + str(where) if self.enabled else 'disabled'})"

    # -- recording ------------------------------------------------------------------------
    def _selected(self, site: str) -> bool:
        keep = self._keep.get(site)
        if keep is None:
            try:
                keep = bool(self._predicate(site, None))
            except Exception as exc:
                raise ConfigError(f"filter raised {type(exc).__name__} on op {site!r}: {exc}") from exc
            self._keep[site] = keep
        return keep

    @staticmethod
    def _identity(t: torch.Tensor) -> tuple | None:
        """Where ``t``'s elements sit, or ``None`` when it has no plain storage of its own
        (meta, fake, sparse, nested, a wrapper subclass): such a tensor is never matched."""
        if holds_no_data(t):
            return None
        try:
            return (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                t.device,
            )
        except (RuntimeError, NotImplementedError):
            return None

    def _lookup(self, t: torch.Tensor) -> tuple[str, bool, tuple] | None:
        """``(key, uninitialized, root)`` of the recorded entry ``t`` still equals, else ``None``."""
        ident = self._identity(t)
        hit = None if ident is None else self._seen.get(ident)
        if hit is None:
            return None
        ref, key, uninit, root = hit
        return (key, uninit, root) if ref() is not None else None

    def _remember(
        self, t: torch.Tensor, key: str, uninitialized: bool = False, root: tuple | None = None
    ) -> None:
        ident = self._identity(t)
        if ident is not None:
            if root is None:  # a stored entry: its own root, at its place in the storage
                root = (key, [*ident[2]], [*ident[3]], ident[1])
            # a weak reference to the storage: a freed and reused address is no match
            self._seen[ident] = (weakref.ref(t.untyped_storage()), key, uninitialized, root)
            self._by_storage.setdefault(ident[0], set()).add(ident)

    def _written_args(self, func) -> list[tuple[int, str]]:
        """``(index, name)`` of the arguments ``func`` writes to (in place, ``out=``); cached."""
        written = self._writes.get(func)
        if written is None:
            written = self._writes[func] = [
                (i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            ]
        return written

    def _forget_written(self, func, args, kwargs) -> None:
        """Drop what an in-place op is about to change (every view of the written storage)."""
        for i, name in self._written_args(func):
            t = args[i] if i < len(args) else kwargs.get(name)
            written = self._identity(t) if isinstance(t, torch.Tensor) else None
            if written is not None:
                for ident in self._by_storage.pop(written[0], ()):
                    self._seen.pop(ident, None)

    def _dispatch(self, func, args, kwargs):
        if self._failed:
            return func(*args, **kwargs)
        module, module_call = self._tracker.current()
        site = f"{module}/{func}"
        if not self._selected(site):
            return func(*args, **kwargs)
        rec = self.recorder
        call = rec.next_call(site) if rec is not None else 0
        suffix = "" if call == 0 else f"{CALL_SEP}{call}"
        aten = str(func)
        # what every record of this op carries (one dict: the op's records repeat it)
        tags = {"module_type": self._tracker.types.get(module, ""), "aten": aten, "module_call": module_call}
        view_base = self._view_base(func, args)
        watch = self.trace is not None or self.health is not None  # look at the tensor inputs
        leaves, spec = tree_flatten((args, kwargs)) if self.inputs or watch else ((), None)
        in_keys: list[str | None] = [None] * len(leaves)
        if self.inputs and rec is not None:
            tensor_i = 0
            for i, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    continue
                key = f"{site}[in{tensor_i}]{suffix}"
                tensor_i += 1
                earlier = self._lookup(leaf)
                if earlier is not None:
                    rec.record(
                        key,
                        leaf,
                        store=False,
                        **tags,
                        ref={"kind": "same", "of": earlier[0]},
                        uninitialized=earlier[1] or None,
                        same_stats_as=earlier[0],
                    )
                    in_keys[i] = earlier[0]
                else:
                    rec.record(key, leaf, **tags)
                    self._remember(leaf, key)
                    in_keys[i] = key
        if self._seen:
            self._forget_written(func, args, kwargs)
        in_tensors = [x for x in leaves if isinstance(x, torch.Tensor)] if watch else []
        traced_in = self._describe(in_tensors) if self.trace is not None else None
        health_in = self._health_inputs(func, in_tensors) if self.health is not None else None
        out = func(*args, **kwargs)
        outs = (
            [out]
            if isinstance(out, torch.Tensor)
            else [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        )
        uninitialized = func._overloadpacket.__name__ in _UNINITIALIZED
        if traced_in is not None:
            outs_s = (
                " ".join(f"{_short(t)} (uninitialized)" for t in outs)
                if uninitialized
                else self._describe(outs)
            )
            print(f"{site + suffix}  in: {traced_in}  ->  out: {outs_s}", file=self.trace)
        if rec is None or not outs:
            return out
        base = self._lookup(view_base) if view_base is not None else None
        root = base[2] if base is not None and not base[1] else None
        for i, o in enumerate(outs):
            key = f"{site}[out{i}]{suffix}"
            if uninitialized:
                rec.record(key, o, store=False, **tags, uninitialized=True)
                self._remember(o, key, uninitialized=True)
                continue
            if health_in is not None:
                self.health.check(
                    key,
                    o,
                    pass_=rec.pass_index,
                    order=len(rec),
                    inputs=health_in[0],
                    inputs_before=health_in[1],
                )
            call_args = None
            if self.inputs and i == 0:
                call_args = {
                    "aten": aten,
                    "spec": self._spec_json(spec),
                    "leaves": [encode_arg(v, k) for v, k in zip(leaves, in_keys)],
                }
            if root is not None and o.dtype == view_base.dtype:
                # a view: where its elements sit in the stored entry's storage, nothing to run
                same = base[0] if func._overloadpacket.__name__ in _SAME_ELEMENTS else None
                ref = {
                    "kind": "view",
                    "of": root[0],
                    "base": root[1:],
                    "view": [[*o.shape], [*o.stride()], o.storage_offset()],
                }
                rec.record(key, o, store=False, **tags, ref=ref, call_args=call_args, same_stats_as=same)
                self._remember(o, key, root=root)
            else:
                rec.record(key, o, **tags, call_args=call_args)
                self._remember(o, key)
        return out

    def _health_inputs(self, func, tensors: list):
        """The op's tensor inputs, and their NaN/Inf flag taken now when the op will overwrite
        them (in place, ``out=``) or the flag stays on an accelerator (read at ``step()``)."""
        before = None
        if any(t.device.type != "cpu" for t in tensors):
            before = HealthCheck.device_flag(tensors)
        elif self._written_args(func):
            before = any_nonfinite(tensors)
        return tensors, before

    def _spec_json(self, spec) -> str:
        """``treespec_dumps`` is slow (dataclass walks); argument structures repeat: cache."""
        try:
            text = self._specs.get(spec)
        except TypeError:  # an unhashable spec
            return treespec_dumps(spec)
        if text is None:
            text = self._specs[spec] = treespec_dumps(spec)
        return text

    @staticmethod
    def _view_base(func, args) -> torch.Tensor | None:
        """The input a pure view op aliases (its ``self``), else ``None``."""
        returns = func._schema.returns
        if not func.is_view or not returns or len(returns) != 1 or func in _ANY_ELEMENTS:
            return None
        alias = returns[0].alias_info
        if alias is None or alias.is_write:
            return None
        base = args[0] if args else None
        return base if isinstance(base, torch.Tensor) else None

    @staticmethod
    def _describe(tensors: list) -> str:
        return " ".join(f"{_short(t)} {_range(t)}" for t in tensors) or "-"


def capture_ops(
    dump_dir=None,
    *,
    model: nn.Module | None = None,
    filter: FilterSpec = None,
    filter_fn: str | None = None,
    config: DumpConfig | None = None,
    root: str = "model",
    inputs: bool = False,
    trace: bool | TextIO = False,
    stats_only: bool = False,
    max_pending_bytes: int = 2 << 30,
    fsync: bool = False,
    background_write: bool | None = None,
    on_nonfinite: str | None = None,
    parallel: dict | None = None,
    dims: dict[str, str] | None = None,
    compare_to=None,
    metric: str | None = None,
    threshold=None,
    on_divergence: str = "raise",
    mapping=None,
    overwrite: bool = False,
    structural: str = "diverge",
    on_uncompared: str = "warn",
    allow_uncompared=None,
    spec=None,
    checksum: bool = False,
    checksum_dim: int | None = None,
    memory=None,
    environ=None,
) -> OpCapture:
    """Record every aten op run inside the ``with`` block, one pass file per ``step()``.

    Parameters
    ----------
    dump_dir : str or Path, optional
        Output directory (or ``TDINSPECT_DUMP_DIR`` / ``PHYAI_DEBUG_TENSOR_DUMP_DIR``).
    model : nn.Module, optional
        Names ops by the module running them (``model.layers.0.ln1/aten...``);
        without it, modules are named by class under their parent.
    filter, filter_fn
        As for :func:`tdinspect.capture`, matched against ``module/op``
        (``"model.layers.0.ln1/aten.native_layer_norm.default"``).
    inputs : bool
        Also record inputs (before in-place ops mutate them) and the
        non-tensor arguments, so :func:`tdinspect.replay` can re-run ops.
    trace : bool or file
        Print one line per op (op, dtypes, shapes, input and output ranges).
        Tracing works without a dump directory.
    stats_only : bool
        Statistics only, no tensors.
    checksum : bool
        Also store a bitwise fingerprint of every recorded tensor (as for
        :func:`tdinspect.capture`).
    checksum_dim : int, optional
        With ``checksum``, one fingerprint per row along this dim too (as for
        :func:`tdinspect.capture`).
    background_write, overwrite : bool, optional
        As for :func:`tdinspect.capture`.
    on_nonfinite : {"raise", "warn"}, optional
        Check every op output, forward and backward, for NaN/Inf (with or
        without a dump); the report says whether the op's inputs already held
        them (inherited) or the op created them. See :func:`tdinspect.capture`.
    parallel, dims
        As for :func:`tdinspect.capture` (``dims`` regexes match ``module/op``
        names).
    compare_to, metric, threshold, on_divergence, mapping, structural, on_uncompared, allow_uncompared, spec
        Live comparison with a reference op-level dump, forward and backward
        ops: as for :func:`tdinspect.capture`.
    memory : bool, int or str, optional
        Keep the passes in memory (``cap.dumpset``, ``cap.save(folder)``), as for
        :func:`tdinspect.capture`.

    Returns
    -------
    OpCapture

    Examples
    --------
    >>> from tdinspect.examples.models import layernorm_test
    >>> with capture_ops("/tmp/tdi_ln") as dump:          # doctest: +SKIP
    ...     layernorm_test(torch.bfloat16)
    ...     dump.step()
    """
    cfg = resolve_config(dump_dir, filter, filter_fn, config, environ)
    return OpCapture(
        cfg,
        model=model,
        root=root,
        inputs=inputs,
        trace=trace,
        stats_only=stats_only,
        max_pending_bytes=max_pending_bytes,
        fsync=fsync,
        background_write=background_write,
        on_nonfinite=on_nonfinite,
        parallel=parallel,
        dims=dims,
        compare_to=compare_to,
        checksum=checksum,
        checksum_dim=checksum_dim,
        memory=memory,
        compare_options=live_options(locals()),
        overwrite=overwrite,
    )
