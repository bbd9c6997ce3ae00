"""SGLang adapter against a stand-in of SGLang's DeepseekV2 MLA (SGLang cannot be installed here; see
engine_standins/__init__.py): attributes with the engine's names, shapes, dtypes and strides, the same
decode projections as the engine's rebuild, SGLang's layer selection, and the EntryClass hook."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from engine_standins import aiter_functions, ragged_k_bug, sglang_mla
from engine_standins.overlay_fixture import GEOM, LAYERS, kv_b_name, make_served, make_served_fp8

from glm_pack.convert.formats import encode_fp8_block
from glm_pack.packing.errors import BackendError, VerifyError
from glm_pack.packing.mxfp4 import dequantize, quantize
from glm_pack.runtime.backends import aiter_backend
from glm_pack.runtime.engines import common, sglang

P, L, V, R = GEOM.qk_nope_head_dim, GEOM.kv_lora_rank, GEOM.v_head_dim, GEOM.qk_rope_head_dim


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    common._OPEN.clear()
    common._KUP_CHECKED.clear()
    aiter = aiter_functions(sglang_mla.batched_gemm_afp4wfp4_pre_quant, "pre_quant")  # SGLang's aiter API
    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: aiter)
    yield
    common._OPEN.clear()


def overlay(root, *, tp_rank=0, tp_size=1):
    return common.open_overlay(str(root), root, tp_rank=tp_rank, tp_size=tp_size, device="cpu", level="full")


def decode_inputs(heads, T=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, heads, P + R, generator=g).bfloat16(), torch.randn(T, heads, L, generator=g).bfloat16()


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_mxfp4_attributes_equal_the_engine_rebuild_including_strides(tmp_path, tp_rank, tp_size):
    weights = make_served(tmp_path)
    kv_b = weights["model.layers.0.self_attn.kv_b_proj.weight"]
    ref = sglang_mla.SelfAttn(GEOM, kv_b, tp_rank=tp_rank, tp_size=tp_size)
    ref.rebuild(fp4=True)
    attn = sglang_mla.SelfAttn(GEOM, kv_b, tp_rank=tp_rank, tp_size=tp_size)
    assert sglang.apply(attn, 0, overlay(tmp_path, tp_rank=tp_rank, tp_size=tp_size), fp4_path=True)
    H = GEOM.num_heads // tp_size
    expect = {
        "w_kc": (H, P // 2, L),
        "w_scale_k": (H, P // 32, L),
        "w_vc": (H, L // 2, V),
        "w_scale_v": (H, L // 32, V),
    }
    for name, shape in expect.items():
        got, want = getattr(attn, name), getattr(ref, name)
        assert got.shape == shape and got.dtype == torch.uint8, name
        assert got.stride() == want.stride(), name  # same physical layout as SGLang's own tensors
        assert torch.equal(got, want), name  # BF16 source, same even rule: byte-identical
    q, o = decode_inputs(H)
    got, want = attn.decode(q, o, gfx95=True), ref.decode(q, o, gfx95=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    w = kv_b.double().view(GEOM.num_heads, P + V, L)[tp_rank * H : (tp_rank + 1) * H]
    exact = torch.einsum("thp,hpl->htl", q[..., :P].double(), w[:, :P])
    assert float((got[0].double() - exact).norm() / exact.norm()) < 0.2


def test_bf16_policy_attributes_match_the_bf16_rebuild(tmp_path):
    weights = make_served(tmp_path, policy="bf16")
    kv_b = weights["model.layers.1.self_attn.kv_b_proj.weight"]
    ref, attn = sglang_mla.SelfAttn(GEOM, kv_b), sglang_mla.SelfAttn(GEOM, kv_b)
    ref.rebuild(fp4=False)
    attn.w_scale = torch.tensor(3.0)  # a stale per-tensor FP8 scale must not survive
    sglang.apply(attn, 1, overlay(tmp_path), fp4_path=True)
    for name in ("w_kc", "w_vc"):
        got, want = getattr(attn, name), getattr(ref, name)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape and torch.equal(got, want), name
    assert attn.w_scale == 1.0
    q, o = decode_inputs(GEOM.num_heads)
    got, want = attn.decode(q, o, gfx95=True), ref.decode(q, o, gfx95=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bf16_overlay_takes_the_served_float_dtype(tmp_path):
    """An fp16 server (SGLang --dtype float16) loads kv_b_proj in fp16 and its rebuild keeps that dtype, which
    its forward multiplies fp16 q_nope with: the overlay's attributes must be fp16 too, with the same values."""
    weights = make_served(tmp_path, policy="bf16")
    kv_b = weights["model.layers.1.self_attn.kv_b_proj.weight"].to(torch.float16)
    ref, attn = sglang_mla.SelfAttn(GEOM, kv_b), sglang_mla.SelfAttn(GEOM, kv_b)
    ref.rebuild(fp4=False)
    sglang.apply(attn, 1, overlay(tmp_path), fp4_path=False)
    for name in ("w_kc", "w_vc"):
        got, want = getattr(attn, name), getattr(ref, name)
        assert got.dtype == torch.float16 and torch.equal(got, want), name


