"""Every source format's dequantization against slow per-element/per-block references and hand-checked values;
format detection rules and Quark ``exclude`` semantics."""

from __future__ import annotations

import math

import pytest
import torch

from glm_pack.convert import formats
from glm_pack.convert.checkpoint import open_checkpoint
from glm_pack.packing.errors import FormatError

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _fp8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e4m3fn)


def slow_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(math.ceil(w.shape[0] / bo)):
        for j in range(math.ceil(w.shape[1] / bi)):
            block = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].to(torch.float32)
            out[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = block * scale_inv[i, j].item()
    return out


def slow_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, half = codes.shape
    out = torch.empty(rows, half * 2, dtype=torch.float32)
    for r in range(rows):
        for k in range(half * 2):
            nib = (int(codes[r, k // 2]) >> (4 * (k % 2))) & 0xF
            value = E2M1[nib & 7] * (-1.0 if nib & 8 else 1.0)
            out[r, k] = value * 2.0 ** (int(scales[r, k // 32]) - 127)
    return out


def test_fp8_block_hand_checked():
    # e4m3fn: 0x38 = 1.0, 0x40 = 2.0, 0xC0 = -2.0, 0x7E = 448, 0x01 = 2**-9 (smallest subnormal)
    w = _fp8([[0x38, 0x40, 0xC0], [0x7E, 0x01, 0x00]])
    scale = torch.tensor([[0.5, 4.0]])  # block (2 rows, 2 cols): columns 0-1 scale 0.5, column 2 scale 4
    fmt = formats.WeightFormat("fp8-block", "m.weight", "m.weight_scale_inv", (2, 2))
    got = formats.dequantize(fmt, w, scale)
    assert got.tolist() == [[0.5, 1.0, -8.0], [224.0, 2.0**-10, 0.0]]


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((576, 256), (128, 128)), ((7, 5), (2, 3))])
def test_fp8_block_matches_slow_reference(shape, block):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g) * 0.02
    q, s = formats.encode_fp8_block(w, block)
    assert s.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])) and s.dtype == torch.float32
    fmt = formats.WeightFormat("fp8-block", "m.weight", "m.weight_scale_inv", block)
    got = formats.dequantize(fmt, q, s)
    assert torch.equal(got, slow_fp8_block(q, s, *block))
    assert (got - w).norm() / w.norm() < 0.05  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("kind", ["fp8-block", "fp8-channel"])
def test_fp8_dequantization_is_the_product_rounded_once_to_float32(kind):
    """FP8 value times a float32 scale needs up to 4 + 24 significant bits: the float32 result is the exact
    (float64) product rounded once, not the exact value."""
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(5)) * 0.02
    if kind == "fp8-block":
        fmt = formats.WeightFormat(kind, "m.weight", "m.weight_scale_inv", (128, 128))
        q, s = formats.encode_fp8_block(x)
        exact = q.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        fmt = formats.WeightFormat(kind, "m.weight", "m.weight_scale")
        q, s = formats.encode_fp8_channel(x)
        exact = q.double() * s.double()[:, None]
    got = formats.dequantize(fmt, q, s)
    assert torch.equal(got, exact.float())
    assert (got.double() != exact).float().mean() > 0.25  # not exact: a third of these elements are rounded
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-24).all()


def test_fp8_channel_hand_checked_and_reference():
    w = _fp8([[0x38, 0x40], [0xC0, 0x7E]])
    fmt = formats.WeightFormat("fp8-channel", "m.weight", "m.weight_scale")
    for scale in (torch.tensor([0.25, 2.0]), torch.tensor([[0.25], [2.0]])):  # [out] and [out, 1]
        assert formats.dequantize(fmt, w, scale).tolist() == [[0.25, 0.5], [-4.0, 896.0]]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 70, generator=g)
    q, s = formats.encode_fp8_channel(x)
    got = formats.dequantize(fmt, q, s)
    slow = torch.stack([q[r].to(torch.float32) * s[r].item() for r in range(33)])
    assert torch.equal(got, slow) and s.shape == (33,)


