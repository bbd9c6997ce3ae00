"""What the vLLM and SGLang adapters share: select and find the overlay, check that it belongs to the
checkpoint being served (source fingerprint, geometry, this rank's TP slice), check that the installed aiter
computes an MXFP4 K-up correctly the way the engines call it (:func:`check_engine_kup`), and turn a loaded
projection into the float or MXFP4 tensors an engine keeps.

Selection: ``GLM_PACK_OVERLAY`` unset, empty or ``0`` = off (the engines rebuild as usual); ``1`` = the
overlay beside the served checkpoint (``<model dir>/glm-pack/manifest.json``; for a Hub id, the local HF
cache snapshot); any other value = the directory that holds ``glm-pack/``.
``GLM_PACK_OVERLAY_CHECK``: ``full`` (default) = config.json sha256 + sha256 of every source kv_b_proj
tensor in the served files + a per-layer comparison of the overlay with the engine's own loaded
kv_b_proj slice; ``fast`` = the same without hashing the tensor bytes.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from glm_pack.packing.errors import BackendError, GlmPackError, VerifyError
from glm_pack.packing.mla import MlaGeometry
from glm_pack.packing.mxfp4 import dequantize, dequantize_reference
from glm_pack.runtime.layer import MlaLayer, ProjectionWeights
from glm_pack.runtime.loader import PackedModel, check_source_tensors, file_sha256, open_packed, tensor_files

log = logging.getLogger("glm_pack.engines")
ENV = "GLM_PACK_OVERLAY"
ENV_CHECK = "GLM_PACK_OVERLAY_CHECK"
CHECKS = ("full", "fast")
_OFF = ("", "0", "false", "off", "no")
_BESIDE = ("1", "true", "on", "yes", "auto")
FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def overlay_setting(environ=None) -> str | None:
    """The overlay selection from the environment: None (off), ``"beside"`` or a directory path."""
    value = (environ if environ is not None else os.environ).get(ENV, "").strip()
    if value.lower() in _OFF:
        return None
    return "beside" if value.lower() in _BESIDE else value


def check_level(environ=None) -> str:
    level = (environ if environ is not None else os.environ).get(ENV_CHECK, "full").strip().lower() or "full"
    if level not in CHECKS:
        raise GlmPackError(f"{ENV_CHECK}={level!r} is not one of {', '.join(CHECKS)}")
    return level


def checkpoint_dir(model: str, revision: str | None = None) -> Path:
    """The local directory of the served checkpoint: ``model`` itself, or its HF cache snapshot (no network). Needed
    whatever ``GLM_PACK_OVERLAY`` selects: the overlay is checked against these files."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as err:
        raise GlmPackError(
            f"cannot find the checkpoint {model!r} locally for the glm-pack overlay ({err}); the overlay is checked "
            f"against the served files: download them into the HF cache (`hf download {model}`) or serve the "
            "checkpoint from its local directory"
        ) from err


def overlay_root(setting: str, served: Path) -> Path:
    return served if setting == "beside" else Path(setting)


def check_source(manifest: dict, served: Path, level: str) -> None:
    """Raise VerifyError unless the served checkpoint is the one the overlay was converted from."""
    source = manifest.get("source") or {}
    config = served / "config.json"
    if not config.is_file():
        raise VerifyError("the served checkpoint has no config.json to check the overlay against", file=config)
    if file_sha256(config) != source.get("config_sha256"):
        raise VerifyError(
            "config.json differs from the one the glm-pack overlay was converted from: the overlay belongs to "
            "another checkpoint (reconvert, or unset " + ENV + ")",
            file=config,
        )
    if level != "full":
        return
    kv_b = tuple(e["source"]["tensor"].rsplit(".", 1)[0] + "." for e in manifest["mla"])
    digests = {name: d for name, d in (source.get("tensors") or {}).items() if name.startswith(kv_b)}
    check_source_tensors(tensor_files(served), digests, f" (reconvert, or unset {ENV})")


