"""Portable Triton sparse MLA: top-k attention over a BF16 latent cache (rope-free 512 or latent+rope 576).

Computes :func:`glm_pack.runtime.reference.sparse_mla` (bf16 inputs, fp32 softmax and accumulation, bf16
output, optional natural-log LSE). One program takes a block of heads of one token against one split of
that token's selected rows, so each gathered row is read once for all heads of the block (the q tile is
``[BLOCK_H, L]``, rows ``[BLOCK_N, L + R]``, scores and ``P @ V`` through ``tl.dot``). When tokens are few,
the top-k axis is split across programs (flash-decoding): each split writes an unnormalised fp32 partial
``[L]`` plus its running max and sum, and a second kernel combines the splits. Launch shapes come from
:func:`default_config` (tuned on an H200, see BENCHMARKS.md), or :func:`compact_config` where a GPU's shared
memory is too small for them.

Importing this module never fails without Triton: :func:`available` says why the kernel cannot run. With
``TRITON_INTERPRET=1`` set before this module is imported, the kernels run on CPU tensors (Triton's
interpreter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glm_pack.packing.errors import BackendError
from glm_pack.runtime.kernels._triton import IMPORT_ERROR as _TRITON_ERROR
from glm_pack.runtime.kernels._triton import availability, interpreted, sm_count, tl, triton, tuned_here
from glm_pack.runtime.reference import cache_rows

_LOG2E = 1.4426950408889634
_INTERPRETED = interpreted()  # read at import: Triton picks interpreter or compiler when a kernel is defined

if not _TRITON_ERROR:
    from glm_pack.runtime.kernels._triton import dot_fp32, to_bf16

    @triton.jit
    def _tile(
        q,
        qr,
        kv_ptr,
        idx_ptr,
        off,
        hi,
        n_slots,
        s_kv,
        qk_scale,
        m_i,
        l_i,
        acc,
        L: tl.constexpr,
        R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """Online-softmax update of ``(m_i, l_i, acc)`` by the selected rows ``[off, min(off + BLOCK_N, hi))``."""
        offs_n = off + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + offs_n, mask=offs_n < hi, other=-1)
        valid = (idx >= 0) & (idx < n_slots)
        row = tl.where(valid, idx, 0).to(tl.int64) * s_kv
        offs_l = tl.arange(0, L)
        c = tl.load(kv_ptr + row[:, None] + offs_l[None, :], mask=valid[:, None], other=0.0)
        s = dot_fp32(q, tl.trans(c), tl.zeros([q.shape[0], BLOCK_N], tl.float32), INTERPRET)
        if R > 0:
            offs_r = tl.arange(0, R)
            kr = tl.load(kv_ptr + row[:, None] + L + offs_r[None, :], mask=valid[:, None], other=0.0)
            s = dot_fp32(qr, tl.trans(kr), s, INTERPRET)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot_fp32(to_bf16(p, INTERPRET), c, acc * alpha[:, None], INTERPRET)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["n_slots", "n_idx", "num_splits"])
    def _fwd(
        q_ptr, qr_ptr, kv_ptr, indptr_ptr, idx_ptr,
        out_ptr, lse_ptr, part_ptr, pm_ptr, pl_ptr,
        H, n_slots, n_idx, num_splits, n_hblocks, qk_scale,
        s_qt, s_qh, s_qd, s_rt, s_rh, s_rd, s_kv, s_ot, s_oh, s_od,
        L: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, RETURN_LSE: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        # Head blocks vary fastest so the programs sharing one token's rows run side by side (L2 reuse).
        pid = tl.program_id(0)
        hb = pid % n_hblocks
        rest = pid // n_hblocks
        split = rest % num_splits
        t = (rest // num_splits).to(tl.int64)

        start = tl.maximum(tl.load(indptr_ptr + t), 0)  # a range reaching outside kv_indices is cut to it
        end = tl.minimum(tl.load(indptr_ptr + t + 1), n_idx)
        n = tl.maximum(end - start, 0)
        chunk = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, end)

        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_l = tl.arange(0, L)
        q = tl.load(q_ptr + t * s_qt + offs_h[:, None] * s_qh + offs_l[None, :] * s_qd, mask=hmask[:, None], other=0.0)
        qr = q  # placeholder operand when rope-free
        if R > 0:
            offs_r = tl.arange(0, R)
            qr = tl.load(
                qr_ptr + t * s_rt + offs_h[:, None] * s_rh + offs_r[None, :] * s_rd, mask=hmask[:, None], other=0.0
            )

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, L], tl.float32)
        if INTERPRET:  # the 3.6 interpreter cannot index range() by a tensor under numpy >= 2.4
            off = lo
            while off < hi:
                m_i, l_i, acc = _tile(
                    q, qr, kv_ptr, idx_ptr, off, hi, n_slots, s_kv, qk_scale, m_i, l_i, acc, L, R, BLOCK_N, INTERPRET
                )
                off += BLOCK_N
        else:
            for off in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _tile(
                    q, qr, kv_ptr, idx_ptr, off, hi, n_slots, s_kv, qk_scale, m_i, l_i, acc, L, R, BLOCK_N, INTERPRET
                )

        if SPLIT:
            row_ml = (t * num_splits + split) * H + offs_h
            tl.store(pm_ptr + row_ml, m_i, mask=hmask)
            tl.store(pl_ptr + row_ml, l_i, mask=hmask)
            tl.store(part_ptr + row_ml[:, None] * L + offs_l[None, :], acc, mask=hmask[:, None])
        else:
            l_safe = tl.where(l_i > 0, l_i, 1.0)  # acc is all zeros where l_i == 0 (no valid row)
            o = acc / l_safe[:, None]
            tl.store(
                out_ptr + t * s_ot + offs_h[:, None] * s_oh + offs_l[None, :] * s_od,
                to_bf16(o, INTERPRET),
                mask=hmask[:, None],
            )
            if RETURN_LSE:
                lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
                tl.store(lse_ptr + t * H + offs_h, lse, mask=hmask)

    @triton.jit(do_not_specialize=["num_splits"])
    def _combine(
        part_ptr, pm_ptr, pl_ptr, out_ptr, lse_ptr,
        H, num_splits, s_ot, s_oh, s_od,
        L: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, RETURN_LSE: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)  # t * H + h
        t = (pid // H).to(tl.int64)
        h = pid % H
        lb = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        smask = offs_s < num_splits
        rows = (t * num_splits + offs_s) * H + h
        m = tl.load(pm_ptr + rows, mask=smask, other=float("-inf"))
        lsum = tl.load(pl_ptr + rows, mask=smask, other=0.0)
        m_max = tl.max(m, 0)
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_ref)
        denom = tl.sum(w * lsum, 0)
        d_safe = tl.where(denom > 0, denom, 1.0)  # every partial is zero where denom == 0
        offs_l = lb * BLOCK_L + tl.arange(0, BLOCK_L)
        part = tl.load(part_ptr + rows[:, None] * L + offs_l[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(part * w[:, None], 0) / d_safe
        tl.store(out_ptr + t * s_ot + h * s_oh + offs_l * s_od, to_bf16(o, INTERPRET))
        if RETURN_LSE:
            if lb == 0:
                lse = tl.where(denom > 0, (m_max + tl.log2(d_safe)) / 1.4426950408889634, float("-inf"))
                tl.store(lse_ptr + pid, lse)


@dataclass(frozen=True)
class SparseMlaConfig:
    """Launch shape. ``block_h`` heads (power of two >= 16) per program, ``block_n`` selected rows per tile
    (power of two >= 16), ``num_splits`` programs per token along the top-k axis (1: no combine pass)."""

    block_h: int
    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2


def available() -> tuple[bool, str]:
    """``(True, "ok")`` when the kernel can run here, else ``(False, why)``."""
    return availability(_INTERPRETED)


def _with_splits(T, H, n_indices, device, block_h, block_n, num_warps, num_stages, per_sm) -> SparseMlaConfig:
    """Split the top-k axis only as far as one wave of ``per_sm`` programs per multiprocessor allows (a
    partial second wave costs more than the splits gain)."""
    programs = T * -(-H // block_h)
    max_splits = max(1, -(-max(1, n_indices // max(T, 1)) // block_n))
    num_splits = min(max_splits, max(1, per_sm * sm_count(device) // programs))
    return SparseMlaConfig(block_h, block_n, num_splits, num_warps=num_warps, num_stages=num_stages)


def default_config(T: int, H: int, n_indices: int, device: torch.device) -> SparseMlaConfig:
    """Launch shape for ``T`` tokens, ``H`` heads and ``n_indices`` selected rows in all, from host values
    only (no sync, so CUDA-graph capture works). Tuned on an H200 (BENCHMARKS.md): 64-head blocks (wgmma,
    one program per SM, ~220 KB shared memory) when heads and tokens are many, on sm_90 only (:func:`tuned_here`:
    elsewhere their kernel spills, 8-104 bytes a thread on NVIDIA's sm_80-sm_120, 1.0-1.5 KB a lane on AMD's);
    otherwise 16-head blocks (mma.sync), two programs per SM, or one deeper-pipelined program per SM while one wave
    of programs needs splitting (a quarter to one wave of tokens x head blocks)."""
    sms = sm_count(device)
    if H > 16 and T * H > 256 and tuned_here(device):
        return _with_splits(T, H, n_indices, device, 64, 64, 8, 3, per_sm=1)
    if sms // 4 <= T * -(-H // 16) < sms:
        return _with_splits(T, H, n_indices, device, 16, 64, 8, 5, per_sm=1)
    return _with_splits(T, H, n_indices, device, 16, 64, 4, 2, per_sm=2)


def compact_config(T: int, H: int, n_indices: int, device: torch.device) -> SparseMlaConfig:
    """Small tiles (~40 KB of shared memory) for GPUs where :func:`default_config` does not fit."""
    return _with_splits(T, H, n_indices, device, 16, 16, 4, 2, per_sm=2)


def _is_pow2_at_least_16(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def _check_tensor(x: object, name: str, dtype: torch.dtype, ndim: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise BackendError(f"triton sparse MLA: {name} must be a torch.Tensor, got {type(x).__name__}", tensor=name)
    if x.dtype != dtype:
        raise BackendError(f"triton sparse MLA: {name} must be {dtype}, got {x.dtype}", tensor=name)
    if x.dim() not in ndim:
        raise BackendError(
            f"triton sparse MLA: {name} must have {' or '.join(map(str, ndim))} dims, got shape {tuple(x.shape)}",
            tensor=name,
        )
    return x


def _validate(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, out):
    """Check the contract; return ``(rows [slots, L + R] view, R)``."""
    _check_tensor(q_latent, "q_latent", torch.bfloat16, (3,))
    T, H, L = q_latent.shape
    if not _is_pow2_at_least_16(L):
        raise BackendError(f"triton sparse MLA: latent width L={L} must be a power of two >= 16", tensor="q_latent")
    R = 0
    if q_rope is not None:
        _check_tensor(q_rope, "q_rope", torch.bfloat16, (3,))
        R = q_rope.shape[2]
        if tuple(q_rope.shape[:2]) != (T, H) or not _is_pow2_at_least_16(R):
            raise BackendError(
                f"triton sparse MLA: q_rope must be [T={T}, H={H}, R] with R a power of two >= 16, "
                f"got {tuple(q_rope.shape)}",
                tensor="q_rope",
            )
    _check_tensor(kv_cache, "kv_cache", torch.bfloat16, (2, 3, 4))
    if kv_cache.shape[-1] != L + R:
        raise BackendError(
            f"triton sparse MLA: kv_cache rows must be L + R = {L} + {R} = {L + R} wide, got {kv_cache.shape[-1]}",
            tensor="kv_cache",
        )
    rows = cache_rows(kv_cache, "triton sparse MLA")
    _check_tensor(kv_indptr, "kv_indptr", torch.int32, (1,))
    if kv_indptr.numel() != T + 1:
        raise BackendError(
            f"triton sparse MLA: kv_indptr must have T + 1 = {T + 1} entries, got {kv_indptr.numel()}",
            tensor="kv_indptr",
        )
    _check_tensor(kv_indices, "kv_indices", torch.int32, (1,))
    if out is not None:
        _check_tensor(out, "out", torch.bfloat16, (3,))
        if tuple(out.shape) != (T, H, L):
            raise BackendError(f"triton sparse MLA: out must be [{T}, {H}, {L}], got {tuple(out.shape)}", tensor="out")
    named = [("q_latent", q_latent), ("q_rope", q_rope), ("kv_cache", kv_cache), ("kv_indptr", kv_indptr),
             ("kv_indices", kv_indices), ("out", out)]  # fmt: skip
    for name, x in named:
        if x is not None and x.device != q_latent.device:
            raise BackendError(
                f"triton sparse MLA: {name} is on {x.device}, q_latent on {q_latent.device}", tensor=name
            )
    if q_latent.device.type != "cuda" and not _INTERPRETED:
        raise BackendError(
            f"triton sparse MLA needs GPU tensors (got {q_latent.device}); set TRITON_INTERPRET=1 to run on CPU",
            tensor="q_latent",
        )
    if not math.isfinite(float(softmax_scale)):
        raise BackendError(f"triton sparse MLA: softmax_scale must be finite, got {softmax_scale}")
    return rows, R


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor | None,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    softmax_scale: float,
    *,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: SparseMlaConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA over selected latent rows (the contract of ``glm_pack.runtime.reference.sparse_mla``).

    q_latent ``[T, H, L]`` bf16 (any strides), q_rope ``[T, H, R]`` bf16 or None (rope-free), kv_cache bf16
    ``[slots, L+R]``, ``[blocks, block, L+R]`` or ``[slots, 1, 1, L+R]`` (flattened to global slots),
    kv_indptr ``[T+1]`` int32, kv_indices flat int32 global slot ids: -1 (and any id outside the cache,
    which the kernel cannot report without a host sync) is skipped; a repeated id counts each time; a token's
    range is cut to ``[0, len(kv_indices)]`` (a falling kv_indptr gives it no rows).
    Returns ``out [T, H, L]`` bf16 (written into ``out`` when given) and, with ``return_lse``, the natural-log
    LSE ``[T, H]`` float32 (-inf, with a zero output row, for a token with no valid row). ``config`` overrides
    :func:`default_config`.
    """
    ok, why = available()
    if not ok:
        raise BackendError(f"triton sparse MLA unavailable: {why}")
    rows, R = _validate(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, out)
    kv_indptr, kv_indices = kv_indptr.contiguous(), kv_indices.contiguous()  # the kernel reads both unit-stride
    T, H, L = q_latent.shape
    dev = q_latent.device
    if out is None:
        out = torch.empty(T, H, L, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev) if return_lse else None
    if T == 0 or H == 0:
        return out, lse
    cfg = config or default_config(T, H, kv_indices.numel(), dev)
    if not (_is_pow2_at_least_16(cfg.block_h) and _is_pow2_at_least_16(cfg.block_n) and cfg.num_splits >= 1):
        raise BackendError(f"triton sparse MLA: bad config {cfg}")
    qr = q_latent if q_rope is None else q_rope  # an unused pointer when rope-free
    kernel = (dev, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.num_splits > 1, L, R, return_lse)
    if config is None and kernel in _UNFIT:
        cfg = compact_config(T, H, kv_indices.numel(), dev)
    try:
        _launch(q_latent, qr, R, rows, kv_indptr, kv_indices, softmax_scale, out, lse, cfg)
    except triton.runtime.errors.OutOfResources as exc:  # less shared memory than an H200 (A100, gfx950's 160 KiB)
        if config is not None:
            raise BackendError(f"triton sparse MLA: config {cfg} does not fit this GPU: {exc}") from exc
        _UNFIT.add(kernel)
        small = compact_config(T, H, kv_indices.numel(), dev)
        _launch(q_latent, qr, R, rows, kv_indptr, kv_indices, softmax_scale, out, lse, small)
    return out, lse


