"""The first NaN/Inf of an existing dump, from its statistics (computed where no sidecar has them).

The same answer :func:`tdinspect.capture` gives live with ``on_nonfinite``:
the first *output* (op-level ``[inN]`` entries are inputs, not checked) in
(pass, execution order) whose statistics count a NaN or an Inf. At op level,
when the dump holds the op's inputs (``capture_ops(..., inputs=True)``), the
answer also says whether they already held NaN/Inf (inherited) or not (the op
created them).

Examples
--------
>>> DumpSet.open("dumps/run_a").first_nonfinite()     # doctest: +SKIP
NonFinite(model.layers.1.mlp.down (call 0, pass 2): 3 NaN and 0 Inf of 2048 elements)
"""

from __future__ import annotations

import re

import numpy as np

from tdinspect.errors import NonFinite
from tdinspect.naming import split_call
from tdinspect.numerics.stats import STAT_NAMES

_NAN, _INF, _NUMEL = (STAT_NAMES.index(s) for s in ("nan", "inf", "numel"))
_INPUT = re.compile(r"\[in\d+\]\Z")
_OUTPUT = re.compile(r"\[out\d+\]\Z")


def first_nonfinite(ds) -> NonFinite | None:
    """The first output of ``ds`` (a :class:`~tdinspect.DumpSet`) holding NaN or Inf, or ``None``.

    Passes are read in order and the search stops at the first one that has
    such an entry; within a pass the order is the execution order.
    """
    for (rank, p), pi in ds.pass_map.items():  # ordered by (pass, rank)
        stats = pi.ensure_stats()
        bad = np.flatnonzero((stats[:, _NAN] > 0) | (stats[:, _INF] > 0))
        for i in bad:
            key = pi.keys[i]
            base, call = split_call(key)
            if _INPUT.search(base) or not ds.keeps(key):
                continue
            inherited = None
            if _OUTPUT.search(base):
                prefix = _OUTPUT.sub("", base) + "[in"
                rows = [j for j, k in enumerate(pi.keys) if k.startswith(prefix) and split_call(k)[1] == call]
                if rows:
                    inherited = bool(((stats[rows, _NAN] > 0) | (stats[rows, _INF] > 0)).any())
            row = stats[i]
            return NonFinite(
                key,
                base,
                call,
                p,
                rank,
                int(row[_NAN]),
                int(row[_INF]),
                int(row[_NUMEL]),
                inherited=inherited,
                order=int(i),
            )
    return None
