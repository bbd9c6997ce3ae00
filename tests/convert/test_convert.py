"""`glm-pack convert` / `verify` end to end on synthetic checkpoints of every card and source format."""

from __future__ import annotations

import builtins
import collections
import errno
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import time

import click
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm_pack import runtime
from glm_pack.convert import convert as convert_module
from glm_pack.convert.checkpoint import Checkpoint, open_checkpoint
from glm_pack.convert.cli import main
from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.items import plan_items
from glm_pack.convert.safetensors_io import LocalFile
from glm_pack.convert.verify import verify
from glm_pack.packing.errors import GlmPackError, ManifestError, PlanError
from glm_pack.packing.mxfp4 import dequantize, quantize


def tree_digest(root):
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def overlay_bytes(out):
    return {p.name: p.read_bytes() for p in sorted((out / "glm-pack").glob("*.safetensors"))}


def manifest(out):
    return json.loads((out / "glm-pack" / "manifest.json").read_text())


def source_kv_b(src, name):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    with safe_open(src / index["weight_map"][name], framework="pt") as f:
        return f.get_tensor(name)


def split(kv_b, g):
    per = kv_b.view(g["num_heads"], g["qk_nope_head_dim"] + g["v_head_dim"], g["kv_lora_rank"])
    return per[:, : g["qk_nope_head_dim"]].transpose(1, 2), per[:, g["qk_nope_head_dim"] :]


def overlay_tensor(out, name):
    entry = manifest(out)["tensors"][name]
    with safe_open(out / "glm-pack" / entry["file"], framework="pt") as f:
        return f.get_tensor(name)


CASES = [
    ("glm-5", "bf16"),
    ("glm-5", "fp8-block"),
    ("glm-5", "fp8-channel"),
    ("glm-5", "mxfp4-attn"),
    ("glm-5", "mxfp4-quark"),
    ("glm-5.2", "bf16"),
    ("glm-5.3-flash", "bf16"),
    ("deepseek-v3", "fp8-block"),
]


