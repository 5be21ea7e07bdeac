"""Triton jit helpers shared by the stage kernels: round-to-nearest casts and the fp8 / int8
quantizers (byte-exact with :mod:`epmoe.reference`), and the launcher every stage uses.

A lower floor than every stage module: it imports only torch, triton and :mod:`epmoe.reference`.
"""

import triton
import triton.language as tl

from epmoe import reference
from epmoe._launch import _INTERPRET

_FP8_MAX = tl.constexpr(reference.FP8_MAX)
_INT8_MAX = tl.constexpr(reference.INT8_MAX)
_EPS = tl.constexpr(reference.SCALE_EPS)
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 to an integer
# The interpreter's own fp8 and bf16 casts do not round to nearest even (fp8 flushes subnormals,
# bf16 truncates), so there the rounding is done by hand; on the GPU the hardware casts
# (cvt.rn.satfinite / cvt.rn) are the ones torch's own casts use.
_MANUAL_RNE = tl.constexpr(_INTERPRET)


@triton.jit
def _fp8_rne(v):
    """Round float32 v (|v| <= 448) to the nearest float8_e4m3fn value, ties to even, in float32.

    The result is exactly representable, so the cast that follows is exact on every backend (the
    Triton interpreter's own cast flushes subnormals).
    """
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3: 3 mantissa bits, min normal 2**-6
    inv_quantum = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e)
    quantum = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
    r = ((tl.abs(v) * inv_quantum + _RNE_MAGIC) - _RNE_MAGIC) * quantum
    return tl.where(bits < 0, -r, r)  # sign bit, so -0.0 stays -0.0 as in torch's cast


@triton.jit
def round_float(v, DTYPE: tl.constexpr):
    """float32 v -> DTYPE with round-to-nearest-even (torch's cast).

    Under the interpreter bf16 is rounded with integer ops (its own bf16 cast truncates); on the
    GPU the cast is cvt.rn, the same bits.
    """
    if DTYPE == tl.bfloat16 and _MANUAL_RNE:
        bits = v.to(tl.int32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(v != v, v, r).to(tl.bfloat16)
    else:
        return v.to(DTYPE)


@triton.jit
def _quant_fp8_groups(x):
    """x float32 `[R, BLOCK_G]` (masked lanes 0) -> (q float8e4nv, s float32 `[R]`).

    q = x * (1 / s): one IEEE division per group, not per element (see reference.quantize_fp8).
    """
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _EPS)
    v = x * tl.math.div_rn(1.0, s)[:, None]
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    if _MANUAL_RNE:
        v = _fp8_rne(v)
    return v.to(tl.float8e4nv), s


@triton.jit
def _int8_scale(amax):
    return tl.maximum(tl.math.div_rn(amax, _INT8_MAX), _EPS)


@triton.jit
def _quant_int8(x, s):
    """round-half-away(x * (1 / s)) clamped to +-127, as int8 (x float32 `[BLOCK_M, N]`, s
    float32 `[BLOCK_M]`)."""
    v = x * tl.math.div_rn(1.0, s)[:, None]
    # v + copysign(0.5, v) is sign(v) * (|v| + 0.5) with the same float32 rounding, and the cast
    # truncates toward zero: sign(v) * floor(|v| + 0.5) in three instructions instead of six
    # (the clamp bounds are integers, so clamping before the truncation gives the same result)
    half = ((v.to(tl.int32, bitcast=True) & -2147483648) | 0x3F000000).to(tl.float32, bitcast=True)
    r = tl.minimum(tl.maximum(v + half, -_INT8_MAX), _INT8_MAX)
    return r.to(tl.int8)


@triton.jit
def _bad_rows(rows, R, ASSERT: tl.constexpr, MSG: tl.constexpr):
    """Mask of ``rows`` outside [0, R) other than -1 (the gather kernels' row check); with ASSERT
    (a debug=True build) asserts there are none, with message MSG. ``rows`` is loaded by the
    caller: torch.compile would see a pointer read in a jit helper as written."""
    bad = (rows < -1) | (rows >= R)
    if ASSERT:
        n_bad = tl.sum(bad.to(tl.int32), axis=0)
        tl.device_assert(n_bad == 0, MSG)
    return bad
