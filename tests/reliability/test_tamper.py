"""Tampering with a finished output: `verify` and `runtime.open(..., verify=True)` notice, and say what changed.

Each case works on a private copy of one converted output (MLA layers + repacked experts, originals copied).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm_pack import runtime
from glm_pack.convert.cli import main
from glm_pack.convert.verify import stored_to_float, verify
from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import rel_errors
from glm_pack.packing.errors import GlmPackError, ManifestError, VerifyError
from glm_pack.packing.mla import split_kv_b


@pytest.fixture
def out(converted, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(converted[1], dst)
    return dst


def manifest(out):
    return json.loads((out / mf.OVERLAY_DIR / mf.MANIFEST_NAME).read_text())


def write_manifest(out, m):
    (out / mf.OVERLAY_DIR / mf.MANIFEST_NAME).write_text(json.dumps(m))


def test_untampered_output_passes(out):
    assert verify(out).ok
    runtime.open(out, backend="torch", verify=True)


def report_steps(out):
    """verify(out) with a recording progress: the report and {phase: [(done, total, nbytes), ...]} in call order."""
    steps: dict[str, list] = {}
    report = verify(out, lambda phase, done, total, nbytes: steps.setdefault(phase, []).append((done, total, nbytes)))
    return report, steps


def test_verify_reports_its_progress_phase_by_phase(out):
    """verify of a GLM-5 with experts reads about four times the overlay's size; it said nothing until its end."""
    report, steps = report_steps(out)
    m = manifest(out)
    experts = sum(len(g["tensors"]) for g in m["experts"]["groups"])
    totals = {
        "overlay files hashed": len(m["files"]),
        "source tensors hashed": len(m["source"]["tensors"]),
        "MLA layers re-derived": len(m["mla"]),
        "expert tensors unshuffled": experts,
    }
    assert report.ok and list(steps) == list(totals)  # in this order
    for phase, total in totals.items():
        assert [(d, t) for d, t, _ in steps[phase]] == [(d, total) for d in range(total + 1)], phase
    sizes = sum((out / mf.OVERLAY_DIR / name).stat().st_size for name in m["files"])
    assert sum(n for *_, n in steps["overlay files hashed"]) == sizes
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    hashed = sum(_span(out / weight_map[name], name) for name in m["source"]["tensors"])  # read from OUT's copies
    assert sum(n for *_, n in steps["source tensors hashed"]) == hashed


def test_verify_progress_reaches_the_end_past_a_missing_file(out):
    layer_file = next(name for name in manifest(out)["files"] if name.startswith("layer-"))
    (out / mf.OVERLAY_DIR / layer_file).unlink()
    report, steps = report_steps(out)
    assert any("overlay file missing" in p for p in report.problems)
    done, total, nbytes = steps["overlay files hashed"][-1]
    assert done == total == len(manifest(out)["files"])
    derived = steps["MLA layers re-derived"]
    assert derived[-1][0] == derived[-1][1] == len(manifest(out)["mla"]) - 1  # its layer is not re-derived


def test_a_changed_byte_in_any_overlay_file_is_named(out):
    """One byte flipped in the data of each overlay file (MLA and expert files) in turn."""
    m = manifest(out)
    files = sorted(m["files"])
    assert any(f.startswith("experts-") for f in files) and any(f.startswith("layer-") for f in files)
    for name in files:
        path = out / mf.OVERLAY_DIR / name
        original = path.read_bytes()
        data = bytearray(original)
        data[-7] ^= 0x01  # the last tensor of the file
        path.write_bytes(bytes(data))
        last = max((t for t, e in m["tensors"].items() if e["file"] == name), key=lambda t: _offset(path, t))
        problems = verify(out).problems  # one line, naming only the changed tensor (the file is not re-derived)
        assert problems == [f"overlay file {path} does not match its sha256 in the manifest (changed tensors: {last})"]
        with pytest.raises(VerifyError, match="does not match its sha256") as err:
            runtime.open(out, backend="torch", verify=True)
        assert name in str(err.value)
        path.write_bytes(original)
    assert verify(out).ok


def _offsets(path, tensor):
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    return header[tensor]["data_offsets"]


def _offset(path, tensor):
    return _offsets(path, tensor)[0]


