"""The interface every runtime backend implements (torch reference, Triton, aiter).

All tensors are on the backend's device. Batched GEMMs take views with arbitrary positive strides:
``x [B, M, K]`` (the runtime passes ``q.transpose(0, 1)`` of a ``[T, H, K]`` tensor) and write into
``out [B, M, N]`` (a transposed view of a batch-major ``[T, H, N]`` buffer).
"""

from __future__ import annotations

import torch


def gpu_reason(device) -> str:
    """Why GPU kernels cannot run on ``device`` ("" when they can): it must be a CUDA (or ROCm) device and torch
    must see a GPU."""
    if torch.device(device).type != "cuda":
        return f"needs a GPU device, got {device}"
    if not torch.cuda.is_available():
        return f"needs a GPU, but torch sees none (device {device})"
    return ""


class Backend:
    """Base class; subclasses override the three operations."""

    name = "base"

    def bmm_a16wfp4(
        self,
        x: torch.Tensor,
        w_codes: torch.Tensor,
        w_scales: torch.Tensor,
        out: torch.Tensor,
        *,
        op: str,
        act_quant: str,
    ) -> None:
        """``out[b] = act(x[b]) @ dequant(w[b])^T``; ``op`` is "k_up" or "v_up" (selects kernel configs)."""
        raise NotImplementedError

    def bmm_bf16(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """``out[b] = x[b] @ w[b]^T`` for BF16-policy weights (fp32 accumulation)."""
        out.copy_(torch.matmul(x, w.transpose(1, 2)))

    def sparse_mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor | None,
        kv_cache: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        softmax_scale: float,
        *,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Top-k sparse MLA; semantics of :func:`glm_pack.runtime.reference.sparse_mla`."""
        raise NotImplementedError
