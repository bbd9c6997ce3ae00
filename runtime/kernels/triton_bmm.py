"""Portable Triton A16WFP4 batched GEMM: the absorbed MLA K-up / V-up on MXFP4 weights in the ``bmm_nk`` layout.

Computes :func:`glm_pack.runtime.reference.bmm_a16wfp4` up to fp32 accumulation order:
``Y[b] = act(X[b]) @ dequant(W[b])^T`` with x ``[B, M, K]`` bf16 (any strides), w codes ``[B, N, K/2]`` u8
(low nibble = even k) and E8M0 scales ``[B, N, K/32]`` u8, y ``[B, M, N]`` bf16 (any strides; the runtime
passes a transposed view of a batch-major ``[T, H, N]`` buffer). ``act_quant="mxfp4"`` rounds each 32-block
of x along K to MXFP4 in the kernel (even rule, bit-exact with ``quantize(mode="even")``) and feeds the
dequantized values, which bf16 holds exactly, to the dot; ``"none"`` feeds x as is. Products of these
values are exact in fp32, so only the accumulation order differs from the reference.

Kernels, picked per call by :func:`default_config` (``BmmConfig.tiles_m``, ``predecode``, ``tma``, ``wgmma``):

* weights-stationary (``tiles_m > 0``): a program decodes its ``[BLOCK_N, K]`` weight tile once into bf16
  dot operands and sweeps ``tiles_m`` tiles of M against it (some decode and mid-size shapes);
* tiled (``tiles_m == 0``): a program owns one ``[BLOCK_M, BLOCK_N]`` tile and walks K; compiled for NVIDIA GPUs
  and gfx950 the weights go through ``tl.dot_scaled`` (bf16 x e2m1 with E8M0 scales; Triton upcasts them to bf16,
  on gfx950 with its ``v_cvt_scalef32_pk_bf16_fp4``); elsewhere (other AMD GPUs, where Triton 3.6 fails to lower
  some of these tiles, and Triton 3.6's interpreter, which has no ``dot_scaled``) the same kernel decodes the
  weights itself (:func:`_e2m1_dequant`); the GPU benchmark checks every kernel against the reference.
* predecode (``BmmConfig.predecode``, large M): one small kernel decodes all weights into a transient bf16
  ``[B, N, K]`` buffer, then the tiled kernel reads it as a plain bf16 operand, so the weights are decoded
  once per call instead of once per M tile; with ``BmmConfig.tma`` a persistent kernel reads x, the decoded
  weights and y through tensor descriptors (TMA) where the GPU has them (NVIDIA sm_90+; the interpreter
  emulates them), and the tiled kernel serves elsewhere;
* wgmma (``BmmConfig.wgmma``; most GLM defaults from 64 rows on): the Hopper Gluon kernel of
  :mod:`~glm_pack.runtime.kernels.gluon_bmm` (x rounded in shared memory in place, with ``BmmConfig.ws`` by
  extra warps, wgmma on both operands from shared memory) on sm_90 GPUs. ``"decode"`` decodes each program's
  weight column from the codes into shared memory itself (no predecode pass); ``"stationary"`` /
  ``"streaming"`` read predecoded weights; ``"swap"`` (small M) decodes the weights straight into the MMA's
  register operand, with x as the other; ``"xreg"`` (K-up 256 at large M) decodes like ``"decode"`` and rounds x
  in the MMA warps' registers, x being the register operand. The tiled (``decode``, ``swap``, ``xreg``) or
  ``tma`` / tiled (the others) kernels serve where it cannot run.

Importing this module never fails without Triton: :func:`available` says why the kernel cannot run.
Triton picks interpreter or compiler when a kernel is defined, i.e. when this module is imported.

Numerical corner cases of the compiled path (none occurs for finite checkpoints and activations in the bf16
range a model produces): ``dot_scaled``'s upcast reads weight scale byte 0 (2**-127) as 0 (the even rule
gives byte 0 only to blocks whose amax is below 2**-124, all-zero ones included, where both give 0) and, with
``fast_math``, byte 255 (NaN) as +inf (on gfx950 too: Triton's LLVM IR there builds the fp32 scale as ``byte << 23``);
the activation round trip runs in packed bf16, whose subnormal handling may differ from the fp32
reference for blocks with amax < 2**-125 or >= 1.75 * 2**127."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from glm_pack.packing.errors import BackendError
from glm_pack.runtime.kernels import gluon_bmm
from glm_pack.runtime.kernels._triton import IMPORT_ERROR as _TRITON_ERROR
from glm_pack.runtime.kernels._triton import (
    KernelLaunch,
    UnsafeKernel,
    availability,
    interpreted,
    sm_count,
    tl,
    tma_strides_ok,
    triton,
    tuned_here,
)
from glm_pack.runtime.reference import ACT_QUANT_MODES

_INTERPRETED = interpreted()  # read at import: Triton picks interpreter or compiler when a kernel is defined

if not _TRITON_ERROR:
    from triton.language.target_info import is_cuda, is_hip_cdna4
    from triton.tools.tensor_descriptor import TensorDescriptor  # host-side TMA descriptors (Triton 3.6 has them)

    from glm_pack.runtime.kernels._triton import dot_fp32, to_bf16
    from glm_pack.runtime.kernels.mxfp4_jit import mxfp4_even_round_trip, pow2

    @triton.constexpr_function
    def _dot_scaled_here():
        """Whether the tiled kernel, compiled for the GPU of Triton's active driver, hands its weight codes to
        ``tl.dot_scaled``: on NVIDIA GPUs (what the H200 tables measure) and gfx950 (which converts FP4 to bf16 in
        one instruction). Triton 3.6 fails to lower it for gfx942 at 16-row tiles with K steps up to 64 deep
        ("failed to translate module to LLVM IR"), and other AMD GPUs are untried, so they decode the codes
        themselves."""
        return is_cuda() or is_hip_cdna4()

    @triton.jit
    def _e2m1_dequant(codes, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """codes u8 ``[BLOCK_N, BLOCK_K/2]`` (low nibble = even k) + E8M0 ``[BLOCK_N, BLOCK_K/32]`` -> float32
        ``[BLOCK_N, BLOCK_K]``: ``E2M1[code] * 2**(scale - 127)`` (scale 255 -> NaN).

        A nibble's magnitude bits placed at fp16 bits 9-11 and its sign at bit 15 read as an fp16 equal to
        ``E2M1[code] * 2**-14`` exactly (index 1, 0.5, lands on the fp16 subnormal 2**-15)."""
        c = codes.to(tl.int32)
        lo = ((c & 7) << 9) | ((c & 8) << 12)
        hi = ((c & 0x70) << 5) | ((c & 0x80) << 8)
        h = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)).to(tl.int16).to(tl.float16, bitcast=True)
        s = scales.to(tl.int32)
        scale = tl.where(s == 255, float("nan"), pow2(s - 127))
        w = tl.reshape(h.to(tl.float32) * 16384.0, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None]
        return tl.reshape(w, (BLOCK_N, BLOCK_K))

    @triton.jit(do_not_specialize=["M"])
    def _bmm_tiled_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        M,
        N,
        stride_xb,
        stride_xm,
        stride_xk,
        stride_wb,
        stride_wn,
        stride_wk,
        stride_sb,
        stride_sn,
        stride_sk,
        stride_yb,
        stride_ym,
        stride_yn,
        K: tl.constexpr,
        ACT_MXFP4: tl.constexpr,
        W_BF16: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), B)``: N tiles fastest, so programs running together
        share x tiles and (at large M) weights in L2. ``W_BF16``: ``w_ptr`` holds decoded bf16 weights
        ``[B, N, K]`` (``s_ptr`` unused) instead of E2M1 codes."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_in = offs_m[:, None] < M
        n_in = offs_n[:, None] < N
        x_ptrs = x_ptr + b * stride_xb + offs_m[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :] * stride_xk
        w_base = w_ptr + b * stride_wb + offs_n[:, None] * stride_wn
        s_ptrs = s_ptr + b * stride_sb + offs_n[:, None] * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :] * stride_sk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, K // BLOCK_K):
            x = tl.load(x_ptrs, mask=m_in, other=0.0)
            if W_BF16:
                w = tl.load(w_base + (kk * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]) * stride_wk, mask=n_in, other=0.0)
            else:
                codes = tl.load(w_base + (kk * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]) * stride_wk,
                                mask=n_in, other=0)  # fmt: skip
                scales = tl.load(s_ptrs, mask=n_in, other=127)
                s_ptrs += (BLOCK_K // 32) * stride_sk
            if ACT_MXFP4:
                x = mxfp4_even_round_trip(x, BLOCK_M, BLOCK_K, INTERPRET)
            if W_BF16:
                acc = dot_fp32(x, tl.trans(w), acc, INTERPRET)
            elif not INTERPRET and _dot_scaled_here():
                # fast_math: no NaN select for scale byte 255 (NaN scales give inf/NaN instead)
                acc = tl.dot_scaled(x, None, "bf16", tl.trans(codes), scales, "e2m1", acc, fast_math=True)
            else:  # the interpreter and AMD GPUs other than gfx950: decode the weights here
                acc = dot_fp32(x, tl.trans(_e2m1_dequant(codes, scales, BLOCK_N, BLOCK_K)), acc, INTERPRET)
            x_ptrs += BLOCK_K * stride_xk
        y_ptrs = y_ptr + b * stride_yb + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, to_bf16(acc, INTERPRET), mask=m_in & (offs_n[None, :] < N))

    @triton.jit
    def _tma_tile(x_desc, w_desc, y_desc, tile, tiles_m, tiles_n, K, ACT_MXFP4, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K):
        """One output tile of :func:`_bmm_tma_kernel` (tiles numbered N fastest, then M, then B)."""
        n0 = (tile % tiles_n) * BLOCK_N
        m0 = (tile // tiles_n % tiles_m) * BLOCK_M
        b = tile // (tiles_n * tiles_m)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = x_desc.load([b, m0, k]).reshape(BLOCK_M, BLOCK_K)
            w = w_desc.load([b, n0, k]).reshape(BLOCK_N, BLOCK_K)
            if ACT_MXFP4:
                x = mxfp4_even_round_trip(x, BLOCK_M, BLOCK_K, INTERPRET)
            acc = dot_fp32(x, w.T, acc, INTERPRET)
        y_desc.store([b, m0, n0], to_bf16(acc, INTERPRET).reshape(1, BLOCK_M, BLOCK_N))

    @triton.jit(do_not_specialize=["M"])
    def _bmm_tma_kernel(
        x_desc,
        w_desc,
        y_desc,
        M,
        N,
        B,
        PROGRAMS,
        K: tl.constexpr,
        ACT_MXFP4: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Persistent, tensor-descriptor (TMA) variant for decoded bf16 weights, grid ``(PROGRAMS,)``: 3-D
        descriptors over x ``[B, M, K]``, w ``[B, N, K]`` and y ``[B, M, N]`` (unit last stride); each program
        loops over output tiles, and the flattened loop overlaps one tile's store with the next tile's loads.
        Out-of-range rows and columns are zero-filled on load and dropped on store. The 3.6 interpreter's
        ``range`` takes no runtime bounds, so there (INTERPRET) each program does one tile (grid = tiles)."""
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles_m = tl.cdiv(M, BLOCK_M)
        if INTERPRET:
            _tma_tile(x_desc, w_desc, y_desc, tl.program_id(0), tiles_m, tiles_n,
                      K, ACT_MXFP4, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        else:
            for tile in tl.range(tl.program_id(0), B * tiles_m * tiles_n, PROGRAMS, flatten=True):
                _tma_tile(x_desc, w_desc, y_desc, tile, tiles_m, tiles_n,
                          K, ACT_MXFP4, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip

    @triton.jit
    def _decode_kernel(
        w_ptr,
        s_ptr,
        o_ptr,
        N,
        stride_wb,
        stride_wn,
        stride_wk,
        stride_sb,
        stride_sn,
        stride_sk,
        stride_ob,
        stride_on,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """Grid ``(cdiv(N, BLOCK_N), K / BLOCK_K, B)``: codes + scales -> bf16 weights ``o [B, N, K]`` (k unit
        stride); every value is exact in bf16 (subnormals included: :func:`to_bf16`)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = offs_n[:, None] < N
        cols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
        codes = tl.load(w_ptr + b * stride_wb + offs_n[:, None] * stride_wn + cols * stride_wk, mask=n_in, other=0)
        blocks = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)[None, :]
        scales = tl.load(s_ptr + b * stride_sb + offs_n[:, None] * stride_sn + blocks * stride_sk, mask=n_in, other=127)
        w = to_bf16(_e2m1_dequant(codes, scales, BLOCK_N, BLOCK_K), INTERPRET)
        o_ptrs = o_ptr + b * stride_ob + offs_n[:, None] * stride_on + pid_k * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
        tl.store(o_ptrs, w, mask=n_in)

    @triton.jit(do_not_specialize=["M"])
    def _bmm_stationary_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        y_ptr,
        M,
        N,
        stride_xb,
        stride_xm,
        stride_xk,
        stride_wb,
        stride_wn,
        stride_wk,
        stride_sb,
        stride_sn,
        stride_sk,
        stride_yb,
        stride_ym,
        stride_yn,
        K: tl.constexpr,
        ACT_MXFP4: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TILES_M: tl.constexpr,
    ):
        """Weights-stationary: grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M * TILES_M), B)``. A program decodes its
        ``[BLOCK_N, K]`` weight tile once (kept as K/BLOCK_K dot operands) and sweeps TILES_M tiles of M."""
        pid_n = tl.program_id(0)
        pid_c = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = offs_n[:, None] < N
        w_ptrs = w_ptr + b * stride_wb + offs_n[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :] * stride_wk
        s_ptrs = s_ptr + b * stride_sb + offs_n[:, None] * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :] * stride_sk
        w_t = ()
        for kk in tl.static_range(K // BLOCK_K):
            codes = tl.load(w_ptrs + kk * (BLOCK_K // 2) * stride_wk, mask=n_in, other=0)
            scales = tl.load(s_ptrs + kk * (BLOCK_K // 32) * stride_sk, mask=n_in, other=127)
            w = tl.trans(_e2m1_dequant(codes, scales, BLOCK_N, BLOCK_K))
            if not INTERPRET:
                w = w.to(tl.bfloat16)  # exact
            w_t = w_t + (w,)
        x_base = x_ptr + b * stride_xb + tl.arange(0, BLOCK_K)[None, :] * stride_xk
        y_base = y_ptr + b * stride_yb + offs_n[None, :] * stride_yn
        for i in range(TILES_M):
            offs_m = (pid_c * TILES_M + i) * BLOCK_M + tl.arange(0, BLOCK_M)
            m_in = offs_m[:, None] < M
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in tl.static_range(K // BLOCK_K):
                x = tl.load(x_base + offs_m[:, None] * stride_xm + kk * BLOCK_K * stride_xk, mask=m_in, other=0.0)
                if ACT_MXFP4:
                    x = mxfp4_even_round_trip(x, BLOCK_M, BLOCK_K, INTERPRET)
                acc = dot_fp32(x, w_t[kk], acc, INTERPRET)
            tl.store(y_base + offs_m[:, None] * stride_ym, to_bf16(acc, INTERPRET), mask=m_in & (offs_n[None, :] < N))


def available() -> tuple[bool, str]:
    """(usable, reason): Triton importable, and a GPU present or the interpreter selected."""
    return availability(_INTERPRETED)


@dataclass(frozen=True)
class BmmConfig:
    """Tile shape and launch options; ``block_k`` divides K, the others are powers of two >= 16.

    ``tiles_m`` > 0 selects the weights-stationary kernel (a program sweeps that many M tiles);
    0 selects the tiled ``dot_scaled`` kernel (a program owns one ``[block_m, block_n]`` tile).
    ``predecode`` (tiled only): decode all weights once into a transient bf16 ``[B, N, K]`` buffer (2 bytes
    per weight, freed after the call) and run the tiled kernel on it, instead of decoding per M tile.
    ``tma`` (with ``predecode``): run the persistent tensor-descriptor kernel instead, where the GPU has TMA
    (NVIDIA compute capability >= 9) and x / out qualify (unit last stride, 16-byte aligned base and strides);
    elsewhere the call falls back to the tiled kernel with the same tiles.
    ``wgmma``: runs the Hopper Gluon kernel of :mod:`gluon_bmm` with that schedule where it can run (sm_90,
    TMA-compatible x / out, shared memory for at least two stages; tiles: :func:`gluon_bmm.tile_error`, it
    picks its own stage count; ``tiles_m`` 0): ``"decode"`` (without ``predecode``) decodes the weights in
    the kernel, ``"stationary"`` / ``"streaming"`` (with ``predecode``) read predecoded ones, ``"swap"``
    (without ``predecode``; ``block_m`` rows of x, ``block_n`` = 16 * ``num_warps`` weight rows a program, one
    tile each) decodes them into the MMA's register operand; elsewhere the call falls back to the tiled kernel
    (``decode``, ``swap``) or ``tma`` / tiled (the others) with the same tiles.
    ``ws`` (with ``wgmma``): warp specialisation: with mxfp4 activations, :data:`gluon_bmm.ROUND_WARPS` more
    warps round the x tiles while the MMA warps only wait, issue MMAs and write y (``decode`` with 8 warps then
    decodes the whole weight column before the first MMA, :func:`gluon_bmm.decode_first`); ``swap`` has them
    except where :func:`gluon_bmm.swap_workers` finds the MMA warps round faster. ``round_warps``: how many, 4 or
    8 (8 only with ``ws`` or ``swap``; a ``swap`` launch of more programs than multiprocessors takes 4,
    :func:`gluon_bmm.swap_round_warps`; at most
    :data:`gluon_bmm.MAX_WARPS` warps in all, and leaving the MMA warps registers for their accumulator:
    :func:`gluon_bmm.register_error`)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tiles_m: int = 1
    predecode: bool = False
    tma: bool = False
    wgmma: str = ""
    ws: bool = False
    round_warps: int = gluon_bmm.ROUND_WARPS


def _block_k(K: int, cap: int) -> int:
    """Largest power of two <= cap that divides K (K is a multiple of 32)."""
    bk = cap
    while K % bk:
        bk //= 2
    return bk


_C = BmmConfig
# Per-shape winners of H200 sweeps and A/B runs for GLM's K-up (N=512, K=192/256) and V-up (N=256, K=512), T <= 256
# (V-up with few heads: up to 1024 rows as 8 heads), keyed (N, K, heads class, rows bucket) (BENCHMARKS.md;
# :func:`heads_class`, rows: :func:`default_config`); a bucket without an entry takes the "narrow" one's for "few"
# heads, then the next bucket's.
_TUNED = {
    (512, 192, "narrow", 16): _C(16, 32, 64, 2, 3, 0),
    (512, 192, "wide", 16): _C(16, 64, 64, 4, 1, 0),
    (512, 256, "narrow", 16): _C(16, 64, 256, 4, 2, 0),
    (512, 256, "wide", 16): _C(16, 128, 256, 4, 2, 0),
    (256, 512, "few", 16): _C(16, 32, 512, 4, 1, 0),
    (256, 512, "narrow", 16): _C(16, 64, 512, 4, 1, 0),
    (256, 512, "wide", 16): _C(16, 64, 512, 4, 1, 0),
    (512, 192, "narrow", 32): _C(32, 64, 64, 4, 1, 0, wgmma="swap"),
    (512, 192, "wide", 32): _C(32, 128, 64, 8, 1, 0, wgmma="swap"),
    (512, 256, "narrow", 32): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (512, 256, "wide", 32): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (256, 512, "few", 32): _C(16, 32, 512, 4, 1, 0),
    (256, 512, "narrow", 32): _C(32, 64, 256, 4, 1, 0, wgmma="swap", round_warps=8),
    (256, 512, "wide", 32): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (512, 192, "few", 64): _C(32, 64, 64, 4, 1, 0, wgmma="swap"),
    (512, 192, "narrow", 64): _C(64, 64, 64, 4, 3, 0, wgmma="decode", ws=True),
    (512, 192, "wide", 64): _C(64, 128, 64, 8, 1, 0, wgmma="swap"),
    (512, 256, "few", 64): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (512, 256, "narrow", 64): _C(32, 128, 256, 8, 1, 0, wgmma="swap"),
    (512, 256, "wide", 64): _C(64, 256, 128, 16, 1, 0, wgmma="swap"),
    (256, 512, "few", 64): _C(16, 64, 512, 4, 1, 0),
    (256, 512, "narrow", 64): _C(32, 64, 256, 4, 1, 0, wgmma="swap", round_warps=8),
    (256, 512, "wide", 64): _C(64, 128, 128, 8, 1, 0, wgmma="swap"),
    (512, 192, "few", 128): _C(32, 64, 64, 4, 1, 0, wgmma="swap"),
    (512, 256, "few", 128): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (512, 192, "narrow", 256): _C(64, 128, 64, 4, 3, 0, wgmma="decode", ws=True),
    (512, 192, "wide", 256): _C(64, 128, 64, 4, 3, 0, wgmma="decode", ws=True),
    (512, 256, "few", 256): _C(64, 128, 128, 8, 1, 0, wgmma="swap", round_warps=8),
    (512, 256, "narrow", 256): _C(64, 128, 256, 4, 3, 0, wgmma="decode", ws=True),
    (512, 256, "wide", 256): _C(128, 256, 64, 8, 3, 0, wgmma="decode", ws=True),
    (256, 512, "few", 256): _C(64, 64, 256, 4, 1, 0, wgmma="swap", round_warps=8),
    (256, 512, "few", 512): _C(64, 128, 256, 8, 1, 0, wgmma="swap", round_warps=8),
    (256, 512, "few", 1024): _C(64, 128, 128, 4, 3, 0, wgmma="decode", ws=True),
    (256, 512, "narrow", 256): _C(64, 128, 256, 8, 1, 0, wgmma="swap", round_warps=8),
    (256, 512, "wide", 256): _C(64, 128, 128, 4, 3, 0, wgmma="decode", ws=True),
    # 32 heads: every bucket (no fallback); the 16- or 64-head entry where it stayed within 2.5% of the sweep's best
    (512, 192, "half", 16): _C(16, 32, 64, 2, 3, 0),
    (512, 192, "half", 32): _C(32, 64, 64, 4, 1, 0, wgmma="swap"),
    (512, 192, "half", 64): _C(64, 128, 64, 8, 1, 0, wgmma="swap"),
    (512, 192, "half", 128): _C(64, 128, 64, 4, 3, 0, wgmma="decode", ws=True),
    (512, 192, "half", 256): _C(64, 256, 64, 8, 3, 0, wgmma="decode", ws=True),
    (512, 256, "half", 16): _C(16, 64, 256, 4, 2, 0),
    (512, 256, "half", 32): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (512, 256, "half", 64): _C(64, 128, 128, 8, 1, 0, wgmma="swap"),
    (512, 256, "half", 128): _C(64, 256, 128, 16, 1, 0, wgmma="swap"),
    (512, 256, "half", 256): _C(64, 128, 256, 4, 3, 0, wgmma="decode", ws=True),
    (256, 512, "half", 16): _C(16, 64, 512, 4, 1, 0),
    (256, 512, "half", 32): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (256, 512, "half", 64): _C(32, 64, 256, 4, 1, 0, wgmma="swap"),
    (256, 512, "half", 128): _C(64, 128, 256, 8, 1, 0, wgmma="swap", round_warps=8),
    (256, 512, "half", 256): _C(64, 128, 128, 4, 3, 0, wgmma="decode", ws=True),
}


FEW_HEADS = 8  # at most this many batches (heads a rank: GLM's 64 at tensor parallelism 8) take the "few" entries
HALF_HEADS = range(24, 33)  # batches taking the "half" entries (32 heads a rank: GLM's 64 at tensor parallelism 2)
FEW_LARGE_TILES = 64  # at most this many 128 x 256 tiles above 256 rows: a GLM shape keeps its 256-row config


def heads_class(B: int, N: int) -> str:
    """Which tuned entries B batches (heads) of N output columns take, by the head counts they were measured at:
    ``"few"`` up to :data:`FEW_HEADS` (8 heads: smaller tiles for as many programs), ``"half"`` in
    :data:`HALF_HEADS` (32), ``"wide"`` where :func:`_fills_gpu` (64 heads; K-up from 33, V-up from 64), else
    ``"narrow"`` (16). The "half" one-tile entries launch about 128 programs at 32 heads: from 33 they would need a
    second wave."""
    if B <= FEW_HEADS:
        return "few"
    if B in HALF_HEADS:
        return "half"
    return "wide" if _fills_gpu(B, N) else "narrow"


def _fills_gpu(B: int, N: int) -> bool:
    """Enough 64-column tiles (B * N / 64 >= 256) to fill the GPU with one-tile programs."""
    return B * triton.cdiv(N, 64) >= 256


def default_config(B: int, M: int, N: int, K: int) -> BmmConfig:
    """Kernel and tiles by rows bucket (16, 32, 64, 128, 256, 512, 1024, larger), measured on an H200
    (BENCHMARKS.md): the tuned GLM shapes first (by :func:`heads_class`; with "few" heads the rows are ``B * M /
    FEW_HEADS``, those of the 8-head call launching as many one-tile programs), then general rules; above 256 rows
    (and the tuned buckets) :func:`_large_m`, unless its 128 x 256 tiles would number at most
    :data:`FEW_LARGE_TILES` (fewer than half of the H200's 132 multiprocessors: few heads, as at 8 per rank, and up
    to about a thousand tokens), where a GLM shape keeps its "narrow" 256-row config, whose 64-row tiles give four
    times the programs."""
    if _INTERPRETED:
        return BmmConfig(16 if M <= 16 else 32, 32 if N <= 32 else 64, _block_k(K, 64), 4, 1, 2)
    spread = heads_class(B, N)
    if spread == "few":  # the 8-head call's rows and entries, then the 16-head ones in the same bucket
        rows, classes = triton.cdiv(B * M, FEW_HEADS), ("few", "narrow")
    else:
        rows, classes = M, (spread,)
    for bucket in (16, 32, 64, 128, 256, 512, 1024):
        for key in ((N, K, c, bucket) for c in classes):
            if rows <= bucket and key in _TUNED:
                return _TUNED[key]
    if M > 256:
        narrow = (N, K, "narrow", 256)
        few_large_tiles = B * triton.cdiv(N, 256) * triton.cdiv(M, 128) <= FEW_LARGE_TILES
        return _TUNED[narrow] if few_large_tiles and narrow in _TUNED else _large_m(K, B * M)
    bk = _block_k(K, 64)
    if M <= 16:
        return BmmConfig(16, 64, _block_k(K, 128), 4, 2, 0) if _fills_gpu(B, N) else BmmConfig(16, 32, bk, 4, 2, 1)
    if M <= 64:
        return BmmConfig(64, 64, bk, 4, 2, 1)
    return BmmConfig(64, 128, bk, 4, 3, 0)


ACCUMULATORS_PER_THREAD = 64  # fp32: a portable tile's at most, on GPUs other than the H200's sm_90
PORTABLE_BLOCK_K = 64  # deepest K step of a portable tile there, but for tiles of 16 rows:
SMALL_TILE_BLOCK_K = 256  # theirs (the H200's decode tiles take up to 512: V-up's spills 72-88 bytes there)


def register_fit(cfg: BmmConfig) -> BmmConfig:
    """What a config runs as on GPUs the H200's tuning does not serve (:func:`tuned_here`: NVIDIA GPUs but sm_90,
    AMD GPUs): the portable tiled kernel, with a tile whose kernel does not spill registers there, as close to the
    H200's as that allows. At most 8 warps and :data:`ACCUMULATORS_PER_THREAD` accumulators a thread, counting 32
    threads a warp (the tile's longer side halved until it holds that; AMD's 64-lane waves hold half as many a lane);
    K steps at most :data:`PORTABLE_BLOCK_K` deep (:data:`SMALL_TILE_BLOCK_K` for 16-row tiles); the config's stages
    where its K step stays, else three (and for the Gluon kernels' configs, whose stages are their own); no TMA
    kernel (it spills on sm_120). The H200's tiles compiled there spill: up to 5.7 KB of stack a thread on sm_80, 308
    bytes a lane on gfx942 (on gfx950 they do not; one rule serves every GPU the tuning was not measured on). These
    tiles do not spill on sm_80, sm_86, sm_89, sm_100, sm_120, gfx90a, gfx942 or gfx950
    (``benchmarks/check_compile.py``). Not timed there."""
    warps = min(cfg.num_warps, 8)
    bm, bn = cfg.block_m, cfg.block_n
    while bm * bn > ACCUMULATORS_PER_THREAD * 32 * warps:
        if bn >= bm:
            bn //= 2
        else:
            bm //= 2
    bk = min(cfg.block_k, SMALL_TILE_BLOCK_K if bm <= 16 else PORTABLE_BLOCK_K)
    stages = cfg.num_stages if bk == cfg.block_k and not cfg.wgmma else 3
    return replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, tma=False, wgmma="",
                   ws=False, round_warps=gluon_bmm.ROUND_WARPS)  # fmt: skip


