"""Token layout: which request and position each token row of a pass holds.

A serving engine packs the tokens of many requests into ``[total_tokens, hidden]``
(sequence boundaries in ``cu_seqlens``, per-token ``positions``) and batches requests
differently at every step; a reference runs padded ``[batch, seq, hidden]`` with an
attention mask. :func:`tokens` builds a :class:`TokenLayout` from the engine's own
tensors; ``dump.step(tokens=...)`` writes it into the pass's sidecar, and
``DumpSet.diff(other, tokens=True)`` lines the two runs up token by token
(:mod:`tdinspect.align.tokens`).

On disk (the sidecar's ``tokens`` field)::

    {"shape": [1, 30], "segments": [[request, first_position, length], ...]}

``shape`` is the leading dims of the pass's token-major tensors (``[T]`` packed,
``[B, S]`` padded); the segments cover its ``prod(shape)`` rows in row order (the
leading dims flattened), each a run of one request's consecutive positions;
``request`` is ``null`` for pad rows.

Capture side: torch and the standard library only.

Examples
--------
>>> layout = tokens(request_ids=[7, 8], seq_lens=[2, 3])
>>> layout.segments
((7, 0, 2), (8, 0, 3))
>>> tokens(attention_mask=[[1, 1, 0], [1, 1, 1]]).segments
((0, 0, 2), (None, 0, 1), (1, 0, 3))
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tdinspect.errors import DumpFormatError, TokenLayoutError

MAX_ROWS = 1 << 26  # token rows one pass may hold: far beyond any engine's batch
MAX_ID = (1 << 63) - 1  # request ids and positions: int64, as the diff's arrays hold them


@dataclass(frozen=True)
class TokenLayout:
    """The token rows of one pass: their leading ``shape`` and ``(request, position, length)`` runs.

    Build with :func:`tokens`. ``request`` is ``None`` for pad rows. Every layout is checked
    when made (:func:`check_layout`, the reader's check too): one that could not be read back
    is never written.
    """

    shape: tuple[int, ...]
    segments: tuple[tuple[int | None, int, int], ...]

    def __post_init__(self) -> None:
        shape, segments = check_layout(self.shape, self.segments, "TokenLayout")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "segments", segments)

    @property
    def rows(self) -> int:
        """Token rows in the pass (pads included): ``prod(shape)``."""
        return math.prod(self.shape)

    def runs(self) -> Iterator[tuple[int, int | None, int, int]]:
        """``(first_row, request, first_position, length)`` of each segment, in row order."""
        row = 0
        for request, position, length in self.segments:
            yield row, request, position, length
            row += length

    def requests(self) -> list[int]:
        """The requests with tokens in this pass, in order of first row."""
        return list(dict.fromkeys(r for r, _, _ in self.segments if r is not None))

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_json(cls, value: Any, where: str) -> TokenLayout:
        """A sidecar's ``tokens`` field, checked (:func:`check_layout`, as at capture);
        :class:`DumpFormatError` naming ``where``."""
        if not isinstance(value, dict) or set(value) != {"shape", "segments"}:
            raise DumpFormatError(
                f"{where}: malformed 'tokens' field (expected {{'shape': [...], 'segments': "
                f"[[request, position, length], ...]}}): {str(value)[:80]!r}"
            )
        try:
            shape, segments = check_layout(value["shape"], value["segments"])
        except TokenLayoutError as exc:
            raise DumpFormatError(f"{where}: malformed 'tokens' field ({exc}): {str(value)[:80]!r}") from None
        layout = object.__new__(cls)  # checked just now: not twice
        object.__setattr__(layout, "shape", shape)
        object.__setattr__(layout, "segments", segments)
        return layout

    def __repr__(self) -> str:
        shown = ", ".join(
            f"pad x{n}" if r is None else f"r{r}@{p}" + (f"..{p + n - 1}" if n > 1 else "")
            for r, p, n in self.segments[:6]
        )
        more = ", ..." if len(self.segments) > 6 else ""
        return f"TokenLayout(shape {list(self.shape)}: {shown}{more})"


def _nonneg(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_ID


def check_layout(shape: Any, segments: Any, where: str = "") -> tuple[tuple, tuple]:
    """``(shape, segments)`` as tuples, or :class:`TokenLayoutError` naming the field (after
    ``where``, if given): the one check of a layout, at capture (:func:`tokens`,
    ``step(tokens=...)``) and on read (:meth:`TokenLayout.from_json`), so that what is
    written can be read.

    ``shape`` is a non-empty sequence of non-negative ints holding at most :data:`MAX_ROWS`
    rows; ``segments`` are ``(request or None, position, length > 0)`` of ints in int64
    (positions up to :data:`MAX_ID`), covering the rows exactly, no ``(request, position)``
    twice. The work is bounded by the rows (checked first), never by what a segment claims.

    Examples
    --------
    >>> check_layout([2], [[0, 0, 2]], "here")
    ((2,), ((0, 0, 2),))
    >>> check_layout((), (), "here")
    Traceback (most recent call last):
    ...
    tdinspect.errors.TokenLayoutError: here: shape=(): expected a non-empty list of non-negative ints
    """
    at = f"{where}: " if where else ""
    if not isinstance(shape, (list, tuple)) or not shape or not all(_nonneg(v) for v in shape):
        raise TokenLayoutError(f"{at}shape={str(shape)[:80]}: expected a non-empty list of non-negative ints")
    rows = math.prod(shape)
    if rows > MAX_ROWS:
        raise TokenLayoutError(
            f"{at}shape={list(shape)} holds {rows} token rows, more than a pass may ({MAX_ROWS})"
        )
    if not isinstance(segments, (list, tuple)):
        raise TokenLayoutError(f"{at}segments: expected a list of [request or null, position, length]")
    if len(segments) > rows:  # each covers one row at least
        raise TokenLayoutError(f"{at}{len(segments)} segments for {rows} token rows")
    out, total = [], 0
    for i, seg in enumerate(segments):
        ok = (
            isinstance(seg, (list, tuple))
            and len(seg) == 3
            and (seg[0] is None or _nonneg(seg[0]))
            and _nonneg(seg[1])
            and _nonneg(seg[2])
            and seg[2] > 0
            and seg[1] + seg[2] - 1 <= MAX_ID
        )
        if not ok:
            raise TokenLayoutError(
                f"{at}segments[{i}] = {str(seg)[:80]}: expected [request (an int up to 2^63-1) or "
                "null, position, length > 0], positions up to 2^63-1"
            )
        total += seg[2]
        out.append(tuple(seg))
    if total != rows:
        raise TokenLayoutError(f"{at}segments cover {total} rows, shape {list(shape)} has {rows}")
    layout = (tuple(shape), tuple(out))
    _check_unique(layout[1], at)
    return layout


def _ints(value: Any, name: str) -> list:
    """A tensor, array or sequence as a (nested) list of Python ints."""
    if value is None:
        return None
    if hasattr(value, "tolist"):
        if getattr(value, "is_floating_point", lambda: False)():
            raise TokenLayoutError(f"{name}: expected integers, got a floating-point tensor")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TokenLayoutError(f"{name}={value!r}: expected a sequence or tensor of ints")
    return list(value)


def _check_flat(values: list, name: str, *, bools: bool = False) -> None:
    for i, v in enumerate(values):
        if not (type(v) is int or (bools and type(v) is bool)) or not 0 <= v <= MAX_ID:
            raise TokenLayoutError(f"{name}[{i}] = {v!r}: expected a non-negative int up to 2^63-1")


def tokens(
    request_ids: Any = None,
    positions: Any = None,
    *,
    cu_seqlens: Any = None,
    seq_lens: Any = None,
    attention_mask: Any = None,
    shape: Any = None,
) -> TokenLayout:
    """The token layout of one pass, from the engine's (or the reference's) own tensors.

    Packed (an engine's ``[total_tokens, ...]``): give ``cu_seqlens`` or ``seq_lens`` (one
    length per sequence), ``request_ids`` one per sequence (default ``0, 1, ...``) and
    ``positions`` one per token (default: each sequence from position 0, a prefill); or,
    without lengths, ``request_ids`` and ``positions`` one per token. Padded (a reference's
    ``[batch, seq, ...]``): give ``attention_mask`` (``[batch, seq]``, 1 for a real token),
    ``request_ids`` one per batch row (default ``0, 1, ...``) and optionally ``positions``
    (``position_ids``, ``[batch, seq]``; default: the count of real tokens before each).

    Parameters
    ----------
    request_ids, positions, cu_seqlens, seq_lens, attention_mask : tensor or sequence of int
    shape : tuple of int, optional
        The leading dims of the pass's token-major tensors: ``(T,)`` by default when
        packed, ``(1, T)`` for an engine that keeps a batch dim of 1; padded runs use the
        mask's ``(batch, seq)``.

    Returns
    -------
    TokenLayout
        Pass it to ``dump.step(tokens=...)``.

    Raises
    ------
    TokenLayoutError
        Naming the argument: lengths that do not add up to the rows, a negative or
        non-integer id or position, a (request, position) given twice...

    Examples
    --------
    >>> tokens(request_ids=[3, 5], positions=[4, 0, 1, 2], cu_seqlens=[0, 1, 4], shape=(1, 4))
    TokenLayout(shape [1, 4]: r3@4, r5@0..2)
    """
    if attention_mask is not None:
        if cu_seqlens is not None or seq_lens is not None:
            raise TokenLayoutError("attention_mask describes a padded batch: give no cu_seqlens or seq_lens")
        req, pos, shape = _padded(request_ids, positions, attention_mask, shape)
    else:
        req, pos = _packed(request_ids, positions, cu_seqlens, seq_lens, shape)
        shape = (len(pos),) if shape is None else shape
    shape = tuple(_ints(shape, "shape"))
    _check_flat(list(shape), "shape")
    if not shape:
        raise TokenLayoutError("shape=(): give the leading dims of the token-major tensors, e.g. (T,)")
    if math.prod(shape) != len(pos):
        raise TokenLayoutError(
            f"shape {list(shape)} holds {math.prod(shape)} rows, but there are {len(pos)} tokens"
        )
    if not pos:
        raise TokenLayoutError("no tokens: a pass's layout needs at least one token row")
    segments: list[list] = []
    for r, p in zip(req, pos):
        last = segments[-1] if segments else None
        if last is not None and last[0] == r and (r is None or last[1] + last[2] == p):
            last[2] += 1
        else:
            segments.append([r, 0 if r is None else p, 1])
    try:
        return TokenLayout(shape, tuple(tuple(s) for s in segments))
    except TokenLayoutError as exc:
        raise TokenLayoutError(str(exc).replace("TokenLayout: ", "tokens(): ", 1)) from None


def _packed(request_ids, positions, cu_seqlens, seq_lens, shape) -> tuple[list, list]:
    if cu_seqlens is not None and seq_lens is not None:
        raise TokenLayoutError("give cu_seqlens or seq_lens, not both")
    lens = None
    if cu_seqlens is not None:
        cu = _ints(cu_seqlens, "cu_seqlens")
        _check_flat(cu, "cu_seqlens")
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise TokenLayoutError(f"cu_seqlens={cu[:8]}: expected 0 first, then non-decreasing offsets")
        lens = [b - a for a, b in zip(cu, cu[1:])]
    elif seq_lens is not None:
        lens = _ints(seq_lens, "seq_lens")
        _check_flat(lens, "seq_lens")
    pos = _ints(positions, "positions")
    req = _ints(request_ids, "request_ids")
    if lens is None:
        if req is None or pos is None:
            raise TokenLayoutError(
                "packed tokens: give cu_seqlens or seq_lens (with request_ids per sequence), or "
                "request_ids and positions per token"
            )
        if len(req) != len(pos):
            raise TokenLayoutError(
                f"request_ids has {len(req)} values, positions {len(pos)}: give one per token"
            )
        _check_flat(req, "request_ids")
        _check_flat(pos, "positions")
        return req, pos
    total = sum(lens)
    rows = math.prod(_ints(shape, "shape")) if shape is not None else MAX_ROWS
    if total > min(rows, MAX_ROWS):  # before a list of that many positions is made
        said = (
            "shape " + str(list(shape)) + f" holds {rows} rows"
            if shape is not None and rows <= MAX_ROWS
            else f"a pass holds {MAX_ROWS} at most"
        )
        raise TokenLayoutError(
            f"{'cu_seqlens' if cu_seqlens is not None else 'seq_lens'} give {total} tokens, but {said}"
        )
    req = list(range(len(lens))) if req is None else req
    if len(req) != len(lens):
        raise TokenLayoutError(
            f"request_ids has {len(req)} values for {len(lens)} sequences: give one per sequence"
        )
    _check_flat(req, "request_ids")
    if pos is None:
        pos = [p for n in lens for p in range(n)]
    if len(pos) != total:
        raise TokenLayoutError(f"positions has {len(pos)} values, the sequences hold {total} tokens")
    _check_flat(pos, "positions")
    return [r for r, n in zip(req, lens) for _ in range(n)], pos


def _padded(request_ids, positions, attention_mask, shape) -> tuple[list, list, tuple]:
    mask = _ints(attention_mask, "attention_mask")
    if not mask or not all(isinstance(row, list) for row in mask) or len({len(row) for row in mask}) != 1:
        raise TokenLayoutError("attention_mask: expected a [batch, seq] tensor of 0 and 1")
    b, s = len(mask), len(mask[0])
    flat = [v for row in mask for v in row]
    if any(v not in (0, 1) for v in flat):
        raise TokenLayoutError("attention_mask: expected 0 (pad) and 1 (token) only")
    if shape is not None and tuple(_ints(shape, "shape")) != (b, s):
        raise TokenLayoutError(f"shape {list(shape)}: a padded batch's rows are the mask's shape [{b}, {s}]")
    req = list(range(b)) if request_ids is None else _ints(request_ids, "request_ids")
    if len(req) != b:
        raise TokenLayoutError(f"request_ids has {len(req)} values for {b} batch rows: give one per row")
    _check_flat(req, "request_ids")
    if positions is None:
        pos_rows = []
        for row in mask:
            seen, out = 0, []
            for v in row:
                out.append(seen)
                seen += v
            pos_rows.append(out)
    else:
        pos_rows = _ints(positions, "positions")
        if len(pos_rows) != b or any(not isinstance(r, list) or len(r) != s for r in pos_rows):
            raise TokenLayoutError(f"positions: expected [batch, seq] = [{b}, {s}] like attention_mask")
        _check_flat([p for row, m in zip(pos_rows, mask) for p, v in zip(row, m) if v], "positions")
    out_req = [req[i] if mask[i][j] else None for i in range(b) for j in range(s)]
    out_pos = [pos_rows[i][j] if mask[i][j] else 0 for i in range(b) for j in range(s)]
    return out_req, out_pos, (b, s)


def _check_unique(segments: tuple, at: str) -> None:
    """A (request, position) in two rows of one pass is an error naming both rows (checked on
    the runs, sorted, never token by token)."""
    runs, row = [], 0
    for r, p, n in segments:
        runs.append((row, r, p, n))
        row += n
    found = sorted((r, p, n, row) for row, r, p, n in runs if r is not None)
    for (r0, p0, n0, row0), (r1, p1, _, row1) in zip(found, found[1:]):
        if r0 == r1 and p0 + n0 > p1:
            raise TokenLayoutError(f"{at}request {r0} position {p1} is in rows {row0 + p1 - p0} and {row1}")