def test_padded_w_kc_and_missing_fp4_path_are_refused(tmp_path):
    weights = make_served(tmp_path, k_stored=96)
    attn = sglang_mla.SelfAttn(GEOM, weights["model.layers.0.self_attn.kv_b_proj.weight"])
    with pytest.raises(BackendError, match="--k-pad none"):
        sglang.apply(attn, 0, overlay(tmp_path), fp4_path=True)
    with pytest.raises(BackendError, match="gfx950"):
        sglang.apply(attn, 0, overlay(tmp_path), fp4_path=False)


def test_an_aiter_with_the_ragged_k_bug_is_caught_before_any_weight_is_set(tmp_path, monkeypatch):
    weights = make_served(tmp_path)
    buggy = aiter_functions(ragged_k_bug(sglang_mla.batched_gemm_afp4wfp4_pre_quant), "pre_quant")
    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: buggy)
    attn = sglang_mla.SelfAttn(GEOM, weights["model.layers.0.self_attn.kv_b_proj.weight"])
    with pytest.raises(BackendError, match=rf"gets K-up with K={P} wrong .*ragged-K bug.*--mla-precision bf16"):
        sglang.apply(attn, 0, overlay(tmp_path), fp4_path=True)
    assert attn.w_kc is None and attn.w_scale_k is None


def test_an_aiter_whose_gemm_raises_is_refused_in_one_line_before_any_weight_is_set(tmp_path, monkeypatch):
    """ROCm/aiter v0.1.7 (the Nov-2025 wheel), aiter/ops/triton/batched_gemm_afp4wfp4_pre_quant.py: with
    config=None the default MI350X-BATCHED_GEMM_PREQUANT-AFP4WFP4.json gives NUM_KSPLIT=4 for M <= 128, and the
    split-K branch calls get_splitk, which that module never imports: NameError, as SGLang calls it."""

    def old_wheel(x, w, w_scales, dtype=torch.bfloat16, y=None, config=None):
        if config is None and x.shape[1] <= 128:
            raise NameError("name 'get_splitk' is not defined")
        return sglang_mla.batched_gemm_afp4wfp4_pre_quant(x, w, w_scales, dtype, y)

    weights = make_served(tmp_path)
    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: aiter_functions(old_wheel, "pre_quant"))
    attn = sglang_mla.SelfAttn(GEOM, weights["model.layers.0.self_attn.kv_b_proj.weight"])
    with pytest.raises(BackendError, match=rf"layer 0: .* fails on K-up with K={P} \(NameError: name 'get_splitk'"
                       r".*--mla-precision bf16"):  # fmt: skip
        sglang.apply(attn, 0, overlay(tmp_path), fp4_path=True)
    assert attn.w_kc is None and attn.w_scale_k is None