@dataclass(frozen=True)
class Overlay:
    """One process's opened overlay: this rank's tensors plus the check level for per-layer checks."""

    model: PackedModel
    level: str

    def holds(self, layer_id: int) -> bool:
        """Whether the overlay has this MLA layer (else the engine rebuilds it itself)."""
        return layer_id in self.model.layers

    def layer(self, layer_id: int, engine_geometry: MlaGeometry) -> MlaLayer | None:
        """This rank's MLA layer, or None when the overlay has no such layer; the engine's per-rank geometry
        must equal the overlay's."""
        if not self.holds(layer_id):
            return None
        local = self.model.local_geometry
        if engine_geometry != local:
            raise VerifyError(
                f"layer {layer_id}: the engine's attention geometry per rank {engine_geometry.as_dict()} differs "
                f"from the overlay's {local.as_dict()} at tp_size={self.model.tp_size}",
                file=str(self.model.root),
            )
        return self.model.mla(layer_id)

    def apply(
        self, module, layer_id: int, engine_geometry: MlaGeometry, attributes, loaded_kv_b, *, engine_quantized=False
    ) -> bool:
        """Set the absorbed weights of one engine attention ``module`` to ``attributes(mla)`` after checking the
        engine's loaded kv_b_proj slice (``loaded_kv_b()``: float ``[out, in]``, or None where the engine holds
        it in a form the adapter cannot read, which skips the check with a warning) against the overlay
        (``engine_quantized``: the engine holds kv_b_proj quantized, see :func:`check_slice`); False when the
        overlay has no such layer (the engine then rebuilds it itself)."""
        mla = self.layer(layer_id, engine_geometry)
        if mla is None:
            return False
        weight = loaded_kv_b()
        if weight is None:
            log.warning("glm-pack: layer %d: kv_b_proj is in a form glm-pack cannot read; its slice is not checked",
                        layer_id)  # fmt: skip
        else:
            check_slice(mla, weight, "kv_b_proj", engine_quantized=engine_quantized)
        for name, value in attributes(mla).items():
            assign(module, name, value)
        return True


def assign(module, name: str, value) -> None:
    """Set ``module.name = value``; where it already holds a tensor of the same shape, strides, dtype and device (a
    reload: vLLM's ``reload_weights``, a wake from level-2 sleep), ``value`` is copied into it instead, as the engines'
    own rebuilds do (vLLM's ``replace_parameter``, SGLang's ``bind_or_assign``), so CUDA graphs captured on its
    memory stay valid."""
    old = getattr(module, name, None)
    same = (
        isinstance(value, torch.Tensor)
        and isinstance(old, torch.Tensor)
        and (old.shape, old.stride(), old.dtype, old.device) == (value.shape, value.stride(), value.dtype, value.device)
    )
    if not same:
        setattr(module, name, value)
    elif old.data_ptr() != value.data_ptr():
        with torch.no_grad():
            old.copy_(value)


_OPEN: dict[tuple, Overlay] = {}


def open_overlay(setting: str, served: Path, *, tp_rank: int, tp_size: int, device, level: str) -> Overlay:
    """Open (once per process and rank) the overlay selected by ``setting`` for the checkpoint ``served``."""
    root = overlay_root(setting, served)
    key = (str(root.resolve()), str(served.resolve()), tp_rank, tp_size, str(device), level)
    if key not in _OPEN:
        model = open_packed(root, device=device, backend="torch", tp_rank=tp_rank, tp_size=tp_size)
        check_source(model.manifest, served, level)
        _OPEN[key] = Overlay(model, level)
    return _OPEN[key]


def check_mxfp4_path(mla: MlaLayer, engine: str, fp4_path: bool, needs: str, *, transpose_bm: bool = False) -> None:
    """An MXFP4 overlay layer needs the engine's MXFP4 BMM path (``fp4_path``; ``needs`` says what the engine lacks
    without it), an unpadded w_kc (:func:`require_unpadded`) and an aiter that computes its K-up right
    (:func:`check_engine_kup`); BackendError otherwise."""
    if not fp4_path:
        raise BackendError(
            f"layer {mla.layer}: the overlay holds MXFP4 w_kc/w_vc but {engine} is not {needs}; convert with "
            "--mla-precision bf16 for this setup"
        )
    require_unpadded(mla.w_kc, engine, mla.layer)
    check_engine_kup(mla.w_kc, engine, mla.layer, transpose_bm=transpose_bm)


