"""Where each tensor of a pass file starts, for reading many small ones at once.

:func:`tdinspect.store.rawpass.read_raw` makes a torch view per entry (``frombuffer``,
``view``, ``as_strided``: several microseconds each, most of a pass of 10⁵
small entries). A batch of small pairs (:mod:`tdinspect.compare.smallpairs`) needs only
their bytes: :func:`element_starts` checks everything ``read_raw`` checks (the
same archive, little-endian, its pickle naming the keys and records in order,
every entry's record stored uncompressed and holding its view, a dtype torch
knows) and returns the file's bytes as one numpy array (a copy-on-write map) and where
each contiguous entry's elements start; the other entries of the pass are made
from them as ``read_raw`` makes them, when asked for. Anything that does not
check out returns ``None``: the caller reads the pass as before.

Examples
--------
>>> import os, tempfile, torch
>>> from tdinspect.store.rawpass import layout
>>> tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 3).t()}
>>> path = os.path.join(tempfile.mkdtemp(), "pass00000.pt")
>>> torch.save(tensors, path)
>>> spans = element_starts(path, ["a", "b"], layout(tensors))
>>> first, count, dtype = spans.starts[0]
>>> spans.data[first:first + 4 * count].view(np.float32).tolist(), dtype, spans.starts[1]
([0.0, 1.0, 2.0, 3.0], 'torch.float32', None)
>>> spans.tensors()["b"].stride()
(1, 3)
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tdinspect.store.rawpass import _DTYPES, checked_map, entry_span, record_storage
from tdinspect.store.reindex import _contiguous
from tdinspect.store.zipindex import ZipIndex


@dataclass
class Spans:
    """Where a pass file's entries lie, checked (see :func:`element_starts`).

    Attributes
    ----------
    data : numpy.ndarray
        The file's bytes (``uint8``, a copy-on-write map: writing to it never
        reaches the file).
    starts : list
        Per entry: ``(offset of its first element, number of elements, dtype
        name)`` where its view is contiguous, else ``None``.
    """

    data: np.ndarray
    starts: list[Any]
    keys: list[str]
    raw: list[Any]
    records: dict[str, tuple[int, int]]

    def tensors(self) -> Views:
        """Every entry as the torch view :func:`~tdinspect.store.rawpass.read_raw` gives, made when
        asked for."""
        return Views(self)


class Views(Mapping):
    """``{key: tensor}`` of a :class:`Spans`, each view made on first use."""

    def __init__(self, spans: Spans):
        self.spans = spans
        self.position = {k: i for i, k in enumerate(spans.keys)}
        self.storages: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        record, offset, shape, strides, name = self.spans.raw[self.position[key]]
        dtype = _DTYPES[name]
        storage = self.storages.get((record, dtype))
        if storage is None:
            start, size = self.spans.records[record]
            storage = self.storages[(record, dtype)] = record_storage(self.spans.data, dtype, start, size)
        return storage.as_strided(shape, strides, offset)

    def __iter__(self):
        return iter(self.spans.keys)

    def __len__(self) -> int:
        return len(self.spans.keys)


def element_starts(
    path: str | os.PathLike, keys: list[str], raw: list[Any], index: ZipIndex | None = None
) -> Spans | None:
    """Where each entry of a pass file lies, after :func:`~tdinspect.store.rawpass.read_raw`'s checks.

    Parameters
    ----------
    path, keys, raw, index
        As for :func:`tdinspect.store.rawpass.read_raw`: every stored entry of the
        pass, in file order.

    Returns
    -------
    Spans or None
        ``None`` when anything does not check out (read the pass as before).
    """
    opened = checked_map(path, keys, raw, index)
    if opened is None:
        return None
    mapped, index, prefix = opened
    located: dict[str, Any] = {}
    starts: list[Any] = []
    for entry in raw:
        span = entry_span(mapped, index, prefix, entry, located)
        if span is None:
            return None
        dtype, start, _ = span
        _, offset, shape, strides, name = entry
        starts.append(
            (start + offset * dtype.itemsize, math.prod(shape), name) if _contiguous(shape, strides) else None
        )
    return Spans(np.frombuffer(mapped, np.uint8), starts, keys, raw, located)