def test_mxfp4_hand_checked_and_reference():
    # byte 0x21: element 0 = code 1 (0.5), element 1 = code 2 (1.0); 0xF9: code 9 (-0.5), code 15 (-6)
    codes = torch.tensor([[0x21] + [0] * 15, [0xF9] + [0] * 15], dtype=torch.uint8)
    scales = torch.tensor([[127], [129]], dtype=torch.uint8)  # 2**0, 2**2
    fmt = formats.WeightFormat("mxfp4", "m.weight", "m.weight_scale")
    got = formats.dequantize(fmt, codes, scales)
    assert got[0, :2].tolist() == [0.5, 1.0] and got[1, :2].tolist() == [-2.0, -24.0]
    assert torch.count_nonzero(got[:, 2:]) == 0
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 256, (6, 48), generator=g, dtype=torch.uint8)
    s = torch.randint(110, 140, (6, 3), generator=g, dtype=torch.uint8)
    assert torch.equal(formats.dequantize(fmt, q, s), slow_mxfp4(q, s))


def test_float_formats_widen_exactly():
    x = torch.randn(4, 8).to(torch.bfloat16)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        got = formats.dequantize(formats.WeightFormat(name, "m.weight"), x.to(dtype), None)
        assert got.dtype == torch.float32 and torch.equal(got, x.to(dtype).double().float())


@pytest.mark.parametrize(
    "fmt, name",
    [
        ("fp8-block", "model.layers.0.self_attn.kv_b_proj.weight"),
        ("fp8-block", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),  # 576 rows: partial blocks
        ("fp8-channel", "model.layers.1.self_attn.kv_b_proj.weight"),
        ("mxfp4-attn", "model.layers.0.self_attn.kv_b_proj.weight"),
        ("mxfp4-quark", "model.layers.2.mlp.experts.1.down_proj.weight"),
        ("bf16", "model.layers.0.self_attn.kv_b_proj.weight"),
    ],
)
def test_checkpoint_read_float_matches_slow_reference(synth_ckpt, fmt, name):
    ck = open_checkpoint(synth_ckpt("glm-5", fmt))
    stored = [ck.read_raw(t) for t in ck.source_tensors(name)]
    got = ck.read_float(name)
    kind = ck.weight_format(name)
    rows = slice(0, 64)  # the slow references are per element: check a band of rows
    if kind == "fp8-block":
        ref = slow_fp8_block(stored[0][:128], stored[1][:1], 128, 128)[:64]
    elif kind == "fp8-channel":
        ref = stored[0][rows].to(torch.float32) * stored[1][rows, None]
    elif kind == "mxfp4":
        ref = slow_mxfp4(stored[0][:4], stored[1][:4])
        rows = slice(0, 4)
    else:
        ref = stored[0][rows].to(torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got[rows], ref)
    if kind == "mxfp4":
        codes, scales = ck.read_mxfp4(name)
        assert torch.equal(codes, stored[0]) and torch.equal(scales, stored[1])


def _t(name, dtype, shape):
    return formats.StoredTensor(name, dtype, tuple(shape))


