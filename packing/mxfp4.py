"""MXFP4 (OCP microscaling FP4) codec: E2M1 element codes plus one E8M0 scale byte per 32 elements.

Layout of the outputs, for an input ``x`` of shape ``[..., L, ...]`` grouped along ``axis`` (L % 32 == 0):

* ``codes``: uint8, shape of ``x`` with ``L -> L/2``; element ``2i`` in the low nibble, ``2i+1`` in
  the high nibble. Nibble = sign bit (bit 3) | index into E2M1 magnitudes ``[0, .5, 1, 1.5, 2, 3, 4, 6]``.
* ``scales``: uint8 E8M0, shape of ``x`` with ``L -> L/32``; value ``2**(byte - 127)``.

Scale modes (``notes/mxfp4.md``): ``even`` (AMD Quark / aiter Triton), ``floor`` (OCP text), ``roundup``
(the smallest power of two >= amax/6; aiter's RoundUp, HIP and torch reference, differs only for
amax <= 6 * 2**-127, where it writes byte 1 and this byte 0) and ``mse`` (best of e-1, e, e+1 around the even
choice, per block; equal errors keep e, then prefer e+1 over e-1).
Elements round to nearest with ties to the even code and saturate at 6; the sign bit is kept (-0.0 and
negatives rounding to zero give code 8).

``even`` is bit-exact with aiter's Triton ``_mxfp4_quant_op`` (checked against ROCm/aiter e4048607,
``aiter/ops/triton/_triton_kernels/quant/quant.py``): ``(bits(amax) + 0x200000) & 0xFF800000``, then
``floor(log2) - 2`` clamped to [-127, 127]; an all-zero block and a block whose amax is denormal both get
-127 (byte 0); an amax whose rounding overflows to Inf (>= 1.75 * 2**127) gets 127; elements scaled by
``2**-e`` in float32 round to nearest, ties to even, saturating at 6.

A block holding NaN/Inf (only reachable with ``check_finite_input=False``) gets exponent 127 in every
mode; Inf elements become +-6 and NaN +-0. For Inf that is aiter's even rule too; for NaN it is a deliberate
difference: aiter's ``tl.max`` leaves NaN out of amax, so its block keeps the scale of its finite elements and the
NaN becomes +-1.5.

This module holds the public API and the obvious vectorised torch reference; ``_mxfp4_fast`` holds the
compiled (numba) fast path, which agrees with the reference bit for bit and is used for CPU tensors when
numba is importable.
"""

from __future__ import annotations

import math

import torch

from .errors import FormatError, NonFiniteError

BLOCK = 32
MODES = ("even", "floor", "roundup", "mse")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_BIAS = 127
EXP_MIN, EXP_MAX = -127, 127

# Midpoints between neighbouring E2M1 magnitudes; a tie goes to the even code (0.25->0, 0.75->1.0, ...).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def _check_float(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise FormatError(f"MXFP4 quantize needs a floating-point tensor, got {getattr(x, 'dtype', type(x))}")


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise FormatError(f"axis {axis} out of range for a tensor with {ndim} dims")
    return axis % ndim


