"""Torch reference semantics of the runtime's kernels. Every backend must compute these functions.

* :func:`bmm_a16wfp4` is aiter's ``batched_gemm_a16wfp4(prequant=True)``: the bf16 activation is quantized
  to MXFP4 per 32-block along K (even rule), then multiplied with the MXFP4 weight in fp32; bf16 out.
* :func:`sparse_mla` is top-k sparse attention over a BF16 latent cache, in fp32, bf16 out.
"""

from __future__ import annotations

import torch

from glm_pack.packing.errors import BackendError
from glm_pack.packing.mxfp4 import dequantize, quantize

ACT_QUANT_MODES = ("mxfp4", "none")


def activation_as_float(x: torch.Tensor, act_quant: str) -> torch.Tensor:
    """bf16 activation ``[..., K]`` -> float32 values the kernel multiplies (MXFP4 even round trip or as is).

    A NaN stays NaN, so a NaN activation row gives a NaN output row: E2M1 has no NaN and the codec writes it
    as +-0, which would hide it (the rest of its block goes to scale 2**127, i.e. +-0 or +-Inf)."""
    if act_quant == "mxfp4":
        codes, scales = quantize(x, mode="even", axis=-1, check_finite_input=False)
        return torch.where(torch.isnan(x), x.float(), dequantize(codes, scales, axis=-1))
    if act_quant == "none":
        return x.float()
    raise BackendError(f"act_quant must be one of {ACT_QUANT_MODES}, got {act_quant!r}")


def bmm_a16wfp4(
    x: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, *, act_quant: str = "mxfp4"
) -> torch.Tensor:
    """``Y[b] = act(X[b]) @ dequant(W[b])^T``: x ``[B, M, K]`` bf16, w ``[B, N, K/2]`` u8 + ``[B, N, K/32]`` u8
    -> ``[B, M, N]`` bf16 (fp32 accumulation)."""
    w = dequantize(w_codes, w_scales, axis=-1)
    return torch.bmm(activation_as_float(x, act_quant), w.transpose(1, 2)).to(torch.bfloat16)