QUARK = formats.QuantConfig(
    {
        "quant_method": "quark",
        "exclude": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
        "global_quant_config": {"weight": {"dtype": "fp4", "qscheme": "per_group", "group_size": 32}},
        "layer_quant_config": {"*shared_experts*": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel"}}},
    }
)


def test_quark_exclude_semantics():
    assert QUARK.excluded("lm_head") and not QUARK.excluded("model.lm_head")  # exact names are exact
    assert QUARK.excluded("model.layers.3.self_attn.kv_b_proj")
    assert QUARK.excluded("model.layers.3.mlp.gate") and not QUARK.excluded("model.layers.3.mlp.gate_proj")
    assert QUARK.expected_format("model.layers.3.mlp.experts.0.up_proj") == "mxfp4"
    assert QUARK.expected_format("model.layers.3.mlp.shared_experts.up_proj") == "fp8-channel"
    assert QUARK.expected_format("model.layers.3.self_attn.o_proj") is None


def test_detection_rules():
    none = formats.QuantConfig(None)
    w = "model.layers.3.mlp.experts.0.up_proj.weight"
    assert formats.detect(_t(w, "BF16", (8, 64)), {}, none).name == "bf16"
    assert formats.detect(_t(w, "F32", (8, 64)), {}, none).name == "fp32"
    mx = formats.detect(_t(w, "U8", (8, 32)), {"weight_scale": _t("s", "U8", (8, 2))}, QUARK)
    assert (mx.name, mx.tensors) == ("mxfp4", [w, "s"])
    blk = formats.detect(_t(w, "F8_E4M3", (300, 200)), {"weight_scale_inv": _t("s", "F32", (3, 2))}, none)
    assert (blk.name, blk.block) == ("fp8-block", (128, 128))
    ch = formats.detect(_t(w, "F8_E4M3", (300, 200)), {"weight_scale": _t("s", "F32", (300, 1))}, none)
    assert ch.name == "fp8-channel"
    bad = [
        (_t(w, "U8", (8, 32)), {}, QUARK, "U8 weight"),
        (_t(w, "U8", (8, 32)), {"weight_scale": _t("s", "U8", (8, 4))}, QUARK, "U8 weight"),
        (_t(w, "F8_E4M3", (300, 200)), {"weight_scale_inv": _t("s", "F32", (2, 2))}, none, "block scale"),
        (_t(w, "F8_E4M3", (300, 200)), {"weight_scale": _t("s", "F32", (1,))}, none, "per-tensor"),
        (_t(w, "F8_E4M3", (300, 200)), {}, none, "without weight_scale"),
        (_t(w, "BF16", (8, 64)), {"weight_scale": _t("s", "F32", (8,))}, none, "has a scale"),
        (_t(w, "I32", (8, 64)), {}, none, "unsupported"),
        (
            _t(w, "F8_E4M3", (300, 200)),
            {"weight_scale_inv": _t("s", "F32", (3, 2)), "weight_scale": _t("t", "F32", (300,))},
            none,
            "weight_scale and weight_scale_inv; which one scales it is ambiguous",
        ),
        (
            _t(w, "U8", (8, 32)),
            {"weight_scale": _t("s", "U8", (8, 2)), "weight_scale_inv": _t("t", "F32", (1, 1))},
            QUARK,
            "ambiguous",
        ),
        (
            _t("model.layers.1.self_attn.o_proj.weight", "U8", (8, 32)),
            {"weight_scale": _t("s", "U8", (8, 2))},
            QUARK,
            "excludes",
        ),
        (
            _t("model.layers.1.mlp.shared_experts.up_proj.weight", "U8", (8, 32)),
            {"weight_scale": _t("s", "U8", (8, 2))},
            QUARK,
            "says fp8-channel",
        ),
    ]
    for weight, scales, quant, message in bad:
        with pytest.raises(FormatError, match=message):
            formats.detect(weight, scales, quant)


def test_quark_patterns_match_as_engines_match_them():
    """``re:`` excludes use ``re.match`` (anchored at the start only); ``layer_quant_config`` is searched in the
    config's order and the first matching pattern wins (vLLM's and SGLang's Quark loaders do both)."""
    q = formats.QuantConfig(
        {
            "quant_method": "quark",
            "exclude": [r"re:model\.layers\.1\.", "re:mlp"],
            "layer_quant_config": {
                "*experts.0.*": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_channel"}},
                "*experts*": {"weight": {"dtype": "fp4"}},
            },
            "global_quant_config": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}},
        }
    )
    assert q.excluded("model.layers.1.mlp.experts.0.up_proj")  # a prefix match excludes
    assert not q.excluded("model.layers.2.mlp.experts.0.up_proj")  # "mlp" occurs, but not at the start
    assert q.expected_format("model.layers.2.mlp.experts.0.up_proj") == "fp8-channel"  # both match: the first
    assert q.expected_format("model.layers.2.mlp.experts.1.up_proj") == "mxfp4"
    # per-tensor FP8 is not per-channel: a per-channel weight under it contradicts the config
    assert q.expected_format("model.layers.2.self_attn.o_proj") == "fp8-per_tensor"
    w = _t("model.layers.2.self_attn.o_proj.weight", "F8_E4M3", (8, 64))
    with pytest.raises(FormatError, match="stored as fp8-channel but quantization_config says fp8-per_tensor"):
        formats.detect(w, {"weight_scale": _t("s", "F32", (8,))}, q)
    # a Quark dtype glm-pack does not read (int4) matches no stored format: a quantized weight under it is refused
    int4 = formats.QuantConfig({"quant_method": "quark", "global_quant_config": {"weight": {"dtype": "int4"}}})
    with pytest.raises(FormatError, match="stored as mxfp4 but quantization_config says int4"):
        up = _t("model.layers.2.mlp.up_proj.weight", "U8", (8, 32))
        formats.detect(up, {"weight_scale": _t("s", "U8", (8, 2))}, int4)
    # only Quark has these parts: without a quant_method they are not read
    assert formats.QuantConfig({"exclude": ["lm_head"]}).excluded("lm_head") is False


