"""SGLang adapter: set DeepseekV2 MLA's ``w_kc`` / ``w_vc`` (+ ``w_scale_k`` / ``w_scale_v``) from a glm-pack
overlay instead of rebuilding them in ``post_load_weights``.

Written against SGLang main: ``python/sglang/srt/models/deepseek_common/deepseek_weight_loader.py`` at
commit 0201c04e983820f371aedd97154d07453badd814 (``DeepseekV2WeightLoaderMixin.post_load_weights``),
``.../attention_forward_methods/forward_mla.py`` (ROCm K-up / V-up calls), ``quark/utils.py``
(``quark_post_load_weights``), ``models/glm4_moe.py`` (``GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM)``),
``models/deepseek_nextn.py`` and ``models/registry.py`` (``SGLANG_EXTERNAL_MODEL_PACKAGE`` is registered with
``overwrite=True``; each module's ``EntryClass`` replaces the built-in class of the same ``__name__``).
Re-read at commit 0340c90c71c1e2d212b1cb1327dea4d757ca2ecf (the newest stored; its weight loader was not
available): the ROCm K-up / V-up moved to ``.../attention_forward_methods/forward_mla_rocm.py``
(``rocm_absorb_q_bmm`` / ``rocm_absorb_v_bmm``) with the same calls and gates on these attributes; DCP query
replication's ``w_kc_qrep`` is made by the model runner from ``w_kc`` after ``post_load_weights`` (bf16/fp16
only), so it follows the overlay's. Checked against the released wheels 0.5.8-0.5.23 (PyPI; the attributes,
layouts, calls and layer selection above are those of 0.5.23): the attention TP rank and size and the server args
come from ``sglang.srt.runtime_context`` from 0.5.15 on (the older functions are gone from 0.5.16, and
``get_global_server_args`` raises from 0.5.20); GLM's MTP draft is its own ``GlmMoeDsaForCausalLMNextN`` from
0.5.16, and the draft classes' ``post_load_weights`` is pinned to ``is_nextn=True``; an FP8 kv_b_proj's block size
comes from its quant method first; ``GlmMoeDsaForCausalLM`` exists from 0.5.9.

SGLang's attributes (per rank, H = local heads, L = kv_lora, P = nope, V = v):

* MXFP4 (taken by the forward when ``_use_aiter_gfx95`` and ``w_kc.dtype == uint8``): ``w_kc`` u8 logical
  ``[H, P/2, L]`` stored ``[H, L, P/2]`` (``.transpose(1, 2).contiguous().transpose(1, 2)``), ``w_scale_k``
  logical ``[H, P/32, L]`` stored ``[H, L, P/32]``, ``w_vc`` logical ``[H, L/2, V]`` stored ``[H, V, L/2]``,
  ``w_scale_v`` logical ``[H, L/32, V]`` stored ``[H, V, L/32]``; the forward calls
  ``batched_gemm_afp4wfp4_pre_quant(q_nope.transpose(0, 1), w_kc.transpose(-2, -1),
  w_scale_k.transpose(-2, -1), bf16, out[H, T, w_kc.shape[2]])`` and the same for V-up.
  On main only DeepseekV3 Quark checkpoints take this path at load; for GLM's BF16 kv_b_proj the engine
  requantizes to per-tensor FP8. The overlay's ``bmm_nk`` tensors are exactly the stored layouts above.
* BF16: ``w_kc`` logical ``[H, P, L]`` stored ``[H, L, P]``, ``w_vc`` logical ``[H, L, V]`` stored
  ``[H, V, L]``, in the loaded kv_b_proj's float dtype (bf16 for a quantized one), ``w_scale = 1.0`` (ROCm
  multiplies by it), used by ``torch.bmm``.

K padding: SGLang passes only q_nope to the K-up GEMM, so a K-padded w_kc is refused (``--k-pad none``).

Hook: ``SGLANG_EXTERNAL_MODEL_PACKAGE=glm_pack.runtime.engines`` makes SGLang import this module and read
``EntryClass`` (built lazily, so importing glm_pack never imports SGLang): subclasses of
``GlmMoeDsaForCausalLM`` and ``DeepseekV3ForCausalLMNextN`` whose ``post_load_weights`` set overlay layers
when ``GLM_PACK_OVERLAY`` is set and hand every other layer to SGLang's own rebuild.
"""

from __future__ import annotations

import functools
import logging

import torch

from glm_pack.packing import fp8
from glm_pack.packing.mla import MlaGeometry
from glm_pack.runtime.layer import MlaLayer

from . import common

log = logging.getLogger("glm_pack.sglang")
ENGINE = "SGLang"
FP4_NEEDS = "on ROCm gfx950 with aiter (its only MXFP4 BMM path)"  # what SGLang lacks without its MXFP4 BMM path


