"""vLLM adapter: set ``MLAAttention``'s absorbed weights from a glm-pack overlay instead of rebuilding them.

Written against the vLLM 0.33.0 release (the wheel's ``vllm/model_executor/layers/attention/mla_attention.py``;
first against main at commit 0014ca6b9929614f1b72c4bb11e5238de49cba89), with
``vllm/model_executor/model_loader/utils.py``, which calls ``module.process_weights_after_loading(model_config.dtype)``
on every ``MLAAttention`` after the quant methods, ``vllm/plugins/__init__.py``: ``vllm.general_plugins`` entry
points run in every process, and ``vllm/model_executor/layers/quantization/utils/quant_utils.py``:
``get_and_maybe_dequant_weights``. The releases' wheels from 0.16 on build these weights on the layer as below
(0.16-0.17 without keeping the model config on it: then vLLM's current config, which its GPU worker sets while loading);
0.29+ first let the attention backend's impl pack its own (a no-op but for the CPU AMX backend, whose layers are left
to vLLM), 0.27+ gather ``W_UK_T_dcp_qrep`` for decode context parallelism's query replication (torch.bmm path only).
Re-read in the vLLM 0.34.0 wheel: ``process_weights_after_loading(self)`` takes no dtype (the loader's
``finalize_model_weights`` calls it bare; the dtype is ``self.act_dtype``), on the torch.bmm path it gathers ``W_UV``
over the DCP group as ``W_UV_dcp`` where ``dcp_manager.v_up_proj_combine`` is set (DCP's fused V-up), and it copies
its tensors into existing ones on a reload (``replace_parameter``, as from 0.26), so captured CUDA graphs stay valid;
the adapter does all three. GLM-5 is served by ``vllm/models/deepseek_v32`` (``DeepseekV32MLAAttention`` on ROCm),
whose decode reads the same attributes (``W_K``, ``W_K_scale`` with ``transpose_bm=True``, ``W_UK_T``, ``W_UV``).

vLLM's own rebuild (``MLAAttention.process_weights_after_loading``): dequantize kv_b_proj to
``[L, H*(P+V)]``, view ``[L, H, P+V]``, split into ``W_UK [L, H, P]`` / ``W_UV [L, H, V]``, then

* gfx950 FP4 path (``is_aiter_triton_fp4_bmm_enabled``: aiter FP4 BMM on and a BF16 kv_b_proj):
  ``W_K`` u8 ``[H, L, P/2]`` + ``W_K_scale`` u8 ``[H, L, P/32]``, ``W_V`` u8 ``[H, V, L/2]`` +
  ``W_V_scale`` u8 ``[H, V, L/32]`` (aiter even-rule ``dynamic_mxfp4_quant``); the forward calls
  ``batched_gemm_a16wfp4(q_nope [H, T, P], W_K, W_K_scale, transpose_bm=True, prequant=True)`` and
  ``batched_gemm_a16wfp4(x [H, T, L], W_V, W_V_scale, out, transpose_bm=True, prequant=True)``;
* otherwise ``W_UK_T = W_UK.permute(1, 2, 0)`` ``[H, P, L]`` and ``W_UV = W_UV.transpose(0, 1)``
  ``[H, L, V]`` in the model dtype, used by ``torch.bmm``; both views of kv_b_proj, so L is the fastest dim
  of each (the adapter's copies keep that order);

then, when the layer loads no quant scales, ``set_default_quant_scales(self, register_buffer=False)``.

The adapter replaces that method (only while ``GLM_PACK_OVERLAY`` is set): overlay layers get their
tensors from the overlay, others fall back to vLLM's rebuild. K padding: vLLM hands the K-up GEMM the
``P``-wide q_nope only, so a K-padded w_kc is refused (convert with ``--k-pad none``). An MXFP4 overlay
needs vLLM's FP4 path (else refused); a BF16-policy overlay (or one BF16 projection) takes the torch.bmm
path with both aiter BMM flags turned off for that layer.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re

import torch

from glm_pack.packing.errors import BackendError, GlmPackError
from glm_pack.packing.mla import MlaGeometry
from glm_pack.runtime.layer import MlaLayer

from . import common

log = logging.getLogger("glm_pack.vllm")
ENGINE = "vLLM"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ORIGINAL = "_glm_pack_original_process_weights_after_loading"


def layer_index(layer_name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7."""
    match = _LAYER.search(layer_name + ".")
    if match is None:
        raise GlmPackError(f"cannot tell the decoder layer of vLLM attention module {layer_name!r}")
    return int(match.group(1))


def engine_geometry(layer) -> MlaGeometry:
    return MlaGeometry(
        layer.num_heads, layer.kv_lora_rank, layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.v_head_dim
    )