def require_unpadded(proj: ProjectionWeights, engine: str, layer_id: int) -> None:
    """The engines pass only the nope part of q to the K-up GEMM, so a K-padded w_kc would meet a q row
    narrower than its K (aiter does not check and returns garbage)."""
    if proj.k_stored != proj.k_logical:
        raise BackendError(
            f"layer {layer_id}: the overlay stores w_kc with K padded {proj.k_logical} -> {proj.k_stored}, but "
            f"{engine} passes only the {proj.k_logical}-wide q_nope to the K-up GEMM; reconvert with "
            "`glm-pack convert --k-pad none` for this engine"
        )


KUP_CHECK_TOKENS = (16, 300)  # one row count in aiter's small-M buckets, one in its "any" bucket
KUP_CHECK_TOLERANCE = 2.0**-6  # max |y - ref| / max |ref|: accumulation order stays far below, a lost K block far above
_KUP_CHECKED: dict[tuple, str] = {}  # (device, N, K, transpose_bm) -> "" (passed) or why it failed, once per process


def check_engine_kup(proj: ProjectionWeights, engine: str, layer_id: int, *, transpose_bm: bool = False) -> None:
    """The engines run MXFP4 K-up through aiter's A16WFP4 GEMM with its default config (``config=None``), whose
    256-deep K blocks split GLM's K = 192 raggedly, and aiter's ragged-K path is wrong in many versions
    (``notes/aiter-contract.md``). Run that call on this w_kc, once per process, shape and output layout, with
    random activations and compare it with the torch reference; BackendError when the installed aiter gets it
    wrong or the call raises (aiter v0.1.7's wrapper: NameError on its default split-K configs).
    ``transpose_bm``: the engine has the GEMM write ``[T, H, N]`` itself (vLLM: ``transpose_bm=True``) instead
    of ``[H, T, N]`` (SGLang); the kernel then stores through other output strides (its split-K reduce too), so
    that is the call checked."""
    from glm_pack.runtime.backends.aiter_backend import load_aiter

    w = proj.weight
    key = (str(w.device), w.shape[1], 2 * w.shape[2], transpose_bm)
    if key not in _KUP_CHECKED:
        _KUP_CHECKED[key] = _engine_kup_problem(load_aiter(), proj, engine, transpose_bm)
    if why := _KUP_CHECKED[key]:
        raise BackendError(
            f"layer {layer_id}: the installed aiter's A16WFP4 GEMM, called as {engine} calls it (default config), "
            f"{why}. Convert with --mla-precision bf16 for this engine, or update aiter"
        )


def _engine_kup_problem(fn, proj: ProjectionWeights, engine: str, transpose_bm: bool) -> str:
    """What is wrong with aiter's GEMM (``fn``: :class:`AiterFunctions`) called with its default config on
    ``proj``'s w_kc for :data:`KUP_CHECK_TOKENS` rows of random activations, writing ``[T, H, N]`` where
    ``transpose_bm`` (the old wheel, without that flag, through a transposed view): "" when it matches the
    torch reference within :data:`KUP_CHECK_TOLERANCE`."""
    from glm_pack.runtime.reference import bmm_a16wfp4

    w, scale = proj.weight, proj.scale
    k = 2 * w.shape[2]
    gen = torch.Generator(device=w.device).manual_seed(0)
    for tokens in KUP_CHECK_TOKENS:
        x = torch.randn(w.shape[0], tokens, k, generator=gen, device=w.device).to(torch.bfloat16)
        shape = (tokens, w.shape[0], w.shape[1]) if transpose_bm else (w.shape[0], tokens, w.shape[1])
        out = torch.empty(shape, dtype=torch.bfloat16, device=w.device)  # what the engine has the GEMM write
        y = out.transpose(0, 1) if transpose_bm else out  # [H, T, N]
        try:
            if fn.bmm_kind == "a16wfp4":
                fn.bmm(x, w, scale, dtype=torch.bfloat16, y=out, config=None, transpose_bm=transpose_bm, prequant=True)
            else:
                fn.bmm(x, w, scale, torch.bfloat16, y)
        except torch.OutOfMemoryError:  # says nothing about aiter's K-up: not cached as its failure
            raise
        except Exception as err:  # the engine's own calls raise the same
            return f"fails on K-up with K={k} ({type(err).__name__}: {err}), and so would {engine}'s own calls"
        ref = bmm_a16wfp4(x, w, scale).float()
        off = float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not off <= KUP_CHECK_TOLERANCE:  # True for NaN too
            return (
                f"gets K-up with K={k} wrong (max |y - ref| / max |ref| = {off:.3g}; aiter's ragged-K bug, or its "
                f"output stored through the wrong strides): {engine} would compute garbage from this MXFP4 overlay"
            )
    return ""


