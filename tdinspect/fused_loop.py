"""The fused metric loop of :mod:`tdinspect.kernels`, compiled by numba, one kernel per codec.

Imported only when a pair is big enough for the compiled loop (numba is slow to load).
A codec says how the loop reads an element:

``"value"``
    float32/float64 arrays, widened to float64 in registers.
``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``
    unsigned-integer views of the raw bits, decoded in registers, then widened to float64:
    bfloat16 as a float32's top half; float16 and e5m2 (a float16's top byte) by the CPU's
    own conversion where :func:`has_f16c`; otherwise, and for e4m3fn, re-biased into a
    float32 in 32-bit lanes, zero and subnormals by one exact subtraction of two normals (no
    subnormal operand, so the flush-to-zero mode cannot change the result).
``"table"``
    raw bits looked up in a float64 table of every bit pattern (the other float8 formats).

Every decoding is exact: the kernels of one pair give the same numbers whatever the codec
that decoded it (tested over every bit pattern against torch's own conversion).

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
from numba.core.extending import intrinsic

LANES = 16  # lanes of accumulators; 4 and 8 did not vectorise here, 16 and 32 ran alike


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
            low = builder.fsub(builder.bitcast(builder.add(u, c(1 << 23)), f32),
                               ir.Constant(f32, smallest_normal))
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
            bits = builder.shl(builder.zext(args[0], iw), ir.Constant(iw, shift)) if shift \
                else args[0]
            return builder.fpext(builder.bitcast(bits, float_type), ir.DoubleType())

        return types.float64(code), codegen

    return decode


_bfloat16 = _shifted(16, 32, 16, ir.FloatType())
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


(_decode_bfloat16, _decode_float16, _decode_half, _decode_e4m3fn, _decode_e5m2,
 _decode_e5m2_half) = (
    _decoder(f) for f in (_bfloat16, _float16, _half, _e4m3fn, _e5m2, _e5m2_half))


@numba.njit(inline="always")
def _loop(x, y, rtol, atol, eps, lut, decode):
    # Elements are taken to float64 in registers (as fast here as float32). The caller
    # passes a multiple of LANES, but LLVM vectorises only when the bound says so itself
    # (8.9 vs 1.5 GB/s measured), as does the fixed inner trip. The tail repeats the body on
    # purpose: one inline helper for both stopped the vectorising (1.58 -> 0.41 G elements/s).
    n = x.shape[0]
    sxx, syy, sdd, sab = np.zeros(LANES), np.zeros(LANES), np.zeros(LANES), np.zeros(LANES)
    mxa, mxr, mis = np.zeros(LANES), np.zeros(LANES), np.zeros(LANES, np.int64)
    whole = n - n % LANES
    for start in range(0, whole, LANES):
        for j in range(LANES):
            xi = decode(x[start + j], lut)
            yi = decode(y[start + j], lut)
            d = xi - yi
            ad = abs(d)
            ay = abs(yi)
            sxx[j] += xi * xi
            syy[j] += yi * yi
            sdd[j] += d * d
            sab[j] += ad
            mxa[j] = max(mxa[j], ad)
            mxr[j] = max(mxr[j], ad / max(ay, eps))
            mis[j] += 1 if ad > atol + rtol * ay else 0
    for k in range(whole, n):  # the < 16-element tail (one call, no numpy tail)
        xi = decode(x[k], lut)
        yi = decode(y[k], lut)
        d = xi - yi
        ad = abs(d)
        ay = abs(yi)
        sxx[0] += xi * xi
        syy[0] += yi * yi
        sdd[0] += d * d
        sab[0] += ad
        mxa[0] = max(mxa[0], ad)
        mxr[0] = max(mxr[0], ad / max(ay, eps))
        mis[0] += 1 if ad > atol + rtol * ay else 0
    return sxx.sum(), syy.sum(), sdd.sum(), sab.sum(), mxa.max(), mxr.max(), mis.sum()


# One entry point per codec, each a plain module-level function so numba's disk cache finds
# it again (a kernel built in a closure over its decoder missed the cache in every process).
def _fused_value(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _value)


def _fused_table(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _lookup)


def _fused_bfloat16(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_bfloat16)


def _fused_float16(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_float16)


def _fused_half(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_half)


def _fused_e5m2_half(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_e5m2_half)


def _fused_e4m3fn(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_e4m3fn)


def _fused_e5m2(x, y, rtol, atol, eps, lut):  # pragma: no cover - compiled
    return _loop(x, y, rtol, atol, eps, lut, _decode_e5m2)


_ENTRIES = {"value": _fused_value, "table": _fused_table, "bfloat16": _fused_bfloat16,
            "float16": _fused_float16, "float8_e4m3fn": _fused_e4m3fn, "float8_e5m2": _fused_e5m2}


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
    (the caller's signal). Raises ``RuntimeError`` when ``cache`` and no cache directory is
    writable.
    """
    options = dict(nogil=True, error_model="numpy", fastmath={"reassoc", "nsz"}, cache=cache)
    entries = dict(_ENTRIES)
    if has_f16c() if f16c is None else f16c:
        entries["float16"], entries["float8_e5m2"] = _fused_half, _fused_e5m2_half
    return {codec: numba.njit(**options)(fn) for codec, fn in entries.items()}