def engine_geometry(self_attn) -> MlaGeometry:
    return MlaGeometry(
        self_attn.num_local_heads,
        self_attn.kv_lora_rank,
        self_attn.qk_nope_head_dim,
        self_attn.qk_rope_head_dim,
        self_attn.v_head_dim,
    )


def absorbed_attributes(
    mla: MlaLayer,
    *,
    fp4_path: bool,
    needs: str = FP4_NEEDS,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """The attributes SGLang's forward reads, built from one overlay layer (see the module docstring); float
    ones in ``dtype``, the dtype SGLang's rebuild keeps (its loaded kv_b_proj's). ``needs``: what SGLang lacks when
    ``fp4_path`` is False, for the refusal of an MXFP4 layer."""
    kc, vc = mla.w_kc, mla.w_vc
    if kc.precision == "mxfp4" and vc.precision == "mxfp4":
        common.check_mxfp4_path(mla, ENGINE, fp4_path, needs)
        return {
            "w_kc": kc.weight.transpose(1, 2),
            "w_scale_k": kc.scale.transpose(1, 2),
            "w_vc": vc.weight.transpose(1, 2),
            "w_scale_v": vc.scale.transpose(1, 2),
        }
    return {
        "w_kc": common.as_float(kc, dtype).transpose(1, 2),
        "w_vc": common.as_float(vc, dtype).transpose(1, 2),
        "w_scale": 1.0,
    }


def fp8_block(linear, quant_config) -> tuple[int, int] | None:
    """The FP8 block size ``post_load_weights`` reads (``_resolve_layer_weight_block_size``): the linear's quant
    method's ``weight_block_size`` where it has one, else ``linear_fp8_config``'s (the model's quant config's where
    that is None); None (per-channel FP8) without one."""
    method = getattr(linear, "quant_method", None)
    if method is not None and hasattr(method, "weight_block_size"):
        block = method.weight_block_size
    else:
        config = getattr(quant_config, "linear_fp8_config", None)
        block = getattr(quant_config if config is None else config, "weight_block_size", None)
    return tuple(block) if block else None


def loaded_kv_b(linear, quant_config) -> torch.Tensor | None:
    """kv_b_proj as float ``[out, in]`` as ``post_load_weights`` reads it (before the linear's quant method
    processes it): a float weight as is; FP8 with ``weight_scale`` (else ``weight_scale_inv``) per block of
    :func:`fp8_block` (UE8M0 exponents in uint8, as a reload after SGLang's requantization leaves them, decoded as
    SGLang does), or per output channel without one; None for any other form (e.g. DeepGEMM's UE8M0 layout, or
    AWQ's ``qweight`` without a ``weight``)."""
    weight = getattr(linear, "weight", None)
    if weight is None:
        return None
    if weight.dtype in common.FLOAT:
        return weight
    scale = getattr(linear, "weight_scale", None)
    if scale is None:
        scale = getattr(linear, "weight_scale_inv", None)
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) or scale is None:
        return None
    if getattr(scale, "format_ue8m0", False):
        if scale.dtype != torch.uint8:
            return None
        scale = (scale.to(torch.int32) << 23).view(torch.float32)  # 2**(e - 127), as SGLang reads them
    block = fp8_block(linear, quant_config)
    return fp8.dequantize_block(weight, scale, block) if block else fp8.dequantize_channel(weight, scale)


def apply(self_attn, layer_id: int, overlay: common.Overlay, *, fp4_path: bool, quant_config=None) -> bool:
    """Set one attention module's absorbed weights; False when the overlay lacks the layer. ``quant_config``:
    the model's, which gives an FP8 kv_b_proj's block size."""
    weight = getattr(self_attn.kv_b_proj, "weight", None)  # AWQ keeps a qweight instead
    loaded = None if weight is None else weight.dtype
    dtype = loaded if loaded in common.FLOAT else torch.bfloat16  # a quantized kv_b_proj: SGLang's bf16 rebuild
    if getattr(self_attn, "rocm_fused_decode_mla", False):  # SGLANG_ROCM_FUSED_DECODE_MLA: K-up as bf16 torch.bmm
        fp4_path, needs = False, "on its MXFP4 BMM path with SGLANG_ROCM_FUSED_DECODE_MLA set (unset it)"
    else:
        needs = FP4_NEEDS
    build = functools.partial(absorbed_attributes, fp4_path=fp4_path, needs=needs, dtype=dtype)
    kv_b = functools.partial(loaded_kv_b, self_attn.kv_b_proj, quant_config)
    geometry = engine_geometry(self_attn)
    return overlay.apply(self_attn, layer_id, geometry, build, kv_b, engine_quantized=loaded not in common.FLOAT)


