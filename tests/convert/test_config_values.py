"""A config.json value of the wrong type is refused in one line naming config.json, the key and the value:
from ``inspect`` and ``convert`` (no OUT created) and in ``verify``'s report; never a traceback or a misread."""

from __future__ import annotations

import copy
import json

import pytest
from click.testing import CliRunner

from glm_pack.convert import cards, formats
from glm_pack.convert.cli import main
from glm_pack.packing.errors import CheckpointError, FormatError

QC = "quantization_config"

# (synthetic source format, dotted key in config.json, bad value)
BAD = [
    ("bf16", "first_k_dense_replace", None),
    ("bf16", "first_k_dense_replace", -1),
    ("bf16", "num_nextn_predict_layers", "x"),
    ("bf16", "num_nextn_predict_layers", -1),
    ("bf16", "num_hidden_layers", "abc"),
    ("bf16", "num_hidden_layers", 1.5),  # was truncated to 1: layer 1 then passed for the MTP layer
    ("bf16", "num_hidden_layers", True),
    ("bf16", "num_hidden_layers", "2"),  # was read as 2
    ("bf16", "n_routed_experts", -1),
    ("bf16", "mlp_layer_types", "dense"),  # was read character by character
    ("bf16", "mlp_layer_types", [1, 2, 3, 4, 5]),
    ("bf16", "architectures", "GlmMoeDsaForCausalLM"),
    ("bf16", "architectures", [["GlmMoeDsaForCausalLM"]]),
    ("bf16", "model_type", ["glm_moe_dsa"]),
    ("bf16", QC, "fp8"),
    ("fp8-block", f"{QC}.weight_block_size", 128),
    ("fp8-block", f"{QC}.weight_block_size", [True, True]),
    ("fp8-block", f"{QC}.weight_block_size", [128]),
    ("fp8-block", f"{QC}.quant_method", ["fp8"]),
    ("mxfp4-quark", f"{QC}.global_quant_config", "x"),
    ("mxfp4-quark", f"{QC}.global_quant_config.weight", [1]),
    ("mxfp4-quark", f"{QC}.exclude", [1, 2]),
    ("mxfp4-quark", f"{QC}.exclude", ["re:("]),
    ("mxfp4-quark", f"{QC}.exclude", "re:.*"),  # was iterated character by character
    ("mxfp4-quark", f"{QC}.layer_quant_config", [1]),
    ("mxfp4-quark", f"{QC}.layer_quant_config", {"*mlp*": "fp4"}),
    ("mxfp4-quark", f"{QC}.layer_quant_config", {"*mlp*": {"weight": {"dtype": 4}}}),
]
IDS = [f"{key}={json.dumps(value)}" for _, key, value in BAD]


def _set(config: dict, key: str, value) -> dict:
    *parents, last = key.split(".")
    node = config
    for name in parents:
        node = node[name]
    node[last] = value
    return config


def _with(src, ckpt_copy, key: str, value):
    """A symlinked copy of ``src`` whose config.json has ``key`` set to ``value`` (the original untouched)."""
    dst = ckpt_copy(src)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(_set(config, key, value)))
    return dst


def _one_error_line(result, src, key: str) -> None:
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("glm-pack: error: "), result.stderr
    assert key in lines[0] and f"file {src / 'config.json'}" in lines[0]


@pytest.mark.parametrize("fmt, key, value", BAD, ids=IDS)
def test_inspect_and_convert_refuse_in_one_line(synth_ckpt, ckpt_copy, tmp_path, fmt, key, value):
    src = _with(synth_ckpt("glm-5", fmt), ckpt_copy, key, value)
    runner = CliRunner()
    _one_error_line(runner.invoke(main, ["inspect", str(src)]), src, key)
    out = tmp_path / "out"
    _one_error_line(runner.invoke(main, ["convert", str(src), str(out)]), src, key)
    assert not out.exists()


@pytest.mark.parametrize("key, value", [(k, v) for _, k, v in BAD], ids=IDS)
def test_verify_reports_a_bad_config_value(converted, ckpt_copy, key, value):
    out = _with(converted[1], ckpt_copy, key, value)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and r.output.rstrip().endswith("FAILED")
    problems = [line for line in r.output.splitlines() if line.startswith("problem cannot open the source")]
    assert len(problems) == 1 and key in problems[0] and str(out / "config.json") in problems[0]


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("glm-5.3-flash", "text_config", "x"),
        ("glm-5.3-flash", "text_config.full_attn_layers", ["3"]),
        ("glm-5.3-flash", "text_config.layer_types", "full_attention"),
        ("glm-5.2", "index_topk_freq", "4"),
        ("glm-5.2", "index_skip_topk_offset", 3.0),
        ("glm-5.2", "indexer_types", None),
    ],
)
def test_layer_selectors_check_their_keys(name, key, value):
    card = cards.load_card(name)
    config = _set(copy.deepcopy(card.synth["config"]), key, value)
    with pytest.raises(CheckpointError, match=key.split(".")[-1]) as err:
        card.layer_plan(config)
    assert err.value.file == "config.json" and json.dumps(value) in str(err.value)


def test_silent_misreads_are_refused():
    card = cards.load_card("glm-5")
    with pytest.raises(CheckpointError, match="num_hidden_layers must be an integer >= 1, got 1.5"):
        card.layer_plan({**card.synth["config"], "num_hidden_layers": 1.5})
    with pytest.raises(FormatError, match='quantization_config.exclude must be a list of strings, got "re:.\\*"'):
        formats.QuantConfig({"quant_method": "quark", "exclude": "re:.*"})


def test_null_keeps_its_meaning_where_it_has_one():
    card = cards.load_card("glm-5")
    config = card.synth["config"]
    assert card.layer_plan({**config, "num_nextn_predict_layers": None}).mtp == ()
    assert formats.QuantConfig({"quant_method": "fp8", "weight_block_size": None}).fp8_block == (128, 128)
    quark = formats.QuantConfig({"quant_method": "quark", "exclude": None, "global_quant_config": None})
    assert quark.expected_format("model.layers.0.mlp.experts.0.up_proj") is None
    # Quark's parts are only read (and checked) for Quark.
    assert formats.QuantConfig({"quant_method": "fp8", "exclude": "x", "layer_quant_config": [1]}).exclude == []


def test_config_value_bounds_and_messages():
    from glm_pack.convert.config_values import config_value

    assert config_value(0, "k", int, minimum=0) == 0  # the minimum itself is allowed
    assert config_value([1, 128], "k", list, item=int, minimum=1) == [1, 128]
    with pytest.raises(CheckpointError, match=r"^k must be a list of integers >= 1, got \[128, 0\]"):
        config_value([128, 0], "k", list, item=int, minimum=1)  # the minimum holds for every item
    with pytest.raises(CheckpointError, match=r"^k must be an integer, got null \(or missing\)"):
        config_value(None, "k", int)
    with pytest.raises(FormatError) as err:
        config_value("x" * 100, "k", int, error=FormatError)
    assert err.value.message == f'k must be an integer, got "{"x" * 76}...' and err.value.file == "config.json"
    # a value written in 80 characters is shown whole; from 81, its first 77 and "..."
    for n, shown in ((78, f'"{"x" * 78}"'), (79, f'"{"x" * 76}...')):
        with pytest.raises(CheckpointError) as err:
            config_value("x" * n, "k", int)
        assert err.value.message == f"k must be an integer, got {shown}"
