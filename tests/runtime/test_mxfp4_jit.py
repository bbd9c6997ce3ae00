"""The in-kernel activation rounding (runtime/kernels/mxfp4_jit.py) against the reference round trip
(``quantize(mode="even")`` then ``dequantize``), bit for bit, in a small kernel (Triton's interpreter here,
compiled on a GPU), on blocks across the whole bf16 range."""

from __future__ import annotations

import pytest
import torch

from glm_pack.runtime import reference
from tests.runtime.kernel_modules import kernel_module
from tests.runtime.test_triton_bmm import DEV, special_blocks

tb = kernel_module("triton_bmm")  # sets up Triton's interpreter where there is no GPU, before the kernel below
_ok, _why = tb.available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"triton unavailable: {_why}")

if _ok:
    import triton
    import triton.language as tl

    from glm_pack.runtime.kernels.mxfp4_jit import mxfp4_even_round_trip

    @triton.jit
    def _round_trip_kernel(x_ptr, y_ptr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs = rows[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        tl.store(y_ptr + offs, mxfp4_even_round_trip(tl.load(x_ptr + offs), BLOCK_M, BLOCK_K, INTERPRET))


def extreme_blocks(seed: int) -> torch.Tensor:
    """bf16 32-blocks at the edges of the range: amax bf16-subnormal (scale 2**-127), just above it, the largest
    scales (an amax rounding past bf16's max gets 2**127), Inf blocks (scale 2**127: Inf stays, the rest -> +-0),
    NaN with and without Inf beside it, -0.0, and random blocks at every 8th exponent from 2**-133 to 2**127."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(-1, 1, 32)
    blocks = [
        ramp * 2.0**-127,
        ramp * 1.5 * 2.0**-125,
        ramp * 6.5 * 2.0**119,
        ramp * 6.5 * 2.0**120,
        torch.cat([torch.tensor([3.3895e38, -2.0**127, -0.0]), ramp[3:] * 2.0**126]),  # bf16 max -> e = 127
        torch.cat([torch.tensor([float("inf"), -1.0, 3.0]), ramp[3:] * 2.0**120]),
        torch.cat([torch.tensor([float("-inf"), float("nan"), 2.0**127]), ramp[3:]]),
        torch.cat([torch.tensor([float("nan"), -5.0, 0.25]), ramp[3:] * 6]),
    ]
    for e in range(-133, 128, 8):
        blocks.append(torch.randn(32, generator=g) * 2.0**e)
    return torch.cat(blocks).to(torch.bfloat16)


def round_trip_reference(x: torch.Tensor) -> torch.Tensor:
    return reference.activation_as_float(x.cpu(), "mxfp4").to(torch.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2**127 -> Inf, in numpy
@pytest.mark.parametrize(
    "block_m, block_k, warps",
    [(16, 64, 4), (64, 64, 8), (32, 128, 4), (16, 32, 8)] if DEV == "cuda" else [(16, 64, 4)],
)
def test_round_trip_in_a_kernel_is_bit_exact(block_m, block_k, warps):
    """The whole in-kernel function (block maxima, exponent, rounding) in tiles of several shapes, against the
    reference round trip: every bit, -0.0 and Inf included. A NaN stays NaN; the rest of a block whose scale
    only the NaN could set is not specified (the reference puts it at 2**127; its GEMM row is NaN anyway)."""
    flat = torch.cat([special_blocks(seed=3), extreme_blocks(seed=4)])
    rows = -(-flat.numel() // (block_m * block_k)) * block_m
    x = torch.zeros(rows * block_k, dtype=torch.bfloat16)
    x[: flat.numel()] = flat
    x = x.reshape(rows, block_k).to(DEV)
    y = torch.full_like(x, float("nan"))
    _round_trip_kernel[(rows // block_m,)](x, y, BLOCK_M=block_m, BLOCK_K=block_k, INTERPRET=DEV != "cuda",
                                            num_warps=warps)  # fmt: skip
    x, y, want = x.cpu(), y.cpu(), round_trip_reference(x)
    blocks = x.reshape(-1, 32)
    nan_scaled = (blocks.isnan().any(dim=1) & ~blocks.isinf().any(dim=1))[:, None].expand(-1, 32).reshape(x.shape)
    assert nan_scaled.any() and torch.equal(y.isnan(), x.isnan())
    checked = ~nan_scaled & ~x.isnan()
    got, want = y[checked].view(torch.int16), want[checked].view(torch.int16)
    differ = (got != want).nonzero()
    assert not len(differ), f"{len(differ)} elements differ, first at flat index {differ[0].item()}"
