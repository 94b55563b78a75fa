"""The fused metric loop of :mod:`tdinspect.numerics.kernels`, compiled by numba, one kernel per codec.

Imported only when a pair is big enough for the compiled loop (numba is slow to load).
A codec says how the loop reads an element:

``"value"``
    float32/float64 arrays, widened to float64 in registers.
``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``
    unsigned-integer views of the raw bits, decoded in registers, then widened to float64:
    bfloat16 as a float32's top half (read two a 32-bit word); float16 and e5m2 (a
    float16's top byte) by the CPU's own conversion where :func:`has_f16c`; otherwise, and
    for e4m3fn, re-biased into a float32 in 32-bit lanes, zero and subnormals by one exact
    subtraction of two normals (no subnormal operand, so the flush-to-zero mode cannot
    change the result).
``"table"``
    raw bits looked up in a float64 table of every bit pattern (the other float8 formats).

Every decoding is exact: the kernels of one pair give the same numbers whatever the codec
that decoded it (tested over every bit pattern against torch's own conversion).

The loop (:func:`_loop`) keeps its 16 lanes of accumulators in registers (stack arrays, see
:func:`_lanes`), adds squares by fused multiply-add, and divides for ``max_rel`` only in the
rare blocks where a quotient may beat the largest so far (a bound checked by one
multiply-add an element; the result is bit for bit that of a division per element). It
runs at 2.5 G float32 and bfloat16 elements/s on one core of the development machine (1.6
for both before, when the stores of the accumulators and the divisions bound it; bfloat16
2.1 before it was read a word at a time).

Examples
--------
>>> import numpy as np
>>> k = compile_kernels(cache=False)["bfloat16"]
>>> one, two = np.full(16, 0x3F80, np.uint16), np.full(16, 0x4000, np.uint16)
>>> k(two, one, 0.0, 0.5, 1e-12, None)[4]  # max |x - y|
1.0
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

LANES = 16  # lanes of accumulators; 4 and 8 did not vectorise here, 16 and 32 ran alike
BLOCK = 1024  # elements between two looks at max_rel's filter (256: 5% slower)


def _minifloat(exp_bits: int, man_bits: int, ieee: bool):
    """An intrinsic decoding the bits of a small float (unsigned integer) to float64.

    ``ieee``: the top exponent is Inf/NaN (float16, e5m2); otherwise only the all-ones
    code is NaN and the top exponent holds numbers (e4m3fn).
    Written in LLVM IR so the arithmetic stays in 32-bit lanes (numba widens integer
    arithmetic to 64 bits, which halved the vector width).
    """
    bias = (1 << (exp_bits - 1)) - 1
    top = 1 + exp_bits + man_bits
    magnitude, shift = (1 << (top - 1)) - 1, 23 - man_bits
    exponent = ((1 << exp_bits) - 1) << 23  # of the shifted bits
    rebias = (127 - bias) << 23
    smallest_normal = 2.0 ** (1 - bias)

    @intrinsic
    def decode(typingctx, code):
        if not isinstance(code, types.Integer) or code.bitwidth > 16:
            return None

        def codegen(context, builder, signature, args):
            i32, f32 = ir.IntType(32), ir.FloatType()

            def c(v):
                return ir.Constant(i32, v)

            h = builder.zext(args[0], i32)
            u = builder.shl(builder.and_(h, c(magnitude)), c(shift))
            e = builder.and_(u, c(exponent))
            u = builder.add(u, c(rebias))
            if ieee:  # Inf/NaN: exponent to 255, payload kept
                special = builder.icmp_unsigned("==", e, c(exponent))
                u = builder.select(special, builder.add(u, c((128 - 1 - bias) << 23)), u)
            # zero/subnormal: 1.m · 2^(1-bias) minus 2^(1-bias), both normal, exact
            low = builder.fsub(
                builder.bitcast(builder.add(u, c(1 << 23)), f32), ir.Constant(f32, smallest_normal)
            )
            f = builder.select(builder.icmp_unsigned("==", e, c(0)), low, builder.bitcast(u, f32))
            if not ieee:
                nan = builder.icmp_unsigned("==", builder.and_(h, c(magnitude)), c(magnitude))
                f = builder.select(nan, ir.Constant(f32, float("nan")), f)
            sign = builder.shl(builder.and_(h, c(1 << (top - 1))), c(32 - top))
            f = builder.bitcast(builder.or_(builder.bitcast(f, i32), sign), f32)
            return builder.fpext(f, ir.DoubleType())

        return types.float64(code), codegen

    return decode


def _shifted(code_bits: int, width: int, shift: int, float_type):
    """An intrinsic reading ``code_bits``-bit codes as the top bits of a ``width``-bit float
    (``float_type``), widened to float64: bfloat16 is a float32's top half, float8_e5m2 a
    float16's top byte."""

    @intrinsic
    def decode(typingctx, code):
        if not isinstance(code, types.Integer) or code.bitwidth != code_bits:
            return None

        def codegen(context, builder, signature, args):
            iw = ir.IntType(width)
            bits = builder.shl(builder.zext(args[0], iw), ir.Constant(iw, shift)) if shift else args[0]
            return builder.fpext(builder.bitcast(bits, float_type), ir.DoubleType())

        return types.float64(code), codegen

    return decode