def test_running_out_of_memory_in_the_k_up_check_is_not_blamed_on_aiter(tmp_path, monkeypatch):
    """Out of memory says nothing about aiter's K-up: it propagates as itself and is not cached, so the same shape is
    checked again (and passes) once memory is free; it used to be cached as 'aiter fails on K-up' for the process."""
    calls = []

    def short_of_memory_once(x, w, w_scales, dtype=torch.bfloat16, y=None, config=None):
        calls.append(x.shape)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return sglang_mla.batched_gemm_afp4wfp4_pre_quant(x, w, w_scales, dtype, y)

    weights = make_served(tmp_path)
    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: aiter_functions(short_of_memory_once, "pre_quant"))
    kv_b = weights["model.layers.0.self_attn.kv_b_proj.weight"]
    attn = sglang_mla.SelfAttn(GEOM, kv_b)
    with pytest.raises(torch.OutOfMemoryError):
        sglang.apply(attn, 0, overlay(tmp_path), fp4_path=True)
    assert attn.w_kc is None
    attn = sglang_mla.SelfAttn(GEOM, kv_b)
    assert sglang.apply(attn, 0, overlay(tmp_path), fp4_path=True) and attn.w_kc is not None


def test_wrong_slice_is_refused(tmp_path):
    weights = make_served(tmp_path)
    attn = sglang_mla.SelfAttn(GEOM, weights["model.layers.0.self_attn.kv_b_proj.weight"], tp_rank=1, tp_size=2)
    with pytest.raises(VerifyError, match="tensor-parallel slice"):
        sglang.apply(attn, 0, overlay(tmp_path, tp_rank=0, tp_size=2), fp4_path=True)


def fp8_model(weights, scales, block, *, tp_rank=0, tp_size=1, scale_factor=1.0):
    """The stand-in model holding FP8 kv_b_proj weights with this rank's rows of their block scales."""
    model = sglang_mla.Model(GEOM, weights, layers=LAYERS, tp_rank=tp_rank, tp_size=tp_size)
    rows = GEOM.num_heads // tp_size * (P + V) // block[0]
    for i in LAYERS:
        linear = model.model.layers[i].self_attn.kv_b_proj
        linear.weight_scale_inv = scales[kv_b_name(i)][tp_rank * rows : (tp_rank + 1) * rows] * scale_factor
    return model


@pytest.mark.parametrize("where", ["weight_block_size", "linear_fp8_config"])
def test_fp8_kv_b_proj_slice_is_dequantized_and_checked(tmp_path, where):
    """SGLang reads an FP8 kv_b_proj raw (weight + weight_scale_inv, block size from the quant config): the slice
    check dequantizes it, so the right rank's slice passes and another rank's, or wrong scales, are refused."""
    block = (32, 32)
    weights, scales = make_served_fp8(tmp_path, block)
    config = types.SimpleNamespace(weight_block_size=None, linear_fp8_config=None)
    linear = types.SimpleNamespace(weight_block_size=block)
    setattr(config, where, list(block) if where == "weight_block_size" else linear)
    model = fp8_model(weights, scales, block, tp_rank=1, tp_size=2)
    model.quant_config = config
    assert sglang.apply_model(model, overlay(tmp_path, tp_rank=1, tp_size=2), False, None, fp4_path=False) is None
    assert model.model.layers[0].self_attn.w_kc.dtype == torch.bfloat16
    for wrong, rank in ((fp8_model(weights, scales, block, tp_rank=0, tp_size=2), 1),
                        (fp8_model(weights, scales, block, scale_factor=4.0), 0)):  # fmt: skip
        wrong.quant_config = config
        common._OPEN.clear()
        with pytest.raises(VerifyError, match="tensor-parallel slice"):
            sglang.apply_model(wrong, overlay(tmp_path, tp_rank=rank, tp_size=2 if rank else 1), False, None,
                               fp4_path=False)  # fmt: skip


