"""The in-kernel activation rounding (runtime/kernels/mxfp4_jit.py) against the reference round trip
(``quantize(mode="even")`` then ``dequantize``), bit for bit, in a small kernel (Triton's interpreter here,
compiled on a GPU), on blocks across the whole bf16 range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm_pack.packing.mxfp4 import even_exponent
from glm_pack.runtime import reference
from tests.runtime.kernel_modules import kernel_module
from tests.runtime.ptx_emulator import run_ptx
from tests.runtime.test_triton_bmm import DEV, special_blocks

tb = kernel_module("triton_bmm")  # sets up Triton's interpreter where there is no GPU, before the kernel below
_ok, _why = tb.available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"triton unavailable: {_why}")

gb = kernel_module("gluon_bmm")
SM90 = DEV == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9

if _ok:
    import triton
    import triton.language as tl

    from glm_pack.runtime.kernels.mxfp4_jit import mxfp4_even_round_trip

    @triton.jit
    def _round_trip_kernel(x_ptr, y_ptr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs = rows[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        tl.store(y_ptr + offs, mxfp4_even_round_trip(tl.load(x_ptr + offs), BLOCK_M, BLOCK_K, INTERPRET))


if SM90 and not gb.IMPORT_ERROR:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _ptx_round_trip_kernel(x_ptr, y_ptr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT: gl.constexpr):
        """The Gluon kernels' call: each thread holds runs of ``LAYOUT.size_per_thread[1]`` k."""
        rows = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
        offs = rows[:, None] * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LAYOUT))[None, :]
        PAIRS: gl.constexpr = LAYOUT.size_per_thread[1] // 2
        gl.store(y_ptr + offs, mxfp4_even_round_trip(gl.load(x_ptr + offs), BLOCK_M, BLOCK_K, False, PAIRS))


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
        torch.cat([torch.tensor([3.3895e38, -(2.0**127), -0.0]), ramp[3:] * 2.0**126]),  # bf16 max -> e = 127
        torch.cat([torch.tensor([float("inf"), -1.0, 3.0]), ramp[3:] * 2.0**120]),
        torch.cat([torch.tensor([float("-inf"), float("nan"), 2.0**127]), ramp[3:]]),
        torch.cat([torch.tensor([float("nan"), -5.0, 0.25]), ramp[3:] * 6]),
    ]
    for e in range(-133, 128, 8):
        blocks.append(torch.randn(32, generator=g) * 2.0**e)
    return torch.cat(blocks).to(torch.bfloat16)


def round_trip_reference(x: torch.Tensor) -> torch.Tensor:
    return reference.activation_as_float(x.cpu(), "mxfp4").to(torch.bfloat16)


