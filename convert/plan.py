"""What ``convert`` would do to a checkpoint, computed from headers only (no tensor data is read).

One :class:`MlaJob` per MLA layer the checkpoint holds: the source kv_b_proj weight and its format, the
stored tensors it is decoded from, and the overlay tensors it produces:

* ``<prefix>.self_attn.w_kc.weight`` ``[H, kv_lora, K_stored/2]`` U8 + ``.weight_scale``
  ``[H, kv_lora, K_stored/32]`` U8 (mxfp4), or ``[H, kv_lora, K_stored]`` BF16 (bf16, no scale);
  layout ``bmm_nk`` with ``k_logical`` = nope and ``k_stored`` = nope padded to the K multiple.
* ``<prefix>.self_attn.w_vc.weight`` ``[H, v, kv_lora/2]`` + ``.weight_scale`` ``[H, v, kv_lora/32]``
  (or BF16 ``[H, v, kv_lora]``); ``bmm_nk`` with ``k_logical = k_stored = kv_lora``.

Precision ``auto`` is decided per projection from the measured error at conversion time; its plan lists
the MXFP4 tensors (the smaller outcome) and says ``auto``. ``files`` says how the original files are
reused: ``link`` (hard link, copy across filesystems), ``copy``, or ``none``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from glm_pack.packing import mxfp4
from glm_pack.packing.absorb import check_choices
from glm_pack.packing.errors import PlanError
from glm_pack.packing.layouts import bmm_nk_params, stored_k
from glm_pack.packing.manifest import k_up_block_sizes, projection_tensor_names

from .checkpoint import Checkpoint

FILE_MODES = ("link", "copy", "none")


def check_files_mode(files: str) -> None:
    """PlanError unless ``files`` (``--files``) is one of :data:`FILE_MODES`."""
    if files not in FILE_MODES:
        raise PlanError(f"--files must be one of {', '.join(FILE_MODES)}, got {files!r}")


@dataclass(frozen=True)
class OutputTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name
    nbytes: int
    layout: dict  # {"layout": "bmm_nk", "k_logical": ..., "k_stored": ...}


@dataclass(frozen=True)
class MlaJob:
    layer: int
    prefix: str
    source: str  # kv_b_proj module weight name
    source_format: str
    source_tensors: list[str]
    outputs: list[OutputTensor]

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass
class Plan:
    card: str
    geometry: dict
    quant_mode: str
    mla_precision: str
    k_multiple: int | None
    k_stored: int
    route: str  # kernel route (:func:`kernel_route`): "padded" (K_stored > nope) or "unpadded"
    kernel_configs: dict
    files_mode: str
    jobs: list[MlaJob]
    reused_files: list[tuple[str, int]] = field(default_factory=list)  # (relative name, bytes)
    # auto only: the overlay's bytes should every tensor stay BF16 (``overlay_bytes`` is the all-MXFP4 end)
    overlay_bytes_bf16: int | None = None

    @property
    def overlay_bytes(self) -> int:
        return sum(j.nbytes for j in self.jobs)

    @property
    def reused_bytes(self) -> int:
        return sum(size for _, size in self.reused_files)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reused_files"] = [{"name": n, "bytes": b} for n, b in self.reused_files]
        d["overlay_bytes"] = self.overlay_bytes
        d["reused_bytes"] = self.reused_bytes
        for job, obj in zip(d["jobs"], self.jobs, strict=True):
            job["nbytes"] = obj.nbytes
            for out in job["outputs"]:
                out["shape"] = list(out["shape"])
        return d


def parse_k_pad(k_pad) -> str | int | None:
    """``"card"`` as it is, ``"none"``/None -> None, else the positive multiple of 32 it names; PlanError otherwise."""
    if k_pad == "card":
        return k_pad
    if k_pad in ("none", None):
        return None
    try:
        value = int(k_pad)
    except (TypeError, ValueError):
        value = 0
    if value <= 0 or value % mxfp4.BLOCK:
        raise PlanError(f"--k-pad must be 'card', 'none' or a positive multiple of 32, got {k_pad!r}")
    return value


def resolve_k_multiple(k_pad, card_default: int | None) -> int | None:
    """``"card"`` -> the card's default, ``"none"``/None -> None, else a positive multiple of 32."""
    value = parse_k_pad(k_pad)
    return card_default if value == "card" else value


def kernel_route(k_stored: int, nope: int) -> str:
    """The card's kernel-config route for w_kc stored with K = ``k_stored``: ``padded`` or ``unpadded``."""
    return "padded" if k_stored != nope else "unpadded"


