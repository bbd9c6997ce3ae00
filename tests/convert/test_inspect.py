"""``glm-pack inspect`` and the plan: JSON keys, sizes, per-layer formats; headers only."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from glm_pack.convert import safetensors_io
from glm_pack.convert.checkpoint import open_checkpoint
from glm_pack.convert.cli import main
from glm_pack.convert.humanize import size_text
from glm_pack.convert.plan import make_plan
from glm_pack.packing.errors import PlanError

KEYS = {
    "schema",
    "source",
    "card",
    "architectures",
    "model_type",
    "geometry",
    "layers",
    "quantization",
    "files",
    "num_tensors",
    "total_bytes",
    "formats",
    "mla",
    "experts",
    "missing_tensors",
    "plan",
    "hub",
}


def test_inspect_json_reads_headers_only(synth_ckpt, monkeypatch):
    path = synth_ckpt("glm-5", "mxfp4-attn")
    reads = []
    original = safetensors_io.LocalFile.read

    def spy(self, offset, length):
        reads.append(length)
        return original(self, offset, length)

    monkeypatch.setattr(safetensors_io.LocalFile, "read", spy)
    result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert max(reads) < 1 << 20  # header reads only: every tensor read would be >= 14 MiB here
    report = json.loads(result.stdout)
    assert set(report) == KEYS and report["schema"] == "glm-pack.inspect/1"
    assert report["card"]["name"] == "glm-5" and report["geometry"]["qk_nope_head_dim"] == 192
    assert report["layers"]["mla"] == [0, 1, 2] and report["layers"]["mtp"] == [2]
    assert [m["format"] for m in report["mla"]] == ["mxfp4", "mxfp4", "bf16"]
    assert report["experts"] == [{"layer": 2, "count": 2, "formats": {"bf16": 6}}]
    assert report["missing_tensors"] == {"count": 0, "first": []}
    assert report["quantization"]["quant_method"] == "quark"
    sizes = {p.name: p.stat().st_size for p in path.glob("*.safetensors")}
    assert {f["name"]: f["bytes"] for f in report["files"]} == sizes and report["total_bytes"] == sum(sizes.values())
    plan = report["plan"]
    assert plan["route"] == "padded" and plan["k_stored"] == 256 and plan["quant_mode"] == "even"
    assert plan["reused_bytes"] == sum(p.stat().st_size for p in path.iterdir())
    mse = CliRunner().invoke(main, ["inspect", str(path), "--json", "--quant-mode", "mse"])
    assert mse.exit_code == 0 and json.loads(mse.stdout)["plan"]["quant_mode"] == "mse", mse.output


def test_plan_outputs_hand_computed(synth_ckpt):
    ck = open_checkpoint(synth_ckpt("glm-5", "fp8-block"))
    plan = make_plan(ck)
    job = plan.jobs[0]
    assert (job.layer, job.prefix, job.source_format) == (0, "model.layers.0", "fp8-block")
    assert job.source_tensors == [job.source, "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    shapes = {o.name.split("self_attn.")[1]: (o.shape, o.dtype, o.nbytes, o.layout) for o in job.outputs}
    assert shapes["w_kc.weight"] == (
        (64, 512, 128),
        "U8",
        64 * 512 * 128,
        {"layout": "bmm_nk", "k_logical": 192, "k_stored": 256},
    )
    assert shapes["w_kc.weight_scale"][:3] == ((64, 512, 8), "U8", 64 * 512 * 8)
    assert shapes["w_vc.weight"][:3] == ((64, 256, 256), "U8", 64 * 256 * 256)
    assert shapes["w_vc.weight_scale"][3] == {"layout": "bmm_nk", "k_logical": 512, "k_stored": 512}
    assert plan.overlay_bytes == 3 * (64 * 512 * 136 + 64 * 256 * 272)
    unpadded = make_plan(ck, k_pad="none", mla_precision="bf16", files="none")
    kc = unpadded.jobs[0].outputs[0]
    assert (unpadded.route, kc.shape, kc.dtype, len(unpadded.jobs[0].outputs)) == (
        "unpadded",
        (64, 512, 192),
        "BF16",
        2,
    )
    assert unpadded.reused_files == [] and unpadded.kernel_configs["gfx950"]["k_up"]["any"]["BLOCK_SIZE_K"] == 64
    for bad in (dict(k_pad="100"), dict(quant_mode="nearest"), dict(mla_precision="fp8"), dict(files="move")):
        with pytest.raises(PlanError):
            make_plan(ck, **bad)


def test_auto_plan_gives_the_overlay_size_as_a_range(synth_ckpt, tmp_path):
    """auto decides per tensor at convert time: inspect gives both ends, the all-BF16 one hand-computed (3 MLA
    layers of w_kc [64, 512, 256] and w_vc [64, 256, 512] in BF16) and equal to an all-BF16 auto conversion's."""
    from glm_pack.convert.convert import ConvertOptions, convert

    src = synth_ckpt("glm-5", "bf16")
    auto = make_plan(open_checkpoint(src), mla_precision="auto")
    assert auto.overlay_bytes == make_plan(open_checkpoint(src)).overlay_bytes
    assert auto.overlay_bytes_bf16 == 3 * 2 * (64 * 512 * 256 + 64 * 256 * 512)
    assert make_plan(open_checkpoint(src)).overlay_bytes_bf16 is None
    convert(src, tmp_path / "out", ConvertOptions(mla_precision="auto", max_rel_error=0.0))
    tensors = json.loads((tmp_path / "out" / "glm-pack" / "manifest.json").read_text())["tensors"]
    assert {t["dtype"] for t in tensors.values()} == {"BF16"}
    assert sum(2 * math.prod(t["shape"]) for t in tensors.values()) == auto.overlay_bytes_bf16
    result = CliRunner().invoke(main, ["inspect", str(src), "--mla-precision", "auto"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "(every tensor MXFP4) to 96.0 MiB (every tensor BF16;" in text


@pytest.mark.parametrize("k_pad, k_stored", [("64", 192), ("128", 256), ("512", 512)])
def test_k_pad_kept_where_pinned_configs_split_k_evenly(synth_ckpt, k_pad, k_stored):
    """GLM-5's nope is 192: the unpadded route's K-up configs take BLOCK_SIZE_K 64, the padded route's 256."""
    plan = make_plan(open_checkpoint(synth_ckpt("glm-5", "bf16")), k_pad=k_pad)
    assert plan.k_stored == k_stored
    assert all(k_stored % c["BLOCK_SIZE_K"] == 0 for c in plan.kernel_configs["gfx950"]["k_up"].values())


@pytest.mark.parametrize(
    "option, says",
    [
        ({"quant_mode": "nearest"}, "unknown MXFP4 scale mode 'nearest'"),
        ({"mla_precision": "fp8"}, "unknown MLA precision policy 'fp8'"),
        ({"files": "move"}, "files must be one of link, copy, none, got 'move'"),
    ],
)
def test_make_plan_refuses_unknown_options(synth_ckpt, option, says):
    with pytest.raises(PlanError, match=says):
        make_plan(open_checkpoint(synth_ckpt("glm-5", "bf16")), **option)


@pytest.mark.parametrize("k_pad, k_stored", [("224", 224), ("288", 288), ("160", 320)])
def test_k_pad_refused_where_pinned_configs_would_split_k_raggedly(synth_ckpt, k_pad, k_stored):
    ck = open_checkpoint(synth_ckpt("glm-5", "bf16"))
    with pytest.raises(PlanError, match=rf"K={k_stored}.*BLOCK_SIZE_K \[256\].*multiple of 256 \(e\.g\. 256\)"):
        make_plan(ck, k_pad=k_pad)
    with pytest.raises(PlanError, match=rf"K={k_stored}.*ragged"):  # auto stores MXFP4 wherever its error allows
        make_plan(ck, k_pad=k_pad, mla_precision="auto")
    assert make_plan(ck, k_pad=k_pad, mla_precision="bf16").k_stored == k_stored  # no aiter GEMM for BF16


def test_inspect_table_for_people(synth_ckpt):
    src = synth_ckpt("glm-5", "fp8-block")
    result = CliRunner().invoke(main, ["inspect", str(src)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "GLM-5 / GLM-5.1" in out and "fp8-block" in out and "U8 64x512x128" in out and "route padded" in out
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for layer in (0, 1, 2):  # the shard column: the 1-based numbers in the shard file names, from the index
        kv_b = f"model.layers.{layer}.self_attn.kv_b_proj."
        files = {f for name, f in weight_map.items() if name.startswith(kv_b)}
        shards = ",".join(str(int(f.split("-")[1])) for f in sorted(files))
        row = next(line for line in out.splitlines() if line.startswith(f"│ {layer} "))
        assert f"│ {shards} " in row, row


@pytest.mark.parametrize(
    "mtp, says", [(True, "layers: 2 decoder, MTP layer 2; MLA 0-2; "), (False, "layers: 2 decoder, no MTP; ")]
)
def test_inspect_layers_line_names_the_mtp_layer_not_a_count(synth_ckpt, mtp, says):
    """The line read 'layers: 2 + MTP 2' (layer 2 is the MTP layer, not two MTP layers) and 'layers: 2 + MTP -'."""
    r = CliRunner().invoke(main, ["inspect", str(synth_ckpt("glm-5", "bf16", mtp=mtp))])
    assert r.exit_code == 0 and r.stdout.splitlines()[2].startswith(says), r.stdout


def test_inspect_prints_sizes_as_convert_and_push_do(synth_ckpt):
    """inspect had a size format of its own: no originals reused read '0 files, 0.0 MiB' (and GiB had two decimals
    where convert's summary and push print one)."""
    r = CliRunner().invoke(main, ["inspect", str(synth_ckpt("glm-5", "bf16")), "--files", "none"])
    assert r.exit_code == 0 and r.stdout.rstrip().endswith("originals reused (none): 0 files, 0 B"), r.stdout


def test_inspect_counts_of_one_are_singular(synth_ckpt):
    """A one-layer checkpoint in one file read '1 files, ...' and 'overlay 8.5 MiB in 1 layers'."""
    r = CliRunner().invoke(main, ["inspect", str(synth_ckpt("glm-5", "bf16", layers=1, mtp=False))])
    assert r.exit_code == 0 and r.stdout.splitlines()[3].startswith("1 file, "), r.stdout
    assert " in 1 layer; originals reused (link): 3 files, " in r.stdout, r.stdout  # shard, index, config


def test_inspect_plans_the_expert_files_convert_writes(converted):
    """The expert files were left out of the plan; with --repack-experts they are there, as convert writes them."""
    src, out = converted  # converted with --repack-experts aiter-a4w4
    r = CliRunner().invoke(main, ["inspect", str(src), "--json", "--repack-experts", "aiter-a4w4"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    written = sorted((out / "glm-pack").glob("experts-*.safetensors"))
    assert [f["name"] for f in plan["expert_files"]] == [p.name for p in written] != []
    for entry, path in zip(plan["expert_files"], written, strict=True):
        with safe_open(path, framework="pt") as f:
            tensors = [f.get_tensor(name) for name in f.keys()]
        assert entry["tensors"] == len(tensors) and entry["bytes"] == sum(t.numel() * t.element_size() for t in tensors)
        assert entry["layer"] == int(path.name.split("-")[1])
    assert plan["expert_bytes"] == sum(f["bytes"] for f in plan["expert_files"])
    people = CliRunner().invoke(main, ["inspect", str(src), "--repack-experts", "aiter-a4w4"])
    files = f"{len(written)} file{'s' * (len(written) != 1)}"
    line = f"experts repacked (aiter-a4w4): {size_text(plan['expert_bytes'])} in {files} of at most 5 GB, MoE layer"
    assert line in people.stdout, people.output
    plain = json.loads(CliRunner().invoke(main, ["inspect", str(src), "--json"]).stdout)["plan"]
    assert (plain["repack_experts"], plain["expert_files"], plain["expert_bytes"]) == ("none", [], 0)


def test_inspect_refuses_repack_experts_where_convert_would(synth_ckpt):
    """The refusal says what the experts are (a small synthetic Quark checkpoint has only the MTP layer's, which
    Quark leaves unquantized: it said only that there were no MXFP4 ones)."""
    src = synth_ckpt("glm-5", "bf16")
    report = json.loads(CliRunner().invoke(main, ["inspect", str(src), "--json"]).stdout)
    layers = [e["layer"] for e in report["experts"]]
    r = CliRunner().invoke(main, ["inspect", str(src), "--repack-experts", "aiter-a4w4"])
    assert r.exit_code == 1 and r.stderr.strip().splitlines() == [
        "glm-pack: error: --repack-experts aiter-a4w4: the checkpoint has no MXFP4 routed-expert weights: the routed "
        f"experts it has (layer(s) {', '.join(map(str, layers))}) are bf16 (file {src})"
    ], r.output
    assert layers


def test_inspect_reports_tensors_the_config_implies_and_the_checkpoint_lacks(synth_ckpt, ckpt_copy, edit_index):
    """An export missing a layer's MLP weights converts (glm-pack touches MLA only), but an engine building the model
    from config.json cannot load it: inspect says so, counting every missing name, an MTP layer dropped whole
    aside (exports often leave it out)."""
    src = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    gone = {f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    edit_index(src, lambda wm: {k: v for k, v in wm.items() if k not in gone and not k.startswith("model.layers.2.")})
    report = json.loads(CliRunner().invoke(main, ["inspect", str(src), "--json"]).stdout)
    assert report["missing_tensors"]["count"] == 3 and set(report["missing_tensors"]["first"]) == gone
    assert report["layers"]["mla"] == [0, 1]  # the MTP layer 2 is not there and not counted missing
    r = CliRunner().invoke(main, ["inspect", str(src)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "config.json implies 3 tensors the checkpoint lacks, first model.layers.1.mlp." in r.stdout, r.stdout


@pytest.mark.parametrize("key, value, layer", [("num_hidden_layers", 1, 2), ("num_nextn_predict_layers", 0, 2)])
def test_a_layer_the_config_does_not_have_is_refused(synth_ckpt, ckpt_copy, tmp_path, key, value, layer):
    """Weights of more layers than config.json counts (a wrong num_hidden_layers, an MTP count of 0 over MTP weights):
    the extra layer was silently neither converted nor checked (with one decoder layer fewer, decoder layer 1 was
    converted as the MTP layer). One line naming the layer, its first tensor and the config's counts."""
    src = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps({**config, key: value}))
    for command in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "o")]):
        r = CliRunner().invoke(main, command)
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert f"the checkpoint holds layer {layer}, which config.json does not have (num_hidden_layers" in r.output
        assert f"{key} {value}" in r.output and "): the config and the weights disagree" in r.output, r.output
        assert f"tensor model.layers.{layer}." in r.output, r.output
    assert not (tmp_path / "o").exists()
