"""vLLM adapter against a stand-in of vLLM's MLAAttention (vLLM cannot be installed here; see
engine_standins/__init__.py): the overlay's attributes must be what the engine's own rebuild makes and
give the same decode projections; mismatching overlays must be refused clearly."""

from __future__ import annotations

import builtins
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from engine_standins import aiter_functions, ragged_k_bug, sglang_mla, transposed_store_bug, vllm_mla
from engine_standins.overlay_fixture import GEOM, LAYERS, kv_b_name, make_served, make_served_fp8

from glm_pack.convert.formats import encode_fp8_block
from glm_pack.packing.errors import BackendError, GlmPackError, VerifyError
from glm_pack.packing.mxfp4 import dequantize, quantize
from glm_pack.runtime.backends import aiter_backend
from glm_pack.runtime.engines import common, vllm

P, L, V, R = GEOM.qk_nope_head_dim, GEOM.kv_lora_rank, GEOM.v_head_dim, GEOM.qk_rope_head_dim


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    common._OPEN.clear()
    common._KUP_CHECKED.clear()
    aiter = aiter_functions(vllm_mla.batched_gemm_a16wfp4, "a16wfp4")
    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: aiter)
    vllm_mla.REBUILDS.clear()
    vllm_mla.PACKED.clear()
    yield
    common._OPEN.clear()


def overlay(root, *, tp_rank=0, tp_size=1, level="full"):
    return common.open_overlay(str(root), root, tp_rank=tp_rank, tp_size=tp_size, device="cpu", level=level)


def engine_pair(weights, layer, *, fp4, tp_rank=0, tp_size=1):
    """(layer rebuilt by the engine, fresh layer for the adapter) on the same kv_b_proj slice."""
    args = (f"model.layers.{layer}.self_attn.attn", GEOM, weights[kv_b_name(layer)])
    ref = vllm_mla.MLAAttention(*args, fp4=fp4, tp_rank=tp_rank, tp_size=tp_size)
    ref.process_weights_after_loading(torch.bfloat16)
    return ref, vllm_mla.MLAAttention(*args, fp4=fp4, tp_rank=tp_rank, tp_size=tp_size)


def decode_inputs(heads, T=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, heads, P + R, generator=g).bfloat16()
    return q, torch.randn(T, heads, L, generator=g).bfloat16()


