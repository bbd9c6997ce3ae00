"""Work items of a conversion and how one is carried out (in the main process or a worker).

One item = one output file: an MLA layer's w_kc/w_vc (``layer-NNN.safetensors``), or a group of one layer's
routed experts repacked for aiter (``experts-NNN-PP.safetensors``, at most :data:`EXPERT_FILE_BYTES`, tensors
made one at a time while the file is written). An item's result is a plain dict (picklable, JSON-able): it
goes to the journal and, in item order, into the manifest, so the output is byte-identical whatever the
number of workers.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from glm_pack.packing import experts
from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import absorb_layer
from glm_pack.packing.errors import GlmPackError, PlanError
from glm_pack.packing.mla import split_kv_b_mxfp4_vc

from .checkpoint import Checkpoint, open_checkpoint
from .machine import use_threads
from .plan import layer_outputs, layers_to_convert
from .writer import LazyTensor, dtype_name, write_safetensors

OVERLAY_METADATA = {"format": "pt", "producer": "glm-pack"}
EXPERT_FILE_BYTES = 5 * 10**9  # the bound; the Hub recommends <= 20 GB per file
REPACK_MODES = ("none", "aiter-a4w4")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class WorkItem:
    kind: str  # "mla" or "experts"
    layer: int
    file: str  # overlay file name inside glm-pack/
    weights: tuple[str, ...] = ()  # experts: the source weight names this file repacks


@dataclass(frozen=True)
class Settings:
    """Everything an item needs besides the checkpoint (picklable for worker processes)."""

    k_kc: int  # stored K of w_kc (nope, or padded)
    quant_mode: str
    policy: str
    max_rel_error: float | None


def expert_groups(ckpt: Checkpoint) -> dict[int, list[str]]:
    """{layer: routed-expert weight names in checkpoint order}."""
    groups: dict[int, list[str]] = {}
    for name in ckpt.names():
        m = ckpt.card.expert_pattern.match(name)
        if m and name.endswith(".weight"):
            groups.setdefault(int(m["layer"]), []).append(name)
    return groups


def _check_expert_set(ckpt: Checkpoint, layer: int, mxfp4_names: list[str]) -> None:
    """PlanError unless ``mxfp4_names`` (a layer's MXFP4 routed-expert weights) is every routed-expert weight
    config.json gives that layer, none missing, none in another format, none beyond ``n_routed_experts``: aiter's
    fused MoE reads a layer's experts as one set, and an incomplete overlay would verify against its source."""
    n = ckpt.card.routed_experts(ckpt.config)
    expected = ckpt.card.expert_weights(layer, n)
    known = set(expected)
    extra = [name for name in mxfp4_names if name not in known]
    if extra:
        raise PlanError(
            f"--repack-experts: layer {layer} has a routed-expert weight beyond config.json's n_routed_experts {n}",
            file=ckpt.map_file,
            tensor=extra[0],
        )
    missing = [name for name in expected if name not in ckpt]
    if missing:
        raise PlanError(
            f"--repack-experts: layer {layer} lacks {len(missing)} of its {len(expected)} routed-expert weights "
            f"(config.json: n_routed_experts {n}); aiter's fused MoE reads every expert of a layer",
            file=ckpt.map_file,
            tensor=missing[0],
        )
    mxfp4 = set(mxfp4_names)
    other = [name for name in expected if name not in mxfp4]
    if other:
        raise PlanError(
            f"--repack-experts: layer {layer} mixes MXFP4 and {ckpt.weight_format(other[0])} routed-expert weights; "
            "aiter's fused MoE reads a layer's experts in one format",
            file=ckpt.map_file,
            tensor=other[0],
        )


def plan_items(ckpt: Checkpoint, repack_experts: str = "none", file_bytes: int = EXPERT_FILE_BYTES) -> list[WorkItem]:
    """MLA items (one per MLA layer), then expert items (per layer, split to stay under ``file_bytes``); PlanError
    when the checkpoint holds no MLA layer."""
    if repack_experts not in REPACK_MODES:
        raise PlanError(f"--repack-experts must be one of {', '.join(REPACK_MODES)}, got {repack_experts!r}")
    items = [WorkItem("mla", layer, f"layer-{layer:03d}.safetensors") for layer in layers_to_convert(ckpt)]
    if repack_experts == "none":
        return items
    # Only MXFP4 experts are repacked; others (e.g. an MTP layer left in BF16 by Quark's exclude list) stay as
    # they are in the original files.
    every = expert_groups(ckpt)
    groups = {layer: [n for n in names if ckpt.weight_format(n) == "mxfp4"] for layer, names in every.items()}
    groups = {layer: names for layer, names in groups.items() if names}
    if not groups:
        formats = sorted({ckpt.weight_format(n) for names in every.values() for n in names})
        found = (
            f": the routed experts it has (layer(s) {', '.join(map(str, sorted(every)))}) are {'/'.join(formats)}"
            if every
            else ": it has no routed experts"
        )
        raise PlanError(
            f"--repack-experts aiter-a4w4: the checkpoint has no MXFP4 routed-expert weights{found}", file=ckpt.root
        )
    for layer, names in sorted(groups.items()):
        _check_expert_set(ckpt, layer, names)
        part: list[str] = []
        size = 0
        for name in names:
            nbytes = sum(ckpt.info(t).nbytes for t in ckpt.source_tensors(name))
            if part and size + nbytes > file_bytes:
                items.append(WorkItem("experts", layer, "", tuple(part)))
                part, size = [], 0
            part.append(name)
            size += nbytes
        items.append(WorkItem("experts", layer, "", tuple(part)))
    counts: dict[int, int] = {}
    named = []
    for item in items:
        if item.kind == "experts":
            counts[item.layer] = counts.get(item.layer, 0) + 1
            item = WorkItem(
                "experts", item.layer, f"experts-{item.layer:03d}-{counts[item.layer]:02d}.safetensors", item.weights
            )
        named.append(item)
    return named


def expert_file_bytes(ckpt: Checkpoint, item: WorkItem) -> int:
    """Tensor bytes of an experts item's overlay file (its header aside): U8 codes and scales of the source's shapes."""
    return sum(math.prod(ckpt.info(name).shape) for w in item.weights for name in (w, w + "_scale"))


def tensor_count(item: WorkItem) -> int:
    """Tensors ``item``'s overlay file holds at most: an expert weight's codes and scales, an MLA layer's w_kc / w_vc
    and (MXFP4) their scales."""
    return 2 * len(item.weights) if item.kind == "experts" else 4


def payload_bytes(ckpt: Checkpoint, item: WorkItem, settings: Settings) -> int:
    """Tensor bytes ``item``'s overlay file will hold (its header aside): an MLA layer's w_kc / w_vc (with policy
    ``auto``, the most they take: all BF16), or :func:`expert_file_bytes`."""
    if item.kind == "experts":
        return expert_file_bytes(ckpt, item)
    precision = "mxfp4" if settings.policy == "mxfp4" else "bf16"
    outputs = layer_outputs(ckpt.card.layer_prefix(item.layer), ckpt.geometry, settings.k_kc, precision)
    return sum(o.nbytes for o in outputs)


def _locate(err: GlmPackError, ckpt: Checkpoint, name: str) -> GlmPackError:
    if err.tensor is None:
        err.tensor = name
    if err.file is None:
        err.file = str(ckpt.root / ckpt.info(name).file)
    return err


def is_entry_of(entry, item: WorkItem) -> bool:
    """Whether a journal line (parsed JSON) is an entry :func:`write_item` returned for ``item``: its item, its file,
    and every key with the type the manifest needs (a line edited by hand may be none of these)."""
    return (
        isinstance(entry, dict)
        and entry.get("item") == json.loads(json.dumps(asdict(item)))  # as the journal holds it: lists for tuples
        and entry.get("file") == item.file
        and type(entry.get("size")) is int
        and isinstance(entry.get("sha256"), str)
        and isinstance(entry.get("tensors"), dict)
        and isinstance(entry.get("source_tensors"), dict)
        and isinstance(entry.get("mla" if item.kind == "mla" else "experts"), dict)
    )


def write_item(overlay: Path, item: WorkItem, tensors: dict, layouts: dict, source: dict, **fragment) -> dict:
    """Write an item's overlay file; return its journal entry (file hash and size, per-tensor table entries with
    their sha256 and layout, the source tensors' sha256, and the manifest ``fragment``)."""
    path = overlay / item.file
    digest, shas = write_safetensors(path, tensors, OVERLAY_METADATA)
    table = {}
    for name, t in tensors.items():
        table[name] = {"file": item.file, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": shas[name]}
        if name in layouts:
            table[name]["layout"] = layouts[name]
    return {
        "item": asdict(item),
        "file": item.file,
        "size": path.stat().st_size,
        "sha256": digest,
        "tensors": table,
        "source_tensors": source,
        **fragment,
    }


def run_mla_item(ckpt: Checkpoint, item: WorkItem, settings: Settings, overlay: Path) -> dict:
    """Absorb one layer, write its overlay file crash-safely, return the journal entry."""
    card, geom = ckpt.card, ckpt.geometry
    prefix = card.layer_prefix(item.layer)
    kv_b_name = card.kv_b_proj(item.layer)
    fmt = ckpt.weight_format(kv_b_name)
    source: dict[str, str] = {}  # sha256 of the stored tensors read, for the manifest's source fingerprint
    try:
        kv_b, kv_b_mxfp4 = ckpt.read_float_and_mxfp4(kv_b_name, digests=source)
        kc, vc = absorb_layer(
            kv_b,
            geom,
            k_stored=settings.k_kc,
            quant_mode=settings.quant_mode,
            policy=settings.policy,
            max_rel_error=settings.max_rel_error,
            vc_mxfp4_source=split_kv_b_mxfp4_vc(*kv_b_mxfp4, geom) if kv_b_mxfp4 else None,
        )
    except GlmPackError as err:
        raise _locate(err, ckpt, kv_b_name) from None
    tensors, entry = {}, {"layer": item.layer, "prefix": prefix, "source": {"tensor": kv_b_name, "format": fmt}}
    for proj_name, stored in (("w_kc", kc), ("w_vc", vc)):
        weight, scale = mf.projection_tensor_names(prefix, proj_name)
        scale = scale if stored.scale is not None else None
        tensors[weight] = stored.weight
        if scale:
            tensors[scale] = stored.scale
        entry[proj_name] = mf.projection_entry(stored, weight, scale)
    return write_item(overlay, item, tensors, {}, source, mla=entry)


def _repack(ckpt: Checkpoint, weight: str, digests: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return experts.repack_expert(*ckpt.read_mxfp4(weight, digests=digests), name=weight)
    except GlmPackError as err:
        raise _locate(err, ckpt, weight) from None


def run_experts_item(ckpt: Checkpoint, item: WorkItem, overlay: Path) -> dict:
    """Repack one group of expert weights into aiter's a4w4 layout, streaming tensor by tensor: each source tensor
    is read once, and its sha256 (for the manifest) comes from the bytes repacked."""
    tensors: dict[str, LazyTensor] = {}
    layouts: dict[str, dict] = {}
    source: dict[str, str] = {}  # sha256 of the source tensors, filled while the file is written
    for weight in item.weights:
        scale_name = weight + "_scale"
        if ckpt.source_tensors(weight) != [weight, scale_name]:
            raise PlanError(
                "expert weight is not a weight + weight_scale MXFP4 pair",
                file=str(ckpt.root / ckpt.info(weight).file),
                tensor=weight,
            )
        memo: dict[str, torch.Tensor] = {}

        def make_codes(weight=weight, memo=memo):
            codes, memo["scales"] = _repack(ckpt, weight, source)
            return codes

        def make_scales(weight=weight, memo=memo):
            return memo.pop("scales") if "scales" in memo else _repack(ckpt, weight, source)[1]

        for name, kind, make in ((weight, "weight", make_codes), (scale_name, "weight_scale", make_scales)):
            info = ckpt.info(name)
            tensors[name] = LazyTensor(torch.uint8, info.shape, make)
            layouts[name] = experts.tensor_layout(kind, info.shape)
    return write_item(
        overlay,
        item,
        tensors,
        layouts,
        source,
        experts={"layer": item.layer, "file": item.file, "tensors": list(tensors)},
    )


def run_item(ckpt: Checkpoint, item: WorkItem, settings: Settings, overlay: Path) -> dict:
    if item.kind == "experts":
        return run_experts_item(ckpt, item, overlay)
    return run_mla_item(ckpt, item, settings, overlay)


_WORKER_CKPT: dict[str, Checkpoint] = {}


def worker_init(threads: int, parent: int) -> None:
    """Give each worker process its share of the cores (torch and numba), and tie its life to the converting
    process ``parent`` (pid): a worker must never go on writing into an OUT whose run was killed."""
    _die_with(parent)
    use_threads(threads)


def _die_with(parent: int) -> None:
    """On Linux the kernel kills this process when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``); a parent
    already gone by then is caught by its pid. Elsewhere nothing is set."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:
        os._exit(1)


def run_item_in_worker(src: str, item: WorkItem, settings: Settings, overlay: str) -> dict:
    """Entry point in a worker process: the checkpoint is opened once per process."""
    if src not in _WORKER_CKPT:
        _WORKER_CKPT[src] = open_checkpoint(src)
    return run_item(_WORKER_CKPT[src], item, settings, Path(overlay))