def test_a_kv_b_proj_the_engine_quantized_at_load_passes_the_slice_check(tmp_path):
    """SGLang's online FP8 (a BF16 checkpoint served with FP8 linears) holds kv_b_proj with FP8 rounding the
    overlay's BF16 source never had: the right rank's slice passes, another rank's is still refused."""
    block = (32, 32)
    weights = make_served(tmp_path, policy="bf16")
    encoded = {name: encode_fp8_block(w.float(), block) for name, w in weights.items()}
    fp8_weights, scales = {n: e[0] for n, e in encoded.items()}, {n: e[1] for n, e in encoded.items()}
    config = types.SimpleNamespace(weight_block_size=list(block), linear_fp8_config=None)
    models = [fp8_model(fp8_weights, scales, block, tp_rank=rank, tp_size=2) for rank in (1, 0)]
    for model in models:
        model.quant_config = config
    assert sglang.apply_model(models[0], overlay(tmp_path, tp_rank=1, tp_size=2), False, None, fp4_path=False) is None
    with pytest.raises(VerifyError, match="tensor-parallel slice"):
        sglang.apply_model(models[1], overlay(tmp_path, tp_rank=1, tp_size=2), False, None, fp4_path=False)


def test_a_float_kv_b_proj_gets_no_quantization_allowance(tmp_path):
    """A BF16 kv_b_proj that differs from the overlay's source by MXFP4 rounding (relative error ~0.1) is another
    checkpoint, not an engine's own load rounding: refused against a BF16-policy overlay."""
    weights = make_served(tmp_path, policy="bf16")
    kv_b = weights[kv_b_name(0)].float()
    rounded = dequantize(*quantize(kv_b, mode="even", axis=-1), axis=-1)
    assert 0.05 < float((rounded - kv_b).norm() / kv_b.norm()) < 0.2
    attn = sglang_mla.SelfAttn(GEOM, rounded.bfloat16())
    with pytest.raises(VerifyError, match="wrong checkpoint"):
        sglang.apply(attn, 0, overlay(tmp_path), fp4_path=False)
    assert attn.w_kc is None


def test_kv_b_proj_in_an_unknown_form_skips_the_check_with_a_warning(tmp_path, caplog):
    weights = make_served(tmp_path, policy="bf16")
    attn = sglang_mla.SelfAttn(GEOM, weights[kv_b_name(0)])
    attn.kv_b_proj.weight = attn.kv_b_proj.weight.view(torch.int16)  # neither float nor FP8
    with caplog.at_level("WARNING", logger="glm_pack.engines"):
        assert sglang.apply(attn, 0, overlay(tmp_path), fp4_path=False)
    assert "layer 0: kv_b_proj is in a form glm-pack cannot read; its slice is not checked" in caplog.text


def test_an_awq_kv_b_proj_without_a_weight_skips_the_check_with_a_warning(tmp_path, caplog):
    """AWQ keeps ``qweight`` and no ``weight`` (SGLang dequantizes it itself): the adapter raised an AttributeError."""
    weights = make_served(tmp_path, policy="bf16")
    ref, attn = (sglang_mla.SelfAttn(GEOM, weights[kv_b_name(0)]) for _ in range(2))
    ref.rebuild(fp4=False)
    attn.kv_b_proj = types.SimpleNamespace(qweight=torch.zeros(L, 8, dtype=torch.int32))
    with caplog.at_level("WARNING", logger="glm_pack.engines"):
        assert sglang.apply(attn, 0, overlay(tmp_path), fp4_path=False)
    assert "layer 0: kv_b_proj is in a form glm-pack cannot read; its slice is not checked" in caplog.text
    assert attn.w_kc.dtype == torch.bfloat16 and torch.equal(attn.w_kc, ref.w_kc) and torch.equal(attn.w_vc, ref.w_vc)


