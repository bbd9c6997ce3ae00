"""The per-layer absorb transform and the manifest schema (pure functions)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import _head_sum_squares, absorb_layer, rel_errors, store_projection
from glm_pack.packing.errors import FormatError, ManifestError, NonFiniteError, PlanError
from glm_pack.packing.mla import MlaGeometry
from glm_pack.packing.mxfp4 import dequantize, quantize

GEOM = MlaGeometry(num_heads=2, kv_lora_rank=64, qk_nope_head_dim=96, qk_rope_head_dim=32, v_head_dim=32)


def kv_b(seed=0, geom=GEOM):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(geom.kv_b_rows, geom.kv_lora_rank, generator=g) * 0.02


def rel_error(approx, ref) -> float:
    """The whole tensor's relative error (the first of ``rel_errors``)."""
    return rel_errors(approx, ref)[0]


def split_by_hand(w, geom=GEOM):
    """Row-by-row split written from the notes: head h owns rows [h*(P+V), (h+1)*(P+V)), K rows first."""
    per = geom.qk_nope_head_dim + geom.v_head_dim
    kc = torch.stack([w[h * per : h * per + geom.qk_nope_head_dim].T for h in range(geom.num_heads)])
    vc = torch.stack([w[h * per + geom.qk_nope_head_dim : (h + 1) * per] for h in range(geom.num_heads)])
    return kc, vc


def test_absorb_mxfp4_padded_matches_even_rule_on_split():
    w = kv_b()
    kc, vc = absorb_layer(w, GEOM, k_stored=128)
    ref_kc, ref_vc = split_by_hand(w)
    codes, scales = quantize(ref_kc, mode="even")
    assert kc.weight.shape == (2, 64, 64) and kc.scale.shape == (2, 64, 4)
    assert torch.equal(kc.weight[..., :48], codes) and torch.equal(kc.scale[..., :3], scales)
    assert torch.all(kc.weight[..., 48:] == 0) and torch.all(kc.scale[..., 3:] == 0x7F)
    vcodes, vscales = quantize(ref_vc, mode="even")
    assert torch.equal(vc.weight, vcodes) and torch.equal(vc.scale, vscales)
    assert kc.rel_error == pytest.approx(rel_error(dequantize(codes, scales), ref_kc))
    assert 0.05 < kc.rel_error < 0.2 and kc.precision == vc.precision == "mxfp4"


def test_absorb_uses_the_requested_scale_rule():
    w = kv_b()
    kc, vc = absorb_layer(w, GEOM, k_stored=128, quant_mode="mse")
    ref_kc, ref_vc = split_by_hand(w)
    codes, scales = quantize(ref_kc, mode="mse")
    assert not torch.equal(scales, quantize(ref_kc, mode="even")[1])  # the rules differ on this data
    assert torch.equal(kc.weight[..., :48], codes) and torch.equal(kc.scale[..., :3], scales)
    assert torch.equal(vc.scale, quantize(ref_vc, mode="mse")[1])
    assert kc.quant_mode == vc.quant_mode == "mse"


def test_absorb_bf16_policy_is_bf16_rounding_and_padded():
    w = kv_b()
    kc, vc = absorb_layer(w, GEOM, k_stored=128, policy="bf16")
    ref_kc, _ = split_by_hand(w)
    assert kc.weight.dtype == torch.bfloat16 and kc.scale is None and kc.weight.shape == (2, 64, 128)
    assert torch.equal(kc.weight[..., :96], ref_kc.bfloat16()) and torch.all(kc.weight[..., 96:] == 0)
    assert kc.rel_error < 4e-3 and kc.mxfp4_rel_error > 0.05


def test_auto_policy_keeps_outlier_heavy_tensor_in_bf16():
    w = kv_b()
    _, ref_vc = split_by_hand(w)
    # One huge element per 32-block of w_vc's rows crushes the rest of the block under MXFP4.
    rows = torch.arange(GEOM.num_heads) * (GEOM.qk_nope_head_dim + GEOM.v_head_dim) + GEOM.qk_nope_head_dim
    w[rows[:, None] + torch.arange(GEOM.v_head_dim), ::32] = 40.0
    kc, vc = absorb_layer(w, GEOM, k_stored=128, policy="auto", max_rel_error=0.15)
    assert kc.precision == "mxfp4" and vc.precision == "bf16"
    assert vc.mxfp4_rel_error > 0.15


