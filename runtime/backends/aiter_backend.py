"""The aiter backend (AMD gfx950): batched A16WFP4 GEMM and sparse MLA from AMD's aiter library.

Written against the documented contract (``notes/aiter-contract.md``); aiter is imported lazily and every
function is feature-detected. The contract is asserted before each call, since aiter checks none of it:
u8 weights and scales, ``x.shape[-1] == 2 * w.shape[-1]`` (a 192-wide q against a 256-padded w_kc returns
garbage otherwise), positive strides, ``prequant=True``, a complete config with ``NUM_KSPLIT == 1``
(aiter's split-K reduce corrupts memory with this wrapper); for sparse MLA, q and cache rows unit-stride along
their last axis (the kernel takes no stride for it); a token with no valid row gets the reference's zero row, not
aiter's NaN (it divides by a zero softmax sum). Numerics as the reference, except that the old wheel's
``pre_quant`` path rounds activation ties up, not to even (its ``_mxfp4_quant_op``; README, Runtime).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from glm_pack.packing.errors import BackendError
from glm_pack.packing.manifest import AITER_BMM_CONFIG_KEYS
from glm_pack.runtime.reference import cache_rows, check_sparse_indices

from .base import Backend, gpu_reason

log = logging.getLogger(__name__)

# (module, function, kind), in order of preference; the second path is aiter's backward-compatible alias.
_BMM_FUNCTIONS = (
    ("aiter.ops.triton.gemm.batched.batched_gemm_a16wfp4", "batched_gemm_a16wfp4", "a16wfp4"),
    ("aiter.ops.triton.batched_gemm_a16wfp4", "batched_gemm_a16wfp4", "a16wfp4"),
    ("aiter.ops.triton.batched_gemm_afp4wfp4_pre_quant", "batched_gemm_afp4wfp4_pre_quant", "pre_quant"),
)
_SPARSE_MODULE = "aiter.ops.triton.attention.sparse_mla"
TARGET_ARCH = "gfx950"


@dataclass
class AiterFunctions:
    """What the installed aiter offers. ``bmm_kind`` is "a16wfp4" (transpose_bm) or "pre_quant" (old wheel)."""

    bmm: Any
    bmm_kind: str
    sparse_mla_fwd: Any | None  # None also when it lacks return_lse (one tensor back) or qk_rope_head_dim
    sparse_rope_free: bool  # sparse_mla_fwd runs qk_rope_head_dim=0 (rope-free BF16 caches); see _sparse_mla
    sparse_has_invalid: bool  # sparse_mla_fwd takes has_invalid (-1 sentinels)


def detect_arch(device) -> str | None:
    """The arch name of GPU ``device`` on ROCm torch (e.g. "gfx950"), or None without a ROCm GPU."""
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None) is None:
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # aiter raises RuntimeError, not ImportError, without ROCm
        return None


def load_aiter() -> AiterFunctions:
    """Import aiter's kernels; raises BackendError saying why when they are not usable."""
    try:
        importlib.import_module("aiter")
    except Exception as err:
        raise BackendError(f"aiter backend unavailable: importing aiter failed ({type(err).__name__}: {err})") from err
    why = []
    for name, function, kind in _BMM_FUNCTIONS:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # aiter raises RuntimeError, not ImportError, without ROCm
            why.append(f"importing {name}: {type(err).__name__}: {err}")
            continue
        if hasattr(module, function):
            return AiterFunctions(getattr(module, function), kind, *_sparse_mla())
        why.append(f"{name} has no {function}")
    raise BackendError(f"aiter backend unavailable: no batched A16WFP4 GEMM in the installed aiter ({'; '.join(why)})")


def _sparse_mla() -> tuple[Any | None, bool, bool]:
    """(sparse_mla_fwd or None, rope-free support, takes has_invalid), told apart by signature.

    ROCm/aiter ``aiter/ops/triton/attention/sparse_mla.py``: without ``return_lse`` (branch
    cagri/sparse_pa_optimizations @ 4d86ac59) it returns ``out`` alone, not ``(out, lse)``: unusable here (so is
    one without ``qk_rope_head_dim``, which would assume aiter's default rope width of 64). With
    positional arguments after ``softmax_scale`` (@ d921e5ba) it launches the separated-rope geometry only
    (``ROPE_SEPARATE=True``; ``qk_rope_head_dim=0`` fails inside the kernel build); the revision that made them
    keyword-only (@ 013f408e) passes ``ROPE_SEPARATE = qk_rope_head_dim > 0``: rope-free support.
    """
    fwd = getattr(_import(_SPARSE_MODULE), "sparse_mla_fwd", None)
    params = inspect.signature(fwd).parameters if fwd is not None else {}
    if "return_lse" not in params or "qk_rope_head_dim" not in params:
        return None, False, False
    return fwd, params["qk_rope_head_dim"].kind is inspect.Parameter.KEYWORD_ONLY, "has_invalid" in params


def aiter_status(device) -> tuple[bool, str]:
    """(usable, reason) for backend selection: ``device`` a GPU, a gfx950 one, and aiter importable."""
    if why := gpu_reason(device):
        return False, f"aiter backend {why}"
    arch = detect_arch(device)
    if arch != TARGET_ARCH:
        return False, f"aiter backend needs a {TARGET_ARCH} GPU ({device} is {arch or 'no ROCm GPU'})"
    try:
        load_aiter()
    except BackendError as err:
        return False, str(err)
    return True, "ok"


