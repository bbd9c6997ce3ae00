"""Triton A16WFP4 batched GEMM against the torch reference (Triton's interpreter on CPU; compiled on a GPU).

The kernel's products are exact in fp32 (MXFP4 or bf16 values), so it may differ from the reference only by
fp32 summation order: each element must lie within ``accumulation_tolerance`` (K * 2**-23 * sum|products|
plus one bf16 ulp). Paths that sum one product per output (identity operands) must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from glm_pack.packing.errors import BackendError
from glm_pack.packing.mxfp4 import dequantize, quantize
from glm_pack.runtime import reference
from tests.runtime.kernel_modules import benchmark_module, kernel_module

tb = kernel_module("triton_bmm")
_ok, _why = tb.available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"triton bmm unavailable: {_why}")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (compiled kernels)")


def tma_here() -> bool:
    """Tensor descriptors work on this device: the interpreter's (emulated), or a GPU with TMA (not an A100)."""
    return DEV == "cpu" or tb._has_tma(torch.device(DEV))


def weights(B, N, K, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    codes, scales = quantize(torch.randn(B, N, K, generator=g) * scale, mode="even")
    return codes.to(DEV), scales.to(DEV)


def activations(M, B, K, seed, row=None):
    """x ``[B, M, K]`` as the runtime passes it: ``q.transpose(0, 1)`` of a ``[M, B, row]`` tensor sliced to K."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(M, B, row or K, generator=g) * 3).to(torch.bfloat16)
    return q.to(DEV)[..., :K].transpose(0, 1)


def poisoned_out(M, B, N, pad=8, offset=0):
    """A ``[B, M, N]`` view, ``offset`` elements into its rows, of a NaN-filled batch-major ``[M, B, offset + N +
    pad]`` buffer (what is outside the view must stay NaN)."""
    buf = torch.full((M, B, offset + N + pad), float("nan"), dtype=torch.bfloat16, device=DEV)
    return buf, buf[..., offset : offset + N].transpose(0, 1)


def ran_or_refused_as_unsafe(x, codes, scales, act_quant, buf, out, config) -> bool:
    """``bmm_a16wfp4`` with a caller's ``config`` into ``out`` (a view of the NaN-filled ``buf``): True when it ran;
    False when it was refused because Triton's code for the config is unsafe on this GPU (Triton 3.6 on sm_90, with
    the activation rounding: :func:`test_dispatch_refuses_unsafe_code_on_sm_90`), with nothing written."""
    try:
        tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out, config=config)
    except BackendError as exc:
        if "is unsafe on this GPU" not in str(exc):
            raise
        assert config is not None and act_quant == "mxfp4" and torch.isnan(buf).all()
        return False
    return True


def assert_close_to_reference(y, x, codes, scales, act_quant):
    ref = reference.bmm_a16wfp4(x, codes, scales, act_quant=act_quant)
    xa = reference.activation_as_float(x, act_quant).abs()
    wa = dequantize(codes, scales).abs()
    tol = tb.accumulation_tolerance(ref, torch.bmm(xa, wa.transpose(1, 2)), x.shape[-1])
    assert not torch.isnan(y).any(), "unwritten output"
    diff = (y.float() - ref.float()).abs()
    assert (diff <= tol).all(), f"max |y - ref| / tol = {(diff / tol).max():.3g}"


@pytest.mark.parametrize("act_quant", ["mxfp4", "none"])
@pytest.mark.parametrize(
    "B, M, N, K, row",
    [(1, 1, 32, 64, 64), (3, 17, 64, 192, 256), (2, 5, 48, 256, 256), (2, 33, 40, 96, 128), (1, 2, 64, 512, 512)],
)
def test_matches_reference_on_strided_views(B, M, N, K, row, act_quant):
    codes, scales = weights(B, N, K, seed=M + K)
    x = activations(M, B, K, seed=K, row=row)
    buf, out = poisoned_out(M, B, N)
    got = tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out)
    assert got.data_ptr() == out.data_ptr() and got.stride() == out.stride()
    assert torch.isnan(buf[..., N:]).all(), "wrote past N"
    assert_close_to_reference(out, x, codes, scales, act_quant)


KERNELS = pytest.mark.parametrize(
    "config",
    [
        tb.BmmConfig(16, 32, 32, 4, 1, 3),
        tb.BmmConfig(32, 64, 64, 4, 1, 0),
        tb.BmmConfig(32, 64, 64, 4, 1, 0, predecode=True),
        tb.BmmConfig(32, 64, 64, 4, 1, 0, predecode=True, tma=True),
    ],
    ids=["weights-stationary", "tiled", "predecode", "predecode-tma"],
)


@KERNELS
def test_every_kernel_shape_matches_reference(config):
    B, M, N, K = 2, 37, 80, 192
    codes, scales = weights(B, N, K, seed=7)
    x = activations(M, B, K, seed=8, row=256)
    buf, out = poisoned_out(M, B, N)
    tb.bmm_a16wfp4(x, codes, scales, out=out, config=config)
    assert torch.isnan(buf[..., N:]).all()
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


@pytest.mark.parametrize("row", [256, 196], ids=["aligned", "unaligned-copied"])
def test_tma_config_reads_an_x_descriptors_cannot_address_from_an_aligned_copy(row, monkeypatch):
    """x rows 196 bf16 apart are not 16-byte aligned, so no descriptor can address x: the call copies x into an
    aligned buffer and the TMA kernel reads that (rows 256 apart: x itself). On a GPU without TMA the tiled kernel
    reads x as it is."""
    B, M, N, K = 2, 37, 80, 192
    codes, scales = weights(B, N, K, seed=3)
    x = activations(M, B, K, seed=4, row=row)
    x_before = x.clone()
    buf, out = poisoned_out(M, B, N)
    read = []
    real = tb._prepare_tma
    monkeypatch.setattr(tb, "_prepare_tma", lambda *a: read.append(a[0]) or real(*a))
    tb.bmm_a16wfp4(x, codes, scales, out=out, config=tb.BmmConfig(32, 64, 64, 4, 1, 0, predecode=True, tma=True))
    assert len(read) == tma_here()
    for staged in read:
        assert tb.tma_strides_ok(staged) and (staged.data_ptr() == x.data_ptr()) == (row == 256)
    assert torch.equal(x, x_before)
    assert torch.isnan(buf[..., N:]).all()
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


@pytest.mark.parametrize(
    "config, copied", [(tb.BmmConfig(16, 32, 64, 2, 3, 0), True), (tb.BmmConfig(16, 64, 64, 4, 1, 0), False)],
    ids=["two-warps", "four-warps"],
)
def test_tiled_kernel_on_two_warps_reads_an_x_off_16_bytes_from_an_aligned_copy(config, copied, monkeypatch):
    """x starting 2 bytes past 16: the tiled kernel on 2 warps (the H200's K-up 192 default up to 32 heads and 16
    tokens) reads an aligned copy of it; on 4 warps (its 64-head default) x itself, where a copy first was slightly
    slower on the H200. x is never written."""
    B, M, N, K = 4, 16, 512, 192
    codes, scales = weights(B, N, K, seed=46)
    x = activations(M, B, K + 1, seed=47, row=256)[..., 1:]
    assert x.data_ptr() % 16 == 2
    x_before = x.clone()
    read = []
    real = tb.KernelLaunch

    def launch(kernel, grid, consts):
        run = real(kernel, grid, consts)
        return lambda *args: (kernel is tb._bmm_tiled_kernel and read.append(args[0])) or run(*args)

    monkeypatch.setattr(tb, "KernelLaunch", launch)
    buf, out = poisoned_out(M, B, N)
    tb.bmm_a16wfp4(x, codes, scales, out=out, config=config)
    ((staged,),) = [read]
    assert (staged.data_ptr() % 16 == 0) == copied and (staged.data_ptr() == x.data_ptr()) == (not copied)
    assert torch.equal(staged, x) and torch.equal(x, x_before)
    assert torch.isnan(buf[..., N:]).all()
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


def test_tma_config_falls_back_for_an_out_descriptors_cannot_address(monkeypatch):
    """An out whose rows are 84 bf16 apart (not 16-byte aligned) gets the tiled kernel, like such an x."""
    B, M, N, K = 2, 37, 80, 192
    codes, scales = weights(B, N, K, seed=3)
    x = activations(M, B, K, seed=4, row=256)
    buf, out = poisoned_out(M, B, N, pad=4)
    monkeypatch.setattr(tb, "_prepare_tma", lambda *a: pytest.fail("TMA kernel prepared"))
    tb.bmm_a16wfp4(x, codes, scales, out=out, config=tb.BmmConfig(32, 64, 64, 4, 1, 0, predecode=True, tma=True))
    assert torch.isnan(buf[..., N:]).all()
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


_REFUSALS = {
    # the GPU refuses to load the kernel: it needs more shared memory than the GPU has
    "shared memory": (lambda: tb.triton.runtime.errors.OutOfResources(98_304, 65_536, "shared memory"),
                      "does not fit this GPU"),  # fmt: skip
    # Triton's code for it writes a pending wgmma's A registers (KernelLaunch checks before launching)
    "unsafe code": (lambda: tb.UnsafeKernel("_bmm_tiled_kernel: ... (triton-lang/triton#9433)"),
                    "is unsafe on this GPU"),  # fmt: skip
}


@pytest.mark.parametrize("refusal", _REFUSALS)
def test_a_default_config_the_gpu_refuses_falls_back_to_one_stage(monkeypatch, refusal):
    """The default config's kernel refused at its first launch is replaced by the same tiles unpipelined, for this
    call and, without preparing again, the next with its signature; a config the caller chose that is refused is an
    error naming it and why."""
    error, why = _REFUSALS[refusal]

    def refused(*tensors):
        raise error()

    B, M, N, K = 2, 37, 80, 192
    codes, scales = weights(B, N, K, seed=21)
    x = activations(M, B, K, seed=22, row=256)
    prepared, real_prepare = [], tb._prepare

    def small_gpu(x, w_codes, w_scales, act_quant, out, config):
        prepared.append(config)
        return refused if config is None else real_prepare(x, w_codes, w_scales, act_quant, out, config)

    monkeypatch.setattr(tb, "_prepare", small_gpu)
    # a default of 3 stages (the interpreter's has one already): the fallback runs its tiles in one
    monkeypatch.setattr(tb, "config_for", lambda *args: tb.BmmConfig(32, 64, 64, 4, 3, 0))
    for _ in range(2):
        buf, out = poisoned_out(M, B, N)
        tb.bmm_a16wfp4(x, codes, scales, out=out)
        assert_close_to_reference(out, x, codes, scales, "mxfp4")
    assert prepared == [None, tb.BmmConfig(32, 64, 64, 4, 1, 0)]
    monkeypatch.setattr(tb, "_prepare", lambda *args: refused)
    chosen = tb.BmmConfig(32, 64, 64, 4, 1, 0)
    with pytest.raises(BackendError, match=rf"config BmmConfig\(block_m=32.* {why}"):
        tb.bmm_a16wfp4(x, codes, scales, config=chosen)


@gpu_only
def test_a_config_the_gpu_refuses_for_shared_memory_is_a_backend_error():
    """Triton's own refusal on a real GPU (no stand-in): six stages of 128 x 256 tiles on predecoded weights need
    about 288 KiB of shared memory, more than any GPU has; the output is left as it was."""
    B, M, N, K = 1, 256, 256, 512
    codes, scales = weights(B, N, K, seed=23)
    x = activations(M, B, K, seed=24)
    buf, out = poisoned_out(M, B, N)
    huge = tb.BmmConfig(128, 256, 64, 8, 6, 0, predecode=True)
    with pytest.raises(BackendError, match="does not fit this GPU"):
        tb.bmm_a16wfp4(x, codes, scales, out=out, config=huge)
    assert torch.isnan(buf).all()


def _glm_defaults() -> set:
    """(N, K, config) of every tuned default and the large-M rule's, at GLM's K-up / V-up shapes (compiled-GPU
    defaults: call with ``_INTERPRETED`` off)."""
    defaults = {(N, K, cfg) for (N, K, _, _), cfg in tb._TUNED.items()}
    return defaults | {(N, K, tb._large_m(K, rows)) for N, K in ((512, 192), (512, 256), (256, 512))
                       for rows in (512, 10**6)}  # fmt: skip


def test_every_default_config_unpipelined_is_a_portable_config(monkeypatch):
    """What each tuned or large-M default falls back to is accepted as a config and runs a portable kernel: same
    tiles, one stage, no Gluon, TMA or rounding warps."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)  # the interpreter has one small config for every shape
    for N, K, cfg in _glm_defaults():
        small = tb.unpipelined(cfg)
        assert (small.block_m, small.block_n, small.block_k, small.num_warps) == (
            cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps)  # fmt: skip
        assert (small.num_stages, small.wgmma, small.tma, small.ws) == (1, "", False, False)
        x = torch.empty(2, 3, K, dtype=torch.bfloat16, device="meta")
        codes = torch.empty(2, N, K // 2, dtype=torch.uint8, device="meta")
        scales = torch.empty(2, N, K // 32, dtype=torch.uint8, device="meta")
        tb._prepare(x, codes, scales, "mxfp4", torch.empty(2, 3, N, dtype=torch.bfloat16, device="meta"), small)


def identity_weights(B, K):
    """MXFP4 identity ``[B, K, K]``: code 2 (1.0) on the diagonal, scale 127, so ``y = act(x)`` exactly."""
    codes = torch.zeros(B, K, K // 2, dtype=torch.uint8)
    n = torch.arange(K)
    codes[:, n, n // 2] = torch.where(n % 2 == 0, 0x02, 0x20).to(torch.uint8)
    return codes.to(DEV), torch.full((B, K, K // 32), 127, dtype=torch.uint8, device=DEV)


def special_blocks(seed):
    """Rows of 32-blocks that pin down the even rule: zeros, E2M1 ties (0.25 ... 5) with amax 6, amax with a
    mantissa >= 1.75 (exponent bump), saturation (6.875 -> 6), -0.0, and random blocks at scales 2**-30..2**25."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    past_ties = (ties.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()  # next magnitude up
    blocks = [
        torch.zeros(32),
        torch.cat([ties, past_ties, torch.zeros(2)]) * 2.0**-3,
        torch.cat([torch.tensor([7.0, -0.9, 0.3, 1.9]), torch.linspace(-3, 3, 28)]),
        torch.cat([torch.tensor([6.875, -6.5, 6.25, 5.5, -0.0]), torch.linspace(-6, 6, 27)]) * 2.0**10,
    ]
    g = torch.Generator().manual_seed(seed)
    for e in range(-30, 30, 5):
        blocks.append(torch.randn(32, generator=g) * 2.0**e)
    return torch.cat(blocks).to(torch.bfloat16)


@pytest.mark.parametrize("act_quant", ["mxfp4", "none"])
def test_activation_path_is_bit_exact(act_quant):
    K, B = 64, 2
    flat = special_blocks(seed=3)
    x = torch.stack([flat, flat.roll(32)]).reshape(B, -1, K).to(DEV)  # [B, M, K], blocks in both halves of K
    codes, scales = identity_weights(B, K)
    y = tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant)
    expected = reference.activation_as_float(x, act_quant).to(torch.bfloat16)
    assert torch.equal(y, expected)  # -0.0 == 0.0; everything else bit for bit


@pytest.mark.parametrize("M", [3, 300] if DEV == "cuda" else [3])
def test_nan_activation_gives_a_nan_output_row(M):
    """A NaN activation makes its output row NaN (the codec's +-0 would hide it, so the reference keeps it)
    and leaves every other row as the reference has it."""
    B, N, K = 2, 64, 256
    codes, scales = weights(B, N, K, seed=11)
    x = activations(M, B, K, seed=12).contiguous()
    x[1, M // 2, 37] = float("nan")
    y = tb.bmm_a16wfp4(x, codes, scales)
    assert y[1, M // 2].isnan().all()
    rows = [m for m in range(M) if m != M // 2]
    assert_close_to_reference(y[:1], x[:1], codes[:1], scales[:1], "mxfp4")
    assert_close_to_reference(y[1:, rows], x[1:, rows], codes[1:], scales[1:], "mxfp4")


@KERNELS
@pytest.mark.parametrize("act_quant", ["mxfp4", "none"])
def test_subnormals_are_exact_in_every_kernel(config, act_quant):
    """bf16 subnormals pass through exactly: every positive and negative subnormal activation against identity
    weights gives ``act(x)``; weights at scale bytes 0 and 1 (values down to 2**-128) against ``2**100 * I``
    give ``2**100 * W^T`` (the Triton interpreter's own bf16 -> fp32 cast would flush or misread them)."""
    B, K = 2, 64
    bits = torch.arange(1, 0x80, dtype=torch.int16)
    sub = torch.cat([bits, bits | -0x8000, torch.tensor([0x0080, 0], dtype=torch.int16)]).view(torch.bfloat16)
    x = sub.reshape(1, 4, K).expand(B, 4, K).to(DEV)  # 127 + 127 subnormals, the smallest normal, zero
    codes, scales = identity_weights(B, K)
    y = tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, config=config)
    assert torch.equal(y, reference.activation_as_float(x, act_quant).to(torch.bfloat16))
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (B, K, K // 2), generator=g, dtype=torch.uint8).to(DEV)
    # scale bytes 0 / 1 (2**-127 / 2**-126); the compiled dot_scaled path reads byte 0 as 0 (triton_bmm's
    # documented corner case, test_dot_scaled_reads_scale_byte_0_as_zero), so there bytes 1 / 2
    low = 1 if DEV == "cuda" and not (config.tiles_m or config.predecode) else 0
    scales = torch.randint(low, low + 2, (B, K, K // 32), generator=g, dtype=torch.uint8).to(DEV)
    big = (torch.eye(K) * 2.0**100).to(torch.bfloat16).expand(B, K, K).to(DEV)
    y = tb.bmm_a16wfp4(big, codes, scales, act_quant=act_quant, config=config)
    assert torch.equal(y.transpose(1, 2), (dequantize(codes, scales).double() * 2.0**100).to(torch.bfloat16))


@gpu_only
def test_dot_scaled_reads_scale_byte_0_as_zero():
    """Pins the compiled tiled kernel's documented corner case: Triton's ``dot_scaled`` upcast turns E8M0 byte
    0 (2**-127) into 0, so such a block contributes nothing where the reference has code * 2**-127 (the even
    rule gives byte 0 only where a block's amax is below 2**-124). If Triton changes, this test says so."""
    codes = torch.full((1, 32, 16), 0x22, dtype=torch.uint8, device=DEV)  # 1.0 everywhere
    scales = torch.zeros(1, 32, 1, dtype=torch.uint8, device=DEV)
    x = torch.full((1, 1, 32), 2.0**100, dtype=torch.bfloat16, device=DEV)
    want = reference.bmm_a16wfp4(x, codes, scales, act_quant="none")
    assert (want == 32 * 2.0**-27).all()
    y = tb.bmm_a16wfp4(x, codes, scales, act_quant="none", config=tb.BmmConfig(16, 32, 32, 4, 1, 0))
    assert (y == 0).all()


def test_weight_decode_is_bit_exact():
    """x = identity with act_quant="none" turns y into dequant(W)^T: every nibble, scales from 2**-127 up."""
    B, N, K = 2, 64, 64
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (B, N, K // 2), generator=g, dtype=torch.uint8)
    codes[0, :8] = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # all 256 code pairs
    scales = torch.randint(60, 190, (B, N, K // 32), generator=g, dtype=torch.uint8)
    scales[1, 0, 0] = 1
    codes, scales = codes.to(DEV), scales.to(DEV)
    eye = torch.eye(K, dtype=torch.bfloat16, device=DEV).expand(B, K, K)
    y = tb.bmm_a16wfp4(eye, codes, scales, act_quant="none")
    assert torch.equal(y.transpose(1, 2), dequantize(codes, scales, dtype=torch.bfloat16))


def test_allocates_batch_major_output():
    B, M, N, K = 3, 5, 32, 64
    codes, scales = weights(B, N, K, seed=1)
    y = tb.bmm_a16wfp4(activations(M, B, K, seed=2), codes, scales)
    assert y.shape == (B, M, N) and y.stride() == (N, B * N, 1)  # a view of a [M, B, N] buffer


def test_a_signature_is_prepared_once(monkeypatch):
    """Later calls with the same shapes, strides, alignment, devices and options reuse the first call's launches
    (fresh data, still the reference's result; out=None allocates a new buffer each time); x one element off its
    16-byte alignment, other strides or other options prepare anew."""
    prepared = []
    real = tb._prepare
    monkeypatch.setattr(tb, "_prepare", lambda *a: prepared.append(a[3]) or real(*a))
    B, M, N, K = 2, 20, 64, 64
    outs = []
    for seed in (1, 2):
        codes, scales = weights(B, N, K, seed=seed)
        x = activations(M, B, K, seed=seed + 10, row=128)
        for act_quant in ("mxfp4", "none"):
            buf, out = poisoned_out(M, B, N)
            tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out)
            assert_close_to_reference(out, x, codes, scales, act_quant)
        outs.append(tb.bmm_a16wfp4(x, codes, scales))
        assert_close_to_reference(outs[-1], x, codes, scales, "mxfp4")
    assert prepared == ["mxfp4", "none", "mxfp4"] and outs[0].data_ptr() != outs[1].data_ptr()
    q = activations(M, B, K + 16, seed=3, row=136)  # row 136: rows stay 16-byte aligned, the view is 2 bytes off
    x = q[..., 1 : K + 1]
    assert x.data_ptr() % 16 == 2
    buf, out = poisoned_out(M, B, N)
    tb.bmm_a16wfp4(x, codes, scales, out=out)
    assert_close_to_reference(out, x, codes, scales, "mxfp4")
    assert len(prepared) == 4


def test_x_off_its_16_byte_alignment_is_prepared_apart(monkeypatch):
    """Two x of the same shape and strides, one starting an element (2 bytes) into the other's rows: the second,
    which tensor descriptors cannot address, gets its own launches, which copy it into an aligned buffer for the same
    TMA kernel (on a GPU without TMA, both the tiled kernel's, on x as it is)."""
    B, M, N, K = 2, 20, 64, 64
    codes, scales = weights(B, N, K, seed=1)
    q = activations(M, B, K + 16, seed=2, row=128)
    tma = []
    real = tb._prepare_tma
    monkeypatch.setattr(tb, "_prepare_tma", lambda *a: tma.append(a[0].data_ptr() % 16) or real(*a))
    cfg = tb.BmmConfig(32, 64, 64, 4, 1, 0, predecode=True, tma=True)
    for x in (q[..., :K], q[..., 1 : K + 1]):
        _, out = poisoned_out(M, B, N)
        tb.bmm_a16wfp4(x, codes, scales, out=out, config=cfg)
        assert_close_to_reference(out, x, codes, scales, "mxfp4")
    assert tma == ([0, 0] if tma_here() else []) and len(tb._PREPARED) == 2


@pytest.mark.parametrize("B, M, N", [(2, 0, 32), (0, 3, 32), (2, 3, 0)], ids=["no-tokens", "no-heads", "no-columns"])
def test_an_empty_call_returns_without_a_launch(monkeypatch, B, M, N):
    """Nothing to compute: the empty ``[B, M, N]`` output, and no kernel launch prepared (a grid with a zero, or a
    tensor descriptor of a zero-sized dimension, is not one a GPU takes)."""
    monkeypatch.setattr(tb, "KernelLaunch", lambda *args, **kwargs: pytest.fail("a kernel launch was prepared"))
    codes, scales = (torch.zeros(B, N, k, dtype=torch.uint8, device=DEV) for k in (32, 2))
    y = tb.bmm_a16wfp4(torch.zeros(B, M, 64, dtype=torch.bfloat16, device=DEV), codes, scales)
    assert y.shape == (B, M, N)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    """Compiled kernels (no TRITON_INTERPRET at import) take GPU tensors only."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)
    monkeypatch.setattr(tb, "available", lambda: (True, "ok"))
    codes, scales = weights(2, 32, 64, seed=1)
    with pytest.raises(BackendError, match="tensors on cpu need a GPU"):
        tb.bmm_a16wfp4(activations(3, 2, 64, seed=2).cpu(), codes.cpu(), scales.cpu())


def test_an_out_with_a_zero_stride_only_on_a_size_one_axis_is_written():
    """A zero stride aliases elements only along an axis longer than one: one token (M = 1) with stride 0 is a
    plain out, written like any other."""
    codes, scales = weights(2, 32, 64, seed=3)
    x = activations(1, 2, 64, seed=4)
    buf = torch.full((2, 32), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = buf.as_strided((2, 1, 32), (32, 0, 1))
    tb.bmm_a16wfp4(x, codes, scales, out=out)
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


def test_prepared_launches_are_bounded(monkeypatch):
    """The signature cache starts over when full (prefill sizes vary without bound)."""
    monkeypatch.setattr(tb, "_MAX_PREPARED", 2)
    codes, scales = weights(1, 32, 64, seed=5)
    for M in (1, 2, 3, 4, 5):
        tb.bmm_a16wfp4(activations(M, 1, 64, seed=M), codes, scales)
        assert 1 <= len(tb._PREPARED) <= 2


def test_block_k_is_the_largest_power_of_two_up_to_the_cap_dividing_k():
    assert [tb._block_k(K, 64) for K in (32, 64, 96, 160, 192, 512)] == [32, 64, 32, 32, 64, 64]
    assert [tb._block_k(K, 128) for K in (128, 192, 256, 384)] == [128, 64, 128, 128]


def test_accumulation_tolerance_units():
    ref = torch.tensor([1.0, 3.0, 0.0], dtype=torch.bfloat16)
    tol = tb.accumulation_tolerance(ref, torch.tensor([0.0, 0.0, 2.0**10]), K=8)
    assert tol[0] == 2.0**-7 and tol[1] == 2.0**-6  # one bf16 ulp at 1 and at 3
    assert tol[2] > 8 * 2.0**-23 * 2.0**10


def _at_k192(args: dict, config) -> None:
    codes, scales = weights(2, 32, 192, seed=1)
    args.update(x=activations(3, 2, 192, seed=2), w_codes=codes, w_scales=scales, config=config)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(x=a["x"][..., :32]), "K=32 but w_codes packs K=64"),
        (lambda a: a.update(x=a["x"].float()), "x must be a 3-D torch.bfloat16"),
        (lambda a: a.update(x=a["x"][0]), "x must be a 3-D"),
        (lambda a: a.update(w_codes=a["w_codes"].to(torch.int8)), "w_codes must be a 3-D torch.uint8"),
        (lambda a: a.update(w_scales=a["w_scales"][..., :1]), "w_scales must be"),
        (lambda a: a.update(w_codes=a["w_codes"][:1], w_scales=a["w_scales"][:1]), "B=2 batches, w_codes 1"),
        (lambda a: a.update(act_quant="fp8"), "act_quant must be one of"),
        (lambda a: a.update(out=torch.empty(2, 3, 31, dtype=torch.bfloat16, device=DEV)), "out must be"),
        (lambda a: a.update(out=torch.empty(2, 3, 32, device=DEV)), "out must be a 3-D torch.bfloat16"),
        (lambda a: a.update(out=torch.empty(1, 1, 32, dtype=torch.bfloat16, device=DEV).expand(2, 3, 32)), "zero"),
        (lambda a: a.update(config=tb.BmmConfig(16, 32, 48, 4, 1, 1)), "block_k=48"),
        (lambda a: a.update(config=tb.BmmConfig(8, 32, 64, 4, 1, 1)), "bad config"),
        (lambda a: a.update(config=tb.BmmConfig(16, 32, 64, 4, 1, 2, True)), "predecode needs the tiled kernel"),
        (lambda a: a.update(config=tb.BmmConfig(16, 32, 64, 4, 1, 0, tma=True)), "tma reads decoded weights"),
        (lambda a: a.update(x=a["x"][..., :48], w_codes=a["w_codes"][..., :24], w_scales=a["w_scales"][..., :1]),
         "K=48 must be a positive multiple of 32"),
        (lambda a: a.update(w_codes=torch.cat([a["w_codes"], a["w_codes"][:1]])), "B=2 batches, w_codes 3"),
        (lambda a: a.update(x=a["x"][..., :0], w_codes=a["w_codes"][..., :0], w_scales=a["w_scales"][..., :0]),
         "K=0 must be a positive multiple of 32"),
        (lambda a: a.update(w_scales=a["w_scales"].to("meta")), "different devices"),
        (lambda a: a.update(out=torch.empty(2, 3, 32, dtype=torch.bfloat16, device="meta")), "different devices"),
        (lambda a: a.update(config=tb.BmmConfig(48, 32, 64, 4, 1, 1)), "bad config"),  # block_m no power of two
        (lambda a: a.update(config=tb.BmmConfig(16, 32, 64, 4, 1, -1)), "bad config"),  # tiles_m < 0: no M tile
        (lambda a: _at_k192(a, tb.BmmConfig(16, 32, 96, 4, 1, 1)), "block_k=96"),  # divides K = 192, no power of two
    ],
)
def test_rejects_calls_outside_the_contract(mutate, match):
    codes, scales = weights(2, 32, 64, seed=1)
    args = dict(x=activations(3, 2, 64, seed=2), w_codes=codes, w_scales=scales, act_quant="mxfp4", out=None)
    mutate(args)
    x, w_codes, w_scales = args.pop("x"), args.pop("w_codes"), args.pop("w_scales")
    with pytest.raises(BackendError, match=match):
        tb.bmm_a16wfp4(x, w_codes, w_scales, **args)


@gpu_only
@pytest.mark.parametrize("T", [1, 16, 300])
@pytest.mark.parametrize("op", [(512, 192, 256), (512, 256, 256), (256, 512, 512)], ids=["kup192", "kup256", "vup"])
def test_glm_shapes_on_gpu_all_kernels(op, T):
    """Each kernel's result, or a refusal of Triton's code for a config as unsafe on this GPU (pipelined tiles with
    the activation rounding on sm_90: :func:`test_dispatch_refuses_unsafe_code_on_sm_90`) with nothing written."""
    N, K, row = op
    H = 16
    codes, scales = weights(H, N, K, seed=T)
    x = activations(T, H, K, seed=T + 1, row=row)
    C = tb.BmmConfig
    pre, tma = C(64, 128, 64, 8, 3, 0, predecode=True), C(128, 256, 64, 8, 3, 0, predecode=True, tma=True)
    for config in (None, C(64, 64, 64, 4, 2, 0), C(16, 32, 64, 4, 2, 2), pre, tma):
        for act_quant in ("mxfp4", "none"):
            buf, out = poisoned_out(T, H, N)
            if ran_or_refused_as_unsafe(x, codes, scales, act_quant, buf, out, config):
                assert_close_to_reference(out, x, codes, scales, act_quant)


sm_90_triton_3_6 = pytest.mark.skipif(
    DEV == "cpu" or torch.cuda.get_device_capability() != (9, 0) or not tb.triton.__version__.startswith("3.6."),
    reason="needs an sm_90 GPU (H100 / H200) and Triton 3.6",
)


@sm_90_triton_3_6
def test_dispatch_refuses_unsafe_code_on_sm_90(monkeypatch):
    """Triton 3.6's code for 128 x 256 tiles of 8 warps in 3 stages (tiled and TMA kernels, on predecoded weights) with
    the activation rounding loads the next K step's A fragments into registers wgmma MMAs still in flight read
    (triton-lang/triton#9433; test_compile_targets.py finds it in their PTX for sm_90): a caller's config is
    refused, nothing written; without the rounding it runs. A default call where the Gluon kernels cannot run (V-up
    at 1025 tokens, whose large-M config then takes the TMA kernel in those tiles) falls back to the same tiles
    unpipelined, the reference's result."""
    H, T, N, K = 16, 1025, 256, 512
    codes, scales = weights(H, N, K, seed=31)
    x = activations(T, H, K, seed=32, row=K)
    C = tb.BmmConfig
    for config in (C(128, 256, 64, 8, 3, 0, predecode=True), C(128, 256, 64, 8, 3, 0, predecode=True, tma=True)):
        buf, out = poisoned_out(T, H, N)
        unsafe = r"is unsafe on this GPU: .* the A operand of the wgmma.mma_async at line \d+, .*triton#9433"
        with pytest.raises(BackendError, match=unsafe):
            tb.bmm_a16wfp4(x, codes, scales, out=out, config=config)
        assert torch.isnan(buf).all()
        tb.bmm_a16wfp4(x, codes, scales, act_quant="none", out=out, config=config)
        assert_close_to_reference(out, x, codes, scales, "none")
    fallbacks, unpipelined = [], tb.unpipelined
    monkeypatch.setattr(tb, "unpipelined", lambda cfg: fallbacks.append(cfg) or unpipelined(cfg))
    monkeypatch.setattr(tb, "_PREPARED", {})  # prepared by another test: no fallback seen
    monkeypatch.setattr(tb.gluon_bmm, "unusable_reason", lambda *tensors: "Gluon cannot run here")
    _, out = poisoned_out(T, H, N)
    tb.bmm_a16wfp4(x, codes, scales, out=out)
    default = tb.config_for(H, T, N, K, x.device)
    assert default.tma and (default.block_m, default.block_n, default.num_stages) == (128, 256, 3)
    assert fallbacks == [default]
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


def test_untuned_shapes_take_the_general_rules_by_rows(monkeypatch):
    """A shape without tuned entries (N = 96, K = 64): one config from 17 to 64 rows, another from 65 to 256, the
    large-M rule only above 256 rows."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)

    def cfg(M):
        return tb.default_config(2, M, 96, 64)

    assert cfg(17) == cfg(64) != cfg(65) == cfg(256) != cfg(257) == tb._large_m(64, 2 * 257)
    assert cfg(256) != tb._large_m(64, 2 * 256)


def test_default_config_takes_the_first_bucket_that_holds_the_rows(monkeypatch):
    """Buckets of 16, 32, 64, 128 and 256 rows: V-up at 16 heads takes its 16-row entry up to 16 rows, the 32-row
    one from 17 to 32, the 64-row one from 33, the 256-row one from 65 (no 128-row entry), the large-M rule above
    256; a bucket without an entry for the shape takes the next one's (here with the 32-row entry removed).
    Compiled-kernel defaults, as on a GPU."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)

    def key(bucket):
        return 256, 512, "narrow", bucket

    assert tb.default_config(16, 16, 256, 512) == tb._TUNED[key(16)]
    assert tb.default_config(16, 17, 256, 512) == tb.default_config(16, 32, 256, 512) == tb._TUNED[key(32)]
    assert tb.default_config(16, 33, 256, 512) == tb.default_config(16, 64, 256, 512) == tb._TUNED[key(64)]
    assert tb.default_config(16, 65, 256, 512) == tb.default_config(16, 256, 256, 512) == tb._TUNED[key(256)]
    assert tb.default_config(16, 513, 256, 512) == tb._large_m(512, 16 * 513)
    monkeypatch.delitem(tb._TUNED, key(32))
    assert tb.default_config(16, 20, 256, 512) == tb._TUNED[key(64)]


def test_few_large_tiles_keep_the_256_row_config(monkeypatch):
    """Above 256 rows a GLM shape keeps its "narrow" 256-row entry while the large-M tiles (128 x 256) would number
    at most FEW_LARGE_TILES: K-up at 8 heads (GLM at TP 8) up to 512 tokens (8 x 2 x 4 = 64 tiles), not from 513;
    16 heads of V-up up to 512; 5 heads x 600 tokens of K-up (375 rows as 8 heads, 50 tiles). V-up at 8 heads has
    "few" entries up to 1024 rows as 8 heads (8 x 1 x 8 = 64 tiles), then the large-M rule from 1025 (72). Shapes
    without a tuned entry keep the large-M rule."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)
    vup, kup192, kup256 = (256, 512, "narrow", 256), (512, 192, "narrow", 256), (512, 256, "narrow", 256)
    few_512, few_1024 = tb._TUNED[(256, 512, "few", 512)], tb._TUNED[(256, 512, "few", 1024)]
    assert tb.default_config(8, 300, 256, 512) == tb.default_config(4, 1024, 256, 512) == few_512
    assert tb.default_config(8, 513, 256, 512) == tb.default_config(1, 8192, 256, 512) == few_1024
    assert tb.default_config(8, 1025, 256, 512) == tb._large_m(512, 8 * 1025)
    assert tb.default_config(16, 512, 256, 512) == tb._TUNED[vup]
    assert tb.default_config(8, 512, 512, 192) == tb._TUNED[kup192]
    assert tb.default_config(8, 513, 512, 192) == tb._large_m(192, 8 * 513)
    assert tb.default_config(1, 4096, 512, 256) == tb._TUNED[kup256]  # 512 rows as 8 heads; 1 x 2 x 32 = 64 tiles
    assert tb.default_config(5, 600, 512, 256) == tb._TUNED[kup256]
    assert tb.default_config(2, 2048, 96, 64) == tb._large_m(64, 2 * 2048)  # no tuned entry


def test_heads_classes_and_few_heads_rows_as_eight_heads(monkeypatch):
    """Heads classes by the head counts their entries were measured at (8, 16, 32 for 24-32, 64; K-up's "wide" from
    33 heads, V-up's from 64).
    Up to FEW_HEADS (8) heads a GLM shape's bucket is that of ``B * M / 8`` rows (the 8-head call with as many
    one-tile programs), where it takes its "few" entry, else the "narrow" (16-head) one of the same bucket, not
    the next bucket's; from 9 heads the class's entries by M."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)
    kup = ["few", "few", "narrow", "narrow", "half", "half", "wide"]
    assert [tb.heads_class(B, 512) for B in (1, 8, 9, 23, 24, 32, 33)] == kup
    vup = [*kup[:-1], "narrow", "narrow", "wide"]
    assert [tb.heads_class(B, 256) for B in (1, 8, 9, 23, 24, 32, 33, 63, 64)] == vup

    def entry(N, K, spread, bucket):
        return tb._TUNED[(N, K, spread, bucket)]

    assert tb.default_config(8, 64, 512, 192) == tb.default_config(4, 128, 512, 192) == entry(512, 192, "few", 64)
    assert tb.default_config(8, 65, 512, 192) == tb.default_config(1, 1024, 512, 192) == entry(512, 192, "few", 128)
    assert tb.default_config(8, 129, 512, 192) == tb.default_config(2, 1024, 512, 192) == entry(512, 192, "narrow", 256)
    assert tb.default_config(8, 16, 512, 192) == tb.default_config(1, 128, 512, 192) == entry(512, 192, "narrow", 16)
    # 129 rows of one head are 17 rows as 8 heads (rounded up, not down to 16): the 32-row bucket
    assert tb.default_config(1, 129, 512, 192) == tb.default_config(8, 17, 512, 192) == entry(512, 192, "narrow", 32)
    assert tb.default_config(8, 1, 256, 512) == tb.default_config(2, 128, 256, 512) == entry(256, 512, "few", 16)
    assert tb.default_config(8, 65, 256, 512) == tb.default_config(1, 2048, 256, 512) == entry(256, 512, "few", 256)
    assert tb.default_config(8, 256, 512, 256) == tb.default_config(3, 600, 512, 256) == entry(512, 256, "few", 256)
    assert tb.default_config(9, 64, 512, 192) == entry(512, 192, "narrow", 64)
    assert tb.default_config(9, 1, 256, 512) == entry(256, 512, "narrow", 16)
    assert tb.default_config(32, 100, 512, 256) == entry(512, 256, "half", 128)  # "half": by M, every bucket
    # shapes without tuned entries: the generic rules by M and their own fill criterion (8 x 2048 / 64 = 256 tiles)
    assert tb.default_config(8, 16, 2048, 128) == tb.default_config(64, 16, 2048, 128)
    wide = tb.default_config(8, 16, 2048, 128)
    assert tb.default_config(8, 16, 1984, 128) == tb.default_config(4, 16, 1984, 128) != wide
    assert entry(256, 512, "few", 16) != entry(256, 512, "narrow", 16)


def test_register_fit_keeps_each_default_within_the_register_budget(monkeypatch):
    """Off sm_90 every default becomes a portable tile of at most 64 fp32 accumulators a thread, 8
    warps and 64-deep K steps (256 for 16-row tiles), neither Gluon nor TMA, the kernel choice (predecoded weights,
    weights-stationary) kept, a tuned portable config that fits kept whole; a config ``_prepare`` accepts. By hand:
    the 128 x 256 prefill tile (whose 3-stage kernel spills 3,280 bytes of stack a thread on sm_80) gives 128 x 128
    in three stages; the 16-warp swap tile 64 x 256 with 8 warps; the 64 x 256 ``xreg`` tile of 4 warps 64 x 128;
    V-up's 512-deep decode tile 256-deep steps in three stages; K-up's 256-deep one stays."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)
    for N, K, cfg in _glm_defaults():
        fit = tb.register_fit(cfg)
        assert fit.block_m * fit.block_n <= tb.ACCUMULATORS_PER_THREAD * 32 * fit.num_warps, cfg
        assert fit.num_warps <= 8 and fit.block_k <= (256 if fit.block_m == 16 else 64) and K % fit.block_k == 0, cfg
        assert 16 <= fit.block_m <= cfg.block_m and 16 <= fit.block_n <= cfg.block_n, cfg
        assert (fit.wgmma, fit.tma, fit.ws) == ("", False, False), cfg
        assert fit.num_stages == (cfg.num_stages if fit.block_k == cfg.block_k and not cfg.wgmma else 3), cfg
        assert (fit.predecode, fit.tiles_m) == (cfg.predecode, cfg.tiles_m), cfg
        if not cfg.wgmma and not cfg.tma and cfg.block_k <= 64 and cfg.num_warps <= 8 and cfg.block_m * cfg.block_n <= (
                64 * 32 * cfg.num_warps):  # fmt: skip
            assert fit == cfg
        x = torch.empty(2, 3, K, dtype=torch.bfloat16, device="meta")
        codes = torch.empty(2, N, K // 2, dtype=torch.uint8, device="meta")
        scales = torch.empty(2, N, K // 32, dtype=torch.uint8, device="meta")
        tb._prepare(x, codes, scales, "mxfp4", torch.empty(2, 3, N, dtype=torch.bfloat16, device="meta"), fit)
    C = tb.BmmConfig
    assert tb.register_fit(C(128, 256, 64, 8, 3, 0, wgmma="decode", ws=True)) == C(128, 128, 64, 8, 3, 0)
    assert tb.register_fit(C(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma="streaming", ws=True)) == C(
        128, 128, 64, 8, 3, 0, predecode=True)  # fmt: skip
    assert tb.register_fit(C(64, 256, 128, 16, 1, 0, wgmma="swap")) == C(64, 256, 64, 8, 3, 0)
    assert tb.register_fit(C(64, 256, 128, 4, 3, 0, wgmma="xreg")) == C(64, 128, 64, 4, 3, 0)
    assert tb.register_fit(C(16, 64, 512, 4, 1, 0)) == C(16, 64, 256, 4, 3, 0)
    assert tb.register_fit(C(16, 64, 256, 4, 2, 0)) == C(16, 64, 256, 4, 2, 0)


OFF_SM_90 = [("sm_90", False), ("sm_80", True), ("sm_89", True), ("sm_100", True), ("sm_120", True), ("gfx950", True),
             ("gfx942", True)]  # fmt: skip


@pytest.mark.parametrize("arch, fits", OFF_SM_90)
def test_dispatch_fits_registers_off_sm_90(monkeypatch, gpu_as, arch, fits):
    """A call without a config takes :func:`register_fit` of the default on every GPU but the H200's sm_90: NVIDIA's
    A100, L40S, B200, RTX 50 and AMD's gfx950 and gfx942; the default itself on sm_90. The CPU interpreter keeps its
    own."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)
    gpu_as(arch)
    for B, M, N, K in ((64, 256, 512, 256), (16, 1, 256, 512), (16, 8192, 256, 512)):
        default = tb.default_config(B, M, N, K)
        got = tb.config_for(B, M, N, K, torch.device("meta"))
        assert got == (tb.register_fit(default) if fits else default)
    assert tb.config_for(64, 256, 512, 256, torch.device("cpu")) == tb.default_config(64, 256, 512, 256)


@pytest.mark.parametrize("arch, fits", OFF_SM_90)
def test_dispatch_of_configs_for_kernels_the_gpu_lacks(monkeypatch, gpu_as, arch, fits):
    """A caller's config for a Gluon or TMA kernel where neither can run (meta tensors here: no Gluon; TMA on NVIDIA
    GPUs from sm_90, which take the TMA kernel) runs the tiled kernel: with its own tiles on sm_90, with
    :func:`register_fit`'s elsewhere (its 128 x 256 tiles spill on NVIDIA GPUs without wgmma). A plain tiled config
    runs as given everywhere."""
    monkeypatch.setattr(tb, "_INTERPRETED", False)
    gpu_as(arch)
    launched = []
    monkeypatch.setattr(tb, "KernelLaunch", lambda kernel, grid, consts: launched.append((kernel, consts)) or None)
    B, M, N, K = 16, 300, 512, 192
    x = torch.empty(B, M, K, dtype=torch.bfloat16, device="meta")
    codes = torch.empty(B, N, K // 2, dtype=torch.uint8, device="meta")
    scales = torch.empty(B, N, K // 32, dtype=torch.uint8, device="meta")
    out = torch.empty(B, M, N, dtype=torch.bfloat16, device="meta")
    C = tb.BmmConfig
    gluon = C(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma="streaming", ws=True)
    plain = C(128, 256, 64, 8, 3, 0, predecode=True)
    for cfg in (gluon, C(128, 256, 64, 8, 3, 0, predecode=True, tma=True), plain):
        launched.clear()
        tb._prepare(x, codes, scales, "mxfp4", out, cfg)
        (kernel, consts), *rest = [launch for launch in launched if launch[0] is not tb._decode_kernel]
        if cfg.tma and arch.startswith("sm_") and int(arch[3:]) >= 90:
            assert kernel is tb._bmm_tma_kernel and not rest
            continue
        ran = tb.register_fit(cfg) if fits and cfg is not plain else cfg
        assert kernel is tb._bmm_tiled_kernel and not rest
        assert (consts["BLOCK_M"], consts["BLOCK_N"], consts["BLOCK_K"]) == (ran.block_m, ran.block_n, ran.block_k)
        assert (consts["num_warps"], consts["num_stages"], consts["W_BF16"]) == (ran.num_warps, ran.num_stages, True)
    assert tb.register_fit(plain) != plain


@pytest.mark.parametrize("row, out_offset", [(256, 0), (196, 0), (256, 1)],
                         ids=["aligned", "x-unaligned-copied", "out-unaligned-in-place"])  # fmt: skip
def test_dispatch_gives_the_gluon_kernel_an_aligned_copy_of_an_x_it_cannot_address(monkeypatch, row, out_offset):
    """Where the Gluon kernel serves aligned tensors (here on CPU: its availability answered as on an H200, its
    layout rule the real one, its launch a stand-in computing the reference), an x whose rows are 196 bf16 apart is
    copied into an aligned buffer that the kernel reads; rows 256 apart are read in place. x is never written. An
    out starting 2 bytes past 16 is written in place (the kernel stores y plainly there)."""
    monkeypatch.setattr(tb.gluon_bmm, "unusable_reason", tb.gluon_bmm.tensors_reason)
    monkeypatch.setattr(tb.gluon_bmm, "smem_limit", lambda device: 227 * 1024)
    read = []

    def gluon_prepare(x, out, act_mxfp4, plan, w, w_scales=None):
        def launch(x, w, w_scales, out):
            read.append((x, out))
            out.copy_(reference.bmm_a16wfp4(x, w, w_scales, act_quant="mxfp4" if act_mxfp4 else "none"))

        return launch

    monkeypatch.setattr(tb.gluon_bmm, "prepare", gluon_prepare)
    B, M, N, K = 4, 256, 512, 192
    cfg = tb.BmmConfig(64, 128, 64, 4, 3, 0, wgmma="decode", ws=True)  # the H200's K-up 192 default at 256 tokens
    codes, scales = weights(B, N, K, seed=41)
    x = activations(M, B, K, seed=42, row=row)
    x_before = x.clone()
    buf, out = poisoned_out(M, B, N, offset=out_offset)
    tb.bmm_a16wfp4(x, codes, scales, out=out, config=cfg)
    ((staged, written),) = read
    assert tb.tma_strides_ok(staged) and (staged.data_ptr() == x.data_ptr()) == (row == 256)
    assert torch.equal(staged, x) and torch.equal(x, x_before)
    assert written.data_ptr() == out.data_ptr() and tb.tma_strides_ok(out) == (out_offset == 0)
    assert_close_to_reference(out, x, codes, scales, "mxfp4")
    assert torch.isnan(buf[..., :out_offset]).all() and torch.isnan(buf[..., out_offset + N :]).all()


def assert_default_matches_reference(B: int, M: int, N: int, K: int) -> None:
    """The default config on fresh inputs of these shapes, through the runtime's strided views (x in rows of 576):
    the reference's result, every element written, with and without the activation rounding."""
    codes, scales = weights(B, N, K, seed=M + K)
    x = activations(M, B, K, seed=N + M, row=576)
    for act_quant in ("mxfp4", "none"):
        _, out = poisoned_out(M, B, N)
        tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out)
        assert_close_to_reference(out, x, codes, scales, act_quant)


@gpu_only
@pytest.mark.parametrize("key", sorted(tb._TUNED))
def test_tuned_glm_defaults_match_reference_on_gpu(key):
    """Each tuned default at a GLM shape that selects it (8, 16, 32 or 64 heads; rows at the top of its bucket and one
    below, so a tile is ragged), through the runtime's strided views: the reference's result, every element
    written."""
    N, K, spread, bucket = key
    B = {"few": 8, "narrow": 16, "half": 32, "wide": 64}[spread]
    for M in (bucket, bucket - 3):
        assert tb.default_config(B, M, N, K) == tb._TUNED[key]
        assert_default_matches_reference(B, M, N, K)


@gpu_only
@pytest.mark.parametrize(
    "B, M, keys",
    [(4, 1024, [("narrow", 256), ("narrow", 256), ("few", 512)]),
     (5, 600, [("narrow", 256), ("narrow", 256), ("few", 512)]),
     (4, 2000, [None, None, ("few", 1024)]),
     (1, 1000, [("few", 128), ("few", 128), ("few", 256)]), (3, 300, [("few", 128), ("few", 128), ("few", 256)])],
)  # fmt: skip
def test_few_head_defaults_match_reference_on_gpu(B, M, keys):
    """The configs that few-head calls take by their rows as 8 heads: for K-up the "narrow" 256-row entries above 256
    such rows while :data:`FEW_LARGE_TILES` holds, then the large-M rule (None); else the "few" entries; at GLM's
    shapes over several M tiles (ragged but for 1024 rows), through the runtime's strided views: the reference's
    result, every element written."""
    for (N, K), key in zip([(512, 192), (512, 256), (256, 512)], keys, strict=True):
        assert tb.default_config(B, M, N, K) == (tb._large_m(K, B * M) if key is None else tb._TUNED[(N, K, *key)])
        assert_default_matches_reference(B, M, N, K)


@gpu_only
@pytest.mark.parametrize(
    "config",
    [None, tb.BmmConfig(16, 32, 64, 4, 2, 2), tb.BmmConfig(64, 128, 64, 8, 3, 0, predecode=True),
     tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True, tma=True),
     tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma="streaming", ws=True),
     tb.BmmConfig(32, 64, 64, 4, 1, 0, wgmma="swap")],
    ids=["default", "stationary", "predecode", "tma", "gluon-streaming", "gluon-swap"],
)  # fmt: skip
def test_repeated_calls_launch_the_compiled_kernels(config, monkeypatch):
    """After the first call of a signature, calls with fresh data skip the JIT (no ``run`` of any Triton or Gluon
    kernel) and launch the compiled kernels directly: still the reference's result, every element written. Without
    the activation rounding: with it, the 8-warp 3-stage configs are refused on sm_90
    (:func:`test_dispatch_refuses_unsafe_code_on_sm_90`)."""
    jit_runs = []
    for kernel in (tb._bmm_tiled_kernel, tb._bmm_stationary_kernel, tb._bmm_tma_kernel, tb._decode_kernel,
                   *([tb.gluon_bmm._bmm_kernel, tb.gluon_bmm._swap_kernel] if not tb.gluon_bmm.IMPORT_ERROR
                     else [])):  # fmt: skip
        real = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, _real=real, **kw: jit_runs.append(1) or _real(*a, **kw))
    B, M, N, K = 16, 300, 512, 192
    for seed in range(3):
        codes, scales = weights(B, N, K, seed=seed)
        x = activations(M, B, K, seed=seed + 5, row=256)
        _, out = poisoned_out(M, B, N)
        tb.bmm_a16wfp4(x, codes, scales, act_quant="none", out=out, config=config)
        assert_close_to_reference(out, x, codes, scales, "none")
        if seed == 0:
            first = len(jit_runs)
    assert first > 0 and len(jit_runs) == first


def test_the_alignment_benchmark_moves_a_tensor_one_element_off_16_bytes():
    """``bench_bmm_alignment.py`` times calls whose x or out starts 2 bytes past a 16-byte boundary: its view holds
    the same values as the aligned one it stands for, and no tensor descriptor could address it."""
    one_element_in = benchmark_module("bench_bmm_alignment").one_element_in
    q = (torch.randn(5, 3, 256, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16)
    for width in (192, 256):
        moved = one_element_in(q, width)
        assert torch.equal(moved, q[..., :width].transpose(0, 1)) and moved.data_ptr() % 16 == 2
        assert moved.stride() == (264, 3 * 264, 1) and not tb.tma_strides_ok(moved)


def test_the_benchmarks_producers_write_every_element_of_their_tensor():
    """``bench_triton_bmm.py --producer`` times each call after a kernel writing its x (ours: the q rows x is a view
    of; torch's: its contiguous x). A producer that left elements unwritten would time less work than a model's:
    ``mul`` writes the values the tensor had when the producer was made, ``gemm`` ``a @ b`` over its rows, the
    same on every call."""
    bench_triton_bmm = benchmark_module("bench_triton_bmm")
    q = (torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    before = q.clone()
    produce = bench_triton_bmm.make_producer("mul", q)
    q.fill_(float("nan"))
    produce()
    assert torch.equal(q, before)
    produce = bench_triton_bmm.make_producer("gemm", q)
    q.fill_(float("nan"))
    produce()
    first = q.clone()
    assert torch.isfinite(first).all() and not torch.equal(first, before)
    q.fill_(float("nan"))
    produce()
    assert torch.equal(q, first)