def test_auto_keeps_mxfp4_at_an_error_equal_to_the_threshold():
    """README: auto goes to BF16 only when the MXFP4 error *exceeds* --max-rel-error (X >= 0), so with X = 0 a
    projection MXFP4 holds exactly (E2M1 grid values, a 6 in every 32-block: scale 2**0) stays MXFP4."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    g = torch.Generator().manual_seed(3)
    w = grid[torch.randint(0, 8, (2, 4, 64), generator=g)] * torch.where(torch.rand(2, 4, 64, generator=g) < 0.5, -1, 1)
    w[..., ::32] = 6.0
    kc = store_projection(w, k_stored=64, quant_mode="even", policy="auto", max_rel_error=0.0)
    assert kc.mxfp4_rel_error == 0.0 and kc.precision == "mxfp4"
    assert torch.equal(dequantize(kc.weight, kc.scale), w)
    w[0, 0, 1] = 0.7  # off the grid: any error exceeds 0
    assert store_projection(w, k_stored=64, quant_mode="even", policy="auto", max_rel_error=0.0).precision == "bf16"


def test_auto_needs_threshold_and_unknown_policy():
    with pytest.raises(PlanError, match="max-rel-error"):
        absorb_layer(kv_b(), GEOM, k_stored=128, policy="auto")
    with pytest.raises(PlanError, match="unknown MLA precision"):
        absorb_layer(kv_b(), GEOM, k_stored=128, policy="fp8")
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(PlanError, match="must be a finite number >= 0"):
            absorb_layer(kv_b(), GEOM, k_stored=128, policy="auto", max_rel_error=bad)


@pytest.mark.parametrize("policy", ["mxfp4", "bf16"])
def test_k_stored_must_be_a_multiple_of_32_under_every_policy(policy):
    with pytest.raises(FormatError, match="k_stored 112 must be a multiple of 32"):
        absorb_layer(kv_b(), GEOM, k_stored=112, policy=policy)  # >= nope 96, not a multiple of 32


def test_absorb_rejects_nan_with_index():
    w = kv_b()
    w[5, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"first at index \(5, 7\)"):
        absorb_layer(w, GEOM, k_stored=128)


@pytest.mark.parametrize("policy", ["mxfp4", "bf16"])
@pytest.mark.parametrize("row, proj", [(3, "w_kc"), (GEOM.qk_nope_head_dim + 1, "w_vc")])
def test_finite_values_near_float_max_are_refused_naming_the_projection(policy, row, proj):
    """3e38 is a legal bf16, but MXFP4 decodes it to 2**128 = Inf: the projection's MXFP4 error (recorded under
    every policy) would be Inf, which the manifest refused after every file was written, naming no tensor."""
    w = kv_b()
    w[row, 5], w[row, 6] = 3.0e38, -3.0e38
    with pytest.raises(FormatError, match=f"{proj} overflows to Inf in MXFP4.*up to 3e\\+38"):
        absorb_layer(w, GEOM, k_stored=128, policy=policy)


@pytest.mark.parametrize("policy", ["bf16", "auto"])
def test_finite_values_that_round_to_inf_in_bf16_are_refused_naming_the_projection(policy):
    """float32's maximum (2 - 2**-23) * 2**127 is finite in MXFP4 under the floor rule (scale 2**125, code 6) but
    past BF16's largest finite value (2 - 2**-7) * 2**127, so it rounds to Inf: a BF16-kept projection held Inf
    and recorded rel_error inf, which the manifest refused (allow_nan=False) after every file was written."""
    w = kv_b()[:64].reshape(2, 32, 64)
    w[1, 3, 9] = torch.finfo(torch.float32).max
    assert torch.isinf(w.bfloat16()).any()  # the premise: BF16 rounding overflows
    with pytest.raises(FormatError, match=r"w_kc overflows to Inf in BF16.*up to 3\.4e\+38"):
        store_projection(
            w,
            k_stored=64,
            quant_mode="floor",
            policy=policy,
            max_rel_error=0.0 if policy == "auto" else None,
            what="w_kc",
        )


def test_mxfp4_source_vc_bytes_kept():
    """w_vc of an MXFP4 source is its bytes, not a requantization of its values: the source is quantized with the
    roundup rule, whose bytes the run's even rule does not give back from the dequantized values (checked below), so
    keeping the bytes and requantizing tell apart (an even-quantized source requantizes to its own bytes)."""
    from glm_pack.packing.mla import split_kv_b, split_kv_b_mxfp4_vc

    w = kv_b()
    codes, scales = quantize(w, mode="roundup")  # kv_b_proj grouped along kv_lora, as Quark stores it
    src = split_kv_b_mxfp4_vc(codes, scales, GEOM)
    values = dequantize(codes, scales)
    requantized = quantize(split_kv_b(values, GEOM)[1], mode="even", axis=-1)
    assert not torch.equal(requantized[0], src[0]) and not torch.equal(requantized[1], src[1])  # the premise
    _, vc = absorb_layer(values, GEOM, k_stored=128, quant_mode="even", vc_mxfp4_source=src)
    per = GEOM.qk_nope_head_dim + GEOM.v_head_dim
    for h in range(GEOM.num_heads):
        rows = slice(h * per + GEOM.qk_nope_head_dim, (h + 1) * per)
        assert torch.equal(vc.weight[h], codes[rows]) and torch.equal(vc.scale[h], scales[rows])
    assert vc.rel_error == 0.0 and vc.quant_mode == "source"


def _manifest():
    w = kv_b()
    kc, vc = absorb_layer(w, GEOM, k_stored=128)
    tensors, entry = {}, {"layer": 0, "prefix": "model.layers.0", "source": {"tensor": "x", "format": "bf16"}}
    for name, p in (("w_kc", kc), ("w_vc", vc)):
        weight, scale = f"model.layers.0.self_attn.{name}.weight", f"model.layers.0.self_attn.{name}.weight_scale"
        entry[name] = mf.projection_entry(p, weight, scale)
        for t_name, t in ((weight, p.weight), (scale, p.scale)):
            tensors[t_name] = {
                "file": "layer-000.safetensors",
                "dtype": "U8",
                "shape": list(t.shape),
                "sha256": "0" * 64,
            }
    return {
        "schema": mf.SCHEMA,
        "schema_version": mf.SCHEMA_VERSION,
        "model": {"geometry": GEOM.as_dict()},
        "source": {"config_sha256": "0" * 64, "tensors": {"x": "0" * 64}},
        "options": {},
        "mla": [entry],
        "tensors": tensors,
        "files": {"layer-000.safetensors": {"size": 0, "sha256": "0" * 64}},
    }


def test_projection_entry_records_what_was_stored():
    w = kv_b()[:64].reshape(2, 32, 64)
    mx = store_projection(w, k_stored=96, quant_mode="mse", policy="mxfp4", max_rel_error=None)
    entry = mf.projection_entry(mx, "a.weight", "a.weight_scale")
    assert entry["quant"] == {"format": "mxfp4", "mode": "mse", "block": 32, "scale": "e8m0", "rounding": "half_even"}
    assert entry["layout"] == {"name": "bmm_nk", "k_logical": 64, "k_stored": 96}
    assert (entry["precision"], entry["weight"], entry["scale"]) == ("mxfp4", "a.weight", "a.weight_scale")
    assert entry["rel_error"] == entry["mxfp4_rel_error"] == rel_error(dequantize(*quantize(w, mode="mse")), w)
    assert entry["max_head_rel_error"] == max(rel_error(dequantize(*quantize(h, mode="mse")), h) for h in w)
    bf = store_projection(w, k_stored=64, quant_mode="mse", policy="bf16", max_rel_error=None)
    entry = mf.projection_entry(bf, "b.weight", None)
    assert entry["quant"] == {"format": "bf16"} and (entry["precision"], entry["scale"]) == ("bf16", None)
    assert entry["rel_error"] == rel_error(w.bfloat16(), w) < entry["mxfp4_rel_error"]


def test_manifest_round_trip_and_parse():
    m = _manifest()
    text = mf.dumps(m)
    assert mf.dumps(mf.loads(text)) == text
    (layer,) = mf.parse_mla(mf.loads(text))
    assert layer.w_kc.k_logical == 96 and layer.w_kc.k_stored == 128 and layer.w_vc.k_stored == 64
    assert layer.w_kc.scale == "model.layers.0.self_attn.w_kc.weight_scale"
    assert layer.w_kc.max_head_rel_error == m["mla"][0]["w_kc"]["max_head_rel_error"] > 0


def test_manifest_without_worst_head_errors_still_parses():
    """Manifests written before max_head_rel_error was recorded lack it: readers take them, with None."""
    m = _manifest()
    for p in ("w_kc", "w_vc"):
        del m["mla"][0][p]["max_head_rel_error"]
    (layer,) = mf.parse_mla(mf.loads(mf.dumps(m)))
    assert layer.w_kc.max_head_rel_error is None and layer.w_vc.max_head_rel_error is None
    assert layer.w_kc.rel_error == m["mla"][0]["w_kc"]["rel_error"]


EXPERT_W, EXPERT_S = "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight_scale"


def _with_experts(m):
    """Add a repacked-experts section: one expert's shuffled weight [256, 128] and scales [256, 8] in their own file."""
    for name, shape, layout in (
        (EXPERT_W, [256, 128], {"layout": "aiter_shuffle_16x16"}),
        (EXPERT_S, [256, 8], {"layout": "aiter_e8m0_shuffle", "shape": [256, 8]}),
    ):
        m["tensors"][name] = {"file": "experts-000.safetensors", "dtype": "U8", "shape": shape, "sha256": "0" * 64}
        m["tensors"][name]["layout"] = layout
    m["files"]["experts-000.safetensors"] = {"size": 0, "sha256": "0" * 64}
    m["experts"] = {
        "layout": "aiter_moe_a4w4",
        "groups": [{"layer": 0, "file": "experts-000.safetensors", "tensors": [EXPERT_W, EXPERT_S]}],
    }
    return m


