"""MXFP4 codec against hand-checked vectors (notes/mxfp4.md and aiter's Triton `_mxfp4_quant_op`).

Every expected value below was worked out by hand from the rules; each test runs on both the fast path and
the torch reference.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
from packing_helpers import E2M1, bits_equal, nibbles, reference_only

from glm_pack.packing import _mxfp4_fast, mxfp4
from glm_pack.packing.errors import FormatError, NonFiniteError
from glm_pack.packing.mxfp4 import MODES, dequantize, quantize

PATHS = ("fast", "reference")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def run(path, fn, *args, **kwargs):
    if path == "reference":
        with reference_only():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def one_block(values):
    return torch.tensor(values + [0.0] * (32 - len(values)), dtype=torch.float32)


def test_fast_path_is_available():
    # numba is a core dependency: the bit-identity tests below would be vacuous without it.
    assert _mxfp4_fast.available()


# Element rounding at block scale 1 (amax 6 -> even exponent 0, byte 127): ties to the even code,
# saturation at 6, sign kept (also for -0.0 and values rounding to zero).
TIE_TABLE = [
    (6.0, 0x7),
    (0.25, 0x0),  # tie 0 | 0.5 -> 0
    (0.75, 0x2),  # tie 0.5 | 1 -> 1
    (1.25, 0x2),  # tie 1 | 1.5 -> 1
    (1.75, 0x4),  # tie 1.5 | 2 -> 2
    (2.5, 0x4),  # tie 2 | 3 -> 2
    (3.5, 0x6),  # tie 3 | 4 -> 4
    (5.0, 0x6),  # tie 4 | 6 -> 4
    (-0.25, 0x8),
    (-0.75, 0xA),
    (-1.25, 0xA),
    (-1.75, 0xC),
    (-2.5, 0xC),
    (-3.5, 0xE),
    (-5.0, 0xE),
    (-0.0, 0x8),
    (0.0, 0x0),
    (0.26, 0x1),
    (0.74, 0x1),
    (1.3, 0x3),
    (2.6, 0x5),
    (5.1, 0x7),
    (0.5, 0x1),
    (1.0, 0x2),
    (1.5, 0x3),
    (2.0, 0x4),
    (3.0, 0x5),
    (4.0, 0x6),
    (-6.0, 0xF),
    (5.99, 0x7),
    (0.24, 0x0),
    (1e-4, 0x0),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tie_table(path, dtype):
    x = torch.tensor([v for v, _ in TIE_TABLE], dtype=dtype)
    codes, scales = run(path, quantize, x, mode="even")
    assert scales.tolist() == [127]
    assert nibbles(codes) == [c for _, c in TIE_TABLE]
    # element 2i is the low nibble: 6.0 (0x7) then 0.25 (0x0) -> byte 0x07
    assert codes[0].item() == 0x07 and codes.shape == (16,) and codes.dtype == torch.uint8


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e", [-127, -126, -125])
def test_tie_table_at_denormal_scales(path, dtype, e):
    # The table times 2**e: amax 6 * 2**e keeps exponent e (byte 127 + e) and every code. At these scales some
    # midpoints times 2**e are denormal (0.25 for e <= -125, up to 1.75 for e = -127); the non-dyadic entries
    # stay on their side of each midpoint after rounding to the dtype's denormal spacing (2**-149, bf16 2**-133).
    x = (torch.tensor([v for v, _ in TIE_TABLE], dtype=torch.float64) * 2.0**e).to(dtype)
    codes, scales = run(path, quantize, x, mode="even")
    assert scales.tolist() == [127 + e]
    assert nibbles(codes) == [c for _, c in TIE_TABLE]


# (mode, amax, expected scale byte, expected code of amax) worked out by hand:
# even:    e = floor(log2(amax rounded to a 1-bit mantissa)) - 2; floor: floor(log2 amax) - 2;
# roundup: smallest e with 6 * 2**e >= amax.
EXPONENT_CASES = [
    ("even", 1.0, 125, 0x6),  # e=-2: 1/0.25 = 4
    ("even", 1.74, 125, 0x7),  # mantissa 1.74 rounds down: e=-2, 6.96 saturates to 6
    ("even", 1.75, 126, 0x6),  # mantissa 1.75 rounds up to 2: e=-1, 3.5 ties to 4
    ("even", 6.0, 127, 0x7),
    ("even", 7.0, 128, 0x6),  # 7 -> 8: e=1, 3.5 -> 4
    ("even", 2.0**-124, 1, 0x6),  # e=-126
    ("floor", 1.75, 125, 0x7),  # e=-2, 7 saturates to 6
    ("floor", 7.0, 127, 0x7),
    ("floor", 8.0, 128, 0x6),
    ("roundup", 6.0, 127, 0x7),
    ("roundup", 6.5, 128, 0x5),  # e=1: 3.25 -> 3
    ("roundup", 3.0, 126, 0x7),  # 3/6 = 0.5 -> e=-1
    ("roundup", 3.01, 127, 0x5),  # e=0: 3.01 -> 3
    ("roundup", 1.0, 125, 0x6),  # 1/6 -> 0.25 -> e=-2: 4
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("mode", "amax", "byte", "code"), EXPONENT_CASES)
def test_scale_rules(path, mode, amax, byte, code):
    codes, scales = run(path, quantize, one_block([amax, -amax / 64]), mode=mode)
    assert scales.tolist() == [byte]
    assert nibbles(codes)[0] == code
    # the same block reversed: amax is the block's last element
    codes, scales = run(path, quantize, one_block([amax, -amax / 64]).flip(0), mode=mode)
    assert scales.tolist() == [byte]
    assert nibbles(codes)[31] == code


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_zero_and_denormal_blocks_get_byte_0(path, mode):
    # all-zero -> byte 0 (aiter: log2(0) = -inf clamps to -127); a denormal amax also clamps to -127.
    # The last block's amax 0.3125 * 2**-127 is denormal too: at 2**-127 it is 0.3125 -> 0.5 (code 0x1, error
    # 0.1875 * 2**-127); 2**-128 would fit it better (0.625 -> 0.5, error 0.0625 * 2**-127) but has no E8M0 byte,
    # so mse keeps byte 0 (its e-1 candidate is clamped to -127 too).
    x = torch.stack([one_block([]), one_block([-0.0, 0.0]), one_block([2.0**-130, -(2.0**-128)])])
    x = torch.cat([x, one_block([0.3125 * 2.0**-127])[None]])
    codes, scales = run(path, quantize, x, mode=mode)
    assert scales.tolist() == [[0], [0], [0], [0]]
    assert nibbles(codes[0]) == [0] * 32
    assert nibbles(codes[1])[:2] == [0x8, 0x0]
    # 2**-130 / 2**-127 = 0.125 -> 0; -2**-128 / 2**-127 = -0.5 -> code 0x9
    assert nibbles(codes[2])[:2] == [0x0, 0x9]
    assert nibbles(codes[3])[:1] == [0x1]


@pytest.mark.parametrize("path", PATHS)
def test_small_exponent_clamp(path):
    # amax 2**-125: even rule gives e = -127 exactly, so the element is 4 (code 6); amax 1.75 * 2**-126
    # rounds to 2**-125 -> e = -127 as well, and 1.75 * 2**-126 / 2**-127 = 3.5 -> 4.
    x = torch.stack([one_block([2.0**-125]), one_block([1.75 * 2.0**-126])])
    codes, scales = run(path, quantize, x, mode="even")
    assert scales.tolist() == [[0], [0]]
    assert nibbles(codes[0])[0] == 0x6 and nibbles(codes[1])[0] == 0x6


@pytest.mark.parametrize("path", PATHS)
def test_huge_fp32_block(path):
    # 3e38 = 1.763 * 2**127: the even rule rounds the mantissa up past the float32 range; aiter's
    # log2(inf) then clamps to 127 (byte 254) and 1.763 rounds to 2 (code 4). Floor: e = 125, 7.05 -> 6.
    x = one_block([3e38])
    codes, scales = run(path, quantize, x, mode="even")
    assert scales.tolist() == [254] and nibbles(codes)[0] == 0x4
    codes, scales = run(path, quantize, x, mode="floor")
    assert scales.tolist() == [252] and nibbles(codes)[0] == 0x7


@pytest.mark.parametrize("path", PATHS)
def test_finite_values_whose_float32_sum_overflows_are_not_called_non_finite(path):
    # 64 x 3e38 sums to Inf in float32 although every value is finite: check_finite must count, not trust the sum.
    # Each block is test_huge_fp32_block's: byte 254, code 0x4.
    x = torch.full((2, 32), 3e38)
    mxfp4.check_finite(x)
    codes, scales = run(path, quantize, x)
    assert scales.tolist() == [[254], [254]] and nibbles(codes) == [0x4] * 64


# mse: (block, even byte, mse byte, mse codes of the listed values), squared errors worked out by hand.
MSE_CASES = [
    # even: 1.75 rounds up to 2 -> e=-1 (scale .5): 3.5 -> 4 -> 2.0 (err .0625), 0.8 -> 1 -> .5 (err .01 x31):
    # .3725. e=-2 (scale .25): 7 -> 6 -> 1.5 (.0625), 1.6 -> 1.5 -> .375 (.000625 x31): .081875, a strict win.
    # e=0: 1.75 -> 2 (.0625), .4 -> .5 (.01 x31): .3725, a tie, so not better.
    ([1.75] + [0.4] * 31, 126, 125, [0x7] + [0x3] * 31),
    # even e=0: 5 -> 4 (tie to even, err 1 each); e=1: 2.5 -> 2 -> 4 (err 1): tie stays with even;
    # e=-1: 10 -> 6 -> 3 (err 4): worse.
    ([5.0] * 32, 127, 127, [0x6] * 32),
    # even: 1.7 (mantissa < 1.75) -> e=-2: 6.8 -> 6 -> 1.5 (err .04 x2); e=-1: 3.4 -> 3 -> 1.5 (same): tie.
    ([1.7, 1.7], 125, 125, [0x7, 0x7]),
    # even e=0 is exact for 6 and 0.5; e=-1: 12 -> 6 -> 3 (err 9): worse; e=1: .25 -> 0 (err .25): worse.
    ([6.0, 0.5], 127, 127, [0x7, 0x1]),
    # a tie with e-1 that the fast path must evaluate (its error sum exceeds amax's alone): even 3.5 -> 4 at
    # e=0: 3.5 -> 4 (err .25), .125 -> 0 (tie 0 | .5, err .015625): .265625. e=-1: 7 -> 6 -> 3 (err .25),
    # .25 -> 0 (tie 0 | .5): .265625, a tie, so not better. e=1: 1.75 -> 2 -> 4 (.25), .0625 -> 0: tie too.
    ([3.5, 0.125], 127, 127, [0x6, 0x0]),
    # another tie with e-1, of elements that are code 7 (6) there: even e=0: 3.5 -> 4 (err .25), 2.625 -> 3
    # (err .140625 x8): 1.375. e=-1: 7 -> 6 -> 3 (.25), 5.25 -> 6 -> 3 (.140625 x8): 1.375, not better.
    # e=1: 1.75 -> 2 -> 4 (.25), 1.3125 -> 1.5 -> 3 (.140625 x8): a tie too.
    ([3.5] + [2.625] * 8, 127, 127, [0x6] + [0x5] * 8),
    # near the float32 top: the even rule rounds 1.875 * 2**127 past the range, so e=127 (byte 254); e+1 is
    # clamped to 127. e=127: 1.875 -> 2 (err .125), .3125 -> .5 (err .1875): .05078125 * 2**254. e=126: 3.75 -> 4
    # (err .125 * 2**127), .625 -> .5 (err .0625 * 2**127): .01953125 * 2**254, a strict win (here amax is below
    # 3 * 2**127, so it does not bound e-1's error from below).
    ([1.875 * 2.0**127, 0.3125 * 2.0**127], 254, 253, [0x6, 0x1]),
    # an exact tie that float64 breaks by the fixed summation order (block_sq_error's docstring). Lanes are the
    # elements j % 4; 2**-27 rounds to 0 at both exponents (squared error 2**-54), .75 is a tie at e=0 (-> 1,
    # err .0625) and exact at e=-1. Lane sums at e=0: (.5, 2**-53, .5, 2**-53), at e=-1: (1, 2**-53, 0, 2**-53);
    # both are 1 + 2**-52 exactly. e=0 adds (.5 + 2**-53) + (.5 + 2**-53) = 1 + 2**-52 with no rounding; e=-1
    # adds (1 + 2**-53) + (0 + 2**-53): 1 + 2**-53 rounds to 1 (tie to even), and so does 1 + 2**-53 again: 1,
    # so e=-1 wins. (Added as (l0 + l2) + (l1 + l3), e=-1 would be 1 + 2**-52 exactly and lose.) e=1 sums like
    # e=0. Codes at e=-1: 3.75 -> 7.5 -> 6, 3.5 -> 7 -> 6, 1.25 -> 2.5 -> 2 (tie), 3.25 -> 6.5 -> 6, .75 -> 1.5.
    (
        [3.75, 2.0**-27, 0.75, 2.0**-27, 3.5, 2.0**-27, 0.75, 2.0**-27]
        + [1.25, 0.0, 0.75, 0.0, 3.25, 0.0, 0.75, 0.0, 1.25, 0.0, 0.75, 0.0]
        + [0.0, 0.0, 0.75, 0.0] * 3,
        127,
        126,
        [0x7, 0x0, 0x3, 0x0, 0x7, 0x0, 0x3, 0x0, 0x4, 0x0, 0x3, 0x0, 0x7, 0x0, 0x3, 0x0, 0x4, 0x0, 0x3, 0x0]
        + [0x0, 0x0, 0x3, 0x0] * 3,
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("values", "even_byte", "mse_byte", "mse_codes"), MSE_CASES)
def test_mse_hand_blocks(path, values, even_byte, mse_byte, mse_codes):
    x = one_block(values)
    _, even_scales = run(path, quantize, x, mode="even")
    codes, scales = run(path, quantize, x, mode="mse")
    assert even_scales.tolist() == [even_byte] and scales.tolist() == [mse_byte]
    assert nibbles(codes)[: len(mse_codes)] == mse_codes


@pytest.mark.parametrize("path", PATHS)
def test_dequantize_every_code_and_scale_byte(path):
    # Row b holds scale byte b; the 16 bytes i | (15 - i) << 4 put every code in both nibble positions.
    codes = torch.tensor([[i | (15 - i) << 4 for i in range(16)]] * 256, dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(256, 1)
    out = run(path, dequantize, codes, scales)
    expected = []
    for byte in range(256):
        row = []
        for i in range(16):
            for code in (i, 15 - i):
                if byte == 255:
                    row.append(math.nan)
                else:
                    value = math.ldexp(E2M1[code & 7], byte - 127)
                    row.append(-value if code & 8 else value)
        expected.append(row)
    # float32 holds every value below 2**128: +-{2, 3, 4, 6} * 2**127 and +-{4, 6} * 2**126 overflow to Inf
    assert bits_equal(out, torch.tensor(expected, dtype=torch.float64).to(torch.float32))
    assert torch.isinf(out[254]).sum() == 16 and torch.isinf(out[253]).sum() == 8 and torch.isinf(out).sum() == 24
    assert torch.isnan(out[255]).all()
    assert out[0, 1].item() == -6.0 * 2.0**-127 and out[127, 0].item() == 0.0 and out[127, 1].item() == -6.0
    assert math.copysign(1.0, out[127, 16].item()) == -1.0  # code 8 is -0.0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_dtype(path, dtype):
    codes = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # 0.5, 1.0 repeated
    scales = torch.tensor([[128]], dtype=torch.uint8)  # x2
    out = run(path, dequantize, codes, scales, dtype=dtype)
    assert out.dtype == dtype and out.tolist() == [[1.0, 2.0] * 16]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_without_check_matches_aiter_like_rule(path, mode):
    # check_finite_input=False: exponent 127 (byte 254) in every mode, NaN -> +-0, Inf -> +-6,
    # finite neighbours divided by 2**127 (here 0).
    x = one_block([math.nan, 1.0, -math.inf, -0.5, math.inf, -math.nan])
    codes, scales = run(path, quantize, x, mode=mode, check_finite_input=False)
    assert scales.tolist() == [254]
    assert nibbles(codes)[:6] == [0x0, 0x0, 0xF, 0x8, 0x7, 0x8]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_raises_with_count_and_first_index(path, bad):
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    x[1, 37] = bad
    x[2, 5] = bad
    with pytest.raises(NonFiniteError, match=r"2 non-finite.*first at index \(1, 37\)"):
        run(path, quantize, x)


@pytest.mark.parametrize("path", PATHS)
def test_fp8_input_is_quantized_and_its_nan_named(path):
    """fp8 (e4m3, whose only non-finite value is NaN) is widened to float32: finite input quantizes like its
    float32 values, a NaN byte raises NonFiniteError with its index."""
    x = (torch.arange(64, dtype=torch.float32).reshape(2, 32) / 8 - 3).to(torch.float8_e4m3fn)
    assert all(torch.equal(a, b) for a, b in zip(run(path, quantize, x), quantize(x.float()), strict=True))
    x.view(torch.uint8)[1, 3] = 0x7F  # e4m3 NaN
    with pytest.raises(NonFiniteError, match=r"1 non-finite value\(s\) \(1 NaN, 0 Inf\); first at index \(1, 3\)"):
        run(path, quantize, x)


@pytest.mark.parametrize("path", PATHS)
def test_fp64_input_beyond_float32_range_is_refused(path):
    """fp64 is quantized as its float32 values: 1e39 is Inf there, so it is named like any Inf."""
    x = torch.ones(2, 32, dtype=torch.float64)
    x[1, 4] = 1e39
    with pytest.raises(NonFiniteError, match=r"1 non-finite value\(s\) \(0 NaN, 1 Inf\); first at index \(1, 4\)"):
        run(path, quantize, x)
    x[1, 4] = 3.0
    assert all(torch.equal(a, b) for a, b in zip(run(path, quantize, x), quantize(x.float()), strict=True))


def test_scale_bytes_0xff_are_counted_and_the_first_named():
    mxfp4.check_scale_bytes(torch.arange(255, dtype=torch.int32).to(torch.uint8))  # 0..254: finite powers of two
    scales = torch.full((3, 6), 127, dtype=torch.uint8)
    scales[2, 1] = scales[1, 4] = 0xFF
    with pytest.raises(NonFiniteError, match=r"holds 2 NaN byte\(s\); first at index \(1, 4\)"):
        mxfp4.check_scale_bytes(scales)


@pytest.mark.parametrize("path", PATHS)
def test_nonfinite_message_counts_nan_and_inf(path):
    x = torch.zeros(64)
    x[[3, 40, 41]] = torch.tensor([math.inf, math.nan, -math.inf])
    with pytest.raises(NonFiniteError, match=r"3 non-finite value\(s\) \(1 NaN, 2 Inf\); first at index \(3,\)"):
        run(path, quantize, x, axis=0)


@pytest.mark.parametrize("path", PATHS)
def test_error_paths(path):
    with pytest.raises(FormatError, match="not a multiple of 32"):
        run(path, quantize, torch.zeros(4, 48))
    with pytest.raises(FormatError, match="not a multiple of 32"):
        run(path, quantize, torch.zeros(48, 64), axis=0)
    with pytest.raises(FormatError, match="floating-point"):
        run(path, quantize, torch.zeros(4, 64, dtype=torch.int32))
    with pytest.raises(FormatError, match="floating-point"):
        run(path, quantize, [0.0] * 32)
    with pytest.raises(FormatError, match="unknown MXFP4 scale mode 'nearest'"):
        run(path, quantize, torch.zeros(32), mode="nearest")
    with pytest.raises(FormatError, match="axis 2 out of range"):
        run(path, quantize, torch.zeros(4, 32), axis=2)
    codes, scales = torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)
    with pytest.raises(FormatError, match="must be uint8"):
        run(path, dequantize, codes.float(), scales)
    with pytest.raises(FormatError, match="same rank"):
        run(path, dequantize, codes, scales[0])
    with pytest.raises(FormatError, match="same rank, at least 1"):
        run(path, dequantize, codes[0, 0], scales[0, 0])
    with pytest.raises(FormatError, match="not a multiple of 16"):
        run(path, dequantize, codes[:, :8], scales)
    with pytest.raises(FormatError, match=r"expected \(2, 1\)"):
        run(path, dequantize, codes, torch.zeros(2, 2, dtype=torch.uint8))


def test_numba_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "explicit"))
    assert _mxfp4_fast.cache_dir() == str(tmp_path / "explicit")
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _mxfp4_fast.cache_dir() == os.path.join(str(tmp_path), "glm-pack", "numba")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _mxfp4_fast.cache_dir() == os.path.join(str(tmp_path), "home", ".cache", "glm-pack", "numba")


@pytest.mark.parametrize("path", PATHS)
def test_parameter_input(path):
    # weights often arrive as nn.Parameter (requires_grad): quantize reads values, never the graph
    x = torch.nn.Parameter(torch.tensor([6.0, 0.75] + [0.0] * 30))
    codes, scales = run(path, quantize, x)
    assert scales.tolist() == [127] and nibbles(codes)[:2] == [0x7, 0x2]


def _quantize_in_child(queue, x):
    codes, scales = quantize(x)
    queue.put((int(codes.numpy().sum()), int(scales.numpy().sum())))  # numpy: no OpenMP in the child


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method only")
def test_fast_path_works_in_a_forked_child():
    # the parent's worker threads do not survive fork(); a child that inherits the pool must not hang.
    # (x is made here and the child sums with numpy: torch's OpenMP ops can hang in a forked child)
    x = torch.full((1024, 512), 6.0)
    quantize(x)  # large enough to start the thread split in this process
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_quantize_in_child, args=(queue, x))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    # every element is 6.0: code 7 in both nibbles (0x77) and scale byte 127
    assert queue.get(timeout=5) == (0x77 * 1024 * 256, 127 * 1024 * 16)


def test_blocks_quantized_on_a_worker_thread(monkeypatch):
    # 8192 blocks, 4096 per thread: the caller quantizes the first half, a worker thread the second. Its codes
    # and scales match the reference, and a NaN/Inf it meets is counted and named.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(7))
    with reference_only():
        expected = quantize(x)
    assert all(torch.equal(a, b) for a, b in zip(quantize(x), expected, strict=True))
    for bad in (math.inf, math.nan):
        x[255, 1000] = bad
        with pytest.raises(NonFiniteError, match=r"1 non-finite value\(s\).*first at index \(255, 1000\)"):
            quantize(x)


def test_without_numba_the_reference_runs():
    # numba unimportable (sys.modules entry None): the codec still works, on the reference path
    script = (
        "import sys; sys.modules['numba'] = None\n"
        "import torch\n"
        "from glm_pack.packing import _mxfp4_fast\n"
        "from glm_pack.packing.mxfp4 import quantize\n"
        "codes, scales = quantize(torch.tensor([6.0, 0.75, 1.25, 3.5] + [0.0] * 28))\n"
        "print(_mxfp4_fast.available(), scales.tolist(), codes[:2].tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    # 6.0 -> 0x7, 0.75 -> 0x2: byte 0x27; 1.25 -> 0x2, 3.5 -> 0x6: byte 0x62
    assert out.split() == ["False", "[127]", "[39,", "98]"]


@pytest.mark.parametrize("path", PATHS)
def test_empty_tensors(path):
    for shape, codes_shape, scales_shape in (((0, 64), (0, 32), (0, 2)), ((3, 0), (3, 0), (3, 0))):
        codes, scales = run(path, quantize, torch.zeros(shape, dtype=torch.bfloat16))
        assert codes.shape == codes_shape and scales.shape == scales_shape
        assert run(path, dequantize, codes, scales).shape == shape
