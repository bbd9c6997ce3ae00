"""The aiter backend's dispatch, run end to end through stand-ins for aiter's kernels.

No AMD GPU exists here. The stand-ins assert aiter's documented contract (u8 weights, bf16 x, x's K equal to
twice the packed K, positive strides, prequant, transpose_bm, complete configs with NUM_KSPLIT=1) and compute
the result independently of glm-pack's codec: a per-element Python even-rule quantizer and a table dequantizer.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import types

import pytest
import torch

from glm_pack import runtime
from glm_pack.packing.errors import BackendError
from glm_pack.packing.manifest import AITER_BMM_CONFIG_KEYS
from glm_pack.runtime.backends import aiter_backend as ab

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def even_round_trip(values: torch.Tensor) -> torch.Tensor:
    """32-blocks ``[..., 32]`` through the even rule, from notes/mxfp4.md with frexp and a nearest-grid search
    (deliberately not the bit tricks of glm_pack.packing.mxfp4)."""
    v = values.double()
    amax = v.abs().amax(-1, keepdim=True)
    m, e2 = torch.frexp(amax)  # amax = m * 2**e2, m in [0.5, 1)
    floor_log2 = e2 - 1 + (2 * m >= 1.75).long()  # mantissa rounded to 1 bit first
    e = torch.where(amax == 0, -127, (floor_log2 - 2).clamp(-127, 127)).double()
    a = (v.abs() / 2.0**e).clamp(max=6.0)
    grid = torch.tensor(E2M1, dtype=torch.float64)
    dist = (a.unsqueeze(-1) - grid).abs() + torch.arange(8) % 2 * 1e-9  # ties go to the even code
    q = grid[dist.argmin(-1)] * 2.0**e
    return torch.where(torch.signbit(v), -q, q)


def act_quant(x: torch.Tensor) -> torch.Tensor:
    return even_round_trip(x.reshape(*x.shape[:-1], -1, 32)).reshape(x.shape)


def weight_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    table = torch.tensor([sign * v for sign in (1, -1) for v in E2M1], dtype=torch.float64)
    nib = torch.stack([w & 15, w >> 4], -1).reshape(*w.shape[:-1], -1).long()
    scale = torch.tensor([2.0 ** (b - 127) for b in range(256)], dtype=torch.float64)[s.long()]
    return table[nib] * scale.repeat_interleave(32, -1)


class Recorder:
    def __init__(self):
        self.calls = []

    def check_common(self, x, w, w_scales, config):
        assert x.dtype == torch.bfloat16 and w.dtype == torch.uint8 and w_scales.dtype == torch.uint8
        assert x.shape[-1] == 2 * w.shape[-1], "aiter's unchecked K contract"
        assert w_scales.shape == (*w.shape[:2], x.shape[-1] // 32)
        assert all(s > 0 for t in (x, w, w_scales) for s in t.stride())
        assert set(AITER_BMM_CONFIG_KEYS) <= set(config) and config["NUM_KSPLIT"] == 1

    def compute(self, x, w, w_scales):
        return torch.stack([act_quant(x[b]) @ weight_dequant(w[b], w_scales[b]).T for b in range(x.shape[0])])

    def a16wfp4(
        self, x, w, w_scales, dtype=torch.bfloat16, y=None, config=None, transpose_bm=False, prequant=True, y_scale=None
    ):
        self.check_common(x, w, w_scales, config)
        assert prequant and transpose_bm and dtype == torch.bfloat16 and y_scale is None
        B, M, _ = x.shape
        assert y.shape == (M, B, w.shape[1]), "transpose_bm wants y as [M, B, N]"
        y.copy_(self.compute(x, w, w_scales).transpose(0, 1))
        self.calls.append(("a16wfp4", M, x.shape[-1], config["BLOCK_SIZE_M"], config["BLOCK_SIZE_K"]))
        return y

    def pre_quant(self, x, w, w_scales, dtype, y, config):
        self.check_common(x, w, w_scales, config)
        assert y.shape == (x.shape[0], x.shape[1], w.shape[1]) and all(s > 0 for s in y.stride())
        y.copy_(self.compute(x, w, w_scales))
        self.calls.append(("pre_quant", x.shape[1], x.shape[-1], config["BLOCK_SIZE_M"], config["BLOCK_SIZE_K"]))
        return y

    def sparse_mla_fwd(
        self,
        q,
        kv_buffer,
        kv_indptr,
        kv_indices,
        softmax_scale,
        *,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        return_lse=False,
        has_invalid=False,
        out=None,
    ):
        assert q.shape[-1] == kv_lora_rank + qk_rope_head_dim == kv_buffer.shape[-1]
        assert kv_indices.dtype == kv_indptr.dtype == torch.int32
        assert kv_indices.is_contiguous() and kv_indptr.is_contiguous()  # no strides in aiter's signature
        assert has_invalid == bool((kv_indices < 0).any())
        # The kernel takes q.stride(0), q.stride(1) and the cache's row stride only; it reads the last axis of
        # both unit-stride (ROCm/aiter aiter/ops/triton/attention/sparse_mla.py @ 013f408e, the launch of
        # _sparse_mla: q offsets query * q_stride0 + head * q_stride1 + d).
        q = torch.as_strided(q, q.shape, (q.stride(0), q.stride(1), 1))
        if kv_buffer.dim() == 2:
            kv_buffer = torch.as_strided(kv_buffer, kv_buffer.shape, (kv_buffer.stride(0), 1))
        rows = kv_buffer.reshape(-1, kv_buffer.shape[-1]).double()
        o = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float64)
        lse = torch.zeros(q.shape[0], q.shape[1], dtype=torch.float64)
        for t in range(q.shape[0]):
            idx = kv_indices[kv_indptr[t] : kv_indptr[t + 1]].long()
            sel = rows[idx[idx >= 0]]
            s = q[t].double() @ sel.T * softmax_scale
            # The kernel's epilogue, acc * (1 / l) with no guard for l == 0 (ROCm/aiter @ 048877719964, aiter/ops/
            # triton/_gluon_kernels/gfx950/attention/sparse_mla.py, _sparse_mla and _sparse_mla_reduce): a token with
            # no valid row comes back NaN; its lse, (m + log2 l) * ln2, is -inf.
            p = torch.exp(s - (s.amax(-1, keepdim=True) if s.shape[-1] else 0.0))
            o[t] = (p @ sel[:, :kv_lora_rank]) * (1.0 / p.sum(-1, keepdim=True))
            lse[t] = torch.logsumexp(s, -1)
        self.calls.append(("sparse", qk_rope_head_dim))
        return o.bfloat16(), (lse.float() if return_lse else None)


@pytest.fixture
def fake_aiter(monkeypatch):
    rec = Recorder()

    def install(kind="a16wfp4", sparse=True, rope_free=True):
        bmm = rec.a16wfp4 if kind == "a16wfp4" else rec.pre_quant
        fns = ab.AiterFunctions(bmm, kind, rec.sparse_mla_fwd if sparse else None, rope_free, True)
        monkeypatch.setattr(ab, "detect_arch", lambda device: "gfx950")
        monkeypatch.setattr(ab, "gpu_reason", lambda device: "")  # the recorder runs on CPU tensors
        monkeypatch.setattr(ab, "load_aiter", lambda: fns)
        return rec

    return install


def _inputs(geom, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, geom.num_heads, geom.qk_nope_head_dim + geom.qk_rope_head_dim, generator=g).bfloat16()
    cache = torch.randn(64, geom.cache_row, generator=g).bfloat16()
    indices = torch.randint(-1, 64, (T * 16,), generator=g, dtype=torch.int32)
    return q, cache, torch.arange(0, T * 16 + 1, 16, dtype=torch.int32), indices


def test_auto_order_is_aiter_then_triton_then_torch(fake_aiter, monkeypatch):
    """auto = aiter on a gfx950 GPU (keeping Triton, where it runs, as its sparse-MLA fallback), else Triton on a
    GPU, else torch; each is picked only when its status says usable."""
    from glm_pack.runtime.backends import select_backend
    from glm_pack.runtime.backends import triton_backend as tb

    fake_aiter()
    monkeypatch.setattr(tb, "triton_status", lambda device: (True, "ok"))
    gpu = torch.device("cuda")
    chosen = select_backend("auto", gpu, {})
    assert chosen.name == "aiter" and chosen.fallback.name == "triton"
    monkeypatch.setattr(ab, "detect_arch", lambda device: "gfx942")
    assert select_backend("auto", gpu, {}).name == "triton"
    monkeypatch.setattr(tb, "triton_status", lambda device: (False, "no triton"))
    assert select_backend("auto", gpu, {}).name == "torch"
    monkeypatch.setattr(ab, "detect_arch", lambda device: "gfx950")
    chosen = select_backend("auto", gpu, {})
    assert chosen.name == "aiter" and chosen.fallback.name == "torch"


def test_aiter_status_reads_the_arch_of_the_device_asked(monkeypatch):
    """On a ROCm host with a gfx942 GPU 0 and a gfx950 GPU 1, cuda:1 is judged by GPU 1 (GPU 0 was read always)."""
    archs = {0: "gfx942:sramecc+:xnack-", 1: "gfx950:sramecc+:xnack-"}
    monkeypatch.setattr(torch.version, "hip", "7.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def props(d):  # torch takes an index or a device
        return types.SimpleNamespace(gcnArchName=archs[d if isinstance(d, int) else d.index])

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(ab, "gpu_reason", lambda device: "")
    monkeypatch.setattr(ab, "load_aiter", lambda: None)
    assert ab.aiter_status(torch.device("cuda:1")) == (True, "ok")
    assert ab.aiter_status(torch.device("cuda:0")) == (False, "aiter backend needs a gfx950 GPU (cuda:0 is gfx942)")


def test_aiter_is_not_chosen_for_a_cpu_device(packed_dirs, monkeypatch):
    """On a gfx950 machine with aiter, ``device="cpu"`` still gets the torch backend (aiter's kernels take GPU
    tensors only), and forcing aiter there says why."""
    fns = ab.AiterFunctions(Recorder().a16wfp4, "a16wfp4", None, True, True)
    monkeypatch.setattr(ab, "detect_arch", lambda device: "gfx950")
    monkeypatch.setattr(ab, "load_aiter", lambda: fns)
    _, out = packed_dirs("glm-5")
    assert runtime.open(out, device="cpu").backend.name == "torch"
    with pytest.raises(BackendError, match="aiter backend needs a GPU device, got cpu"):
        runtime.open(out, device="cpu", backend="aiter")


@pytest.mark.parametrize("kind", ["a16wfp4", "pre_quant"])
def test_aiter_dispatch_end_to_end(packed_dirs, fake_aiter, kind):
    rec = fake_aiter(kind)
    _, out = packed_dirs("glm-5")
    model = runtime.open(out, backend="aiter", tp_rank=1, tp_size=8)  # 8 heads per rank
    ref_model = runtime.open(out, backend="torch", tp_rank=1, tp_size=8)
    assert model.backend.name == "aiter"
    layer, ref = model.mla(0), ref_model.mla(0)
    geom = model.local_geometry
    q, cache, indptr, indices = _inputs(geom, T=3)
    latent = layer.k_up(q)
    assert rec.calls[-1] == (kind, 3, 256, 16, 256)  # full padded row (K=256 route), M<=16 bucket
    expect = rec.compute(q.transpose(0, 1), ref.w_kc.weight, ref.w_kc.scale).transpose(0, 1)
    assert torch.equal(latent, expect.bfloat16())
    torch.testing.assert_close(latent, ref.k_up(q), rtol=1e-2, atol=1e-2)
    o = layer.attend(latent, cache, indptr, indices, 0.06, q_rope=q[..., 192:])
    assert rec.calls[-1] == ("sparse", 64)
    torch.testing.assert_close(o, ref.attend(latent, cache, indptr, indices, 0.06, q_rope=q[..., 192:]))
    strided = [torch.stack([t, t], dim=1)[:, 0] for t in (indptr, indices)]  # column views, stride 2
    assert torch.equal(layer.attend(latent, cache, *strided, 0.06, q_rope=q[..., 192:]), o)
    big = torch.randn(300, 8, 512).bfloat16()
    y = layer.v_up(big)
    assert rec.calls[-1] == (kind, 300, 512, 128, 128)  # the seed's V-up tuning for M > 256: BM 128, BK 128
    torch.testing.assert_close(y, ref.v_up(big), rtol=1e-2, atol=1e-2)


def test_rope_free_falls_back_once_when_aiter_lacks_it(packed_dirs, fake_aiter, caplog):
    rec = fake_aiter(rope_free=False)
    _, out = packed_dirs("glm-5.3-flash")
    layer = runtime.open(out, backend="aiter").mla(runtime.open(out, backend="torch").layers[0])
    geom = layer.geometry
    assert geom.qk_rope_head_dim == 0
    q, cache, indptr, indices = _inputs(geom, T=2)
    latent = layer.k_up(q)
    with caplog.at_level(logging.WARNING):
        layer.attend(latent, cache, indptr, indices, 0.06)
        layer.attend(latent, cache, indptr, indices, 0.06)
    assert sum("lacks rope-free support" in r.message for r in caplog.records) == 1
    assert all(c[0] != "sparse" for c in rec.calls)


def test_rope_free_uses_aiter_when_supported(packed_dirs, fake_aiter):
    rec = fake_aiter(rope_free=True)
    _, out = packed_dirs("glm-5.3-flash")
    model = runtime.open(out, backend="aiter")
    layer = model.mla(model.layers[0])
    q, cache, indptr, indices = _inputs(layer.geometry, T=2)
    layer.attend(layer.k_up(q), cache, indptr, indices, 0.06)
    assert rec.calls[-1] == ("sparse", 0)


def test_contract_violations_raise_before_the_call():
    x = torch.zeros(2, 3, 192, dtype=torch.bfloat16)
    w = torch.zeros(2, 8, 128, dtype=torch.uint8)  # stores K = 256
    s = torch.zeros(2, 8, 8, dtype=torch.uint8)
    y = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(BackendError, match="K=192 but the weight stores K=256"):
        ab.check_bmm_contract(x, w, s, y)
    with pytest.raises(BackendError, match="u8 weights"):
        ab.check_bmm_contract(torch.zeros(2, 3, 256, dtype=torch.bfloat16), w.float(), s, y)
    x = torch.zeros(1, 3, 256, dtype=torch.bfloat16).expand(2, 3, 256)  # both batches read one buffer: stride 0
    with pytest.raises(BackendError, match=r"positive strides; x has \(0, 256, 1\)"):
        ab.check_bmm_contract(x, w, s, y)
    with pytest.raises(BackendError, match="positive strides; out has"):
        ab.check_bmm_contract(x.contiguous(), w, s, torch.zeros(1, 3, 8, dtype=torch.bfloat16).expand(2, 3, 8))
    cfg = {k: 1 for k in ab.AITER_BMM_CONFIG_KEYS}
    with pytest.raises(BackendError, match="lacks BLOCK_SIZE_M"):
        ab.select_config({"any": {k: v for k, v in cfg.items() if k != "BLOCK_SIZE_M"}}, 4)
    with pytest.raises(BackendError, match="NUM_KSPLIT=2"):
        ab.select_config({"any": {**cfg, "NUM_KSPLIT": 2}}, 4)
    assert ab.select_config({"M_LEQ_16": {**cfg, "BLOCK_SIZE_M": 16}, "any": cfg}, 16)["BLOCK_SIZE_M"] == 16
    assert ab.select_config({"M_LEQ_16": {**cfg, "BLOCK_SIZE_M": 16}, "any": cfg}, 17)["BLOCK_SIZE_M"] == 1


def test_act_quant_none_is_refused_on_aiter(packed_dirs, fake_aiter):
    fake_aiter()
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="aiter", tp_size=8).mla(0)
    with pytest.raises(BackendError, match=r"^layer 0 k_up: aiter's A16WFP4 always quantizes .*\(prequant\)"):
        layer.k_up(torch.zeros(1, 8, 256, dtype=torch.bfloat16), act_quant="none")
    with pytest.raises(BackendError, match=r"^layer 0 v_up: aiter's A16WFP4 always quantizes"):
        layer.v_up(torch.zeros(1, 8, 512, dtype=torch.bfloat16), act_quant="none")


def test_independent_even_rule_matches_hand_vectors():
    # Hand-checked: amax 6 -> e = 0; ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    block = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75] + [0.0] * 23)
    assert even_round_trip(block)[:9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0]
    # amax 7 = 1.75 * 4 rounds up to 8, so e = 1; 7 / 2 = 3.5 ties to 4, i.e. 8.
    assert even_round_trip(torch.tensor([7.0] + [0.0] * 31))[0] == 8.0
    assert even_round_trip(torch.zeros(32)).abs().sum() == 0


# ------------------------------------------------- load_aiter against the sparse_mla_fwd revisions aiter had
# Signatures transcribed (not copied) from ROCm/aiter aiter/ops/triton/attention/sparse_mla.py:
# * branch cagri/sparse_pa_optimizations @ 4d86ac59df030f7852444b721e7c5d024b870c4f: no return_lse, returns `out`
#   alone; the launch passes ROPE_SEPARATE=True (separated rope only).
# * @ d921e5ba5cd0beaaf3a956b4a04cb860c0307c55: adds return_lse and returns (out, lse), still ROPE_SEPARATE=True
#   ("separated-rope geometry"): qk_rope_head_dim=0 gives a zero-width rope plane the kernel cannot build.
# * @ 013f408ebe8491e80ddab1fbab4c3dbcbc98bd74: everything after softmax_scale keyword-only, ROPE_SEPARATE =
#   qk_rope_head_dim > 0, so qk_rope_head_dim=0 is the rope-free (GLM-5.3-Flash) geometry.


def _rev_branch(rec):
    def sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, kv_scale=None, kv_lora_rank=512,
                       qk_rope_head_dim=64, kv_splits=None, skip_reduce=False, has_invalid=False,
                       dot_precision="bf16", q_scale=None, out=None):  # fmt: skip
        return rec.sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, kv_lora_rank=kv_lora_rank,
                                  qk_rope_head_dim=qk_rope_head_dim, has_invalid=has_invalid)[0]  # fmt: skip

    return sparse_mla_fwd


def _rev_separated(rec):
    def sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, kv_scale=None, kv_lora_rank=512,
                       qk_rope_head_dim=64, kv_splits=None, skip_reduce=False, has_invalid=False,
                       dot_precision="bf16", q_scale=None, out=None, return_lse=False):  # fmt: skip
        if qk_rope_head_dim == 0:
            raise ZeroDivisionError("integer division or modulo by zero")  # RTW = ROPE_DIM // ROPE_VEC
        return rec.sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, kv_lora_rank=kv_lora_rank,
                                  qk_rope_head_dim=qk_rope_head_dim, has_invalid=has_invalid,
                                  return_lse=return_lse)  # fmt: skip

    return sparse_mla_fwd


def _rev_merged(rec):
    def sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, *, kv_scale=None, kv_lora_rank=512,
                       qk_rope_head_dim=64, kv_splits=None, skip_reduce=False, has_invalid=False,
                       dot_precision="bf16", q_scale=None, out=None, return_lse=False, attn_sink=None):  # fmt: skip
        return rec.sparse_mla_fwd(q, kv_buffer, kv_indptr, kv_indices, softmax_scale, kv_lora_rank=kv_lora_rank,
                                  qk_rope_head_dim=qk_rope_head_dim, has_invalid=has_invalid,
                                  return_lse=return_lse)  # fmt: skip

    return sparse_mla_fwd


def _install_modules(monkeypatch, rec, sparse_mla_fwd):
    """A stand-in aiter package: the batched GEMM module and the sparse-MLA module, nothing else."""
    modules = {"aiter": {}, ab._BMM_FUNCTIONS[0][0]: {"batched_gemm_a16wfp4": rec.a16wfp4}}
    modules[ab._SPARSE_MODULE] = {"sparse_mla_fwd": sparse_mla_fwd}
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(ab, "detect_arch", lambda device: "gfx950")
    monkeypatch.setattr(ab, "gpu_reason", lambda device: "")


@pytest.mark.parametrize(
    ("revision", "usable", "rope_free"),
    [(_rev_branch, False, False), (_rev_separated, True, False), (_rev_merged, True, True)],
)
def test_load_aiter_tells_the_sparse_mla_revisions_apart(monkeypatch, revision, usable, rope_free):
    rec = Recorder()
    _install_modules(monkeypatch, rec, revision(rec))
    fns = ab.load_aiter()
    assert fns.bmm_kind == "a16wfp4" and fns.bmm == rec.a16wfp4
    assert (fns.sparse_mla_fwd is not None) == usable
    assert fns.sparse_rope_free == rope_free


@pytest.mark.parametrize(("card", "revision"), [("glm-5.3-flash", _rev_separated), ("glm-5", _rev_branch)])
def test_attend_falls_back_where_the_installed_sparse_mla_cannot_serve(packed_dirs, monkeypatch, caplog, card,
                                                                        revision):  # fmt: skip
    """A rope-free model on aiter's separated-rope-only revision, and any model on the revision without
    return_lse (one tensor back, not (out, lse)), get the fallback backend's answer, said once."""
    rec = Recorder()
    _install_modules(monkeypatch, rec, revision(rec))
    _, out = packed_dirs(card)
    model, ref_model = runtime.open(out, backend="aiter"), runtime.open(out, backend="torch")
    layer, ref = model.mla(model.layers[0]), ref_model.mla(ref_model.layers[0])
    q, cache, indptr, indices = _inputs(layer.geometry, T=2)
    latent = ref.k_up(q)
    q_rope = q[..., layer.geometry.qk_nope_head_dim :] if layer.geometry.qk_rope_head_dim else None
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            o = layer.attend(latent, cache, indptr, indices, 0.06, q_rope=q_rope)
    assert sum("sparse MLA runs on the" in r.message for r in caplog.records) == 1
    assert all(c[0] != "sparse" for c in rec.calls)
    torch.testing.assert_close(o, ref.attend(latent, cache, indptr, indices, 0.06, q_rope=q_rope))


