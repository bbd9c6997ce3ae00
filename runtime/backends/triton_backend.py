"""The Triton backend: portable kernels for NVIDIA (and AMD where aiter lacks a path)."""

from __future__ import annotations

import torch

from glm_pack.packing.errors import BackendError

from .base import Backend, gpu_reason

MIN_CUDA_CAPABILITY = (8, 0)  # Triton's supported NVIDIA GPUs (its README); below, no bf16 MMA and no bf16x2 PTX


def triton_status(device) -> tuple[bool, str]:
    """(usable, reason): Triton importable and recent enough for the kernels, and the device a GPU torch sees, on
    NVIDIA of compute capability :data:`MIN_CUDA_CAPABILITY` or later that Triton's ptxas can compile for."""
    if why := gpu_reason(device):
        return False, f"triton backend {why}"
    from glm_pack.runtime.kernels._triton import IMPORT_ERROR, ptxas_reason

    if IMPORT_ERROR:
        return False, f"triton backend unavailable: {IMPORT_ERROR}"
    if torch.version.hip is not None:
        return True, "ok"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        need = ".".join(map(str, MIN_CUDA_CAPABILITY))
        return False, (f"triton backend needs an NVIDIA GPU of compute capability {need} or later (Triton's floor), "
                       f"{device} is {capability[0]}.{capability[1]}")  # fmt: skip
    if why := ptxas_reason(capability):
        return False, f"triton backend unavailable on {device}: {why}"
    return True, "ok"


class TritonBackend(Backend):
    name = "triton"

    def __init__(self):
        try:
            from glm_pack.runtime.kernels import triton_bmm, triton_sparse_mla
        except Exception as err:
            raise BackendError(f"triton backend unavailable: {err}") from err
        self._bmm = triton_bmm
        self._sparse = triton_sparse_mla

    def bmm_a16wfp4(self, x, w_codes, w_scales, out, *, op, act_quant):
        self._bmm.bmm_a16wfp4(x, w_codes, w_scales, act_quant=act_quant, out=out)

    def sparse_mla(self, q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, *, return_lse):
        return self._sparse.sparse_mla(
            q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, return_lse=return_lse
        )
