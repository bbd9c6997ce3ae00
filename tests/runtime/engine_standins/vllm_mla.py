"""Stand-in for vLLM's ``MLAAttention`` (``vllm/model_executor/layers/attention/mla_attention.py`` of the vLLM 0.33.0
wheel; 0.16-0.32 and main at 0014ca6b differ in effect in the backend packing (0.29+), AMX (0.29+) and DCP (0.27+)
steps, in how the tensors are stored (attributes or, 0.26+, vLLM's ``replace_parameter``) and, 0.16-0.17, in keeping
no ``_vllm_config`` on the layer: the attributes the adapter reads and writes, ``process_weights_after_loading`` (the
backend impl's own packing first, AMX's early return, DCP query replication's gathered ``W_UK_T_dcp_qrep``, the
rebuild from kv_b_proj, unquantized or FP8 block-scaled), and the decode forward's K-up / V-up calls
(``forward_impl`` MQA branch and ``_v_up_proj``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from glm_pack.packing.mxfp4 import quantize
from glm_pack.runtime.reference import bmm_a16wfp4

from .overlay_fixture import fp8_block_dequant

REBUILDS = []  # layer names whose engine rebuild ran
PACKED = []  # layer names whose backend impl packing (``impl.process_weights_after_loading``) ran
DCP_WORLD = 2  # ranks of the stand-in DCP group; its all_gather stacks this rank's tensor that often


class _DcpGroup:
    def all_gather(self, tensor, dim=0):
        return torch.cat([tensor] * DCP_WORLD, dim=dim)


def get_dcp_group():
    """``vllm.distributed.parallel_state.get_dcp_group``."""
    return _DcpGroup()


class _Impl:
    """The attention backend's impl: ``process_weights_after_loading`` is a no-op but for AMX (CPU)."""

    def __init__(self, layer_name):
        self.layer_name = layer_name

    def process_weights_after_loading(self, act_dtype):
        PACKED.append(self.layer_name)


def batched_gemm_a16wfp4(x, w, w_scales, dtype=torch.bfloat16, y=None, transpose_bm=False, prequant=True, **_):
    """aiter's kernel: x (B, M, K) bf16, w (B, N, K/2) u8, scales (B, N, K/32) u8 -> (B, M, N), or (M, B, N)
    with ``transpose_bm``. aiter does not check K; the stand-in does, so a contract break fails loudly."""
    assert prequant and x.dim() == 3 and w.dtype == torch.uint8 and w_scales.dtype == torch.uint8
    assert x.shape[-1] == 2 * w.shape[-1] == 32 * w_scales.shape[-1], (x.shape, w.shape, w_scales.shape)
    assert w.shape[:2] == w_scales.shape[:2] == (x.shape[0], w.shape[1])
    assert all(s > 0 for s in (*w.stride(), *w_scales.stride()))
    out = bmm_a16wfp4(x.contiguous(), w.contiguous(), w_scales.contiguous()).to(dtype)
    out = out.transpose(0, 1) if transpose_bm else out
    if y is None:
        return out.contiguous()
    y.copy_(out)
    return y


def rocm_aiter_batched_gemm_a16wfp4(X, WQ, w_scale, Y, transpose_bm=False, prequant=True, y_scale=None):
    """``rocm_aiter_ops.batched_gemm_a16wfp4``: vLLM's wrapper, output tensor as 4th positional argument."""
    return batched_gemm_a16wfp4(X, WQ, w_scale, y=Y, transpose_bm=transpose_bm, prequant=prequant)


def quark_quantize_weight_to_mxfp4(w):
    """vLLM's helper: aiter ``dynamic_mxfp4_quant`` (even rule) along the last dim of a bf16 tensor."""
    assert w.dtype == torch.bfloat16
    return quantize(w, mode="even", axis=-1)


def get_and_maybe_dequant_weights(layer, out_dtype=torch.float32):
    """``quant_utils.get_and_maybe_dequant_weights``: an unquantized layer's weight; a block-scaled FP8 one (its
    ``weight_scale_inv`` and ``weight_block_size``) as vLLM's identity-GEMM branch returns it (DeepGEMM and
    Marlin layouts): the quant method applied to an identity matrix, transposed, so a strided ``[out, in]`` view."""
    w = layer.weight
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return w.to(out_dtype)
    eye = torch.eye(w.shape[1], dtype=out_dtype)
    return (eye @ fp8_block_dequant(w, layer.weight_scale_inv, layer.weight_block_size).to(out_dtype).T).T


