"""Hopper (sm_90) Gluon kernel for the A16WFP4 batched GEMM on predecoded bf16 weights: TMA + wgmma.

Same function as :func:`glm_pack.runtime.kernels.triton_bmm.bmm_a16wfp4` (which dispatches here): x ``[B, M, K]``
bf16 (unit last stride), decoded weights w ``[B, N, K]`` bf16, y ``[B, M, N]`` bf16 (unit last stride; the
runtime passes a view of the batch-major ``[T, H, N]`` buffer), all read and written through 3-D tensor
descriptors. With ``act_mxfp4`` each x tile is rounded to MXFP4 in shared memory, in place, by the shared
:func:`~glm_pack.runtime.kernels.mxfp4_jit.mxfp4_even_round_trip` (bit-exact), before the MMAs read it.

One program per multiprocessor at most; ``[block_m, block_n]`` output tiles (``block_m = 16 * num_warps``, two
warpgroups at 128 rows), ``block_k`` K steps, both operands from shared memory (wgmma SS), fp32 accumulators in
registers; y leaves in two column halves through one ``[block_m, block_n / 2]`` buffer. Two schedules:

* ``stationary``: a program owns one ``(b, n0)`` column of weights, kept in shared memory for the whole call
  (``block_n * K * 2`` bytes), and a contiguous run of its M tiles; x streams through a ring. The weights then
  cross L2 once per program instead of once per tile, which on the H200 is what bounds the streaming schedule.
* ``streaming``: x and w tiles stream through one ring; programs walk all tiles (N fastest, then M, then B).
  For weights too large to keep (GLM's V-up: 256 x 512 bf16 = 256 KiB per head).

The x ring has as many stages as fit in shared memory, up to 4. TMA loads for step ``i + stages - 1`` are
issued once the MMAs of step ``i - 1`` are done, so the rounding of step ``i`` overlaps the MMAs of ``i - 1``.

Gluon has no interpreter: under ``TRITON_INTERPRET=1``, on AMD GPUs and on NVIDIA GPUs other than sm_90 (wgmma
is sm_90-only), :func:`unusable_reason` says why and the caller runs its Triton kernels instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from glm_pack.runtime.kernels._triton import IMPORT_ERROR as _TRITON_ERROR
from glm_pack.runtime.kernels._triton import interpreted, sm_count, tma_strides_ok, triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    IMPORT_ERROR = _TRITON_ERROR
except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
    IMPORT_ERROR = _TRITON_ERROR or f"triton's gluon cannot be imported: {exc}"

MAX_STAGES = 4
_SMEM_SLACK = 1024  # barriers and alignment, bytes
_INTERPRETED = interpreted()  # read at import, as the kernels below are defined (or not) by it

if not IMPORT_ERROR and not _INTERPRETED:
    from glm_pack.runtime.kernels.mxfp4_jit import mxfp4_even_round_trip

    @gluon.jit
    def _tile(t, pid, M, N, PROGRAMS, SPLITS, BM: gl.constexpr, BN: gl.constexpr, STATIONARY: gl.constexpr):
        """(b, m0, n0) of this program's t-th tile."""
        tiles_m = gl.cdiv(M, BM)
        tiles_n = gl.cdiv(N, BN)
        if STATIONARY:  # program = (column, split): SPLITS consecutive programs share a column
            col = pid // SPLITS
            m_tile = (pid % SPLITS) * gl.cdiv(tiles_m, SPLITS) + t
            return col // tiles_n, m_tile * BM, (col % tiles_n) * BN
        else:
            tile = pid + t * PROGRAMS
            return tile // (tiles_n * tiles_m), (tile // tiles_n % tiles_m) * BM, (tile % tiles_n) * BN

    @gluon.jit
    def _load_step(x_desc, w_desc, x_bufs, w_bufs, x_ready, w_ready, j, pid, M, N, PROGRAMS, SPLITS,
                   K: gl.constexpr, STATIONARY: gl.constexpr):  # fmt: skip
        """Issue the TMA loads of flattened step j (tile j // KSTEPS, K step j % KSTEPS) into ring slot j % S."""
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        BN: gl.constexpr = w_desc.block_type.shape[1]
        KSTEPS: gl.constexpr = K // BK
        b, m0, n0 = _tile(j // KSTEPS, pid, M, N, PROGRAMS, SPLITS, BM, BN, STATIONARY)
        k = (j % KSTEPS) * BK
        s = j % x_bufs.type.shape[0]
        mbarrier.expect(x_ready.index(s), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [b, m0, k], x_ready.index(s), x_bufs.index(s))
        if not STATIONARY:
            mbarrier.expect(w_ready.index(s), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [b, n0, k], w_ready.index(s), w_bufs.index(s))

    @gluon.jit
    def _bmm_kernel(x_desc, w_desc, y_desc, M, N, B, PROGRAMS, SPLITS, K: gl.constexpr, ACT_MXFP4: gl.constexpr,
                    STATIONARY: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        """Grid ``(PROGRAMS,)``; descriptors over x ``[B, M, K]`` (block ``[1, BM, BK]``), w ``[B, N, K]``
        (``[1, BN, BK]``) and y ``[B, M, N]`` (``[1, BM, BN / 2]``). STATIONARY: PROGRAMS = columns * SPLITS."""
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        BN: gl.constexpr = w_desc.block_type.shape[1]
        HN: gl.constexpr = BN // 2
        KSTEPS: gl.constexpr = K // BK
        W_SLOTS: gl.constexpr = KSTEPS if STATIONARY else STAGES
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
        )
        # rounding layout: a thread holds one whole 32-block of a row, so block maxima need no shuffles
        round_layout: gl.constexpr = gl.BlockedLayout([1, 32], [32 // (BK // 32), BK // 32], [num_warps, 1], [1, 0])
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [W_SLOTS] + w_desc.block_type.shape, w_desc.layout)
        y_buf = gl.allocate_shared_memory(y_desc.dtype, y_desc.block_type.shape, y_desc.layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [W_SLOTS, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(x_ready.index(st), count=1)
        for st in gl.static_range(W_SLOTS):
            mbarrier.init(w_ready.index(st), count=1)
        pid = gl.program_id(0)
        if STATIONARY:
            tiles_m = gl.cdiv(M, BM)
            per = gl.cdiv(tiles_m, SPLITS)
            n_tiles = gl.maximum(gl.minimum(per, tiles_m - (pid % SPLITS) * per), 0)
            b, m0, n0 = _tile(0, pid, M, N, PROGRAMS, SPLITS, BM, BN, STATIONARY)
            mbarrier.expect(w_ready.index(0), KSTEPS * w_desc.block_type.nbytes)
            for kk in gl.static_range(KSTEPS):
                tma.async_copy_global_to_shared(w_desc, [b, n0, kk * BK], w_ready.index(0), w_bufs.index(kk))
        else:
            n_tiles = gl.cdiv(B * gl.cdiv(M, BM) * gl.cdiv(N, BN) - pid, PROGRAMS)
        steps = n_tiles * KSTEPS
        for j in gl.static_range(STAGES - 1):
            if j < steps:
                _load_step(x_desc, w_desc, x_bufs, w_bufs, x_ready, w_ready, j, pid, M, N, PROGRAMS, SPLITS,
                           K, STATIONARY)  # fmt: skip
        if STATIONARY:
            mbarrier.wait(w_ready.index(0), 0)  # also keeps a program without tiles alive until its loads land
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        for i in range(steps):
            xs = x_bufs.index(i % STAGES).reshape([BM, BK])
            mbarrier.wait(x_ready.index(i % STAGES), (i // STAGES) & 1)
            if ACT_MXFP4:
                xs.store(mxfp4_even_round_trip(xs.load(round_layout), BM, BK, False))
                fence_async_shared()  # generic-proxy writes before the MMA's (async-proxy) reads
            if STATIONARY:
                ws = w_bufs.index(i % KSTEPS).reshape([BN, BK])
            else:
                mbarrier.wait(w_ready.index(i % STAGES), (i // STAGES) & 1)
                ws = w_bufs.index(i % STAGES).reshape([BN, BK])
            acc = warpgroup_mma(xs, ws.permute((1, 0)), acc, use_acc=(i % KSTEPS) != 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if i + STAGES - 1 < steps:  # into the slot of step i - 1, whose MMAs are done
                _load_step(x_desc, w_desc, x_bufs, w_bufs, x_ready, w_ready, i + STAGES - 1, pid, M, N, PROGRAMS,
                           SPLITS, K, STATIONARY)  # fmt: skip
            if i % KSTEPS == KSTEPS - 1:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                b, m0, n0 = _tile(i // KSTEPS, pid, M, N, PROGRAMS, SPLITS, BM, BN, STATIONARY)
                y0, y1 = acc.to(gl.bfloat16).reshape([BM, 2, HN]).permute((0, 2, 1)).split()
                tma.store_wait(0)  # the previous store has read y_buf
                y_buf.reshape([BM, HN]).store(y0)
                fence_async_shared()
                tma.async_copy_shared_to_global(y_desc, [b, m0, n0], y_buf)
                tma.store_wait(0)
                y_buf.reshape([BM, HN]).store(y1)
                fence_async_shared()
                tma.async_copy_shared_to_global(y_desc, [b, m0, n0 + HN], y_buf)
        tma.store_wait(0)


@dataclass(frozen=True)
class Plan:
    """A launch: tile sizes, warps, schedule and x-ring stages (shared memory permitting)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    stationary: bool
    stages: int


@functools.cache
def _device_reason(device: torch.device) -> str:
    if torch.version.hip is not None:
        return "wgmma kernels are NVIDIA-only (AMD GPU)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"wgmma needs compute capability 9.x (sm_90), this GPU is {major}.{minor}"
    return ""


@functools.cache
def smem_limit(device: torch.device) -> int:
    """Shared memory one program may opt into on this GPU (bytes)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def smem_bytes(block_m: int, block_n: int, block_k: int, K: int, stationary: bool, stages: int) -> int:
    """Shared memory of a launch (bytes): x ring, w (whole column, or a ring), the y half-tile buffer."""
    x_stage, w_stage = block_m * block_k * 2, block_n * block_k * 2
    w = (K // block_k) * w_stage if stationary else stages * w_stage
    return stages * x_stage + w + block_m * block_n + _SMEM_SLACK


def tile_error(block_m: int, block_n: int, block_k: int, num_warps: int) -> str:
    """Why these tiles break the kernel's shape rules ("" when they do not): ``block_m == 16 * num_warps`` with
    4 or 8 warps (one or two warpgroups), ``block_n`` a multiple of 32 up to 256, ``block_k`` 32 to 256."""
    if num_warps not in (4, 8) or block_m != 16 * num_warps:
        return f"block_m={block_m} with num_warps={num_warps}: needs 4 or 8 warps and block_m = 16 * num_warps"
    if block_n % 32 or not 32 <= block_n <= 256:
        return f"block_n={block_n}: needs a multiple of 32 up to 256"
    if not 32 <= block_k <= 256:
        return f"block_k={block_k}: needs 32 to 256"
    return ""


def plan(block_m: int, block_n: int, block_k: int, num_warps: int, stationary: bool, K: int, smem: int) -> Plan | None:
    """The launch for tiles that pass :func:`tile_error` (``block_k`` dividing K) with the most x stages
    (<= :data:`MAX_STAGES`, >= 2) fitting ``smem`` bytes; None when none fits."""
    for stages in range(MAX_STAGES, 1, -1):
        if smem_bytes(block_m, block_n, block_k, K, stationary, stages) <= smem:
            return Plan(block_m, block_n, block_k, num_warps, stationary, stages)
    return None


def unusable_reason(x: torch.Tensor, out: torch.Tensor) -> str:
    """Why this kernel cannot serve these tensors ("" when it can): Gluon importable, compiled kernels, an
    sm_90 NVIDIA GPU, x and out with unit last stride and 16-byte-aligned base and other strides."""
    if IMPORT_ERROR:
        return IMPORT_ERROR
    if _INTERPRETED:
        return "Gluon kernels do not run in Triton's interpreter"
    if x.device.type != "cuda":
        return f"tensors on {x.device}"
    reason = _device_reason(x.device)
    if reason:
        return reason
    for name, t in (("x", x), ("out", out)):
        if not tma_strides_ok(t):
            return f"{name} strides {t.stride()} are not TMA-compatible (unit last, 16-byte aligned others)"
    return ""


@functools.cache
def _smem_layout(block: tuple[int, ...]):
    """The swizzled shared-memory layout of a bf16 TMA block (cached: it is on every call's path)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, act_mxfp4: bool, p: Plan) -> None:
    """``out[b] = act(x[b]) @ w[b]^T`` for bf16 ``w [B, N, K]`` (contiguous); the caller checked
    :func:`unusable_reason` and made ``p`` with :func:`plan`."""
    B, M, K = x.shape
    N = w.shape[1]
    bm, bn, bk = p.block_m, p.block_n, p.block_k
    x_desc, w_desc, y_desc = (
        TensorDescriptor.from_tensor(t, list(block), _smem_layout(block))
        for t, block in ((x, (1, bm, bk)), (w, (1, bn, bk)), (out, (1, bm, bn // 2)))
    )
    sms = sm_count(x.device)
    columns = B * triton.cdiv(N, bn)
    if p.stationary:  # spread each column's M tiles over the multiprocessors left over
        splits = max(1, min(triton.cdiv(M, bm), sms // columns))
        programs = columns * splits
    else:
        splits = 1
        programs = min(sms, columns * triton.cdiv(M, bm))
    _bmm_kernel[(programs,)](
        x_desc, w_desc, y_desc, M, N, B, programs, splits, K=K, ACT_MXFP4=act_mxfp4, STATIONARY=p.stationary,
        STAGES=p.stages, num_warps=p.num_warps,
    )  # fmt: skip
