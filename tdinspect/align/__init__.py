"""Lining two runs up: mappings between names, transforms of tensors, suggested mappings,
unsharding tensor-parallel dumps (:mod:`.unshard`, dims grammar in :mod:`.dims`) and
concatenating decode steps (:mod:`.concat`).

Each piece produces a plan that :class:`tdinspect.diff.Diff` applies when
tensors are read.
"""

from __future__ import annotations

from .args import arg_difference, describe_args
from .mapping import Mapping, MappingError, Rule
from .suggest import Suggestion, suggest_mapping
from .transforms import Transform, TransformError, as_transform, parse_transform

__all__ = ["Mapping", "MappingError", "Rule", "Suggestion", "Transform", "TransformError",
           "arg_difference", "as_transform", "describe_args", "parse_transform", "suggest_mapping"]