_bfloat16 = _shifted(16, 32, 16, ir.FloatType())


@intrinsic
def _word(typingctx, codes, i):
    """The 32 bits of ``codes`` (a contiguous 16-bit array) from element ``2·i``: elements
    ``2·i`` and ``2·i + 1`` in one load (the caller keeps ``2·i + 1`` inside the array). A
    strided array does not compile (its words are not its elements')."""
    if not (
        isinstance(codes, types.Array)
        and isinstance(codes.dtype, types.Integer)
        and codes.dtype.bitwidth == 16
        and codes.layout == "C"
        and isinstance(i, types.Integer)
    ):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        words = builder.bitcast(data, ir.IntType(32).as_pointer())
        return builder.load(builder.gep(words, [args[1]]), align=2)

    return types.uint32(codes, i), codegen


def _bfloat16_of_word(high: bool):
    """An intrinsic taking one bfloat16 of a :func:`_word` to float64: its low half moved up
    by one shift, its high half kept by one AND (the bits of a float32 either way, so exact
    as :data:`_bfloat16`). Which half is which element does not matter: both are read."""

    @intrinsic
    def decode(typingctx, word):
        if not isinstance(word, types.Integer) or word.bitwidth != 32:
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            bits = (
                builder.and_(args[0], ir.Constant(i32, 0xFFFF0000))
                if high
                else builder.shl(args[0], ir.Constant(i32, 16))
            )
            return builder.fpext(builder.bitcast(bits, ir.FloatType()), ir.DoubleType())

        return types.float64(word), codegen

    return decode


_bfloat16_low, _bfloat16_high = _bfloat16_of_word(False), _bfloat16_of_word(True)
# float16 and e5m2 by the CPU's own conversion (F16C's vcvtph2ps): only where has_f16c()
# (without it LLVM calls a runtime helper the JIT does not link)
_half = _shifted(16, 16, 0, ir.HalfType())
_e5m2_half = _shifted(8, 16, 8, ir.HalfType())
_float16 = _minifloat(5, 10, ieee=True)
_e4m3fn = _minifloat(4, 3, ieee=False)
_e5m2 = _minifloat(5, 2, ieee=True)


def _decoder(convert):
    """``decode(code, lut)`` for :func:`_loop` from an intrinsic of the code alone."""

    @numba.njit(inline="always")
    def decode(code, lut):
        return convert(code)

    return decode


@numba.njit(inline="always")
def _value(v, lut):
    return np.float64(v)


@numba.njit(inline="always")
def _lookup(code, lut):
    return lut[code]


(_decode_bfloat16, _decode_float16, _decode_half, _decode_e4m3fn, _decode_e5m2, _decode_e5m2_half) = (
    _decoder(f) for f in (_bfloat16, _float16, _half, _e4m3fn, _e5m2, _e5m2_half)
)


@intrinsic
def _lanes(typingctx, dtype):
    """A zeroed ``[LANES x dtype]`` on the stack, as a pointer (:func:`_zeros` makes it an
    array). Accumulators in numba's heap arrays stayed in memory (a store and a reload per
    element group: the stores were the loop's bottleneck); on the stack LLVM keeps them in
    registers."""
    if not isinstance(dtype, (types.DType, types.NumberClass)):
        return None
    nb = dtype.dtype

    def codegen(context, builder, signature, args):
        ty = ir.ArrayType(context.get_value_type(nb), LANES)
        arr = cgutils.alloca_once(builder, ty)
        builder.store(ir.Constant(ty, None), arr)
        return builder.bitcast(arr, context.get_value_type(nb).as_pointer())

    return types.CPointer(nb)(dtype), codegen