def block_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The even rule's exponent e of each bf16 32-block (rows of ``blocks``), NaN ignored as the GPU's max does."""
    return even_exponent(blocks.float().abs().nan_to_num(nan=0.0).amax(dim=1))


def round_trip_blocks() -> torch.Tensor:
    """The round trip's test data, bf16 ``[blocks, 32]``: :func:`special_blocks` and :func:`extreme_blocks`,
    which take both paths of the PTX rounding (scales up to 2**119 and from 2**120)."""
    blocks = torch.cat([special_blocks(seed=3), extreme_blocks(seed=4)]).reshape(-1, 32)
    e = block_scales(blocks)
    assert (e < 120).any() and (e >= 120).any()
    return blocks


def assert_round_trip(x: torch.Tensor, y: torch.Tensor) -> None:
    """``y`` is the reference round trip of ``x`` (bf16, 32-blocks along the last dimension), every bit, -0.0
    and Inf included. A NaN stays NaN; the rest of a block whose scale only the NaN could set is not specified
    (the reference puts it at 2**127; its GEMM row is NaN anyway)."""
    x, y, want = x.cpu(), y.cpu(), round_trip_reference(x)
    blocks = x.reshape(-1, 32)
    nan_scaled = (blocks.isnan().any(dim=1) & ~blocks.isinf().any(dim=1))[:, None].expand(-1, 32).reshape(x.shape)
    assert nan_scaled.any() and torch.equal(y.isnan(), x.isnan())
    checked = ~nan_scaled & ~x.isnan()
    got, want = y[checked].view(torch.int16), want[checked].view(torch.int16)
    differ = (got != want).nonzero()
    assert not len(differ), f"{len(differ)} elements differ, first at flat index {differ[0].item()}"


def round_in_kernel(launch, block_m: int, block_k: int) -> None:
    """Run ``launch(x, y, grid)`` on :func:`round_trip_blocks` laid out as ``[rows, block_k]`` (zero-padded to whole
    tiles) and check the result with :func:`assert_round_trip`."""
    flat = round_trip_blocks().reshape(-1)
    rows = -(-flat.numel() // (block_m * block_k)) * block_m
    x = torch.zeros(rows * block_k, dtype=torch.bfloat16)
    x[: flat.numel()] = flat
    x = x.reshape(rows, block_k).to(DEV)
    y = torch.full_like(x, float("nan"))
    launch(x, y, (rows // block_m,))
    assert_round_trip(x, y)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2**127 -> Inf, in numpy
@pytest.mark.parametrize(
    "block_m, block_k, warps",
    [(16, 64, 4), (64, 64, 8), (32, 128, 4), (16, 32, 8)] if DEV == "cuda" else [(16, 64, 4)],
)
def test_round_trip_in_a_kernel_is_bit_exact(block_m, block_k, warps):
    """The portable path (Triton's interpreter here, compiled on a GPU), in tiles of several shapes."""
    round_in_kernel(lambda x, y, grid: _round_trip_kernel[grid](x, y, BLOCK_M=block_m, BLOCK_K=block_k,
                                                                INTERPRET=DEV != "cuda", num_warps=warps),
                    block_m, block_k)  # fmt: skip


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("pairs", [4, 16])
def test_round_ptx_is_bit_exact_in_an_emulator(pairs):
    """The PTX text of the Gluon kernels' rounding, run by a slow interpreter on this CPU (each 32-block's
    pairs in invocations of ``pairs``, with the block's 2**e and 2**-e bits as the kernel computes them), on the
    same blocks as the kernels: both of its paths, against the reference round trip, bit for bit."""
    from glm_pack.runtime.kernels.mxfp4_jit import round_ptx  # after kernel_module set up the interpreter

    blocks = round_trip_blocks()
    e = block_scales(blocks)
    up = torch.where(e >= -126, (e + 127) << 7, 0x40)
    down = torch.where(e <= 126, (127 - e) << 7, 0x40)
    bits = blocks.view(torch.int16).to(torch.int64) & 0xFFFF
    words = (bits[:, 0::2] | (bits[:, 1::2] << 16)).reshape(len(blocks), 16 // pairs, pairs).numpy().astype(np.uint64)
    regs = {f"${pairs + i}": words[:, :, i] for i in range(pairs)}
    regs[f"${2 * pairs}"] = ((up | (up << 16)).numpy().astype(np.uint64))[:, None]
    regs[f"${4 * pairs}"] = ((down | (down << 16)).numpy().astype(np.uint64))[:, None]
    regs = run_ptx(round_ptx(pairs), regs)
    out = torch.from_numpy(np.stack([regs[f"${i}"] for i in range(pairs)], axis=2).astype(np.int64)).reshape(-1, 16)
    got = torch.stack([out & 0xFFFF, out >> 16], dim=2).reshape(blocks.shape).to(torch.int16).view(torch.bfloat16)
    assert_round_trip(blocks, got)


@pytest.mark.skipif(not SM90 or bool(gb.IMPORT_ERROR), reason="needs an sm_90 NVIDIA GPU and Gluon")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("run", [8, 16, 32])
def test_ptx_round_trip_is_bit_exact(run):
    """The PTX rounding of the Gluon kernels, with runs of 8, 16 and 32 k per thread (4, 8, 16 pairs per
    invocation), on the same blocks."""
    layout = gl.BlockedLayout([1, run], [32 * run // 64, 64 // run], [4, 1], [1, 0])  # 64-wide rows
    round_in_kernel(lambda x, y, grid: _ptx_round_trip_kernel[grid](x, y, BLOCK_M=64, BLOCK_K=64, LAYOUT=layout,
                                                                    num_warps=4),
                    64, 64)  # fmt: skip


def test_grid_rounding_is_exact_when_bf16_arithmetic_is_emulated_in_fp32():
    """The compiled portable path rounds a = |x| / 2**e (bf16, at most 6) to the E2M1 grid with ``(a + M) - M``, M = 96
    times a's exponent step, in bf16 arithmetic. AMD GPUs run bf16 adds as fp32 adds rounded to bf16 (as torch does on
    this CPU), so each add rounds twice in principle: for every bf16 a in [0, 6], subnormals included, the result is
    still the reference's round trip of a block whose scale is 1 (amax 6)."""
    a = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    a = a[a.float() <= 6]
    one, ninety_six = (torch.tensor(v, dtype=torch.bfloat16) for v in (1.0, 96.0))
    step = (torch.where(a > one, a, one).view(torch.int16) & 0x7F80).view(torch.bfloat16)  # a's exponent, 1 at least
    magic = step * ninety_six
    rounded = (a + magic) - magic
    blocks = torch.zeros(a.numel(), 32, dtype=torch.bfloat16)
    blocks[:, 0], blocks[:, 1] = a, 6.0
    assert torch.equal(rounded, round_trip_reference(blocks)[:, 0])
