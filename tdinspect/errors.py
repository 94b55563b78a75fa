"""Every public exception and warning of tdinspect, in one place.

Each names what it is about (a file, an argument, a rule) in its message. The modules that raise
them import them from here; the public ones are also names of :mod:`tdinspect`.

Examples
--------
>>> from tdinspect.errors import DumpFormatError
>>> issubclass(DumpFormatError, ValueError)
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tdinspect.util.terminal import visible


class DumpFormatError(ValueError):
    """A dump file or folder that cannot be read; the message names it."""


class ReplayRefused(DumpFormatError):
    """The recorded op is not one ``replay`` runs (it could act outside its own outputs)."""


class ConfigError(ValueError):
    """A capture setting (argument, config field or environment variable) is invalid."""


class KeyGrammarError(ValueError):
    """A key that does not follow the grammar."""


class DimsError(ValueError):
    """A dims spec that does not parse; the message names the spec."""


class TransformError(ValueError):
    """A transform spec outside the language, or one that does not fit a tensor."""


class MappingError(ValueError):
    """A mapping file or rule that cannot be used (the message names the rule)."""


class AlignError(ValueError):
    """A logical entry that cannot be assembled; the message says why (and names ranks)."""


class TokenLayoutError(ValueError):
    """Token layout metadata (``tdinspect.tokens(...)``, a sidecar's ``tokens``) that does not
    describe a pass's token rows; the message names the argument or file."""


class CaptureWriteError(RuntimeError):
    """Writing a pass failed (full disk, permissions...); capture has stopped."""


class CaptureCheckError(RuntimeError):
    """Base of the errors a check raises while the model runs; the capture is closed first."""


class CaptureMemoryError(CaptureCheckError):
    """A capture to memory (``capture(..., memory=...)``) would hold more than its limit; the
    message names the limit and the entry that crossed it. The capture is closed, the pass in
    progress dropped; the passes before it stay in ``cap.dumpset``."""


@dataclass
class NonFinite:
    """The first entry holding NaN or Inf.

    Attributes
    ----------
    key : str
        The entry's key (``model.layers.2.mlp.down``, ``model.ln/aten.sqrt.default[out0]``).
    op : str
        The key without ``::callN``.
    call, pass_, rank : int
        Where it is (0-based call).
    nan, inf, numel : int or None
        Counts (``None`` where they could not be taken: an accelerator tensor
        already freed when the step's flags were read).
    inherited : bool or None
        Op level: whether the op's inputs already held NaN/Inf. ``None`` at
        module level or when the inputs are unknown.
    order : int
        Position in its pass.
    """

    key: str
    op: str
    call: int
    pass_: int
    rank: int = 0
    nan: int | None = None
    inf: int | None = None
    numel: int | None = None
    inherited: bool | None = None
    order: int = -1

    def describe(self) -> str:
        where = f"call {self.call}, pass {self.pass_}" + (f", rank {self.rank}" if self.rank else "")
        counts = (
            "NaN/Inf (counts unavailable)"
            if self.nan is None
            else f"{self.nan} NaN and {self.inf} Inf of {self.numel} elements"
        )
        origin = (
            ""
            if self.inherited is None
            else "; its inputs already held NaN/Inf (inherited)"
            if self.inherited
            else "; its inputs were finite: this op created them"
        )
        return f"{self.key} ({where}): {counts}{origin}"

    def __repr__(self) -> str:
        return f"NonFinite({self.describe()})"


class NonFiniteError(CaptureCheckError):
    """An output held NaN or Inf (``on_nonfinite="raise"``); ``.nonfinite`` says where.

    Examples
    --------
    >>> try:                                                   # doctest: +SKIP
    ...     with tdinspect.capture(model, on_nonfinite="raise") as cap:
    ...         model(x); cap.step()
    ... except tdinspect.NonFiniteError as e:
    ...     print(e.nonfinite.key, e.nonfinite.pass_)
    """

    def __init__(self, nonfinite: NonFinite):
        super().__init__(f"first non-finite output: {nonfinite.describe()}")
        self.nonfinite = nonfinite


class DivergenceError(CaptureCheckError):
    """An entry passed the threshold against the reference (``on_divergence="raise"``).

    ``.divergence`` is the :class:`tdinspect.Divergence` that
    ``DumpSet.open(ref).diff(run).first_divergence()`` answers for a full dump
    of the same run.
    """

    def __init__(self, divergence: Any, evidence: Any = None):
        where = f"; evidence in {evidence}" if evidence else ""
        super().__init__(
            visible(
                f"live comparison: first divergence at {divergence.key} "
                f"(call {divergence.call}, pass {divergence.pass_}): "
                f"{divergence.reason}{where}"
            )
        )  # names from the files
        self.divergence = divergence
        self.evidence = evidence


class UncomparedError(CaptureCheckError):
    """Live comparison set entries aside or never compared them in a pass
    (``on_uncompared="raise"``); ``.rows`` are their rows (``key``, ``key_b``, ``reason``)."""

    def __init__(self, message: str, rows: Any = None):
        super().__init__(visible(message))  # names from the files
        self.rows = rows or []


class GraftError(RuntimeError):
    """The reference cannot supply what a grafted module needs (the message names both sides)."""


class RunWarning(UserWarning):
    """A dump folder holds several runs, or a capture added or removed one (one line each)."""


class RunsNote(RunWarning):
    """The routine :class:`RunWarning`: a capture made a new run beside earlier ones, removed
    earlier ones (``overwrite=True``), or an open took the newest of several. The magics fold
    it into their cell's one line; a script sees it as a ``RunWarning``."""


class UncomparedWarning(UserWarning):
    """``first_divergence()`` found no divergence, but entries were set aside
    (``structural="report"``) or never compared: the verdict is ``"incomplete"``
    (:meth:`tdinspect.Diff.verdict` says which, and where the comparison stopped)."""
