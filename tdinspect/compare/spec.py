"""CompareSpec: the options a comparison is made with, as one value.

Mapping, structural mode, alignment, concat, unshard, metric, threshold,
entries allowed to be one-sided and a baseline run are built once into a
frozen :class:`CompareSpec`, held by the :class:`~tdinspect.Diff` (``diff.spec``),
shown by its repr and :meth:`~tdinspect.Diff.plan`, and taken by every surface:
the CLI (:meth:`CompareSpec.from_args`, the flags of
:func:`tdinspect.util.arguments.add_spec_arguments`), the magics, the explorer,
the plots, the dashboard (handed to its Voilà page as JSON, :meth:`to_json`)
and live capture (:meth:`live_options`). A view never rebuilds a comparison
from fewer options than the diff it shows.

Examples
--------
>>> spec = CompareSpec(structural="report", allow_uncompared=r"rotary_emb")
>>> spec
CompareSpec(structural='report', allow_uncompared=('rotary_emb',))
>>> CompareSpec.from_json(spec.to_json()) == spec
True
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from tdinspect.align.mapping import Mapping
from tdinspect.compare.baseline import FACTOR, check_factor
from tdinspect.compare.thresholds import allowed_pattern
from tdinspect.numerics.metrics import metric as metric_named
from tdinspect.util.arguments import threshold_values

ALIGNS = ("name", "sequence")
STRUCTURAL = ("diverge", "report")


@dataclass(frozen=True, repr=False, eq=False)
class CompareSpec:
    """The options a comparison is made with (a frozen value; :meth:`replace` makes another).

    Attributes
    ----------
    align : {"name", "sequence"}
        Pair entries by name, or by a sequence alignment of (op, shape) per pass.
    mapping : Mapping, optional
        Rules pairing differently named entries (a dict, a YAML/JSON file or a
        :class:`~tdinspect.align.Mapping` is turned into one).
    unshard : bool
        Reassemble tensor/context/expert-parallel ranks on both sides first.
    concat : str or (over, dim), optional
        ``"call:1"``, ``"pass:1"``: decode steps put end to end on both sides.
    tokens : bool
        Line the runs up token by token, by (request, position), whatever their packing,
        padding or passes (:class:`~tdinspect.compare.tokens.TokenDiff`).
    structural : {"diverge", "report"}
        Whether entries differing in structure (one side only, another shape)
        diverge or are set aside (:meth:`tdinspect.Diff.first_divergence`).
    metric : str, optional
        The divergence metric (``None``: ``rel_diff``, ``stats_rel`` for statistics-only).
    threshold : "auto", float or {regex: float or "auto"}
        The divergence threshold of :attr:`metric`.
    allow_uncompared : tuple of str
        Regexes of entries one-sided or never compared by design.
    baseline : str or DumpSet, optional
        A baseline run (the trusted implementation in the working precision): B
        diverges where its error exceeds ``baseline_factor`` times the baseline's
        (:mod:`tdinspect.compare.baseline`).
    baseline_factor : float
        ``k`` of the baseline's error budget (default 10).

    Examples
    --------
    >>> CompareSpec(mapping={r"layers\\.(\\d+)\\.mlp": r"blocks.\\1.ffn"}).describe()
    'mapping 1 rule'
    """

    align: str = "name"
    mapping: Mapping | None = None
    unshard: bool = False
    concat: str | tuple | None = None
    tokens: bool = False
    structural: str = "diverge"
    metric: str | None = None
    threshold: Any = "auto"
    allow_uncompared: tuple[str, ...] = ()
    baseline: Any = None
    baseline_factor: float = FACTOR

    def __post_init__(self):
        if self.align not in ALIGNS:
            raise ValueError(f"align={self.align!r}: expected 'name' or 'sequence'")
        if self.structural not in STRUCTURAL:
            raise ValueError(f"structural={self.structural!r}: expected 'diverge' or 'report'")
        set_ = object.__setattr__.__get__(self)  # a frozen dataclass normalises in place
        set_("mapping", Mapping.coerce(self.mapping))
        if self.mapping is not None and self.align != "name":
            raise ValueError("mapping= pairs entries by rule: use it with align='name'")
        if self.metric is not None:
            metric_named(self.metric)  # "" became the default metric, silently
        set_("threshold", "auto" if self.threshold is None else self.threshold)
        allow = self.allow_uncompared
        if allow is None:
            allow = ()
        elif isinstance(allow, (str, re.Pattern)):
            allow = (allow,)
        elif isinstance(allow, (list, tuple, set, frozenset)):
            allow = tuple(allow)
        else:  # a hand-edited spec: tuple(5) raised "'int' object is not iterable"
            raise ValueError(f"allow_uncompared={allow!r}: expected a regex or a list of them")
        for p in allow:
            allowed_pattern(p)
        set_("allow_uncompared", tuple(p.pattern if isinstance(p, re.Pattern) else p for p in allow))
        if isinstance(self.concat, list):
            set_("concat", tuple(self.concat))
        for flag in ("unshard", "tokens"):  # bool("false") is True
            value = getattr(self, flag)
            if value not in (None, True, False):
                raise ValueError(f"{flag}={value!r}: expected true or false")
            set_(flag, bool(value))
        baseline = self.baseline
        if not (baseline is None or isinstance(baseline, (str, os.PathLike)) or hasattr(baseline, "path")):
            raise ValueError(f"baseline={baseline!r}: expected a dump folder (a path) or a DumpSet")
        if self.tokens and (self.concat is not None or self.align != "name"):
            raise ValueError(
                "tokens=True lines passes up by request and position: no concat or align='sequence'"
            )
        if self.tokens and self.baseline is not None:  # every entry read "no baseline entry"
            raise ValueError(
                "tokens=True with a baseline: not supported (the baseline pairs with A pass by pass, "
                "tokens=True by request); compare token by token without baseline="
            )
        set_("baseline_factor", check_factor(self.baseline_factor))

    def __eq__(self, other) -> bool:
        return isinstance(other, CompareSpec) and self.to_dict() == other.to_dict()

    __hash__ = None  # a threshold or mapping may be a dict

    # -- making one -------------------------------------------------------------------------
    def replace(self, **changes) -> CompareSpec:
        """This spec with ``changes`` (those that are ``None`` left as they are)."""
        given = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    @classmethod
    def coerce(cls, value: CompareSpec | dict | None) -> CompareSpec:
        """A spec, a dict of its fields, or ``None`` (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"spec= takes a CompareSpec or a dict of its fields, not {type(value).__name__}")

    @classmethod
    def from_args(cls, args) -> CompareSpec:
        """The spec of parsed :func:`~tdinspect.util.arguments.add_spec_arguments` flags
        (``ValueError`` naming the flag for a bad value)."""
        for p in args.allow_uncompared or ():
            try:
                allowed_pattern(p)
            except ValueError as exc:
                raise ValueError(f"--{exc}".replace("allow_uncompared", "allow-uncompared", 1)) from None
        mapping = getattr(args, "mapping", None)
        if mapping is not None:
            mapping = Mapping.from_file(mapping)
        return cls(
            align=args.align,
            mapping=mapping,
            unshard=args.unshard,
            concat=args.concat,
            tokens=bool(getattr(args, "tokens", False)),
            structural=args.structural,
            metric=args.metric,
            threshold=threshold_values(args.threshold),
            allow_uncompared=tuple(args.allow_uncompared or ()),
            baseline=getattr(args, "baseline", None),
            baseline_factor=FACTOR
            if getattr(args, "baseline_factor", None) is None
            else args.baseline_factor,
        )

    # -- handing it on --------------------------------------------------------------------
    def live_options(self) -> dict[str, Any]:
        """The keyword arguments of ``tdinspect.capture(compare_to=...)`` of this spec (live
        comparison pairs by name and takes neither unshard nor concat: ``ValueError``)."""
        if (
            self.align != "name"
            or self.unshard
            or self.tokens
            or self.concat is not None
            or self.baseline is not None
        ):
            raise ValueError(
                "live comparison pairs entries by name: no align='sequence', unshard, tokens, concat or baseline"
            )
        return {
            "metric": self.metric,
            "threshold": self.threshold,
            "mapping": self.mapping,
            "structural": self.structural,
            "allow_uncompared": list(self.allow_uncompared) or None,
        }

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (the mapping as its rules, a baseline as its path)."""
        baseline = self.baseline
        if baseline is not None and not isinstance(baseline, (str, os.PathLike)):
            baseline = str(baseline.path)  # a DumpSet
        return {
            "align": self.align,
            "mapping": None if self.mapping is None else self.mapping.to_dict(),
            "unshard": self.unshard,
            "concat": list(self.concat) if isinstance(self.concat, tuple) else self.concat,
            "tokens": self.tokens,
            "structural": self.structural,
            "metric": self.metric,
            "threshold": self.threshold,
            "allow_uncompared": list(self.allow_uncompared),
            "baseline": None if baseline is None else os.fspath(baseline),
            "baseline_factor": self.baseline_factor,
        }

    def to_json(self) -> str:
        """The spec as JSON (data only: a mapping's transforms are their parsed text).

        ``ValueError`` when a mapping rule's transform is a Python callable (code, not data)."""
        if self.mapping is not None and any(
            r.transform is not None and r.transform.fn is not None for r in self.mapping.rules
        ):
            raise ValueError("a mapping rule's transform is a Python callable: it cannot be sent as data")
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> CompareSpec:
        """The spec :meth:`to_json` wrote (checked as any spec is: bad values raise ``ValueError``)."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"not a CompareSpec in JSON: {text[:80]!r}")
        return cls(**data)

    # -- showing it -----------------------------------------------------------------------
    def changed(self) -> dict[str, Any]:
        """The fields that differ from the defaults."""
        mine, default = self.to_dict(), CompareSpec().to_dict()
        return {k: getattr(self, k) for k in mine if mine[k] != default[k]}

    def describe(self) -> str:
        """The options that differ from the defaults, in words (``""`` for none)."""
        parts = []
        for name, value in self.changed().items():
            if name == "mapping":
                n = len(value)
                parts.append(f"mapping {n} rule{'s' if n != 1 else ''}")
            elif name in ("unshard", "tokens"):
                parts.append(name)
            elif name == "allow_uncompared":
                parts.append(f"allow_uncompared {list(value)}")
            elif name == "baseline":
                parts.append(f"baseline {getattr(value, 'path', value)}")
            else:
                parts.append(f"{name} {value}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{k}={v!r}" if k != "mapping" else f"mapping=<{len(v)} rules>" for k, v in self.changed().items()
        )
        return f"CompareSpec({shown})"
