"""Stand-ins for the parts of vLLM and SGLang the engine adapters touch.

Neither engine can be installed here (both need GPU builds with pinned torch versions and do not
pip-install on this CPU machine), so these modules reproduce, from the engines' sources cited in
``glm_pack.runtime.engines.vllm`` / ``.sglang``, the attention modules' attributes, their load-time rebuild
from kv_b_proj and the forward's K-up / V-up calls. aiter's GEMMs are modelled by
``glm_pack.runtime.reference`` (the even-rule MXFP4 activation quant and fp32 accumulation), aiter's
``dynamic_mxfp4_quant`` by ``glm_pack.packing.mxfp4.quantize(mode="even")``.
"""