# Default launches (device, shape, split or not, L, R, LSE or not) whose kernel needed more shared memory than the GPU
# has: later calls go straight to the compact launch instead of failing to load the same kernel again.
_UNFIT: set[tuple] = set()


def _launch(q_latent, qr, R, rows, kv_indptr, kv_indices, softmax_scale, out, lse, cfg: SparseMlaConfig) -> None:
    """Run the forward kernel (and the combine kernel when ``cfg`` splits the top-k axis)."""
    T, H, L = q_latent.shape
    n_hblocks = -(-H // cfg.block_h)
    split = cfg.num_splits > 1
    if split:
        part = torch.empty(T, cfg.num_splits, H, L, dtype=torch.float32, device=out.device)
        pm = torch.empty(T, cfg.num_splits, H, dtype=torch.float32, device=out.device)
        pl = torch.empty_like(pm)
    else:
        part = pm = pl = out  # unused pointers
    lse_arg = lse if lse is not None else out
    _fwd[(T * cfg.num_splits * n_hblocks,)](
        q_latent, qr, rows, kv_indptr, kv_indices, out, lse_arg, part, pm, pl,
        H, rows.shape[0], kv_indices.numel(), cfg.num_splits, n_hblocks, float(softmax_scale) * _LOG2E,
        *q_latent.stride(), *qr.stride(), rows.stride(0), *out.stride(),
        L=L, R=R, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, SPLIT=split, RETURN_LSE=lse is not None,
        INTERPRET=_INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split:
        block_l = min(L, 128)
        _combine[(T * H, L // block_l)](
            part, pm, pl, out, lse_arg, H, cfg.num_splits, *out.stride(),
            L=L, BLOCK_S=triton.next_power_of_2(cfg.num_splits), BLOCK_L=block_l, RETURN_LSE=lse is not None,
            INTERPRET=_INTERPRETED, num_warps=4,
        )  # fmt: skip
