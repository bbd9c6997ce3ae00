"""Compiled (numba) fast path of the MXFP4 codec, bit-identical to the torch reference in ``mxfp4``.

Both entry points work on rows: contiguous CPU tensors ``[R, L]`` grouped in blocks of 32 along L (the
caller moves the grouped axis last). They return ``None`` when numba is unavailable or the tensor is not a
CPU tensor; the caller then runs the reference.

How it stays bit-identical without floating-point rounding steps: every value is handled as its float32
bit pattern. For non-negative floats, comparing bit patterns as integers compares values exactly, so the
reference's "compute ``|x| * 2**-e`` in float32, compare with the midpoints 0.25, 0.75, ..." becomes
"compare ``|x|``'s bits with the bits of ``midpoint * 2**e``" (exact: a midpoint has at most 3 significant
bits; a midpoint beyond the float32 range is bigger than any finite |x|, so it is clamped to Inf's bits).
The reference's float32 product is exact too, except below 2**-126 where both give code 0.

``mse`` sums each candidate's 32 squared errors in float64, element 0 to 31 in order, exactly like
:func:`glm_pack.packing.mxfp4.block_sq_error`, with no fused multiply-add (numba's default, no fastmath),
so both paths see the same sums and make the same strict-less choices.

JIT: compiled on first use and cached on disk (``NUMBA_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/glm-pack/numba``, default ``~/.cache/glm-pack/numba``), so a machine compiles once.
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import torch

try:  # any failure to load numba (missing, broken llvmlite, numpy mismatch) means: use the reference
    import numba
    from numba import njit, prange, types
    from numba.extending import intrinsic
except Exception:  # noqa: BLE001
    numba = None

MODE_IDS = {"even": 0, "floor": 1, "roundup": 2, "mse": 3}
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF


def cache_dir() -> str:
    """Directory for numba's on-disk cache of this module's kernels."""
    explicit = os.environ.get("NUMBA_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "glm-pack", "numba")


@contextlib.contextmanager
def _numba_cache_dir():
    """Point numba's cache at :func:`cache_dir` while our kernels are declared, then restore the setting.

    numba picks a function's cache location when it is decorated; restoring keeps other libraries' caches
    where their users expect them.
    """
    previous = numba.config.CACHE_DIR
    numba.config.CACHE_DIR = cache_dir()
    try:
        yield
    finally:
        numba.config.CACHE_DIR = previous


if numba is not None:

    @intrinsic
    def _bits_as_f32(typingctx, bits):
        """Reinterpret an int32 bit pattern as float32 (no conversion)."""
        sig = types.float32(types.int32)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.float32))

        return sig, codegen

    @njit(inline="always")
    def _midpoint_bits(biased, mantissa):
        """float32 bits of ``1.mantissa * 2**(biased-127)``: denormal below 2**-126, Inf's bits above the range."""
        if biased >= 255:
            return _INF_BITS
        if biased >= 1:
            return (biased << 23) | mantissa
        return (0x800000 | mantissa) >> (1 - biased)

    @njit(inline="always")
    def _thresholds(e):
        """Bits of the seven E2M1 rounding midpoints (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) times ``2**e``."""
        b = e + 127
        return (
            _midpoint_bits(b - 2, 0),
            _midpoint_bits(b - 1, 0x400000),
            _midpoint_bits(b, 0x200000),
            _midpoint_bits(b, 0x600000),
            _midpoint_bits(b + 1, 0x200000),
            _midpoint_bits(b + 1, 0x600000),
            _midpoint_bits(b + 2, 0x200000),
        )

    @njit(inline="always")
    def _magnitude_index(a, t):
        """E2M1 magnitude index 0..7 of finite ``|x|`` bits ``a``; ties go to the even index (> vs >=)."""
        return (
            (a > t[0]) + (a >= t[1]) + (a > t[2]) + (a >= t[3]) + (a > t[4]) + (a >= t[5]) + (a > t[6])
        )

    @njit(inline="always")
    def _exponent(amax, mode):
        """Unbiased block exponent from the finite amax bits for modes even / floor / roundup (and mse's start)."""
        if mode == 1:  # floor
            e = (amax >> 23) - 129
        elif mode == 2:  # roundup: +1 when the mantissa exceeds 1.5 (amax > 6 * 2**(floor(log2 amax) - 2))
            e = (amax >> 23) - 129 + ((amax & 0x7FFFFF) > 0x400000)
        else:  # even: round the mantissa to 1 bit first
            biased = ((amax + 0x200000) & _INF_BITS) >> 23
            e = 127 if biased == 255 else biased - 129
        return min(max(e, -127), 127)

    @njit(inline="always")
    def _load(src, i, shift):
        """Element ``i`` as float32 bits in an int64 (bf16 bits are the high half of float32 bits)."""
        return np.int64(src[i]) << shift

    @njit(inline="always")
    def _mse_exponent(src, base, shift, e):
        """Best of e, e+1, e-1 (clamped) by float64 squared error summed in element order; ties keep e."""
        ea, eb = min(e + 1, 127), max(e - 1, -127)
        t0, ta, tb = _thresholds(e), _thresholds(ea), _thresholds(eb)
        p0, pa, pb = math.ldexp(1.0, e), math.ldexp(1.0, ea), math.ldexp(1.0, eb)
        s0 = sa = sb = 0.0
        for j in range(32):
            a = _load(src, base + j, shift) & _ABS_MASK
            xf = np.float64(_bits_as_f32(np.int32(a)))
            d0 = xf - _E2M1_F64[_magnitude_index(a, t0)] * p0
            da = xf - _E2M1_F64[_magnitude_index(a, ta)] * pa
            db = xf - _E2M1_F64[_magnitude_index(a, tb)] * pb
            s0 += d0 * d0
            sa += da * da
            sb += db * db
        best, best_err = e, s0
        if sa < best_err:
            best, best_err = ea, sa
        if sb < best_err:
            best = eb
        return best

    @njit(inline="always")
    def _nonfinite_block(src, base, shift, codes, cbase):
        """A block holding NaN/Inf: exponent 127 (every mode), NaN -> +-0, Inf -> +-6; returns the bad count."""
        t = _thresholds(127)
        bad = 0
        for j in range(16):
            byte = 0
            for half in range(2):
                v = _load(src, base + 2 * j + half, shift)
                a = v & _ABS_MASK
                if a > _INF_BITS:
                    idx = 0
                elif a == _INF_BITS:
                    idx = 7
                else:
                    idx = _magnitude_index(a, t)
                bad += a >= _INF_BITS
                byte |= (idx | (((v >> 31) & 1) << 3)) << (4 * half)
            codes[cbase + j] = byte
        return bad

    def _quantize_kernel_py(src, shift, mode, codes, scales):
        """src: flat float32 (shift 0, uint32) or bf16 (shift 16, uint16) bits, 32 per block; returns #NaN/Inf."""
        n_bad = 0
        for b in prange(scales.size):
            base, cbase = 32 * b, 16 * b
            amax = 0
            for j in range(32):
                amax = max(amax, _load(src, base + j, shift) & _ABS_MASK)
            if amax >= _INF_BITS:
                n_bad += _nonfinite_block(src, base, shift, codes, cbase)
                scales[b] = 254
                continue
            e = _exponent(amax, mode)
            if mode == 3:
                e = _mse_exponent(src, base, shift, e)
            scales[b] = e + 127
            t = _thresholds(e)
            for j in range(16):
                lo = _load(src, base + 2 * j, shift)
                hi = _load(src, base + 2 * j + 1, shift)
                nib_lo = _magnitude_index(lo & _ABS_MASK, t) | (((lo >> 31) & 1) << 3)
                nib_hi = _magnitude_index(hi & _ABS_MASK, t) | (((hi >> 31) & 1) << 3)
                codes[cbase + j] = nib_lo | (nib_hi << 4)
        return n_bad

    def _dequantize_kernel_py(codes, scales, out):
        """codes: flat u8 (16 per block), scales: u8 per block -> out float32, 32 per block."""
        for b in prange(scales.size):
            s = _SCALE_F32[scales[b]]
            for j in range(16):
                c = codes[16 * b + j]
                out[32 * b + 2 * j] = _CODE_F32[c & 15] * s
                out[32 * b + 2 * j + 1] = _CODE_F32[c >> 4] * s

    _E2M1_F64 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
    _CODE_F32 = np.concatenate([_E2M1_F64, -_E2M1_F64]).astype(np.float32)  # index = 4-bit code
    # E8M0 byte -> 2**(byte-127) as float32 (byte 0 is the denormal 2**-127), byte 255 -> NaN.
    _SCALE_F32 = np.array(
        [2.0 ** (i - 127) for i in range(255)] + [float("nan")], dtype=np.float64
    ).astype(np.float32)

    with _numba_cache_dir():
        _quantize_kernel = njit(parallel=True, cache=True)(_quantize_kernel_py)
        _dequantize_kernel = njit(parallel=True, cache=True)(_dequantize_kernel_py)


