"""The generated model card: metadata parsed back with huggingface_hub's own loader, body checked against
the manifest, the source card kept, refreshes idempotent, overlay-only cards beside the overlay."""

from __future__ import annotations

import json

from click.testing import CliRunner
from huggingface_hub import ModelCard
from test_push import SOURCE_README, converted_fixture, out_fixture  # noqa: F401  (fixtures: converted, out)

from glm_pack.convert.cli import main
from glm_pack.convert.modelcard import render_card, write_card

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
            f"| {entry['layer']} | {kc['precision']} | {kc['rel_error']:.4f} | {vc['precision']} | "
            f"{vc['rel_error']:.4f} |"
        )
        assert row in text
        assert entry["source"]["tensor"] in text
    kc = manifest["mla"][0]["w_kc"]["layout"]
    assert f"{kc['k_logical']} → {kc['k_stored']}" in text  # K padding 192 -> 256 is stated
    assert "`even`" in text and "gfx950" in text
    assert "glm_pack.runtime.open(" in text
    assert "stock engines" in text.lower() and "original" in text
    assert manifest["source"]["config_sha256"] in text


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