def _span(path, tensor):
    begin, end = _offsets(path, tensor)
    return end - begin


def test_a_changed_header_byte_is_reported(out):
    path = out / mf.OVERLAY_DIR / "layer-000.safetensors"
    data = bytearray(path.read_bytes())
    data[data.index(b'"shape"') + 1] = ord("S")  # still parses as JSON; no longer a valid header
    path.write_bytes(bytes(data))
    assert any("layer-000.safetensors" in p for p in verify(out).problems)
    with pytest.raises(VerifyError, match="layer-000.safetensors"):
        runtime.open(out, backend="torch", verify=True)


def test_a_missing_overlay_file_is_named(out):
    for name in ("layer-001.safetensors", "experts-003-01.safetensors"):
        (out / mf.OVERLAY_DIR / name).unlink()
        assert any("missing" in p and name in p for p in verify(out).problems)
        with pytest.raises(VerifyError, match="missing") as err:
            runtime.open(out, backend="torch", verify=True)
        assert name in str(err.value)


def _kc(m):
    return m["mla"][0]["w_kc"]


def _scale_layout_claims_256_more_rows(m):
    """An e8m0 shuffle whose recorded [R, C] pads to more rows than the stored tensor holds."""
    scale = next(name for name in m["experts"]["groups"][0]["tensors"] if name.endswith("_scale"))
    m["tensors"][scale]["layout"]["shape"][-2] += 256


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda m: _kc(m)["layout"].update(name="bmm_kn"), "'bmm_kn' is not a layout the runtime reads"),
        (lambda m: _kc(m)["layout"].update(k_stored=192), "mxfp4 tensors must be U8"),
        (lambda m: _kc(m).update(precision="bf16", scale=None), "bf16 tensor must be BF16"),
        (lambda m: m["experts"].update(layout="aiter_moe_a8w8"), "experts.layout"),
        (
            lambda m: m["tensors"][m["experts"]["groups"][0]["tensors"][1]]["layout"].update(
                layout="aiter_shuffle_16x16"
            ),
            "no known shuffle layout",
        ),
        (_scale_layout_claims_256_more_rows, "no known shuffle layout"),
        (lambda m: m["model"]["geometry"].update(kv_lora_rank=256), "w_kc.weight: mxfp4 tensors must be U8"),
    ],
)
def test_a_manifest_claiming_another_layout_is_refused(out, edit, says):
    m = manifest(out)
    edit(m)
    write_manifest(out, m)
    problems = verify(out).problems
    assert len(problems) == 1 and says in problems[0] and "manifest.json" in problems[0], problems
    with pytest.raises(ManifestError, match="manifest") as err:
        runtime.open(out, backend="torch", verify=True)
    assert says in str(err.value)


def test_a_manifest_claiming_another_quantization_is_caught(out):
    """Consistent in itself, but the stored bytes are not what the recorded scale rule gives (nor is it the run's)."""
    m = manifest(out)
    _kc(m)["quant"]["mode"] = "roundup"
    write_manifest(out, m)
    problems = verify(out).problems
    assert any(_kc(m)["weight"] in p and "recorded scale rule 'roundup'" in p for p in problems), problems


def test_a_consistent_overlay_with_other_expert_bytes_is_caught(out):
    """An expert weight's bytes changed and every hash in the manifest updated to match: only unshuffling it
    and comparing with the source tensor tells."""
    m = manifest(out)
    group = m["experts"]["groups"][0]
    name = next(n for n in group["tensors"] if not n.endswith("_scale"))
    path = out / mf.OVERLAY_DIR / group["file"]
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    tensors[name].view(-1)[0] ^= 0x11  # both codes of one byte
    path.unlink()
    save_file(tensors, path, metadata=metadata)
    data = path.read_bytes()
    m["files"][group["file"]].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    m["tensors"][name]["sha256"] = hashlib.sha256(tensors[name].numpy().tobytes()).hexdigest()
    write_manifest(out, m)
    problems = verify(out).problems
    assert problems == [f"{name}: unshuffled bytes differ from the source tensor"], problems