def select_config(configs: dict, m: int) -> dict:
    """Pick the config for M rows from ``{"M_LEQ_<n>": cfg, ..., "any": cfg}`` and check it is complete."""
    buckets = sorted((int(k.removeprefix("M_LEQ_")), k) for k in configs if k.startswith("M_LEQ_"))
    key = next((k for bound, k in buckets if m <= bound), "any")
    if key not in configs:
        raise BackendError(f"no kernel config for M={m}: the manifest's buckets are {sorted(configs)}")
    cfg = dict(configs[key])
    missing = [k for k in AITER_BMM_CONFIG_KEYS if k not in cfg]
    if missing:
        raise BackendError(f"kernel config {key} lacks {', '.join(missing)}: aiter needs every key")
    if cfg["NUM_KSPLIT"] != 1:
        raise BackendError(
            f"kernel config {key} has NUM_KSPLIT={cfg['NUM_KSPLIT']}; only 1 is safe with this aiter wrapper"
        )
    return cfg


def check_bmm_contract(x: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor, out: torch.Tensor) -> None:
    """aiter's unchecked preconditions for ``batched_gemm_a16wfp4``."""
    if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise BackendError(f"aiter A16WFP4 needs bf16 x and out, got {x.dtype} / {out.dtype}")
    if w.dtype != torch.uint8 or w_scales.dtype != torch.uint8:
        raise BackendError(f"aiter A16WFP4 needs u8 weights and E8M0 scales, got {w.dtype} / {w_scales.dtype}")
    B, M, K = x.shape
    if x.shape[-1] != 2 * w.shape[-1]:
        raise BackendError(
            f"x has K={x.shape[-1]} but the weight stores K={2 * w.shape[-1]}: aiter would return garbage"
        )
    if w.shape[0] != B or w_scales.shape != (B, w.shape[1], K // 32) or out.shape != (B, M, w.shape[1]):
        raise BackendError(
            f"shape mismatch: x {tuple(x.shape)}, w {tuple(w.shape)}, "
            f"scales {tuple(w_scales.shape)}, out {tuple(out.shape)}"
        )
    for name, t in (("x", x), ("w", w), ("w_scales", w_scales), ("out", out)):
        if any(s <= 0 for s in t.stride()):
            raise BackendError(f"aiter needs positive strides; {name} has {t.stride()}")


class AiterBackend(Backend):
    name = "aiter"

    def __init__(self, kernel_configs: dict, *, functions: AiterFunctions | None = None, fallback: Backend):
        self.fn = functions or load_aiter()
        self.configs = kernel_configs.get(TARGET_ARCH, {})
        self.fallback = fallback
        self._warned = False

    def bmm_a16wfp4(self, x, w_codes, w_scales, out, *, op, act_quant):
        if act_quant != "mxfp4":
            raise BackendError(
                "aiter's A16WFP4 always quantizes activations (prequant); act_quant='none' is unsupported"
            )
        check_bmm_contract(x, w_codes, w_scales, out)
        if op not in self.configs:
            raise BackendError(f"the manifest has no {TARGET_ARCH} kernel config for {op}")
        cfg = select_config(self.configs[op], x.shape[1])
        if self.fn.bmm_kind == "a16wfp4":
            # transpose_bm: y is (M, B, N) = the batch-major [T, H, N] buffer behind `out`.
            self.fn.bmm(
                x,
                w_codes,
                w_scales,
                dtype=torch.bfloat16,
                y=out.transpose(0, 1),
                config=cfg,
                transpose_bm=True,
                prequant=True,
            )
        else:
            self.fn.bmm(x, w_codes, w_scales, torch.bfloat16, out, cfg)

    def sparse_mla(self, q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, *, return_lse):
        rope = 0 if q_rope is None else q_rope.shape[-1]
        if self.fn.sparse_mla_fwd is None or (rope == 0 and not self.fn.sparse_rope_free):
            if not self._warned:
                why = "has no usable sparse_mla_fwd" if self.fn.sparse_mla_fwd is None else "lacks rope-free support"
                log.warning("installed aiter %s; sparse MLA runs on the %s backend", why, self.fallback.name)
                self._warned = True
            return self.fallback.sparse_mla(
                q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, return_lse=return_lse
            )
        rows = cache_rows(kv_cache, "aiter sparse MLA")  # aiter passes only a row stride (and checks nothing)
        # aiter's kernel masks neither ids past the cache nor a falling kv_indptr on its unmasked gather
        _, has_skips = check_sparse_indices(kv_indptr, kv_indices, rows.shape[0])
        # aiter's kernel takes q's token and head strides only and reads its last axis unit-stride
        q = q_latent.contiguous() if q_rope is None else torch.cat([q_latent, q_rope], dim=-1)
        # lse always: aiter divides by the softmax sum unguarded, so a token with no valid row (all -1, or an empty
        # range) comes back NaN with lse -inf; the reference gives it a zero row
        kwargs = {"kv_lora_rank": q_latent.shape[-1], "qk_rope_head_dim": rope, "return_lse": True}
        if self.fn.sparse_has_invalid:
            kwargs["has_invalid"] = has_skips
        indptr, indices = kv_indptr.contiguous(), kv_indices.contiguous()  # aiter documents no strides for them
        out, lse = self.fn.sparse_mla_fwd(q, rows, indptr, indices, softmax_scale, **kwargs)
        out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0)
        return out, (lse if return_lse else None)
