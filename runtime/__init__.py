"""glm_pack.runtime: load a packed checkpoint and run absorbed MLA (aiter on gfx950, Triton, torch reference).

The inputs and their shapes and dtypes: README.md, Runtime (an example that runs on CPU with ``device="cpu"``).

>>> model = glm_pack.runtime.open("out/", device="cuda", tp_rank=0, tp_size=8)
>>> layer = model.mla(7)
>>> latent = layer.k_up(q)              # [T, H, nope(+rope)] -> [T, H, kv_lora]
>>> o = layer.attend(latent, kv_cache, kv_indptr, kv_indices, softmax_scale, q_rope=q[..., nope:])
>>> y = layer.v_up(o)                   # [T, H, kv_lora] -> [T, H, v]
"""

from .layer import MlaLayer
from .loader import PackedModel, open_packed

open = open_packed  # noqa: A001 - the public name is glm_pack.runtime.open

__all__ = ["MlaLayer", "PackedModel", "open"]
