"""Synthetic checkpoints: determinism, realistic values, sharding, index, config, and an independent check
against the model classes of ``transformers`` (test-only dependency) for the families it knows."""

from __future__ import annotations

import errno
import hashlib
import json
import re

import pytest
import torch
from click.testing import CliRunner

from glm_pack.convert import cards, commands, synth
from glm_pack.convert.checkpoint import open_checkpoint
from glm_pack.convert.cli import main
from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.safetensors_io import LocalFile, parse_header
from glm_pack.convert.verify import verify
from glm_pack.packing.errors import PlanError


def _digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_same_arguments_same_bytes_other_seed_other_bytes(tmp_path):
    args = dict(card="glm-5", layers=1, experts=2, fmt="fp8-channel", mtp=False)
    a = synth.synthesize(tmp_path / "a", **args)
    b = synth.synthesize(tmp_path / "b", **args)
    c = synth.synthesize(tmp_path / "c", seed=1, **args)
    assert _digest(a) == _digest(b)
    da, dc = _digest(a), _digest(c)
    assert da["config.json"] == dc["config.json"] and all(da[k] != dc[k] for k in da if k.endswith(".safetensors"))


def test_a_non_empty_out_is_refused_and_overwrite_never_writes_through_hard_links(tmp_path):
    """A converted OUT hard-links the checkpoint's files: synthesizing another checkpoint into the same folder
    must replace those files, not rewrite them (which would change the converted output too)."""
    src, out = tmp_path / "src", tmp_path / "out"
    synth.synthesize(src, card="glm-5", layers=1, experts=2, fmt="bf16", mtp=False)
    convert(src, out, ConvertOptions(files="link"))
    assert (out / "config.json").stat().st_ino == (src / "config.json").stat().st_ino  # linked, as by default
    linked = _digest(out)
    r = CliRunner().invoke(main, ["synth", str(src), "--card", "glm-5", "--layers", "2", "--experts", "2",
                                  "--format", "fp8-block"])  # fmt: skip
    assert r.exit_code == 1 and "not empty" in r.output and "--overwrite" in r.output
    r = CliRunner().invoke(main, ["synth", str(src), "--card", "glm-5", "--layers", "2", "--experts", "2",
                                  "--format", "fp8-block", "--overwrite"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads((src / "config.json").read_text())["num_hidden_layers"] == 2
    assert _digest(out) == linked and verify(out).ok
    fresh = synth.synthesize(tmp_path / "fresh", card="glm-5", layers=2, experts=2, fmt="fp8-block")
    assert _digest(src) == _digest(fresh)  # no file of the first checkpoint is left


def test_an_out_that_cannot_be_created_is_one_line(tmp_path):
    """An OUT under a file, or a symlink to nothing: one line naming what is in the way, for every command that makes
    OUT (they said "Not a directory" naming OUT, or convert "cannot create the output lock: File exists")."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    args = ["--card", "glm-5", "--layers", "1", "--experts", "2", "--format", "bf16"]
    src = synth.synthesize(tmp_path / "src", card="glm-5", layers=1, experts=2, fmt="bf16")
    afile, dangling = tmp_path / "afile", tmp_path / "dangling"
    for out, says in (
        (afile / "o", f"cannot create the output folder: {afile} is a file, not a folder"),
        (dangling, f"cannot create the output folder: {dangling} is a symlink to {tmp_path / 'gone'}, which does not "
         "exist; create that folder or remove the link"),
    ):  # fmt: skip
        for cmd in (["synth", str(out), *args], ["demo", str(out)], ["convert", str(src), str(out)]):
            r = CliRunner().invoke(main, cmd)
            errors = [line for line in r.output.splitlines() if line.startswith("glm-pack: error:")]
            assert r.exit_code == 1 and "Traceback" not in r.output and len(errors) == 1, r.output
            assert errors[0].startswith(f"glm-pack: error: {says}"), (cmd, r.output)
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("fault", ["unreadable", "latin-1"])
def test_a_card_file_that_cannot_be_read_is_one_line(tmp_path, fault, refuse):
    """A family card given by path (``--card my.toml``) that cannot be read (a permission, an I/O error) or is not
    UTF-8: one line naming it, exit 1, nothing written (a raw OSError / UnicodeDecodeError traceback before)."""
    card = tmp_path / "my.toml"
    card.write_bytes((cards.resources.files("glm_pack.cards") / "glm-5.toml").read_bytes() + b"# caf\xe9\n")
    if fault == "unreadable":
        refuse(type(card), "open", card, errno.EIO)
    args = ["--card", str(card), "--layers", "1", "--experts", "2", "--format", "bf16"]
    r = CliRunner().invoke(main, ["synth", str(tmp_path / "out"), *args])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    why = "cannot read card .*: Input/output error" if fault == "unreadable" else "is not valid TOML: 'utf-8' codec"
    assert re.search(f"^glm-pack: error: .*{why}", r.output) and r.output.count(str(card)) == 1, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mb", ["0", "-5"])
def test_shard_size_must_be_positive(tmp_path, mb):
    r = CliRunner().invoke(main, ["synth", str(tmp_path / "s"), "--card", "glm-5", "--layers", "1", "--experts", "2",
                                  "--format", "bf16", "--shard-mb", mb])  # fmt: skip
    assert r.exit_code == 2 and "--shard-mb" in r.output and not (tmp_path / "s").exists()


def test_demo_without_a_usable_temp_folder_is_one_line(monkeypatch):
    """demo without WORKDIR where no work folder can be made in the temp folder (full, read-only, another user's):
    one line naming it, exit 1; it was the raw OSError (a traceback)."""
    tried = "/tmp/glm-pack-demo-x"

    def mkdtemp(*args, **kwargs):
        raise PermissionError(13, "Permission denied", tried)

    monkeypatch.setattr(commands.tempfile, "mkdtemp", mkdtemp)
    r = CliRunner().invoke(main, ["demo"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert f"cannot create the demo's work folder: Permission denied (file {tried})" in r.output, r.output


@pytest.mark.parametrize("layers", ["0", "-1"])
def test_demo_refuses_no_layers_by_its_own_option(tmp_path, layers):
    """`demo --layers 0` printed its first step, then 'need at least one layer and one expert, got layers=0
    experts=4', naming an experts count the demo has no option for; it is now a usage error naming --layers."""
    r = CliRunner().invoke(main, ["demo", str(tmp_path / "d"), "--layers", layers])
    assert r.exit_code == 2 and "'--layers'" in r.output and "experts" not in r.output, r.output
    assert "1/4" not in r.output and not (tmp_path / "d").exists()


@pytest.mark.parametrize("option", ["--layers", "--experts"])
def test_synth_refuses_a_count_below_one_as_a_usage_error(tmp_path, option):
    """README: numbers out of range are click's usage errors, exit 2 (`synth --layers 0` exited 1); the API says it
    in its own words."""
    counts = {"--layers": "1", "--experts": "1", option: "0"}
    numbers = [x for kv in counts.items() for x in kv]
    r = CliRunner().invoke(main, ["synth", str(tmp_path / "s"), "--card", "glm-5", "--format", "bf16", *numbers])
    assert r.exit_code == 2 and f"Invalid value for '{option}': 0 is not in the range x>=1" in r.output, r.output
    assert not (tmp_path / "s").exists()
    with pytest.raises(PlanError, match=f"need at least one layer and one expert, got layers={counts['--layers']}"):
        synth.synthesize(tmp_path / "s", card="glm-5", layers=int(counts["--layers"]),
                         experts=int(counts["--experts"]), fmt="bf16")  # fmt: skip


def test_demo_runs_twice_in_one_workdir_and_keeps_the_rest(tmp_path):
    """The quick start: exit 0, each step printed, the output verified, and the runtime's error against unabsorbed
    float MLA below the README's first-order bound (about 0.67 for all-MXFP4 GLM-5 layers), MXFP4 activations
    adding error to bf16 ones; run again in the same WORKDIR it replaces its two folders and nothing else."""
    (tmp_path / "mine.txt").write_text("mine")
    for _ in range(2):
        r = CliRunner().invoke(main, ["demo", str(tmp_path), "--layers", "1"])
        assert r.exit_code == 0, r.output
        assert all(f"{step}/4" in r.output for step in range(1, 5)), r.output
        errors = [float(e) for e in re.findall(r"output rel error ([0-9.]+) vs unabsorbed float MLA", r.output)]
        assert len(errors) == 2 and 0 < errors[1] < errors[0] < 0.67, errors
        done = f"done: both folders are in {tmp_path}; next: glm-pack inspect {tmp_path / 'glm-5-small'}"
        assert r.output.splitlines()[-1] == done, r.output
        assert verify(tmp_path / "glm-5-small-gfx950").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["glm-5-small", "glm-5-small-gfx950", "mine.txt"]
    assert (tmp_path / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize("folder", ["glm-5-small", "glm-5-small-gfx950"])
def test_demo_does_not_write_through_a_linked_folder(tmp_path, folder):
    """A WORKDIR whose demo folder is a link elsewhere: the demo emptied the folder the link points to (it replaces
    its two folders). One line naming the link; the target's files stay."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / folder).symlink_to(victim)
    r = CliRunner().invoke(main, ["demo", str(tmp_path / "w"), "--layers", "1"])
    assert r.exit_code == 1 and f"{tmp_path / 'w' / folder} is a symlink (to {victim})" in r.output, r.output
    assert "1/4" not in r.output and [p.name for p in victim.iterdir()] == ["keep.txt"]


def test_values_are_realistic(synth_ckpt):
    ck = open_checkpoint(synth_ckpt("glm-5", "bf16"))
    w = ck.read_float("model.layers.0.self_attn.kv_b_proj.weight")
    row_max = w.abs().amax(dim=1)
    typical = row_max.median()
    outliers = int((row_max > 4 * typical).sum())
    assert 1 <= outliers <= 4  # a few outlier rows
    plain = w[row_max <= 4 * typical]
    assert 0.019 < float(plain.std()) < 0.021
    norm = ck.read_float("model.layers.0.input_layernorm.weight")
    assert abs(float(norm.mean()) - 1.0) < 0.01
    bias = ck.read_raw("model.layers.0.self_attn.indexer.k_norm.bias").float()  # a LayerNorm bias starts near 0
    assert abs(float(bias.mean())) < 0.01


@pytest.mark.parametrize("card", ["glm-5", "glm-5.2", "glm-5.3-flash", "deepseek-v3"])
def test_router_tensors_keep_their_own_dtypes(synth_ckpt, card):
    """Whatever the format, the router's gate weight is BF16 and its score-correction bias F32, as DeepSeek-V3 stores
    them (the cards' stated assumption for GLM); in every MoE layer written."""
    ck = open_checkpoint(synth_ckpt(card, "fp8-block", layers=4))
    names = [n for n in ck.names() if n.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))]
    assert names and len(names) % 2 == 0
    for name in names:
        want = torch.float32 if name.endswith("bias") else torch.bfloat16
        assert ck.read_raw(name).dtype == want, name


def test_top_k_is_clamped_to_the_experts_written():
    """A checkpoint with fewer experts than the card's top-k routes to all of them; with more, top-k is the card's."""
    glm5 = cards.load_card("glm-5")
    top_k = [
        synth.synth_config(glm5, layers=2, experts=e, fmt="bf16", profile="small", mtp=True)["num_experts_per_tok"]
        for e in (2, 16)
    ]
    assert top_k == [2, 8] and glm5.synth["config"]["num_experts_per_tok"] == 8


def test_tensors_of_one_shape_get_their_own_values(synth_ckpt):
    """Values are seeded by (seed, tensor name): two layers' kv_b_proj must differ, or a wrong-layer mix-up
    downstream (overlay layer vs served layer) could not be told apart on a synthetic checkpoint."""
    ck = open_checkpoint(synth_ckpt("glm-5", "bf16"))
    a, b = (ck.read_float(f"model.layers.{i}.self_attn.kv_b_proj.weight") for i in (0, 2))
    assert a.shape == b.shape and not torch.equal(a, b)


def test_shards_stay_within_the_shard_size(tmp_path):
    limit = 4 << 20
    path = synth.synthesize(tmp_path / "s", card="glm-5", layers=1, experts=2, fmt="bf16", shard_bytes=limit)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 3
    for shard in shards:  # a tensor larger than the limit alone; otherwise the tensors fit the limit
        sizes = [e.nbytes for e in parse_header(LocalFile(shard)).tensors.values()]
        assert len(sizes) == 1 or sum(sizes) <= limit, (shard.name, sum(sizes), len(sizes))


def test_small_profile_keeps_the_mla_geometry(synth_ckpt):
    path = synth_ckpt("glm-5", "bf16")
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"], config["q_lora_rank"]) == (256, 1024, 128)
    assert (config["num_attention_heads"], config["kv_lora_rank"], config["qk_nope_head_dim"]) == (64, 512, 192)
    assert (config["qk_rope_head_dim"], config["v_head_dim"]) == (64, 256)
    assert (config["num_hidden_layers"], config["n_routed_experts"], config["num_nextn_predict_layers"]) == (2, 2, 1)
    ck = open_checkpoint(path)
    assert ck.info("model.layers.2.self_attn.kv_b_proj.weight").shape == (28672, 512)


def test_shards_index_and_scale_split(synth_ckpt):
    path = synth_ckpt("glm-5", "mxfp4-attn")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert list(wm) == sorted(wm)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and all(p.name.endswith(f"-of-{len(shards):05d}.safetensors") for p in shards)
    total = 0
    for shard in shards:
        header = parse_header(LocalFile(shard))
        assert header.metadata == {"format": "pt"}
        assert {n for n, f in wm.items() if f == shard.name} == set(header.tensors)
        total += sum(e.nbytes for e in header.tensors.values())
    assert index["metadata"]["total_size"] == total
    weight = "model.layers.0.self_attn.kv_b_proj"
    assert wm[f"{weight}.weight"] != wm[f"{weight}.weight_scale"]


@pytest.mark.parametrize("mtp, count", [(True, 1), (False, 0)])
def test_config_counts_the_mtp_layer_only_when_written(mtp, count):
    config = synth.synth_config(cards.load_card("glm-5"), layers=2, experts=2, fmt="bf16", profile="small", mtp=mtp)
    assert config["num_nextn_predict_layers"] == count


def test_per_layer_config_lists():
    c52 = synth.synth_config(cards.load_card("glm-5.2"), layers=8, experts=2, fmt="bf16", profile="small", mtp=True)
    assert c52["indexer_types"] == ["full", "full", "full", "shared", "shared", "shared", "full", "shared"]
    flash = synth.synth_config(
        cards.load_card("glm-5.3-flash"), layers=8, experts=2, fmt="bf16", profile="full", mtp=True
    )
    text = flash["text_config"]
    assert text["full_attn_layers"] == [3, 7] and text["layer_types"][3] == "indexed_attention"
    assert text["hidden_size"] == 4096 and text["num_hidden_layers"] == 8
    with pytest.raises(PlanError, match="unknown synthetic format"):
        synth.synth_config(cards.load_card("glm-5"), layers=1, experts=1, fmt="int4", profile="small", mtp=True)


def test_flash_assumptions_are_surfaced(tmp_path):
    assert {"num_attention_heads", "v_head_dim", "hidden_size", "vocab_size"} <= set(synth.assumptions("glm-5.3-flash"))
    result = CliRunner().invoke(
        main,
        [
            "synth",
            str(tmp_path / "f"),
            "--card",
            "glm-5.3-flash",
            "--layers",
            "1",
            "--experts",
            "1",
            "--format",
            "bf16",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "assumed v_head_dim" in result.output and "wrote" in result.output
    ck = open_checkpoint(tmp_path / "f")
    assert ck.mla_layers() == [1] and ck.geometry.qk_rope_head_dim == 0
    assert ck.info("model.language_model.layers.1.self_attn.kv_b_proj.weight").shape == (32768, 512)
    assert "model.language_model.layers.0.self_attn.q_conv1d.weight" in ck


@pytest.mark.parametrize("mtp", [True, False])
def test_mtp_assumption_printed_only_with_the_mtp_layer(tmp_path, mtp):
    args = ["synth", str(tmp_path / "s"), "--card", "glm-5", "--layers", "1", "--experts", "1", "--format", "bf16"]
    result = CliRunner().invoke(main, args + ([] if mtp else ["--no-mtp"]))
    assert result.exit_code == 0, result.output
    assert ("assumed mtp_shared_head" in result.output) is mtp
    assert "assumed router_dtype" in result.output  # the other assumptions stay either way
    assert bool(open_checkpoint(tmp_path / "s").layer_plan.mtp) is mtp


TRANSFORMERS_FAMILIES = [
    ("glm-5.2", "GlmMoeDsaConfig"),
    ("deepseek-v3", "DeepseekV3Config"),
    ("glm-5.3-flash", "Glm5NextConfig"),
]


@pytest.mark.parametrize("card, config_class", TRANSFORMERS_FAMILIES, ids=[c for c, _ in TRANSFORMERS_FAMILIES])
def test_transformers_loads_the_synthetic_checkpoint(synth_ckpt, card, config_class):
    """transformers' own loader (its key renames and expert merging) must find every parameter, each with
    the right shape, and nothing unexpected apart from the MTP layer it does not model."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    transformers.logging.set_verbosity_error()
    path = synth_ckpt(card, "bf16", layers=4, experts=2)
    config = transformers.AutoConfig.from_pretrained(path)
    if card == "glm-5.3-flash":
        config.vision_config.depth = 1  # the synthetic checkpoint holds the text model only
        model_class = transformers.Glm5NextForConditionalGeneration
    else:
        model_class = transformers.AutoModelForCausalLM
    _, info = model_class.from_pretrained(path, config=config, dtype=torch.bfloat16, output_loading_info=True)
    mtp = cards.load_card(card).layer_prefix(4) + "."
    assert [k for k in info["missing_keys"] if not k.startswith("model.visual.")] == []
    assert not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith(mtp) for k in info["unexpected_keys"])


def test_one_shard_is_singular(tmp_path):
    """synth's line said 'wrote OUT: 1 shards, ...'."""
    args = ["synth", str(tmp_path / "s"), "--card", "glm-5", "--layers", "1", "--experts", "1", "--format", "bf16"]
    r = CliRunner().invoke(main, [*args, "--no-mtp"])
    assert r.exit_code == 0 and f"wrote {tmp_path / 's'}: 1 shard, " in r.stdout, r.stdout
