"""MoE expert repacking (aiter gfx950 a4w4): exact round trips, the stacked bytes against slow references
written from aiter's own view/permute code, and shape refusals."""

from __future__ import annotations

import pytest
import torch

from glm_pack.packing.errors import FormatError
from glm_pack.packing.experts import (
    PROJECTIONS,
    moe_layout_description,
    repack_expert,
    repack_experts,
    stack_for_kernel,
    tensor_layout,
    unpack_expert,
    unpack_experts,
)
from glm_pack.packing.layouts import get_layout
from glm_pack.packing.mxfp4 import quantize

E, INTER, HIDDEN = 2, 256, 512  # I != H so that a gate/down mix-up changes shapes
PREFIX = "model.layers.3.mlp.experts"


def _experts(n: int, rows: int, k: int, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    pairs = [quantize(torch.randn(rows, k, generator=g) * (1 + i)) for i in range(n)]
    return [c for c, _ in pairs], [s for _, s in pairs]


@pytest.fixture(scope="module")
def layer() -> dict:
    return {
        "gate_proj": _experts(E, INTER, HIDDEN, 1),
        "up_proj": _experts(E, INTER, HIDDEN, 2),
        "down_proj": _experts(E, HIDDEN, INTER, 3),
    }


# ------------------------------------------------- slow references, transcribed from aiter's shuffle code


def slow_aiter_shuffle_weight(w: torch.Tensor) -> torch.Tensor:
    """aiter ``shuffle_weight(x, layout=(16, 16))`` on uint8 ``[M, N, Kb]``, one byte at a time:
    ``x.view(-1, N//16, 16, Kb//32, 2, 16).permute(0, 1, 3, 4, 2, 5)`` (IN=16, BK=32, K=16 bytes)."""
    m_, n_, kb_ = w.shape
    src = w.reshape(-1).tolist()
    dst = [None] * len(src)
    for m in range(m_):
        for n in range(n_):
            n1, n0 = divmod(n, 16)
            for kb in range(kb_):
                k1, k2, k0 = kb // 32, (kb % 32) // 16, kb % 16
                flat = ((((m * (n_ // 16) + n1) * (kb_ // 32) + k1) * 2 + k2) * 16 + n0) * 16 + k0
                dst[flat] = src[(m * n_ + n) * kb_ + kb]
    return torch.tensor(dst, dtype=torch.uint8).reshape(w.shape)


def slow_aiter_e8m0_shuffle(s: torch.Tensor) -> torch.Tensor:
    """aiter ``e8m0_shuffle`` of ``[R, C]`` with R % 256 == 0 and C % 8 == 0 (no padding), one byte at a time:
    ``s.view(R//32, 2, 16, C//8, 2, 4).permute(0, 3, 5, 2, 4, 1)``."""
    r_, c_ = s.shape
    assert r_ % 256 == 0 and c_ % 8 == 0
    src = s.reshape(-1).tolist()
    dst = [None] * len(src)
    for r in range(r_):
        r0, r1, r2 = r // 32, (r % 32) // 16, r % 16
        for c in range(c_):
            c0, c1, c2 = c // 8, (c % 8) // 4, c % 4
            flat = ((((r0 * (c_ // 8) + c0) * 4 + c2) * 16 + r2) * 2 + c1) * 2 + r1
            dst[flat] = src[r * c_ + c]
    return torch.tensor(dst, dtype=torch.uint8).reshape(s.shape)


def test_stacked_overlay_is_what_engines_feed_aiter(layer):
    """Engines stack w13 = [gate | up] per expert, then shuffle_weight(w13) and e8m0_shuffle(view(E*2I, -1)).
    Stacking our per-expert overlay tensors must give exactly those bytes."""
    gate, up, down = (layer[p] for p in PROJECTIONS)
    w13_src = torch.stack([torch.cat([g, u]) for g, u in zip(gate[0], up[0], strict=True)])
    w13s_src = torch.stack([torch.cat([g, u]) for g, u in zip(gate[1], up[1], strict=True)])
    w2_src, w2s_src = torch.stack(down[0]), torch.stack(down[1])

    w13, w13_scale, w2, w2_scale = stack_for_kernel(repack_experts(layer, prefix=PREFIX))

    assert w13.shape == (E, 2 * INTER, HIDDEN // 2) and w2.shape == (E, HIDDEN, INTER // 2)
    assert torch.equal(w13, slow_aiter_shuffle_weight(w13_src))
    assert torch.equal(w2, slow_aiter_shuffle_weight(w2_src))
    assert torch.equal(
        w13_scale.reshape(E * 2 * INTER, -1), slow_aiter_e8m0_shuffle(w13s_src.reshape(E * 2 * INTER, -1))
    )
    assert torch.equal(
        w2_scale.reshape(E * HIDDEN, -1), slow_aiter_e8m0_shuffle(w2s_src.reshape(E * HIDDEN, -1))
    )


def test_round_trip_returns_source_bytes(layer):
    packed = repack_experts(layer, prefix=PREFIX)
    back = unpack_experts(packed, prefix=PREFIX)
    for proj in PROJECTIONS:
        for side in (0, 1):
            for src, out, got in zip(layer[proj][side], packed[proj][side], back[proj][side], strict=True):
                assert out.shape == src.shape and out.dtype == torch.uint8  # kept under the source name
                assert not torch.equal(out, src)  # really shuffled (random data)
                assert torch.equal(got, src)


def test_manifest_layout_params_unpack_through_the_registry(layer):
    codes, scales = layer["down_proj"][0][1], layer["down_proj"][1][1]
    out_c, out_s = repack_expert(codes, scales)
    for packed, kind, src in ((out_c, "weight", codes), (out_s, "weight_scale", scales)):
        params = tensor_layout(kind, src.shape)
        kw = {k: v for k, v in params.items() if k != "layout"}
        assert torch.equal(get_layout(params["layout"]).unpack(packed, **kw), src)
    desc = moe_layout_description()
    assert desc["layout"] == "aiter_moe_a4w4" and desc["is_shuffled"] is True
    assert desc["per_tensor_layouts"] == {
        "weight": "aiter_shuffle_16x16",
        "weight_scale": "aiter_e8m0_shuffle",
    }


def test_single_expert_inverse_is_exact_on_all_byte_values():
    codes = torch.arange(256 * 128, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(256, 128)
    scales = torch.arange(256 * 8, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(256, 8)
    back_codes, back_scales = unpack_expert(*repack_expert(codes, scales))
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


# ---------------------------------------------------------------------------------------------- refusals


def _with(layer: dict, proj: str, side: int, expert: int, tensor) -> dict:
    out = {p: (list(layer[p][0]), list(layer[p][1])) for p in PROJECTIONS}
    out[proj][side][expert] = tensor
    return out


@pytest.mark.parametrize(
    ("edit", "names", "says"),
    [
        (lambda L: _with(L, "gate_proj", 0, 0, L["gate_proj"][0][0].float()), "0.gate_proj", "uint8"),
        (lambda L: _with(L, "up_proj", 0, 1, L["up_proj"][0][1][:128]), "1.up_proj", "disagree"),
        (
            lambda L: _with(
                _with(L, "up_proj", 0, 1, L["up_proj"][0][1][:128]), "up_proj", 1, 1, L["up_proj"][1][1][:128]
            ),
            "1.up_proj",
            "do not match the layer",
        ),
        (
            lambda L: _with(
                _with(L, "up_proj", 0, 1, L["up_proj"][0][1][:, :128]), "up_proj", 1, 1, L["up_proj"][1][1][:, :8]
            ),  # K = 256, a valid shape on its own, but the layer's K (hidden) is 512
            "1.up_proj",
            "do not match the layer",
        ),
        (lambda L: _with(L, "down_proj", 1, 0, L["down_proj"][1][0][:, :4]), "0.down_proj", "disagree"),
        (lambda L: {**L, "up_proj": (L["up_proj"][0], L["up_proj"][1][:1])}, None, "same positive number"),
        (
            lambda L: {**L, "down_proj": (L["up_proj"][0], L["up_proj"][1])},
            "0.down_proj",
            "do not match the layer",
        ),
        (
            lambda L: {**L, "down_proj": (L["down_proj"][0][:1], L["down_proj"][1][:1])},
            None,
            "same positive number",
        ),
        (lambda L: {p: ([], []) for p in PROJECTIONS}, None, "same positive number"),
        (lambda L: {k: v for k, v in L.items() if k != "up_proj"}, None, "needs exactly"),
        (lambda L: {**L, "shared_proj": L["up_proj"]}, None, "needs exactly"),
    ],
)
def test_bad_layers_raise_format_error_naming_the_tensor(layer, edit, names, says):
    bad = edit(layer)
    for fn in (repack_experts, unpack_experts, stack_for_kernel):
        with pytest.raises(FormatError, match=says) as info:
            fn(bad, prefix=PREFIX)
        assert info.value.tensor == (f"{PREFIX}.{names}.weight" if names else PREFIX)


@pytest.mark.parametrize(("rows", "k"), [(128, 512), (256, 320), (96, 256)])
def test_shapes_that_would_need_shuffle_padding_are_refused(rows, k):
    codes, scales = quantize(torch.ones(rows, k))
    layer = {
        "gate_proj": ([codes], [scales]),
        "up_proj": ([codes], [scales]),
        "down_proj": quantize(torch.ones(k, rows)),
    }
    layer["down_proj"] = ([layer["down_proj"][0]], [layer["down_proj"][1]])
    with pytest.raises(FormatError, match="rows % 256 == 0 and K % 256 == 0") as info:
        repack_experts(layer, prefix=PREFIX)
    assert info.value.tensor == f"{PREFIX}.0.gate_proj.weight"
    with pytest.raises(FormatError, match="rows % 256"):
        repack_expert(codes, scales, name="w")


def test_single_expert_shape_errors():
    codes, scales = quantize(torch.ones(256, 256))
    with pytest.raises(FormatError, match="2-D uint8") as info:
        repack_expert(codes[None], scales, name="x.weight")
    assert info.value.tensor == "x.weight"
    with pytest.raises(FormatError, match="disagree"):
        unpack_expert(codes, scales[:, :4])
    with pytest.raises(FormatError, match="2-D uint8"):
        unpack_expert(codes, "not a tensor")
    with pytest.raises(FormatError, match="weight_scale"):
        tensor_layout("bias", (1, 1))
