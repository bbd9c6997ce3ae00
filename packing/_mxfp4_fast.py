"""Compiled (numba) fast path of the MXFP4 codec, bit-identical to the torch reference in ``mxfp4``.

Both entry points work on rows: contiguous CPU tensors ``[R, L]`` grouped in blocks of 32 along L (the
caller moves the grouped axis last). They return ``None`` when numba is unavailable or a tensor is not on
the CPU; the caller then runs the reference.

Bit identity without floating-point rounding steps: every value is handled as its float32 bit pattern.
For non-negative floats, comparing bit patterns as integers compares values exactly, so the reference's
"compute ``|x| * 2**-e`` in float32, compare with the midpoints 0.25, 0.75, ..." becomes "compare |x|'s
bits with the bits of ``midpoint * 2**e``" (exact: a midpoint has at most 3 significant bits; one beyond
the float32 range exceeds every finite |x|, so it is clamped to Inf's bits). The reference's float32
product is exact too, except below 2**-126, where both give code 0.

``mse`` computes squared errors in float64 and sums them in the fixed order of
:func:`glm_pack.packing.mxfp4.block_sq_error`, with no fused multiply-add (numba's default without
fastmath), so both paths see the same sums and make the same strict-less choices. It skips work that
cannot change the choice; :func:`_mse_block` gives the reasons.

Kernels are serial, release the GIL and run on a few Python threads, each over a range of blocks (numba's
``parallel=True`` doubled the compile time and its thread pool costs milliseconds per call on a busy
machine). bf16 input is read as its uint16 bits, anything else as float32 (uint32) bits: two compiled
signatures, each compiled on first use (about 5 s of CPU) and cached on disk (``NUMBA_CACHE_DIR`` if set,
else ``$XDG_CACHE_HOME/glm-pack/numba``, default ``~/.cache/glm-pack/numba``), so a machine compiles once.
"""

from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

try:  # any failure to load numba (missing, broken llvmlite, numpy mismatch) means: use the reference
    import numba
    import numpy as np
    from numba import njit, types
    from numba.extending import intrinsic
except Exception:  # noqa: BLE001
    numba = None