def _kc_as_bf16(m, dtype="BF16"):
    """w_kc stored in BF16: [H, kv_lora, k_stored] = [2, 64, 128] of ``dtype``, no scale."""
    m["mla"][0]["w_kc"].update(precision="bf16", scale=None, quant={"format": "bf16"})
    m["tensors"]["model.layers.0.self_attn.w_kc.weight"].update(dtype=dtype, shape=[2, 64, 128])
    return m


def test_manifest_with_experts_and_bf16_projection_parses():
    m = _kc_as_bf16(_with_experts(_manifest()))
    (layer,) = mf.parse_mla(m)
    assert layer.w_kc.precision == "bf16" and layer.w_kc.scale is None and layer.w_kc.quant_mode is None
    ((group_layer, file, names),) = mf.parse_experts(m)
    assert (group_layer, file, len(names)) == (0, "experts-000.safetensors", 2)


def test_manifest_with_a_layer_of_experts_in_two_files_parses():
    """convert splits a layer's experts over files of at most 5 GB (GLM-5's 256 experts take 5.13 GB): one group per
    file, each naming the layer."""
    m = _with_experts(_manifest())
    m["tensors"][EXPERT_S]["file"] = "experts-000-02.safetensors"
    m["files"]["experts-000-02.safetensors"] = {"size": 0, "sha256": "0" * 64}
    m["experts"]["groups"] = [
        {"layer": 0, "file": "experts-000.safetensors", "tensors": [EXPERT_W]},
        {"layer": 0, "file": "experts-000-02.safetensors", "tensors": [EXPERT_S]},
    ]
    groups = [(0, "experts-000.safetensors", [EXPERT_W]), (0, "experts-000-02.safetensors", [EXPERT_S])]
    assert mf.parse_experts(m) == groups
    assert len(mf.parse_mla(m)) == 1


