"""Stand-in for SGLang's DeepseekV2 MLA (main at 0201c04e; the same in the 0.5.23 wheel): ``DeepseekV2AttentionMLA``'s
absorbed-weight attributes, ``DeepseekV2WeightLoaderMixin.post_load_weights`` (BF16 kv_b_proj; the MXFP4 branch as
in ``quark_post_load_weights``), the MTP draft's (``DeepseekV3ForCausalLMNextN``, which 0.5.12+ pins to
``is_nextn=True``) and the ROCm forward's K-up / V-up calls (``forward_mla.py``, ``forward_mla_rocm.py``).
``rebuild(fp4=True)`` is the MXFP4 branch SGLang takes for DeepseekV3 Quark checkpoints; for GLM's BF16 kv_b_proj
SGLang 0.5.23 requantizes to per-tensor FP8 on gfx950 instead, so there it is the reference for the bytes and calls
of SGLang's MXFP4 path, not a rebuild GLM gets. The model's layer selection leaves out the ``start_layer <= id <
end_layer`` filter SGLang applies to ``weight_names``; the adapter applies it itself."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from glm_pack.packing.mxfp4 import quantize
from glm_pack.runtime.reference import bmm_a16wfp4


def batched_gemm_afp4wfp4_pre_quant(x, w, w_scales, dtype, y):
    """aiter (old API): x (B, M, K) bf16, w (B, N, K/2) u8, scales (B, N, K/32) u8, y (B, M, N) required."""
    assert x.shape[-1] == 2 * w.shape[-1] == 32 * w_scales.shape[-1], (x.shape, w.shape, w_scales.shape)
    assert w.dtype == w_scales.dtype == torch.uint8 and w.shape[:2] == w_scales.shape[:2]
    y.copy_(bmm_a16wfp4(x.contiguous(), w.contiguous(), w_scales.contiguous()).to(dtype))


def b_dynamic_mxfp4_quant(x):
    return quantize(x, mode="even", axis=-1)


class SelfAttn:
    def __init__(self, geom, kv_b_weight, *, tp_rank=0, tp_size=1):
        self.num_local_heads = geom.num_heads // tp_size
        rows = self.num_local_heads * (geom.qk_nope_head_dim + geom.v_head_dim)
        self.kv_lora_rank = geom.kv_lora_rank
        self.qk_nope_head_dim = geom.qk_nope_head_dim
        self.qk_rope_head_dim = geom.qk_rope_head_dim
        self.v_head_dim = geom.v_head_dim
        self.kv_b_proj = SimpleNamespace(weight=kv_b_weight[tp_rank * rows : (tp_rank + 1) * rows])
        self.w_kc = self.w_vc = None
        self.w_scale = 1.0
        self.w_scale_k = self.w_scale_v = None

    def rebuild(self, fp4: bool):
        """The engine's post_load_weights body for one layer."""
        w = self.kv_b_proj.weight
        w_kc, w_vc = w.unflatten(0, (-1, self.qk_nope_head_dim + self.v_head_dim)).split(
            [self.qk_nope_head_dim, self.v_head_dim], dim=1
        )
        if fp4:  # quark_post_load_weights(self_attn, w, "mxfp4"), bf16 branch
            w_kc, w_s_kc = b_dynamic_mxfp4_quant(w_kc.transpose(-2, -1))
            w_kc = w_kc.transpose(-2, -1)
            w_s_kc = w_s_kc.transpose(-2, -1)
            w_vc, w_s_vc = b_dynamic_mxfp4_quant(w_vc)
            self.w_scale_k = w_s_kc.transpose(1, 2).contiguous().transpose(1, 2)
            self.w_scale_v = w_s_vc.contiguous().transpose(1, 2)
        self.w_kc = w_kc.transpose(1, 2).contiguous().transpose(1, 2)
        self.w_vc = w_vc.contiguous().transpose(1, 2)

    def decode(self, q: torch.Tensor, attn_output: torch.Tensor, *, gfx95: bool):
        """q ``[T, H, P+R]`` -> q_nope_out ``[H, T, L]``; attention output ``[T, H, L]`` -> ``[T, H*V]``."""
        q_nope, _ = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if gfx95 and self.w_kc.dtype == torch.uint8:
            x = q_nope.transpose(0, 1)
            q_nope_out = torch.empty(x.shape[0], x.shape[1], self.w_kc.shape[2], dtype=torch.bfloat16)
            batched_gemm_afp4wfp4_pre_quant(
                x, self.w_kc.transpose(-2, -1), self.w_scale_k.transpose(-2, -1), torch.bfloat16, q_nope_out
            )
            x = attn_output.transpose(0, 1)
            buf = torch.empty(x.shape[1], x.shape[0], self.w_vc.shape[2], dtype=torch.bfloat16)
            out = buf.transpose(0, 1)
            batched_gemm_afp4wfp4_pre_quant(
                x, self.w_vc.transpose(-2, -1), self.w_scale_v.transpose(-2, -1), torch.bfloat16, out
            )
        else:
            q_nope_out = torch.bmm(
                q_nope.to(torch.bfloat16).transpose(0, 1), self.w_kc.to(torch.bfloat16) * self.w_scale
            )
            out = torch.bmm(attn_output.to(torch.bfloat16).transpose(0, 1), self.w_vc.to(torch.bfloat16) * self.w_scale)
        return q_nope_out, out.transpose(0, 1).flatten(1, 2)


class Model:
    """``DeepseekV2ForCausalLM`` as post_load_weights sees it, with ``DeepseekV2WeightLoaderMixin``'s layer
    selection; the rebuild records which layers it processed."""

    def __init__(self, geom, weights: dict, *, layers, tp_rank=0, tp_size=1, fp4=True, nextn_layer=None):
        self.config = SimpleNamespace(num_hidden_layers=len(layers))
        attn = {
            i: SelfAttn(geom, weights[f"model.layers.{i}.self_attn.kv_b_proj.weight"], tp_rank=tp_rank, tp_size=tp_size)
            for i in layers
        }
        self.model = SimpleNamespace(
            start_layer=0,
            end_layer=len(layers),
            layers={i: SimpleNamespace(self_attn=a) for i, a in attn.items()},
            decoder=SimpleNamespace(self_attn=attn.get(nextn_layer)),
        )
        self.fp4 = fp4
        self.rebuilt = []

    def parameters(self):
        return iter([self.model.layers[0].self_attn.kv_b_proj.weight])

    def post_load_weights(self, is_nextn=False, weight_names=None):
        if is_nextn:
            layer_ids = [self.config.num_hidden_layers]
        elif weight_names is None:
            layer_ids = range(self.model.start_layer, self.model.end_layer)
        else:
            layer_ids = {int(n.split(".")[2]) for n in weight_names if "kv_b_proj" in n}
        for layer_id in layer_ids:
            attn = self.model.decoder.self_attn if is_nextn else self.model.layers[layer_id].self_attn
            attn.rebuild(self.fp4)
            self.rebuilt.append(layer_id)


class NextNModel(Model):
    """``DeepseekV3ForCausalLMNextN`` (0.5.12+): ``post_load_weights`` pinned to ``is_nextn=True``, which SGLang's
    dummy, sharded-state and remote loaders call with no argument."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model = SimpleNamespace(decoder=self.model.decoder)  # DeepseekModelNextN: one decoder layer, no list

    def parameters(self):
        return iter([self.model.decoder.self_attn.kv_b_proj.weight])

    def post_load_weights(self, is_nextn=True, weight_names=None):
        super().post_load_weights(is_nextn=True, weight_names=weight_names)
