"""convert's overlay bytes against a slow, obvious reference written here from shared/notes alone.

Nothing of glm_pack.packing is used to compute the expected bytes: the split (rows per head, w_kc transposed),
the FP8 128x128-block dequantization, the even scale rule ((bits + 0x200000) & 0xFF800000, floor(log2) - 2,
clamped), E2M1 rounding to the nearest grid value with ties to the even code, nibble packing (element 2i low),
the bmm_nk layout with K padded by zero codes and scale bytes 0x7F, and the recorded relative errors are all
re-derived below with numpy. Edge-case blocks are planted in kv_b_proj in both orientations (a w_vc block runs
along a source row, a w_kc block down 32 source rows of one column): zeros, -0, exact ties, an amax whose
mantissa is exactly 1.75 (or one bf16 ulp below), subnormal blocks, a tiny negative among zeros, blocks on the
E2M1 grid (where neighbouring exponents tie for the mse rule).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from glm_pack.convert.convert import ConvertOptions, convert

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MIDPOINTS = (GRID[:-1] + GRID[1:]) / 2
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
EDGE_BLOCKS = [
    lambda r, k: np.zeros(32),
    lambda r, k: -np.zeros(32),
    lambda r, k: np.r_[6.0, r.choice(TIES, 31)] * r.choice([-1, 1], 32) * 2.0**k,  # amax 6: exponent k, ties
    lambda r, k: np.r_[7.0, r.choice(TIES, 31)] * 2.0**k,  # mantissa 1.75: exponent k + 1, 7 -> 3.5 -> 4
    lambda r, k: np.r_[6.96875, r.normal(0, 2, 31)] * 2.0**k,  # one ulp below: exponent k, 6.97 saturates
    lambda r, k: r.choice([0, 1, 2, 3, 5, 7], 32) * r.choice([-1, 1], 32) * 2.0**-133,  # bf16 subnormals
    lambda r, k: np.r_[-(2.0**-133), np.zeros(31)],  # rounds to -0: code 8
    lambda r, k: r.choice(GRID, 32) * r.choice([-1, 1], 32) * 2.0**k,  # on the grid: exact under 2 exponents
]


def plant_edge_blocks(w: torch.Tensor, heads: int, nope: int, v: int) -> torch.Tensor:
    r = np.random.default_rng(7)
    x = w.float().numpy().astype(np.float64)
    lora, i = x.shape[1], 0
    for h in range(heads):
        base = h * (nope + v)
        for j in range(0, v, 5):  # w_vc blocks: along source row base + nope + j
            c = 32 * r.integers(0, lora // 32)
            x[base + nope + j, c : c + 32] = EDGE_BLOCKS[i % len(EDGE_BLOCKS)](r, int(r.integers(-8, 4)))
            i += 1
        for col in range(0, lora, 7):  # w_kc blocks: down source rows [base + 32b, base + 32b + 32) of col
            b = 32 * r.integers(0, nope // 32)
            x[base + b : base + b + 32, col] = EDGE_BLOCKS[i % len(EDGE_BLOCKS)](r, int(r.integers(-8, 4)))
            i += 1
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)  # the designed values are bf16-exact


def shrink_heads(src, heads: int, edit_tensor) -> None:
    """Keep the first ``heads`` heads of every MLA layer (config, q_b_proj, kv_b_proj, o_proj and their scales):
    small layers whose kv_b_proj rows (heads * 448) end in a partial 128-row FP8 scale block."""
    config = json.loads((src / "config.json").read_text())
    g = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    config["num_attention_heads"] = config["num_key_value_heads"] = heads
    (src / "config.json").unlink()
    (src / "config.json").write_text(json.dumps(config))
    wmap = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    layers = [n[: -len("kv_b_proj.weight")] for n in wmap if n.endswith("self_attn.kv_b_proj.weight")]
    shapes = [
        ("q_b_proj", heads * (g[0] + g[1]), None),
        ("kv_b_proj", heads * (g[0] + g[2]), None),
        ("o_proj", None, heads * g[2]),
    ]  # rows or columns kept
    for attn, (proj, rows, cols) in itertools.product(layers, shapes):
        weight = attn + proj + ".weight"
        packed = read(src / wmap[weight], weight).dtype == torch.uint8  # MXFP4: 2 codes a byte, scale per 32
        edit_tensor(src, weight, functools.partial(first, rows, cols and cols // (2 if packed else 1)))
        for scale, per in ((weight + "_scale_inv", 128), (weight + "_scale", 32)):
            if scale in wmap:
                row_blocks = rows and -(-rows // per) if per == 128 else rows
                edit_tensor(src, scale, functools.partial(first, row_blocks, cols and -(-cols // per)))


def first(rows: int | None, cols: int | None, t: torch.Tensor) -> torch.Tensor:
    return t[:rows, :cols].contiguous()


def read(path, name) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name)


def source_float(src, name: str) -> np.ndarray:
    """kv_b_proj as float32: bf16 as is, FP8 times its 128x128 block's scale_inv (float64 product, rounded once),
    MXFP4 codes (element 2i in the low nibble) times 2^(scale byte - 127) per 32 along the row."""
    wmap = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    w = read(src / wmap[name], name)
    if w.dtype == torch.bfloat16:
        return w.float().numpy()
    if w.dtype == torch.uint8:
        b = w.numpy()
        codes = np.stack([b & 0xF, b >> 4], -1).reshape(len(b), -1, 32)
        scales = read(src / wmap[name + "_scale"], name + "_scale").numpy().astype(np.int64) - 127
        return decode(codes, scales).reshape(len(b), -1).astype(np.float32)
    scale_name = name + "_scale_inv"
    s = read(src / wmap[scale_name], scale_name).double().numpy()
    big = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[: w.shape[0], : w.shape[1]]
    return (w.float().double().numpy() * big).astype(np.float32)


def even_exponent(blocks: np.ndarray) -> np.ndarray:
    """Unbiased shared exponent of each 32-block (last axis) under the even rule."""
    bits = np.abs(blocks).max(-1).astype(np.float32).view(np.uint32).astype(np.int64)
    return np.clip(((bits + 0x200000) >> 23) - 127 - 2, -127, 127)


def encode(blocks: np.ndarray, e: np.ndarray) -> np.ndarray:
    """E2M1 codes of 32-blocks at exponents e: nearest grid value, ties to the even code, saturating, signed."""
    q = np.abs(blocks.astype(np.float64)) / np.ldexp(1.0, e)[..., None]
    idx = np.searchsorted(MIDPOINTS, q, side="left")  # a value on a midpoint lands on the lower neighbour
    on_mid = (idx < 7) & (q == MIDPOINTS[np.minimum(idx, 6)])
    idx = np.where(on_mid & (idx % 2 == 1), idx + 1, idx)  # ... and moves up when that one is odd
    return (idx | (np.signbit(blocks).astype(np.int64) << 3)).astype(np.uint8)


def decode(codes: np.ndarray, e: np.ndarray) -> np.ndarray:
    return GRID[codes & 7] * np.where(codes & 8, -1.0, 1.0) * np.ldexp(1.0, e)[..., None]


def stored_bytes(x: np.ndarray, k_stored: int, mode: str):
    """[H, N, K] float32 -> (codes [H, N, k_stored/2], scales [H, N, k_stored/32], dequantized [H, N, K])."""
    h, n, k = x.shape
    blocks = x.reshape(h, n, k // 32, 32)
    e = even_exponent(blocks)
    codes = encode(blocks, e)
    if mode == "mse":  # the best of e-1, e, e+1 per block (least squared error); a tie keeps the even exponent
        err = ((decode(codes, e) - blocks) ** 2).sum(-1)
        for cand in (np.clip(e - 1, -127, 127), np.clip(e + 1, -127, 127)):
            c = encode(blocks, cand)
            ce = ((decode(c, cand) - blocks) ** 2).sum(-1)
            better = ce < err
            e, codes, err = np.where(better, cand, e), np.where(better[..., None], c, codes), np.minimum(ce, err)
    deq = decode(codes, e).reshape(h, n, k)
    pad = k_stored - k
    codes = np.concatenate([codes.reshape(h, n, k), np.zeros((h, n, pad), np.uint8)], -1)
    scales = np.concatenate([(e + 127).astype(np.uint8), np.full((h, n, pad // 32), 0x7F, np.uint8)], -1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), scales, deq


def rel_errors(stored: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    d2 = ((stored - ref.astype(np.float64)) ** 2).reshape(len(ref), -1).sum(1)
    r2 = (ref.astype(np.float64) ** 2).reshape(len(ref), -1).sum(1)
    return float(np.sqrt(d2.sum() / r2.sum())), float(np.sqrt(d2 / r2).max())


@pytest.mark.parametrize(
    "fmt, mode, k_pad, k_stored",
    [
        ("bf16", "even", "card", 256),
        ("bf16", "mse", "none", 192),
        ("fp8-block", "even", "card", 256),
        ("mxfp4-attn", "mse", "128", 256),
    ],
)
def test_overlay_bytes_equal_an_independent_reference(
    synth_ckpt, ckpt_copy, edit_tensor, tmp_path, fmt, mode, k_pad, k_stored
):
    heads, nope, v, lora = 3, 192, 256, 512  # GLM-5 geometry, 3 of its 64 heads
    src = ckpt_copy(synth_ckpt("glm-5", fmt))
    shrink_heads(src, heads, edit_tensor)
    if fmt == "bf16":
        edit_tensor(src, "model.layers.0.self_attn.kv_b_proj.weight", lambda w: plant_edge_blocks(w, heads, nope, v))
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(quant_mode=mode, k_pad=k_pad, files="none"))

    manifest = json.loads((out / "glm-pack" / "manifest.json").read_text())
    wmap = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    names = [e["source"]["tensor"] for e in manifest["mla"]]
    assert sorted(names) == sorted(n for n in wmap if n.endswith("self_attn.kv_b_proj.weight"))
    for entry, name in zip(manifest["mla"], names, strict=True):
        w = source_float(src, name).reshape(heads, nope + v, lora)
        assert np.isfinite(w).all()
        kc, vc = w[:, :nope].transpose(0, 2, 1), w[:, nope:]  # [H, lora, nope] (K = nope last), [H, v, lora]
        for proj, x, k_st in (("w_kc", kc, k_stored), ("w_vc", vc, lora)):
            codes, scales, deq = stored_bytes(x, k_st, mode)
            want_mode, p = mode, entry[proj]
            if entry["source"]["format"] == "mxfp4" and proj == "w_vc":  # grouped along the source's own axis:
                codes, scales = (  # its bytes, row slices
                    read(src / wmap[t], t).numpy().reshape(heads, nope + v, -1)[:, nope:]
                    for t in (name, name + "_scale")
                )
                deq, want_mode = x.astype(np.float64), "source"
            assert p["layout"] == {"name": "bmm_nk", "k_logical": x.shape[-1], "k_stored": k_st}
            assert p["quant"]["mode"] == want_mode and p["precision"] == "mxfp4"
            for tensor, want in ((p["weight"], codes), (p["scale"], scales)):
                t = manifest["tensors"][tensor]
                got = read(out / "glm-pack" / t["file"], tensor)
                assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape, tensor
                assert np.array_equal(got.numpy(), want), f"{tensor}: {(got.numpy() != want).sum()} bytes differ"
                assert t["sha256"] == hashlib.sha256(want.tobytes()).hexdigest()
            total, worst = rel_errors(deq, x)
            assert p["rel_error"] == pytest.approx(total, rel=1e-6, abs=1e-12)
            assert p["mxfp4_rel_error"] == p["rel_error"]
            assert p["max_head_rel_error"] == pytest.approx(worst, rel=1e-6, abs=1e-12)  # float32 per-head sums
