"""Context parallel's zigzag, per sequence when the token dim is packed (THD).

A dim tagged ``(cp,zigzag)`` is cut into ``2C`` chunks at ``C`` context-parallel ranks,
rank ``r`` holding chunks ``r`` and ``2C-1-r``. A packed token dim (``[total_tokens, h]``,
sequences end to end, Megatron's THD layout) is cut *per sequence*: every sequence is split
into ``2C`` chunks and rank ``r`` holds chunks ``r`` and ``2C-1-r`` of each, sequence after
sequence. Applied to the whole dim instead, identical data reads as a divergence.

The sequences come from each rank's token layout (``dump.step(tokens=...)``): a sequence is
a run of rows of one request (pad rows belong to the sequence before them). Every rank must
hold the same sequences, each an even number of rows; otherwise the reason says why.

Examples
--------
>>> from tdinspect.store.tokenlayout import tokens
>>> r0 = tokens(request_ids=[7, 8], seq_lens=[2, 4], positions=[0, 3, 0, 1, 6, 7])
>>> r1 = tokens(request_ids=[7, 8], seq_lens=[2, 4], positions=[1, 2, 2, 3, 4, 5])
>>> local_lengths([r0, r1])                   # request 7: 4 tokens, request 8: 8, at cp = 2
[2, 4]
>>> order([2], size=2)                        # (cp rank, first row, rows) in the logical order
[(0, 0, 1), (1, 0, 1), (1, 1, 1), (0, 1, 1)]
>>> merged_layout([r0, r1], [2, 4]).segments
((7, 0, 4), (8, 0, 8))
"""

from __future__ import annotations

from tdinspect.store.tokenlayout import TokenLayout


def sequences(layout: TokenLayout) -> list[tuple[int | None, int]]:
    """``(request, rows)`` of each sequence of a packed layout, in row order: consecutive rows of
    one request, pad rows (request ``None``) joined to the sequence before them."""
    out: list[list] = []
    for _, request, _, length in layout.runs():
        if out and (request is None or out[-1][0] in (request, None)):
            if out[-1][0] is None:  # leading pads: the first sequence's
                out[-1][0] = request
            out[-1][1] += length
        else:
            out.append([request, length])
    return [(r, n) for r, n in out]


def local_lengths(layouts: list[TokenLayout | None]) -> list[int] | str:
    """Each sequence's rows on one rank (the same on every rank, in cp rank order), or the reason
    the layouts do not describe a per-sequence zigzag: a rank without a layout, ranks holding
    different sequences, a sequence with an odd number of rows on a rank."""
    if any(layout is None for layout in layouts):
        return "a rank has no token layout"
    seqs = [sequences(layout) for layout in layouts]
    first = seqs[0]
    for r, s in enumerate(seqs[1:], 1):
        if s != first:
            return (
                f"cp ranks 0 and {r} hold different sequences ({_shown(first)} vs {_shown(s)}): "
                "a per-sequence zigzag has every sequence on every rank, the same number of rows each"
            )
    odd = [(req, n) for req, n in first if n % 2]
    if odd:
        return (
            f"request {odd[0][0]} has {odd[0][1]} rows on each cp rank, an odd number: a zigzag "
            "rank holds two equal chunks of every sequence"
        )
    return [n for _, n in first]


def _shown(seqs: list[tuple[int | None, int]]) -> str:
    text = ", ".join(f"r{req}: {n}" for req, n in seqs[:6])
    return text + (", ..." if len(seqs) > 6 else "")


def order(lengths: list[int], size: int) -> list[tuple[int, int, int]]:
    """``(cp rank, first row in that rank's shard, rows)`` of every chunk, in the logical order:
    sequence by sequence, chunks ``0 .. 2C-1`` (chunk ``k`` is rank ``k``'s first half for
    ``k < C``, else rank ``2C-1-k``'s second half)."""
    out, start = [], 0
    for n in lengths:
        half = n // 2
        for k in range(2 * size):
            rank, second = (k, 0) if k < size else (2 * size - 1 - k, 1)
            out.append((rank, start + second * half, half))
        start += n
    return out


def merged_layout(layouts: list[TokenLayout], lengths: list[int]) -> TokenLayout:
    """The logical (unsharded) pass's layout: each rank's rows put where :func:`order` puts them.

    The token dim is the layouts' last leading dim; their other leading dims (a batch of 1) are
    kept. :class:`~tdinspect.errors.DumpFormatError` when a (request, position) lands twice."""
    rows = [_rows(layout) for layout in layouts]
    merged = [rows[rank][start + i] for rank, start, n in order(lengths, len(layouts)) for i in range(n)]
    segments: list[list] = []
    for request, position in merged:
        last = segments[-1] if segments else None
        if last is not None and last[0] == request and (request is None or last[1] + last[2] == position):
            last[2] += 1
        else:
            segments.append([request, 0 if request is None else position, 1])
    shape = list(layouts[0].shape)
    shape[-1] = len(merged)
    return TokenLayout.from_json(
        {"shape": shape, "segments": segments}, f"the cp ranks' token layouts put together ({len(layouts)})"
    )


def _rows(layout: TokenLayout) -> list[tuple[int | None, int]]:
    return [
        (request, 0 if request is None else position + i)
        for _, request, position, length in layout.runs()
        for i in range(length)
    ]
