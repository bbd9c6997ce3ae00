"""Cards: recognition, geometry, layer sets, names, kernel configs; format detection on every card x format."""

from __future__ import annotations

import copy

import pytest

from glm_pack.convert import cards, formats, synth
from glm_pack.convert.checkpoint import open_checkpoint
from glm_pack.packing.errors import CheckpointError, PlanError
from glm_pack.packing.manifest import AITER_BMM_CONFIG_KEYS

ALL = ["deepseek-v3", "glm-5", "glm-5.2", "glm-5.3-flash"]


def test_bundled_cards():
    assert cards.list_cards() == ALL
    with pytest.raises(PlanError, match="unknown card 'nope'"):
        cards.load_card("nope")


@pytest.mark.parametrize("name", ALL)
def test_each_card_recognises_its_own_config(name):
    card = cards.load_card(name)
    assert cards.detect_card(card.synth["config"]) is card


def test_glm5_and_glm52_share_an_architecture_but_not_a_card():
    base = dict(cards.load_card("glm-5").synth["config"])
    assert cards.detect_card(base).name == "glm-5"
    assert cards.detect_card({**base, "index_topk_freq": 4}).name == "glm-5.2"
    assert cards.detect_card({**base, "indexer_types": ["full"]}).name == "glm-5.2"
    with pytest.raises(CheckpointError, match="unknown architecture LlamaForCausalLM"):
        cards.detect_card({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


@pytest.mark.parametrize(
    "name, geometry, kv_b_rows, k_pad",
    [
        ("glm-5", (64, 512, 192, 64, 256), 28672, 256),
        ("glm-5.2", (64, 512, 192, 64, 256), 28672, 256),
        ("deepseek-v3", (128, 512, 128, 64, 128), 32768, None),
        ("glm-5.3-flash", (64, 512, 256, 0, 256), 32768, None),
    ],
)
def test_geometry_from_config(name, geometry, kv_b_rows, k_pad):
    card = cards.load_card(name)
    g = card.geometry(card.synth["config"])
    assert (g.num_heads, g.kv_lora_rank, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim) == geometry
    assert g.kv_b_rows == kv_b_rows and card.default_k_pad(g) == k_pad


def test_geometry_never_uses_head_dim():
    card = cards.load_card("glm-5")
    config = {**card.synth["config"], "head_dim": 999}
    assert card.geometry(config).qk_nope_head_dim == 192
    with pytest.raises(CheckpointError, match="qk_nope_head_dim"):
        card.geometry({k: v for k, v in config.items() if k != "qk_nope_head_dim"})


def test_layer_sets_of_the_full_configs():
    glm5 = cards.load_card("glm-5")
    assert glm5.mla_layers(glm5.synth["config"]) == list(range(79))
    assert glm5.layer_plan(glm5.synth["config"]).dense == (0, 1, 2)  # GLM-5: the first 3 layers dense
    plan52 = cards.load_card("glm-5.2").layer_plan(cards.load_card("glm-5.2").synth["config"])
    # IndexShare, freq 4, offset 3: layers 0, 1, 2 then every 4th from 6 (21 layers) + the MTP layer 78
    assert plan52.indexer == (0, 1, 2, *range(6, 78, 4), 78) and len(plan52.indexer) == 22
    flash = cards.load_card("glm-5.3-flash")
    config = flash.synth["config"]
    assert flash.mla_layers(config) == [*range(3, 45, 4), 45]  # 11 DSA layers + MTP layer 45
    listed = {**config, "text_config": {**config["text_config"], "full_attn_layers": [1, 5]}}
    assert flash.mla_layers(listed) == [1, 5, 45]
    ds = cards.load_card("deepseek-v3").layer_plan(cards.load_card("deepseek-v3").synth["config"])
    assert ds.mtp == (61,) and ds.dense == (0, 1, 2) and ds.indexer == ()


def test_names():
    flash = cards.load_card("glm-5.3-flash")
    assert flash.layer_prefix(7) == "model.language_model.layers.7"
    assert flash.kv_b_proj(7) == "model.language_model.layers.7.self_attn.kv_b_proj.weight"
    glm5 = cards.load_card("glm-5")
    assert glm5.expert_weights(5, 2) == [
        "model.layers.5.mlp.experts.0.gate_proj.weight",
        "model.layers.5.mlp.experts.0.up_proj.weight",
        "model.layers.5.mlp.experts.0.down_proj.weight",
        "model.layers.5.mlp.experts.1.gate_proj.weight",
        "model.layers.5.mlp.experts.1.up_proj.weight",
        "model.layers.5.mlp.experts.1.down_proj.weight",
    ]
    m = glm5.expert_pattern.match("model.layers.5.mlp.experts.17.down_proj.weight_scale")
    assert (m["layer"], m["expert"], m["proj"]) == ("5", "17", "down_proj")
    assert glm5.expert_pattern.match("model.layers.5.mlp.shared_experts.down_proj.weight") is None


@pytest.mark.parametrize("name", ALL)
def test_kernel_configs_are_complete(name):
    card = cards.load_card(name)
    padded, unpadded = card.kernel_configs("padded")["gfx950"], card.kernel_configs("unpadded")["gfx950"]
    for route in (padded, unpadded):
        assert set(route) == {"k_up", "v_up"}
        for op in route.values():
            assert set(op) == {"M_LEQ_16", "M_LEQ_32", "M_LEQ_64", "M_LEQ_128", "M_LEQ_256", "any"}
            for cfg in op.values():
                assert tuple(cfg) == AITER_BMM_CONFIG_KEYS and cfg["NUM_KSPLIT"] == 1
    assert all(c["BLOCK_SIZE_K"] == 256 for c in padded["k_up"].values())
    assert all(c["BLOCK_SIZE_K"] == 64 for c in unpadded["k_up"].values())
    for route in (padded, unpadded):
        assert (route["v_up"]["any"]["BLOCK_SIZE_M"], route["v_up"]["any"]["BLOCK_SIZE_K"]) == (128, 128)
        assert route["v_up"]["M_LEQ_16"] == padded["k_up"]["M_LEQ_16"]  # small-M: aiter's defaults
    assert padded["k_up"]["any"]["cache_modifier"] is None and padded["k_up"]["M_LEQ_16"]["cache_modifier"] == ".cg"
    with pytest.raises(PlanError, match="unknown kernel route"):
        card.kernel_configs("fast")


def test_a_new_family_needs_only_a_card(tmp_path, synth_ckpt):
    text = (cards.resources.files("glm_pack.cards") / "glm-5.toml").read_text()
    card_path = tmp_path / "my-glm.toml"
    card_path.write_text(text.replace('name = "glm-5"', 'name = "my-glm"').replace("k_pad_to = 256", "k_pad_to = 0"))
    ck = open_checkpoint(synth_ckpt("glm-5", "bf16"), card=str(card_path))
    assert ck.card.name == "my-glm" and ck.card.default_k_pad(ck.geometry) is None


def _expected(fmt: str, role: str, in_mtp: bool) -> str:
    if fmt in ("bf16", "fp8-block"):
        return fmt
    if in_mtp or role == "indexer":
        return "bf16"
    if role in ("mlp", "expert"):
        return "mxfp4"
    return {"mxfp4-quark": "bf16", "mxfp4-attn": "mxfp4", "fp8-channel": "fp8-channel"}[fmt]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("fmt", synth.FORMATS)
def test_detection_on_every_card_and_format(name, fmt):
    """Headers as synth writes them (no data) -> every Linear weight detected as the format's policy says."""
    card = cards.load_card(name)
    config = synth.synth_config(card, layers=5, experts=2, fmt=fmt, profile="small", mtp=True)
    assert cards.detect_card(config) is card
    entries = {e.name: formats.StoredTensor(e.name, e.dtype, e.shape) for e in synth.tensor_entries(card, config, fmt)}
    quant = formats.QuantConfig(config.get("quantization_config"))
    mtp = card.layer_prefix(card.layer_plan(config).mtp[0]) + "."
    seen = set()
    for tensor_name, template, _ in card.iter_tensors(config):
        if not template.is_linear:
            continue
        module = formats.module_of(tensor_name)
        scales = {s: entries[f"{module}.{s}"] for s in formats.SCALE_SUFFIXES if f"{module}.{s}" in entries}
        got = formats.detect(entries[tensor_name], scales, quant).name
        assert got == _expected(fmt, template.role, tensor_name.startswith(mtp)), tensor_name
        seen.add(got)
    assert seen == {"bf16", "fp8-block", "mxfp4", "fp8-channel"} & (
        {_expected(fmt, r, m) for r in ("attn", "mlp", "indexer") for m in (0, 1)}
    )


@pytest.mark.parametrize("fmt", synth.FORMATS)
def test_detection_on_written_checkpoints(synth_ckpt, fmt):
    ck = open_checkpoint(synth_ckpt("glm-5", fmt))
    assert ck.mla_layers() == [0, 1, 2]  # two dense layers + MTP layer 2
    kv_b = [ck.weight_format(ck.card.kv_b_proj(i)) for i in ck.mla_layers()]
    assert kv_b == [_expected(fmt, "attn", False)] * 2 + [_expected(fmt, "attn", True)]
    experts = ck.card.expert_weights(2, 2)
    assert {ck.weight_format(n) for n in experts} == {_expected(fmt, "expert", True)}
    dense = "model.layers.0.mlp.down_proj.weight"
    assert ck.weight_format(dense) == _expected(fmt, "mlp", False)


def test_layer_selectors_at_their_bounds():
    """Hand-checked layer sets at each selector's edges: list ids outside 0..n-1 are dropped, a types list shorter
    than the layers is refused, first_k past the last layer makes every decoder layer dense (the MTP layer stays
    MoE), the indexer only sits on MLA layers."""
    flash = cards.load_card("glm-5.3-flash")
    config = flash.synth["config"]
    text = {**config["text_config"], "num_nextn_predict_layers": 0, "full_attn_layers": [-1, 1, 5, 45]}
    assert flash.mla_layers({**config, "text_config": text}) == [1, 5]  # 45 is no layer without an MTP layer
    assert flash.layer_plan(config).indexer == (*range(3, 45, 4), 45)  # [[layers.indexer]] all, within MLA
    glm5 = cards.load_card("glm-5")
    base = glm5.synth["config"]
    with pytest.raises(CheckpointError, match="mlp_layer_types has 77 entries for 78 layers"):
        glm5.layer_plan({**base, "mlp_layer_types": ["dense"] * 77})
    plan = glm5.layer_plan({**base, "first_k_dense_replace": 100})
    assert plan.dense == tuple(range(78)) and plan.moe == (78,)


@pytest.mark.parametrize(
    "schedule",
    [
        {},
        {"index_skip_topk_offset": 3},
        {"index_topk_freq": 3, "index_skip_topk_offset": 0},
        {"index_topk_freq": 0},
        {"index_topk_pattern": "FFS" + "SFSS" * 18 + "SFS"},
        {"index_topk_pattern": ["full", "shared"] * 39},
    ],
    ids=["offset-absent", "offset-3", "freq-3-offset-0", "freq-0", "pattern", "pattern-list"],
)
def test_indexshare_layers_are_the_ones_transformers_derives(schedule):
    """GLM-5.2's indexer layers from index_topk_pattern (which wins), else index_topk_freq /
    index_skip_topk_offset, are the layers transformers' GlmMoeDsaConfig marks "full" (and the MTP layer). An
    absent offset was taken as 0 (transformers: 2); a pattern was ignored (no decoder layer had an indexer)."""
    transformers = pytest.importorskip("transformers")
    card = cards.load_card("glm-5.2")
    config = {k: v for k, v in card.synth["config"].items() if k != "index_skip_topk_offset"} | schedule
    full = [i for i, kind in enumerate(transformers.GlmMoeDsaConfig(**config).indexer_types) if kind == "full"]
    assert card.layer_plan(config).indexer == (*full, 78)
    if not schedule:
        assert full[:4] == [0, 1, 5, 9]  # max(i - 2 + 1, 0) % 4 == 0


@pytest.mark.parametrize(
    "schedule",
    [
        {},
        {"index_topk_freq": 4},
        {"index_topk_freq": 3, "index_skip_topk_offset": 0},
        {"index_topk_pattern": "FFFFFFFS" * 5 + "FFFFF"},
    ],
    ids=["none", "freq-4", "freq-3-offset-0", "pattern"],
)
def test_flash_indexer_layers_are_the_ones_transformers_derives(schedule):
    """GLM-5.3-Flash: the MLA layers whose indexer transformers' Glm5NextTextConfig marks "full" (and the MTP
    layer). index_topk_pattern and index_topk_freq were ignored: every MLA layer counted as having an indexer."""
    transformers = pytest.importorskip("transformers")
    card = cards.load_card("glm-5.3-flash")
    config = card.synth["config"]
    text = {**config["text_config"], **schedule}
    kinds = transformers.Glm5NextTextConfig(**text).indexer_types
    mla = set(range(3, 45, 4))
    full = [i for i, kind in enumerate(kinds) if kind == "full" and i in mla]
    assert card.layer_plan({**config, "text_config": text}).indexer == (*full, 45)


def test_a_pattern_of_unknown_letters_is_refused():
    card = cards.load_card("glm-5.2")
    with pytest.raises(CheckpointError, match="index_topk_pattern must be a string of the letters FS, got 'FFX'"):
        card.layer_plan({**card.synth["config"], "index_topk_pattern": "FFX"})


def test_card_defaults_mtp_carries_mla_but_no_indexer():
    """A card that leaves mtp_has_mla / mtp_has_indexer out: the MTP layer carries MLA, no indexer."""
    data = {**cards.load_card("glm-5").data}
    data["layers"] = {k: v for k, v in data["layers"].items() if not k.startswith("mtp_has_")}
    plan = cards.Card(data, "test").layer_plan(data["synth"]["config"])
    assert plan.mla == tuple(range(79)) and plan.indexer == tuple(range(78))


def test_detection_needs_the_architecture_or_the_model_type():
    """Either one is enough (a config may lack the other); neither known is refused."""
    base = cards.load_card("glm-5").synth["config"]
    assert cards.detect_card({k: v for k, v in base.items() if k != "architectures"}).name == "glm-5"
    assert cards.detect_card({**base, "model_type": "something_else"}).name == "glm-5"
    with pytest.raises(CheckpointError, match="unknown architecture none"):
        cards.detect_card({k: v for k, v in base.items() if k not in ("architectures", "model_type")})


def test_a_config_two_cards_match_is_refused(tmp_path, monkeypatch):
    card_path = tmp_path / "my-glm.toml"
    text = (cards.resources.files("glm_pack.cards") / "glm-5.toml").read_text()
    card_path.write_text(text.replace('name = "glm-5"', 'name = "my-glm"'))
    monkeypatch.setattr(cards, "list_cards", lambda: ["glm-5", str(card_path)])
    with pytest.raises(CheckpointError, match="matches several cards: glm-5, my-glm"):
        cards.detect_card(cards.load_card("glm-5").synth["config"])


def test_shape_expressions():
    """Integer arithmetic only: // floors; a float or boolean constant or another operator is refused."""
    assert cards.eval_expr("(a + 1) * 3 - a // 2", {"a": 7}, "t") == 21
    assert cards.eval_expr(5, {}, "t") == 5
    for expr in ("a * 1.5", "a / 2", "a ** 2", "a * True", True):
        with pytest.raises(PlanError, match="unsupported expression"):
            cards.eval_expr(expr, {"a": 7}, "t")


def _card_data(edit) -> dict:
    data = copy.deepcopy(cards.load_card("glm-5").data)
    edit(data)
    return data


def test_bucket_overrides_win_over_the_route_wide_ones():
    """A route's per-bucket entry beats its "*" entry, which beats the base bucket."""

    def edit(data):
        data["kernels"]["gfx950"]["routes"]["padded"]["k_up"] = {"*": {"BLOCK_SIZE_K": 64}, "any": {"BLOCK_SIZE_K": 32}}

    k_up = cards.Card(_card_data(edit), "test").kernel_configs("padded")["gfx950"]["k_up"]
    assert k_up["any"]["BLOCK_SIZE_K"] == 32 and k_up["M_LEQ_16"]["BLOCK_SIZE_K"] == 64
    assert k_up["M_LEQ_16"]["BLOCK_SIZE_N"] == 64  # untouched keys from the base bucket


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["kernels"]["gfx950"]["base"]["any"].update(NUM_KSPLIT=2), "any needs every key"),
        (lambda d: d["kernels"]["gfx950"]["base"]["M_LEQ_16"].pop("num_warps"), r"missing \['num_warps'\]"),
        (lambda d: d["kernels"]["gfx950"]["routes"].pop("unpadded"), "kernels.gfx950 lacks route 'unpadded'"),
        (lambda d: d["tensors"][0].update(scope="decoder"), "unknown scope 'decoder'"),
    ],
    ids=["split-k", "missing-key", "missing-route", "bad-scope"],
)
def test_bad_cards_are_refused_naming_the_card(edit, message):
    with pytest.raises(PlanError, match=message) as err:
        cards.Card(_card_data(edit), "my.toml")
    assert err.value.file == "my.toml" and "card glm-5" in str(err.value)