def test_sglangs_fused_rocm_decode_refuses_an_mxfp4_overlay(tmp_path):
    """With SGLANG_ROCM_FUSED_DECODE_MLA set, SGLang's fused ROCm decode runs the K-up as a bf16 torch.bmm of
    ``w_kc.to(bf16) * w_scale`` (forward_mla_fused_rope_rocm.py), which would read MXFP4 bytes as numbers: refused
    by name before any weight is set; a BF16 overlay, which that path reads right, is taken."""
    weights = make_served(tmp_path)
    attn = sglang_mla.SelfAttn(GEOM, weights[kv_b_name(0)])
    attn.rocm_fused_decode_mla = True  # as SGLang's init_mla_fused_rope_rocm_forward sets it from the variable
    with pytest.raises(BackendError, match="layer 0: .*SGLANG_ROCM_FUSED_DECODE_MLA set \\(unset it\\)"):
        sglang.apply(attn, 0, overlay(tmp_path), fp4_path=True)
    assert attn.w_kc is None
    common._OPEN.clear()
    bf16 = tmp_path / "bf16"
    weights = make_served(bf16, policy="bf16")
    attn = sglang_mla.SelfAttn(GEOM, weights[kv_b_name(0)])
    attn.rocm_fused_decode_mla = True
    assert sglang.apply(attn, 0, overlay(bf16), fp4_path=True) and attn.w_kc.dtype == torch.bfloat16


def test_model_level_selection_hands_uncovered_layers_to_the_engine(tmp_path):
    weights = make_served(tmp_path)
    model = sglang_mla.Model(GEOM, weights, layers=LAYERS)
    packed = overlay(tmp_path)
    assert sglang.apply_model(model, packed, False, None, fp4_path=True) is None
    assert model.model.layers[1].self_attn.w_kc.dtype == torch.uint8
    model.config.num_hidden_layers = 2
    model.model.end_layer = 3  # a layer the overlay lacks
    model.model.layers[2] = types.SimpleNamespace(self_attn=sglang_mla.SelfAttn(GEOM, weights[next(iter(weights))]))
    rest = sglang.apply_model(
        model, packed, False, ["model.layers.2.self_attn.kv_b_proj.weight", "x.y.z"], fp4_path=True
    )
    assert rest == {"weight_names": ["model.layers.2.self_attn.kv_b_proj.weight"]}
    model.model.decoder.self_attn = model.model.layers[2].self_attn
    nextn = sglang.apply_model(model, packed, True, None, fp4_path=True)  # nextn layer id 2: not in the overlay
    assert nextn == {}


def test_weight_names_of_another_pipeline_stage_are_left_out(tmp_path):
    """SGLang's rebuild takes the kv_b_proj names it was given only within this pipeline stage's layers
    (``start_layer <= id < end_layer``), whose other layers it does not hold: the adapter selects the same."""
    weights = make_served(tmp_path)
    model = sglang_mla.Model(GEOM, weights, layers=LAYERS)
    model.model.start_layer = 1  # this stage holds layer 1 alone; SGLang keeps a placeholder at layer 0
    model.model.layers[0] = types.SimpleNamespace()
    names = [kv_b_name(i) for i in LAYERS]
    assert sglang.apply_model(model, overlay(tmp_path), False, names, fp4_path=True) is None
    assert model.model.layers[1].self_attn.w_kc.dtype == torch.uint8


