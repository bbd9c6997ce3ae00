"""Work items of a conversion and how one is carried out (in the main process or a worker).

One item = one output file: an MLA layer's w_kc/w_vc (``layer-NNN.safetensors``). An item's result is a
plain dict (picklable, JSON-able): it goes to the journal and, in item order, into the manifest, so the
output is byte-identical whatever the number of workers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import absorb_layer
from glm_pack.packing.errors import GlmPackError
from glm_pack.packing.mla import split_kv_b_mxfp4_vc

from .checkpoint import Checkpoint, open_checkpoint
from .writer import dtype_name, sha256_tensor, write_safetensors

OVERLAY_METADATA = {"format": "pt", "producer": "glm-pack"}


@dataclass(frozen=True)
class WorkItem:
    kind: str  # "mla"
    layer: int
    file: str  # overlay file name inside glm-pack/

    @property
    def key(self) -> str:
        return self.file


@dataclass(frozen=True)
class Settings:
    """Everything an item needs besides the checkpoint (picklable for worker processes)."""

    k_kc: int  # stored K of w_kc (nope, or padded)
    quant_mode: str
    policy: str
    max_rel_error: float | None


def plan_items(ckpt: Checkpoint) -> list[WorkItem]:
    return [WorkItem("mla", layer, f"layer-{layer:03d}.safetensors") for layer in ckpt.card.mla_layers(ckpt.config)]


def _locate(err: GlmPackError, ckpt: Checkpoint, name: str) -> GlmPackError:
    if err.tensor is None:
        err.tensor = name
    if err.file is None:
        err.file = str(ckpt.root / ckpt.info(name).file)
    return err


def run_mla_item(ckpt: Checkpoint, item: WorkItem, settings: Settings, overlay: Path) -> dict:
    """Absorb one layer, write its overlay file crash-safely, return the journal entry."""
    card, geom = ckpt.card, ckpt.geometry
    prefix = card.layer_prefix(item.layer)
    kv_b_name = card.kv_b_proj(item.layer)
    fmt = ckpt.weight_format(kv_b_name)
    try:
        vc_source = split_kv_b_mxfp4_vc(*ckpt.read_mxfp4(kv_b_name), geom) if fmt == "mxfp4" else None
        kc, vc = absorb_layer(
            ckpt.read_float(kv_b_name),
            geom,
            k_stored=settings.k_kc,
            quant_mode=settings.quant_mode,
            policy=settings.policy,
            max_rel_error=settings.max_rel_error,
            vc_mxfp4_source=vc_source,
        )
    except GlmPackError as err:
        raise _locate(err, ckpt, kv_b_name) from None
    tensors, entry = {}, {"layer": item.layer, "prefix": prefix, "source": {"tensor": kv_b_name, "format": fmt}}
    for proj_name, stored in (("w_kc", kc), ("w_vc", vc)):
        weight = f"{prefix}.self_attn.{proj_name}.weight"
        scale = f"{prefix}.self_attn.{proj_name}.weight_scale" if stored.scale is not None else None
        tensors[weight] = stored.weight
        if scale:
            tensors[scale] = stored.scale
        entry[proj_name] = mf.projection_entry(stored, weight, scale)
    path = overlay / item.file
    digest = write_safetensors(path, tensors, OVERLAY_METADATA)
    return {
        "item": asdict(item),
        "file": item.file,
        "size": path.stat().st_size,
        "sha256": digest,
        "tensors": {
            name: {"file": item.file, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": sha256_tensor(t)}
            for name, t in tensors.items()
        },
        "source_tensors": {name: ckpt.raw_sha256(name) for name in ckpt.source_tensors(kv_b_name)},
        "mla": entry,
    }


_WORKER_CKPT: dict[str, Checkpoint] = {}


def worker_init(threads: int) -> None:
    """Give each worker process its share of the cores (torch and numba)."""
    import torch

    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass


def run_item_in_worker(src: str, item: WorkItem, settings: Settings, overlay: str) -> dict:
    """Entry point in a worker process: the checkpoint is opened once per process."""
    if src not in _WORKER_CKPT:
        _WORKER_CKPT[src] = open_checkpoint(src)
    return run_mla_item(_WORKER_CKPT[src], item, settings, Path(overlay))