def _k_stored_200(m):
    """k_stored 200 >= k_logical 96, not a multiple of 32, with tensors shaped as 200 would give (100, 200 // 32)."""
    m["mla"][0]["w_kc"]["layout"].update(k_stored=200)
    m["tensors"]["model.layers.0.self_attn.w_kc.weight"].update(shape=[2, 64, 100])
    m["tensors"]["model.layers.0.self_attn.w_kc.weight_scale"].update(shape=[2, 64, 6])


def _stacked_scale_with_other_leading_dims(m):
    """A stacked [2, 256, 8] scale tensor whose layout records the shape of a [3, 256, 8] stack."""
    _with_experts(m)["tensors"][EXPERT_S].update(
        shape=[2, 256, 8], layout={"layout": "aiter_e8m0_shuffle", "shape": [3, 256, 8]}
    )


def _k_stored_64(m):
    """k_stored 64 < k_logical 96, with tensors shaped as 64 would give (32, 2)."""
    m["mla"][0]["w_kc"]["layout"].update(k_stored=64)
    m["tensors"]["model.layers.0.self_attn.w_kc.weight"].update(shape=[2, 64, 32])
    m["tensors"]["model.layers.0.self_attn.w_kc.weight_scale"].update(shape=[2, 64, 2])


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(schema_version=2), "schema_version 2"),
        (lambda m: m.update(schema="other"), "not a glm-pack manifest"),
        (lambda m: m["mla"][0]["w_kc"]["layout"].update(name="aiter_shuffle_16x16"), "not a layout the runtime"),
        (lambda m: m["mla"][0]["w_kc"]["layout"].update(k_logical=64), "contradicts the geometry"),
        (lambda m: m["mla"][0]["w_kc"]["layout"].update(k_stored=33), "k_stored % 32"),
        (_k_stored_200, "k_stored % 32"),
        (lambda m: m["tensors"]["model.layers.0.self_attn.w_vc.weight_scale"].update(shape=[2, 32, 1]), "must be U8"),
        (lambda m: m["mla"][0]["w_vc"].update(rel_error=float("nan")), "finite non-negative"),
        (lambda m: m["mla"][0]["w_vc"].update(scale=None), "names no scale"),
        (lambda m: m["tensors"].popitem(), "tensors table lacks"),
        (lambda m: next(iter(m["tensors"].values())).update(shape=[2, -64, 32]), "positive integers"),
        (lambda m: next(iter(m["tensors"].values())).update(file="../x"), "plain file name"),
        (lambda m: m["mla"][0]["w_kc"].update(precision="fp8"), "precision 'fp8'"),
        (lambda m: m["model"]["geometry"].update(num_heads=0), "geometry is invalid"),
        (lambda m: m["mla"].append(copy.deepcopy(m["mla"][0])), "repeated"),
        (lambda m: m["mla"][0].update(layer=-1), "layer -1 is negative"),
        (lambda m: m["mla"][0].update(layer=True), "layer must be int, got bool"),
        (_k_stored_64, "0 < k_logical <= k_stored"),
        (lambda m: m["mla"][0]["w_kc"].update(precision="bf16"), "is bf16 but names a scale tensor"),
        (lambda m: _kc_as_bf16(m, dtype="U8"), "bf16 tensor must be BF16"),
        (lambda m: m["mla"][0]["w_vc"].update(mxfp4_rel_error=-0.1), "finite non-negative"),
        (lambda m: m["mla"][0]["w_vc"].update(rel_error=float("inf")), "finite non-negative"),
        (lambda m: m["mla"][0]["w_kc"].update(mxfp4_rel_error=10**400), "finite non-negative"),
        (lambda m: m["mla"][0]["w_kc"].update(max_head_rel_error=float("nan")), "max_head_rel_error must be a fin"),
        (lambda m: m["mla"][0]["w_kc"].update(max_head_rel_error="0.1"), "max_head_rel_error"),
        (lambda m: m["mla"][0]["w_vc"].update(max_head_rel_error=None), "w_vc.max_head_rel_error must be"),
        (lambda m: m["mla"][0]["w_kc"].pop("rel_error"), "w_kc lacks 'rel_error'"),
        (lambda m: m["mla"][0]["w_vc"].pop("mxfp4_rel_error"), "w_vc lacks 'mxfp4_rel_error'"),
        (lambda m: m["mla"][0]["w_kc"]["quant"].update(mode="half"), "quant.mode 'half'"),
        (lambda m: m["mla"][0]["w_kc"]["quant"].update(block=16), r"w_kc.quant must be \{'format': 'mxfp4'"),
        (lambda m: m["mla"][0]["w_vc"]["quant"].update(format="nvfp4", scale="e4m3"), r"w_vc.quant must be"),
        (lambda m: m["mla"][0]["w_kc"]["quant"].pop("rounding"), r"w_kc.quant must be .*'rounding': 'half_even'"),
        (lambda m: next(iter(m["tensors"].values())).update(file=".."), "plain file name"),
        (lambda m: next(iter(m["tensors"].values())).update(sha256="0" * 63), "is not a sha256"),
        (lambda m: next(iter(m["tensors"].values())).update(dtype="I8"), "dtype 'I8'"),
        (lambda m: next(iter(m["tensors"].values())).update(shape=[2, 0, 48]), "positive integers"),
        (lambda m: next(iter(m["tensors"].values())).update(shape=[]), "non-empty list"),
        (lambda m: next(iter(m["tensors"].values())).update(file="sub\\layer-000.safetensors"), "plain file name"),
        (lambda m: next(iter(m["tensors"].values())).update(sha256="A" * 64), "is not a sha256"),
        (lambda m: m["files"].update({"../layer-000.safetensors": {"size": 0, "sha256": "0" * 64}}), "plain file"),
        (_stacked_scale_with_other_leading_dims, "no known shuffle layout"),
        (lambda m: m["files"]["layer-000.safetensors"].update(size=-1), "size -1 is negative"),
        (lambda m: m["source"]["tensors"].update(x="not hex"), r"source.tensors\['x'\] is not a sha256"),
        (lambda m: m["source"].update(path=5), "source.path must be a string or null"),
        (lambda m: m["source"].update(config_sha256="0" * 63), "source.config_sha256 is not a sha256"),
        (lambda m: m["source"].update(index_sha256="Z" * 64), "source.index_sha256 is not a sha256"),
        (lambda m: m["source"].update(index_sha256=5), "source.index_sha256 is not a sha256"),
        (lambda m: m.update(kernel_configs=[]), "kernel_configs must be an object"),
        (lambda m: _with_experts(m)["experts"].update(layout="aiter_moe_a8w8"), "experts.layout must be"),
        (lambda m: _with_experts(m)["experts"]["groups"][0].update(file="layer-000.safetensors"), "lacks in"),
        (lambda m: _with_experts(m)["tensors"][EXPERT_W]["layout"].update(tile=32), "no known shuffle layout"),
        # [512, 8] would be shuffled to [512, 8], but [256, 8] is stored
        (lambda m: _with_experts(m)["tensors"][EXPERT_S]["layout"].update(shape=[512, 8]), "no known shuffle layout"),
        (lambda m: _with_experts(m)["tensors"][EXPERT_W].update(dtype="BF16"), "must be U8"),
        (lambda m: _with_experts(m)["experts"]["groups"][0].update(layer=-1), r"groups\[0\].layer -1 is negative"),
        (
            lambda m: _with_experts(m)["experts"]["groups"].append(m["experts"]["groups"][0]),
            r"groups\[1\].file 'experts-000.safetensors' is repeated",
        ),
    ],
)
def test_manifest_rejects(edit, match):
    m = _manifest()
    edit(m)
    with pytest.raises(ManifestError, match=match):
        mf.parse_mla(m)


