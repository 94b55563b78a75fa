"""The comparison flags and option values shared by the CLI and the magics.

:data:`SPEC_FLAGS` is the one definition of the flags that make a comparison spec
(``--mapping``, ``--structural``, ``--align``, ``--concat``, ``--unshard``, ``--metric``,
``--threshold``, ``--allow-uncompared``, ``--baseline``): ``tdinspect first-divergence``,
``diff`` and ``dashboard`` add them with :func:`add_spec_arguments`, ``%tdi_diff`` and
``%%tdi_capture`` with IPython's ``argument`` from the same list, and
:meth:`tdinspect.compare.spec.CompareSpec.from_args` reads them back.

Examples
--------
>>> number_or_auto("auto"), number_or_auto("1e-3")
('auto', 0.001)
>>> threshold_values(["attn=1e-2", "1e-3"])
{'attn': 0.01, '.*': 0.001}
"""

from __future__ import annotations

import argparse
import math
import re


def number_or_auto(text: str) -> float | str:
    """``"auto"`` or a float that is not NaN (``ValueError`` otherwise)."""
    if text.strip() == "auto":
        return "auto"
    value = float(text)
    if math.isnan(value):
        raise ValueError(f"{text!r} is NaN")
    return value


def nonempty(text: str) -> str:
    """A path, regex or name given on the command line, refused when empty (an argparse type):
    ``""`` (an unset shell variable) named the working folder, or allowed every entry."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: an empty value names nothing")
    return text


def threshold_arg(text: str) -> float | str:
    """One ``--threshold`` value: ``auto`` or a number (an argparse type)."""
    try:
        return number_or_auto(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number (not NaN), got {text!r}") from None


def threshold_values(values: list[str] | str | float | None):
    """``--threshold`` given zero or more times: ``auto`` (none given), one number, or
    ``{regex: value}`` from ``REGEX=VALUE`` ones (a plain one then applies to the rest,
    ``".*"``). ``ValueError`` naming the flag for a bad value or regex."""
    if values is None or isinstance(values, (int, float)) or values == []:
        return "auto" if values in (None, []) else values
    values = [values] if isinstance(values, str) else list(values)
    plain = [v for v in values if "=" not in str(v)]
    named = [v for v in values if "=" in str(v)]
    try:
        if plain and not named and len(plain) == 1:
            return number_or_auto(str(plain[0]))
        out = {}
        for v in named:
            pattern, _, number = v.rpartition("=")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(
                    f"--threshold {v!r}: invalid regular expression {pattern!r} ({exc})"
                ) from None
            out[pattern] = number_or_auto(number)
        if plain:
            out[".*"] = number_or_auto(str(plain[-1]))
        return out
    except ValueError as exc:
        if str(exc).startswith("--threshold"):
            raise
        shown = " ".join(f"--threshold {v}" for v in values)
        raise ValueError(f"{shown}: expected auto, a number (not NaN) or REGEX=NUMBER") from None


# (flags, argparse keywords) of each option of a comparison spec: the one definition
SPEC_FLAGS: list[tuple[tuple[str, ...], dict]] = [
    (
        ("--metric",),
        dict(default=None, help="divergence metric (default rel_diff; stats_rel for stats-only)"),
    ),
    (
        ("--threshold",),
        dict(
            action="append",
            metavar="auto|T|REGEX=T",
            help="auto (default): each entry's from its two dtypes, rel_diff u/4 and cosine "
            "1 - u/4 with u the unit roundoff of the coarser (float32 1.5e-8, float16 1.2e-4, "
            "bfloat16 9.8e-4), sqnr_db 10*log10(2/u), integers exact, fixed defaults for the "
            "other metrics; a number for every entry; REGEX=T per entry name (repeatable, T a "
            "number or auto)",
        ),
    ),
    (
        ("--align",),
        dict(
            choices=["name", "sequence"],
            default="name",
            help="pair entries by name (default) or by aligning the two sequences of (op, shape): "
            "op-level runs of two implementations whose op sequences differ",
        ),
    ),
    (
        ("--mapping",),
        dict(
            type=nonempty,
            metavar="FILE",
            default=None,
            help="YAML/JSON rules {a_regex: b_template | [b_template, transform]} pairing "
            "differently named entries",
        ),
    ),
    (
        ("--unshard",),
        dict(action="store_true", help="reassemble tensor/context/expert-parallel ranks on both sides"),
    ),
    (
        ("--concat",),
        dict(
            type=nonempty,
            metavar="pass:DIM|call:DIM",
            default=None,
            help="put consecutive passes or calls end to end along DIM on both sides (a decode "
            "run against one full forward)",
        ),
    ),
    (
        ("--tokens",),
        dict(
            action="store_true",
            help="line the runs up token by token, by (request, position), whatever their packing, "
            "padding or passes (both recorded with dump.step(tokens=...)); the answer names the "
            "request and position",
        ),
    ),
    (
        ("--structural",),
        dict(
            choices=["diverge", "report"],
            default="diverge",
            help="report: set one-sided/unmatched/reshaped entries aside, list them and name the "
            "first numerical divergence (none: incomplete, exit 3, unless --allow-uncompared "
            "names them all)",
        ),
    ),
    (
        ("--allow-uncompared",),
        dict(
            type=nonempty,
            action="append",
            metavar="REGEX",
            default=None,
            help="entries (re.search on A's or B's name) that may be one-sided or never compared "
            "by design: they neither diverge for it nor make the result incomplete (exit 3); "
            "repeatable",
        ),
    ),
    (
        ("--baseline",),
        dict(
            type=nonempty,
            metavar="DIR",
            default=None,
            help="a baseline run (the trusted implementation in the working precision, e.g. the "
            "reference in float32 against a float64 A): B diverges where its error exceeds "
            "--baseline-factor times the baseline's error against A at that entry",
        ),
    ),
    (
        ("--baseline-factor",),
        dict(
            type=float,
            metavar="K",
            default=None,
            help="how many times the baseline's error B may make (default 10; with --baseline)",
        ),
    ),
]


def add_spec_arguments(parser: argparse.ArgumentParser, metrics=None) -> argparse.ArgumentParser:
    """Add :data:`SPEC_FLAGS` to ``parser`` (``metrics``: the choices of ``--metric``)."""
    for flags, options in spec_flags(metrics):
        parser.add_argument(*flags, **options)
    return parser


def spec_flags(metrics=None) -> list[tuple[tuple[str, ...], dict]]:
    """:data:`SPEC_FLAGS`, with ``--metric`` limited to ``metrics`` when given."""
    out = []
    for flags, options in SPEC_FLAGS:
        if flags == ("--metric",) and metrics:
            options = {**options, "choices": sorted(metrics)}
        out.append((flags, options))
    return out