def bmm_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """BF16-policy weights: x ``[B, M, K]`` bf16, w ``[B, N, K]`` bf16 -> ``[B, M, N]`` bf16 (fp32 accumulation)."""
    return torch.bmm(x.float(), w.float().transpose(1, 2)).to(torch.bfloat16)


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor | None,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    softmax_scale: float,
    *,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA over selected latent rows.

    q_latent ``[T, H, L]`` bf16 (L = kv_lora), q_rope ``[T, H, R]`` or None (rope-free), kv_cache bf16 with last
    dim ``L + R`` (the layouts :func:`cache_rows` views as global slots), kv_indptr ``[T+1]`` int32, kv_indices flat
    int32 global slot ids (-1 = skip). Any other id outside the cache, or a kv_indptr that falls or leaves
    ``[0, len(kv_indices)]``, raises BackendError here (and on aiter, :func:`check_sparse_indices`); the Triton
    kernel, without a host sync, cannot: it skips
    such ids and cuts each token's range to ``[0, len(kv_indices)]``. Scores ``scale * (q_latent . c +
    q_rope . k_rope)``, softmax over the token's valid rows, output ``sum p * c`` -> ``[T, H, L]`` bf16; lse
    ``[T, H]`` float32 natural log (-inf and a zero output for a token with no valid row).
    """
    T, H, L = q_latent.shape
    rows = cache_rows(kv_cache, "torch sparse MLA")  # the layouts the GPU kernels read, no others
    out = torch.zeros(T, H, L, dtype=torch.float32, device=q_latent.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q_latent.device)
    indptr, _ = check_sparse_indices(kv_indptr, kv_indices, rows.shape[0])
    for t in range(T):
        idx = kv_indices[indptr[t] : indptr[t + 1]].long()
        idx = idx[idx >= 0]
        if idx.numel() == 0:
            continue
        sel = rows[idx].float()  # [k, L + R]; only the selected rows are widened, never the whole cache
        scores = q_latent[t].float() @ sel[:, :L].T
        if q_rope is not None:
            scores = scores + q_rope[t].float() @ sel[:, L:].T
        scores = scores * softmax_scale
        lse[t] = torch.logsumexp(scores, dim=-1)
        out[t] = torch.softmax(scores, dim=-1) @ sel[:, :L]
    return out.to(torch.bfloat16), (lse if return_lse else None)


def check_sparse_indices(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, slots: int) -> tuple[list[int], bool]:
    """(kv_indptr as a list, whether kv_indices holds a -1), after checking that kv_indptr rises within
    ``[0, len(kv_indices)]`` and that every id is a slot of the ``slots``-slot cache or -1; BackendError naming the
    tensor otherwise. One pass over kv_indices (its min and max) and two host syncs."""
    indptr = kv_indptr.tolist()
    if any(not 0 <= a <= b <= kv_indices.numel() for a, b in zip(indptr, indptr[1:], strict=False)):
        raise BackendError(
            f"kv_indptr must rise monotonically within [0, {kv_indices.numel()}] (the length of kv_indices), "
            f"got {indptr[:8]}{' ...' if len(indptr) > 8 else ''}",
            tensor="kv_indptr",
        )
    if kv_indices.numel() == 0:
        return indptr, False
    lo, hi = torch.stack(torch.aminmax(kv_indices)).tolist()
    if lo < -1 or hi >= slots:
        i = int(((kv_indices < -1) | (kv_indices >= slots)).nonzero()[0, 0])
        raise BackendError(
            f"kv_indices[{i}] = {int(kv_indices[i])} is not a slot of the {slots}-slot cache (nor -1, skip)",
            tensor="kv_indices",
        )
    return indptr, lo < 0


def cache_rows(kv_cache: torch.Tensor, who: str) -> torch.Tensor:
    """kv_cache ``[slots, W]``, ``[blocks, block, W]`` or ``[slots, 1, 1, W]`` as a ``[slots, W]`` view, as the
    kernels read it (each row unit-stride, one row stride) and so the reference too; BackendError naming kv_cache
    (and ``who``) for a layout no such view has: a copy would detach a kernel from the engine's cache."""
    width = kv_cache.shape[-1]
    if kv_cache.dim() == 4 and tuple(kv_cache.shape[1:3]) != (1, 1):
        raise BackendError(
            f"{who}: a 4-D kv_cache must be [slots, 1, 1, {width}], got {tuple(kv_cache.shape)}", tensor="kv_cache"
        )
    if kv_cache.stride(-1) != 1:
        raise BackendError(f"{who}: kv_cache rows must be contiguous (last stride 1)", tensor="kv_cache")
    try:
        return kv_cache.view(-1, width)
    except RuntimeError as exc:
        raise BackendError(
            f"{who}: kv_cache leading dims cannot be flattened to slots without a copy "
            f"(shape {tuple(kv_cache.shape)}, strides {kv_cache.stride()})",
            tensor="kv_cache",
        ) from exc


def unabsorbed_mla(
    kv_b: torch.Tensor,
    geometry,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Plain (unabsorbed) MLA in float64, the ground truth for the absorbed pipeline k_up -> attend -> v_up.

    kv_b ``[H*(P+V), L]`` float; q ``[T, H, P+R]``; per selected cache row c (latent) and k_rope:
    ``K = W_UK c``, ``V = W_UV c``, score ``scale * (q_nope . K + q_rope . k_rope)``, softmax over the token's
    valid rows -> ``[T, H, V]`` float64.
    """
    g = geometry
    H, P, R, V, L = g.num_heads, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim, g.kv_lora_rank
    w = kv_b.double().view(H, P + V, L)
    w_uk, w_uv = w[:, :P], w[:, P:]
    rows_all = kv_cache.reshape(-1, kv_cache.shape[-1])
    out = torch.zeros(q.shape[0], H, V, dtype=torch.float64)
    indptr = kv_indptr.tolist()
    for t in range(q.shape[0]):
        idx = kv_indices[indptr[t] : indptr[t + 1]].long()
        rows = rows_all[idx[idx >= 0]].double()
        if rows.shape[0] == 0:
            continue
        c, k_rope = rows[:, :L], rows[:, L:]
        k = torch.einsum("hpl,sl->shp", w_uk, c)
        v = torch.einsum("hvl,sl->shv", w_uv, c)
        s = torch.einsum("hp,shp->hs", q[t, :, :P].double(), k)
        if R:
            s = s + q[t, :, P:].double() @ k_rope.T
        out[t] = torch.einsum("hs,shv->hv", torch.softmax(s * softmax_scale, dim=-1), v)
    return out
