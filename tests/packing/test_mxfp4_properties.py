"""Property tests of the MXFP4 codec: fast path == reference bit for bit, round trips, mse never worse."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packing_helpers import E2M1, bits_equal, exact_block_error, exact_value, nibbles, reference_only

from glm_pack.packing import _mxfp4_fast
from glm_pack.packing.mxfp4 import MODES, dequantize, quantize, quantize_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Block exponents that keep 8 * 2**e finite in the dtype (fp16 tops out at 65504); the low end reaches
# denormals and the clamp at 2**-127 (fp16 and bf16 underflow there, which is fine: it is just input).
EXPONENTS = {torch.float32: (-150, 120), torch.bfloat16: (-150, 120), torch.float16: (-30, 12)}
# Values that sit on rounding midpoints, grid points, the saturation edge and signed zeros.
SPECIAL = (0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, -0.75, -2.5, -5.0, 0.5, 3.0, 6.5, 7.99)
PROFILE = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def blocks(draw, dtype, max_rows=3, max_blocks=3, rows=None):
    """A float tensor ``[rows, 32 * nblocks]`` whose blocks have independent magnitudes."""
    rows = draw(st.integers(1, max_rows)) if rows is None else rows
    nb = draw(st.integers(1, max_blocks))
    lo, hi = EXPONENTS[dtype]
    exps = draw(st.lists(st.integers(lo, hi), min_size=rows * nb, max_size=rows * nb))
    element = st.one_of(st.sampled_from(SPECIAL), st.floats(-8, 8, width=32))
    values = draw(st.lists(element, min_size=rows * nb * 32, max_size=rows * nb * 32))
    x = torch.tensor(values, dtype=torch.float64).reshape(rows, nb, 32)
    x = x * torch.tensor([2.0**e for e in exps], dtype=torch.float64).reshape(rows, nb, 1)
    return x.reshape(rows, nb * 32).to(dtype)


dtypes = st.sampled_from(DTYPES)
modes = st.sampled_from(MODES)


@PROFILE
@given(data=st.data(), dtype=dtypes, mode=modes)
def test_fast_equals_reference(data, dtype, mode):
    x = data.draw(blocks(dtype))
    fast = _mxfp4_fast.quantize_rows(x, mode)
    codes, scales = quantize_reference(x.float().reshape(x.shape[0], -1, 32), mode)
    assert torch.equal(fast[0], codes) and torch.equal(fast[1], scales) and fast[2] == 0


@PROFILE
@given(data=st.data(), dtype=dtypes, mode=modes, lead=st.lists(st.sampled_from([1, 3, 5]), max_size=2))
def test_fast_equals_reference_any_axis(data, dtype, mode, lead):
    """Public API, odd leading dims, the grouped axis anywhere: the two paths agree bit for bit."""
    rows = data.draw(blocks(dtype, max_blocks=2, rows=math.prod(lead)))
    axis = data.draw(st.integers(0, len(lead)))
    x = rows.reshape(*lead, rows.shape[-1]).movedim(-1, axis).contiguous()
    codes, scales = quantize(x, mode=mode, axis=axis)
    with reference_only():
        ref_codes, ref_scales = quantize(x, mode=mode, axis=axis)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    shape = list(x.shape)
    assert list(codes.shape) == shape[:axis] + [shape[axis] // 2] + shape[axis + 1 :]
    assert list(scales.shape) == shape[:axis] + [shape[axis] // 32] + shape[axis + 1 :]
    values = dequantize(codes, scales, axis=axis, dtype=dtype)
    with reference_only():
        ref_values = dequantize(codes, scales, axis=axis, dtype=dtype)
    assert bits_equal(values, ref_values) and values.shape == x.shape and values.is_contiguous()


@PROFILE
@given(data=st.data(), mode=modes)
def test_axis_groups_along_that_axis(data, mode):
    """Quantizing along axis 0 of [L, 3] equals quantizing each column as its own vector."""
    x = data.draw(blocks(torch.float32, max_rows=3, max_blocks=2)).T.contiguous()  # [L, rows]
    codes, scales = quantize(x, mode=mode, axis=0)
    for j in range(x.shape[1]):
        col_codes, col_scales = quantize(x[:, j].clone(), mode=mode)
        assert torch.equal(codes[:, j], col_codes) and torch.equal(scales[:, j], col_scales)


@PROFILE
@given(codes=st.binary(min_size=16 * 6, max_size=16 * 6), scales=st.binary(min_size=6, max_size=6))
def test_dequantize_fast_equals_reference(codes, scales):
    c = torch.frombuffer(bytearray(codes), dtype=torch.uint8).reshape(2, 48)
    s = torch.frombuffer(bytearray(scales), dtype=torch.uint8).reshape(2, 3)
    fast = dequantize(c, s)
    with reference_only():
        ref = dequantize(c, s)
    assert bits_equal(fast, ref)
    # both are the exact value of each code, rounded to float32 (Inf beyond its range; byte 255 is NaN)
    expected = []
    for i, code in enumerate(nibbles(c)):
        byte = scales[i // 32]
        magnitude = float("nan") if byte == 255 else float(exact_value(code & 7, byte))
        expected.append(math.copysign(magnitude, -1.0 if code & 8 else 1.0))
    assert bits_equal(fast.reshape(-1), torch.tensor(expected, dtype=torch.float64).to(torch.float32))


@PROFILE
@given(data=st.data(), dtype=dtypes, mode=modes)
def test_round_trip(data, dtype, mode):
    """Dequantized values are a fixed point of quantize -> dequantize for every mode; for even and floor
    the codes and scales are too (the block's largest code is then 4 or 6, which keeps the exponent)."""
    x = data.draw(blocks(dtype))
    codes, scales = quantize(x, mode=mode)
    y = dequantize(codes, scales)
    codes2, scales2 = quantize(y, mode=mode)
    assert torch.equal(dequantize(codes2, scales2), y)
    if mode in ("even", "floor"):
        assert torch.equal(codes2, codes) and torch.equal(scales2, scales)


@PROFILE
@given(data=st.data(), dtype=dtypes)
def test_mse_never_worse_than_even(data, dtype):
    """Exact (rational) squared error of each mse block <= that of the even block.

    The codec compares float64 sums (fixed order); two candidates within rounding of each other could in
    principle be ordered differently from the exact errors, so the exact check allows 2**-40 relative.
    """
    x = data.draw(blocks(dtype, max_rows=2, max_blocks=2))
    even_codes, even_scales = quantize(x, mode="even")
    mse_codes, mse_scales = quantize(x, mode="mse")
    values = x.double().reshape(-1, 32).tolist()
    even_nib, mse_nib = nibbles(even_codes), nibbles(mse_codes)
    for b, block in enumerate(values):
        err_even = exact_block_error(block, even_nib[32 * b : 32 * b + 32], even_scales.reshape(-1)[b].item())
        err_mse = exact_block_error(block, mse_nib[32 * b : 32 * b + 32], mse_scales.reshape(-1)[b].item())
        assert err_mse <= err_even * (1 + 2**-40)
        # and the mse exponent is the even one or a neighbour
        assert abs(mse_scales.reshape(-1)[b].item() - even_scales.reshape(-1)[b].item()) <= 1


@PROFILE
@given(data=st.data(), dtype=dtypes)
def test_even_elements_are_nearest(data, dtype):
    """Under the block's scale, every even-mode code is a nearest E2M1 value (or 6 when beyond it)."""
    x = data.draw(blocks(dtype, max_rows=2, max_blocks=2))
    codes, scales = quantize(x, mode="even")
    scale_bytes = scales.reshape(-1).tolist()
    for i, (v, code) in enumerate(zip(x.double().reshape(-1).tolist(), nibbles(codes), strict=True)):
        magnitude, scale = abs(Fraction(v)), Fraction(2) ** (scale_bytes[i // 32] - 127)
        best = min(abs(magnitude - Fraction(m) * scale) for m in E2M1)
        assert abs(magnitude - Fraction(E2M1[code & 7]) * scale) == best
        assert code >> 3 == (math.copysign(1.0, v) < 0)
