"""A pass held in memory (``capture(..., memory=True)``): its sidecar's facts and its tensors.

It answers as a pass read from disk does (:class:`~tdinspect.store.passindex.PassIndex`):
the same keys, statistics and columns, because its facts go through the sidecar's JSON and
checks (:func:`~tdinspect.store.format.sidecar_in_memory`); only :meth:`MemoryPass.load`
differs, handing the tensors it holds instead of reading a file.

Examples
--------
>>> import torch
>>> from tdinspect.store.format import sidecar_in_memory
>>> meta = {"rank": 0, "level": "module", "stats_only": False, "pass": 0,
...         "entries": {"key": ["model.fc"], "shape": [[2]], "dtype": ["torch.float32"],
...                     "module_type": ["Linear"], "stored": [True], "stats": [None]}}
>>> pi = MemoryPass.held(0, sidecar_in_memory(meta, "<memory>"), {"model.fc": torch.ones(2)})
>>> pi.tensor("model.fc")
tensor([1., 1.])
"""

from __future__ import annotations

from pathlib import Path

import torch

from tdinspect.errors import DumpFormatError
from tdinspect.store.format import PassFiles, pass_filename
from tdinspect.store.passindex import PassIndex

WHERE = "<memory>"  # what names a pass held in memory in messages and in ``DumpSet.path``


class MemoryPass(PassIndex):
    """A :class:`PassIndex` whose tensors are held, not on disk (see the module docstring)."""

    @classmethod
    def held(
        cls,
        rank: int,
        doc: dict,
        tensors: dict[str, torch.Tensor],
        earlier: dict[int, MemoryPass] | None = None,
    ) -> MemoryPass:
        """The pass ``doc`` describes (a sidecar document, as ``sidecar_in_memory`` makes it)
        holding ``tensors``; ``earlier``: this rank's passes by number, for entries that refer
        to a pass before (parameters unchanged since)."""
        pi = cls.from_sidecar(rank, PassFiles(int(doc["pass"])), doc)
        pi._tensors = tensors
        pi._earlier = {} if earlier is None else earlier
        return pi

    @property
    def path(self) -> Path:
        return Path(WHERE) / f"rank{self.rank}" / pass_filename(self.index)

    def load(self) -> dict[str, torch.Tensor]:
        if self.stats_only:
            raise DumpFormatError(f"{self.path}: statistics-only pass, no tensors were kept")
        return self._tensors

    def damaged(self, key: str) -> str | None:
        return None  # no file: nothing read back that could fail its CRC

    def earlier(self, index, key: str) -> PassIndex:
        found = self._earlier.get(index) if isinstance(index, int) and 0 <= index < self.index else None
        if found is None:
            raise DumpFormatError(
                f"{self.path}: entry {key!r} refers to pass {index!r}, which is not an earlier pass held"
            )
        return found
