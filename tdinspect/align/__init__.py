"""Lining two runs up: mappings between names, transforms of tensors, suggested mappings,
unsharding tensor-parallel dumps (:mod:`.unshard`, dims grammar in :mod:`.dims`) and
concatenating decode steps (:mod:`.concat`).

Each piece produces a plan that :class:`tdinspect.diff.Diff` applies when
tensors are read.
"""

from __future__ import annotations

from .mapping import Mapping, MappingError, Rule
from .transforms import Transform, TransformError, as_transform, parse_transform

__all__ = ["Mapping", "MappingError", "Rule", "Transform", "TransformError", "as_transform",
           "parse_transform"]
