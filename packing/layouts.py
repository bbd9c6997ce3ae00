"""Named, reversible byte layouts of MXFP4 tensors, with parameters a manifest can record.

All tensors are uint8: packed codes (two E2M1 codes per byte, low nibble first) or E8M0 scale bytes.

* ``bmm_nk``: aiter's batched A16WFP4 GEMM weight. Codes ``[B, N, K_stored/2]``, scales
  ``[B, N, K_stored/32]``, plain row-major, K the reduction axis. K may be padded from ``k_logical`` to
  ``k_stored`` (a multiple of ``k_multiple``): padded codes are 0 and padded scale bytes 0x7F (2**0),
  so padded columns hold exact zeros.
* ``aiter_shuffle_16x16``: aiter's ``shuffle_weight(w, layout=(16, 16))`` of packed bytes ``[..., N, Kb]``,
  a 16x16-byte tile transpose: byte (n, kb) goes to
  ``(n//16)*16*Kb + (kb//16)*256 + (n%16)*16 + kb%16`` within its matrix.
* ``aiter_e8m0_shuffle``: aiter's ``shuffle_scale`` / ``e8m0_shuffle`` of scales ``[..., R, C]``: each matrix
  padded to ``(Rp, Cp) = (ceil(R/256)*256, ceil(C/8)*8)`` with 0x7F (aiter leaves it uninitialised), then
  byte (r, c) goes to ``(r//32)*32*Cp + (c//8)*256 + (c%4)*64 + (r%16)*4 + ((c%8)//4)*2 + (r%32)//16``.
  Leading dims are independent matrices; with R % 256 == 0 this equals shuffling the stacked ``[E*R, C]``.

Each :class:`Layout` records ``params(...)`` (a JSON-able dict with the ``layout`` name); unpacking takes
those same parameters as keywords: ``layout.unpack(*packed, **{k: v for k, v in p.items() if k != "layout"})``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import FormatError
from .mxfp4 import BLOCK

SCALE_PAD = 0x7F  # E8M0 byte of 2**0: a neutral, finite scale for padded blocks
CODE_PAD = 0x00  # two +0 codes
_TILE = 16  # aiter's (16, 16) weight shuffle tile: 16 rows x 16 bytes
_SCALE_ROWS, _SCALE_COLS = 256, 8  # e8m0_shuffle pads rows and columns to these multiples


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise FormatError(message)


def _check_u8(t: torch.Tensor, what: str, min_dims: int) -> None:
    _need(isinstance(t, torch.Tensor), f"{what} must be a torch.Tensor, got {type(t).__name__}")
    _need(t.dtype == torch.uint8, f"{what} must be uint8, got {t.dtype}")
    _need(t.dim() >= min_dims, f"{what} needs at least {min_dims} dims, got shape {tuple(t.shape)}")


# ----------------------------------------------------------------------------------------------- bmm_nk


def stored_k(k_logical: int, k_multiple: int | None) -> int:
    """K (elements) as stored: ``k_logical`` rounded up to a multiple of ``k_multiple`` (None: unpadded)."""
    _need(k_logical > 0 and k_logical % BLOCK == 0, f"K must be a positive multiple of 32, got {k_logical}")
    if k_multiple is None:
        return k_logical
    _need(
        k_multiple > 0 and k_multiple % BLOCK == 0,
        f"k_multiple must be a positive multiple of 32, got {k_multiple}",
    )
    return -(-k_logical // k_multiple) * k_multiple


def _check_bmm_pair(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """Validate a ``[B, N, K/2]`` / ``[B, N, K/32]`` pair; return K (elements)."""
    _check_u8(codes, "bmm_nk codes", 0)
    _check_u8(scales, "bmm_nk scales", 0)
    _need(
        codes.dim() == 3 and scales.dim() == 3,
        f"bmm_nk needs 3-D codes [B, N, K/2] and scales [B, N, K/32], got {tuple(codes.shape)} and "
        f"{tuple(scales.shape)}",
    )
    _need(
        codes.shape[:2] == scales.shape[:2] and codes.shape[2] == scales.shape[2] * (BLOCK // 2),
        f"bmm_nk codes {tuple(codes.shape)} and scales {tuple(scales.shape)} disagree: need the same [B, N] "
        "and codes K/2 == 16 * scales K/32",
    )
    return codes.shape[2] * 2


def pack_bmm_nk(codes: torch.Tensor, scales: torch.Tensor, *, k_stored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad K from the input's logical K to ``k_stored`` (codes 0, scale bytes 0x7F); contiguous outputs."""
    k_logical = _check_bmm_pair(codes, scales)
    _need(
        k_stored >= k_logical and k_stored % BLOCK == 0,
        f"bmm_nk k_stored must be a multiple of 32 and >= K = {k_logical}, got {k_stored}",
    )
    if k_stored == k_logical:
        return codes.contiguous(), scales.contiguous()
    return _pad_last(codes, k_stored // 2, CODE_PAD), _pad_last(scales, k_stored // BLOCK, SCALE_PAD)


def pad_bmm_nk_bf16(values: torch.Tensor, *, k_stored: int) -> torch.Tensor:
    """BF16 ``bmm_nk`` values ``[..., K]`` -> ``[..., k_stored]``, zero-padded (a contiguous tensor)."""
    if k_stored == values.shape[-1]:
        return values.contiguous()
    return _pad_last(values, k_stored, 0)


def _pad_last(t: torch.Tensor, size: int, value: int) -> torch.Tensor:
    """``t`` with its last axis extended to ``size`` with ``value`` (a fill + one copy: F.pad is slow on uint8)."""
    out = torch.full((*t.shape[:-1], size), value, dtype=t.dtype, device=t.device)
    out[..., : t.shape[-1]] = t
    return out


def unpack_bmm_nk(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    k_logical: int,
    k_stored: int | None = None,
    check_padding: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop K padding: back to codes ``[B, N, k_logical/2]``, scales ``[B, N, k_logical/32]`` (contiguous).

    ``k_stored``, when given (as recorded), must match the tensors. With ``check_padding`` the padded
    bytes must be the deterministic ones (codes 0, scales 0x7F).
    """
    k_have = _check_bmm_pair(codes, scales)
    _need(
        k_stored is None or k_stored == k_have,
        f"bmm_nk tensors hold K = {k_have}, but k_stored = {k_stored} was recorded",
    )
    _need(
        0 < k_logical <= k_have and k_logical % BLOCK == 0,
        f"bmm_nk k_logical must be a positive multiple of 32 and <= stored K = {k_have}, got {k_logical}",
    )
    c_pad, s_pad = codes[..., k_logical // 2 :], scales[..., k_logical // BLOCK :]
    _need(
        not check_padding or (bool((c_pad == CODE_PAD).all()) and bool((s_pad == SCALE_PAD).all())),
        f"bmm_nk padding beyond K = {k_logical} is not codes 0x00 / scales 0x7F",
    )
    return codes[..., : k_logical // 2].contiguous(), scales[..., : k_logical // BLOCK].contiguous()


def bmm_nk_params(k_logical: int, k_stored: int) -> dict:
    return {"layout": "bmm_nk", "k_logical": int(k_logical), "k_stored": int(k_stored)}


# ------------------------------------------------------------------------------------ aiter weight shuffle


def _weight_tiles(w: torch.Tensor, what: str) -> tuple[int, int]:
    _check_u8(w, what, 2)
    n, kb = w.shape[-2:]
    _need(
        n % _TILE == 0 and kb % (2 * _TILE) == 0,
        f"{what} [..., N, Kb] = {tuple(w.shape)} needs N % 16 == 0 and Kb % 32 == 0 (aiter 16x16 shuffle)",
    )
    return n, kb


def shuffle_weight(w: torch.Tensor) -> torch.Tensor:
    """aiter ``shuffle_weight(layout=(16, 16))`` of packed bytes ``[..., N, Kb]``; same shape, contiguous."""
    n, kb = _weight_tiles(w, "shuffle_weight input")
    lead = w.shape[:-2]
    tiles = w.reshape(math.prod(lead), n // _TILE, _TILE, kb // _TILE, _TILE)  # [M, n1, n0, k1, k0]
    return tiles.permute(0, 1, 3, 2, 4).contiguous().reshape(*lead, n, kb)


def unshuffle_weight(w: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`shuffle_weight`."""
    n, kb = _weight_tiles(w, "unshuffle_weight input")
    lead = w.shape[:-2]
    tiles = w.reshape(math.prod(lead), n // _TILE, kb // _TILE, _TILE, _TILE)  # [M, n1, k1, n0, k0]
    return tiles.permute(0, 1, 3, 2, 4).contiguous().reshape(*lead, n, kb)


def shuffle_weight_params() -> dict:
    return {"layout": "aiter_shuffle_16x16"}


# ------------------------------------------------------------------------------------- aiter scale shuffle


def padded_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """(Rp, Cp) of :func:`shuffle_scale`'s output for a ``[R, C]`` scale matrix."""
    return -(-rows // _SCALE_ROWS) * _SCALE_ROWS, -(-cols // _SCALE_COLS) * _SCALE_COLS


def shuffle_scale(s: torch.Tensor) -> torch.Tensor:
    """aiter ``e8m0_shuffle`` of E8M0 bytes ``[..., R, C]`` -> ``[..., Rp, Cp]`` (padding 0x7F), contiguous."""
    _check_u8(s, "shuffle_scale input", 2)
    rows, cols = s.shape[-2:]
    rp, cp = padded_scale_shape(rows, cols)
    padded = F.pad(s, (0, cp - cols, 0, rp - rows), value=SCALE_PAD)
    # r = (r0, r1, r2) with sizes (Rp/32, 2, 16); c = (c0, c1, c2) with sizes (Cp/8, 2, 4)
    view = padded.reshape(math.prod(s.shape[:-2]), rp // 32, 2, 16, cp // 8, 2, 4)  # [M, r0, r1, r2, c0, c1, c2]
    return view.permute(0, 1, 4, 6, 3, 5, 2).contiguous().reshape(*s.shape[:-2], rp, cp)


def unshuffle_scale(s: torch.Tensor, shape, *, check_padding: bool = True) -> torch.Tensor:
    """Inverse of :func:`shuffle_scale`: padded shuffled ``[..., Rp, Cp]`` -> ``shape`` = ``[..., R, C]``.

    With ``check_padding`` the padded bytes must be 0x7F (as :func:`shuffle_scale` writes them).
    """
    _check_u8(s, "unshuffle_scale input", 2)
    shape = tuple(int(d) for d in shape)
    _need(
        len(shape) == s.dim() and shape[:-2] == tuple(s.shape[:-2]),
        f"unshuffle_scale shape {shape} must have the shuffled tensor's rank and leading dims {tuple(s.shape)}",
    )
    rows, cols = shape[-2:]
    rp, cp = padded_scale_shape(rows, cols)
    _need(
        tuple(s.shape[-2:]) == (rp, cp),
        f"unshuffle_scale of [R, C] = {(rows, cols)} needs a shuffled [..., {rp}, {cp}] tensor "
        f"(R padded to a multiple of 256, C to a multiple of 8), got {tuple(s.shape)}",
    )
    view = s.reshape(math.prod(shape[:-2]), rp // 32, cp // 8, 4, 16, 2, 2)  # [M, r0, c0, c2, r2, c1, r1]
    padded = view.permute(0, 1, 6, 4, 2, 5, 3).reshape(math.prod(shape[:-2]), rp, cp)
    if check_padding:
        inside = torch.zeros(rp, cp, dtype=torch.bool, device=s.device)
        inside[:rows, :cols] = True
        _need(
            bool((padded[:, ~inside] == SCALE_PAD).all()),
            f"unshuffle_scale: padding outside [R, C] = {(rows, cols)} is not 0x7F",
        )
    return padded[:, :rows, :cols].contiguous().reshape(shape)


def shuffle_scale_params(shape) -> dict:
    return {"layout": "aiter_e8m0_shuffle", "shape": [int(d) for d in shape]}


# -------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Layout:
    """A reversible layout: ``unpack(*pack(*tensors, **pack_kw), **params_without_name) == tensors``."""

    name: str
    description: str
    pack: Callable
    unpack: Callable
    params: Callable[..., dict]


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            "bmm_nk",
            "aiter batched A16WFP4 weight: codes [B, N, K_stored/2], scales [B, N, K_stored/32], row-major, "
            "K padded with codes 0 / scales 0x7F",
            pack_bmm_nk,
            unpack_bmm_nk,
            bmm_nk_params,
        ),
        Layout(
            "aiter_shuffle_16x16",
            "aiter shuffle_weight(layout=(16, 16)) of packed MXFP4 bytes [..., N, Kb]",
            shuffle_weight,
            unshuffle_weight,
            shuffle_weight_params,
        ),
        Layout(
            "aiter_e8m0_shuffle",
            "aiter e8m0_shuffle of E8M0 scales [..., R, C], padded to [ceil(R/256)*256, ceil(C/8)*8] with 0x7F",
            shuffle_scale,
            unshuffle_scale,
            shuffle_scale_params,
        ),
    )
}


def get_layout(name: str) -> Layout:
    """The registered layout called ``name``; :class:`FormatError` for unknown names."""
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown layout {name!r}; known layouts: {', '.join(sorted(LAYOUTS))}") from None