def test_card_files(tmp_path, monkeypatch):
    """A *.toml path loads that file; a bundled name is never read from a same-named file in the working
    directory; a file that is no TOML is refused naming it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "glm-5").write_text("not a card")
    assert cards.load_card.__wrapped__("glm-5").source.endswith("glm-5.toml")
    (tmp_path / "bad.toml").write_text("name = ")
    with pytest.raises(PlanError, match="card bad.toml is not valid TOML") as err:
        cards.load_card.__wrapped__("bad.toml")
    assert err.value.file == "bad.toml"


def test_only_two_dimensional_weights_are_linear():
    assert cards.TensorTemplate("x.weight", ("a", "b"), "BF16", "attn", "mla").is_linear
    assert not cards.TensorTemplate("x.weight", ("a",), "BF16", "attn", "mla").is_linear
    assert not cards.TensorTemplate("x.bias", ("a", "b"), "BF16", "attn", "mla").is_linear
    assert not cards.TensorTemplate("x.weight", ("a", "b"), "BF16", "norm", "mla").is_linear


def test_an_empty_text_config_falls_back_to_the_top_level():
    flash = cards.load_card("glm-5.3-flash")
    config = flash.synth["config"]
    flat = {**config, **config["text_config"], "text_config": {}}
    assert flash.geometry(flat) == flash.geometry(config)
