"""Lining two runs up: mappings between names, transforms of tensors,
unsharding tensor-parallel dumps (:mod:`.unshard`, dims grammar in :mod:`.dims`) and
concatenating decode steps (:mod:`.concat`).

Each piece produces a plan that :class:`tdinspect.compare.diff.Diff` applies when
tensors are read.
"""

from __future__ import annotations

from tdinspect.align.args import arg_difference, describe_args
from tdinspect.align.mapping import Mapping, Rule
from tdinspect.align.transforms import Transform, as_transform, parse_transform
from tdinspect.errors import MappingError, TransformError

__all__ = [
    "Mapping",
    "MappingError",
    "Rule",
    "Transform",
    "TransformError",
    "arg_difference",
    "as_transform",
    "describe_args",
    "parse_transform",
]