@pytest.mark.parametrize("proj", ["w_kc", "w_vc"])
def test_a_consistent_overlay_with_other_mla_scale_bytes_is_caught(out, proj):
    """One MXFP4 scale byte of layer 1's w_kc / w_vc raised by one (one block at twice its scale; the weight's bytes
    as converted), its file rewritten and every hash the manifest records for it updated to match, and the errors
    it records recomputed from what is now stored: only re-deriving the layer from the source and comparing the
    scale's bytes tells, and it names the scale (it named the weight). runtime.open(verify=True) checks the hashes
    alone and opens it."""
    m = manifest(out)
    entry = next(e for e in m["mla"] if e["layer"] == 1)
    stored = entry[proj]
    name, file = stored["scale"], m["tensors"][stored["scale"]]["file"]
    path = out / mf.OVERLAY_DIR / file
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    assert stored["precision"] == "mxfp4" and tensors[name][0, 0, 0] < 0xFE  # e8m0 0xFF is NaN
    tensors[name][0, 0, 0] += 1  # head 0, row 0, the first block of K (never padding)
    path.unlink()
    save_file(tensors, path, metadata=metadata)
    data = path.read_bytes()
    m["files"][file].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    m["tensors"][name]["sha256"] = hashlib.sha256(tensors[name].numpy().tobytes()).hexdigest()
    # the stored tensor's errors vs the (BF16) source split: recorded as they now are, they cannot tell either
    kv_b = entry["source"]["tensor"]
    assert entry["source"]["format"] == "bf16"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(out / weight_map[kv_b], framework="pt") as f:
        ref = dict(zip(mf.PROJECTIONS, split_kv_b(f.get_tensor(kv_b).float(), mf.parse_geometry(m)), strict=True))
    layer = next(layer for layer in mf.parse_mla(m) if layer.layer == 1)
    now = stored_to_float(getattr(layer, proj), out / mf.OVERLAY_DIR, mf.parse_tensors(m))
    err, head_err = rel_errors(now, ref[proj])
    assert err != stored["rel_error"]  # the block's values did change
    stored.update(rel_error=err, max_head_rel_error=head_err)
    write_manifest(out, m)
    problems = verify(out).problems
    assert problems == [f"{name}: stored bytes differ from those re-derived from {kv_b}"], problems  # the scale
    runtime.open(out, backend="torch", verify=True).mla(1)


def test_a_source_shard_swapped_for_another_revision(out, synth_ckpt):
    """Same names and shapes, other values (another revision of the checkpoint): the fingerprint catches it."""
    other = synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2, seed=1)
    kv_b = manifest(out)["mla"][0]["source"]["tensor"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][kv_b]
    shutil.copyfile(other / shard, out / shard)
    problems = verify(out).problems
    assert any(kv_b in p and "differs from the one the overlay was made from" in p for p in problems), problems


def test_two_source_shards_swapped_with_each_other(out):
    index = json.loads((out / "model.safetensors.index.json").read_text())
    a, b = sorted(set(index["weight_map"].values()))[:2]
    (out / a).rename(out / "tmp")
    (out / b).rename(out / a)
    (out / "tmp").rename(out / b)
    problems = verify(out).problems
    sizes = [p for p in problems if "bytes, the original" in p]  # the synthetic shards differ in size
    assert sorted(p.split(" has ")[0] for p in sizes) == [str(out / a), str(out / b)], problems
    rest = [p for p in problems if p not in sizes]
    assert len(rest) == 1 and "cannot open the source" in rest[0] and (a in rest[0] or b in rest[0]), problems