MODE_IDS = {"even": 0, "floor": 1, "roundup": 2, "mse": 3}
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_BLOCKS_PER_THREAD = 4096  # fewer blocks per thread than this: fewer threads (down to the caller alone)
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


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
    def _load(src, i, shift):
        """Element ``i`` as float32 bits in an int64: ``src`` holds float32 bits (uint32, shift 0) or bf16
        bits (uint16, shift 16: the high half of the float32 bits)."""
        return np.int64(src[i]) << shift

    @njit(inline="always")
    def _value(a):
        """float64 value of non-negative float32 bits ``a``."""
        return np.float64(_bits_as_f32(np.int32(a)))

    @njit(inline="always")
    def _midpoint_bits(biased, mantissa):
        """float32 bits of ``1.mantissa * 2**(biased-127)``: denormal below 2**-126, Inf's bits past the range."""
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
        return (a > t[0]) + (a >= t[1]) + (a > t[2]) + (a >= t[3]) + (a > t[4]) + (a >= t[5]) + (a > t[6])

    @njit(inline="always")
    def _magnitude(a, t):
        """The E2M1 magnitude (float64) that :func:`_magnitude_index` selects, as a sum of its grid steps."""
        return (
            0.5 * ((a > t[0]) + (a >= t[1]) + (a > t[2]) + (a >= t[3])) + ((a > t[4]) + (a >= t[5])) + 2.0 * (a > t[6])
        )

    @njit(inline="always")
    def _encode(v, t):
        """4-bit code of finite float32 bits ``v`` (sign bit 3, also for -0.0)."""
        return _magnitude_index(v & _ABS_MASK, t) | (((v >> 31) & 1) << 3)

    @njit(inline="always")
    def _sq_error(v, t, p):
        """float64 squared error of finite float32 bits ``v`` quantized with thresholds ``t``, scale ``p``."""
        a = v & _ABS_MASK
        d = _value(a) - _magnitude(a, t) * p
        return d * d

    @njit(inline="always")
    def _lane_sum(sq):
        """Sum of 32 float64 in the codec's fixed order: lane k = sq[k] + sq[k+4] + ... + sq[k+28] in order,
        then (lane0 + lane1) + (lane2 + lane3); the order of ``mxfp4.block_sq_error``."""
        l0 = l1 = l2 = l3 = 0.0
        for i in range(0, 32, 4):
            l0 += sq[i]
            l1 += sq[i + 1]
            l2 += sq[i + 2]
            l3 += sq[i + 3]
        return (l0 + l1) + (l2 + l3)

    @njit(inline="always")
    def _exponent(amax, mode):
        """Unbiased block exponent for the finite amax bits: even (also mse's start), floor or roundup."""
        if mode == 1:  # floor
            e = (amax >> 23) - 129
        elif mode == 2:  # roundup: +1 when the mantissa exceeds 1.5 (amax > 6 * 2**(floor(log2 amax) - 2))
            e = (amax >> 23) - 129 + ((amax & 0x7FFFFF) > 0x400000)
        else:  # even: round the mantissa to 1 bit first
            biased = ((amax + 0x200000) & _INF_BITS) >> 23
            e = 127 if biased == 255 else biased - 129
        return min(max(e, -127), 127)

    @njit(inline="always")
    def _encode_block(src, base, shift, e, codes, cbase):
        t = _thresholds(e)
        for j in range(16):
            lo, hi = _load(src, base + 2 * j, shift), _load(src, base + 2 * j + 1, shift)
            codes[cbase + j] = _encode(lo, t) | (_encode(hi, t) << 4)

    @njit(inline="always")
    def _mse_block(src, base, shift, amax, codes, cbase, sq):
        """Encode one block in mode mse; returns its exponent. ``sq`` is float64 scratch of 32.

        Same choice as the reference (best of e, e+1, e-1 by squared error, strict less, e = even rule),
        with less work:

        * e+1 is never strictly better: under the even rule every |x| / 2**e < 7, and there the e+1 grid
          {0, 1, 2, 3, 4, 6, 8, 12} * 2**e has no point nearer than the e grid {0, .5, ..., 4, 6} * 2**e
          (8 is farther than 6), so each error, its rounded square and each rounded partial sum are >= e's.
        * e-1 is only evaluated when it can win: if amax > 3 * 2**e, amax saturates to 3 * 2**e there and
          its rounded squared error alone bounds e-1's sum from below (sums of non-negative terms only grow).
        """
        e = _exponent(amax, 0)
        t, p = _thresholds(e), math.ldexp(1.0, e)
        for j in range(16):
            lo, hi = _load(src, base + 2 * j, shift), _load(src, base + 2 * j + 1, shift)
            codes[cbase + j] = _encode(lo, t) | (_encode(hi, t) << 4)
            sq[2 * j], sq[2 * j + 1] = _sq_error(lo, t, p), _sq_error(hi, t, p)
        s_e = _lane_sum(sq)
        down = e - 1
        if down < -127:
            return e
        d = _value(amax) - 3.0 * p
        if d > 0 and d * d >= s_e:
            return e
        t, p = _thresholds(down), math.ldexp(1.0, down)
        for j in range(32):
            sq[j] = _sq_error(_load(src, base + j, shift), t, p)
        if _lane_sum(sq) < s_e:
            _encode_block(src, base, shift, down, codes, cbase)
            return down
        return e

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
                code = _encode(v, t)
                if a > _INF_BITS:
                    code &= 8
                elif a == _INF_BITS:
                    code |= 7
                bad += a >= _INF_BITS
                byte |= code << (4 * half)
            codes[cbase + j] = byte
        return bad

    @njit(inline="always")
    def _block_amax_bits(src, base, shift):
        amax = 0
        for j in range(32):
            amax = max(amax, _load(src, base + j, shift) & _ABS_MASK)
        return amax

    def _quantize_kernel_py(src, codes, scales, shift, mode):
        """Blocks of 32 elements of ``src`` (see :func:`_load`) -> codes (16 bytes per block) and scale bytes,
        for the closed-form modes (even, floor, roundup); returns the number of NaN/Inf elements met. (mse has
        its own kernel: compiling it only when used keeps a cold start short.)"""
        n_bad = 0
        for b in range(scales.size):
            base, cbase = 32 * b, 16 * b
            amax = _block_amax_bits(src, base, shift)
            if amax >= _INF_BITS:
                n_bad += _nonfinite_block(src, base, shift, codes, cbase)
                scales[b] = 254
            else:
                e = _exponent(amax, mode)
                _encode_block(src, base, shift, e, codes, cbase)
                scales[b] = e + 127
        return n_bad

    def _quantize_mse_kernel_py(src, codes, scales, shift, mode):
        """As :func:`_quantize_kernel_py` for mode mse (``mode`` is unused)."""
        n_bad = 0
        sq = np.empty(32)
        for b in range(scales.size):
            base, cbase = 32 * b, 16 * b
            amax = _block_amax_bits(src, base, shift)
            if amax >= _INF_BITS:
                n_bad += _nonfinite_block(src, base, shift, codes, cbase)
                scales[b] = 254
            else:
                scales[b] = _mse_block(src, base, shift, amax, codes, cbase, sq) + 127
        return n_bad

    def _dequantize_kernel_py(codes, scales, out):
        """Blocks: codes (16 bytes per block) and scale bytes -> out float32, 32 per block."""
        for b in range(scales.size):
            s = _SCALE_F32[scales[b]]
            for j in range(16):
                c = codes[16 * b + j]
                out[32 * b + 2 * j] = _CODE_F32[c & 15] * s
                out[32 * b + 2 * j + 1] = _CODE_F32[c >> 4] * s
        return 0

    _E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    _CODE_F32 = np.concatenate([_E2M1, -_E2M1]).astype(np.float32)  # index: the 4-bit code
    # E8M0 byte -> 2**(byte-127) as float32 (byte 0 is the denormal 2**-127), byte 255 -> NaN.
    _SCALE_F32 = np.array([2.0 ** (i - 127) for i in range(255)] + [float("nan")]).astype(np.float32)

    with _numba_cache_dir():
        _quantize_kernel = njit(nogil=True, cache=True)(_quantize_kernel_py)
        _quantize_mse_kernel = njit(nogil=True, cache=True)(_quantize_mse_kernel_py)
        _dequantize_kernel = njit(nogil=True, cache=True)(_dequantize_kernel_py)