def available() -> bool:
    """True when the compiled path can run (numba imported)."""
    return numba is not None


def _usable(*tensors: torch.Tensor) -> bool:
    return numba is not None and all(t.device.type == "cpu" for t in tensors)


def quantize_rows(rows: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Float rows ``[R, L]`` (L % 32 == 0) -> (codes ``[R, L/2]``, scales ``[R, L/32]``, #NaN/Inf), or None.

    bf16 and float32 are read as raw bits; other float dtypes are converted to float32 first.
    """
    if not _usable(rows):
        return None
    if rows.dtype == torch.bfloat16:
        src, shift = rows.contiguous().view(torch.int16).numpy().view(np.uint16), 16
    else:
        src, shift = rows.to(torch.float32).contiguous().view(torch.int32).numpy().view(np.uint32), 0
    n_rows, length = rows.shape
    codes = torch.empty(n_rows, length // 2, dtype=torch.uint8)
    scales = torch.empty(n_rows, length // 32, dtype=torch.uint8)
    n_bad = _quantize_kernel(src.reshape(-1), shift, MODE_IDS[mode], codes.view(-1).numpy(), scales.view(-1).numpy())
    return codes, scales, int(n_bad)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """uint8 codes ``[R, n]`` and scales ``[R, n/16]`` -> float32 ``[R, 2n]``, or None."""
    if not _usable(codes, scales):
        return None
    out = torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)
    _dequantize_kernel(
        codes.contiguous().view(-1).numpy(), scales.contiguous().view(-1).numpy(), out.view(-1).numpy()
    )
    return out