def test_a_source_tensor_rewritten_in_place_is_named(out):
    m = manifest(out)
    kv_b = m["mla"][1]["source"]["tensor"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"][kv_b]
    tensors = load_file(shard)
    tensors[kv_b].view(torch.uint8).view(-1)[0] ^= 1  # one bit of one stored byte
    shard.unlink()
    save_file(tensors, shard, metadata={"format": "pt"})
    problems = verify(out).problems
    assert any(kv_b in p and "differs" in p for p in problems), problems


def test_an_mla_layer_dropped_from_every_section_is_caught(out):
    """Layer 2's mla entry, tensors, file and source fingerprint removed and its file deleted: consistent in
    itself, but the source has that layer and the runtime cannot serve it."""
    m = manifest(out)
    entry = next(e for e in m["mla"] if e["layer"] == 2)
    m["mla"].remove(entry)
    for name in [t for p in mf.PROJECTIONS for t in (entry[p]["weight"], entry[p]["scale"]) if t]:
        file = m["tensors"].pop(name)["file"]
    del m["files"][file]
    module = entry["source"]["tensor"].removesuffix("weight")
    m["source"]["tensors"] = {t: h for t, h in m["source"]["tensors"].items() if not t.startswith(module)}
    (out / mf.OVERLAY_DIR / file).unlink()
    write_manifest(out, m)
    with pytest.raises(GlmPackError, match="layer 2 has no MLA overlay"):
        runtime.open(out, backend="torch").mla(2)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "the manifest lacks MLA layers of the source: [2]" in r.output, r.output


def test_mla_entries_swapped_between_layers_are_caught(out):
    """Layers 0 and 1 trade their layer numbers: every entry still re-derives from the source tensor it names."""
    m = manifest(out)
    m["mla"][0]["layer"], m["mla"][1]["layer"] = m["mla"][1]["layer"], m["mla"][0]["layer"]
    write_manifest(out, m)
    problems = verify(out).problems
    assert any(
        p.startswith("MLA layer 0 is recorded as derived from model.layers.1.self_attn.kv_b_proj.weight")
        for p in problems
    ), problems


@pytest.mark.parametrize(
    "policy, threshold, says",
    [
        ("bf16", None, "stored mxfp4, but options.mla_precision bf16 gives bf16"),
        ("fp4", None, "options.mla_precision 'fp4' is not one of"),
        ("auto", 0.05, "stored mxfp4, but options.mla_precision auto with max_rel_error 0.05 (MXFP4 error 0.1"),
        ("auto", None, "options.max_rel_error None is not the number auto needs"),
    ],
)
def test_stored_precisions_must_match_the_recorded_option(out, policy, threshold, says):
    m = manifest(out)  # converted with mla_precision mxfp4: every MXFP4 error is about 0.11
    m["options"].update(mla_precision=policy, max_rel_error=threshold)
    write_manifest(out, m)
    problems = verify(out).problems
    assert any(says in p for p in problems), problems
    if policy in ("bf16", "auto") and threshold:
        assert sum(says in p for p in problems) == 2 * len(m["mla"]) and _kc(m)["weight"] in problems[0]


def test_auto_decisions_within_the_recorded_threshold_pass(out):
    m = manifest(out)
    m["options"].update(mla_precision="auto", max_rel_error=0.5)  # every MXFP4 error is below it: all mxfp4
    write_manifest(out, m)
    assert verify(out).ok


def test_a_recorded_mxfp4_error_that_is_not_the_tensors_is_caught(out):
    """mxfp4_rel_error (what decides `auto` and what the card quotes for BF16-kept tensors) is recomputed too: for
    an MXFP4-stored tensor it must be its error, whatever the policy (verify used to check only rel_error)."""
    m = manifest(out)
    _kc(m)["mxfp4_rel_error"] = _kc(m)["rel_error"] / 2
    write_manifest(out, m)
    problems = verify(out).problems
    assert len(problems) == 1 and _kc(m)["weight"] in problems[0] and "MXFP4 error" in problems[0], problems


@pytest.mark.parametrize("key, says", [("rel_error", "error vs source"), ("mxfp4_rel_error", "MXFP4 error vs source")])
def test_a_recorded_error_off_by_a_thousandth_is_caught(out, key, says):
    """Both recorded errors are recomputed from the stored tensors and compared within ERROR_TOLERANCE (1e-4,
    relative): one 0.1 % off is named (the errors the card quotes and `auto` decides by)."""
    m = manifest(out)
    _kc(m)[key] *= 1.001
    write_manifest(out, m)
    problems = verify(out).problems
    assert len(problems) == 1 and problems[0].startswith(f"{_kc(m)['weight']}: {says} "), problems


@pytest.fixture(scope="module")
def bf16_kept(synth_ckpt, tmp_path_factory) -> dict:
    """BF16-policy outputs whose mxfp4_rel_error verify must re-derive as convert did: with --quant-mode mse from
    a BF16 source (the rule is only in options), and from an MXFP4-attention source (w_vc from its bytes: 0);
    ``mxfp4-source-kept``: that source under the MXFP4 policy (w_vc stored as the source's bytes)."""
    from glm_pack.convert.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("bf16-kept")
    convert(
        synth_ckpt("glm-5", "bf16", layers=2, experts=1, mtp=False),
        root / "mse",
        ConvertOptions(files="none", mla_precision="bf16", quant_mode="mse"),
    )
    convert(
        synth_ckpt("glm-5", "mxfp4-attn", layers=2, experts=1, mtp=False),
        root / "mxfp4-source",
        ConvertOptions(files="none", mla_precision="bf16"),
    )
    convert(
        synth_ckpt("glm-5", "mxfp4-attn", layers=2, experts=1, mtp=False),
        root / "mxfp4-source-kept",
        ConvertOptions(files="none"),
    )
    return {case: root / case for case in ("mse", "mxfp4-source", "mxfp4-source-kept")}


@pytest.mark.parametrize("case", ["mse", "mxfp4-source"])
def test_mxfp4_errors_of_bf16_kept_tensors_are_recomputed(bf16_kept, tmp_path, case):
    out = tmp_path / case
    shutil.copytree(bf16_kept[case], out)
    report = verify(out)
    assert report.ok and report.source_checked, report.problems
    m = manifest(out)
    entry = m["mla"][1]["w_vc"]
    assert entry["precision"] == "bf16"
    assert (entry["mxfp4_rel_error"] == 0) == (case == "mxfp4-source")  # the MXFP4 source's own bytes
    entry["mxfp4_rel_error"] = 0.2  # still above nothing the policy reads: only the recomputation can tell
    write_manifest(out, m)
    problems = verify(out).problems
    assert len(problems) == 1 and entry["weight"] in problems[0] and "MXFP4 error" in problems[0], problems


def test_source_bytes_recorded_as_requantized_are_caught(bf16_kept, tmp_path):
    """A w_vc kept as the MXFP4 source's bytes must say so (quant.mode `source`): recorded as `even` it is named
    (requantizing the source with `even` gives the same bytes here, so the byte comparison alone passed it)."""
    out = tmp_path / "out"
    shutil.copytree(bf16_kept["mxfp4-source-kept"], out)
    assert verify(out).ok
    m = manifest(out)
    entry = m["mla"][0]["w_vc"]
    assert entry["quant"]["mode"] == "source"
    entry["quant"]["mode"] = "even"
    write_manifest(out, m)
    problems = verify(out).problems
    assert any(entry["weight"] in p and "recorded scale rule 'even'" in p for p in problems), problems


def test_a_run_rule_the_tensors_do_not_follow_is_caught(bf16_kept, tmp_path):
    """options.quant_mode is the rule convert applied to every projection it quantized (the card quotes it): an
    `even` output whose options claim `mse` is named (each tensor was re-derived with its own recorded rule, so
    it passed)."""
    out = tmp_path / "out"
    shutil.copytree(bf16_kept["mxfp4-source-kept"], out)
    m = manifest(out)
    assert m["options"]["quant_mode"] == "even" and _kc(m)["quant"]["mode"] == "even"
    m["options"]["quant_mode"] = "mse"
    write_manifest(out, m)
    problems = verify(out).problems
    rule = "recorded scale rule 'even', but the source gives 'mse'"
    assert any(_kc(m)["weight"] in p and rule in p for p in problems), problems
    assert not any("w_vc" in p for p in problems), problems  # the source's own bytes follow no run rule


@pytest.mark.parametrize("value", ["bogus", None])
def test_an_unknown_recorded_quant_mode_is_named_as_the_manifests(bf16_kept, tmp_path, value):
    """options.quant_mode is what a BF16-kept tensor's MXFP4 error is recomputed with: an unknown one is named as
    that manifest field, not as a source tensor that cannot be re-derived (the source is fine)."""
    out = tmp_path / "out"
    shutil.copytree(bf16_kept["mse"], out)
    m = manifest(out)
    m["options"]["quant_mode"] = value
    write_manifest(out, m)
    problems = verify(out).problems
    assert problems == [
        f"options.quant_mode {value!r} is not one of even, floor, roundup, mse: MLA layers not re-derived"
    ], problems