@intrinsic
def _muladd(typingctx, a, b, c):
    """``a * b + c``: one fused multiply-add where the CPU has one (``llvm.fmuladd``), else a
    product and a sum (no library call on CPUs without FMA)."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f64, [f64] * 3), "llvm.fmuladd.f64"
        )
        return builder.call(
            fn, [context.cast(builder, v, t, types.float64) for v, t in zip(args, signature.args)]
        )

    return types.float64(a, b, c), codegen


@numba.njit(inline="always")
def _zeros(dtype):
    return numba.carray(_lanes(dtype), LANES)


@numba.njit(inline="always")
def _floor_ratio(r, small):
    """The filter's threshold when the largest quotient so far is ``r``: a little below it
    (0 where ``r`` is tiny), see :func:`_loop`."""
    return r * (1.0 - 2.0**-50) if r >= small else 0.0


@numba.njit(inline="always")
def _lowest_bit(v):
    j = 0
    while not v & 1:
        v >>= 1
        j += 1
    return j


@numba.njit(inline="always")
def _popcount(v):
    c = 0
    while v:
        v &= v - 1
        c += 1
    return c


@numba.njit(inline="always")
def _element(xi, yi, low, rtol, atol, eps, sxx, syy, sdd, sab, mxa, hit, mis, count):
    """One element's share of its lane's sums, maxima, ``max_rel`` filter and mismatch count
    (of type ``count``): the lane's new values (scalars in and out: array arguments kept LLVM
    from vectorising)."""
    d = xi - yi
    ad = abs(d)
    ay = abs(yi)
    return (
        _muladd(xi, xi, sxx),
        _muladd(yi, yi, syy),
        _muladd(d, d, sdd),
        sab + ad,
        max(mxa, ad),
        max(hit, _muladd(low, max(ay, eps), ad)),
        mis + (count(1) if ad > atol + rtol * ay else count(0)),
    )


@numba.njit(inline="always")
def _elements(x, y, blk, end, lut, decode, low, rtol, atol, eps, sxx, syy, sdd, sab, mxa, hit, mis):
    """A block's elements: lane j takes elements ``blk + j + LANES·i``; the mismatch count in
    float64 lanes (exact below 2^53): a masked add, where int64 lanes cost a mask-to-vector
    move and a subtraction."""
    for start in range(blk, end, LANES):
        for j in range(LANES):
            sxx[j], syy[j], sdd[j], sab[j], mxa[j], hit[j], mis[j] = _element(
                decode(x[start + j], lut),
                decode(y[start + j], lut),
                low,
                rtol,
                atol,
                eps,
                sxx[j],
                syy[j],
                sdd[j],
                sab[j],
                mxa[j],
                hit[j],
                mis[j],
                np.float64,
            )


@numba.njit(inline="always")
def _bfloat16_pairs(x, y, blk, end, lut, decode, low, rtol, atol, eps, sxx, syy, sdd, sab, mxa, hit, mis):
    """A block of bfloat16 read as 32-bit words (:func:`_word`): lane j takes elements
    ``blk + 2·j + 2·LANES·i`` and the next. A shift or an AND makes float32s of 8 elements
    (a zero-extension and a shift did before: 10% of the loop); the lanes hold other
    elements than :func:`_elements` would give them, which changes only the order of the
    sums' terms (reassociated anyway). The mismatch count in int32 lanes (at most 2·BLOCK/LANES
    each), added to ``mis`` at the end: a vector subtraction of the compare's mask, 3-5% faster
    here than float64 lanes (float16 by F16C ran 3-4% slower with it: :func:`_elements` keeps
    float64)."""
    mic = _zeros(np.int32)  # zeroed at each call (the stack slot is the function's own)
    for start in range(blk >> 1, end >> 1, LANES):
        for j in range(LANES):
            wx, wy = _word(x, start + j), _word(y, start + j)
            sxx[j], syy[j], sdd[j], sab[j], mxa[j], hit[j], mic[j] = _element(
                _bfloat16_low(wx),
                _bfloat16_low(wy),
                low,
                rtol,
                atol,
                eps,
                sxx[j],
                syy[j],
                sdd[j],
                sab[j],
                mxa[j],
                hit[j],
                mic[j],
                np.int32,
            )
            sxx[j], syy[j], sdd[j], sab[j], mxa[j], hit[j], mic[j] = _element(
                _bfloat16_high(wx),
                _bfloat16_high(wy),
                low,
                rtol,
                atol,
                eps,
                sxx[j],
                syy[j],
                sdd[j],
                sab[j],
                mxa[j],
                hit[j],
                mic[j],
                np.int32,
            )
    for j in range(LANES):
        mis[j] += mic[j]


@numba.njit(inline="always")
def _loop(x, y, rtol, atol, eps, lut, decode, elements, spread, best):
    # Elements are taken to float64 in registers (as fast here as float32). LLVM vectorises
    # the fixed inner trip of LANES (the caller's length need not be a multiple).
    # ``elements`` runs a block (_elements, or _bfloat16_pairs with spread 2: lane j then
    # holds ``spread`` neighbours in each stretch of spread·LANES elements).
    #
    # max_rel without a division per element (a vdivpd was the costliest instruction): the
    # largest of the rounded quotients is the rounded quotient of the largest exact ratio,
    # and a quotient can raise the largest so far, r, only if ad/m > r (m = max(ay, eps)).
    # Each lane keeps z = max(ad - r'·m) over a block, r' = r·(1 - 2^-50) (0 when
    # r < 2^-1020/eps); where z > 0 (or NaN) the block is divided: all of it, vectorised,
    # when more than 3 lanes are (the first blocks), else those lanes element by element.
    # Never misses one: fl(ad/m) > r implies ad > r·m > r'·m exactly. Fused, z rounds the
    # exact ad - r'·m > (r - r')·m > 2^-51·r·m >= 2^-1071: positive. Unfused, fl(r'·m) <=
    # r'·m·(1 + 2^-53) < r·m < ad, and a difference of two floats never rounds to 0. One r
    # for all lanes: a lane's own maximum made the first blocks of a 64 KB pair slower than
    # dividing everything (each lane sets records for a while). The maxima are the numbers a
    # division of every element gives (tested bit for bit, on an FMA and a generic build).
    # ``best``: a max_rel already reached (0.0 for a pair; the rows before, for a row of
    # :func:`_rows`): the filter then skips what cannot beat it, and max_rel is the larger.
    n = x.shape[0]
    f8 = numba.float64
    sxx, syy, sdd, sab = _zeros(f8), _zeros(f8), _zeros(f8), _zeros(f8)
    mxa, mis, hit, mxr = _zeros(f8), _zeros(f8), _zeros(f8), _zeros(f8)
    # best: max_rel so far (the lanes' mxr, and the quotients divided one at a time)
    small = 2.0**-1020 / eps
    # whole blocks only: a last, shorter block (a variable bound) ran 9x slower
    whole = n - n % BLOCK
    for blk in range(0, whole, BLOCK):
        end = blk + BLOCK
        low = -_floor_ratio(best, small)
        for j in range(LANES):
            hit[j] = 0.0
        elements(x, y, blk, end, lut, decode, low, rtol, atol, eps, sxx, syy, sdd, sab, mxa, hit, mis)
        lanes = 0
        for j in range(LANES):  # unrolled: constant indices keep ``hit`` in registers
            lanes |= (0 if hit[j] <= 0.0 else 1) << j
        if not lanes:
            continue
        if _popcount(lanes) > 3:  # the first blocks: every quotient, vectorised
            for start in range(blk, end, LANES):
                for j in range(LANES):
                    xi = decode(x[start + j], lut)
                    yi = decode(y[start + j], lut)
                    mxr[j] = max(mxr[j], abs(xi - yi) / max(abs(yi), eps))
            for j in range(LANES):
                best = max(best, mxr[j])
            continue
        while lanes:  # a few lanes: their elements one at a time
            j = _lowest_bit(lanes)
            lanes &= lanes - 1
            for k in range(blk + spread * j, end, spread * LANES):
                yk = decode(y[k], lut)
                best = max(best, abs(decode(x[k], lut) - yk) / max(abs(yk), eps))
                if spread == 2:
                    yk = decode(y[k + 1], lut)
                    best = max(best, abs(decode(x[k + 1], lut) - yk) / max(abs(yk), eps))
    for k in range(whole, n):  # the < BLOCK-element tail (one call, no numpy tail)
        xi = decode(x[k], lut)
        yi = decode(y[k], lut)
        d = xi - yi
        ad = abs(d)
        ay = abs(yi)
        sxx[0] = _muladd(xi, xi, sxx[0])
        syy[0] = _muladd(yi, yi, syy[0])
        sdd[0] = _muladd(d, d, sdd[0])
        sab[0] += ad
        mxa[0] = max(mxa[0], ad)
        best = max(best, ad / max(ay, eps))
        mis[0] += 1.0 if ad > atol + rtol * ay else 0.0
    return (sxx.sum(), syy.sum(), sdd.sum(), sab.sum(), mxa.max(), max(best, mxr.max()), np.int64(mis.sum()))


# One entry point per codec, each a plain module-level function so numba's disk cache finds
# it again (a kernel built in a closure over its decoder missed the cache in every process).
def _fused_value(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _value, _elements, 1, 0.0)


def _fused_table(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _lookup, _elements, 1, 0.0)


def _fused_bfloat16(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_bfloat16, _bfloat16_pairs, 2, 0.0)


def _fused_float16(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_float16, _elements, 1, 0.0)


def _fused_half(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_half, _elements, 1, 0.0)


def _fused_e5m2_half(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_e5m2_half, _elements, 1, 0.0)


def _fused_e4m3fn(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_e4m3fn, _elements, 1, 0.0)


def _fused_e5m2(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_e5m2, _elements, 1, 0.0)


@numba.njit(inline="always")
def _rows(x, y, width, rtol, atol, eps, lut, decode, elements, spread):
    # each row of ``width`` elements summed by the loop of a pair (the same arithmetic), the
    # pair's sums added up row after row, and each row judged as it is summed (the worst row's
    # rel_diff, mean_abs, cosine, sqnr_db and mismatch, by metrics._from_sums' formulas: no
    # array of rows, no second pass). max_rel's bound carried from row to row, so a row does
    # not divide its first blocks again (the pair's max_rel is the last row's, the largest).
    best = 0.0
    sxx, syy, sdd, sab, mxa, mis = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    rel, mab, mms, cos = -1.0, -1.0, -1.0, 2.0
    qy, qd = 1.0, 0.0  # Σy², Σ(x-y)² of the row of least Σy²/Σ(x-y)² (sqnr_db), no log a row
    seen = False
    for r in range(x.shape[0] // width):
        a = r * width
        s = _loop(x[a : a + width], y[a : a + width], rtol, atol, eps, lut, decode, elements, spread, best)
        best = s[5]
        rx, ry, rd, rb, rm = s[0], s[1], s[2], s[3], np.float64(s[6])
        sxx += rx
        syy += ry
        sdd += rd
        sab += rb
        mxa = max(mxa, s[4])
        mis += rm
        mab = max(mab, rb / width)
        mms = max(mms, rm / width)
        if max(rx, ry) < 1e-250 and rd > 0:  # sums that underflowed: not this row's ratios
            continue
        den = rx + ry
        rel = max(rel, rd / den if den > 0 else 0.0)
        seen = True
        if rd > 0 and (qd == 0 or ry * (1.0 / rd) < qy * (1.0 / qd)):
            qy, qd = ry, rd
        if rx == 0 and ry == 0:
            cos = min(cos, 1.0)
        elif rx == 0 or ry == 0:
            cos = min(cos, 0.0)
        else:
            root = np.sqrt(rx) * np.sqrt(ry)
            if den <= 16 * root:  # else Σxy is to be summed directly: left out
                cos = min(cos, max(-1.0, min(1.0, (den - rd) / 2 / root)))
    sq = np.nan
    if seen:
        sq = np.inf if qd == 0 else 10.0 * (np.log10(qy) - np.log10(qd)) if qy > 0 else -np.inf
    return sxx, syy, sdd, sab, mxa, best, mis, rel, mab, cos, sq, mms


def _rows_value(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _value, _elements, 1)


def _rows_table(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _lookup, _elements, 1)


def _rows_bfloat16(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _decode_bfloat16, _bfloat16_pairs, 2)


def _rows_float16(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _decode_float16, _elements, 1)


def _rows_half(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _decode_half, _elements, 1)


def _rows_e5m2_half(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _decode_e5m2_half, _elements, 1)


def _rows_e4m3fn(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _decode_e4m3fn, _elements, 1)


def _rows_e5m2(x, y, width, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _rows(x, y, width, rtol, atol, eps, lut, _decode_e5m2, _elements, 1)


_ROWS = {
    "value": _rows_value,
    "table": _rows_table,
    "bfloat16": _rows_bfloat16,
    "float16": _rows_float16,
    "float8_e4m3fn": _rows_e4m3fn,
    "float8_e5m2": _rows_e5m2,
}


_ENTRIES = {
    "value": _fused_value,
    "table": _fused_table,
    "bfloat16": _fused_bfloat16,
    "float16": _fused_float16,
    "float8_e4m3fn": _fused_e4m3fn,
    "float8_e5m2": _fused_e5m2,
}


def has_f16c() -> bool:
    """Whether numba compiles for this very CPU and it converts half floats itself (F16C).

    A CPU named by ``NUMBA_CPU_NAME`` (a portable build) does not count: LLVM then lowered
    the conversion to a helper call that crashed the process (measured with ``generic``).
    """
    from llvmlite import binding
    from numba.core import config

    if config.CPU_NAME is not None:
        return False
    if config.CPU_FEATURES is not None:
        return "+f16c" in config.CPU_FEATURES.split(",")
    try:
        return bool(binding.get_host_cpu_features().get("f16c"))
    except RuntimeError:  # LLVM cannot tell
        return False


def compile_kernels(cache: bool = True, f16c: bool | None = None) -> dict:
    """``{codec: kernel}``; each kernel is compiled on its first call (from numba's disk cache
    when ``cache``) and called as ``kernel(x, y, rtol, atol, eps, lut)`` -> the seven sums.

    ``f16c``: decode float16 and float8_e5m2 (a float16's top byte) by the CPU's conversion
    (float16: 1.6 vs 1.0 G elements/s measured) rather than by bit arithmetic; default
    :func:`has_f16c`. Both are exact.

    error_model="numpy": no ZeroDivisionError check, which stops vectorisation. fastmath for
    reassociated sums (the lanes) only: without "arcp", "afn" and "contract", max_abs, max_rel
    and the mismatch count round exactly as the numpy backend's do, so the two agree bit for
    bit on them; without "nnan" and "ninf", a NaN/Inf element still makes the sums non-finite
    (the caller's signal). The sums of squares alone add each product by ``llvm.fmuladd``
    (one rounding instead of two where the CPU has FMA: 12-18% faster, never less accurate;
    their last bits then differ between an FMA CPU and a ``NUMBA_CPU_NAME=generic`` build,
    never between threads or processes on one machine). Raises ``RuntimeError`` when
    ``cache`` and no cache directory is writable.
    """
    options = dict(nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"}, cache=cache)
    entries = dict(_ENTRIES)
    if has_f16c() if f16c is None else f16c:
        entries["float16"], entries["float8_e5m2"] = _fused_half, _fused_e5m2_half
    return {codec: numba.njit(**options)(fn) for codec, fn in entries.items()}


def compile_row_kernels(cache: bool = True, f16c: bool | None = None) -> dict:
    """``{codec: kernel}`` of the loop row by row (:mod:`tdinspect.numerics.slices`): called as
    ``kernel(x, y, width, rtol, atol, eps, lut)``, it gives the pair's seven sums (its rows'
    added up, each row's by the arithmetic of :func:`compile_kernels`') and its worst row's
    ``rel_diff``, ``mean_abs``, ``cosine``, ``sqnr_db`` and ``mismatch`` (-1, 2 or NaN where
    no row has one). Options as for :func:`compile_kernels`."""
    options = dict(nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"}, cache=cache)
    entries = dict(_ROWS)
    if has_f16c() if f16c is None else f16c:
        entries["float16"], entries["float8_e5m2"] = _rows_half, _rows_e5m2_half
    return {codec: numba.njit(**options)(fn) for codec, fn in entries.items()}
