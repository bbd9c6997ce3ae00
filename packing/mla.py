"""MLA geometry and the split of ``kv_b_proj`` into the absorbed projections w_kc (K-up) and w_vc (V-up).

``kv_b_proj.weight`` is ``[H * (nope + v), kv_lora]`` with rows grouped per head: head h owns rows
``[h*(nope+v), (h+1)*(nope+v))``, first ``nope`` rows its K projection, then ``v`` rows its V projection.
Outputs follow the engines' convention, reduction axis last:

* ``w_kc``: ``[H, kv_lora, nope]``  (K-up: latent = q_nope @ w_kc^T per head, K = nope)
* ``w_vc``: ``[H, v, kv_lora]``     (V-up: out = latent @ w_vc^T per head, K = kv_lora)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import FormatError
from .mxfp4 import BLOCK


@dataclass(frozen=True)
class MlaGeometry:
    """Head count and per-head widths of one MLA attention (all in elements)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self):
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if int(getattr(self, name)) <= 0:
                raise FormatError(f"MLA geometry needs a positive {name}, got {getattr(self, name)}")
        if self.qk_rope_head_dim < 0:
            raise FormatError(f"MLA geometry needs qk_rope_head_dim >= 0, got {self.qk_rope_head_dim}")

    @property
    def kv_b_rows(self) -> int:
        """Rows of kv_b_proj.weight: H * (nope + v)."""
        return self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def cache_row(self) -> int:
        """Width of one latent KV-cache row: kv_lora + rope (512 rope-free, 576 with rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def as_dict(self) -> dict:
        return {
            "num_heads": self.num_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
        }


def _check_rows(shape, geom: MlaGeometry, cols: int, what: str) -> None:
    if tuple(shape) != (geom.kv_b_rows, cols):
        raise FormatError(
            f"{what} has shape {tuple(shape)}, expected ({geom.kv_b_rows}, {cols}) = "
            f"(H*(nope+v) = {geom.num_heads}*({geom.qk_nope_head_dim}+{geom.v_head_dim}), {cols})"
        )


def split_kv_b(kv_b: torch.Tensor, geom: MlaGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``kv_b [H*(nope+v), kv_lora]`` -> contiguous (w_kc ``[H, kv_lora, nope]``, w_vc ``[H, v, kv_lora]``)."""
    _check_rows(kv_b.shape, geom, geom.kv_lora_rank, "kv_b_proj")
    per_head = kv_b.view(geom.num_heads, geom.qk_nope_head_dim + geom.v_head_dim, geom.kv_lora_rank)
    w_k, w_v = per_head.split([geom.qk_nope_head_dim, geom.v_head_dim], dim=1)
    return w_k.transpose(1, 2).contiguous(), w_v.contiguous()


def split_kv_b_mxfp4_vc(
    codes: torch.Tensor, scales: torch.Tensor, geom: MlaGeometry
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 kv_b_proj grouped along kv_lora -> w_vc (codes ``[H, v, kv_lora/2]``, scales ``[H, v, kv_lora/32]``).

    The V rows are already grouped along w_vc's reduction axis, so they are row slices, byte-identical to
    the source: no requantization.
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise FormatError(f"kv_b_proj MXFP4 codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if geom.kv_lora_rank % BLOCK:
        raise FormatError(f"kv_lora_rank {geom.kv_lora_rank} is not a multiple of 32: no MXFP4 blocks along it")
    _check_rows(codes.shape, geom, geom.kv_lora_rank // 2, "kv_b_proj codes")
    _check_rows(scales.shape, geom, geom.kv_lora_rank // BLOCK, "kv_b_proj scales")
    out = []
    for t in (codes, scales):
        per_head = t.view(geom.num_heads, geom.qk_nope_head_dim + geom.v_head_dim, t.shape[-1])
        out.append(per_head[:, geom.qk_nope_head_dim :, :].contiguous())
    return out[0], out[1]