def test_manifest_loads_limits():
    with pytest.raises(ManifestError, match="deeper"):
        mf.loads(json.dumps(json.loads("[" * 40 + "]" * 40)))

    def nested(levels):  # the innermost object lies `levels` levels below the top
        return '{"a": ' * levels + "{}" + "}" * levels

    assert mf.loads(nested(mf.MAX_JSON_DEPTH)) and mf.MAX_JSON_DEPTH == 32
    with pytest.raises(ManifestError, match="deeper than 32 levels"):
        mf.loads(nested(33))
    with pytest.raises(ManifestError, match="not valid JSON"):
        mf.loads("{")
    with pytest.raises(ManifestError, match="not a JSON object"):
        mf.loads("[]")


def test_manifest_loads_size_limit(monkeypatch):
    text = json.dumps({"a": "x" * 100})  # valid JSON: only the size limit can refuse it
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(text))
    assert mf.loads(text) == {"a": "x" * 100}
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(text) - 1)
    with pytest.raises(ManifestError, match=f"{len(text)} bytes, larger than the {len(text) - 1} byte limit"):
        mf.loads(text)
    wide = json.dumps({"a": "\u00e9" * 50}, ensure_ascii=False)  # 50 two-byte characters
    assert len(wide.encode()) == len(text)  # limit is len(text) - 1: too big in bytes, not in characters
    with pytest.raises(ManifestError, match=f"{len(text)} bytes, larger than"):
        mf.loads(wide)