def test_detection_checks_every_scale_dtype_and_shape():
    none = formats.QuantConfig(None)
    w = "model.layers.3.mlp.experts.0.up_proj.weight"
    bad = [
        (_t(w, "F8_E4M3", (2, 8, 64)), {"weight_scale": _t("s", "F32", (2,))}, "must be 2-D"),
        (_t(w, "U8", (8, 24)), {"weight_scale": _t("s", "U8", (8, 1))}, "U8 weight"),  # in = 48: no whole block
        (_t(w, "U8", (8, 32)), {"weight_scale": _t("s", "F32", (8, 2))}, "found F32"),  # E8M0 scales are bytes
        (_t(w, "F8_E4M3", (300, 200)), {"weight_scale": _t("s", "F16", (300,))}, "per-channel scale must be F32"),
    ]
    for weight, scales, message in bad:
        with pytest.raises(FormatError, match=message):
            formats.detect(weight, scales, none)
    # a block of 128 rows x 64 columns: [ceil(300/128), ceil(200/64)] = [3, 4] scales
    wide = formats.QuantConfig({"quant_method": "fp8", "weight_block_size": [128, 64]})
    got = formats.detect(_t(w, "F8_E4M3", (300, 200)), {"weight_scale_inv": _t("s", "F32", (3, 4))}, wide)
    assert (got.name, got.block) == ("fp8-block", (128, 64))
    with pytest.raises(FormatError, match=r"block scale must be F32 \(3, 4\)"):
        formats.detect(_t(w, "F8_E4M3", (300, 200)), {"weight_scale_inv": _t("s", "F32", (3, 2))}, wide)


def test_stored_specs_hand_checked():
    assert formats.stored_specs("fp8-block", (300, 200), (128, 64)) == {
        "weight": ("F8_E4M3", (300, 200)),
        "weight_scale_inv": ("F32", (3, 4)),
    }
    assert formats.stored_specs("mxfp4", (8, 64)) == {"weight": ("U8", (8, 32)), "weight_scale": ("U8", (8, 2))}
    with pytest.raises(FormatError, match="in % 32 == 0"):
        formats.stored_specs("mxfp4", (8, 48))


def test_encoders_keep_zero_blocks_finite_and_use_quarks_even_rule():
    w = torch.zeros(4, 6)
    w[0, 0] = 448.0  # one block of 2 x 3 is all zeros
    q, s = formats.encode_fp8_block(w, (2, 3))
    assert s.tolist() == [[1.0, 1.0], [1.0, 1.0]] and formats.dequantize(
        formats.WeightFormat("fp8-block", "m.weight", "m.weight_scale_inv", (2, 3)), q, s
    ).equal(w)
    q, s = formats.encode_fp8_channel(w)
    assert s.tolist() == [1.0, 1.0, 1.0, 1.0] and q.float().equal(w)
    # a ragged edge block's scale is the amax of its own values (the zero padding adds none): the lone w[2, 3]
    ragged = torch.full((3, 4), 1e-3)
    ragged[2, 3] = 3e-4
    q, s = formats.encode_fp8_block(ragged, (2, 3))
    assert s[1, 1] == torch.tensor(3e-4) / 448 and q[2, 3].float().item() == 448.0
    # 7.0: its mantissa 1.75 rounds up to 2, so the even rule takes 2**1 (byte 128) and 3.5 ties to the even code 6
    # (4.0), giving 8.0; the floor rule would take 2**0 and clip to 6
    codes, scales = formats.encode_mxfp4(torch.tensor([[7.0] + [0.0] * 31]))
    assert scales.tolist() == [[128]] and codes[0, 0].item() == 0x06 and not codes[0, 1:].any()