def _forget_pool() -> None:
    """A forked child inherits the pool object but not its threads: start a new one there when needed."""
    global _pool, _pool_size
    _pool, _pool_size = None, 0


os.register_at_fork(after_in_child=_forget_pool)


def _run_split(kernel, n_blocks: int, blocked: tuple, scalars: tuple) -> int:
    """``kernel(*block_slices, *scalars)`` over ``[0, n_blocks)``, split into ranges across up to torch's
    thread count (the caller runs the first). ``blocked`` holds (flat array, elements per block) pairs;
    returns the sum of the kernel results."""
    global _pool, _pool_size
    n = max(1, min(torch.get_num_threads(), n_blocks // _BLOCKS_PER_THREAD))
    bounds = [n_blocks * i // n for i in range(n + 1)]

    def args(i):
        lo, hi = bounds[i], bounds[i + 1]
        return [a[w * lo : w * hi] for a, w in blocked] + list(scalars)

    if n == 1:
        return kernel(*args(0))
    if _pool_size < n - 1:
        _pool, _pool_size = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="glm-pack-mxfp4"), n - 1
    futures = [_pool.submit(kernel, *args(i)) for i in range(1, n)]
    return kernel(*args(0)) + sum(f.result() for f in futures)


def available() -> bool:
    """True when the compiled path can run (numba imported)."""
    return numba is not None


def _usable(*tensors: torch.Tensor) -> bool:
    return available() and all(t.device.type == "cpu" for t in tensors)


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
    blocked = ((src.reshape(-1), 32), (codes.view(-1).numpy(), 16), (scales.view(-1).numpy(), 1))
    kernel = _quantize_mse_kernel if mode == "mse" else _quantize_kernel
    n_bad = _run_split(kernel, scales.numel(), blocked, (shift, MODE_IDS[mode]))
    return codes, scales, int(n_bad)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """uint8 codes ``[R, n]`` and scales ``[R, n/16]`` -> float32 ``[R, 2n]``, or None."""
    if not _usable(codes, scales):
        return None
    out = torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)
    blocked = (
        (codes.contiguous().view(-1).numpy(), 16),
        (scales.contiguous().view(-1).numpy(), 1),
        (out.view(-1).numpy(), 32),
    )
    _run_split(_dequantize_kernel, scales.numel(), blocked, ())
    return out
