"""Layout registry: index math against element-by-element references written from notes/aiter-contract.md,
inverses, deterministic padding, manifest parameters and error paths."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_pack.packing.errors import FormatError
from glm_pack.packing.layouts import (
    LAYOUTS,
    get_layout,
    pack_bmm_nk,
    shuffle_scale,
    shuffle_weight,
    stored_k,
    unpack_bmm_nk,
    unshuffle_scale,
    unshuffle_weight,
)

PROFILE = settings(max_examples=25, deadline=None)


def random_u8(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- slow references (notes)


def weight_shuffle_by_hand(w: torch.Tensor) -> torch.Tensor:
    """notes: byte (n, kb) of each [N, Kb] matrix goes to (n//16)*16*Kb + (kb//16)*256 + (n%16)*16 + kb%16."""
    n_rows, kb_cols = w.shape[-2:]
    mats = w.reshape(-1, n_rows, kb_cols)
    out = torch.empty(mats.shape[0], n_rows * kb_cols, dtype=torch.uint8)
    for m in range(mats.shape[0]):
        for n in range(n_rows):
            for kb in range(kb_cols):
                dst = (n // 16) * 16 * kb_cols + (kb // 16) * 256 + (n % 16) * 16 + kb % 16
                out[m, dst] = mats[m, n, kb]
    return out.reshape(w.shape)


def scale_shuffle_by_hand(s: torch.Tensor) -> torch.Tensor:
    """notes: pad each [R, C] to (ceil(R/256)*256, ceil(C/8)*8), then byte (r, c) goes to
    (r//32)*32*Cp + (c//8)*256 + (c%4)*64 + (r%16)*4 + ((c%8)//4)*2 + (r%32)//16. Padding: 0x7F."""
    rows, cols = s.shape[-2:]
    rp, cp = -(-rows // 256) * 256, -(-cols // 8) * 8
    mats = s.reshape(-1, rows, cols)
    out = torch.full((mats.shape[0], rp * cp), 0x7F, dtype=torch.uint8)
    for m in range(mats.shape[0]):
        for r in range(rows):
            for c in range(cols):
                dst = (r // 32) * 32 * cp + (c // 8) * 256 + (c % 4) * 64 + (r % 16) * 4 + ((c % 8) // 4) * 2
                out[m, dst + (r % 32) // 16] = mats[m, r, c]
    return out.reshape(*s.shape[:-2], rp, cp)


# -------------------------------------------------------------------------------------------- bmm_nk


@pytest.mark.parametrize(
    ("k", "multiple", "expected"),
    [(192, 256, 256), (192, None, 192), (256, 256, 256), (512, 256, 512), (288, 256, 512), (64, 32, 64)],
)
def test_stored_k(k, multiple, expected):
    assert stored_k(k, multiple) == expected


@pytest.mark.parametrize(("k", "multiple"), [(100, 256), (0, 256), (-32, None), (192, 48), (192, 0)])
def test_stored_k_rejects(k, multiple):
    with pytest.raises(FormatError, match="multiple of 32"):
        stored_k(k, multiple)


def test_bmm_nk_glm_k_up():
    # GLM K-up: K = 192 padded to 256 -> codes [H, 512, 96 -> 128], scales [H, 512, 6 -> 8]
    codes, scales = random_u8(2, 512, 96, seed=1), random_u8(2, 512, 6, seed=2)
    pc, ps = pack_bmm_nk(codes, scales, k_stored=256)
    assert pc.shape == (2, 512, 128) and ps.shape == (2, 512, 8)
    assert pc.is_contiguous() and ps.is_contiguous()
    assert torch.equal(pc[..., :96], codes) and bool((pc[..., 96:] == 0).all())
    assert torch.equal(ps[..., :6], scales) and bool((ps[..., 6:] == 0x7F).all())
    uc, us = unpack_bmm_nk(pc, ps, k_logical=192)
    assert torch.equal(uc, codes) and torch.equal(us, scales)


@PROFILE
@given(
    b=st.integers(1, 3),
    n=st.integers(1, 5),
    k_blocks=st.integers(1, 6),
    extra_blocks=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_bmm_nk_round_trip(b, n, k_blocks, extra_blocks, seed):
    codes, scales = random_u8(b, n, 16 * k_blocks, seed=seed), random_u8(b, n, k_blocks, seed=seed + 1)
    k, k_stored = 32 * k_blocks, 32 * (k_blocks + extra_blocks)
    pc, ps = pack_bmm_nk(codes, scales, k_stored=k_stored)
    assert pc.shape == (b, n, k_stored // 2) and ps.shape == (b, n, k_stored // 32)
    # element by element: logical bytes unchanged, padded codes 0x00 and padded scales 0x7F
    for kb in range(k_stored // 2):
        assert torch.equal(pc[..., kb], codes[..., kb] if kb < k // 2 else torch.zeros(b, n, dtype=torch.uint8))
    for g in range(k_stored // 32):
        want = scales[..., g] if g < k_blocks else torch.full((b, n), 0x7F, dtype=torch.uint8)
        assert torch.equal(ps[..., g], want)
    params = get_layout("bmm_nk").params(k, k_stored)
    assert params == {"layout": "bmm_nk", "k_logical": k, "k_stored": k_stored}
    uc, us = get_layout("bmm_nk").unpack(pc, ps, **{key: v for key, v in params.items() if key != "layout"})
    assert torch.equal(uc, codes) and torch.equal(us, scales)


def test_bmm_nk_outputs_are_contiguous_for_strided_inputs():
    codes, scales = random_u8(2, 96, 4, seed=3).transpose(1, 2), random_u8(2, 6, 4, seed=4).transpose(1, 2)
    assert not codes.is_contiguous() and not scales.is_contiguous()
    for k_stored in (192, 256):  # unpadded and padded
        pc, ps = pack_bmm_nk(codes, scales, k_stored=k_stored)
        assert pc.is_contiguous() and ps.is_contiguous()
        assert torch.equal(pc[..., :96], codes) and torch.equal(ps[..., :6], scales)
        uc, us = unpack_bmm_nk(pc, ps, k_logical=192)  # a slice of the padded tensors when k_stored > 192
        assert uc.is_contiguous() and us.is_contiguous()
        assert torch.equal(uc, codes) and torch.equal(us, scales)


def test_bmm_nk_errors():
    codes, scales = random_u8(2, 4, 96), random_u8(2, 4, 6)
    with pytest.raises(FormatError, match="k_stored must be a multiple of 32 and >= K = 192"):
        pack_bmm_nk(codes, scales, k_stored=160)
    with pytest.raises(FormatError, match="k_stored must be a multiple of 32"):
        pack_bmm_nk(codes, scales, k_stored=200)
    with pytest.raises(FormatError, match="3-D"):
        pack_bmm_nk(codes[0], scales[0], k_stored=256)
    with pytest.raises(FormatError, match="disagree"):
        pack_bmm_nk(codes, scales[..., :5], k_stored=256)
    with pytest.raises(FormatError, match="disagree"):
        pack_bmm_nk(codes, scales[:1], k_stored=256)
    with pytest.raises(FormatError, match="uint8"):
        pack_bmm_nk(codes.float(), scales, k_stored=256)
    pc, ps = pack_bmm_nk(codes, scales, k_stored=256)
    with pytest.raises(FormatError, match="k_logical must be a positive multiple of 32 and <= stored K = 256"):
        unpack_bmm_nk(pc, ps, k_logical=288)
    with pytest.raises(FormatError, match="k_logical must be a positive multiple of 32"):
        unpack_bmm_nk(pc, ps, k_logical=200)  # 200 / 2 code bytes but 200 // 32 scale bytes: not a pair
    with pytest.raises(FormatError, match="k_stored = 512 was recorded"):
        unpack_bmm_nk(pc, ps, k_logical=192, k_stored=512)
    bad = ps.clone()
    bad[1, 2, 7] = 0x80
    with pytest.raises(FormatError, match="padding beyond K = 192"):
        unpack_bmm_nk(pc, bad, k_logical=192)
    uc, us = unpack_bmm_nk(pc, bad, k_logical=192, check_padding=False)
    assert torch.equal(uc, codes) and torch.equal(us, scales)
    bad_codes = pc.clone()
    bad_codes[0, 3, 127] = 0x10  # a nonzero code in the last padded byte: the padded columns would not be zeros
    with pytest.raises(FormatError, match="padding beyond K = 192"):
        unpack_bmm_nk(bad_codes, ps, k_logical=192)


# ------------------------------------------------------------------------------------ weight shuffle


def test_weight_shuffle_known_bytes():
    # [16, 32]: byte (n, kb) -> (kb//16)*256 + n*16 + kb%16, so row 0 of the output holds column 0..15 of
    # rows 0..15 read row-major as 16-byte chunks.
    w = torch.arange(16 * 32, dtype=torch.int32).reshape(16, 32).to(torch.uint8)
    flat = shuffle_weight(w).reshape(-1)
    assert flat[:16].tolist() == w[0, :16].tolist()
    assert flat[16:32].tolist() == w[1, :16].tolist()
    assert flat[256:272].tolist() == w[0, 16:].tolist()


@settings(max_examples=15, deadline=None)
@given(lead=st.lists(st.integers(1, 2), max_size=2), n_tiles=st.integers(1, 3), kb_tiles=st.integers(1, 2))
def test_weight_shuffle_matches_notes(lead, n_tiles, kb_tiles):
    w = random_u8(*lead, 16 * n_tiles, 32 * kb_tiles, seed=n_tiles * 7 + kb_tiles)
    shuffled = shuffle_weight(w)
    assert shuffled.shape == w.shape and shuffled.is_contiguous()
    assert torch.equal(shuffled, weight_shuffle_by_hand(w))
    assert torch.equal(unshuffle_weight(shuffled), w)
    layout = get_layout("aiter_shuffle_16x16")
    params = layout.params()
    assert params == {"layout": "aiter_shuffle_16x16"}
    assert torch.equal(layout.unpack(layout.pack(w)), w)


def test_weight_shuffle_batched_equals_stacked():
    # Experts [E, N, Kb]: the tile transpose never crosses matrices, so it equals shuffling [E*N, Kb].
    w = random_u8(4, 32, 64, seed=3)
    assert torch.equal(shuffle_weight(w), shuffle_weight(w.reshape(128, 64)).reshape(4, 32, 64))


@pytest.mark.parametrize("shape", [(24, 32), (16, 48), (16, 16), (32,)])
def test_weight_shuffle_rejects_shapes(shape):
    w = torch.zeros(shape, dtype=torch.uint8)
    with pytest.raises(FormatError, match=r"N % 16 == 0 and Kb % 32 == 0|at least 2 dims"):
        shuffle_weight(w)
    with pytest.raises(FormatError, match=r"N % 16 == 0 and Kb % 32 == 0|at least 2 dims"):
        unshuffle_weight(w)


def test_weight_shuffle_rejects_dtype():
    with pytest.raises(FormatError, match="uint8"):
        shuffle_weight(torch.zeros(16, 32, dtype=torch.int8))


# ------------------------------------------------------------------------------------- scale shuffle


@settings(max_examples=15, deadline=None)
@given(lead=st.lists(st.integers(1, 2), max_size=1), rows=st.integers(1, 300), cols=st.integers(1, 17))
def test_scale_shuffle_matches_notes(lead, rows, cols):
    s = random_u8(*lead, rows, cols, seed=rows * 31 + cols)
    shuffled = shuffle_scale(s)
    rp, cp = -(-rows // 256) * 256, -(-cols // 8) * 8
    assert shuffled.shape == (*lead, rp, cp) and shuffled.is_contiguous()
    assert torch.equal(shuffled, scale_shuffle_by_hand(s))
    assert torch.equal(unshuffle_scale(shuffled, s.shape), s)
    layout = get_layout("aiter_e8m0_shuffle")
    params = layout.params(s.shape)
    assert params == {"layout": "aiter_e8m0_shuffle", "shape": [*lead, rows, cols]}
    json.dumps(params)
    restored = layout.unpack(layout.pack(s), **{k: v for k, v in params.items() if k != "layout"})
    assert torch.equal(restored, s)


def test_scale_shuffle_padding_is_0x7f_and_deterministic():
    s = torch.zeros(3, 5, dtype=torch.uint8)
    shuffled = shuffle_scale(s)
    assert shuffled.shape == (256, 8)
    assert int((shuffled == 0).sum()) == 15 and int((shuffled == 0x7F).sum()) == 256 * 8 - 15
    assert torch.equal(shuffle_scale(s), shuffled)


def test_scale_shuffle_stacked_experts():
    # With R % 256 == 0 per expert, shuffling [E, R, C] equals aiter's e8m0_shuffle of the stacked [E*R, C].
    s = random_u8(3, 256, 16, seed=5)
    assert torch.equal(shuffle_scale(s), shuffle_scale(s.reshape(768, 16)).reshape(3, 256, 16))


def test_unshuffle_scale_errors():
    s = random_u8(40, 5, seed=9)
    shuffled = shuffle_scale(s)
    with pytest.raises(FormatError, match=r"needs a shuffled \[..., 256, 8\] tensor"):
        unshuffle_scale(shuffled[:128], (40, 5))
    with pytest.raises(FormatError, match="rank and leading dims"):
        unshuffle_scale(shuffled, (1, 40, 5))
    with pytest.raises(FormatError, match="rank and leading dims"):
        unshuffle_scale(shuffled, (40,))
    with pytest.raises(FormatError, match="at least 2 dims"):
        shuffle_scale(s.reshape(-1))
    with pytest.raises(FormatError, match=r"needs a shuffled \[..., 512, 8\] tensor"):
        unshuffle_scale(shuffled, (300, 5))
    bad = shuffled.clone()
    bad[255, 7] = 0  # shuffled byte 2047 lies in the last 32-row group (rows 224..255): padding
    with pytest.raises(FormatError, match="padding outside"):
        unshuffle_scale(bad, (40, 5))
    assert torch.equal(unshuffle_scale(bad, (40, 5), check_padding=False), s)
    bad = shuffled.clone()
    # (r, c) = (0, 5) is column padding (C = 5 -> Cp = 8) in a data row; notes: (5%4)*64 + ((5%8)//4)*2 = 66
    bad.view(-1)[66] = 0
    with pytest.raises(FormatError, match="padding outside"):
        unshuffle_scale(bad, (40, 5))
    with pytest.raises(FormatError, match="uint8"):
        shuffle_scale(s.float())
    stacked = shuffle_scale(random_u8(2, 40, 5, seed=10))
    stacked[1, 255, 7] = 0  # padding of the second matrix only
    with pytest.raises(FormatError, match="padding outside"):
        unshuffle_scale(stacked, (2, 40, 5))


# --------------------------------------------- aiter's own shuffles, transcribed (their view / permute code)
# ROCm/aiter @ e4048607a535ace3a2b51ded31b1c8c2d45c0879, aiter/ops/shuffle.py: shuffle_weight (the branch without
# is_guinterleave, lines 192-205) and shuffle_scale (the branch without is_guinterleave, lines 351-365), which
# aiter/utility/fp4_utils.py e8m0_shuffle calls. Written from that code, for uint8 inputs.


def aiter_shuffle_weight(x: torch.Tensor, layout=(16, 16)) -> torch.Tensor:
    IN, IK = layout
    BK, K, BN = IK * 2, 16 // x.element_size(), IN
    assert x.shape[-2] % BN == 0 and x.shape[-1] % BK == 0
    x_ = x.view(-1, x.shape[-2] // BN, BN, x.shape[-1] // BK, BK // K, K)
    return x_.permute(0, 1, 3, 4, 2, 5).contiguous().view(*x.shape)


def aiter_shuffle_scale(src: torch.Tensor) -> torch.Tensor:
    m, n = src.shape  # aiter asserts a 2-D scale
    # aiter allocates the padded buffer with torch.empty; 0x7F here, the byte glm-pack writes there
    scale = torch.full(((m + 255) // 256 * 256, (n + 7) // 8 * 8), 0x7F, dtype=src.dtype)
    scale[:m, :n] = src
    sm, sn = scale.shape
    return scale.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


@pytest.mark.parametrize(("shape", "seed"), [((16, 32), 0), ((48, 96), 1), ((3, 32, 64), 2), ((2, 2, 16, 160), 3)])
def test_weight_shuffle_equals_aiter_shuffle_weight(shape, seed):
    w = random_u8(*shape, seed=seed)
    assert torch.equal(shuffle_weight(w), aiter_shuffle_weight(w))


@pytest.mark.parametrize(("shape", "seed"), [((256, 8), 0), ((512, 24), 1), ((40, 5), 2), ((300, 17), 3), ((1, 1), 4)])
def test_scale_shuffle_equals_aiter_shuffle_scale(shape, seed):
    s = random_u8(*shape, seed=seed)
    assert torch.equal(shuffle_scale(s), aiter_shuffle_scale(s))
    stacked = random_u8(3, *shape, seed=seed + 10)  # glm-pack shuffles each matrix of [E, R, C] on its own
    assert torch.equal(shuffle_scale(stacked), torch.stack([aiter_shuffle_scale(m) for m in stacked]))


# ------------------------------------------------------------------------------------------ registry


def test_registry():
    assert set(LAYOUTS) == {"bmm_nk", "aiter_shuffle_16x16", "aiter_e8m0_shuffle"}
    for name, layout in LAYOUTS.items():
        assert layout.name == name and get_layout(name) is layout and layout.description
    with pytest.raises(FormatError, match="unknown layout 'nk_bmm'; known layouts: aiter_e8m0_shuffle"):
        get_layout("nk_bmm")
    with pytest.raises(FormatError, match="unknown layout"):
        get_layout(None)
    with pytest.raises(FormatError, match="unknown layout"):
        get_layout(["bmm_nk"])  # a JSON list where a name belongs: unhashable