def config_for(B: int, M: int, N: int, K: int, device: torch.device) -> BmmConfig:
    """The config a call without one runs on ``device``: :func:`default_config`, through :func:`register_fit` where
    the H200's tuning does not serve (:func:`tuned_here`)."""
    cfg = default_config(B, M, N, K)
    return cfg if tuned_here(device) else register_fit(cfg)


def unpipelined(cfg: BmmConfig) -> BmmConfig:
    """What a default config falls back to where its kernel needs more shared memory than the GPU has (Triton refuses
    to load it: ``OutOfResources`` at its first launch; e.g. V-up's 128 x 256 tiles on predecoded weights need 80-96
    KiB on AMD's gfx942, which has 64), or where Triton's code for it is unsafe (:class:`UnsafeKernel`; e.g. the
    H200's 128 x 256 tiles in the tiled or TMA kernel, which run where Gluon cannot): the same tiles in the portable
    kernels, in one stage (32 KiB at most for GLM's tiles; unpipelined, every MMA is waited for in its K step)."""
    return replace(cfg, num_stages=1, tma=False, wgmma="", ws=False, round_warps=gluon_bmm.ROUND_WARPS)


XREG_MIN_ROWS = 16384  # B * M above which K-up 256 takes xreg: 64 heads from 257 tokens, 16 from 1025 (H200 tie)