def float_reference(kv_b, q, attn_out, heads):
    w = kv_b.double().view(heads, P + V, L)
    return torch.einsum("thp,hpl->thl", q[..., :P].double(), w[:, :P]), torch.einsum(
        "thl,hvl->thv", attn_out.double(), w[:, P:]
    ).reshape(q.shape[0], -1)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_fp4_path_attributes_and_decode_match_the_engine_rebuild(tmp_path, tp_rank, tp_size):
    weights = make_served(tmp_path)
    ref, layer = engine_pair(weights, 1, fp4=True, tp_rank=tp_rank, tp_size=tp_size)
    assert vllm.apply(layer, overlay(tmp_path, tp_rank=tp_rank, tp_size=tp_size), torch.bfloat16)
    H = GEOM.num_heads // tp_size
    for name, shape in (("W_K", (H, L, P // 2)), ("W_K_scale", (H, L, P // 32))):
        assert getattr(layer, name).shape == shape and getattr(layer, name).dtype == torch.uint8
    for name, shape in (("W_V", (H, V, L // 2)), ("W_V_scale", (H, V, L // 32))):
        assert getattr(layer, name).shape == shape and getattr(layer, name).dtype == torch.uint8
    # A BF16 source quantized with the same even rule: the overlay is byte-identical to vLLM's rebuild.
    for name in ("W_K", "W_K_scale", "W_V", "W_V_scale"):
        assert torch.equal(getattr(layer, name), getattr(ref, name)), name
    q, attn_out = decode_inputs(H)
    got, want = layer.decode(q, attn_out), ref.decode(q, attn_out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    exact = float_reference(layer.kv_b_proj.weight, q, attn_out, H)
    assert rel(got[0], exact[0]) < 0.2 and rel(got[1], exact[1]) < 0.2  # MXFP4 weights and activations


def test_bf16_policy_gives_the_torch_bmm_attributes(tmp_path):
    weights = make_served(tmp_path, policy="bf16")
    ref, layer = engine_pair(weights, 0, fp4=True)
    ref_bf16, _ = engine_pair(weights, 0, fp4=False)
    vllm.apply(layer, overlay(tmp_path), torch.bfloat16)
    assert not layer.is_aiter_triton_fp4_bmm_enabled and not layer.is_aiter_triton_fp8_bmm_enabled
    assert layer.W_UK_T.shape == (GEOM.num_heads, P, L) and layer.W_UK_T.dtype == torch.bfloat16
    assert layer.W_UV.shape == (GEOM.num_heads, L, V) and layer.W_UV.dtype == torch.bfloat16
    assert torch.equal(layer.W_UK_T, ref_bf16.W_UK_T) and torch.equal(layer.W_UV, ref_bf16.W_UV)
    for name, latent_dim in (("W_UK_T", 2), ("W_UV", 1)):  # L varies fastest, as in vLLM's views of kv_b_proj
        assert getattr(layer, name).stride(latent_dim) == getattr(ref_bf16, name).stride(latent_dim) == 1, name
    q, attn_out = decode_inputs(GEOM.num_heads)
    got, want = layer.decode(q, attn_out), ref_bf16.decode(q, attn_out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_padded_w_kc_is_refused_with_the_fix(tmp_path):
    weights = make_served(tmp_path, k_stored=96)
    _, layer = engine_pair(weights, 0, fp4=True)
    with pytest.raises(BackendError, match="--k-pad none"):
        vllm.apply(layer, overlay(tmp_path), torch.bfloat16)


@pytest.mark.parametrize("bug", [ragged_k_bug, transposed_store_bug])
def test_an_aiter_that_gets_vllms_k_up_call_wrong_is_caught_before_any_weight_is_set(tmp_path, monkeypatch, bug):
    """vLLM calls aiter's GEMM with its default config and has it write [T, H, N] itself (transpose_bm=True):
    where the installed aiter gets that call wrong (its ragged-K bug, or a store of the transposed output through
    the plain [H, T, N] strides, which SGLang's call would not show), vLLM's own decode computes garbage, so the
    MXFP4 overlay is refused and the layer is left as it was."""
    weights = make_served(tmp_path)
    buggy = aiter_functions(bug(vllm_mla.batched_gemm_a16wfp4), "a16wfp4")
    monkeypatch.setattr(vllm_mla, "batched_gemm_a16wfp4", buggy.bmm)  # the engine's own calls get it too
    ref, _ = engine_pair(weights, 0, fp4=True)
    q, attn_out = decode_inputs(GEOM.num_heads)
    assert rel(ref.decode(q, attn_out)[0], float_reference(ref.kv_b_proj.weight, q, attn_out, GEOM.num_heads)[0]) > 0.5
    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: buggy)
    _, layer = engine_pair(weights, 0, fp4=True)
    with pytest.raises(BackendError, match=rf"gets K-up with K={P} wrong .*ragged-K bug.*--mla-precision bf16"):
        vllm.apply(layer, overlay(tmp_path), torch.bfloat16)
    assert getattr(layer, "W_K", None) is None


def test_the_k_up_check_caches_each_output_layout_on_its_own(tmp_path, monkeypatch):
    """One process checking SGLang's call ([H, T, N] output) and then vLLM's (transpose_bm=True, [T, H, N]): an aiter
    wrong only for the transposed store passes the first and is still refused for the second."""
    make_served(tmp_path)
    buggy = aiter_functions(transposed_store_bug(vllm_mla.batched_gemm_a16wfp4), "a16wfp4")
    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: buggy)
    kc = overlay(tmp_path).model.mla(0).w_kc
    common.check_engine_kup(kc, "sglang", 0)
    with pytest.raises(BackendError, match=rf"layer 0: .* as vllm calls it .*K={P} wrong .*wrong strides"):
        common.check_engine_kup(kc, "vllm", 0, transpose_bm=True)


@pytest.mark.parametrize("transpose_bm", [False, True])
def test_an_aiter_whose_k_up_output_holds_nan_is_refused(tmp_path, monkeypatch, transpose_bm):
    """The check's error of an output holding NaN is NaN: it was dropped by a running ``max`` (which keeps 0.0 over
    NaN), so an aiter writing NaN passed the check."""
    make_served(tmp_path)

    def one_nan(x, w, w_scales, *args, y=None, **kwargs):
        vllm_mla.batched_gemm_a16wfp4(x, w, w_scales, *args, y=y, **kwargs)
        y[-1, -1, -1] = float("nan")

    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: aiter_functions(one_nan, "a16wfp4"))
    with pytest.raises(
        BackendError, match=rf"layer 0: .*gets K-up with K={P} wrong \(max \|y - ref\| / max \|ref\| = nan"
    ):
        common.check_engine_kup(overlay(tmp_path).model.mla(0).w_kc, "vllm", 0, transpose_bm=transpose_bm)


def test_a_reload_of_another_layout_binds_the_new_tensor():
    """``assign`` copies into the tensor a module already holds only where shape, strides, dtype and device all
    match: a tensor of other strides (vLLM's W_UV is a view of kv_b_proj.weight) is replaced, not written through."""
    weight = torch.zeros(2, 4, 3)
    module = types.SimpleNamespace(w=weight.transpose(1, 2))
    value = torch.randn(2, 3, 4)
    common.assign(module, "w", value)
    assert module.w is value and not weight.any()
    same = torch.randn(2, 3, 4)
    common.assign(module, "w", same)
    assert module.w is value and torch.equal(value, same)  # same layout: copied in place


def test_an_old_aiter_wheel_writes_vllms_output_layout_through_a_transposed_view(tmp_path, monkeypatch):
    """aiter's older batched_gemm_afp4wfp4_pre_quant has no transpose_bm: a [T, H, N] output is passed to it as its
    [H, T, N] transposed view (notes/aiter-contract.md), so the check of vLLM's call runs on such a wheel, and a
    correct one passes."""
    make_served(tmp_path)
    outputs = []

    def old_wheel(x, w, w_scales, dtype, y):
        outputs.append(y)
        sglang_mla.batched_gemm_afp4wfp4_pre_quant(x, w, w_scales, dtype, y)

    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: aiter_functions(old_wheel, "pre_quant"))
    common.check_engine_kup(overlay(tmp_path).model.mla(0).w_kc, "vllm", 0, transpose_bm=True)
    assert [y.shape for y in outputs] == [(GEOM.num_heads, t, L) for t in common.KUP_CHECK_TOKENS]
    assert all(y.transpose(0, 1).is_contiguous() and not y.is_contiguous() for y in outputs)


def test_the_aiter_k_up_check_runs_once_per_shape_and_not_for_bf16(tmp_path, monkeypatch):
    weights = make_served(tmp_path)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("config", "none given"))
        return vllm_mla.batched_gemm_a16wfp4(*args, **kwargs)

    monkeypatch.setattr(aiter_backend, "load_aiter", lambda: aiter_functions(counted, "a16wfp4"))
    for layer_id in LAYERS:
        _, layer = engine_pair(weights, layer_id, fp4=True)
        assert vllm.apply(layer, overlay(tmp_path), torch.bfloat16)
    assert calls == [None] * len(common.KUP_CHECK_TOKENS)  # the engine's default config, once for both layers
    bf16_root = tmp_path / "bf16"
    bf16_root.mkdir()
    weights = make_served(bf16_root, policy="bf16")
    common._KUP_CHECKED.clear()
    _, layer = engine_pair(weights, 0, fp4=True)
    assert vllm.apply(layer, overlay(bf16_root), torch.bfloat16) and len(calls) == len(common.KUP_CHECK_TOKENS)


def test_mxfp4_overlay_needs_the_fp4_path(tmp_path):
    weights = make_served(tmp_path)
    _, layer = engine_pair(weights, 0, fp4=False)
    with pytest.raises(BackendError, match="FP4 BMM path"):
        vllm.apply(layer, overlay(tmp_path), torch.bfloat16)


def test_other_checkpoint_config_is_refused(tmp_path):
    make_served(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_theta"] = 1.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(VerifyError, match="config.json differs") as err:
        overlay(tmp_path)
    assert "config.json" in str(err.value)


def test_a_served_config_that_cannot_be_read_is_refused_by_name(tmp_path, refuse):
    """The served config.json hashed against the overlay's record cannot be read (a permission, an I/O error): a
    VerifyError naming it (it was the raw OSError, failing the engine's start-up with a traceback)."""
    make_served(tmp_path)
    config = tmp_path / "config.json"
    refuse(builtins, "open", config)
    with pytest.raises(VerifyError) as err:
        overlay(tmp_path)
    assert str(err.value) == f"cannot read: Permission denied (file {config})"


def test_changed_kv_b_tensor_is_refused(tmp_path):
    weights = make_served(tmp_path)
    from safetensors.torch import save_file

    changed = dict(weights)
    changed[kv_b_name(1)] = (weights[kv_b_name(1)].float() * -1).bfloat16()
    save_file(changed, str(tmp_path / "model-00001-of-00001.safetensors"))
    with pytest.raises(VerifyError, match="tensor differs") as err:
        overlay(tmp_path, level="full")
    assert kv_b_name(1) in str(err.value)
    # Without hashing, the per-layer comparison with the engine's loaded weight still catches it.
    _, layer = engine_pair(changed, 1, fp4=True)
    with pytest.raises(VerifyError, match="layer 1 w_kc"):
        vllm.apply(layer, overlay(tmp_path, level="fast"), torch.bfloat16)


def test_served_index_without_a_source_tensor_is_refused(tmp_path):
    make_served(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][kv_b_name(1)]
    index_path.write_text(json.dumps(index))
    with pytest.raises(VerifyError, match="index lacks a source tensor") as err:
        overlay(tmp_path, level="full")
    assert kv_b_name(1) in str(err.value)


def test_each_rank_of_one_process_gets_its_own_slice(tmp_path):
    make_served(tmp_path)
    full = overlay(tmp_path).model.mla(0).w_vc.weight  # [heads, ...]
    ranks = [overlay(tmp_path, tp_rank=r, tp_size=2) for r in (0, 1)]
    assert ranks[0] is overlay(tmp_path, tp_rank=0, tp_size=2)  # opened once per rank
    half = full.shape[0] // 2
    assert torch.equal(ranks[0].model.mla(0).w_vc.weight, full[:half])
    assert torch.equal(ranks[1].model.mla(0).w_vc.weight, full[half:])


def test_wrong_tp_slice_and_tp_size_are_refused(tmp_path):
    weights = make_served(tmp_path)
    _, layer = engine_pair(weights, 0, fp4=True, tp_rank=0, tp_size=2)
    with pytest.raises(VerifyError, match="tensor-parallel slice"):
        vllm.apply(layer, overlay(tmp_path, tp_rank=1, tp_size=2), torch.bfloat16)
    common._OPEN.clear()
    with pytest.raises(VerifyError, match="geometry per rank"):
        vllm.apply(layer, overlay(tmp_path, tp_rank=0, tp_size=1), torch.bfloat16)


def test_layer_index_from_vllm_prefix():
    assert vllm.layer_index("model.layers.78.self_attn.attn") == 78
    assert vllm.layer_index("language_model.model.layers.3.self_attn.mla_attn") == 3


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM's import paths the plugin uses, served by the stand-in (vLLM 0.33's MLAAttention)."""
    return serve_fake_vllm(monkeypatch, vllm_mla.MLAAttention)


@pytest.fixture
def fake_vllm_034(monkeypatch):
    """The same with vLLM 0.34's MLAAttention (its hook takes no dtype)."""
    return serve_fake_vllm(monkeypatch, vllm_mla.MLAAttention034)


def serve_fake_vllm(monkeypatch, base: type) -> type:
    class MLAAttention(base):
        pass

    mods = {
        "vllm": types.ModuleType("vllm"),
        "vllm.model_executor.layers.attention.mla_attention": types.SimpleNamespace(MLAAttention=MLAAttention),
        "vllm.model_executor.layers.attention.attention": vllm_mla,
        "vllm.model_executor.layers.quantization.utils.quant_utils": vllm_mla,
        "vllm.distributed": types.SimpleNamespace(
            get_tensor_model_parallel_rank=lambda: 0, get_tensor_model_parallel_world_size=lambda: 1
        ),
        "vllm.distributed.parallel_state": vllm_mla,
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return MLAAttention


def test_a_vllm_with_mla_bmm_objects_is_refused_by_name(tmp_path):
    """A vLLM whose forward reads kv_b_proj.mla_bmm (vLLM pull request 55741's layout) has no aiter flags on the
    layer: one line naming the layer and what to do, not an AttributeError, and nothing set."""
    weights = make_served(tmp_path)
    layer = vllm_mla.MLAAttention("model.layers.0.self_attn.attn", GEOM, weights[kv_b_name(0)], fp4=True)
    layer.kv_b_proj.mla_bmm = None
    del layer.is_aiter_triton_fp4_bmm_enabled
    with pytest.raises(BackendError, match=r"model\.layers\.0\.self_attn\.attn: .*kv_b_proj\.mla_bmm.*unset GLM_"):
        vllm.apply(layer, overlay(tmp_path), torch.bfloat16)
    assert getattr(layer, "W_K", None) is None


def test_a_vllm_whose_mla_layer_holds_no_kv_b_proj_is_refused_by_name(tmp_path, fake_vllm, monkeypatch):
    """Before 0.16 vLLM's attention backend held kv_b_proj and built the absorbed weights itself: one line with the
    version needed, not an AttributeError from inside vLLM's loader."""
    weights = make_served(tmp_path)
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    (layer, _) = plugin_layers(fake_vllm, weights, tmp_path)
    del layer.kv_b_proj
    with pytest.raises(BackendError, match=r"model\.layers\.0\.self_attn\.attn: .*vLLM 0\.16 or later.*unset GLM_PACK"):
        layer.process_weights_after_loading(torch.bfloat16)
    assert getattr(layer, "W_K", None) is None and vllm_mla.REBUILDS == []


def test_vllm_0_16_and_0_17_give_the_model_config_through_the_current_config(tmp_path, fake_vllm, monkeypatch):
    """vLLM 0.16-0.17's MLAAttention keeps no ``_vllm_config``; their GPU worker loads the model inside
    ``set_current_vllm_config``, so the served model is read from there (it was an AttributeError)."""
    weights = make_served(tmp_path)
    current = types.SimpleNamespace(model_config=types.SimpleNamespace(model=str(tmp_path), revision=None))
    monkeypatch.setitem(sys.modules, "vllm.config", types.SimpleNamespace(get_current_vllm_config=lambda: current))
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    (layer, _) = plugin_layers(fake_vllm, weights, tmp_path)
    del layer._vllm_config
    layer.process_weights_after_loading(torch.bfloat16)
    ref, _ = engine_pair(weights, 0, fp4=True)
    assert torch.equal(layer.W_K, ref.W_K) and vllm_mla.REBUILDS == [ref.layer_name]  # the reference's rebuild alone


def test_a_vllm_before_0_16_is_refused_when_the_plugin_loads(monkeypatch):
    """vLLM 0.15 has no MLAAttention in mla_attention.py: the plugin says which vLLM it needs (an ImportError)."""
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.attention.mla_attention", types.SimpleNamespace())
    monkeypatch.setenv(common.ENV, "1")
    with pytest.raises(BackendError, match=r"needs vLLM 0\.16 or later .*unset GLM_PACK_OVERLAY"):
        vllm.register()


# GLM_PACK_OVERLAY's values (common.py's docstring, README "Serving"): off, the overlay beside the served checkpoint, or
# the directory that holds glm-pack/; the words are read stripped and in any case, a directory as it is (stripped).
OVERLAY_OFF = ["", "0", "false", "off", "no", " Off ", "FALSE", "\t0\n"]
OVERLAY_BESIDE = ["1", "true", "on", "yes", "auto", " Yes ", "TRUE", "Auto"]
OVERLAY_DIRECTORY = [
    ("/models/GLM-5-packed", "/models/GLM-5-packed"),
    (" /models/Packed \n", "/models/Packed"),  # stripped, its case kept
    ("./auto", "./auto"),  # a folder named like a word
    ("packed", "packed"),
    ("2", "2"),  # no word: a directory
]


def set_env(monkeypatch, name, value):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    "value, setting",
    [(None, None), *((v, None) for v in OVERLAY_OFF), *((v, "beside") for v in OVERLAY_BESIDE), *OVERLAY_DIRECTORY],
)
def test_overlay_variable_selects_off_beside_or_a_directory(monkeypatch, tmp_path, value, setting):
    assert common.overlay_setting({} if value is None else {common.ENV: value}) == setting
    set_env(monkeypatch, common.ENV, value)
    assert common.overlay_setting() == setting  # from the process environment, as the adapters read it
    served = tmp_path / "served"
    if setting == "beside":
        assert common.overlay_root(setting, served) == served
    elif setting is not None:
        assert common.overlay_root(setting, served) == Path(value.strip())


@pytest.mark.parametrize("value", [None, *OVERLAY_OFF])
def test_plugin_is_inert_without_the_variable(fake_vllm, monkeypatch, value):
    set_env(monkeypatch, common.ENV, value)
    original = fake_vllm.process_weights_after_loading
    vllm.register()
    assert fake_vllm.process_weights_after_loading is original


@pytest.mark.parametrize("value", [*OVERLAY_BESIDE, *(v for v, _ in OVERLAY_DIRECTORY)])
def test_plugin_routes_the_weights_through_the_overlay_when_the_variable_selects_one(fake_vllm, monkeypatch, value):
    monkeypatch.setenv(common.ENV, value)
    original = fake_vllm.process_weights_after_loading
    vllm.register()
    assert fake_vllm.process_weights_after_loading is vllm._process_weights_after_loading is not original


CHECK_LEVELS = [(None, "full"), ("", "full"), (" ", "full"), ("full", "full"), ("Full", "full")]
CHECK_LEVELS += [("fast", "fast"), (" FAST\n", "fast")]


@pytest.mark.parametrize("value, level", CHECK_LEVELS)
def test_check_variable_levels(monkeypatch, value, level):
    """GLM_PACK_OVERLAY_CHECK: full (the default: unset or empty) or fast, stripped and in any case."""
    assert common.check_level({} if value is None else {common.ENV_CHECK: value}) == level
    set_env(monkeypatch, common.ENV_CHECK, value)
    assert common.check_level() == level


@pytest.mark.parametrize("value", ["slow", "none", "0", "off", "fast,full"])
def test_check_variable_refuses_any_other_value(monkeypatch, value):
    """No value turns the check off or is taken for another: one line naming the variable, its value and the choices."""
    monkeypatch.setenv(common.ENV_CHECK, value)
    with pytest.raises(GlmPackError) as err:
        common.check_level()
    assert str(err.value) == f"GLM_PACK_OVERLAY_CHECK={value!r} is not one of full, fast"


@pytest.mark.parametrize("check", ["full", "fast", "slow"])
def test_the_check_variable_reaches_the_plugin(tmp_path, fake_vllm, monkeypatch, check):
    """A served kv_b_proj changed after conversion: under `full` the source hash refuses it when the overlay opens,
    under `fast` (no hashing) the comparison with the engine's loaded slice; any other value stops the load."""
    weights = make_served(tmp_path)
    from safetensors.torch import save_file

    changed = dict(weights)
    changed[kv_b_name(1)] = (weights[kv_b_name(1)].float() * -1).bfloat16()
    save_file(changed, str(tmp_path / "model-00001-of-00001.safetensors"))
    monkeypatch.setenv(common.ENV, "1")
    monkeypatch.setenv(common.ENV_CHECK, check)
    vllm.register()
    (_, layer) = plugin_layers(fake_vllm, changed, tmp_path)
    says = {"full": "tensor differs", "fast": "layer 1 w_kc", "slow": "GLM_PACK_OVERLAY_CHECK='slow' is not one of"}
    with pytest.raises(VerifyError if check != "slow" else GlmPackError, match=says[check]):
        layer.process_weights_after_loading(torch.bfloat16)
    assert getattr(layer, "W_K", None) is None and vllm_mla.REBUILDS == []


def test_plugin_loads_overlay_layers_and_rebuilds_the_rest(tmp_path, fake_vllm, monkeypatch):
    weights = make_served(tmp_path)
    manifest = tmp_path / "glm-pack" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["mla"] = [e for e in data["mla"] if e["layer"] == 1]  # overlay for layer 1 only
    manifest.write_text(json.dumps(data))
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    vllm.register()  # idempotent
    layers = [
        fake_vllm(f"model.layers.{i}.self_attn.attn", GEOM, weights[kv_b_name(i)], fp4=True, model=tmp_path)
        for i in (0, 1)
    ]
    for layer in layers:
        layer.process_weights_after_loading(torch.bfloat16)
    assert vllm_mla.REBUILDS == ["model.layers.0.self_attn.attn"]
    assert all(layer.default_scales_set for layer in layers)
    ref, _ = engine_pair(weights, 1, fp4=True)
    assert torch.equal(layers[1].W_K, ref.W_K) and torch.equal(layers[1].W_V_scale, ref.W_V_scale)


def plugin_layers(fake_vllm, weights, root, *, fp4=True, **flags):
    """One fake_vllm layer per served layer, with ``flags`` (e.g. ``dcp_q_replicate=True``) set on each."""
    layers = [
        fake_vllm(f"model.layers.{i}.self_attn.attn", GEOM, weights[kv_b_name(i)], fp4=fp4, model=root) for i in (0, 1)
    ]
    for layer in layers:
        for name, value in flags.items():
            setattr(layer, name, value)
    return layers


def test_the_backend_packs_its_own_weights_first_as_in_vllm(tmp_path, fake_vllm, monkeypatch):
    """vLLM 0.29+ lets the attention backend's impl pack its weights before the MLA rebuild; the plugin skipped that
    step for overlay layers (a no-op but on AMX today). Each layer's impl packs once, overlay or not."""
    weights = make_served(tmp_path)
    manifest = tmp_path / "glm-pack" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["mla"] = [e for e in data["mla"] if e["layer"] == 1]
    manifest.write_text(json.dumps(data))
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    for layer in plugin_layers(fake_vllm, weights, tmp_path):
        layer.process_weights_after_loading(torch.bfloat16)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert vllm_mla.PACKED == names and vllm_mla.REBUILDS == names[:1]


def test_amx_layers_are_left_to_vllm_with_a_warning(tmp_path, fake_vllm, monkeypatch, caplog):
    """AMX (vLLM's CPU MLA) decodes from weights its impl packs from kv_b_proj: the overlay's would go unread."""
    weights = make_served(tmp_path, policy="bf16")
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    layers = plugin_layers(fake_vllm, weights, tmp_path, fp4=False, is_amx_bmm_enabled=True)
    with caplog.at_level("WARNING", logger="glm_pack.vllm"):
        for layer in layers:
            layer.process_weights_after_loading(torch.bfloat16)
    assert vllm_mla.REBUILDS == [layer.layer_name for layer in layers] == vllm_mla.PACKED
    assert "AMX" in caplog.text and "the overlay is not used" in caplog.text


def test_dcp_query_replication_gathers_the_overlays_w_uk_t(tmp_path, fake_vllm, monkeypatch):
    """vLLM 0.27+'s decode context parallelism with query replication reads W_UK_T_dcp_qrep, W_UK_T gathered over
    the DCP group; the plugin left it None, on which vLLM's decode asserts."""
    weights = make_served(tmp_path, policy="bf16")
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    (layer, _) = plugin_layers(fake_vllm, weights, tmp_path, fp4=False, dcp_q_replicate=True)
    layer.process_weights_after_loading(torch.bfloat16)
    ref = vllm_mla.MLAAttention("model.layers.0.self_attn.attn", GEOM, weights[kv_b_name(0)], fp4=False)
    ref.dcp_q_replicate = True
    ref.process_weights_after_loading(torch.bfloat16)
    assert vllm_mla.REBUILDS == [ref.layer_name]  # the reference's alone: the plugin's layer came from the overlay
    assert layer.W_UK_T_dcp_qrep.shape == (vllm_mla.DCP_WORLD * GEOM.num_heads, P, L)
    assert torch.equal(layer.W_UK_T_dcp_qrep, ref.W_UK_T_dcp_qrep)


def test_dcp_query_replication_with_an_mxfp4_overlay_is_refused(tmp_path, fake_vllm, monkeypatch):
    """vLLM raises NotImplementedError for DCP query replication on its FP4 path: the plugin says it in one line."""
    weights = make_served(tmp_path)
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    (layer, _) = plugin_layers(fake_vllm, weights, tmp_path, dcp_q_replicate=True)
    says = r"model\.layers\.0\.self_attn\.attn: .*DCP query replication.*--mla-precision bf16"
    with pytest.raises(BackendError, match=says):
        layer.process_weights_after_loading(torch.bfloat16)


def test_dcp_query_replication_with_head_padding_is_refused(tmp_path, fake_vllm, monkeypatch):
    """vLLM asserts that DCP query replication runs without head padding: the plugin says it in one line."""
    weights = make_served(tmp_path, policy="bf16")
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    flags = {"dcp_q_replicate": True, "q_pad_num_heads": 2 * GEOM.num_heads}
    (layer, _) = plugin_layers(fake_vllm, weights, tmp_path, fp4=False, **flags)
    with pytest.raises(BackendError, match=r"model\.layers\.0\.self_attn\.attn: .*DCP query replication with head pad"):
        layer.process_weights_after_loading(torch.bfloat16)


def overlay_of_layer_1(tmp_path, **served):
    """A served checkpoint whose overlay holds layer 1 alone (layer 0 is left to vLLM's rebuild)."""
    weights = make_served(tmp_path, **served)
    manifest = tmp_path / "glm-pack" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["mla"] = [e for e in data["mla"] if e["layer"] == 1]
    manifest.write_text(json.dumps(data))
    return weights


@pytest.mark.parametrize("policy", ["mxfp4", "bf16"])
def test_vllm_0_34_calls_the_hook_without_a_dtype(tmp_path, fake_vllm_034, monkeypatch, policy):
    """vLLM 0.34 calls ``process_weights_after_loading()`` with no argument and keeps the dtype on the layer as
    ``act_dtype``: the plugin's hook, which required the dtype, raised a TypeError on every MLA layer. Overlay layers
    now load from the overlay, the others run vLLM's own rebuild, called without the dtype it no longer takes."""
    weights = overlay_of_layer_1(tmp_path, policy=policy)
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    layers = plugin_layers(fake_vllm_034, weights, tmp_path, fp4=policy == "mxfp4")
    for layer in layers:
        layer.process_weights_after_loading()
    names = [layer.layer_name for layer in layers]
    assert vllm_mla.PACKED == names and vllm_mla.REBUILDS == names[:1]
    ref, _ = engine_pair(weights, 1, fp4=policy == "mxfp4")
    q, attn_out = decode_inputs(GEOM.num_heads)
    got, want = layers[1].decode(q, attn_out), ref.decode(q, attn_out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(layer.default_scales_set for layer in layers)


@pytest.mark.parametrize("fused, policy", [(True, "bf16"), (False, "bf16"), (True, "mxfp4")])
def test_dcp_fused_v_up_gets_the_overlays_w_uv_gathered(tmp_path, fake_vllm_034, monkeypatch, fused, policy):
    """vLLM 0.34's DCP decode fuses the V-up with its combine where ``dcp_manager.v_up_proj_combine`` is set, reading
    W_UV gathered over the DCP group (``W_UV_dcp``), which it builds on its torch.bmm path: the plugin left it None
    (vLLM then took its unfused V-up). It is now what vLLM's rebuild gathers, and None where vLLM keeps it None (on
    its FP4 path too, which has no W_UV to gather)."""
    fp4 = policy == "mxfp4"
    weights = make_served(tmp_path, policy=policy)
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    (layer, _) = plugin_layers(fake_vllm_034, weights, tmp_path, fp4=fp4, dcp_manager=vllm_mla.DcpManager(fused))
    layer.process_weights_after_loading()
    ref = vllm_mla.MLAAttention034(layer.layer_name, GEOM, weights[kv_b_name(0)], fp4=fp4)
    ref.dcp_manager = vllm_mla.DcpManager(fused)
    ref.process_weights_after_loading()
    assert vllm_mla.REBUILDS == [ref.layer_name]  # the reference's alone
    if fp4:
        assert layer.W_UV_dcp is None and ref.W_UV_dcp is None and torch.equal(layer.W_K, ref.W_K)
    elif fused:
        assert layer.W_UV_dcp.shape == (vllm_mla.DCP_WORLD * GEOM.num_heads, L, V)
        assert torch.equal(layer.W_UV_dcp, ref.W_UV_dcp)
    else:
        assert layer.W_UV_dcp is None and ref.W_UV_dcp is None


@pytest.mark.parametrize("policy", ["mxfp4", "bf16"])
def test_a_reload_writes_the_absorbed_weights_in_place(tmp_path, fake_vllm, monkeypatch, policy):
    """vLLM's reload (``reload_weights``, a wake from level-2 sleep) runs the hook again, and its own rebuild copies
    into the existing tensors (``replace_parameter``) so CUDA graphs captured on their memory stay valid: the plugin
    bound new tensors (W_UK_T a fresh copy each time), leaving captured graphs reading freed memory. A reload now
    keeps every tensor's memory and gives the same values."""
    weights = make_served(tmp_path, policy=policy)
    monkeypatch.setenv(common.ENV, "1")
    vllm.register()
    (layer, _) = plugin_layers(fake_vllm, weights, tmp_path, fp4=policy == "mxfp4")
    layer.process_weights_after_loading(torch.bfloat16)
    names = ("W_K", "W_K_scale", "W_V", "W_V_scale") if policy == "mxfp4" else ("W_UK_T", "W_UV")
    first = {name: (getattr(layer, name).data_ptr(), getattr(layer, name).clone()) for name in names}
    common._OPEN.clear()  # the reload reopens the overlay: new tensors, to be copied into the old ones
    layer.process_weights_after_loading(torch.bfloat16)
    for name, (pointer, values) in first.items():
        assert getattr(layer, name).data_ptr() == pointer and torch.equal(getattr(layer, name), values), name


def test_a_kv_b_proj_without_a_weight_skips_the_slice_check_with_a_warning(tmp_path, caplog):
    """An AWQ or GPTQ kv_b_proj keeps ``qweight`` (compressed tensors: ``weight_packed``) and no ``weight``: the
    adapter read ``weight`` and raised an AttributeError; as the README says, the slice check is skipped with a
    warning and the overlay's weights are set."""
    weights = make_served(tmp_path, policy="bf16")
    ref, layer = engine_pair(weights, 0, fp4=False)
    layer.kv_b_proj = types.SimpleNamespace(qweight=torch.zeros(L, 8, dtype=torch.int32))
    with caplog.at_level("WARNING", logger="glm_pack.engines"):
        assert vllm.apply(layer, overlay(tmp_path), torch.bfloat16)
    assert "kv_b_proj is in a form glm-pack cannot read; its slice is not checked" in caplog.text
    assert torch.equal(layer.W_UK_T, ref.W_UK_T) and torch.equal(layer.W_UV, ref.W_UV)
    assert vllm.stored_kv_b(layer.kv_b_proj) is layer.kv_b_proj.qweight
    with pytest.raises(BackendError, match="kv_b_proj holds none of weight, qweight, weight_packed"):
        vllm.stored_kv_b(types.SimpleNamespace())


def test_a_hub_id_missing_from_the_cache_says_what_helps(tmp_path, fake_vllm, monkeypatch):
    """A model served by Hub id that is not in the local HF cache: the overlay cannot be checked against the served
    files, whatever GLM_PACK_OVERLAY selects (a directory too), so the one line says to download it or serve the
    local directory (it said to set GLM_PACK_OVERLAY to the overlay's directory, which fails the same way)."""
    weights = make_served(tmp_path / "ckpt")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv(common.ENV, str(tmp_path / "ckpt"))  # the directory holding glm-pack/
    vllm.register()
    layer = fake_vllm("model.layers.0.self_attn.attn", GEOM, weights[kv_b_name(0)], fp4=True, model="org/not-cached")
    with pytest.raises(GlmPackError, match="cannot find the checkpoint 'org/not-cached' locally") as err:
        layer.process_weights_after_loading(torch.bfloat16)
    assert common.ENV not in str(err.value) and "serve the checkpoint from its local directory" in str(err.value)
    served = fake_vllm("model.layers.0.self_attn.attn", GEOM, weights[kv_b_name(0)], fp4=True, model=tmp_path / "ckpt")
    served.process_weights_after_loading(torch.bfloat16)  # the advice: the local directory is served and checked
    assert served.default_scales_set and vllm_mla.REBUILDS == []


def test_fp8_kv_b_proj_is_dequantized_by_vllm_for_the_slice_check(tmp_path, fake_vllm):
    """An FP8 block-scaled kv_b_proj (vLLM then takes its torch.bmm path: a BF16-policy overlay) is compared
    through vLLM's own dequantization: the right rank's slice passes, another rank's is refused."""
    block = (32, 32)
    weights, scales = make_served_fp8(tmp_path, block)
    name = kv_b_name(1)
    for rank in (0, 1):
        ref = fake_vllm(name.removesuffix(".kv_b_proj.weight") + ".attn", GEOM, weights[name], fp4=True,
                        tp_rank=rank, tp_size=2, fp8=(scales[name], block))  # fmt: skip
        layer = fake_vllm(ref.layer_name, GEOM, weights[name], fp4=True, tp_rank=rank, tp_size=2,
                          fp8=(scales[name], block))  # fmt: skip
        assert not layer.is_aiter_triton_fp4_bmm_enabled  # vLLM's FP4 path needs a BF16 kv_b_proj
        ref.process_weights_after_loading(torch.bfloat16)
        assert vllm.apply(layer, overlay(tmp_path, tp_rank=rank, tp_size=2), torch.bfloat16)
        assert torch.equal(layer.W_UK_T, ref.W_UK_T) and torch.equal(layer.W_UV, ref.W_UV)
        common._OPEN.clear()
        with pytest.raises(VerifyError, match="tensor-parallel slice"):
            vllm.apply(layer, overlay(tmp_path, tp_rank=1 - rank, tp_size=2), torch.bfloat16)


def test_a_kv_b_proj_vllm_quantized_at_load_passes_the_slice_check(tmp_path, fake_vllm):
    """vLLM's online FP8 (a BF16 checkpoint served with FP8 linears) holds kv_b_proj with FP8 rounding the
    overlay's BF16 source never had: the right rank's slice passes, another rank's is still refused."""
    block = (32, 32)
    weights = make_served(tmp_path, policy="bf16")
    name = kv_b_name(1)
    fp8, scale = encode_fp8_block(weights[name].float(), block)
    for rank in (0, 1):
        layer = fake_vllm("model.layers.1.self_attn.attn", GEOM, fp8, fp4=True, tp_rank=rank, tp_size=2,
                          fp8=(scale, block))  # fmt: skip
        assert vllm.apply(layer, overlay(tmp_path, tp_rank=rank, tp_size=2), torch.bfloat16)
        common._OPEN.clear()
        with pytest.raises(VerifyError, match="tensor-parallel slice"):
            vllm.apply(layer, overlay(tmp_path, tp_rank=1 - rank, tp_size=2), torch.bfloat16)
        common._OPEN.clear()


def test_the_engine_quantization_allowance_is_only_for_a_quantized_kv_b_proj(tmp_path):
    """A BF16-policy overlay against a kv_b_proj carrying MXFP4 rounding (relative error ~0.1, the rounding an
    engine's own MXFP4 load quantization adds): allowed where the engine holds kv_b_proj quantized, refused where it
    holds it in float, where such a difference means another checkpoint (e.g. an MXFP4 release dequantized)."""
    weights = make_served(tmp_path, policy="bf16")
    kv_b = weights[kv_b_name(0)].float()
    rounded = dequantize(*quantize(kv_b, mode="even", axis=-1), axis=-1)
    assert 0.05 < rel(rounded, kv_b) < 0.2
    mla = overlay(tmp_path).model.mla(0)
    common.check_slice(mla, rounded, "kv_b_proj", engine_quantized=True)
    with pytest.raises(VerifyError, match="wrong checkpoint"):
        common.check_slice(mla, rounded, "kv_b_proj")
    _, layer = engine_pair({kv_b_name(0): rounded.bfloat16()}, 0, fp4=False)
    with pytest.raises(VerifyError, match="wrong checkpoint"):
        vllm.apply(layer, overlay(tmp_path), torch.bfloat16)