def test_manifest_loads_str_with_a_lone_surrogate():
    """str text holding a lone surrogate (what the JSON escape \\ud800 decodes to) is measured and parsed like the
    bytes of the same JSON: it was a UnicodeEncodeError out of the size check, not a ManifestError or a manifest."""
    escaped = b'{"a": "\\ud800"}'
    assert mf.loads(json.dumps({"a": "\ud800"}, ensure_ascii=False)) == mf.loads(escaped) == {"a": "\ud800"}


def test_rel_errors_whole_and_worst_head_by_hand():
    """Heads off by 0%, 10% and 20% of equal norms: the whole is sqrt((0 + 0.01 + 0.04) / 3), the worst head 0.2;
    an all-zero head stored exactly counts 0, not 0 / 0."""
    ref = torch.ones(4, 2, 32)
    ref[3] = 0
    approx = ref * torch.tensor([1.0, 1.1, 1.2, 1.0])[:, None, None]
    whole, worst = rel_errors(approx, ref)
    assert whole == pytest.approx((0.05 / 3) ** 0.5, rel=1e-6) and worst == pytest.approx(0.2, rel=1e-6)


@pytest.mark.parametrize("head", [0, 2])
def test_rel_errors_worst_head_is_nan_where_a_head_is(head):
    """A NaN in one head makes the worst head NaN wherever that head is (Python's max kept a finite error when
    the NaN head came after the first), as it makes the whole NaN."""
    ref = torch.ones(3, 2, 32)
    approx = ref * 1.1
    approx[head, 1, 5] = float("nan")
    whole, worst = rel_errors(approx, ref)
    assert math.isnan(whole) and math.isnan(worst)


