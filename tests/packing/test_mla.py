"""MLA geometry and the kv_b_proj split, checked element by element against the layout in notes/glm-family.md:
head h owns rows [h*(nope+v), (h+1)*(nope+v)) of kv_b_proj [H*(nope+v), kv_lora], its nope K rows first."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pack.packing.errors import FormatError
from glm_pack.packing.mla import MlaGeometry, split_kv_b, split_kv_b_mxfp4_vc
from glm_pack.packing.mxfp4 import quantize

GLM5 = MlaGeometry(num_heads=64, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)


def labelled_kv_b(geom: MlaGeometry, dtype=torch.float32) -> torch.Tensor:
    """kv_b[row, col] = row * 1000 + col: every element names its own position (exact in float32)."""
    rows = torch.arange(geom.kv_b_rows, dtype=torch.float64).unsqueeze(1)
    return (rows * 1000 + torch.arange(geom.kv_lora_rank, dtype=torch.float64)).to(dtype)


def test_glm5_geometry():
    assert GLM5.kv_b_rows == 28672 and GLM5.cache_row == 576
    assert MlaGeometry(**GLM5.as_dict()) == GLM5


@settings(max_examples=20, deadline=None)
@given(
    heads=st.integers(1, 4),
    kv_lora=st.sampled_from([32, 64, 96]),
    nope=st.integers(1, 7),
    v=st.integers(1, 7),
)
def test_split_kv_b_element_by_element(heads, kv_lora, nope, v):
    geom = MlaGeometry(heads, kv_lora, nope, 0, v)
    kv_b = labelled_kv_b(geom)
    w_kc, w_vc = split_kv_b(kv_b, geom)
    assert w_kc.shape == (heads, kv_lora, nope) and w_vc.shape == (heads, v, kv_lora)
    assert w_kc.is_contiguous() and w_vc.is_contiguous()
    for h in range(heads):
        for c in range(kv_lora):
            for r in range(nope):
                assert w_kc[h, c, r].item() == (h * (nope + v) + r) * 1000 + c
        for r in range(v):
            for c in range(kv_lora):
                assert w_vc[h, r, c].item() == (h * (nope + v) + nope + r) * 1000 + c


def test_split_keeps_dtype_and_accepts_strided_input():
    geom = MlaGeometry(2, 64, 8, 4, 16)
    kv_b = labelled_kv_b(geom)
    strided = kv_b.T.contiguous().T  # same values, column-major storage
    for t in (kv_b.to(torch.bfloat16), strided):
        w_kc, w_vc = split_kv_b(t, geom)
        ref_kc, ref_vc = split_kv_b(kv_b, geom)
        assert w_kc.dtype == t.dtype and torch.equal(w_kc.float(), ref_kc.to(t.dtype).float())
        assert torch.equal(w_vc.float(), ref_vc.to(t.dtype).float())


def test_mxfp4_vc_is_a_byte_exact_row_slice():
    geom = MlaGeometry(3, 64, 32, 16, 32)
    g = torch.Generator().manual_seed(0)
    kv_b = torch.randn(geom.kv_b_rows, geom.kv_lora_rank, generator=g).to(torch.bfloat16)
    codes, scales = quantize(kv_b, axis=-1)
    vc_codes, vc_scales = split_kv_b_mxfp4_vc(codes, scales, geom)
    assert vc_codes.shape == (3, 32, 32) and vc_scales.shape == (3, 32, 2)
    per = geom.qk_nope_head_dim + geom.v_head_dim
    for h in range(3):
        rows = slice(h * per + geom.qk_nope_head_dim, (h + 1) * per)
        assert torch.equal(vc_codes[h], codes[rows]) and torch.equal(vc_scales[h], scales[rows])
    # and it equals quantizing the float w_vc directly: the same rows, the same blocks
    _, w_vc = split_kv_b(kv_b, geom)
    direct_codes, direct_scales = quantize(w_vc, axis=-1)
    assert torch.equal(vc_codes, direct_codes) and torch.equal(vc_scales, direct_scales)


def test_split_errors():
    geom = MlaGeometry(2, 64, 8, 0, 16)
    with pytest.raises(FormatError, match=r"kv_b_proj has shape \(48, 32\), expected \(48, 64\)"):
        split_kv_b(torch.zeros(48, 32), geom)
    with pytest.raises(FormatError, match=r"expected \(48, 64\) = \(H\*\(nope\+v\) = 2\*\(8\+16\), 64\)"):
        split_kv_b(torch.zeros(47, 64), geom)
    with pytest.raises(FormatError, match="kv_b_proj has shape"):
        split_kv_b(torch.zeros(48 * 64), geom)
    codes, scales = torch.zeros(48, 32, dtype=torch.uint8), torch.zeros(48, 2, dtype=torch.uint8)
    with pytest.raises(FormatError, match="kv_b_proj scales has shape"):
        split_kv_b_mxfp4_vc(codes, scales[:, :1], geom)
    with pytest.raises(FormatError, match="kv_b_proj codes has shape"):
        split_kv_b_mxfp4_vc(codes[:40], scales, geom)
    with pytest.raises(FormatError, match="uint8"):
        split_kv_b_mxfp4_vc(codes.float(), scales, geom)
    with pytest.raises(FormatError, match="kv_lora_rank 48 is not a multiple of 32"):
        split_kv_b_mxfp4_vc(codes[:, :24], scales[:, :1], MlaGeometry(2, 48, 8, 0, 16))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_heads", 0, "positive num_heads"),
        ("kv_lora_rank", -512, "positive kv_lora_rank"),
        ("qk_nope_head_dim", 0, "positive qk_nope_head_dim"),
        ("v_head_dim", 0, "positive v_head_dim"),
        ("qk_rope_head_dim", -1, "qk_rope_head_dim >= 0"),
    ],
)
def test_geometry_rejects(field, value, message):
    fields = GLM5.as_dict() | {field: value}
    with pytest.raises(FormatError, match=message):
        MlaGeometry(**fields)