def absorbed_attributes(mla: MlaLayer, *, fp4_path: bool, act_dtype: torch.dtype) -> dict:
    """The attributes vLLM's forward reads, built from one overlay layer (see the module docstring)."""
    kc, vc = mla.w_kc, mla.w_vc
    if kc.precision == "mxfp4" and vc.precision == "mxfp4":
        needs = (
            "on its gfx950 FP4 BMM path (needs ROCm gfx950, VLLM_ROCM_USE_AITER=1, VLLM_ROCM_USE_AITER_FP4BMM=1 and "
            "a BF16 kv_b_proj)"
        )
        common.check_mxfp4_path(mla, ENGINE, fp4_path, needs, transpose_bm=True)  # vLLM writes [T, H, N]
        return {
            "W_K": kc.weight,
            "W_K_scale": kc.scale,
            "W_V": vc.weight,
            "W_V_scale": vc.scale,
            "is_aiter_triton_fp4_bmm_enabled": True,
        }
    return {
        # L fastest in both, as in vLLM's rebuild (a view of kv_b_proj [H*(P+V), L]): torch.bmm then sees the
        # operand layouts vLLM's own weights give it
        "W_UK_T": common.as_float(kc, act_dtype).transpose(1, 2).contiguous(),  # [H, L, P] -> [H, P, L]
        "W_UV": common.as_float(vc, act_dtype).transpose(1, 2),  # [H, V, L] -> [H, L, V]
        "is_aiter_triton_fp4_bmm_enabled": False,
        "is_aiter_triton_fp8_bmm_enabled": False,
    }


def stored_kv_b(kv_b_proj) -> torch.Tensor:
    """kv_b_proj's stored weight tensor: ``weight``, else a packed ``qweight`` (AWQ, GPTQ) or ``weight_packed``
    (compressed tensors), the names vLLM's ``get_and_maybe_dequant_weights`` looks for, in its order."""
    for name in ("weight", "qweight", "weight_packed"):
        tensor = getattr(kv_b_proj, name, None)
        if tensor is not None:
            return tensor
    raise BackendError(f"kv_b_proj holds none of weight, qweight, weight_packed: {type(kv_b_proj).__name__}")


def loaded_kv_b(layer) -> torch.Tensor | None:
    """The layer's kv_b_proj as float ``[out, in]``, as vLLM's own rebuild gets it: a float weight as is, a
    quantized ``weight`` through vLLM's ``get_and_maybe_dequant_weights``, which knows the layout each quant method
    left (FP8 block scales as stored, or DeepGEMM's requantized ones through an identity GEMM); None for a packed
    ``qweight`` / ``weight_packed`` (the slice check is then skipped with a warning)."""
    weight = getattr(layer.kv_b_proj, "weight", None)
    if weight is None:
        return None
    if weight.dtype in common.FLOAT:
        return weight
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

    return get_and_maybe_dequant_weights(layer.kv_b_proj, out_dtype=torch.float32)


def apply(layer, overlay: common.Overlay, act_dtype: torch.dtype) -> bool:
    """Set one ``MLAAttention``'s absorbed weights from ``overlay``; False when the overlay lacks the layer.
    BackendError on a vLLM that keeps them in ``kv_b_proj.mla_bmm`` objects instead (the layout of vLLM pull
    request 55741, open when this was written), whose forward would never read the attributes set here."""
    if hasattr(layer.kv_b_proj, "mla_bmm"):
        raise BackendError(
            f"{layer.layer_name}: this vLLM keeps its absorbed MLA weights in kv_b_proj.mla_bmm, a layout glm-pack's "
            f"adapter does not fill; unset {common.ENV} to let vLLM rebuild them"
        )
    fp4_path = bool(layer.is_aiter_triton_fp4_bmm_enabled)
    build = functools.partial(absorbed_attributes, fp4_path=fp4_path, act_dtype=act_dtype)
    kv_b = functools.partial(loaded_kv_b, layer)
    quantized = stored_kv_b(layer.kv_b_proj).dtype not in common.FLOAT  # e.g. vLLM's online FP8 of a BF16 one
    geometry = engine_geometry(layer)
    return overlay.apply(layer, layer_index(layer.layer_name), geometry, build, kv_b, engine_quantized=quantized)


def model_config_of(layer):
    """The served model's config: captured by ``MLAAttention.__init__`` (vLLM 0.18+), else vLLM's current config,
    which the GPU worker sets around loading the model (0.16-0.17)."""
    captured = getattr(layer, "_vllm_config", None)
    if captured is not None:
        return captured.model_config
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().model_config


def _overlay_for(layer) -> common.Overlay | None:
    setting = common.overlay_setting()
    if setting is None:
        return None
    if not hasattr(layer, "kv_b_proj"):  # vLLM's attention backend holds it and builds the weights there
        raise BackendError(
            f"{layer.layer_name}: this vLLM's MLAAttention holds no kv_b_proj (vLLM before 0.16); use vLLM 0.16 or "
            f"later, or unset {common.ENV} to let vLLM rebuild the weights"
        )
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    model_config = model_config_of(layer)
    served = common.checkpoint_dir(model_config.model, getattr(model_config, "revision", None))
    return common.open_overlay(
        setting,
        served,
        tp_rank=get_tensor_model_parallel_rank(),
        tp_size=get_tensor_model_parallel_world_size(),
        device=stored_kv_b(layer.kv_b_proj).device,
        level=common.check_level(),
    )


