"""FP8 (E4M3) weights with float32 scales, dequantized in float32 (the exact product rounded once: at most 2**-24
relative where the product is in float32's normal range, below 2**-126 to the subnormal grid of 2**-149): per 2-D
block (DeepSeek-V3 / zai-org ``weight_scale_inv``) or per output channel (Quark ``weight_scale``). Pure tensor
math, no I/O."""

from __future__ import annotations

import math

import torch


def block_view(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``[out, in]`` -> ``[ceil(out/bo), bo, ceil(in/bi), bi]`` (zero-padded copy only when ragged)."""
    bo, bi = block
    out, cols = x.shape
    nb_o, nb_i = math.ceil(out / bo), math.ceil(cols / bi)
    if (nb_o * bo, nb_i * bi) != (out, cols):
        padded = torch.zeros(nb_o * bo, nb_i * bi, dtype=torch.float32, device=x.device)
        padded[:out, :cols] = x
        x = padded
    return x.reshape(nb_o, bo, nb_i, bi)


def dequantize_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 ``weight [out, in]`` + float ``scale [ceil(out/bo), ceil(in/bi)]`` -> float32 ``[out, in]``,
    ``float(w[i, j]) * scale[i // bo, j // bi]`` (edge blocks may be partial)."""
    out, cols = weight.shape
    blocks = block_view(weight.to(torch.float32), block)
    scaled = blocks * scale.to(torch.float32)[:, None, :, None]
    return scaled.reshape(blocks.shape[0] * blocks.shape[1], -1)[:out, :cols]


def dequantize_channel(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 ``weight [out, in]`` + float ``scale [out]`` (or ``[out, 1]``) -> float32 ``w[i, j] * scale[i]``."""
    return weight.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)
