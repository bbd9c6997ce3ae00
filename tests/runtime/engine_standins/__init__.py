"""Stand-ins for the parts of vLLM and SGLang the engine adapters touch.

Neither engine can be installed here (both need GPU builds with pinned torch versions and do not
pip-install on this CPU machine), so these modules reproduce, from the engines' sources cited in
``glm_pack.runtime.engines.vllm`` / ``.sglang``, the attention modules' attributes, their load-time rebuild
from kv_b_proj and the forward's K-up / V-up calls. aiter's GEMMs are modelled by
``glm_pack.runtime.reference`` (the even-rule MXFP4 activation quant and fp32 accumulation), aiter's
``dynamic_mxfp4_quant`` by ``glm_pack.packing.mxfp4.quantize(mode="even")``.

The adapters also run aiter's GEMM themselves once (``common.check_engine_kup``, through
``aiter_backend.load_aiter``): :func:`aiter_functions` wraps an engine stand-in's kernel for that, and
:func:`ragged_k_bug` makes a kernel reproduce aiter's ragged-K fault.
"""

from glm_pack.runtime.backends.aiter_backend import AiterFunctions


def aiter_functions(bmm, kind: str) -> AiterFunctions:
    """What ``load_aiter`` returns for an aiter whose batched GEMM is ``bmm`` (``kind``: "a16wfp4" or
    "pre_quant")."""
    return AiterFunctions(bmm, kind, None, False, False)


def ragged_k_bug(bmm):
    """``bmm`` as aiter versions with the ragged-K bug compute it under their default config (``config=None``,
    256-deep K blocks): where K is not a multiple of 256, the activation is masked with the packed K, so its
    second half is dropped (``notes/aiter-contract.md``)."""

    def buggy(x, w, w_scales, *args, **kwargs):
        if kwargs.get("config", args[2] if len(args) > 2 else None) is None and x.shape[-1] % 256:
            x = x.clone()
            x[..., w.shape[-1] :] = 0
        return bmm(x, w, w_scales, *args, **kwargs)

    return buggy


def transposed_store_bug(bmm):
    """``bmm`` as an aiter that stores a ``transpose_bm=True`` output (``[M, B, N]``) through the strides of the
    plain ``[B, M, N]`` layout, as its split-K reduce can (``notes/aiter-contract.md``): right for ``[H, T, N]``
    outputs, scrambled for ``[T, H, N]`` ones."""

    def buggy(x, w, w_scales, *args, y=None, transpose_bm=False, **kwargs):
        if not transpose_bm:
            return bmm(x, w, w_scales, *args, y=y, **kwargs)
        plain = bmm(x, w, w_scales, *args, **kwargs)  # [B, M, N]
        y = plain.new_empty(plain.shape[1], plain.shape[0], plain.shape[2]) if y is None else y
        return y.copy_(plain.contiguous().view(y.shape))

    return buggy
