"""One MLA layer's transform: float kv_b_proj -> stored w_kc / w_vc with their error metrics. Pure, no I/O.

Stored forms (``bmm_nk`` layout, reduction axis last, K padded from ``k_logical`` to ``k_stored``):

* mxfp4: codes U8 ``[H, N, k_stored/2]`` + E8M0 scales U8 ``[H, N, k_stored/32]`` (pad: code 0, scale 0x7F)
* bf16:  values ``[H, N, k_stored]`` (pad: 0)

w_kc has N = kv_lora, K = nope; w_vc has N = v, K = kv_lora. Errors are relative Frobenius norms over the
logical K, against the float source split: over all heads, and per head (the worst head is recorded, since a
tensor-parallel rank serves a few heads and one bad head is diluted in the whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import FormatError, PlanError
from .layouts import pack_bmm_nk, pad_bmm_nk_bf16
from .mla import MlaGeometry, split_kv_b
from .mxfp4 import MODES, check_finite, dequantize, quantize

POLICIES = ("mxfp4", "bf16", "auto")


@dataclass
class StoredProjection:
    """One projection as it goes to the overlay."""

    precision: str  # "mxfp4" | "bf16"
    quant_mode: str | None  # scale rule of the stored MXFP4 ("even", "mse", ... or "source" for kept bytes)
    weight: torch.Tensor  # U8 codes or BF16 values, [H, N, k_stored/2] or [H, N, k_stored]
    scale: torch.Tensor | None  # U8 [H, N, k_stored/32] for mxfp4
    k_logical: int
    k_stored: int
    rel_error: float  # of what is stored
    mxfp4_rel_error: float  # what MXFP4 gives (equal to rel_error when MXFP4 is stored)
    max_head_rel_error: float  # of what is stored, the largest over the heads (each head's own relative error)


def _head_sum_squares(t: torch.Tensor) -> torch.Tensor:
    """Sums of squares of float32 ``t`` per index of its first axis (per head), float64 ``[t.shape[0]]``: float32
    norms along the last axis (fast), summed in float64; in float64 throughout where a row's amax is below 2**-60 or
    its n squares could sum past 2**124 (amax above 2**62 / sqrt(n)), where float32 would under- or overflow.

    A row's amax lies within [norm / sqrt(n), norm], so only rows whose float32 norm is near those bounds (or not
    finite, or 0) are looked at element by element: the common case reads ``t`` once, with no temporary of its size.
    """
    root_n = math.sqrt(max(t.shape[-1], 1))
    low, high = 2.0**-60, 2.0**62 / root_n
    norms = torch.linalg.vector_norm(t, dim=-1)
    near = ~((norms > 2 * low * root_n) & (norms < high / 2))  # NaN and Inf norms included
    if bool(near.any()):
        amax = t[near].abs().amax(dim=-1)
        amax = amax[amax > 0]
        if bool(((amax < low) | (amax > high)).any()):
            norms = torch.linalg.vector_norm(t, dim=-1, dtype=torch.float64)
    return norms.double().square().reshape(t.shape[0], -1).sum(dim=1)


def _ratio(num: float, denom: float) -> float:
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return (num / denom) ** 0.5


def rel_errors(approx: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||approx - ref||_F / ||ref||_F over the whole tensor, the largest of the same over one index of the first
    axis, i.e. one head): float64 from float32 values; 0 where both are zero, inf where only ``ref`` is; NaN where
    ``approx`` holds one (a NaN head is the worst, whatever its position)."""
    denom = _head_sum_squares(ref.float())
    num = _head_sum_squares(approx.float() - ref.float())
    heads = [_ratio(n, d) for n, d in zip(num.tolist(), denom.tolist(), strict=True)]
    return _ratio(float(num.sum()), float(denom.sum())), max(heads, default=0.0, key=_nan_first)


def _nan_first(error: float) -> float:
    """Order key that makes NaN the largest (Python's ``max`` keeps a NaN only when it comes first)."""
    return math.inf if math.isnan(error) else error


def _finite(errors: tuple[float, float], w: torch.Tensor, what: str, fmt: str) -> tuple[float, float]:
    """The relative errors (whole, worst head) of ``w`` stored as ``fmt`` when finite; else FormatError: ``w``'s
    values, finite but near float32's maximum, overflow to Inf in ``fmt`` (MXFP4: a block scale of 2**127 makes
    the E2M1 value 2 (code 4) decode to 2**128; BF16: values from (2 - 2**-8) * 2**127 up round to Inf)."""
    if not all(map(math.isfinite, errors)):
        raise FormatError(
            f"{what} overflows to Inf in {fmt}: its values (up to {float(w.abs().max()):.3g}) are too close to "
            f"float32's maximum (relative error {errors[0]})"
        )
    return errors