def _large_m(K: int, rows: int) -> BmmConfig:
    """Above 256 rows: the Hopper wgmma kernel, decoding its weight column into shared memory itself while a
    256-column bf16 column fits next to the x ring (K <= 256), else streaming predecoded weights; the tiled
    ``dot_scaled`` kernel / the persistent TMA kernel on predecoded weights (same tiles) where it cannot run.
    At K = 256 with more than :data:`XREG_MIN_ROWS` rows over all batches, the ``xreg`` schedule (64 x 256
    tiles, 128-deep K steps: whole 32-blocks of x in a thread); measured on the H200 at GLM's padded K-up only
    (BENCHMARKS.md: a tie at 16 heads x 1024 tokens, faster above)."""
    if K == 256 and rows > XREG_MIN_ROWS:
        return BmmConfig(64, 256, 128, 4, 3, 0, wgmma="xreg")
    if K <= 256:
        return BmmConfig(128, 256, _block_k(K, 64), 8, 3, 0, wgmma="decode", ws=True)
    return BmmConfig(128, 256, _block_k(K, 64), 8, 3, 0, predecode=True, tma=True, wgmma="streaming", ws=True)


def accumulation_tolerance(ref: torch.Tensor, abs_dot: torch.Tensor, K: int) -> torch.Tensor:
    """Per-element bound on ``|y - ref|`` for bf16 results of the same fp32 dot products of length K summed in
    another order: ``K * 2**-23 * abs_dot`` (``abs_dot`` = sum over k of ``|a_k * b_k|``, float32) plus one bf16
    ulp at the larger magnitude, for the two final roundings."""
    spread = K * 2.0**-23 * abs_dot.float()
    _, exp = torch.frexp((ref.float().abs() + spread).clamp_min(2.0**-126))
    return spread + torch.ldexp(torch.ones_like(spread), exp - 8)