def as_float(proj: ProjectionWeights, dtype: torch.dtype, *, small: bool = False) -> torch.Tensor:
    """The projection's values ``[H, N, k_logical]`` in ``dtype`` (MXFP4 dequantized exactly), contiguous.
    ``small``: use the plain torch decoder (no per-call kernel launch cost; for a few rows)."""
    if proj.precision == "mxfp4":
        decode = dequantize_reference if small else functools.partial(dequantize, axis=-1)
        values = decode(proj.weight, proj.scale)
    else:
        values = proj.weight
    return values[..., : proj.k_logical].to(dtype).contiguous()


ENGINE_QUANT_ALLOWANCE = 0.25  # on top, where the engine holds kv_b_proj quantized (FP8 ~0.04, MXFP4 ~0.12)


def check_slice(
    mla: MlaLayer, kv_b_local: torch.Tensor, what: str, *, rows: int = 4, engine_quantized: bool = False
) -> None:
    """Compare the overlay's layer with the engine's loaded kv_b_proj slice ``[H_local*(nope+v), kv_lora]``.

    Catches a wrong checkpoint, layer numbering or TP slice: on about ``rows`` evenly spaced output rows of
    each projection (every head, all of K) the relative error must stay near the one the converter recorded
    (a mismatch gives about 1.4). ``engine_quantized``: the engine holds kv_b_proj quantized, possibly by
    itself at load from a float checkpoint (vLLM's and SGLang's online FP8), so its float view carries rounding
    the overlay's source did not: :data:`ENGINE_QUANT_ALLOWANCE` more is allowed.
    """
    g = mla.geometry
    per_head = kv_b_local.reshape(g.num_heads, g.qk_nope_head_dim + g.v_head_dim, g.kv_lora_rank)  # any strides
    kc_step, vc_step = max(1, g.kv_lora_rank // rows), max(1, g.v_head_dim // rows)
    refs = {
        "w_kc": per_head[:, : g.qk_nope_head_dim, ::kc_step].transpose(1, 2),  # [H, L/step, P]
        "w_vc": per_head[:, g.qk_nope_head_dim :: vc_step],  # [H, V/step, L]
    }
    for name, proj, step in (("w_kc", mla.w_kc, kc_step), ("w_vc", mla.w_vc, vc_step)):
        scale = None if proj.scale is None else proj.scale[:, ::step]
        sample = ProjectionWeights(
            proj.precision, proj.weight[:, ::step], scale, proj.k_logical, proj.k_stored, proj.rel_error
        )
        ref = refs[name].float()
        err = float((as_float(sample, torch.float32, small=True) - ref).norm() / ref.norm().clamp_min(1e-30))
        bound = 1.5 * proj.rel_error + 0.02 + (ENGINE_QUANT_ALLOWANCE if engine_quantized else 0.0)
        if not err <= bound:
            raise VerifyError(
                f"layer {mla.layer} {name}: the overlay differs from the engine's loaded {what} on this rank "
                f"(relative error {err:.3g} > {bound:.3g}): wrong checkpoint, layer or tensor-parallel slice"
            )
