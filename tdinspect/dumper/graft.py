"""Grafting: feed a reference run's recorded tensors into the live model, module by module.

An error a module *introduces* and one it *inherits* look the same in an
ordinary diff: every module after the first wrong one differs. Grafting tells
them apart. Under ``graft(model, reference, what="inputs")`` each selected
module receives, instead of what the live model computed, the inputs it
received in the reference run (recorded with ``capture(...,
record=("inputs", "outputs"))``). A module whose output still differs from
the reference made that error itself; one that agrees only inherited it::

    with tdinspect.capture(model, "runs/b", record=("inputs", "outputs")) as dump, \\
            tdinspect.graft(model, "runs/a", modules=[r"layers\\."], capture=dump):
        model(batch)
        dump.step()                          # also moves the graft to the next reference pass
    tdinspect.DumpSet.open("runs/a").diff("runs/b").introduced()

``what="outputs"`` instead replaces the selected modules' outputs with the
reference's (the rest of the model then runs on reference values).

Tensors are matched by name, call and pass: call ``c`` of module ``m`` in the
graft's pass ``p`` receives entry ``m[in]...::callc`` (or ``m...::callc``) of
reference pass ``p``. Reference passes are read one at a time, when first
needed, and each tensor is moved to the live tensor's device and dtype. A name
the reference lacks or a shape that differs is a :class:`GraftError` naming
both sides.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tdinspect.config import FilterSpec, resolve_filter
from tdinspect.dumper.modules import map_tensors, select_modules, unwrap_compiled
from tdinspect.dumper.recorder import current_rank
from tdinspect.errors import (
    ConfigError,
    GraftError,
)
from tdinspect.naming import INPUT_PREFIX, make_key, split_call
from tdinspect.store.passindex import PassIndex
from tdinspect.store.runs import discover

WHAT = ("inputs", "outputs")


class Graft:
    """A running graft; made by :func:`graft`. Use it as a context manager.

    Attributes
    ----------
    names : list of str
        The grafted module names.
    pass_ : int
        The reference pass the next forward reads from.
    grafted : int
        How many tensors were replaced so far.
    """

    def __init__(
        self,
        model: nn.Module,
        reference: str | os.PathLike,
        *,
        modules: FilterSpec = None,
        what: str = "inputs",
        root: str = "model",
        scope: str = "leaves",
        mapping: Any = None,
        capture: Any = None,
        rank: int | None = None,
        start: int | None = None,
    ):
        if what not in WHAT:
            raise ConfigError(f"graft(what={what!r}): expected 'inputs' or 'outputs'")
        if not isinstance(model, nn.Module):
            raise TypeError(f"graft(model=...) needs an nn.Module, got {type(model).__name__}")
        self.what = what
        self.reference = Path(reference)
        self._folder = _rank_folder(self.reference, current_rank() if rank is None else rank)
        passes = sorted(self._folder.passes)
        self.pass_ = passes[0] if start is None else start
        self.grafted = 0
        self._mapping = _mapping(mapping)
        self._calls: dict[str, int] = {}
        self._current: tuple[PassIndex, dict, dict] | None = None
        model, _ = unwrap_compiled(model)
        chosen = select_modules(model, resolve_filter(modules), root, scope)
        if not chosen:
            raise ConfigError(f"graft: modules={modules!r} selects no module of {type(model).__name__}")
        self.names = [name for name, _ in chosen]
        self._handles = []
        self._capture = None
        if capture is not None and not hasattr(capture, "_on_step"):
            raise TypeError("graft(capture=...) takes the object tdinspect.capture() returned")
        try:  # a graft that fails to start leaves no hook on the model
            for name, mod in chosen:
                # prepended: a capture of the same modules records what the module really got
                if what == "inputs":
                    self._handles.append(
                        mod.register_forward_pre_hook(
                            self._make_pre_hook(name), with_kwargs=True, prepend=True
                        )
                    )
                else:
                    self._handles.append(mod.register_forward_hook(self._make_hook(name), prepend=True))
            if capture is not None:
                self._capture = capture
                capture._on_step.append(self.step)
        except BaseException:
            self.close()
            raise

    # -- hooks ----------------------------------------------------------------------------
    def _make_pre_hook(self, name: str):
        def pre_hook(module, args, kwargs):
            call = self._next_call(name)
            fetch = self._fetcher(name, call)
            with self._closed_on_error():
                return (
                    map_tensors(tuple(args), fetch, INPUT_PREFIX),
                    map_tensors(dict(kwargs), fetch, INPUT_PREFIX),
                )

        return pre_hook

    def _make_hook(self, name: str):
        def hook(module, args, output):
            with self._closed_on_error():
                return map_tensors(output, self._fetcher(name, self._next_call(name)))

        return hook

    @contextlib.contextmanager
    def _closed_on_error(self):
        """A graft that failed in the forward (a :class:`GraftError`: an entry missing, shapes
        differ) removes its hooks before the error leaves ``model(...)``, as a capture's
        checks do: the model is left as it was, not half grafted."""
        try:
            yield
        except GraftError:
            self.close()
            raise

    def _next_call(self, name: str) -> int:
        call = self._calls.get(name, -1) + 1
        self._calls[name] = call
        return call

    def _fetcher(self, name: str, call: int):
        def fetch(label: str, live: torch.Tensor) -> torch.Tensor:
            pi, loaded, inverse = self._pass()
            live_base = name + label
            ref_key = make_key(inverse.get(live_base, live_base), call)
            where = (
                f"graft: {self.what[:-1]} {make_key(live_base, call)!r} of the live run (pass {self.pass_})"
            )
            if ref_key not in pi.position:
                near = [k for k in pi.keys if split_call(k)[0].startswith(name)][:4]
                hint = (
                    f"; it records {near}"
                    if near
                    else "; capture the reference with record=('inputs', 'outputs')"
                )
                raise GraftError(f"{where}: the reference {pi.path} has no entry {ref_key!r}{hint}")
            ref = pi.tensor(ref_key, loaded)
            if ref.shape != live.shape:
                raise GraftError(
                    f"{where} has shape {list(live.shape)}, the reference's "
                    f"{ref_key!r} in {pi.path} has shape {list(ref.shape)}"
                )
            self.grafted += 1
            return ref.to(device=live.device, dtype=live.dtype, copy=True)

        return fetch

    def _pass(self) -> tuple[PassIndex, dict, dict]:
        """The current reference pass: its index, its tensors and the live -> reference names."""
        if self._current is None:
            files = self._folder.passes.get(self.pass_)
            if files is None:
                raise GraftError(
                    f"graft: the live run is at pass {self.pass_}, but the reference "
                    f"{self._folder.path} has passes {sorted(self._folder.passes)}"
                )
            pi = PassIndex.read(self._folder.rank, files)
            if pi.stats_only:
                raise GraftError(
                    f"graft: {pi.path} is statistics-only: grafting needs the reference's tensors"
                )
            inverse = {}
            if self._mapping is not None:
                for key in pi.keys:
                    base = split_call(key)[0]
                    live, transform = self._mapping.partner(base)
                    if transform is not None:
                        continue  # a transform maps B onto A; grafting would need its inverse
                    inverse[live] = base
            self._current = (pi, pi.load(), inverse)
        return self._current

    # -- public API ---------------------------------------------------------------------------
    def step(self) -> None:
        """Move to the next reference pass (called by the capture's ``step()`` when linked)."""
        self.pass_ += 1
        self._calls = {}
        self._current = None  # the pass just used is released

    def close(self) -> None:
        """Remove the hooks and release the reference pass."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._capture is not None and self.step in self._capture._on_step:
            self._capture._on_step.remove(self.step)
        self._current = None

    def __enter__(self) -> Graft:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Graft({self.what} of {len(self.names)} modules from {self.reference}, "
            f"pass {self.pass_}, {self.grafted} tensors grafted)"
        )


def _rank_folder(reference: Path, rank: int):
    from tdinspect.errors import DumpFormatError

    folders = discover(reference)
    by_rank = {f.rank: f for f in folders}
    if rank in by_rank:
        return by_rank[rank]
    if len(folders) == 1:
        return folders[0]
    raise DumpFormatError(
        f"{reference}: no folder for rank {rank} (ranks {sorted(by_rank)}); pass graft(rank=...)"
    )


def _mapping(value):
    if value is None:
        return None
    from tdinspect.align.mapping import Mapping

    return Mapping.coerce(value)


def graft(
    model: nn.Module,
    reference: str | os.PathLike,
    *,
    modules: FilterSpec = None,
    what: str = "inputs",
    root: str = "model",
    scope: str = "leaves",
    mapping: Any = None,
    capture: Any = None,
    rank: int | None = None,
    start: int | None = None,
) -> Graft:
    """Feed the reference run's recorded inputs (or outputs) into the selected modules.

    Parameters
    ----------
    model : nn.Module
        The live model.
    reference : str or Path
        A dump captured with ``record=("inputs", ...)`` (for ``what="inputs"``)
        or with outputs (for ``what="outputs"``).
    modules : regex, list of regexes, or callable, optional
        Which modules to graft (``re.search`` on the dotted name, as
        ``capture``'s ``filter``); ``None`` grafts all of ``scope``.
    what : {"inputs", "outputs"}
        Replace what goes into the modules (to measure each module's own
        error) or what comes out of them.
    root : str
        Name of the top module, as in the reference (``"model"``).
    scope : {"leaves", "all"}
        The leaf modules and the modules holding parameters of their own (as ``capture``), or
        every module.
    mapping : dict, path or Mapping, optional
        Rules ``{reference_regex: live_template}`` when the runs name modules
        differently (:class:`tdinspect.align.mapping.Mapping`; rules with a
        transform are not used: grafting would need its inverse).
    capture : ModuleCapture, optional
        A capture of the same model: its ``step()`` advances the graft too.
    rank : int, optional
        The reference rank to read (default: this process's rank).
    start : int, optional
        The reference pass of the first forward (default: its first pass).

    Returns
    -------
    Graft

    Raises
    ------
    GraftError
        During the forward, when the reference lacks an entry or its shape
        differs (the message names both sides).

    Examples
    --------
    >>> with graft(model, "runs/a", modules=[r"layers\\.2\\."]) as g:   # doctest: +SKIP
    ...     model(tokens)
    ...     g.step()
    """
    return Graft(
        model,
        reference,
        modules=modules,
        what=what,
        root=root,
        scope=scope,
        mapping=mapping,
        capture=capture,
        rank=rank,
        start=start,
    )
