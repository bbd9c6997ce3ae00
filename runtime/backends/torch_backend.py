"""The torch backend: the reference semantics on any device. Always available."""

from __future__ import annotations

from glm_pack.runtime import reference

from .base import Backend


class TorchBackend(Backend):
    name = "torch"

    def bmm_a16wfp4(self, x, w_codes, w_scales, out, *, op, act_quant):
        out.copy_(reference.bmm_a16wfp4(x, w_codes, w_scales, act_quant=act_quant))

    def bmm_bf16(self, x, w, out):
        out.copy_(reference.bmm_bf16(x, w))

    def sparse_mla(self, q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, *, return_lse):
        return reference.sparse_mla(
            q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, return_lse=return_lse
        )
