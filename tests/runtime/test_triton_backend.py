"""The runtime's triton backend end to end on a GPU: open(backend="triton") gives the torch backend's results.

Skipped without a CUDA GPU (the kernels themselves are tested under TRITON_INTERPRET=1 in
test_triton_bmm.py and test_triton_sparse_mla.py).
"""

from __future__ import annotations

import pytest
import torch

from glm_pack import runtime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("card, tp_size", [("glm-5", 4), ("glm-5.3-flash", 1)])
def test_triton_backend_matches_torch(packed_dirs, card, tp_size):
    _, out = packed_dirs(card)
    gpu = runtime.open(out, device="cuda", backend="triton", tp_size=tp_size)
    ref = runtime.open(out, device="cuda", backend="torch", tp_size=tp_size)
    assert gpu.backend.name == "triton"
    layer_id = gpu.layers[0]
    layer, ref_layer = gpu.mla(layer_id), ref.mla(layer_id)
    g = gpu.local_geometry
    gen = torch.Generator().manual_seed(0)
    T, slots, topk = 5, 4096, 256
    q = torch.randn(T, g.num_heads, g.qk_nope_head_dim + g.qk_rope_head_dim, generator=gen).bfloat16().cuda()
    cache = torch.randn(slots, g.cache_row, generator=gen).bfloat16().cuda()
    indices = torch.randint(-1, slots, (T * topk,), generator=gen, dtype=torch.int32).cuda()
    indptr = torch.arange(0, T * topk + 1, topk, dtype=torch.int32).cuda()
    q_rope = q[..., g.qk_nope_head_dim :] if g.qk_rope_head_dim else None
    for act in ("mxfp4", "none"):
        latent, latent_ref = layer.k_up(q, act_quant=act), ref_layer.k_up(q, act_quant=act)
        torch.testing.assert_close(latent.float(), latent_ref.float(), rtol=2e-2, atol=2e-2)
        o = layer.attend(latent_ref, cache, indptr, indices, 0.06, q_rope=q_rope)
        o_ref = ref_layer.attend(latent_ref, cache, indptr, indices, 0.06, q_rope=q_rope)
        assert float((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max()) < 2e-2
        y = layer.v_up(o_ref, act_quant=act)
        torch.testing.assert_close(y.float(), ref_layer.v_up(o_ref, act_quant=act).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_layer_on_a_gpu_other_than_the_current_one(packed_dirs):
    """Weights on cuda:1 while cuda:0 is current: Triton launches on the current device, so the layer makes its own
    GPU current for the call (else device-1 pointers went to a device-0 launch) and leaves the current one as it was."""
    _, out = packed_dirs("glm-5")
    torch.cuda.set_device(0)
    gpu = runtime.open(out, device="cuda:1", backend="triton", tp_size=4)
    ref = runtime.open(out, device="cuda:1", backend="torch", tp_size=4)
    layer, ref_layer = gpu.mla(gpu.layers[0]), ref.mla(gpu.layers[0])
    g = gpu.local_geometry
    gen = torch.Generator().manual_seed(1)
    T, slots, topk = 7, 2048, 128
    dev = torch.device("cuda", 1)
    q = torch.randn(T, g.num_heads, g.qk_nope_head_dim + g.qk_rope_head_dim, generator=gen).bfloat16().to(dev)
    cache = torch.randn(slots, g.cache_row, generator=gen).bfloat16().to(dev)
    indices = torch.randint(-1, slots, (T * topk,), generator=gen, dtype=torch.int32).to(dev)
    indptr = torch.arange(0, T * topk + 1, topk, dtype=torch.int32).to(dev)
    q_rope = q[..., g.qk_nope_head_dim :]
    latent, latent_ref = layer.k_up(q), ref_layer.k_up(q)
    o = layer.attend(latent_ref, cache, indptr, indices, 0.06, q_rope=q_rope)
    o_ref = ref_layer.attend(latent_ref, cache, indptr, indices, 0.06, q_rope=q_rope)
    y, y_ref = layer.v_up(o_ref), ref_layer.v_up(o_ref)
    torch.cuda.synchronize(dev)
    assert torch.cuda.current_device() == 0
    assert latent.device == o.device == y.device == dev
    torch.testing.assert_close(latent.float(), latent_ref.float(), rtol=2e-2, atol=2e-2)
    assert float((o.float() - o_ref.float()).abs().max() / o_ref.float().abs().max()) < 2e-2
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