def check_choices(quant_mode: str, policy: str) -> None:
    """PlanError unless ``quant_mode`` is an MXFP4 scale mode and ``policy`` an MLA precision policy."""
    if quant_mode not in MODES:
        raise PlanError(f"unknown MXFP4 scale mode {quant_mode!r}; choose one of {', '.join(MODES)}")
    if policy not in POLICIES:
        raise PlanError(f"unknown MLA precision policy {policy!r}; choose one of {', '.join(POLICIES)}")


def check_bound(policy: str, max_rel_error: float | None) -> None:
    """PlanError unless ``max_rel_error`` (a relative error, finite, >= 0) is given exactly when the policy is
    ``auto``, the one that reads it."""
    if (policy == "auto") != (max_rel_error is not None):
        raise PlanError("--max-rel-error goes with --mla-precision auto, and auto needs it")
    if max_rel_error is not None and not 0 <= max_rel_error < math.inf:
        raise PlanError(f"--max-rel-error must be a finite number >= 0, got {max_rel_error}")


def stored_precision(policy: str, mxfp4_rel_error: float, max_rel_error: float | None) -> str:
    """What a projection is stored as under ``policy``: ``auto`` keeps MXFP4 while its relative error is within
    ``max_rel_error``, else BF16; the others are themselves."""
    if policy != "auto":
        return policy
    return "mxfp4" if mxfp4_rel_error <= max_rel_error else "bf16"


def store_projection(
    w: torch.Tensor,
    *,
    k_stored: int,
    quant_mode: str,
    policy: str,
    max_rel_error: float | None,
    mxfp4_source: tuple[torch.Tensor, torch.Tensor] | None = None,
    what: str = "projection",
) -> StoredProjection:
    """Float ``w [H, N, K]`` -> stored projection under ``policy``.

    ``mxfp4_source``: the projection's codes/scales already grouped along K (from an MXFP4 checkpoint);
    they are kept byte for byte instead of quantizing again. ``what`` names the projection in errors.
    """
    check_choices(quant_mode, policy)
    check_bound(policy, max_rel_error)
    k = w.shape[-1]
    if k_stored < k or k_stored % 32:
        raise FormatError(f"k_stored {k_stored} must be a multiple of 32 and >= K {k}")
    codes, scales = mxfp4_source if mxfp4_source is not None else quantize(w, mode=quant_mode, axis=-1)
    mx_err, mx_head = _finite(rel_errors(dequantize(codes, scales, axis=-1), w), w, what, "MXFP4")
    if stored_precision(policy, mx_err, max_rel_error) == "mxfp4":
        codes, scales = pack_bmm_nk(codes, scales, k_stored=k_stored)
        mode = "source" if mxfp4_source is not None else quant_mode
        return StoredProjection("mxfp4", mode, codes, scales, k, k_stored, mx_err, mx_err, mx_head)
    values = w.to(torch.bfloat16)
    bf16_err, bf16_head = _finite(rel_errors(values, w), w, what, "BF16")
    padded = pad_bmm_nk_bf16(values, k_stored=k_stored)
    return StoredProjection("bf16", None, padded, None, k, k_stored, bf16_err, mx_err, bf16_head)


def absorb_layer(
    kv_b: torch.Tensor,
    geom: MlaGeometry,
    *,
    k_stored: int,
    quant_mode: str = "even",
    policy: str = "mxfp4",
    max_rel_error: float | None = None,
    vc_mxfp4_source: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[StoredProjection, StoredProjection]:
    """Float kv_b_proj ``[H*(nope+v), kv_lora]`` -> (w_kc, w_vc) stored projections.

    ``k_stored`` is w_kc's stored K (nope, or nope padded, e.g. 192 -> 256); w_vc's K (kv_lora) is never
    padded. NaN/Inf in kv_b raise :class:`~glm_pack.packing.errors.NonFiniteError`.
    """
    check_finite(kv_b, "kv_b_proj")
    w_kc, w_vc = split_kv_b(kv_b.float(), geom)
    common = {"quant_mode": quant_mode, "policy": policy, "max_rel_error": max_rel_error}
    kc = store_projection(w_kc, k_stored=k_stored, what="w_kc", **common)
    vc = store_projection(w_vc, k_stored=geom.kv_lora_rank, mxfp4_source=vc_mxfp4_source, what="w_vc", **common)
    return kc, vc