def test_absorb_records_the_worst_head():
    """One head's rows scaled so that MXFP4's relative error differs per head: the recorded worst head is the
    largest of the heads' errors computed one head at a time, and exceeds the whole tensor's."""
    w = kv_b()
    ref_kc, ref_vc = split_by_hand(w)
    for policy in ("mxfp4", "bf16"):
        kc, vc = absorb_layer(w, GEOM, k_stored=128, policy=policy)
        for stored, ref in ((kc, ref_kc), (vc, ref_vc)):
            k = ref.shape[-1]
            if policy == "mxfp4":
                values = dequantize(stored.weight[..., : k // 2], stored.scale[..., : k // 32])
            else:
                values = stored.weight[..., :k].float()
            heads = [rel_error(values[h], ref[h]) for h in range(GEOM.num_heads)]
            assert stored.max_head_rel_error == pytest.approx(max(heads), rel=1e-9)
            assert min(heads) < stored.rel_error < stored.max_head_rel_error


def test_rel_error_of_a_zero_reference():
    zero = torch.zeros(2, 32)
    assert rel_error(zero, zero) == 0.0
    assert rel_error(torch.full((2, 32), 1e-3), zero) == float("inf")


def test_rel_error_holds_where_a_short_row_of_squares_reaches_2_to_128():
    """Rows of 4 values of 2**63: each square (2**126) fits float32, their sum (2**128) is float32's Inf."""
    w = torch.full((2, 4), 2.0**63)
    assert rel_error(w * 1.01, w) == pytest.approx(0.01, rel=1e-5)


def test_rel_error_holds_where_the_rows_together_sum_past_float32():
    """Rows of 32 values of 2**58: each row's squares sum to 2**121 (float32 is fine per row), 512 rows to 2**130."""
    w = torch.full((512, 32), 2.0**58)
    assert rel_error(w * 1.01, w) == pytest.approx(0.01, rel=1e-5)


@pytest.mark.parametrize("scale", [1e-30, 3e-23, 1.0, 1e17, 1e19, 1e30])
def test_rel_error_holds_at_every_float32_magnitude(scale):
    """Squares of float32 values neither overflow nor underflow: a 10% perturbation reads 0.1 at any scale."""
    w = torch.randn(8, 512, generator=torch.Generator().manual_seed(0)) * scale
    assert rel_error(w * 1.1, w) == pytest.approx(0.1, rel=1e-5)


@pytest.mark.parametrize("odd_row", [None, 0.0, 2.0**-70, 2.0**-61, 2.0**-59, 2.0**57, 2.0**58, 2.0**63, math.inf])
def test_head_sums_of_squares_match_float64_whatever_one_row_holds(odd_row):
    """Per-head sums of squares against float64 throughout: normal rows alone (the float32 norms), and with one row
    scaled to zero, near float32's under- or overflow on either side of the float64 switch (amax 2**-60 and
    2**62 / sqrt(512) = 2**57.5), or Inf; within float32 rounding of the float64 sums in every head."""
    t = torch.randn(4, 8, 512, generator=torch.Generator().manual_seed(1))
    if odd_row is not None:
        t[2, 3] = t[2, 3] / t[2, 3].abs().max() * odd_row if odd_row else 0.0
    got = _head_sum_squares(t)
    want = t.double().square().sum(dim=(1, 2))
    assert got.dtype == torch.float64 and got.shape == (4,)
    assert torch.equal(got.isinf(), want.isinf()) and torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)


def _spike(amax):
    """512 values: one of ``amax``, the others about 0.03 * amax (norm just above amax)."""
    row = torch.randn(512, generator=torch.Generator().manual_seed(3)) * 0.03 * amax
    row[0] = amax
    return row


def _flat(amax):
    """512 values within 3% below ``amax`` (norm near amax * sqrt(512))."""
    return amax * (1 - 0.03 * torch.rand(512, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("row", [_flat(2.0**-60.5), _spike(1.2 * 2.0**57.5)], ids=["small-flat", "large-spike"])
def test_head_sums_of_squares_are_float64_once_a_row_passes_the_switch(row):
    """A row whose amax is just past the float64 switch (below 2**-60, or above 2**62 / sqrt(512) = 2**57.5) while its
    norm is within 2x of the bound it implies (amax * sqrt(512) for a flat row, amax for a spike): the sums are float64
    throughout (float32 norms would be off by about 1e-7)."""
    t = torch.randn(4, 8, 512, generator=torch.Generator().manual_seed(2))
    t[2, 3] = row
    got, want = _head_sum_squares(t), t.double().square().sum(dim=(1, 2))
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got - want) / want


def test_rel_error_holds_where_a_row_of_squares_sums_past_float32():
    """512 values of 2**59.9: each square fits float32, their row sum (2**128.8) does not."""
    w = torch.full((4, 512), 2.0**59.9)
    assert rel_error(w * 1.01, w) == pytest.approx(0.01, rel=1e-5)


def test_an_error_names_its_file_and_tensor_once():
    """The line ends with the file and tensor the message does not already name (a folder named in the message, as
    'output OUT is not empty', read '... (file OUT)' after it)."""
    shard = "/o/a.safetensors"
    assert str(PlanError("bad values", file=shard, tensor="x.w")) == "bad values (file /o/a.safetensors, tensor x.w)"
    assert str(PlanError("output /o is not empty", file="/o")) == "output /o is not empty"
    assert str(FormatError("x.w has NaN", file=shard, tensor="x.w")) == "x.w has NaN (file /o/a.safetensors)"
    assert str(ManifestError("no manifest")) == "no manifest"
    # a longer name containing the name does not name it; a name ending a sentence or quoted does
    layer10 = "model.layers.10.self_attn.w"
    assert str(FormatError(f"{layer10} has NaN", tensor="layers.1")) == f"{layer10} has NaN (tensor layers.1)"
    assert str(FormatError("x.w_scale is short", tensor="x.w")) == "x.w_scale is short (tensor x.w)"
    assert str(PlanError("left /o/a.safetensors.tmp", file="/o/a.safetensors")).endswith("(file /o/a.safetensors)")
    assert str(PlanError("cannot read 'a.safetensors'.", file="a.safetensors")) == "cannot read 'a.safetensors'."
    assert str(PlanError("x.w is bad.", tensor="x.w")) == "x.w is bad."
