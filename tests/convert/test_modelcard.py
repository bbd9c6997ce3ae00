"""The generated model card: metadata parsed back with huggingface_hub's own loader, body checked against
the manifest, the source card kept, refreshes idempotent, overlay-only cards beside the overlay."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner
from huggingface_hub import ModelCard
from test_push import SOURCE_README, converted_fixture, out_fixture  # noqa: F401  (fixtures: converted, out)

from glm_pack.convert.cli import main
from glm_pack.convert.modelcard import render_card, write_card
from glm_pack.convert.verify import verify
from glm_pack.packing.manifest import PROJECTIONS

TAGS = {"glm", "mla", "mxfp4", "rocm", "gfx950"}


def _manifest(out) -> dict:
    return json.loads((out / "glm-pack" / "manifest.json").read_text())


def test_card_metadata_round_trips_through_the_hub_loader(out):
    result = CliRunner().invoke(main, ["card", str(out), "--base-model", "zai-org/GLM-5"])
    assert result.exit_code == 0, result.output
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "zai-org/GLM-5"
    assert data["base_model_relation"] == "quantized"
    assert data["license"] == "apache-2.0"  # carried over from the source card
    assert data["library_name"] == "transformers"  # the original weights load as the source said
    assert TAGS <= set(data["tags"])
    assert (out / "README.source.md").read_bytes() == SOURCE_README


def test_card_body_reports_the_manifest(out):
    text = render_card(out)
    manifest = _manifest(out)
    for entry in manifest["mla"]:
        kc, vc = entry["w_kc"], entry["w_vc"]
        row = (
            f"| {entry['layer']} | {kc['precision']} | {kc['rel_error']:.4f} | {kc['max_head_rel_error']:.4f} | "
            f"{vc['precision']} | {vc['rel_error']:.4f} | {vc['max_head_rel_error']:.4f} |"
        )
        assert row in text
        assert entry["source"]["tensor"] in text
    kc = manifest["mla"][0]["w_kc"]["layout"]
    assert f"{kc['k_logical']} → {kc['k_stored']}" in text  # K padding 192 -> 256 is stated
    assert "`even`" in text and "gfx950" in text
    assert "glm_pack.runtime.open(" in text
    assert "stock engines" in text.lower() and "original" in text
    assert manifest["source"]["config_sha256"] in text
    config = json.loads((out / "config.json").read_text())  # the source's own geometry, not the manifest's
    h, rank = config["num_attention_heads"], config["kv_lora_rank"]
    assert f"`[{h}, {rank}, {config['qk_nope_head_dim']}]`" in text  # w_kc [heads, kv_lora_rank, nope]
    assert f"`[{h}, {config['v_head_dim']}, {rank}]`" in text  # w_vc [heads, v_head_dim, kv_lora_rank]
    assert f"weight of {len(manifest['mla'])} layer(s) (" in text


def test_card_of_a_manifest_without_worst_head_errors(out):
    """A manifest written before max_head_rel_error was recorded: its cells read n/a and the summary names no worst
    head, rather than failing or inventing one."""
    path = out / "glm-pack" / "manifest.json"
    manifest = json.loads(path.read_text())
    for entry in manifest["mla"]:
        for p in PROJECTIONS:
            del entry[p]["max_head_rel_error"]
    path.unlink()  # a hard link into the shared conversion: replace, never write through
    path.write_text(json.dumps(manifest))
    text = render_card(out)
    kc, vc = manifest["mla"][0]["w_kc"], manifest["mla"][0]["w_vc"]
    row = f"| 0 | mxfp4 | {kc['rel_error']:.4f} | n/a | mxfp4 | {vc['rel_error']:.4f} | n/a |"
    summary = text.split("Summary: ", 1)[1].split("\n", 1)[0]
    assert row in text and summary.startswith("w_kc MXFP4 max ") and "worst head" not in summary, summary


def test_an_out_whose_source_card_was_moved_aside_still_verifies(out):
    """verify checks the placed originals' sizes: the source's README.md, moved to README.source.md for glm-pack's
    card, is checked there (the card itself is no original; without README.source.md it is taken for the source's)."""
    write_card(out)
    assert (out / "README.md").read_bytes() != SOURCE_README
    report = verify(out)
    assert report.ok, report.problems
    (out / "README.source.md").unlink()  # the source card lost: README.md is taken for it, and is not it
    card = out / "README.md"
    assert verify(out).problems == [f"{card} has {card.stat().st_size} bytes, the original {len(SOURCE_README)}"]


@pytest.mark.parametrize("source_card", [True, False])
def test_an_out_converted_from_a_glm_pack_output_takes_a_new_card_and_verifies(out, tmp_path, source_card):
    """A glm-pack output converted again (with other options) brings its card along as an original README.md;
    `card` replaces it with the new output's own, and verify accepts that (it reported the card's size against the
    old one's and failed, refusing every push), while a README.md no glm-pack card in its place is still a problem.
    With the first output's README.source.md (the model's own card) placed too, the new card keeps that one."""
    from glm_pack.convert.convert import ConvertOptions, convert

    write_card(out)  # the first output as it would be published: glm-pack's card, the source's kept aside
    if not source_card:
        (out / "README.source.md").unlink()
    again = tmp_path / "again"
    convert(out, again, ConvertOptions(k_pad="none"))
    old_card = (out / "README.md").read_bytes()
    assert (again / "README.md").read_bytes() == old_card
    assert _manifest(again)["source"]["files"]["README.md"] == {"size": len(old_card), "glm_pack_card": True}
    assert verify(again).ok
    write_card(again)
    new_card = (again / "README.md").read_bytes()
    assert b"No K padding." in new_card and b"No K padding." not in old_card
    assert (again / "README.source.md").exists() == source_card
    report = verify(again)
    assert report.ok, report.problems
    (again / "README.md").unlink()
    (again / "README.md").write_bytes(b"# someone's notes\n")
    assert verify(again).problems == [f"{again / 'README.md'} has 18 bytes, the original {len(old_card)}"]


def test_source_readme_kept_and_source_untouched(out, converted):
    source_readme = (out / "README.md").read_bytes()
    assert source_readme == SOURCE_README  # before: the original, hard-linked from the source
    write_card(out)
    first = (out / "README.md").read_bytes()
    assert first != SOURCE_README
    assert (out / "README.source.md").read_bytes() == SOURCE_README
    assert (converted / "README.md").read_bytes() == SOURCE_README  # link replaced, not written through
    write_card(out)  # a refresh keeps the kept source card and gives the same bytes
    assert (out / "README.md").read_bytes() == first
    assert (out / "README.source.md").read_bytes() == SOURCE_README


def test_a_source_card_that_is_no_utf8_is_kept_aside(out):
    """A source README.md that is not UTF-8 (Latin-1 here) is kept as README.source.md, byte for byte, and the card
    written; `card` failed with a UnicodeDecodeError traceback comparing it with the new card."""
    latin1 = SOURCE_README.replace(b"# GLM-5 small", b"# GLM-5 caf\xe9")
    (out / "README.md").unlink()  # replaced, never written through (a hard link to the shared OUT)
    (out / "README.md").write_bytes(latin1)
    r = CliRunner().invoke(main, ["card", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "README.source.md").read_bytes() == latin1
    data = ModelCard.load(out / "README.md").data.to_dict()
    assert data["license"] == "apache-2.0" and TAGS <= set(data["tags"])


@pytest.mark.parametrize("name", ["README.md", "README.source.md", "glm-pack/README.md"])
def test_a_card_that_cannot_be_read_is_one_line_naming_it(out, monkeypatch, name, refuse):
    """A model card glm-pack reads (the source's README.md, the one kept aside, the card an earlier run wrote) that
    cannot be read (a permission, an I/O error): one line naming it, exit 1, OUT unchanged; it was the raw OSError
    (a traceback)."""
    overlay_only = name.startswith("glm-pack/")
    write_card(out, overlay_only=overlay_only)  # README.source.md, or glm-pack/README.md, exists
    before = {p: p.read_bytes() for p in out.rglob("README*.md")}
    target = out / name
    refuse(type(target), "open", target)
    r = CliRunner().invoke(main, ["card", str(out), *(["--overlay-only"] if overlay_only else [])])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert f"cannot read the model card: Permission denied (file {target})" in r.output, r.output
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in out.rglob("README*.md")} == before


def test_overlay_only_card_beside_the_overlay(out):
    path = write_card(out, overlay_only=True)
    assert path == out / "glm-pack" / "README.md"
    assert (out / "README.md").read_bytes() == SOURCE_README
    assert not (out / "README.source.md").exists()
    data = ModelCard.load(path).data.to_dict()
    assert data["library_name"] == "glm-pack"
    assert data["license"] == "apache-2.0"
    assert TAGS <= set(data["tags"])
    assert "base_model" not in data  # a local source, no --base-model given


def test_base_model_from_the_manifest_and_no_source_card(out):
    manifest = _manifest(out)
    manifest["source"]["repo_id"] = "zai-org/GLM-5"
    manifest["source"]["revision"] = "abc123"
    manifest["source"]["path"] = None
    path = out / "glm-pack" / "manifest.json"
    path.unlink()
    path.write_text(json.dumps(manifest))
    (out / "README.md").unlink()
    card = ModelCard(render_card(out))
    data = card.data.to_dict()
    assert data["base_model"] == "zai-org/GLM-5"
    assert "license" not in data
    assert "`zai-org/GLM-5` at revision `abc123`" in card.text
    assert "README.source.md" not in card.text
    # An explicit --base-model wins over the manifest's source repo (e.g. a fine-tune converted from its base's repo).
    explicit = ModelCard(render_card(out, base_model="someone/GLM-5-tuned")).data.to_dict()
    assert explicit["base_model"] == "someone/GLM-5-tuned"



def test_card_without_a_base_model_says_how_to_name_one(out):
    """A local source's card names no base model unless --base-model gives one (README); `card` says so in a note
    line, and stops saying it once the card names one (given now, or kept from an earlier card on refresh)."""
    path = out / "README.md"
    note = (
        f"note: the card {path} names no base model: pass --base-model REPO (the source model's Hub repo) to link it "
        "on the Hub"
    )
    result = CliRunner().invoke(main, ["card", str(out)])
    assert result.exit_code == 0 and result.output.splitlines() == [f"model card written: {path}", note], result.output
    data = ModelCard.load(path).data.to_dict()
    assert "base_model" not in data and "base_model_relation" not in data  # a relation to no base: none
    assert "mxfp4" in data["tags"]  # though glm-pack quantized (with a base, the relation is "quantized")
    for args in (["--base-model", "zai-org/GLM-5"], []):  # named, then kept by the refresh
        result = CliRunner().invoke(main, ["card", str(out), *args])
        assert result.exit_code == 0 and result.output == f"model card written: {path}\n", result.output


@pytest.mark.parametrize("overlay_only", [False, True])
def test_a_refresh_keeps_the_base_model_an_earlier_card_named(out, overlay_only):
    """README's sequence `card OUT --base-model REPO`, then `push OUT ...` (which refreshes the card) published a card
    without base_model for a local source: the refresh rendered it from the manifest alone. It now keeps the one the
    card at OUT names; an explicit --base-model still replaces it."""
    flag = ["--overlay-only"] if overlay_only else []
    path = out / "glm-pack" / "README.md" if overlay_only else out / "README.md"
    assert CliRunner().invoke(main, ["card", str(out), *flag, "--base-model", "zai-org/GLM-5"]).exit_code == 0
    assert CliRunner().invoke(main, ["card", str(out), *flag, "--repo-id", "me/GLM-5-gfx950"]).exit_code == 0
    data = ModelCard.load(path).data.to_dict()
    assert data["base_model"] == "zai-org/GLM-5" and data["base_model_relation"] == "quantized"
    assert "me/GLM-5-gfx950" in path.read_text()
    assert CliRunner().invoke(main, ["card", str(out), *flag, "--base-model", "someone/GLM-5-tuned"]).exit_code == 0
    assert ModelCard.load(path).data.to_dict()["base_model"] == "someone/GLM-5-tuned"


@pytest.fixture(scope="session")
def precision_outs(tmp_path_factory) -> dict:
    """Real conversions of one 2-layer synthetic checkpoint under each MLA precision policy, by case name.

    ``mixed`` is ``auto`` with a bound between the two layers' w_kc MXFP4 errors (one w_kc stays BF16, the
    other is MXFP4, both K-padded); ``auto-all-bf16`` is ``auto`` with the bound 0, which every error exceeds.
    """
    from glm_pack.convert.convert import ConvertOptions, convert
    from glm_pack.convert.synth import synthesize

    root = tmp_path_factory.mktemp("precisions")
    src = synthesize(root / "src", card="glm-5", layers=2, experts=1, fmt="bf16", seed=0, mtp=False)
    cases = {
        "mxfp4": ConvertOptions(),
        "bf16": ConvertOptions(mla_precision="bf16"),
        "auto-all-bf16": ConvertOptions(mla_precision="auto", max_rel_error=0.0),
    }
    for case, options in cases.items():
        convert(src, root / case, options)
    kc = [e["w_kc"]["mxfp4_rel_error"] for e in _manifest(root / "mxfp4")["mla"]]
    convert(src, root / "mixed", ConvertOptions(mla_precision="auto", max_rel_error=(min(kc) + max(kc)) / 2))
    return {case: root / case for case in (*cases, "mixed")}


def _stored(manifest: dict) -> list[tuple[bool, int, int]]:
    """Per projection, from the manifest's tensors table: (stored as MXFP4, K logical, K stored)."""
    tensors = manifest["tensors"]
    stored = []
    for entry in manifest["mla"]:
        for proj in (entry["w_kc"], entry["w_vc"]):
            dtype = tensors[proj["weight"]]["dtype"]
            mxfp4 = proj["scale"] is not None and dtype == "U8" and tensors[proj["scale"]]["dtype"] == "U8"
            assert mxfp4 or (dtype == "BF16" and proj["scale"] is None), proj
            stored.append((mxfp4, proj["layout"]["k_logical"], proj["layout"]["k_stored"]))
    return stored


def _title_intro_layout(text: str) -> tuple[str, str, str]:
    """The card's title, intro paragraph and layout paragraph (whitespace collapsed)."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# "))
    paragraphs = [" ".join(p.split()) for p in "\n".join(lines[at + 1 :]).split("\n\n") if p.strip()]
    layout = [p for p in paragraphs if p.startswith("Layout `bmm_nk`")]
    assert len(layout) == 1
    return lines[at][2:], paragraphs[0], layout[0]


CASES = {"mxfp4": (True, False), "bf16": (False, True), "auto-all-bf16": (False, True), "mixed": (True, True)}


@pytest.mark.parametrize("case", list(CASES))
def test_card_describes_the_stored_precisions(precision_outs, case):
    stored = _stored(_manifest(precision_outs[case]))
    any_mx, any_bf = any(s[0] for s in stored), not all(s[0] for s in stored)
    padded_mx = any(mx and k != ks for mx, k, ks in stored)
    padded_bf = any(not mx and k != ks for mx, k, ks in stored)
    assert (any_mx, any_bf) == CASES[case]  # the fixture made this mix
    assert case != "mixed" or (padded_mx and padded_bf)
    text = render_card(precision_outs[case])
    title, intro, layout = _title_intro_layout(text)
    assert ("MXFP4" in title, "BF16" in title) == (any_mx, any_bf), title
    assert ("quantized to MXFP4" in intro, "BF16" in intro) == (any_mx, any_bf), intro
    if any_mx and any_bf:
        assert f"{sum(s[0] for s in stored)} of {len(stored)} quantized to MXFP4" in intro, intro
    assert ("codes" in layout, "scale" in layout) == (any_mx, any_mx), layout  # MXFP4 wording only for MXFP4
    for k, ks in sorted({(k, ks) for _, k, ks in stored if k != ks}):
        assert f"{k} → {ks}" in layout
    assert ("0x7F" in layout, "zero columns" in layout) == (padded_mx, padded_bf), layout
    assert ("No projection is quantized" in text) == (not any_mx)
    kernels = next(line for line in text.splitlines() if line.startswith("- K-up and V-up:"))
    assert ("batched_gemm_a16wfp4" in kernels, "plain BF16 batched matmul" in kernels) == (any_mx, any_bf)
    tags = ModelCard(text).data.to_dict()["tags"]
    assert ("mxfp4" in tags) == any_mx, tags
    data = ModelCard(render_card(precision_outs[case], base_model="zai-org/GLM-5")).data.to_dict()
    assert data["base_model"] == "zai-org/GLM-5"  # nothing quantized (all BF16): no claim that it is
    assert data.get("base_model_relation") == ("quantized" if any_mx else None), data


@pytest.mark.parametrize("case", ["auto-all-bf16", "mixed", "bf16"])
def test_provenance_states_the_recorded_error_bound(precision_outs, case):
    bound = _manifest(precision_outs[case])["options"]["max_rel_error"]
    text = " ".join(render_card(precision_outs[case]).split())
    assert f"max relative error `{'none' if bound is None else bound}`" in text
    if bound is not None:  # the policy line names the same bound
        assert f"exceed {bound}" in text


@pytest.mark.parametrize("card", ["glm-5", "glm-5.3-flash"], ids=["rope", "rope-free"])
def test_how_to_use_snippet_runs_against_the_output(synth_ckpt, tmp_path, monkeypatch, card):
    """The card's python block, run as written (on CPU, the download stubbed to OUT) on inputs of the
    model's shapes: with rope it must pass q's rope part, rope-free it must not."""
    import huggingface_hub
    import torch

    from glm_pack.convert.convert import ConvertOptions, convert

    out = tmp_path / "out"
    convert(synth_ckpt(card, "bf16"), out, ConvertOptions(files="none"))
    text = render_card(out, overlay_only=True)
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'device="cuda"' in code
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(out))
    g = _manifest(out)["model"]["geometry"]
    tokens, slots, topk = 2, 16, 4
    gen = torch.Generator().manual_seed(0)
    width = g["qk_nope_head_dim"] + g["qk_rope_head_dim"]
    scope = {
        "q": torch.randn(tokens, g["num_heads"], width, generator=gen).bfloat16(),
        "cache": torch.randn(slots, g["kv_lora_rank"] + g["qk_rope_head_dim"], generator=gen).bfloat16(),
        "kv_indptr": torch.arange(0, tokens * topk + 1, topk, dtype=torch.int32),
        "kv_indices": torch.randint(0, slots, (tokens * topk,), generator=gen, dtype=torch.int32),
        "softmax_scale": width**-0.5,
    }
    exec(code.replace('device="cuda"', 'device="cpu"'), scope)
    assert scope["y"].shape == (tokens, g["num_heads"], g["v_head_dim"])
    assert torch.isfinite(scope["y"].float()).all()


def test_card_names_a_layer_file_and_the_repacked_experts(synth_ckpt, tmp_path, out):
    """With --repack-experts the example overlay file is a layer's, and the experts are described rather than
    "No other tensor was changed"; without experts that sentence stays."""
    from glm_pack.convert.convert import ConvertOptions, convert

    repacked = tmp_path / "repacked"
    options = ConvertOptions(files="none", repack_experts="aiter-a4w4")
    convert(synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2), repacked, options)
    manifest = _manifest(repacked)
    groups = manifest["experts"]["groups"]
    text = " ".join(render_card(repacked, overlay_only=True).split())
    layer_file = manifest["tensors"][manifest["mla"][0]["w_kc"]["weight"]]["file"]
    assert f"one overlay file per layer (e.g. `glm-pack/{layer_file}`)" in text
    # the source tensor is one layer's, given as an example: it read as if it were the only one
    source = manifest["mla"][0]["source"]["tensor"]
    assert f"Source tensors: each MLA layer's `kv_b_proj` (e.g. `{source}`; source format " in text, text
    assert "No other tensor was changed" not in text
    n_tensors = sum(len(g["tensors"]) for g in groups)
    assert f"{n_tensors} expert tensors" in text and "`aiter_moe_a4w4`" in text
    assert f"in {len(groups)} overlay file(s) (`glm-pack/{groups[0]['file']}`)" in text
    assert "No other tensor was changed." in render_card(out)


def test_card_and_push_refuse_a_full_card_for_an_out_without_originals(converted, tmp_path):
    """An OUT converted with --files none holds only the overlay: a root card would claim the original weights
    are there, so `card` refuses as `push` does (one line, exit 1, nothing written); --overlay-only works."""
    from glm_pack.convert.convert import ConvertOptions, convert

    out = tmp_path / "overlay"
    convert(converted.parent / "src", out, ConvertOptions(files="none"))
    shutil.copyfile(converted / "config.json", out / "config.json")  # the runtime's config, still no weights
    before = sorted(p.name for p in out.iterdir())
    for args, action in ((["card"], "write its card"), (["push", "--dry-run"], "push it")):
        r = CliRunner().invoke(main, [*args, str(out), *(["tester/x"] if "push" in args else [])])
        assert r.exit_code == 1, r.output
        (line,) = r.output.strip().splitlines()
        assert line.startswith(
            f"glm-pack: error: {out} holds no original files (converted with --files none): {action} with"
            " --overlay-only"
        )
        assert sorted(p.name for p in out.iterdir()) == before
    r = CliRunner().invoke(main, ["card", str(out), "--overlay-only"])
    assert r.exit_code == 0 and (out / "glm-pack" / "README.md").is_file()
    linked = tmp_path / "linked"
    shutil.copytree(converted, linked, copy_function=os.link)
    (linked / "config.json").unlink()  # a link output that lost its config: not "converted with --files none"
    r = CliRunner().invoke(main, ["card", str(linked)])
    assert r.exit_code == 1 and f"{linked} lacks its original config.json: write its card with" in r.output


@pytest.mark.parametrize(
    ("card", "k", "kc_precisions", "ragged"),
    [
        ("glm-5", 192, ["mxfp4"], True),
        ("glm-5", 192, ["bf16", "mxfp4"], True),  # auto: layer 0's w_kc in BF16, layer 1's MXFP4
        ("deepseek-v3", 128, ["mxfp4"], False),
        ("glm-5", 192, ["bf16", "bf16"], False),  # no MXFP4 w_kc: no aiter K-up GEMM at all
    ],
)
def test_unpadded_route_text_says_whether_aiter_defaults_split_k_raggedly(card, k, kc_precisions, ragged):
    """aiter's batched A16WFP4 wrapper shrinks its default BLOCK_SIZE_K=256 to the next power of two >= K when
    one block covers K (ROCm/aiter e4048607 aiter/ops/triton/gemm/batched/batched_gemm_a16wfp4.py lines
    153-155): K = 128 takes the even path, K = 192 the ragged one, still wrong there (kernel lines 191-193).
    A w_kc kept in BF16 is a plain BF16 matmul, which the ragged-K warning does not concern."""
    from types import SimpleNamespace

    from glm_pack.convert.cards import load_card
    from glm_pack.convert.modelcard import _kernel_fields

    vc = SimpleNamespace(precision="mxfp4", k_stored=512, k_logical=512)
    layers = [
        SimpleNamespace(w_kc=SimpleNamespace(precision=p, k_stored=k, k_logical=k), w_vc=vc) for p in kc_precisions
    ]
    manifest = {"kernel_configs": {"route": "unpadded", "configs": load_card(card).kernel_configs("unpadded")}}
    text = _kernel_fields(manifest, layers)["route_text"]
    assert ("raggedly" in text) == ragged, text
    if "mxfp4" in kc_precisions:
        assert f"unpadded (K = {k})" in text and "`BLOCK_SIZE_K=64`" in text, text
    else:
        assert "A16WFP4" not in text and "plain BF16 batched matmul" in text, text
        padded = {"kernel_configs": {"route": "padded", "configs": load_card(card).kernel_configs("padded")}}
        text = _kernel_fields(padded, layers)["route_text"]  # K-padded BF16: still no K-up GEMM to speak of
        assert "even-K path" not in text and "plain BF16 batched matmul" in text, text


@pytest.fixture(scope="module")
def quantized_source_outs(synth_ckpt, tmp_path_factory) -> dict:
    """Conversions of sources whose kv_b_proj is quantized. From MXFP4 attention: ``mxfp4`` (w_kc requantized with
    `even`, w_vc the source bytes) and ``auto`` with a bound below every w_kc error (w_kc BF16, w_vc still the
    source bytes); ``fp8`` from an FP8 128x128-block source."""
    from glm_pack.convert.convert import ConvertOptions, convert

    mx = synth_ckpt("glm-5", "mxfp4-attn", layers=2, experts=1, mtp=False)
    fp8 = synth_ckpt("glm-5", "fp8-block", layers=2, experts=1, mtp=False)
    root = tmp_path_factory.mktemp("quantized-source")
    convert(mx, root / "mxfp4", ConvertOptions(files="none"))
    convert(mx, root / "auto", ConvertOptions(files="none", mla_precision="auto", max_rel_error=0.001))
    convert(fp8, root / "fp8", ConvertOptions(files="none"))
    return {case: root / case for case in ("mxfp4", "auto", "fp8")}


@pytest.mark.parametrize("case", ["mxfp4", "auto"])
def test_card_names_each_recorded_scale_rule(quantized_source_outs, case):
    """Each MXFP4 projection's recorded quant.mode is named with its meaning and count; w_vc kept as source bytes is
    never described as requantized (the card used to name only the first projection's rule, and called `source`
    "best of three exponents per block")."""
    manifest = _manifest(quantized_source_outs[case])
    modes = [e[p]["quant"]["mode"] for e in manifest["mla"] for p in PROJECTIONS if e[p]["precision"] == "mxfp4"]
    assert "source" in modes
    text = " ".join(render_card(quantized_source_outs[case], overlay_only=True).split())
    para = next(p for p in text.split("## ") if p.startswith("Quantization"))
    assert "best of three exponents" not in para, para
    assert "`source` (the source checkpoint's MXFP4 bytes, kept as they are" in para, para
    if len(set(modes)) > 1:
        for mode in set(modes):
            assert f"`{mode}` (" in para and f": {modes.count(mode)} projections)" in para, para
    else:
        assert "rounding" not in para, para  # glm-pack rounded nothing: the bytes are the source's


@pytest.mark.parametrize("case", ["bf16-source", "mxfp4", "auto", "fp8"])
def test_card_says_errors_exclude_a_quantized_sources_own_error(quantized_source_outs, precision_outs, case):
    """Against an FP8 or MXFP4 source the recorded errors leave out the source's own quantization error (w_vc kept
    as MXFP4 source bytes reads 0): the card says so, naming the source format; from a BF16 source it says nothing
    of the kind."""
    out = precision_outs["mxfp4"] if case == "bf16-source" else quantized_source_outs[case]
    manifest = _manifest(out)
    formats = {e["source"]["format"] for e in manifest["mla"]}
    text = " ".join(render_card(out, overlay_only=True).split())
    if case == "bf16-source":
        assert formats == {"bf16"} and "already quantized" not in text
        return
    (fmt,) = formats
    assert f"The source `kv_b_proj` is already quantized ({fmt}): these errors are measured against its" in text
    kept = any(e["w_vc"]["quant"].get("mode") == "source" for e in manifest["mla"])
    assert kept == (fmt == "mxfp4")
    assert ("w_vc keeps the source's MXFP4 bytes" in text) == kept
    if kept:
        assert all(e["w_vc"]["rel_error"] == 0 for e in manifest["mla"])  # the 0 the card explains
    # w_kc is said to be quantized again only where it was: `auto` here keeps every w_kc in BF16
    kc_mxfp4 = any(e["w_kc"]["precision"] == "mxfp4" for e in manifest["mla"])
    assert kc_mxfp4 == (case != "auto")
    assert ("w_kc stored as MXFP4 is quantized again" in text) == (kept and kc_mxfp4), text
    assert "w_kc is quantized again" not in text, text


@pytest.mark.parametrize("case", list(CASES))
def test_error_summary_is_per_stored_precision(precision_outs, case):
    """The summary's max / mean never mix MXFP4 and BF16 errors (a mean of 0.113 and 0.0016 is neither); each
    projection gets one max (mean) per stored precision, over the layers stored so, from the manifest."""
    manifest = _manifest(precision_outs[case])
    text = " ".join(render_card(precision_outs[case]).split())
    summary = text.split("Summary: ", 1)[1].split(" ## ", 1)[0]
    for name in PROJECTIONS:
        for precision in ("mxfp4", "bf16"):
            projs = [e[name] for e in manifest["mla"] if e[name]["precision"] == precision]
            if projs:
                errors = [p["rel_error"] for p in projs]
                mean, n = sum(errors) / len(errors), len(errors)
                head = max(p["max_head_rel_error"] for p in projs)
                stated = (
                    f"{name} {precision.upper()} max {max(errors):.4f} (mean {mean:.4f}, worst head {head:.4f}) "
                    f"over {n} layer(s)"
                )
                assert stated in summary, summary
            else:
                assert f"{name} {precision.upper()}" not in summary, summary