class MLAAttention:
    def __init__(self, layer_name, geom, kv_b_weight, *, fp4: bool, tp_rank=0, tp_size=1, model=".", fp8=None):
        """``fp8``: (weight_scale_inv of the whole kv_b_weight, block) for an FP8 block-scaled kv_b_proj."""
        heads = geom.num_heads // tp_size
        rows = heads * (geom.qk_nope_head_dim + geom.v_head_dim)
        self.layer_name = layer_name
        self.num_heads = heads
        self.kv_lora_rank = geom.kv_lora_rank
        self.qk_nope_head_dim = geom.qk_nope_head_dim
        self.qk_rope_head_dim = geom.qk_rope_head_dim
        self.v_head_dim = geom.v_head_dim
        self.kv_b_proj = SimpleNamespace(weight=kv_b_weight[tp_rank * rows : (tp_rank + 1) * rows])
        if fp8 is not None:
            scale, block = fp8
            self.kv_b_proj.weight_block_size = block
            self.kv_b_proj.weight_scale_inv = scale[tp_rank * rows // block[0] : (tp_rank + 1) * rows // block[0]]
        self.quant_config = None
        self.is_aiter_triton_fp8_bmm_enabled = False
        self.is_aiter_triton_fp4_bmm_enabled = fp4 and self.kv_b_proj.weight.dtype == torch.bfloat16
        self._vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None))
        self.default_scales_set = False
        self.impl = _Impl(layer_name)
        self.q_pad_num_heads = None
        self.is_amx_bmm_enabled = False
        self.dcp_q_replicate = False
        self.W_UK_T_dcp_qrep = None

    def process_weights_after_loading(self, act_dtype):
        self.impl.process_weights_after_loading(act_dtype)
        REBUILDS.append(self.layer_name)
        if self.is_amx_bmm_enabled:  # AMXMLAImpl packed its own weights from kv_b_proj
            return
        if self.dcp_q_replicate:
            assert self.q_pad_num_heads in (None, self.num_heads)
            if self.is_aiter_triton_fp4_bmm_enabled or self.is_aiter_triton_fp8_bmm_enabled:
                raise NotImplementedError("DCP query replication: not on the aiter FP4/FP8 MLA BMM paths")
        kv_b = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=act_dtype).T
        kv_b = kv_b.view(self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        W_UK, W_UV = kv_b.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if self.is_aiter_triton_fp4_bmm_enabled:
            self.W_K, self.W_K_scale = quark_quantize_weight_to_mxfp4(W_UK)
            self.W_K = self.W_K.transpose(0, 1)
            self.W_K_scale = self.W_K_scale.transpose(0, 1)
            self.W_V, self.W_V_scale = quark_quantize_weight_to_mxfp4(W_UV.permute(1, 2, 0))
        else:
            self.W_UV = W_UV.transpose(0, 1)
            self.W_UK_T = W_UK.permute(1, 2, 0)
            if self.dcp_q_replicate:
                self.W_UK_T_dcp_qrep = get_dcp_group().all_gather(self.W_UK_T.contiguous(), dim=0)
        self.default_scales_set = True  # set_default_quant_scales (no quant config)

    def decode(self, q: torch.Tensor, attn_out: torch.Tensor):
        """The forward's absorbed projections for decode tokens: q ``[T, H, P+R]`` -> ql_nope ``[T, H, L]``;
        attention output ``[T, H, L]`` -> ``[T, H*V]``."""
        mqa_q_nope, _ = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        mqa_q_nope = mqa_q_nope.transpose(0, 1)
        if self.is_aiter_triton_fp4_bmm_enabled:
            ql_nope = batched_gemm_a16wfp4(mqa_q_nope, self.W_K, self.W_K_scale, transpose_bm=True, prequant=True)
        else:
            N, B, P = mqa_q_nope.shape
            ql_nope = mqa_q_nope.new_empty((N, B, self.W_UK_T.shape[2]))
            torch.bmm(mqa_q_nope, self.W_UK_T, out=ql_nope)
            ql_nope = ql_nope.transpose(0, 1)
        out = torch.empty(q.shape[0], self.num_heads * self.v_head_dim, dtype=q.dtype)
        x = attn_out.view(-1, self.num_heads, self.kv_lora_rank).transpose(0, 1)
        o = out.view(-1, self.num_heads, self.v_head_dim)
        if self.is_aiter_triton_fp4_bmm_enabled:
            rocm_aiter_batched_gemm_a16wfp4(x, self.W_V, self.W_V_scale, o, transpose_bm=True, prequant=True)
        else:
            torch.bmm(x, self.W_UV, out=o.transpose(0, 1))
        return ql_nope, out


class DcpManager:
    """vLLM 0.34's ``MLADCPManager`` as far as the weights go: ``v_up_proj_combine`` is set where DCP's decode fuses
    the V-up with its combine (which then reads ``W_UV_dcp``)."""

    def __init__(self, fused_v_up: bool = True):
        self.v_up_proj_combine = (lambda *args, **kwargs: None) if fused_v_up else None


class MLAAttention034(MLAAttention):
    """vLLM 0.34.0's ``MLAAttention`` (``mla_attention.py`` of the 0.34.0 wheel, lines 480-525 and 1428-1562): the
    activation dtype kept on the layer as ``act_dtype``, ``process_weights_after_loading(self)`` called with no
    argument (``model_loader/weight_utils.py``'s ``finalize_model_weights``), and on the torch.bmm path ``W_UV``
    gathered over the DCP group as ``W_UV_dcp`` where ``dcp_manager.v_up_proj_combine`` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.act_dtype = torch.bfloat16
        self.dcp_manager = None
        self.W_UV_dcp = None

    def process_weights_after_loading(self):
        super().process_weights_after_loading(self.act_dtype)
        fused = self.dcp_manager is not None and self.dcp_manager.v_up_proj_combine is not None
        if fused and not self.is_aiter_triton_fp4_bmm_enabled:
            self.W_UV_dcp = get_dcp_group().all_gather(self.W_UV.contiguous(), dim=0)


def set_default_quant_scales(layer, register_buffer=False):
    layer.default_scales_set = True


def should_load_quant_weights(quant_method) -> bool:
    return quant_method is not None