@pytest.fixture(params=["runtime_context", "legacy"])
def fake_sglang(request, monkeypatch, tmp_path):
    """SGLang's import paths the hook uses, served by the stand-in, in the API of a release (0.5.20+: TP rank and
    server args in ``runtime_context``, the old functions gone or raising, GLM's own draft class) or of main at
    0201c04e (``legacy``: ``dp_attention`` and ``get_global_server_args``, no runtime_context, no GLM draft class)."""

    class GlmMoeDsaForCausalLM(sglang_mla.Model):
        pass

    class DeepseekV3ForCausalLMNextN(sglang_mla.NextNModel):
        pass

    class GlmMoeDsaForCausalLMNextN(DeepseekV3ForCausalLMNextN):
        pass

    args = types.SimpleNamespace(model_path=str(tmp_path), revision=None)

    def retired():
        raise RuntimeError("get_global_server_args() is retired")

    new = request.param == "runtime_context"
    glm = {"GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM}
    mods = {
        "sglang.srt.models": types.ModuleType("sglang.srt.models"),
        "sglang.srt.models.glm4_moe": types.SimpleNamespace(
            **glm, **({"GlmMoeDsaForCausalLMNextN": GlmMoeDsaForCausalLMNextN} if new else {})
        ),
        "sglang.srt.models.deepseek_nextn": types.SimpleNamespace(
            DeepseekV3ForCausalLMNextN=DeepseekV3ForCausalLMNextN
        ),
        "sglang.srt.models.deepseek_common.utils": types.SimpleNamespace(_use_aiter_gfx95=True),
        "sglang.srt.layers.dp_attention": types.SimpleNamespace()
        if new
        else types.SimpleNamespace(get_attention_tp_rank=lambda: 0, get_attention_tp_size=lambda: 1),
        "sglang.srt.server_args": types.SimpleNamespace(get_global_server_args=retired if new else lambda: args),
        "sglang.srt.runtime_context": types.SimpleNamespace(
            get_parallel=lambda: types.SimpleNamespace(attn_tp_rank=0, attn_tp_size=1), get_server_args=lambda: args
        )
        if new
        else None,  # import fails
    }
    mods["sglang.srt.models"].glm4_moe = mods["sglang.srt.models.glm4_moe"]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    sglang._entry_classes.cache_clear()
    yield request.param
    sglang._entry_classes.cache_clear()


def test_entry_classes_replace_by_name_and_load_the_overlay(tmp_path, fake_sglang, monkeypatch):
    weights = make_served(tmp_path)
    import glm_pack.runtime.engines.sglang as module

    assert hasattr(module, "EntryClass")  # what SGLang's registry asks
    glm_cls, nextn_cls, *glm_draft = module.EntryClass
    assert (glm_cls.__name__, nextn_cls.__name__) == ("GlmMoeDsaForCausalLM", "DeepseekV3ForCausalLMNextN")
    drafts = ["GlmMoeDsaForCausalLMNextN"] if fake_sglang == "runtime_context" else []  # SGLang 0.5.16+'s GLM draft
    assert [c.__name__ for c in glm_draft] == drafts

    monkeypatch.delenv(common.ENV, raising=False)
    model = glm_cls(GEOM, weights, layers=LAYERS)
    model.post_load_weights()
    assert model.rebuilt == [0, 1]  # without the variable: SGLang's own rebuild

    monkeypatch.setenv(common.ENV, "1")
    model = glm_cls(GEOM, weights, layers=LAYERS)
    model.post_load_weights()
    assert model.rebuilt == []
    ref = sglang_mla.SelfAttn(GEOM, weights["model.layers.0.self_attn.kv_b_proj.weight"])
    ref.rebuild(fp4=True)
    assert torch.equal(model.model.layers[0].self_attn.w_scale_k, ref.w_scale_k)


def test_the_mtp_draft_classes_load_their_layer_when_called_without_arguments(tmp_path, fake_sglang, monkeypatch):
    """SGLang's dummy, sharded-state and remote loaders call ``post_load_weights()`` with no argument; the MTP draft
    classes pin ``is_nextn=True`` (0.5.12+). The override defaulted to ``is_nextn=False`` and went to the main
    model's layers; and GLM's draft is its own class (0.5.16+), which the hook did not replace at all."""
    weights = make_served(tmp_path)
    import glm_pack.runtime.engines.sglang as module

    monkeypatch.setenv(common.ENV, "1")
    for draft in module.EntryClass[1:]:
        model = draft(GEOM, weights, layers=LAYERS, nextn_layer=1)
        model.config.num_hidden_layers = 1  # the draft's layer id: the one after the main model's last
        model.post_load_weights()
        assert model.rebuilt == [], draft.__name__  # from the overlay, not SGLang's rebuild
        ref = sglang_mla.SelfAttn(GEOM, weights[kv_b_name(1)])
        ref.rebuild(fp4=True)
        assert torch.equal(model.model.decoder.self_attn.w_kc, ref.w_kc), draft.__name__
        common._OPEN.clear()


def test_tp_rank_and_size_come_from_the_serving_sglang(fake_sglang, monkeypatch):
    """SGLang 0.5.16+ has no ``dp_attention.get_attention_tp_rank`` and 0.5.20+ retires ``get_global_server_args``
    (it raises): the hook imported the former, so every overlay start failed with an ImportError."""
    args, rank, size = sglang.serving_context()
    assert (rank, size) == (0, 1) and args.model_path
    if fake_sglang == "runtime_context":
        parallel = types.SimpleNamespace(attn_tp_rank=3, attn_tp_size=4)
        monkeypatch.setattr(sys.modules["sglang.srt.runtime_context"], "get_parallel", lambda: parallel)
        assert sglang.serving_context()[1:] == (3, 4)


def test_fp8_block_size_comes_from_the_linear_quant_method_first(tmp_path):
    """SGLang's ``_resolve_layer_weight_block_size``: the kv_b_proj's quant method's block size where it has one
    (None there means per channel), else ``linear_fp8_config``'s, else the model quant config's."""
    method = types.SimpleNamespace(weight_block_size=[64, 32])
    config = types.SimpleNamespace(weight_block_size=[128, 128], linear_fp8_config=None)
    assert sglang.fp8_block(types.SimpleNamespace(quant_method=method), config) == (64, 32)
    per_channel = types.SimpleNamespace(weight_block_size=None)
    assert sglang.fp8_block(types.SimpleNamespace(quant_method=per_channel), config) is None
    assert sglang.fp8_block(types.SimpleNamespace(quant_method=object()), config) == (128, 128)
    config.linear_fp8_config = types.SimpleNamespace(weight_block_size=[32, 32])
    assert sglang.fp8_block(types.SimpleNamespace(), config) == (32, 32)


def test_an_fp8_kv_b_proj_with_both_scale_names_is_read_with_weight_scale():
    """SGLang's rebuild reads ``weight_scale`` where a linear has it and ``weight_scale_inv`` only otherwise."""
    linear = types.SimpleNamespace(
        weight=torch.ones(4, 4).to(torch.float8_e4m3fn),
        weight_scale=torch.full((4,), 2.0),
        weight_scale_inv=torch.full((4,), 8.0),
    )
    assert torch.equal(sglang.loaded_kv_b(linear, None), torch.full((4, 4), 2.0))


def test_ue8m0_scales_in_uint8_are_read_as_sglang_reads_them(tmp_path):
    """After SGLang requantized kv_b_proj's scales to UE8M0 exponents in uint8 (a reload), they are 2**(e - 127):
    read raw, the slice check compared garbage and refused the right slice."""
    block = (32, 32)
    weights, scales = make_served_fp8(tmp_path, block)
    name = kv_b_name(0)
    exponents = torch.frexp(scales[name])[1] - 1  # scales that are powers of two: exactly representable in UE8M0
    pow2 = torch.ldexp(torch.ones_like(scales[name]), exponents)
    fp8_weight = weights[name]
    linear = types.SimpleNamespace(weight=fp8_weight, weight_scale_inv=(exponents + 127).to(torch.uint8))
    linear.weight_scale_inv.format_ue8m0 = True
    config = types.SimpleNamespace(weight_block_size=list(block), linear_fp8_config=None)
    got = sglang.loaded_kv_b(linear, config)
    want = fp8_weight.float() * pow2.repeat_interleave(32, 0).repeat_interleave(32, 1)[: fp8_weight.shape[0]]
    assert torch.equal(got, want)
    linear.weight_scale_inv = pow2.clone()
    linear.weight_scale_inv.format_ue8m0 = True  # float UE8M0 scales: DeepGEMM's layout, not read here
    assert sglang.loaded_kv_b(linear, config) is None