def _check(t: object, name: str, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise BackendError(f"triton bmm_a16wfp4: {name} must be a torch.Tensor, got {type(t).__name__}", tensor=name)
    if t.dtype != dtype or t.dim() != 3:
        raise BackendError(
            f"triton bmm_a16wfp4: {name} must be a 3-D {dtype} tensor, got {t.dim()}-D {t.dtype}", tensor=name
        )
    return t  # torch has no negative strides (as_strided rejects them), so any strides are fine


def _validate(x, w_codes, w_scales, act_quant, out) -> tuple[int, int, int, int]:
    _check(x, "x", torch.bfloat16)
    _check(w_codes, "w_codes", torch.uint8)
    _check(w_scales, "w_scales", torch.uint8)
    B, M, K = x.shape
    Bw, N, Kh = w_codes.shape
    if act_quant not in ACT_QUANT_MODES:
        raise BackendError(f"triton bmm_a16wfp4: act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")
    if K != 2 * Kh:
        raise BackendError(
            f"triton bmm_a16wfp4: x has K={K} but w_codes packs K={2 * Kh} ([B, N, K/2] = {tuple(w_codes.shape)}); "
            "pass the padded q row when the weights are K-padded",
            tensor="x",
        )
    if K == 0 or K % 32:
        raise BackendError(f"triton bmm_a16wfp4: K={K} must be a positive multiple of 32", tensor="x")
    if Bw != B:
        raise BackendError(f"triton bmm_a16wfp4: x has B={B} batches, w_codes {Bw}", tensor="w_codes")
    if tuple(w_scales.shape) != (B, N, K // 32):
        raise BackendError(
            f"triton bmm_a16wfp4: w_scales must be {(B, N, K // 32)}, got {tuple(w_scales.shape)}", tensor="w_scales"
        )
    devices = {t.device for t in (x, w_codes, w_scales)}
    if out is not None:
        _check(out, "out", torch.bfloat16)
        if tuple(out.shape) != (B, M, N):
            raise BackendError(f"triton bmm_a16wfp4: out must be {(B, M, N)}, got {tuple(out.shape)}", tensor="out")
        if any(st == 0 and sz > 1 for st, sz in zip(out.stride(), out.shape, strict=True)):
            raise BackendError(f"triton bmm_a16wfp4: out has a zero stride {out.stride()}", tensor="out")
        devices.add(out.device)
    if len(devices) != 1:
        raise BackendError(f"triton bmm_a16wfp4: tensors on different devices {sorted(map(str, devices))}")
    if x.device.type != "cuda" and not _INTERPRETED:
        raise BackendError(
            f"triton bmm_a16wfp4: tensors on {x.device} need a GPU, or TRITON_INTERPRET=1 set before import"
        )
    return B, M, N, K


def _tma_usable(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors work here for these bf16 tensors: an NVIDIA GPU with TMA (sm_90+) or the interpreter,
    unit last stride, base and other strides 16-byte aligned."""
    if not _INTERPRETED and not _has_tma(tensors[0].device):  # the interpreter emulates descriptors on CPU
        return False
    return all(tma_strides_ok(t) for t in tensors)


def _prepare_tma(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, act_mxfp4: bool, cfg: BmmConfig) -> Callable:
    """Persistent descriptor kernel over bf16 ``w [B, N, K]`` (one program per multiprocessor at most), for
    tensors like these: a function of ``(x, w, w_scales, out)`` (``w_scales`` unused)."""
    B, M, K = x.shape
    N = w.shape[1]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles = B * triton.cdiv(M, bm) * triton.cdiv(N, bn)
    programs = tiles if _INTERPRETED else min(tiles, sm_count(x.device))
    kernel = KernelLaunch(_bmm_tma_kernel, (programs,), dict(
        K=K, ACT_MXFP4=act_mxfp4, INTERPRET=_INTERPRETED, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    ))  # fmt: skip

    def launch(x, w, w_scales, out):
        descriptors = [TensorDescriptor.from_tensor(t, [1, rows, bk]) for t, rows in ((x, bm), (w, bn))]
        kernel(*descriptors, TensorDescriptor.from_tensor(out, [1, bm, bn]), M, N, B, programs)

    return launch


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def _x_copy(x: torch.Tensor) -> torch.Tensor:
    """A new buffer for x ``[B, M, K]``'s values, laid out as the q rows it comes from (``[M, B, K]`` storage): 16-byte
    aligned, as every allocation, so that tensor descriptors can address it and pointer loads read 16 bytes at once."""
    B, M, K = x.shape
    return torch.empty(M, B, K, dtype=x.dtype, device=x.device).transpose(0, 1)


def forget_gpu() -> None:
    """Drop what the GEMM's dispatch cached from torch's answers about a GPU (ROCm build or not, compute capability),
    so that the next calls ask again: for the tools and tests that make torch answer as another GPU."""
    for cached in (tuned_here, _has_tma, gluon_bmm._device_reason):
        cached.cache_clear()


def _prepare(x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, act_quant: str, out: torch.Tensor,
             config: BmmConfig | None) -> Callable:  # fmt: skip
    """How calls with tensors like these (shapes, strides, 16-byte alignment, devices; validated) run: checks
    the config, picks the kernels and works out their launches; returns a function of
    ``(x, w_codes, w_scales, out)`` that only launches them."""
    B, M, K = x.shape
    N = w_codes.shape[1]
    if B == 0 or M == 0 or N == 0:
        return lambda *tensors: None
    cfg = config or config_for(B, M, N, K, x.device)
    if K % cfg.block_k or cfg.block_k % 32 or cfg.block_k & (cfg.block_k - 1):
        raise BackendError(f"triton bmm_a16wfp4: block_k={cfg.block_k} must be a power of two >= 32 dividing K={K}")
    if any(v < 16 or v & (v - 1) for v in (cfg.block_m, cfg.block_n)) or cfg.tiles_m < 0:
        raise BackendError(f"triton bmm_a16wfp4: bad config {cfg} (block_m/block_n: powers of two >= 16)")
    if cfg.predecode and cfg.tiles_m:
        raise BackendError(f"triton bmm_a16wfp4: bad config {cfg} (predecode needs the tiled kernel, tiles_m=0)")
    if cfg.tma and not cfg.predecode:
        raise BackendError(f"triton bmm_a16wfp4: bad config {cfg} (tma reads decoded weights: set predecode)")
    if cfg.ws and cfg.wgmma in ("", "xreg"):
        raise BackendError(f"triton bmm_a16wfp4: bad config {cfg} (ws is an option of the wgmma kernel, not of xreg, "
                           f"whose MMA warps round x)")  # fmt: skip
    extra_warps = cfg.ws or cfg.wgmma == "swap"
    if cfg.round_warps not in (4, 8) or (cfg.round_warps != gluon_bmm.ROUND_WARPS and not extra_warps):
        raise BackendError(f"triton bmm_a16wfp4: bad config {cfg} (round_warps: 4, or 8 with ws or swap)")
    if cfg.wgmma:
        bad = gluon_bmm.tile_error(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.wgmma)
        if bad or cfg.predecode == (cfg.wgmma in gluon_bmm.FROM_CODES) or cfg.tiles_m:
            raise BackendError(
                f"triton bmm_a16wfp4: bad config {cfg} (wgmma: 'stationary' or 'streaming' with predecode, "
                f"'decode', 'swap' and 'xreg' without, tiles_m=0; {bad})"
            )
        if cfg.num_warps + (cfg.round_warps if extra_warps else 0) > gluon_bmm.MAX_WARPS:
            raise BackendError(f"triton bmm_a16wfp4: bad config {cfg} (at most {gluon_bmm.MAX_WARPS} warps with the "
                               f"rounding warps: more leave too few registers)")  # fmt: skip
        short = extra_warps and gluon_bmm.register_error(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.round_warps)
        if short:
            raise BackendError(f"triton bmm_a16wfp4: bad config {cfg} (too few registers for the MMA warps' "
                               f"accumulator: {short})")  # fmt: skip
    act = act_quant == "mxfp4"
    plan = None
    decode_args = (w_codes, w_scales) if cfg.wgmma in gluon_bmm.FROM_CODES else ()

    def gluon_takes(x: torch.Tensor) -> bool:
        return bool(cfg.wgmma) and not gluon_bmm.unusable_reason(x, out, *decode_args)

    def tma_takes(x: torch.Tensor) -> bool:
        return cfg.tma and _tma_usable(x, out)

    def tiled_reads_narrowly() -> bool:  # 2 warps or fewer: each thread loads 16+ of an x tile's values a K step
        return not (cfg.wgmma or cfg.tma or cfg.tiles_m) and cfg.num_warps <= 2

    # An x whose base or strides keep those kernels off is copied to an aligned buffer first where they can then serve,
    # or where the tiled kernel runs on 2 warps or fewer: the tiled kernel would read it 2 bytes at a time, and round it
    # with shuffles, a thread holding one value of each 32-value block (on the H200 GLM's calls from 256 tokens took
    # 2.2-10.8x the aligned call's time that way, 1.5-3.1x with the copy; K-up 192's 2-warp tiles up to 32 heads and 16
    # tokens 2.5-4.7x, 1.4-1.9x with the copy; BENCHMARKS.md).
    if not tma_strides_ok(x) and (gluon_takes(planned := _x_copy(x)) or tma_takes(planned) or tiled_reads_narrowly()):
        main = _prepare(planned, w_codes, w_scales, act_quant, out, cfg)

        def copy_then_main(x, w_codes, w_scales, out):
            staged = _x_copy(x)
            staged.copy_(x)
            main(staged, w_codes, w_scales, out)

        return copy_then_main
    if gluon_takes(x):
        smem = gluon_bmm.smem_limit(x.device)
        plan = gluon_bmm.plan(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.wgmma, K, smem, ws=cfg.ws,
                              round_warps=cfg.round_warps)  # fmt: skip
    if plan and decode_args:
        return gluon_bmm.prepare(x, out, act, plan, w=w_codes, w_scales=w_scales)
    # the weights the main kernel reads: the codes, or the transient bf16 [B, N, K] buffer each call decodes into
    w = torch.empty(B, N, K, dtype=torch.bfloat16, device="meta") if cfg.predecode else w_codes
    if plan:
        main = gluon_bmm.prepare(x, out, act, plan, w=w)
    elif tma_takes(x):
        main = _prepare_tma(x, w, out, act, cfg)
    else:
        if (cfg.wgmma or cfg.tma) and not tuned_here(x.device):  # a config for kernels this GPU lacks (Gluon, TMA)
            cfg = register_fit(cfg)
        ints = (M, N, *x.stride(), *w.stride(), *w_scales.stride(), *out.stride())
        consts = dict(K=K, ACT_MXFP4=act, INTERPRET=_INTERPRETED, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
        if cfg.tiles_m:
            grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m * cfg.tiles_m), B)
            kernel = KernelLaunch(_bmm_stationary_kernel, grid, dict(TILES_M=cfg.tiles_m, **consts))
        else:
            grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m), B)
            consts.update(W_BF16=cfg.predecode)
            kernel = KernelLaunch(_bmm_tiled_kernel, grid, consts)

        def main(x, w, w_scales, out):
            kernel(x, w, w_scales, out, *ints)

    if not cfg.predecode:
        return main
    bk = _block_k(K, 128)
    decode_grid = (triton.cdiv(N, 32), K // bk, B)
    decode = KernelLaunch(_decode_kernel, decode_grid, dict(BLOCK_N=32, BLOCK_K=bk, INTERPRET=_INTERPRETED))
    decode_ints = (N, *w_codes.stride(), *w_scales.stride(), *w.stride()[:2])

    def predecode_then_main(x, w_codes, w_scales, out):
        w = torch.empty(B, N, K, dtype=torch.bfloat16, device=x.device)
        decode(w_codes, w_scales, w, *decode_ints)
        main(x, w, w_scales, out)

    return predecode_then_main


_PREPARED: dict = {}  # call signature -> launch function (:func:`_prepare`)
_MAX_PREPARED = 4096  # signatures kept (prefill sizes vary); the dict starts over when full


def _signature(x, w_codes, w_scales, out, act_quant: str, config) -> tuple | None:
    """All :func:`_prepare` and the compiled kernels depend on: each tensor's dtype, shape, strides, device and
    16-byte alignment, the options. None when an argument is not a tensor or the config is not hashable (such
    calls are validated and prepared every time)."""
    try:
        sig = (act_quant, config, *[None if t is None else (t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16)
                                    for t in (x, w_codes, w_scales, out)])  # fmt: skip
        hash(sig)
    except (AttributeError, TypeError):
        return None
    return sig


def bmm_a16wfp4(
    x: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    *,
    act_quant: str = "mxfp4",
    out: torch.Tensor | None = None,
    config: BmmConfig | None = None,
) -> torch.Tensor:
    """``out[b] = act(x[b]) @ dequant(w[b])^T``; returns ``out`` ``[B, M, N]`` bf16.

    x ``[B, M, K]`` bf16, w_codes ``[B, N, K/2]`` u8, w_scales ``[B, N, K/32]`` u8, any non-negative strides;
    K a multiple of 32. Without ``out``, allocates a batch-major ``[M, B, N]`` buffer and returns its
    ``[B, M, N]`` view. ``config`` overrides :func:`config_for`'s choice.

    The first call with a signature (:func:`_signature`) validates it and prepares its launches; later calls
    with the same signature only launch (a few tens of microseconds of host time instead of 100-200). Where the
    default config's kernel does not fit the GPU's shared memory, or Triton's code for it is unsafe there
    (:class:`UnsafeKernel`: a Hopper wgmma hazard), the call and later ones with its signature take
    :func:`unpipelined`; a ``config`` that does either raises :class:`BackendError`. An x whose start or strides are
    not 16-byte aligned is copied into an aligned buffer first where the config's Gluon or TMA kernel can then serve
    the call (those read x through tensor descriptors), or where the tiled kernel runs on 2 warps or fewer (which
    would read and round it one value a thread at a time); x itself is never written. An ``out`` off 16 bytes is written
    in place (by the Gluon kernels' plain stores, :func:`gluon_bmm.plain_y`).
    """
    ok, why = available()
    if not ok:
        raise BackendError(f"triton bmm_a16wfp4 unavailable: {why}")
    sig = _signature(x, w_codes, w_scales, out, act_quant, config)
    launch = _PREPARED.get(sig)
    if launch is None:
        _validate(x, w_codes, w_scales, act_quant, out)
    if out is None:  # a signature with out=None is prepared for this layout
        out = torch.empty(x.shape[1], x.shape[0], w_codes.shape[1], dtype=torch.bfloat16, device=x.device)
        out = out.transpose(0, 1)
    if launch is None:
        launch = _prepare(x, w_codes, w_scales, act_quant, out, config)
        if sig is not None:
            if len(_PREPARED) >= _MAX_PREPARED:
                _PREPARED.clear()
            _PREPARED[sig] = launch
    try:
        launch(x, w_codes, w_scales, out)
    except (triton.runtime.errors.OutOfResources, UnsafeKernel) as exc:  # raised before anything of out is written
        if config is not None:
            why = "is unsafe on this GPU" if isinstance(exc, UnsafeKernel) else "does not fit this GPU"
            raise BackendError(f"triton bmm_a16wfp4: config {config} {why}: {exc}") from exc
        B, M, K = x.shape
        fallback = unpipelined(config_for(B, M, w_codes.shape[1], K, x.device))
        launch = _prepare(x, w_codes, w_scales, act_quant, out, fallback)
        if sig is not None:
            _PREPARED[sig] = launch
        launch(x, w_codes, w_scales, out)
    return out