def test_sparse_mla_gets_unit_stride_rows(packed_dirs, fake_aiter):
    """aiter's sparse kernel reads q's and the cache's last axis unit-stride whatever their strides say: a
    strided rope-free q_latent must reach it as a unit-stride copy, and a cache with strided rows (which the
    Triton backend refuses too) is refused before the call."""
    rec = fake_aiter(rope_free=True)
    _, out = packed_dirs("glm-5.3-flash")
    model, ref_model = runtime.open(out, backend="aiter"), runtime.open(out, backend="torch")
    layer, ref = model.mla(model.layers[0]), ref_model.mla(ref_model.layers[0])
    q, cache, indptr, indices = _inputs(layer.geometry, T=2)
    latent = ref.k_up(q)
    strided = torch.stack([latent, -latent], dim=-1)[..., 0]  # last stride 2
    o = layer.attend(strided, cache, indptr, indices, 0.06)
    assert rec.calls[-1] == ("sparse", 0)
    torch.testing.assert_close(o, ref.attend(latent, cache, indptr, indices, 0.06))
    with pytest.raises(BackendError, match="kv_cache rows must be contiguous"):
        layer.attend(latent, torch.stack([cache, cache], dim=-1)[..., 0], indptr, indices, 0.06)


def test_a_paged_cache_reaches_aiter_as_one_row_stride(packed_dirs, fake_aiter, monkeypatch):
    """aiter's kernel takes one row stride for the whole cache: a paged ``[blocks, block, R]`` cache reaches it as the
    ``[slots, R]`` view of the same memory (the reference's answer), and a cache whose rows are padded inside each
    block, or a 4-D cache other than ``[slots, 1, 1, R]``, has no such view and is refused before the call (aiter
    read the padded one at the wrong row stride, or raised its own ValueError)."""
    fake_aiter()
    fns, seen = ab.load_aiter(), []
    spy = lambda q, kv_buffer, *a, **k: seen.append(kv_buffer) or fns.sparse_mla_fwd(q, kv_buffer, *a, **k)  # noqa: E731
    monkeypatch.setattr(ab, "load_aiter", lambda: dataclasses.replace(fns, sparse_mla_fwd=spy))
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="aiter", tp_size=8).mla(0)
    ref = runtime.open(out, backend="torch", tp_size=8).mla(0)
    q, cache, indptr, indices = _inputs(layer.geometry, T=3)
    latent, rope = ref.k_up(q), q[..., 192:]
    paged = cache.view(4, 16, -1)
    o = layer.attend(latent, paged, indptr, indices, 0.06, q_rope=rope)
    torch.testing.assert_close(o, ref.attend(latent, cache, indptr, indices, 0.06, q_rope=rope))
    assert seen[-1].shape == cache.shape and seen[-1].data_ptr() == paged.data_ptr()
    padded = torch.cat([paged, paged[:, :1]], dim=1)[:, :16]  # rows of a block 16 apart, blocks 17 rows apart
    for bad, says in ((padded, "cannot be flattened to slots"), (cache.view(32, 2, 1, -1), "must be .slots, 1, 1")):
        with pytest.raises(BackendError, match=says):
            layer.attend(latent, bad, indptr, indices, 0.06, q_rope=rope)
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda indptr, indices: indices.__setitem__(3, 64), r"^layer 0: kv_indices\[3\] = 64 is not a slot of the 64"),
        (lambda indptr, indices: indices.__setitem__(5, -2), r"^layer 0: kv_indices\[5\] = -2 is not a slot"),
        (lambda indptr, indices: indptr.__setitem__(1, 40), "^layer 0: kv_indptr must rise monotonically"),
    ],
)
def test_out_of_range_indices_are_refused_before_aiter_reads_them(packed_dirs, fake_aiter, edit, says):
    """aiter's sparse kernel masks neither ids past the cache nor a falling kv_indptr on its unmasked (UNI_TILE)
    gather (ROCm/aiter @ 048877719964164466bb02c024188783eacf16ff, aiter/ops/triton/_gluon_kernels/gfx950/
    attention/sparse_mla.py, _slots: only the masked tail tests slot < num_rows), so the backend refuses them as
    the torch reference does."""
    rec = fake_aiter()
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="aiter", tp_size=8).mla(0)
    q, cache, indptr, indices = _inputs(layer.geometry, T=3)
    edit(indptr, indices)
    latent = torch.zeros(3, layer.geometry.num_heads, 512, dtype=torch.bfloat16)
    with pytest.raises(BackendError, match=says):
        layer.attend(latent, cache, indptr, indices, 0.06, q_rope=q[..., 192:])
    assert all(c[0] != "sparse" for c in rec.calls)