def resolve_k_up(card, geom, k_pad, mla_precision: str) -> tuple[int | None, int]:
    """(k_multiple, K stored) of w_kc for ``--k-pad k_pad``; PlanError when an MXFP4 w_kc's K is not a multiple
    of every BLOCK_SIZE_K of its route's pinned K-up configs (aiter's ragged-K path is wrong in many versions)."""
    nope = geom.qk_nope_head_dim
    k_multiple = resolve_k_multiple(k_pad, card.default_k_pad(geom))
    k_stored = stored_k(nope, k_multiple)
    if mla_precision != "bf16":
        configs = card.kernel_configs(kernel_route(k_stored, nope))
        blocks = k_up_block_sizes(configs)
        ragged = [b for b in blocks if k_stored % b]
        if ragged:
            fit = -(-nope // max(blocks)) * max(blocks)
            raise PlanError(
                f"--k-pad {k_pad} stores w_kc with K={k_stored}, which the pinned {'/'.join(sorted(configs))} K-up "
                f"configs (BLOCK_SIZE_K {ragged}) would split raggedly, and aiter's ragged-K path is wrong in many "
                f"versions; choose a --k-pad that makes K a multiple of {max(blocks)} (e.g. {fit}), or 'none'"
            )
    return k_multiple, k_stored


def _projection(
    prefix: str, name: str, heads: int, n: int, k_logical: int, k_stored: int, precision: str
) -> list[OutputTensor]:
    layout = bmm_nk_params(k_logical, k_stored)
    weight, scale = projection_tensor_names(prefix, name)
    if precision == "bf16":
        shape = (heads, n, k_stored)
        return [OutputTensor(weight, shape, "BF16", 2 * math.prod(shape), layout)]
    codes, scales = (heads, n, k_stored // 2), (heads, n, k_stored // mxfp4.BLOCK)
    return [
        OutputTensor(weight, codes, "U8", math.prod(codes), layout),
        OutputTensor(scale, scales, "U8", math.prod(scales), layout),
    ]


def layer_outputs(prefix: str, geom, k_kc: int, precision: str) -> list[OutputTensor]:
    """The overlay tensors of one MLA layer (w_kc then w_vc) stored as ``precision`` (``mxfp4`` or ``bf16``), w_kc
    with K = ``k_kc``."""
    heads, kv_lora = geom.num_heads, geom.kv_lora_rank
    return [
        *_projection(prefix, "w_kc", heads, kv_lora, geom.qk_nope_head_dim, k_kc, precision),
        *_projection(prefix, "w_vc", heads, geom.v_head_dim, kv_lora, kv_lora, precision),
    ]


def layers_to_convert(ckpt: Checkpoint) -> list[int]:
    """The MLA layer ids of ``ckpt``; PlanError when it holds none (there would be no w_kc / w_vc to write)."""
    layers = ckpt.mla_layers()
    if not layers:
        raise PlanError(
            f"the checkpoint holds no MLA layer (card {ckpt.card.name}): there is no w_kc / w_vc to write",
            file=ckpt.root,
        )
    return layers


def make_plan(
    ckpt: Checkpoint, *, quant_mode: str = "even", k_pad="card", mla_precision: str = "mxfp4", files: str = "link"
) -> Plan:
    """The conversion plan for ``ckpt`` (headers only); PlanError on bad options."""
    check_choices(quant_mode, mla_precision)
    check_files_mode(files)
    geom = ckpt.geometry
    k_multiple, k_kc = resolve_k_up(ckpt.card, geom, k_pad, mla_precision)
    route = kernel_route(k_kc, geom.qk_nope_head_dim)
    stored_precision = "mxfp4" if mla_precision == "auto" else mla_precision
    jobs = []
    for layer in layers_to_convert(ckpt):
        prefix = ckpt.card.layer_prefix(layer)
        source = ckpt.card.kv_b_proj(layer)
        outputs = layer_outputs(prefix, geom, k_kc, stored_precision)
        jobs.append(MlaJob(layer, prefix, source, ckpt.weight_format(source), ckpt.source_tensors(source), outputs))
    bf16_bytes = None
    if mla_precision == "auto":
        bf16_bytes = sum(o.nbytes for job in jobs for o in layer_outputs(job.prefix, geom, k_kc, "bf16"))
    reused = [] if files == "none" else ckpt.store.list_files()
    return Plan(
        card=ckpt.card.name,
        geometry=geom.as_dict(),
        quant_mode=quant_mode,
        mla_precision=mla_precision,
        k_multiple=k_multiple,
        k_stored=k_kc,
        route=route,
        kernel_configs=ckpt.card.kernel_configs(route),
        files_mode=files,
        jobs=jobs,
        reused_files=reused,
        overlay_bytes_bf16=bf16_bytes,
    )