def apply_model(model, overlay: common.Overlay, is_nextn: bool, weight_names, *, fp4_path: bool):
    """Apply the overlay to the layers SGLang's ``post_load_weights`` would rebuild (same layer selection);
    returns the arguments for SGLang's own rebuild of what is left, or None when nothing is left."""
    quant_config = getattr(model, "quant_config", None)
    put = functools.partial(apply, overlay=overlay, fp4_path=fp4_path, quant_config=quant_config)
    if is_nextn:
        return None if put(model.model.decoder.self_attn, model.config.num_hidden_layers) else {}
    if weight_names is None:
        layer_ids = range(model.model.start_layer, model.model.end_layer)
    else:
        layer_ids = sorted(
            {int(n.split(".")[2]) for n in weight_names if "kv_b_proj" in n}
            & set(range(model.model.start_layer, model.model.end_layer))
        )
    left = []
    for layer_id in layer_ids:
        self_attn = model.model.layers[layer_id].self_attn
        if not hasattr(self_attn, "kv_b_proj") or not put(self_attn, layer_id):
            left.append(f"model.layers.{layer_id}.self_attn.kv_b_proj.weight")
    return {"weight_names": left} if left else None


def serving_context() -> tuple:
    """(server args, attention TP rank, attention TP size) of this SGLang process: from ``sglang.srt.runtime_context``
    (``get_server_args()``, ``get_parallel().attn_tp_rank`` / ``attn_tp_size``; releases from 0.5.15 on: the older
    functions below are gone from 0.5.16, and ``get_global_server_args`` raises from 0.5.20), else from
    ``get_global_server_args()`` and ``dp_attention.get_attention_tp_rank()`` / ``get_attention_tp_size()`` (SGLang
    main at 0201c04e, releases before 0.5.15)."""
    try:
        from sglang.srt.runtime_context import get_parallel, get_server_args
    except ImportError:
        from sglang.srt.layers.dp_attention import get_attention_tp_rank, get_attention_tp_size
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args(), get_attention_tp_rank(), get_attention_tp_size()
    parallel = get_parallel()
    return get_server_args(), parallel.attn_tp_rank, parallel.attn_tp_size


def _overlay(model) -> common.Overlay | None:
    setting = common.overlay_setting()
    if setting is None:
        return None
    args, tp_rank, tp_size = serving_context()
    served = common.checkpoint_dir(args.model_path, getattr(args, "revision", None))
    return common.open_overlay(
        setting,
        served,
        tp_rank=tp_rank,
        tp_size=tp_size,
        device=next(model.parameters()).device,
        level=common.check_level(),
    )


def _with_overlay(base: type, *, nextn: bool = False) -> type:
    """A subclass of SGLang's model class ``base`` (same ``__name__``) that loads MLA weights from the overlay;
    ``nextn``: an MTP draft class, whose ``post_load_weights`` SGLang pins to ``is_nextn=True`` (its loaders may call
    it with no argument)."""

    def post_load_weights(self, is_nextn=False, weight_names=None):
        is_nextn = is_nextn or nextn
        overlay = _overlay(self)
        if overlay is None:
            return base.post_load_weights(self, is_nextn=is_nextn, weight_names=weight_names)
        from sglang.srt.models.deepseek_common.utils import _use_aiter_gfx95

        rest = apply_model(self, overlay, is_nextn, weight_names, fp4_path=bool(_use_aiter_gfx95))
        if rest is not None:
            return base.post_load_weights(self, is_nextn=is_nextn, **rest)
        return None

    return type(base.__name__, (base,), {"post_load_weights": post_load_weights, "__module__": __name__})


@functools.cache
def _entry_classes() -> list[type]:
    """GLM-5's model class and the MTP draft classes SGLang builds for it: ``GlmMoeDsaForCausalLMNextN`` (SGLang's
    GLM draft from 0.5.16 on; it subclasses the original ``DeepseekV3ForCausalLMNextN``, so replacing only that one
    left GLM's MTP layer to SGLang's rebuild) where SGLang has it, and ``DeepseekV3ForCausalLMNextN``."""
    from sglang.srt.models import glm4_moe
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN

    classes = [_with_overlay(glm4_moe.GlmMoeDsaForCausalLM), _with_overlay(DeepseekV3ForCausalLMNextN, nextn=True)]
    glm_draft = getattr(glm4_moe, "GlmMoeDsaForCausalLMNextN", None)
    return classes + ([_with_overlay(glm_draft, nextn=True)] if glm_draft is not None else [])


def __getattr__(name: str):
    if name == "EntryClass":  # read by SGLang's registry (hasattr/getattr), built only then
        return _entry_classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
