"""Parsing of option values shared by the CLI and the magics.

Examples
--------
>>> number_or_auto("auto"), number_or_auto("1e-3")
('auto', 0.001)
"""

from __future__ import annotations

import argparse
import math


def number_or_auto(text: str) -> float | str:
    """``"auto"`` or a float that is not NaN (``ValueError`` otherwise)."""
    if text.strip() == "auto":
        return "auto"
    value = float(text)
    if math.isnan(value):
        raise ValueError(f"{text!r} is NaN")
    return value


def threshold_arg(text: str) -> float | str:
    """``--threshold`` of the dashboard and the magics: ``auto`` or a number (an argparse type)."""
    try:
        return number_or_auto(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number (not NaN), got {text!r}") from None