def _replicate_for_dcp(layer) -> None:
    """Decode context parallelism's query replication (vLLM 0.27+, ``dcp_q_replicate``): the decode K-up reads
    ``W_UK_T_dcp_qrep``, W_UK_T gathered over the DCP group, which vLLM builds only on its torch.bmm path."""
    if layer.is_aiter_triton_fp4_bmm_enabled:
        raise BackendError(
            f"{layer.layer_name}: vLLM does not implement DCP query replication on its aiter FP4 BMM path, which an "
            "MXFP4 overlay needs; turn DCP query replication off, or convert with --mla-precision bf16"
        )
    if layer.q_pad_num_heads not in (None, layer.num_heads):
        raise BackendError(f"{layer.layer_name}: vLLM does not support DCP query replication with head padding")
    from vllm.distributed.parallel_state import get_dcp_group

    common.assign(layer, "W_UK_T_dcp_qrep", get_dcp_group().all_gather(layer.W_UK_T.contiguous(), dim=0))


def _gather_w_uv_for_dcp(layer) -> None:
    """Decode context parallelism's fused V-up (vLLM 0.34+, ``dcp_manager.v_up_proj_combine``) reads ``W_UV_dcp``,
    W_UV gathered over the DCP group, which vLLM builds only on its torch.bmm path (elsewhere it stays None and vLLM
    takes its unfused V-up)."""
    manager = getattr(layer, "dcp_manager", None)
    if manager is None or getattr(manager, "v_up_proj_combine", None) is None or layer.is_aiter_triton_fp4_bmm_enabled:
        return
    from vllm.distributed.parallel_state import get_dcp_group

    common.assign(layer, "W_UV_dcp", get_dcp_group().all_gather(layer.W_UV.contiguous(), dim=0))


def _run_original(self, act_dtype: torch.dtype | None) -> None:
    """vLLM's own ``process_weights_after_loading``, called as this vLLM defines it: with the activation dtype
    (up to 0.33) or without (0.34+, which keeps it as ``self.act_dtype``)."""
    original = getattr(type(self), _ORIGINAL)
    return original(self, act_dtype) if _takes_dtype(original) else original(self)


@functools.cache
def _takes_dtype(method) -> bool:
    return len(inspect.signature(method).parameters) > 1


def _process_weights_after_loading(self, act_dtype: torch.dtype | None = None):
    """The replacement: vLLM up to 0.33 passes the activation dtype, 0.34+ passes none and keeps it on the layer."""
    overlay = _overlay_for(self)
    if overlay is not None and getattr(self, "is_amx_bmm_enabled", False):
        log.warning("glm-pack: %s: vLLM's AMX (CPU) MLA packs its own weights from kv_b_proj; the overlay is not used",
                    self.layer_name)  # fmt: skip
        overlay = None
    if overlay is None or not overlay.holds(layer_index(self.layer_name)):
        return _run_original(self, act_dtype)
    act_dtype = self.act_dtype if act_dtype is None else act_dtype
    impl = getattr(self, "impl", None)
    if hasattr(impl, "process_weights_after_loading"):  # vLLM 0.29+: the backend's own packing comes first
        impl.process_weights_after_loading(act_dtype)
    apply(self, overlay, act_dtype)
    if getattr(self, "dcp_q_replicate", False):
        _replicate_for_dcp(self)
    _gather_w_uv_for_dcp(self)
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales, should_load_quant_weights

    quant_method = self.quant_config.get_quant_method(self, prefix=self.layer_name) if self.quant_config else None
    if not should_load_quant_weights(quant_method):
        set_default_quant_scales(self, register_buffer=False)
    return None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: when ``GLM_PACK_OVERLAY`` is set, route
    ``MLAAttention.process_weights_after_loading`` through the overlay (idempotent; vLLM may call it often)."""
    if common.overlay_setting() is None:
        return
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError as err:  # vLLM before 0.16 keeps MLAAttention elsewhere, its weights in the backend
        raise BackendError(
            f"glm-pack's vLLM adapter needs vLLM 0.16 or later ({err}); unset {common.ENV} to let vLLM rebuild the "
            "MLA weights"
        ) from err

    if not hasattr(MLAAttention, _ORIGINAL):
        setattr(MLAAttention, _ORIGINAL, MLAAttention.process_weights_after_loading)
        MLAAttention.process_weights_after_loading = _process_weights_after_loading
        log.info("glm-pack: MLA weights come from the overlay (%s=%s)", common.ENV, common.overlay_setting())
