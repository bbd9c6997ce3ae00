"""Host (CPU) cost of the runtime layer's own Python per eager call: microseconds per ``k_up``, ``v_up`` (with
``out``) and ``attend`` of one GLM-5 layer (16 heads, T = 4) whose backend does nothing, so only the layer's
argument checks, views and device guard are timed (best of 5 runs of ``--calls`` calls). Runs on the CPU; to
compare two versions of ``glm_pack``, run it with each on ``PYTHONPATH``.

    python benchmarks/host_layer.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import timeit

import torch

from glm_pack.packing.mla import MlaGeometry
from glm_pack.runtime.backends.base import Backend
from glm_pack.runtime.layer import MlaLayer, ProjectionWeights


class NoOp(Backend):
    name = "no-op"

    def bmm_a16wfp4(self, x, w_codes, w_scales, out, *, op, act_quant):
        pass

    def sparse_mla(self, q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, *, return_lse):
        return q_latent, None


def layer() -> MlaLayer:
    """GLM-5's per-rank geometry at TP 4 (16 heads), K-up stored K 256, MXFP4 weights of zeros."""
    geom = MlaGeometry(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)

    def weights(n: int, k: int) -> ProjectionWeights:
        codes, scales = torch.zeros(16, n, k // 2, dtype=torch.uint8), torch.zeros(16, n, k // 32, dtype=torch.uint8)
        return ProjectionWeights("mxfp4", codes, scales, k, k, 0.0)

    return MlaLayer(0, geom, weights(512, 256), weights(256, 512), NoOp())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    calls = parser.parse_args().calls
    mla, bf16 = layer(), torch.bfloat16
    q, latent, y = (
        torch.zeros(4, 16, 256, dtype=bf16),
        torch.zeros(4, 16, 512, dtype=bf16),
        torch.empty(4, 16, 256, dtype=bf16),
    )
    cache, indptr = torch.zeros(64, 576, dtype=bf16), torch.arange(5, dtype=torch.int32)
    indices = torch.zeros(4, dtype=torch.int32)
    cases = {
        "k_up": lambda: mla.k_up(q),
        "v_up(out=y)": lambda: mla.v_up(latent, y),
        "attend": lambda: mla.attend(latent, cache, indptr, indices, 0.1, q_rope=q[..., 192:]),
    }
    for name, call in cases.items():
        best = min(timeit.repeat(call, number=calls, repeat=5)) / calls
        print(f"{name}: {best * 1e6:.2f} us per call")


if __name__ == "__main__":
    main()