def check_finite(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise :class:`NonFiniteError` with the count and the first index of NaN/Inf elements in ``x`` (any float
    dtype: fp8, which torch cannot sum or test, is widened first)."""
    if x.dtype.itemsize == 1:
        x = x.float()
    if bool(torch.isfinite(x.sum())):  # fast path (one reduction): any NaN/Inf makes the sum NaN/Inf
        return
    bad = ~torch.isfinite(x)  # the sum may also have overflowed on finite values: count exactly
    n_bad = int(bad.sum())
    if n_bad:
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        n_nan = int(torch.isnan(x).sum())
        raise NonFiniteError(
            f"{what} holds {n_bad} non-finite value(s) ({n_nan} NaN, {n_bad - n_nan} Inf); first at index {first}"
        )


def check_scale_bytes(scales: torch.Tensor, what: str = "E8M0 scale (byte 0xFF is NaN)") -> None:
    """Raise :class:`NonFiniteError` with the count and first index of E8M0 NaN bytes (0xFF) in u8 ``scales``
    (a byte comparison: no decoding)."""
    bad = scales == 0xFF
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise NonFiniteError(f"{what} holds {int(bad.sum())} NaN byte(s); first at index {first}")


def even_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Unbiased block exponent under the even rule: round amax's mantissa to 1 bit, floor(log2) - 2."""
    bits = amax.view(torch.int32).to(torch.int64)
    rounded = (bits + 0x200000) & 0xFF800000
    biased = rounded >> 23  # 0 for zero/denormal-rounded-to-zero, 255 when rounding overflowed to inf
    e = torch.where(biased == 255, torch.full_like(biased, EXP_MAX), biased - 127 - 2)
    return e.clamp(EXP_MIN, EXP_MAX).to(torch.int32)


def floor_exponent(amax: torch.Tensor) -> torch.Tensor:
    """OCP rule: floor(log2 amax) - 2 (zero and denormal amax clamp to -127; NaN/Inf give 127)."""
    biased = (amax.view(torch.int32) >> 23).to(torch.int64)
    e = torch.where(biased == 255, torch.full_like(biased, EXP_MAX), biased - 127 - 2)
    return e.clamp(EXP_MIN, EXP_MAX).to(torch.int32)


def roundup_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with 6 * 2**e >= amax, computed exactly from frexp (amax = m * 2**E, m in [0.5, 1)).

    Zero amax gives -127, NaN/Inf give 127.
    """
    mantissa, exponent = torch.frexp(amax)
    e = exponent.to(torch.int64) - 3 + (mantissa > 0.75).to(torch.int64)
    e = torch.where(amax == 0, torch.full_like(e, EXP_MIN), e)
    e = torch.where(torch.isfinite(amax), e, torch.full_like(e, EXP_MAX))
    return e.clamp(EXP_MIN, EXP_MAX).to(torch.int32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**e`` for integer e in [-149, 127] (built from bits, never through exp2)."""
    e = e.to(torch.int64)
    normal = ((e + 127).clamp(1, 254) << 23).to(torch.int32).view(torch.float32)
    denormal = (torch.ones_like(e) << (e + 149).clamp(0, 22)).to(torch.int32).view(torch.float32)
    return torch.where(e >= -126, normal, denormal)


def round_to_e2m1(q: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by the block scale -> uint8 nibbles (sign bit 3, magnitude 0..7)."""
    a = q.abs()
    index = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for mid, tie_up in zip(_MIDPOINTS, _TIE_ROUNDS_UP, strict=True):
        index += (a >= mid if tie_up else a > mid).to(torch.uint8)
    sign = (q.view(torch.int32) < 0).to(torch.uint8) << 3  # keeps the sign of -0.0
    return index | sign


def _e2m1_table(device) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def block_sq_error(xb: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Per block, the sum of (x - dequant(quant(x, e)))**2 in float64, in one fixed order.

    x and E2M1 * 2**e are exact in float64 and so is their difference; each square is rounded once. Order:
    element j goes to lane j % 4, each lane adds its 8 squares in element order, then
    (lane0 + lane1) + (lane2 + lane3). The fast path sums in this same order, so both make identical
    ``mse`` choices.
    """
    nib = round_to_e2m1(xb * pow2(-e).unsqueeze(-1))
    deq = _e2m1_table(xb.device).double()[nib.long()] * pow2(e).double().unsqueeze(-1)
    diff = xb.double() - deq
    sq = (diff * diff).reshape(*e.shape, BLOCK // 4, 4)
    lanes = torch.zeros(*e.shape, 4, dtype=torch.float64, device=xb.device)
    for i in range(BLOCK // 4):
        lanes = lanes + sq[..., i, :]
    return (lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3])


def block_exponents(xb: torch.Tensor, mode: str) -> torch.Tensor:
    """Unbiased int32 exponents ``[rows, nblocks]`` for float32 blocks ``xb [rows, nblocks, 32]``."""
    amax = xb.abs().amax(-1)
    if mode == "even":
        return even_exponent(amax)
    if mode == "floor":
        return floor_exponent(amax)
    if mode == "roundup":
        return roundup_exponent(amax)
    if mode == "mse":
        e = even_exponent(amax)
        best, best_err = e, block_sq_error(xb, e)
        for cand in ((e + 1).clamp(max=EXP_MAX), (e - 1).clamp(min=EXP_MIN)):
            err = block_sq_error(xb, cand)
            better = err < best_err  # strict: ties stay with the earlier (even-rule first) candidate
            best, best_err = torch.where(better, cand, best), torch.where(better, err, best_err)
        return best
    raise FormatError(f"unknown MXFP4 scale mode {mode!r}; choose one of {', '.join(MODES)}")


def quantize_reference(xb: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow obvious path on float32 blocks ``[rows, nb, 32]`` -> (codes ``[rows, nb*16]``, scales ``[rows, nb]``)."""
    e = block_exponents(xb, mode)
    nib = round_to_e2m1(xb * pow2(-e).unsqueeze(-1)).reshape(xb.shape[0], xb.shape[1] * BLOCK)
    codes = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return codes, (e + SCALE_BIAS).to(torch.uint8)


def _rows(t: torch.Tensor, axis: int, width: int) -> tuple[torch.Tensor, list[int]]:
    """``t`` with ``axis`` moved last as ``[rows, width]`` (a view when already last), plus the leading shape."""
    moved = t.movedim(axis, -1)
    lead = list(moved.shape[:-1])
    return moved.reshape(math.prod(lead), width), lead


def _unrows(rows: torch.Tensor, lead: list[int], axis: int) -> torch.Tensor:
    """Inverse of :func:`_rows` for a result of any width: back to the input's axis order, contiguous."""
    return rows.reshape(*lead, rows.shape[-1]).movedim(-1, axis).contiguous()


def quantize(
    x: torch.Tensor, *, mode: str = "even", axis: int = -1, check_finite_input: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (bf16/fp16/fp32, any dims) to MXFP4 in blocks of 32 along ``axis``.

    Returns ``(codes, scales)`` as uint8 tensors on x's device, in x's axis order, with ``axis`` of
    length L becoming L/2 (codes) and L/32 (scales). NaN/Inf raise :class:`NonFiniteError` (count and
    first index) unless ``check_finite_input=False`` (activations inside kernels' reference paths). Other
    float dtypes (fp64, fp8) are converted to float32 first.
    """
    _check_float(x)
    if mode not in MODES:
        raise FormatError(f"unknown MXFP4 scale mode {mode!r}; choose one of {', '.join(MODES)}")
    axis = _normalize_axis(axis, x.dim())
    length = x.shape[axis]
    if length % BLOCK:
        raise FormatError(
            f"MXFP4 groups {BLOCK} elements along axis {axis}, whose length {length} is not a multiple of 32"
        )
    if x.dtype == torch.float64:  # to float32 before the finiteness check: values past its range become Inf
        x = x.float()
    rows, lead = _rows(x.detach(), axis, length)
    from . import _mxfp4_fast

    fast = _mxfp4_fast.quantize_rows(rows, mode)
    if fast is None:
        if check_finite_input:
            check_finite(x.detach())
        codes, scales = quantize_reference(rows.to(torch.float32).reshape(len(rows), length // BLOCK, BLOCK), mode)
    else:
        codes, scales, n_nonfinite = fast
        if n_nonfinite and check_finite_input:
            check_finite(x.detach())
    return _unrows(codes, lead, axis), _unrows(scales, lead, axis)


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n]`` packed codes -> uint8 nibbles ``[..., 2n]`` (low nibble first)."""
    return torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 ``2**(byte-127)``; byte 255 -> NaN."""
    e = scales.to(torch.int64) - SCALE_BIAS
    return torch.where(scales == 255, torch.full(scales.shape, float("nan"), device=scales.device), pow2(e))


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Slow obvious path: codes ``[..., n]`` and scales ``[..., n/16]`` (grouped along the last axis) -> float32."""
    values = _e2m1_table(codes.device)[unpack_nibbles(codes).long()]
    return values * scale_values(scales).repeat_interleave(BLOCK, dim=-1)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, *, axis: int = -1, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Exact inverse mapping of :func:`quantize`: ``E2M1[code] * 2**(scale-127)``, returned as ``dtype``.

    Computed in float32, exact there except that values of 2**128 and more (scale bytes 253 and 254)
    overflow to Inf, then converted to ``dtype``; scale byte 255 gives NaN. The result is contiguous, in
    the codes' axis order.
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise FormatError(f"MXFP4 codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() != scales.dim() or codes.dim() == 0:
        raise FormatError(
            f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} must have the same rank, at least 1"
        )
    axis = _normalize_axis(axis, codes.dim())
    expected = list(codes.shape)
    if expected[axis] % (BLOCK // 2):
        raise FormatError(f"codes axis {axis} has {expected[axis]} bytes, not a multiple of 16 (32 elements)")
    expected[axis] = expected[axis] * 2 // BLOCK
    if list(scales.shape) != expected:
        raise FormatError(
            f"scales shape {tuple(scales.shape)} does not match codes {tuple(codes.shape)} "
            f"(expected {tuple(expected)} for blocks of 32 along axis {axis})"
        )
    code_rows, lead = _rows(codes, axis, codes.shape[axis])
    scale_rows, _ = _rows(scales, axis, expected[axis])
    from . import _mxfp4_fast

    values = _mxfp4_fast.dequantize_rows(code_rows, scale_rows)
    if values is None:
        values = dequantize_reference(code_rows, scale_rows)
    return _unrows(values, lead, axis).to(dtype)