@pytest.mark.parametrize("card, fmt", CASES)
def test_convert_each_card_and_format(synth_ckpt, tmp_path, card, fmt):
    src = synth_ckpt(card, fmt)
    before = tree_digest(src)
    out = tmp_path / "out"
    report = convert(src, out, ConvertOptions())
    m = manifest(out)
    g = m["model"]["geometry"]
    assert [e["layer"] for e in m["mla"]] == [r.layer for r in report.layers] and m["mla"]
    for entry in m["mla"]:
        name = entry["source"]["tensor"]
        from glm_pack.convert.checkpoint import open_checkpoint

        ref_kc, ref_vc = split(open_checkpoint(src).read_float(name), g)
        kc, kc_s = overlay_tensor(out, entry["w_kc"]["weight"]), overlay_tensor(out, entry["w_kc"]["scale"])
        k, ks = entry["w_kc"]["layout"]["k_logical"], entry["w_kc"]["layout"]["k_stored"]
        # Codes are the even rule applied to the float source split; padding is exact.
        codes, scales = quantize(ref_kc, mode="even")
        assert torch.equal(kc[..., : k // 2], codes) and torch.equal(kc_s[..., : k // 32], scales)
        assert torch.all(kc[..., k // 2 :] == 0) and torch.all(kc_s[..., k // 32 :] == 0x7F)
        assert ks == (256 if g["qk_nope_head_dim"] == 192 else g["qk_nope_head_dim"])
        vc, vc_s = overlay_tensor(out, entry["w_vc"]["weight"]), overlay_tensor(out, entry["w_vc"]["scale"])
        if entry["source"]["format"] == "mxfp4":  # w_vc is the source's own bytes (row slices of kv_b_proj)
            index = json.loads((src / "model.safetensors.index.json").read_text())
            raw = load_file(src / index["weight_map"][name])[name]
            scale_name = name + "_scale"
            raw_s = load_file(src / index["weight_map"][scale_name])[scale_name]
            assert torch.equal(vc, split(raw, {**g, "kv_lora_rank": g["kv_lora_rank"] // 2})[1])
            assert torch.equal(vc_s, split(raw_s, {**g, "kv_lora_rank": g["kv_lora_rank"] // 32})[1])
            assert entry["w_vc"]["rel_error"] == 0.0
        else:
            assert torch.equal(vc, quantize(ref_vc, mode="even")[0])
        # Dequantized overlay within the quantization bound of the float source.
        err = float((dequantize(codes, scales).double() - ref_kc.double()).norm() / ref_kc.double().norm())
        assert err == pytest.approx(entry["w_kc"]["rel_error"], rel=1e-4) and err < 0.2
    if fmt == "mxfp4-attn":
        assert any(e["source"]["format"] == "mxfp4" for e in m["mla"])
    assert tree_digest(src) == before  # nothing the user had is modified
    for rel, digest in before.items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest  # originals identical, index too
    assert verify(out).ok


def test_mxfp4_kv_b_proj_read_once_per_layer(synth_ckpt, tmp_path, monkeypatch):
    """An MXFP4 kv_b_proj feeds both the float split and the byte-exact w_vc: convert and verify read its codes and
    scales once per layer, so both come from the same bytes (and the hashed bytes are the ones used)."""
    src = synth_ckpt("glm-5", "mxfp4-attn")
    reads = collections.Counter()
    read_raw = Checkpoint.read_raw

    def counting(self, name):
        reads[name] += 1
        return read_raw(self, name)

    monkeypatch.setattr(Checkpoint, "read_raw", counting)
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(files="none", workers=1))
    layers = manifest(out)["mla"]
    mx = [e["source"]["tensor"] for e in layers if e["source"]["format"] == "mxfp4"]
    assert mx  # the MTP layer's kv_b_proj stays BF16 in this format
    expected = {e["source"]["tensor"]: 1 for e in layers} | {name + "_scale": 1 for name in mx}
    assert {n: c for n, c in reads.items() if "kv_b_proj" in n} == expected
    reads.clear()
    report = verify(out)
    assert report.ok and report.source_checked
    assert {n: c for n, c in reads.items() if "kv_b_proj" in n} == expected


def test_deterministic_and_worker_count_independent(synth_ckpt, tmp_path):
    src = synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2)  # layer 3: first MoE layer
    outs = []
    for i, workers in enumerate((1, 2, 1)):
        out = tmp_path / f"out{i}"
        convert(src, out, ConvertOptions(files="none", workers=workers, repack_experts="aiter-a4w4"))
        outs.append(out)
    assert overlay_bytes(outs[0]) == overlay_bytes(outs[1]) == overlay_bytes(outs[2])
    m = [manifest(o) for o in outs]
    for x in m:
        x.pop("created")
    assert m[0] == m[1] == m[2]
    assert len(m[0]["experts"]["groups"]) >= 1


def test_mse_mode_never_worse_and_recorded(synth_ckpt, tmp_path):
    src = synth_ckpt("glm-5", "bf16")
    convert(src, tmp_path / "even", ConvertOptions(files="none"))
    convert(src, tmp_path / "mse", ConvertOptions(files="none", quant_mode="mse"))
    for a, b in zip(manifest(tmp_path / "even")["mla"], manifest(tmp_path / "mse")["mla"], strict=True):
        for p in ("w_kc", "w_vc"):
            assert b[p]["quant"]["mode"] == "mse" and b[p]["rel_error"] <= a[p]["rel_error"]
    assert verify(tmp_path / "mse").ok


def test_auto_keeps_planted_hard_layer_in_bf16(synth_ckpt, tmp_path, ckpt_copy, edit_tensor):
    src = ckpt_copy(synth_ckpt("glm-5", "bf16"))

    def hard(t):
        # One outlier (1.0) per 32-block along both reduction axes (kv_lora for w_vc, nope for w_kc): the other 31
        # elements (+-0.06) fall below half the smallest code step and flush to zero, ~30% relative error.
        w = torch.sign(t.float()) * 0.06
        w[:, ::32] = 1.0
        w[::32, :] = 1.0
        return w.bfloat16()

    edit_tensor(src, "model.layers.1.self_attn.kv_b_proj.weight", hard)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["convert", str(src), str(out), "--mla-precision", "auto", "--max-rel-error", "0.2", "--files", "copy"]
    )
    assert result.exit_code == 0, result.output
    layers = {e["layer"]: e for e in manifest(out)["mla"]}
    assert layers[1]["w_kc"]["precision"] == layers[1]["w_vc"]["precision"] == "bf16"
    assert layers[1]["w_kc"]["mxfp4_rel_error"] > 0.2 and layers[1]["w_kc"]["rel_error"] < 5e-3
    assert layers[0]["w_kc"]["precision"] == "mxfp4"
    mla = manifest(out)["mla"]
    rows = [line.strip("│").split("│") for line in result.stdout.splitlines() if line.startswith("│")]
    cells = {int(row[0]): [cell.strip() for cell in row[1:]] for row in rows}
    for e in mla:  # the summary table shows each projection's decision, error and worst head's error
        want = [
            v
            for p in (e["w_kc"], e["w_vc"])
            for v in (p["precision"], f"{p['rel_error']:.4f}", f"{p['max_head_rel_error']:.4f}")
        ]
        assert cells.pop(e["layer"]) == want, result.stdout
    assert not cells, result.stdout
    kc, vc = (f"{max(e[p]['rel_error'] for e in mla):.4f}" for p in ("w_kc", "w_vc"))
    hkc, hvc = (f"{max(e[p]['max_head_rel_error'] for e in mla):.4f}" for p in ("w_kc", "w_vc"))
    summary = [line for line in result.stdout.splitlines() if " MLA layers, overlay " in line]
    assert len(summary) == 1 and summary[0].startswith(f"{len(mla)} MLA layers, "), result.stdout
    assert ", 2 tensors kept in BF16; " in summary[0] and kc != vc  # layer 1's w_kc and w_vc
    expect = f"; rel error w_kc max {kc}, worst head {hkc}, w_vc max {vc}, worst head {hvc}; "
    assert expect in summary[0] and hkc != kc, summary[0]
    assert verify(out).ok


@pytest.mark.parametrize("files", ["link", "copy"])
def test_the_summary_counts_what_the_manifest_holds(synth_ckpt, tmp_path, files):
    """convert's summary line against the manifest and OUT: the overlay's bytes (expert files included), the expert
    tensors repacked, the originals placed (linked or copied alike); the manifest records the options as named."""
    src = synth_ckpt("glm-5", "mxfp4-quark", layers=4)
    out = tmp_path / "out"
    args = ["convert", str(src), str(out), "--repack-experts", "aiter-a4w4", "--files", files]
    result = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    m = manifest(out)
    total = sum(f["size"] for f in m["files"].values())
    assert m["experts"]["groups"] and 2**20 <= total < 2**30
    experts = sum(len(g["tensors"]) for g in m["experts"]["groups"])
    originals = [p for p in out.rglob("*") if p.is_file() and "glm-pack" not in p.parts and not p.name.startswith(".")]
    assert len(originals) == sum(1 for p in src.iterdir() if p.is_file()) > 1
    summary = next(line for line in result.stdout.splitlines() if " MLA layers, overlay " in line)
    want = f"overlay {total / 2**20:,.1f} MiB, {experts} expert tensors repacked, {len(originals)} original files "
    assert want in summary, summary
    assert m["options"] == {
        "quant_mode": "even",
        "k_pad": 256,  # the card's K multiple, resolved
        "mla_precision": "mxfp4",
        "max_rel_error": None,
        "files": files,
        "repack_experts": "aiter-a4w4",
    }


def test_mxfp4_source_w_vc_keeps_bytes_no_rule_would_write(synth_ckpt, tmp_path, ckpt_copy, edit_tensor):
    """w_vc of an MXFP4 kv_b_proj is its V rows byte for byte (mode "source"), even where requantizing would
    write other bytes for the same values: a block of codes 0x1 (0.5) under scale s, which the even rule would
    store as codes 0x6 (4.0) under s - 3."""
    src = ckpt_copy(synth_ckpt("glm-5", "mxfp4-attn"))
    nope = json.loads((src / "config.json").read_text())["qk_nope_head_dim"]
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(n for n in sorted(weight_map) if n.endswith("kv_b_proj.weight") and n + "_scale" in weight_map)

    def small_block(codes):
        codes = codes.clone()
        codes[nope, :16] = 0x11  # head 0's first V row, its first 32 elements
        return codes

    edit_tensor(src, name, small_block)
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(files="none"))
    entry = next(e for e in manifest(out)["mla"] if e["source"]["tensor"] == name)
    g = manifest(out)["model"]["geometry"]
    raw, raw_s = source_kv_b(src, name), source_kv_b(src, name + "_scale")
    vc, vc_s = overlay_tensor(out, entry["w_vc"]["weight"]), overlay_tensor(out, entry["w_vc"]["scale"])
    assert vc[0, 0, :16].tolist() == [0x11] * 16
    assert torch.equal(vc, split(raw, {**g, "kv_lora_rank": g["kv_lora_rank"] // 2})[1])
    assert torch.equal(vc_s, split(raw_s, {**g, "kv_lora_rank": g["kv_lora_rank"] // 32})[1])
    assert entry["w_vc"]["quant"]["mode"] == "source" and entry["w_vc"]["rel_error"] == 0.0
    assert verify(out).ok


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp4-attn"])
def test_source_fingerprint_holds_each_kv_b_proj_and_its_scale(synth_ckpt, tmp_path, fmt):
    """The manifest fingerprints every stored tensor a layer was decoded from, scales included (a changed scale
    changes the layer): the sha256 of its stored bytes, as the safetensors library reads them."""
    src = synth_ckpt("glm-5", fmt)
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(files="none"))
    m = manifest(out)
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    expected = {}
    for entry in m["mla"]:
        weight = entry["source"]["tensor"]
        module = weight.removesuffix(".weight")
        for name in (weight, module + ".weight_scale_inv", module + ".weight_scale"):
            if name in weight_map:
                raw = load_file(src / weight_map[name])[name]
                expected[name] = hashlib.sha256(raw.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    assert any(n.endswith("_scale_inv" if fmt == "fp8-block" else "_scale") for n in expected)
    assert {n: m["source"]["tensors"].get(n) for n in expected} == expected
    assert set(m["source"]["tensors"]) == set(expected)


def test_k_pad_none_keeps_192(synth_ckpt, tmp_path):
    out = tmp_path / "out"
    convert(synth_ckpt("glm-5", "bf16"), out, ConvertOptions(files="none", k_pad="none"))
    m = manifest(out)
    assert m["kernel_configs"]["route"] == "unpadded"
    assert m["tensors"][m["mla"][0]["w_kc"]["weight"]]["shape"] == [64, 512, 96]
    # The unpadded route pins the seed's K-up BLOCK_SIZE_K=64 in every bucket.
    assert {c["BLOCK_SIZE_K"] for c in m["kernel_configs"]["configs"]["gfx950"]["k_up"].values()} == {64}


def test_overwrite_leaves_nothing_of_the_old_contents(synth_ckpt, tmp_path):
    """--overwrite replaces OUT's contents: an earlier output of another checkpoint (its shards, config, card) and
    files of the user's go; originals hard-linked from the earlier source stay intact there."""
    old_src, src = synth_ckpt("glm-5", "bf16", layers=3), synth_ckpt("glm-5", "fp8-block")
    out = tmp_path / "out"
    convert(old_src, out, ConvertOptions(files="link"))
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "more.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in old_src.iterdir() if p.is_file()}
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--overwrite", "--quiet"])
    assert r.exit_code == 0, r.output
    placed = {p.name for p in out.iterdir()} - {"glm-pack", ".glm-pack.lock"}
    assert placed == {p.name for p in src.iterdir()}  # the new source's files, nothing else
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert {p.name: p.read_bytes() for p in old_src.iterdir() if p.is_file()} == before
    assert verify(out).ok


@pytest.mark.parametrize("planted", ["glm-pack is a file", "manifest.json is a folder"])
def test_overwrite_replaces_an_overlay_of_the_wrong_kind(synth_ckpt, tmp_path, planted):
    """README: --overwrite deletes everything in OUT first, whatever kind of entry holds the overlay's names."""
    src = synth_ckpt("glm-5", "bf16")
    out = tmp_path / "out"
    out.mkdir()
    if planted == "glm-pack is a file":
        (out / "glm-pack").write_text("mine")
    else:
        (out / "glm-pack" / "manifest.json").mkdir(parents=True)
        (out / "glm-pack" / "manifest.json" / "inside").write_text("mine")
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--overwrite", "--quiet", "--files", "none"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert (out / "glm-pack" / "manifest.json").is_file() and verify(out).ok


def test_quiet_convert_prints_nothing(synth_ckpt, tmp_path):
    """--quiet: no progress bar, no summary, on success too."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(synth_ckpt("glm-5", "bf16")), str(out), "--quiet", "--files", "none"])
    assert r.exit_code == 0 and r.output == "", r.output
    assert verify(out).ok


@pytest.mark.parametrize("files, rate", [("copy", True), ("link", False)])
def test_progress_shows_the_originals_being_placed(synth_ckpt, tmp_path, files, rate):
    """After the overlay files, --files copy of a GLM-5 copies hundreds of GB; the bar stood still at N/N meanwhile."""
    src = synth_ckpt("glm-5", "bf16")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--files", files], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    bars = {line.split("━")[0].strip(): line for line in r.stdout.splitlines() if "━ " in line and line[0].isalpha()}
    originals = len(list(src.iterdir()))
    assert list(bars) == ["overlay files", "original files"], r.stdout
    assert " 3/3 " in bars["overlay files"] and f" {originals}/{originals} " in bars["original files"]
    assert ("MiB/s" in bars["original files"]) == rate  # hard links move no bytes: no rate


def test_debug_lets_the_error_through(tmp_path):
    """--debug: the error itself propagates (Python prints its traceback) instead of the one line."""
    args = ["convert", str(tmp_path / "nope"), str(tmp_path / "o")]
    r = CliRunner().invoke(main, ["--debug", *args])
    assert isinstance(r.exception, GlmPackError) and "glm-pack: error:" not in r.output, r.output
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and r.stderr.startswith("glm-pack: error: ") and str(tmp_path / "nope") in r.stderr


def test_ragged_k_pad_is_refused_before_any_output(synth_ckpt, tmp_path):
    r = CliRunner().invoke(main, ["convert", str(synth_ckpt("glm-5", "bf16")), str(tmp_path / "out"), "--k-pad", "224"])
    assert r.exit_code == 1 and "K=224" in r.output and "ragged" in r.output
    assert not (tmp_path / "out").exists()


def test_every_option_of_every_command_has_help():
    """README: `glm-pack COMMAND --help` shows every option (synth's --profile / --seed, inspect's
    --mla-precision had none)."""
    bare = [
        f"{name} {'/'.join(p.opts)}"
        for name, command in main.commands.items()
        for p in command.params
        if isinstance(p, click.Option) and not p.help
    ]
    assert bare == []


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize("k_pad", ["48", "foo", "nonee", "0", "-32"])
def test_bad_k_pad_is_a_usage_error_naming_the_option(synth_ckpt, tmp_path, k_pad, command):
    """The user typed --k-pad: a click usage error (exit 2, as a bad --mla-precision choice gives; it was exit 1)
    naming it and what it takes (it named the internal `k_pad`), before SRC is opened."""
    out = tmp_path / "out"
    args = [str(tmp_path / "no-such-src"), *([str(out)] if command == "convert" else []), "--k-pad", k_pad]
    r = CliRunner().invoke(main, [command, *args])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        "Error: Invalid value for '--k-pad': --k-pad must be 'card', 'none' or a positive multiple of 32, "
        f"got '{k_pad}'"
    ), r.output
    assert not out.exists()
    with pytest.raises(PlanError, match="--k-pad must be 'card', 'none' or a positive multiple of 32"):
        convert(synth_ckpt("glm-5", "bf16"), out, ConvertOptions(k_pad=k_pad))  # the API's own check
    assert not out.exists()


@pytest.mark.parametrize("card", ["glm5", "glm-5.1", "no/such.toml"])
def test_synth_unknown_card_is_a_usage_error_listing_the_cards(tmp_path, card):
    args = ["synth", str(tmp_path / "o"), "--card", card, "--layers", "1", "--experts", "1", "--format", "bf16"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        f"Error: Invalid value for '--card': unknown card '{card}'; known cards: deepseek-v3, glm-5, glm-5.2, "
        "glm-5.3-flash"
    ), r.output
    assert not (tmp_path / "o").exists()


def test_a_refused_convert_prints_its_error_line_and_nothing_else(synth_ckpt, tmp_path):
    """The progress bar starts with the work: stopping it unstarted printed an empty line on stdout."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    r = CliRunner().invoke(main, ["convert", str(synth_ckpt("glm-5", "bf16")), str(tmp_path / "full")])
    assert r.exit_code == 1 and r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_a_checkpoint_without_mla_layers_is_refused(synth_ckpt, tmp_path, command):
    """GLM-5.3-Flash's first MLA layer is layer 3: two layers without the MTP layer hold none. Convert wrote an
    overlay of no layers, with a manifest, and reported success; inspect showed a plan of no layers."""
    src = synth_ckpt("glm-5.3-flash", "bf16", layers=2, mtp=False)
    args = [str(src), str(tmp_path / "out"), "--quiet"] if command == "convert" else [str(src)]
    r = CliRunner().invoke(main, [command, *args])
    assert r.exit_code == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [
        f"glm-pack: error: the checkpoint holds no MLA layer (card glm-5.3-flash): there is no w_kc / w_vc to write "
        f"(file {src})"
    ]
    assert not (tmp_path / "out").exists()


def test_long_paths_and_summaries_stay_on_one_line_when_piped(synth_ckpt, tmp_path):
    """Piped output (80 columns) was wrapped mid-word: inspect's first line split its path, convert's summary ran
    over three lines, so `grep` and `tail -1` got pieces; the summary table's header split a column name."""
    src = tmp_path / ("a-long-folder-name-" * 5) / "GLM-5-source"
    src.parent.mkdir()
    src.symlink_to(synth_ckpt("glm-5", "bf16"), target_is_directory=True)
    runner = CliRunner()
    r = runner.invoke(main, ["inspect", str(src)])
    assert r.exit_code == 0 and r.stdout.splitlines()[0].startswith(f"{src}: "), r.stdout
    out = src.parent / "GLM-5-gfx950"
    r = runner.invoke(main, ["convert", str(src), str(out), "--files", "none", "--workers", "1"])
    assert r.exit_code == 0, r.output
    summary = [line for line in r.stdout.splitlines() if " MLA layers, overlay " in line]
    assert len(summary) == 1 and summary[0].endswith(" s") and "rel error w_kc max" in summary[0], r.stdout
    assert f"MLA overlay in {out}" in r.stdout.splitlines()
    # The table's header is one row: 'w_vc rel err' was wrapped into 'w_vc rel' over 'err' at 80 columns.
    header = [line for line in r.stdout.splitlines() if "w_kc rel err" in line]
    assert len(header) == 1 and "w_vc rel err" in header[0] and header[0].count("worst head") == 2, r.stdout


@pytest.mark.parametrize("tag", ["[old]", ":cd:"])
def test_paths_with_markup_are_printed_as_they_are(synth_ckpt, tmp_path, tag):
    """Paths went through rich's markup: '[old]' in a folder name was taken for a style tag and dropped, so verify
    reported on 'GLM-5-gfx950' when asked about 'GLM-5[old]-gfx950'; ':cd:' was taken for an emoji code and
    printed as an optical disc."""
    src, out = tmp_path / f"src{tag}v1", tmp_path / f"GLM-5{tag}-gfx950"
    src.symlink_to(synth_ckpt("glm-5", "bf16"), target_is_directory=True)
    runner = CliRunner()
    r = runner.invoke(main, ["inspect", str(src)])
    assert r.exit_code == 0 and r.output.startswith(f"{src}: GLM-5"), r.output
    r = runner.invoke(main, ["convert", str(src), str(out), "--files", "none", "--workers", "1"])
    assert r.exit_code == 0 and f"GLM-5{tag}-gfx950" in " ".join(r.output.split()), r.output  # the summary's title
    r = runner.invoke(main, ["verify", str(out)])
    assert r.exit_code == 0 and r.output.splitlines()[-1] == f"verify {out}: OK", r.output
    assert all(r.output.splitlines()), r.output  # off a terminal no bars, nor the blank line they leave
    r = runner.invoke(main, ["card", str(out), "--overlay-only"])
    card = out / "glm-pack" / "README.md"
    lines = r.output.splitlines()
    assert r.exit_code == 0 and lines[0] == f"model card written: {card}", r.output
    assert len(lines) == 2 and lines[1].startswith(f"note: the card {card} names no base model"), r.output


def test_verify_problem_lines_print_paths_with_markup_as_they_are(synth_ckpt, tmp_path):
    """A problem line names a file under OUT: '[old]' in OUT's path was dropped from it as a style tag."""
    out = tmp_path / "GLM-5[old]-gfx950"
    convert(synth_ckpt("glm-5", "bf16"), out, ConvertOptions(files="none", workers=1))
    (out / "glm-pack" / "layer-000.safetensors").unlink()
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1, r.output
    assert f"problem overlay file missing: {out / 'glm-pack' / 'layer-000.safetensors'}" in r.output.splitlines()


def test_bad_option_values_of_the_api_are_refused_before_out_is_made(synth_ckpt, tmp_path):
    """The CLI's choices keep these out; the Python API checked the scale mode only in the first work item, after
    OUT held a journal, under a source shard's name, and a rerun with the mode corrected was told to --resume."""
    src = synth_ckpt("glm-5", "bf16")
    for options, says in (
        ({"quant_mode": "nearest"}, "unknown MXFP4 scale mode 'nearest'; choose one of even, floor, roundup, mse"),
        ({"mla_precision": "fp8"}, "unknown MLA precision policy 'fp8'; choose one of mxfp4, bf16, auto"),
    ):
        with pytest.raises(PlanError) as err:
            convert(src, tmp_path / "o", ConvertOptions(files="none", workers=1, **options))
        assert str(err.value) == says
        assert not (tmp_path / "o").exists()
    convert(src, tmp_path / "o", ConvertOptions(files="none", workers=1, quant_mode="mse"))


def test_refusals(synth_ckpt, tmp_path):
    src = synth_ckpt("glm-5", "bf16")
    runner = CliRunner()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    r = runner.invoke(main, ["convert", str(src), str(tmp_path / "full")])
    assert r.exit_code == 1 and "not empty" in r.output and "--overwrite" in r.output
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    r = runner.invoke(main, ["convert", str(src), str(src / "sub")])
    assert r.exit_code == 1 and "outside the source" in r.output
    for options in (["--mla-precision", "auto"], ["--max-rel-error", "0.2"]):  # auto and the threshold go together
        r = runner.invoke(main, ["convert", str(src), str(tmp_path / "o"), *options])
        assert r.exit_code == 1 and "--max-rel-error goes with --mla-precision auto" in r.output
        assert not (tmp_path / "o").exists()
    for bad in ("nan", "inf", "-0.1"):
        auto = ["--mla-precision", "auto", "--max-rel-error", bad]
        r = runner.invoke(main, ["convert", str(src), str(tmp_path / "o"), *auto])
        assert r.exit_code == 1 and "must be a finite number >= 0" in r.output, r.output
        assert not (tmp_path / "o").exists()
    r = runner.invoke(main, ["convert", str(tmp_path / "nope"), str(tmp_path / "o2")])
    assert r.exit_code == 1 and "nope" in r.output
    # a mistyped or wrong SRC says what is wrong with the path ('not a checkpoint directory' alone did not)
    for cmd in ("convert", "inspect"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        for path, why in (
            (tmp_path / "nope", "the path does not exist"),
            (src / "config.json", "the path is a file"),
            (tmp_path / "empty", "it has no config.json"),  # was "file is missing (file .../config.json)"
        ):
            r = runner.invoke(main, [cmd, str(path), *([str(tmp_path / "o2")] if cmd == "convert" else [])])
            assert r.exit_code == 1 and r.output.splitlines() == [
                f"glm-pack: error: not a checkpoint directory: {why} (file {path})"
            ], r.output
    for args, env in ((["--workers", "0"], {}), ([], {"GLM_PACK_WORKERS": "0"})):  # a usage error, as README says
        r = runner.invoke(main, ["convert", str(src), str(tmp_path / "o"), *args], env=env)
        assert r.exit_code == 2 and not (tmp_path / "o").exists(), r.output
        assert "Invalid value for '--workers' (env var: 'GLM_PACK_WORKERS'): 0 is not in the range x>=1" in r.output
    with pytest.raises(PlanError, match="--workers must be at least 1, got 0"):  # the API's own check
        convert(src, tmp_path / "o", ConvertOptions(workers=0))


def test_workers_default_comes_from_glm_pack_workers_else_the_machine(synth_ckpt, tmp_path, monkeypatch):
    """``GLM_PACK_WORKERS`` sets --workers' default, else the cores of the process's CPU affinity (a container's
    cpuset: 3 of the machine's cores here) capped by a cgroup CPU quota and by one worker per GiB of memory, else
    every core where the OS has no affinity; --workers wins over it; a value that is no integer is refused, naming
    the variable. (The test session sets it to 1: tests/conftest.py.)"""
    from glm_pack.convert import commands, machine

    seen = []

    def spy(src, out, options, progress=None):
        seen.append(options.workers)
        raise GlmPackError("spied")

    def container(*files: tuple[str, str]) -> None:
        """This process in a cgroup namespace whose root holds ``files``; plenty of memory available."""
        root = tmp_path / f"cgroup-{len(list(tmp_path.glob('cgroup-*')))}"
        root.mkdir()
        for name, text in files:
            (root / name).write_text(text + "\n")
        monkeypatch.setattr(machine, "CGROUP_FS", root)

    monkeypatch.setattr(commands, "convert", spy)
    (tmp_path / "self-cgroup").write_text("0::/\n")
    (tmp_path / "meminfo").write_text("MemTotal: 67108864 kB\nMemAvailable: 50331648 kB\n")  # 48 GiB available
    monkeypatch.setattr(machine, "SELF_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(machine, "MEMINFO", tmp_path / "meminfo")
    container()  # no limits
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    src, runner = synth_ckpt("glm-5", "bf16"), CliRunner()
    cases = [({"GLM_PACK_WORKERS": "3"}, [], 3), ({"GLM_PACK_WORKERS": "3"}, ["--workers", "5"], 5),
             ({"GLM_PACK_WORKERS": None}, [], 3), ({"GLM_PACK_WORKERS": ""}, [], 3)]
    for env, args, workers in cases:  # fmt: skip
        r = runner.invoke(main, ["convert", str(src), str(tmp_path / "o"), *args], env=env)
        assert r.exit_code == 1 and "spied" in r.output and seen.pop() == workers, (env, args, r.output)
    for files, workers in [
        ([("cpu.max", "150000 100000")], 2),  # a CPU limit of 1.5 cores
        ([("memory.max", str(5 << 29))], 2),  # a memory limit of 2.5 GiB
        ([("cpu.max", "150000 100000"), ("memory.max", str(1 << 29))], 1),
    ]:
        container(*files)
        r = runner.invoke(main, ["convert", str(src), str(tmp_path / "o")], env={"GLM_PACK_WORKERS": None})
        assert r.exit_code == 1 and seen.pop() == workers, (files, r.output)
    container()
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    r = runner.invoke(main, ["convert", str(src), str(tmp_path / "o")], env={"GLM_PACK_WORKERS": None})
    assert r.exit_code == 1 and seen.pop() == 16, r.output
    r = runner.invoke(main, ["convert", str(src), str(tmp_path / "o")], env={"GLM_PACK_WORKERS": "two"})
    assert r.exit_code == 2 and "'two' is not a valid integer" in r.output and "GLM_PACK_WORKERS" in r.output, r.output
    assert not seen and not (tmp_path / "o").exists()


def test_nan_weight_named_in_error(synth_ckpt, tmp_path, ckpt_copy, edit_tensor):
    src = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    name = "model.layers.0.self_attn.kv_b_proj.weight"

    def poison(t):
        t[100, 3] = float("inf")
        return t

    shard = edit_tensor(src, name, poison)
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o"), "--workers", "2"])  # raised in a worker
    assert r.exit_code == 1
    assert "1 non-finite" in r.output and "(100, 3)" in r.output and name in r.output and shard.name in r.output
    assert not (tmp_path / "o" / "glm-pack" / "manifest.json").exists()


def _set_first(value):
    def change(t):
        t.view(-1)[0] = value
        return t

    return change


@pytest.mark.parametrize(
    "fmt, scale, value, message",
    [
        ("fp8-block", "model.layers.0.self_attn.kv_b_proj.weight_scale_inv", float("nan"), "scale holds 1"),
        ("fp8-channel", "model.layers.0.self_attn.kv_b_proj.weight_scale", float("inf"), "scale holds 1"),
        ("mxfp4-attn", "model.layers.0.self_attn.kv_b_proj.weight_scale", 0xFF, "E8M0 scale (byte 0xFF is NaN)"),
        # finite scales the weight's values overflow float32 with (it named the weight, kv_b_proj)
        ("fp8-block", "model.layers.0.self_attn.kv_b_proj.weight_scale_inv", 1e38, "this scale overflows float32"),
        ("fp8-channel", "model.layers.0.self_attn.kv_b_proj.weight_scale", 1e38, "this scale overflows float32"),
        ("mxfp4-attn", "model.layers.0.self_attn.kv_b_proj.weight_scale", 254, "this scale overflows float32"),
    ],
)
def test_non_finite_scale_is_named_with_its_own_shard(
    synth_ckpt, tmp_path, ckpt_copy, edit_tensor, fmt, scale, value, message
):
    src = ckpt_copy(synth_ckpt("glm-5", fmt))
    shard = edit_tensor(src, scale, _set_first(value))
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o")])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert message in r.output and f"(file {shard}, tensor {scale})" in r.output, r.output
    assert not (tmp_path / "o" / "glm-pack" / "manifest.json").exists()


def test_scale_of_the_wrong_dtype_is_named_with_its_own_shard(synth_ckpt, tmp_path, ckpt_copy, edit_tensor):
    src = ckpt_copy(synth_ckpt("glm-5", "fp8-block"))
    scale = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
    shard = edit_tensor(src, scale, lambda t: t.double())
    r = CliRunner().invoke(main, ["inspect", str(src)])
    assert r.exit_code == 1 and "fp8 block scale must be F32" in r.output, r.output
    assert f"(file {shard}, tensor {scale})" in r.output, r.output


@pytest.mark.parametrize(
    "file_bytes, sizes",
    [(2 * 34816, [2, 2, 2]), (2 * 34816 + 1, [2, 2, 2]), (3 * 34816 - 1, [2, 2, 2]), (34815, [1] * 6), (10**9, [6])],
)
def test_expert_files_are_split_to_stay_under_the_file_bound(synth_ckpt, file_bytes, sizes):
    """Layer 3's six MXFP4 expert weights, each 34 816 bytes with its scale (codes [256, 128] U8 + E8M0 scales
    [256, 8]), fill files in checkpoint order up to ``file_bytes`` inclusive; one larger than the bound has a file
    of its own, numbered from 01 per layer, after the MLA items."""
    ckpt = open_checkpoint(synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2))
    items = plan_items(ckpt, "aiter-a4w4", file_bytes=file_bytes)
    assert [i.file for i in items if i.kind == "mla"] == [f"layer-{n:03d}.safetensors" for n in range(5)]
    experts = [i for i in items if i.kind == "experts"]
    assert [len(i.weights) for i in experts] == sizes
    assert [i.file for i in experts] == [f"experts-003-{n:02d}.safetensors" for n in range(1, len(sizes) + 1)]
    names = [f"model.layers.3.mlp.experts.{e}.{p}_proj.weight" for e in (0, 1) for p in ("down", "gate", "up")]
    assert [w for i in experts for w in i.weights] == names and {i.layer for i in experts} == {3}


def test_a_layer_of_experts_over_several_files_converts_and_verifies(synth_ckpt, tmp_path, monkeypatch):
    """A layer whose experts pass the file bound (GLM-5: 256 experts, 5.13 GB > 5 GB) is written as several files: the
    manifest has a group per file, all of that layer, which convert's own manifest check, verify and the runtime
    accept (the bound is lowered here so that layer 3's six expert weights fill three files)."""
    src = synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2)
    monkeypatch.setattr(convert_module, "plan_items", functools.partial(plan_items, file_bytes=2 * 34816))
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(files="none", workers=1, repack_experts="aiter-a4w4"))
    groups = manifest(out)["experts"]["groups"]
    assert [(g["layer"], g["file"], len(g["tensors"])) for g in groups] == [
        (3, f"experts-003-{n:02d}.safetensors", 4) for n in (1, 2, 3)
    ]
    report = verify(out)
    assert report.ok and "12 repacked expert tensors unshuffled to the source bytes" in report.checked
    assert runtime.open(out, verify=True)


def test_repacked_expert_tensors_are_read_once(synth_ckpt, tmp_path, monkeypatch):
    """Each source expert tensor (codes and scales) is read from its file once: the bytes repacked are the bytes whose
    sha256 the manifest records (at 256 experts a layer is ~5 GB: a second pass would read it all again)."""
    src = synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2)
    ckpt = open_checkpoint(src)
    weights = [w for i in plan_items(ckpt, "aiter-a4w4") if i.kind == "experts" for w in i.weights]
    names = [t for w in weights for t in (w, w + "_scale")]
    starts = {(str(src / ckpt.info(t).file), ckpt.info(t).begin): t for t in names}
    reads = collections.Counter()
    read = LocalFile.read

    def counting(self, offset, length):
        if (str(self.path), offset) in starts:
            reads[starts[str(self.path), offset]] += 1
        return read(self, offset, length)

    monkeypatch.setattr(LocalFile, "read", counting)
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(files="none", workers=1, repack_experts="aiter-a4w4"))
    assert len(names) == 12 and reads == dict.fromkeys(names, 1)
    recorded = manifest(out)["source"]["tensors"]
    for t in names:
        assert recorded[t] == hashlib.sha256(ckpt.read_raw(t).numpy()).hexdigest()


def test_nan_scale_of_a_repacked_expert_is_refused(synth_ckpt, tmp_path, ckpt_copy, edit_tensor):
    src = ckpt_copy(synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2))
    scale = "model.layers.3.mlp.experts.0.gate_proj.weight_scale"

    def plant(t):
        t[5, 2] = 0xFF
        return t

    shard = edit_tensor(src, scale, plant)
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o"), "--repack-experts", "aiter-a4w4"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "first at index (5, 2)" in r.output and f"(file {shard}, tensor {scale})" in r.output, r.output
    assert not (tmp_path / "o" / "glm-pack" / "manifest.json").exists()


@pytest.mark.parametrize("case", ["missing", "beyond", "bf16"])
def test_an_incomplete_set_of_experts_is_not_repacked(
    synth_ckpt, ckpt_copy, edit_tensor, edit_index, tmp_path, case
):
    """A layer's routed experts are repacked only as the whole set config.json gives it (aiter's fused MoE reads them
    as one): an expert weight missing from the index, one beyond n_routed_experts, one stored in BF16 among MXFP4
    ones. Each wrote an overlay lacking or mixing experts that verify passed (it compares with the same source)."""
    src = ckpt_copy(synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2))
    victim = "model.layers.3.mlp.experts.1.up_proj.weight"
    if case == "missing":
        edit_index(src, lambda wm: {k: v for k, v in wm.items() if k not in (victim, victim + "_scale")})
        says = "layer 3 lacks 1 of its 6 routed-expert weights (config.json: n_routed_experts 2)"
    elif case == "beyond":  # a stray expert 2 in a shard of its own, listed in the index
        victim = "model.layers.3.mlp.experts.2.up_proj.weight"
        ckpt = open_checkpoint(src)
        stray = {t: ckpt.read_raw(t.replace(".2.", ".1.")) for t in (victim, victim + "_scale")}
        save_file(stray, src / "stray.safetensors")
        edit_index(src, lambda wm: {**wm, **dict.fromkeys(stray, "stray.safetensors")})
        says = "layer 3 has a routed-expert weight beyond config.json's n_routed_experts 2"
    else:
        edit_tensor(src, victim, lambda t: torch.zeros(t.shape[0], 2 * t.shape[1], dtype=torch.bfloat16))
        edit_index(src, lambda wm: {k: v for k, v in wm.items() if k != victim + "_scale"})
        says = "layer 3 mixes MXFP4 and bf16 routed-expert weights"
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o"), "--repack-experts", "aiter-a4w4"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert says in r.output and f"tensor {victim})" in r.output, r.output
    assert not (tmp_path / "o").exists()


@pytest.fixture
def converted(synth_ckpt, tmp_path):
    out = tmp_path / "out"
    convert(synth_ckpt("glm-5", "bf16"), out, ConvertOptions(files="copy"))
    return out


def test_verify_catches_flipped_byte(converted):
    path = converted / "glm-pack" / "layer-001.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["verify", str(converted)])
    assert r.exit_code == 1 and "layer-001.safetensors" in r.output and "w_vc.weight" in r.output


def test_the_manifest_records_the_installed_version(converted):
    """The manifest's tool version is the installed package's, the one `glm-pack --version` prints: convert's
    constant must follow pyproject.toml's version when it is bumped."""
    installed = importlib.metadata.version("glm-pack")
    assert manifest(converted)["tool"] == {"name": "glm-pack", "version": installed}
    assert CliRunner().invoke(main, ["--version"]).output.split()[-1] == installed


def test_verify_catches_missing_file_and_edited_manifest(converted):
    path = converted / "glm-pack" / "manifest.json"
    original = path.read_text()
    m = json.loads(original)
    for entry in m["mla"]:  # as written before max_head_rel_error was recorded: nothing to recompute it against
        for p in ("w_kc", "w_vc"):
            del entry[p]["max_head_rel_error"]
    path.write_text(json.dumps(m))
    assert verify(converted).ok
    m = json.loads(original)
    m["mla"][0]["w_vc"]["max_head_rel_error"] = 0.02
    path.write_text(json.dumps(m))
    (problem,) = verify(converted).problems
    assert problem.startswith(m["mla"][0]["w_vc"]["weight"]) and problem.endswith("recorded max_head_rel_error 0.02")
    m = json.loads(original)
    m["mla"][0]["w_kc"]["rel_error"] = 0.01
    path.write_text(json.dumps(m))
    report = verify(converted)
    assert not report.ok and any("recorded 0.01" in p for p in report.problems)
    (converted / "glm-pack" / "layer-000.safetensors").unlink()
    report = verify(converted)
    assert any("missing" in p and "layer-000" in p for p in report.problems)
    m["mla"][0]["w_kc"]["layout"]["k_stored"] = 192
    path.write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["verify", str(converted), "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["ok"] is False and json.loads(r.output)["verdict"] == "FAILED"


def test_verify_catches_changed_index_and_source(converted):
    """OUT's index edited (one space); then, the index restored, the shard holding layer 0's kv_b_proj grown by 8 bytes
    and then moved away: each is named by its path."""
    index = converted / "model.safetensors.index.json"
    text = index.read_text()
    index.write_text(text.replace("{", "{ ", 1))
    problems = verify(converted).problems
    assert problems == [
        f"{index} differs from the model.safetensors.index.json the overlay was made from",
        f"{index} has {len(text.encode()) + 1} bytes, the original {len(text.encode())}",
    ], problems
    index.write_text(text)
    assert verify(converted).ok
    shard = converted / json.loads(text)["weight_map"][manifest(converted)["mla"][0]["source"]["tensor"]]
    data = shard.read_bytes()
    shard.unlink()  # a new file: whatever OUT's copy shares its bytes with stays as it is
    shard.write_bytes(data + bytes(8))  # as a copy or download gone wrong leaves it
    problems = verify(converted).problems
    assert problems == [
        f"{shard} has {len(data) + 8} bytes, the original {len(data)}",
        f"cannot open the source at {converted}: corrupt: 8 trailing bytes after the last tensor (file {shard})",
    ], problems
    shard.rename(shard.with_name("moved.safetensors"))
    problems = verify(converted).problems
    assert len(problems) == 2 and problems[0] == f"{shard} is missing although the originals were placed in OUT"
    missing = f"cannot open the source at {converted}: shard named by the index is missing (file {shard}, tensor "
    assert problems[1].startswith(missing), problems


def test_verify_reports_interrupted_output_incomplete(converted):
    (converted / "glm-pack" / "manifest.json").unlink()
    r = CliRunner().invoke(main, ["verify", str(converted)])
    assert r.exit_code == 1 and "INCOMPLETE" in r.output


def test_verify_tells_a_missing_out_and_a_corrupt_manifest_from_an_interrupted_output(synth_ckpt, tmp_path):
    """Only a missing manifest means an interrupted conversion: not a missing OUT, nor a corrupt manifest under a
    path that happens to contain the word "incomplete"."""
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "does-not-exist")])
    assert r.exit_code == 1 and "INCOMPLETE" not in r.output, r.output
    assert f"{tmp_path / 'does-not-exist'} does not exist" in r.output and "FAILED" in r.output, r.output
    (tmp_path / "a-file").write_text("x")
    report = verify(tmp_path / "a-file")  # the CLI's own check refuses a file first (usage error, exit 2)
    assert not report.ok and f"{tmp_path / 'a-file'} is a file, not a folder" in str(report.problems), report.problems
    out = tmp_path / "incomplete-runs" / "out"
    convert(synth_ckpt("glm-5", "bf16"), out, ConvertOptions(files="none"))
    (out / "glm-pack" / "manifest.json").write_text("{")
    report = verify(out)
    assert not report.ok and not report.incomplete, report.problems


def assert_manifest_unreadable(out, manifest):
    """verify and card of ``out`` fail in one line (exit 1, no traceback), and runtime.open with a ManifestError,
    each saying ``manifest`` cannot be read."""
    message = f"cannot read: Permission denied (file {manifest})"
    for command in ("verify", "card"):
        r = CliRunner().invoke(main, [command, str(out)])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception  # no traceback
        assert message in r.output, r.output
    with pytest.raises(ManifestError) as err:
        runtime.open(out)
    assert str(err.value) == message


def test_an_unreadable_manifest_is_one_line_naming_it(converted, refuse):
    """A manifest that cannot be read (a permission, an I/O error) is a ManifestError naming it, for verify / card
    (exit 1, one line) and runtime.open; it was the raw OSError (a traceback from the CLI)."""
    manifest = converted / "glm-pack" / "manifest.json"
    refuse(type(manifest), "read_bytes", manifest)
    assert_manifest_unreadable(converted, manifest)


def test_an_out_in_a_folder_that_cannot_be_entered_is_one_line_naming_it(converted, refuse):
    """OUT inside a folder this user cannot enter (another user's home, mode 0700: stat fails with EACCES, as
    injected here): runtime.open raises a ManifestError naming OUT (it raised the raw PermissionError from
    Path.is_dir); verify reports it (exit 1), card refuses the argument (click's usage error, exit 2)."""
    refuse(os, "stat", lambda p: converted.parent in p.parents)
    for command, code in (("verify", 1), ("card", 2)):
        r = CliRunner().invoke(main, [command, str(converted)])
        assert r.exit_code == code and isinstance(r.exception, SystemExit), r.exception  # no traceback
        assert str(converted) in r.output, r.output
    with pytest.raises(ManifestError) as err:
        runtime.open(converted)
    assert str(err.value) == f"cannot read: Permission denied (file {converted})"


@pytest.mark.parametrize("folder", ["glm-pack", "out"])
def test_a_manifest_in_a_folder_that_cannot_be_entered_is_one_line_naming_it(converted, folder, refuse):
    """OUT/glm-pack/, or OUT without a lock file (as downloaded), that this user may list but not enter (`chmod -R
    644 OUT`; stat fails with EACCES, as injected here): a ManifestError naming the manifest, for verify / card (exit
    1, one line) and runtime.open; it was the raw PermissionError from Path.is_file / is_dir (a traceback)."""
    manifest = converted / "glm-pack" / "manifest.json"
    closed = converted / "glm-pack" if folder == "glm-pack" else converted
    if folder == "out":
        (converted / ".glm-pack.lock").unlink()
    refuse(os, "stat", lambda p: closed in p.parents)
    assert_manifest_unreadable(converted, manifest)


@pytest.mark.parametrize("name", ["glm-pack/layer-001.safetensors", "config.json"])
def test_verify_reports_an_unreadable_file_of_out_by_name(converted, name, refuse):
    """An overlay file, or OUT's config.json, that cannot be read (a permission, an I/O error) is a problem naming it:
    FAILED, exit 1, the other checks still made; it was the raw OSError (a traceback)."""
    target = converted / name
    refuse(builtins, "open", target, errno.EIO)
    r = CliRunner().invoke(main, ["verify", str(converted)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception  # no traceback
    assert f"cannot read: Input/output error (file {target})" in r.output, r.output
    assert f"verify {converted}: FAILED" in r.output, r.output
    hashed = 3 if name == "config.json" else 2  # of the 3 overlay files
    assert f"checked {hashed} overlay files hashed" in r.output, r.output


def test_verify_and_card_of_a_folder_that_is_no_output_say_so(synth_ckpt, tmp_path):
    """A checkpoint or any folder without glm-pack/ was reported INCOMPLETE, 'the conversion did not finish', though
    no conversion ever ran there; both commands now say it is not a glm-pack output, and verify says FAILED."""
    src = synth_ckpt("glm-5", "bf16")
    r = CliRunner().invoke(main, ["verify", str(src)])
    assert r.exit_code == 1 and r.output.splitlines() == [
        f"problem {src} is not a glm-pack output: it has no glm-pack/ folder (`glm-pack convert SRC OUT` writes one)",
        f"verify {src}: FAILED",
    ], r.output
    r = CliRunner().invoke(main, ["card", str(src)])
    assert r.exit_code == 1 and "did not finish" not in r.output, r.output
    assert r.output.startswith(f"glm-pack: error: {src} is not a glm-pack output"), r.output


def test_link_mode_hard_links_and_follows_symlinked_sources(synth_ckpt, tmp_path, ckpt_copy):
    src = ckpt_copy(synth_ckpt("glm-5", "bf16"))  # every file a symlink, as in a HF cache snapshot
    out = tmp_path / "out"
    convert(src, out, ConvertOptions())
    shard = next(out.glob("model-*.safetensors"))
    assert not shard.is_symlink() and shard.stat().st_ino == (src / shard.name).resolve().stat().st_ino
    assert verify(out).ok
    shutil.rmtree(out)


@pytest.mark.parametrize("files", ["link", "copy"])
def test_hidden_files_and_an_overlay_inside_the_source_are_not_originals(synth_ckpt, tmp_path, ckpt_copy, files):
    """`hf download --local-dir` leaves .cache/huggingface/ in the folder, and a converted OUT used as a source
    holds glm-pack/: neither is part of the model, so neither is placed in OUT nor listed as a source file."""
    src = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    (src / ".cache" / "huggingface").mkdir(parents=True)
    (src / ".cache" / "huggingface" / "config.json.metadata").write_text("download state")
    (src / "glm-pack").mkdir()
    (src / "glm-pack" / "notes.txt").write_text("an earlier overlay's file")
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(files=files))
    assert not (out / ".cache").exists() and not (out / "glm-pack" / "notes.txt").exists()
    listed = json.dumps(json.loads((out / "glm-pack" / "manifest.json").read_text()))
    assert "metadata" not in listed and "notes.txt" not in listed
    assert verify(out).ok


def test_index_entry_outside_the_source_is_refused_before_any_output(synth_ckpt, ckpt_copy, tmp_path):
    src = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / index["weight_map"][name]).symlink_to((src / index["weight_map"][name]).resolve())
    index["weight_map"][name] = f"../other/{index['weight_map'][name]}"
    index_path.unlink()
    index_path.write_text(json.dumps(index))
    out = tmp_path / "sub" / "o"
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy"])
    assert r.exit_code == 1 and "not a file name inside the checkpoint" in r.output
    assert f"file {index_path}, tensor {name}" in r.output
    assert not (tmp_path / "sub").exists()


def test_verify_checks_outs_own_config_and_index_with_files_none(synth_ckpt, tmp_path):
    """Another model's config and index placed in an overlay-only OUT (by hand: --overwrite empties OUT): the
    runtime reads OUT's config.json, so verify must compare them with the manifest even though --files none."""
    src, out, other = synth_ckpt("glm-5", "bf16"), tmp_path / "out", synth_ckpt("deepseek-v3", "fp8-block")
    convert(src, out, ConvertOptions(files="none"))
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copyfile(other / name, out / name)
    with pytest.raises(GlmPackError, match="geometry contradicts config.json"):
        runtime.open(out, backend="torch")
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1
    for name in ("config.json", "model.safetensors.index.json"):
        assert f"{out / name} differs from the {name} the overlay was made from" in r.output, r.output
    for name in ("config.json", "model.safetensors.index.json"):  # the source's own files: all is well
        shutil.copyfile(src / name, out / name)
    assert verify(out).ok


def test_verify_checks_the_source_config_and_index_with_files_none(synth_ckpt, ckpt_copy, tmp_path):
    """An overlay-only OUT is checked against its recorded source: a config.json edited there (same geometry) and
    an index removed there are each named."""
    src, out = ckpt_copy(synth_ckpt("glm-5", "bf16")), tmp_path / "out"
    convert(src, out, ConvertOptions(files="none"))
    assert verify(out).ok
    config = (src / "config.json").read_bytes()
    (src / "config.json").unlink()  # a new file: the shared original stays as it is
    (src / "config.json").write_bytes(config.replace(b"{", b'{"edited": 1, ', 1))
    assert [p for p in verify(out).problems if "differs from the config the overlay was made from" in p] != []
    (src / "config.json").unlink()
    (src / "config.json").write_bytes(config)
    (src / "model.safetensors.index.json").unlink()
    report = verify(out)
    assert report.problems == [f"the original index in {src} was changed or removed"], report.problems


def test_an_overlay_only_out_whose_source_cannot_be_entered_is_served_without_it(
    synth_ckpt, ckpt_copy, tmp_path, refuse
):
    """An overlay-only OUT whose recorded source is in a folder this user cannot enter (another user's; stat fails
    with EACCES, as injected here) is one whose source is not reachable: verify passes on OUT's own files, card
    writes the overlay's card, runtime.open (verify=True too) opens it; each raised the raw PermissionError."""
    src, out = ckpt_copy(synth_ckpt("glm-5", "bf16")), tmp_path / "out"
    convert(src, out, ConvertOptions(files="none"))
    refuse(os, "stat", lambda p: src in p.parents)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 0, r.output
    assert f"verify {out}: OK (overlay files only: source not reachable" in r.output, r.output
    r = CliRunner().invoke(main, ["card", str(out), "--overlay-only"])
    assert r.exit_code == 0, r.output
    assert runtime.open(out, verify=True).layers == [0, 1, 2]


def test_verify_names_placed_originals_that_were_removed_or_resized(converted):
    shards = sorted(converted.glob("model-*.safetensors"))
    (converted / "model.safetensors.index.json").unlink()
    shards[-1].unlink()
    size = shards[0].stat().st_size
    with open(shards[0], "ab") as f:
        f.write(b"x")
    problems = verify(converted).problems
    for gone in (converted / "model.safetensors.index.json", shards[-1]):
        assert f"{gone} is missing although the originals were placed in OUT" in problems, problems
    assert f"{shards[0]} has {size + 1} bytes, the original {size}" in problems, problems


def test_verify_reports_a_placed_original_it_cannot_look_at(synth_ckpt, ckpt_copy, tmp_path, refuse):
    """A placed original in a folder of OUT this user may list but not enter (`chmod 644 OUT/original`: stat fails
    with EACCES, as injected here): a problem naming it, FAILED, exit 1; it was the raw PermissionError (a
    traceback)."""
    src, out = ckpt_copy(synth_ckpt("glm-5", "bf16")), tmp_path / "out"
    (src / "original").mkdir()
    (src / "original" / "notes.md").write_text("kept with the checkpoint")
    convert(src, out, ConvertOptions(files="copy", workers=1))
    notes = out / "original" / "notes.md"
    refuse(os, "stat", notes)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert f"cannot read {notes}: Permission denied" in r.output and f"verify {out}: FAILED" in r.output, r.output


def test_verify_reports_a_layer_it_cannot_re_derive(synth_ckpt, ckpt_copy, tmp_path, edit_tensor):
    """A source kv_b_proj that no longer converts (a NaN planted), or a source replaced by another model's
    checkpoint: verify --json still prints its report, naming the layer, the source tensor and its file."""
    src, out = ckpt_copy(synth_ckpt("glm-5", "bf16")), tmp_path / "out"
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    convert(src, out, ConvertOptions(files="none"))

    def plant_nan(t):
        t[3, 5] = float("nan")
        return t

    shard = edit_tensor(src, name, plant_nan)
    r = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert r.exit_code == 1, r.output
    problems = json.loads(r.output)["problems"]
    assert f"MLA layer 0: cannot re-derive from source tensor {name} (file {shard}): tensor holds 1 non-finite" in (
        " ".join(problems)
    ), problems
    for p in src.iterdir():  # the source folder now holds a DeepSeek-V3 checkpoint
        p.unlink()
    for p in synth_ckpt("deepseek-v3", "bf16").iterdir():
        (src / p.name).symlink_to(p)
    r = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert r.exit_code == 1, r.output
    problems = json.loads(r.output)["problems"]
    assert any("contradicts" in p and p.endswith("layers not re-derived") for p in problems), problems
    assert not any("cannot re-derive" in p for p in problems), problems


def test_verify_names_layers_the_source_no_longer_has(synth_ckpt, ckpt_copy, tmp_path):
    """An overlay made from a checkpoint of more MLA layers than its recorded source now holds: the layers the source
    lacks are named."""
    src, out = ckpt_copy(synth_ckpt("glm-5", "bf16")), tmp_path / "out"  # MLA layers 0, 1 and the MTP layer 2
    convert(src, out, ConvertOptions(files="none"))
    for p in src.iterdir():  # the same family and geometry, without the MTP layer
        p.unlink()
    for p in synth_ckpt("glm-5", "bf16", layers=2, experts=1, mtp=False).iterdir():
        (src / p.name).symlink_to(p)
    problems = verify(out).problems
    assert "the manifest has MLA layers the source lacks: [2]" in problems, problems


def test_verify_reads_an_out_whose_path_is_not_utf8(synth_ckpt, tmp_path):
    """The safetensors library takes only UTF-8 paths; verify reads the overlay with glm-pack's own reader."""
    out = tmp_path / os.fsdecode(b"out\xff")
    convert(synth_ckpt("glm-5", "bf16"), out, ConvertOptions(files="none"))
    r = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True, r.output


def test_verify_counts_only_what_it_checked(synth_ckpt, tmp_path):
    """A deleted layer file and a deleted experts file: the "checked" lines count the files hashed, the layers
    re-derived and the expert tensors unshuffled, not what the manifest lists."""
    out = tmp_path / "out"
    options = ConvertOptions(files="none", repack_experts="aiter-a4w4")
    convert(synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2), out, options)
    m = manifest(out)
    experts_file = m["experts"]["groups"][0]["file"]
    (out / "glm-pack" / "layer-000.safetensors").unlink()
    (out / "glm-pack" / experts_file).unlink()
    report = verify(out)
    assert not report.ok
    n_experts = sum(len(g["tensors"]) for g in m["experts"]["groups"] if g["file"] != experts_file)
    assert report.checked == [
        f"{len(m['files']) - 2} overlay files hashed",
        f"{len(m['source']['tensors'])} source tensors hashed",
        f"{len(m['mla']) - 1} MLA layers re-derived from the source and compared byte for byte",
        f"{n_experts} repacked expert tensors unshuffled to the source bytes",
    ]


def test_counts_of_one_are_singular(synth_ckpt, tmp_path):
    """A one-layer checkpoint: convert's summary said '1 MLA layers, overlay ...', verify '1 overlay files hashed',
    '1 source tensors hashed' and '1 MLA layers re-derived from their source'."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(synth_ckpt("glm-5", "bf16", layers=1, mtp=False)), str(out)])
    assert r.exit_code == 0 and "\n1 MLA layer, overlay " in r.stdout, r.stdout
    assert verify(out).checked == [
        "1 overlay file hashed",
        "1 source tensor hashed",
        "1 MLA layer re-derived from the source and compared byte for byte",
    ]


def test_verify_says_when_the_source_was_not_reached(synth_ckpt, ckpt_copy, tmp_path):
    """An overlay whose source folder is gone: OUT's own files pass (exit 0, as push needs), but the verdict and
    the JSON say the layers were not re-derived."""
    src, out = ckpt_copy(synth_ckpt("glm-5", "bf16")), tmp_path / ("out-" + "x" * 200)  # wider than any terminal
    convert(src, out, ConvertOptions(files="none"))
    r = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["source_checked"] is True, r.output
    src.rename(tmp_path / "moved-away")
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 0, r.output
    verdict = f"verify {out}: OK (overlay files only: source not reachable, layers not re-derived)"
    assert r.output.splitlines()[-1] == verdict, r.output  # one line, not wrapped at the console's width
    skipped = "checked overlay files only: source not reachable, layers not re-derived, errors not recomputed"
    assert skipped in r.output.splitlines(), r.output
    r = CliRunner().invoke(main, ["verify", str(out), "--json"])
    report = json.loads(r.output)
    assert r.exit_code == 0 and report["ok"] is True and report["source_checked"] is False, r.output
    assert report["schema"] == "glm-pack.verify/1" and report["verdict"] == (
        "OK (overlay files only: source not reachable, layers not re-derived)"
    )


def test_verify_of_the_overlay_folder_points_at_its_output(synth_ckpt, tmp_path, monkeypatch):
    """`verify OUT/glm-pack` reported an interrupted conversion (INCOMPLETE, 'the conversion did not finish') of a
    complete output; it now says which folder to pass (for `verify .` inside it too: it named '.' itself)."""
    out = tmp_path / "out"
    convert(synth_ckpt("glm-5", "bf16"), out, ConvertOptions(files="none"))
    r = CliRunner().invoke(main, ["verify", str(out / "glm-pack")])
    assert r.exit_code == 1 and r.output.splitlines() == [
        f"problem {out / 'glm-pack'} is the glm-pack/ folder of a converted output: pass the output itself, {out}",
        f"verify {out / 'glm-pack'}: FAILED",
    ], r.output
    monkeypatch.chdir(out / "glm-pack")
    r = CliRunner().invoke(main, ["verify", "."])
    assert r.exit_code == 1 and r.output.splitlines()[0].endswith(f"pass the output itself, {out}"), r.output
    for wrong in (out / "glm-pack", tmp_path):  # neither is an output: verify and card leave no lock file there
        for command in (["verify"], ["card", "--overlay-only"]):
            assert CliRunner().invoke(main, [*command, str(wrong)]).exit_code == 1
        assert not (wrong / ".glm-pack.lock").exists()


@pytest.mark.parametrize("fmt", ["bf16", "fp8-channel", "mxfp4-attn"])
def test_summary_says_what_errors_against_a_quantized_source_leave_out(synth_ckpt, tmp_path, fmt):
    """convert's summary, like the card, says that errors against an FP8 / MXFP4 source leave out that source's own
    quantization error, and why w_vc from an MXFP4 source reads 0.0000; nothing of the kind for a BF16 source."""
    src = synth_ckpt("glm-5", fmt, layers=2, experts=1, mtp=False)
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o"), "--files", "none", "--workers", "1"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    source_format = {e["source"]["format"] for e in manifest(tmp_path / "o")["mla"]}.pop()
    quantized = fmt != "bf16"
    assert (f"already quantized ({source_format})" in text) == quantized, text
    assert ("w_vc keeps the source's MXFP4 bytes" in text) == (source_format == "mxfp4"), text


def test_summary_names_the_quantized_layers_of_a_mixed_source(synth_ckpt, tmp_path):
    """An MXFP4-attention checkpoint keeps its MTP layer's kv_b_proj in BF16: the note said the source `kv_b_proj`
    was quantized and every w_vc kept its bytes (error 0), though the MTP layer's is neither; it names the layers."""
    src = synth_ckpt("glm-5", "mxfp4-attn", layers=2, experts=1, mtp=True)
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o"), "--files", "none", "--workers", "1"])
    assert r.exit_code == 0, r.output
    mla = manifest(tmp_path / "o")["mla"]
    mx = [e["layer"] for e in mla if e["source"]["format"] == "mxfp4"]
    assert mx == [0, 1] and [e["source"]["format"] for e in mla if e["layer"] not in mx] == ["bf16"]
    assert [e["layer"] for e in mla if e["w_vc"]["rel_error"] == 0] == mx
    text = " ".join(r.output.split())
    assert "The source `kv_b_proj` of layers 0-1 is already quantized (mxfp4): " in text, text
    assert "w_vc of layers 0-1 keeps the source's MXFP4 bytes" in text, text


def test_sigterm_in_any_command_is_one_line_and_exit_143(monkeypatch, tmp_path):
    """SIGTERM (a real one, sent to this process) during verify: one line and 128 + 15, as a shell reports it; it was
    Python's default, death without a word. The handler is the CLI's only while a command runs."""
    import signal

    from glm_pack.convert import commands

    def terminated(*_):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises in this thread before the sleep ends

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(commands, "verify", terminated)
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 143 and r.stdout == "", r.output
    assert r.stderr.splitlines() == ["glm-pack: terminated; verify did not finish"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(monkeypatch, tmp_path):
    """click turned a Ctrl-C outside convert into 'Aborted!' and exit code 1, like a failure."""
    from glm_pack.convert import commands

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "verify", interrupted)
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 130 and r.stdout == "", r.output
    assert r.stderr.splitlines() == ["glm-pack: interrupted; verify did not finish"]
