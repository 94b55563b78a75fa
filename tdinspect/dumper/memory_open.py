"""The DumpSet of a capture to memory, built on first use (the analysis side loads here)."""

from __future__ import annotations

from typing import Any


def open_memory(passes: list[dict[str, Any]]):
    """:meth:`tdinspect.DumpSet.from_memory` of the plain pass dicts a memory capture kept."""
    from tdinspect.dumpset import DumpSet

    return DumpSet.from_memory(passes)