@pytest.mark.parametrize(
    ("ids", "has_invalid"),
    [([5, -1, 7, 0, 63, 2], True), ([5, 1, 7, 0, 63, 2], False), ([-1] * 6, True), ([], False)],
)
def test_has_invalid_says_whether_any_id_is_minus_one(packed_dirs, fake_aiter, monkeypatch, ids, has_invalid):
    """aiter's kernel skips -1 ids only when told has_invalid; the flag is True exactly when kv_indices holds a -1
    (no -1, or no ids at all: False), and the output matches the reference either way."""
    fake_aiter()
    fns, seen = ab.load_aiter(), []
    spy = lambda *a, **k: seen.append(k["has_invalid"]) or fns.sparse_mla_fwd(*a, **k)  # noqa: E731
    monkeypatch.setattr(ab, "load_aiter", lambda: dataclasses.replace(fns, sparse_mla_fwd=spy))
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="aiter", tp_size=8).mla(0)
    ref = runtime.open(out, backend="torch", tp_size=8).mla(0)
    q, cache, _, _ = _inputs(layer.geometry, T=2)
    indices = torch.tensor(ids, dtype=torch.int32)
    indptr = torch.tensor([0, len(ids) // 2, len(ids)], dtype=torch.int32)
    latent, rope = ref.k_up(q), q[..., 192:]
    o = layer.attend(latent, cache, indptr, indices, 0.06, q_rope=rope)
    assert seen == [has_invalid]
    torch.testing.assert_close(o, ref.attend(latent, cache, indptr, indices, 0.06, q_rope=rope))


@pytest.mark.parametrize("revision", [_rev_separated, _rev_merged])
def test_rope_width_is_passed_to_every_usable_revision(packed_dirs, monkeypatch, revision):
    """Both revisions that return (out, lse) serve a model with rope; the rope width goes to them explicitly,
    never left to aiter's default of 64."""
    rec, seen = Recorder(), []
    fwd = revision(rec)

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return fwd(*args, **kwargs)

    recording.__signature__ = inspect.signature(fwd)
    _install_modules(monkeypatch, rec, recording)
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="aiter", tp_size=8).mla(0)
    q, cache, indptr, indices = _inputs(layer.geometry, T=2)
    layer.attend(layer.k_up(q), cache, indptr, indices, 0.06, q_rope=q[..., 192:])
    assert rec.calls[-1] == ("sparse", 64) and seen[-1]["qk_rope_head_dim"] == 64


def test_load_aiter_says_why_it_found_no_gemm(monkeypatch):
    """A GEMM module that fails to import (aiter raises RuntimeError without ROCm, ImportError on a broken
    install) is named with its error, not reported as an aiter without the GEMM."""
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    new, old = "aiter.ops.triton.gemm.batched.batched_gemm_a16wfp4", "aiter.ops.triton.batched_gemm_afp4wfp4_pre_quant"
    monkeypatch.setitem(sys.modules, new, None)  # importing it raises, naming it
    with pytest.raises(BackendError, match=rf"importing {new}: ModuleNotFoundError: import of .* importing {old}: "):
        ab.load_aiter()


@pytest.mark.parametrize("card", ["glm-5", "glm-5.3-flash"])
def test_a_token_without_a_valid_row_gets_the_references_zeros(packed_dirs, fake_aiter, card):
    """aiter's kernel returns NaN for a token whose ids are all -1 or whose range is empty (it divides by a zero
    softmax sum); the backend gives the reference's zero row and lse -inf, and leaves the other tokens alone
    (repeated ids included)."""
    rec = fake_aiter()
    _, out = packed_dirs(card)
    model, ref_model = runtime.open(out, backend="aiter"), runtime.open(out, backend="torch")
    layer, ref = model.mla(model.layers[0]), ref_model.mla(ref_model.layers[0])
    geom = layer.geometry
    q, cache, indptr, indices = _inputs(geom, T=3)
    indices[:4] = 7  # token 0: a repeated id
    indices[16:32] = -1  # token 1: no valid row
    indptr[3] = indptr[2]  # token 2: an empty range
    q_rope = q[..., geom.qk_nope_head_dim :] if geom.qk_rope_head_dim else None
    latent = ref.k_up(q)
    o, lse = layer.attend(latent, cache, indptr, indices, 0.06, q_rope=q_rope, return_lse=True)
    assert rec.calls[-1][0] == "sparse"
    o_ref, lse_ref = ref.attend(latent, cache, indptr, indices, 0.06, q_rope=q_rope, return_lse=True)
    assert torch.equal(o[1:], torch.zeros_like(o[1:])) and torch.isneginf(lse[1:]).all()
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
