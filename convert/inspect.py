"""``glm-pack inspect SRC [--json]``: family, geometry, per-layer source formats, the conversion plan, sizes.

Reads config.json, the index and the shard headers only (no tensor data): seconds on a full-size checkpoint.
SRC may be a Hub repo id ``org/name[@revision]``; its shard headers are then read by HTTP range requests.

JSON output (``--json``; schema ``glm-pack.inspect/1``, keys are stable; sizes in bytes):

``schema``         ``"glm-pack.inspect/1"``
``source``         the checkpoint directory, or ``hf://org/name@<commit sha>`` for a Hub repo
``hub``            ``null`` (local source) or ``{"repo_id", "revision", "bytes_transferred"}``: the resolved
                   commit sha and the payload bytes fetched from the Hub (config, index, shard headers by range)
``card``           ``{"name", "title"}`` of the detected model family
``architectures``  config.json's ``architectures``; ``model_type`` its ``model_type``
``geometry``       ``{"num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}``
``layers``         ``{"num_hidden_layers", "mtp", "mla", "dense", "moe", "indexer"}`` (lists of layer ids per
                   config.json; ``mla`` lists those the checkpoint holds)
``quantization``   ``null`` or ``{"quant_method", "exclude"}`` from ``quantization_config``
``files``          ``[{"name", "bytes", "tensors"}]`` for each shard, in index order
``num_tensors``    tensors in the index; ``total_bytes``: sum of the shard sizes
``formats``        ``{format: count}`` of the Linear weights the card knows (formats: bf16, fp16, fp32,
                   fp8-block, fp8-channel, mxfp4)
``mla``            ``[{"layer", "tensor", "format", "dtype", "shape", "files"}]``: each kv_b_proj, its stored
                   dtype/shape and the shard(s) holding it and its scale
``experts``        ``[{"layer", "count", "formats"}]``: routed experts found per MoE layer and their formats
``missing_tensors`` ``{"count", "first"}``: tensors config.json implies that the checkpoint lacks (an MTP layer
                   left out altogether aside), and the first 10 of their names in the card's order
``plan``           what ``convert`` would produce with the given options: ``card``, ``geometry``,
                   ``quant_mode``, ``mla_precision``, ``k_multiple``, ``k_stored``, ``route``,
                   ``kernel_configs`` ({arch: {op: {bucket: config}}}), ``files_mode``, ``jobs`` (per MLA layer:
                   ``layer``, ``prefix``, ``source``, ``source_format``, ``source_tensors``, ``outputs``
                   [{``name``, ``shape``, ``dtype``, ``nbytes``, ``layout``}], ``nbytes``), ``reused_files``
                   [{``name``, ``bytes``}], ``overlay_bytes`` (with ``auto``: every tensor MXFP4),
                   ``overlay_bytes_bf16`` (``auto`` only: every tensor BF16; null otherwise), ``reused_bytes``,
                   ``repack_experts`` (the option), ``expert_files`` [{``name``, ``layer``, ``tensors``, ``bytes``}]
                   (the files ``--repack-experts aiter-a4w4`` adds, bytes of their tensors; empty with ``none``),
                   ``expert_bytes``
"""

from __future__ import annotations

import json
import re
from collections import Counter

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .checkpoint import Checkpoint, open_checkpoint
from .commands import console, plan_option
from .convert import files_mode, is_hub
from .humanize import counted, plural, size_text
from .items import EXPERT_FILE_BYTES, expert_file_bytes, expert_groups, plan_items, tensor_count
from .modelcard import compact_ranges
from .plan import make_plan

SCHEMA = "glm-pack.inspect/1"


def inspect_checkpoint(
    src,
    *,
    k_pad="card",
    mla_precision: str = "mxfp4",
    files: str | None = None,
    quant_mode: str = "even",
    repack_experts: str = "none",
) -> dict:
    """The inspect report of ``src`` as a JSON-ready dict (keys documented in the module docstring).

    ``files`` None: convert's default for the source (link for a local directory, none for a Hub repo). The plan
    covers the MLA overlay, the expert files ``repack_experts`` adds and the reused files.
    """
    files = files_mode(src, files)
    ckpt = open_checkpoint(src)
    card, plan = ckpt.card, ckpt.layer_plan
    counts = Counter(
        ckpt.weight_format(name) for name, t, _ in card.iter_tensors(ckpt.config) if t.is_linear and name in ckpt
    )
    qc = ckpt.quant_config
    missing = ckpt.missing_tensors()
    return {
        "schema": SCHEMA,
        "source": f"hf://{ckpt.root}" if is_hub(ckpt) else str(ckpt.root),
        "card": {"name": card.name, "title": card.title},
        "architectures": ckpt.config.get("architectures", []),
        "model_type": ckpt.config.get("model_type"),
        "geometry": ckpt.geometry.as_dict(),
        "layers": {
            "num_hidden_layers": plan.num_layers,
            "mtp": list(plan.mtp),
            "mla": ckpt.mla_layers(),
            "dense": list(plan.dense),
            "moe": list(plan.moe),
            "indexer": list(plan.indexer),
        },
        "quantization": None if qc is None else {"quant_method": qc.get("quant_method"), "exclude": qc.get("exclude")},
        "files": [
            {"name": rel, "bytes": ckpt.file_size(rel), "tensors": len(ckpt.headers[rel].tensors)} for rel in ckpt.files
        ],
        "num_tensors": len(ckpt.weight_map),
        "total_bytes": sum(ckpt.file_size(rel) for rel in ckpt.files),
        "formats": dict(sorted(counts.items())),
        "mla": [_mla_entry(ckpt, layer) for layer in ckpt.mla_layers()],
        "experts": _experts(ckpt),
        "missing_tensors": {"count": len(missing), "first": missing[:10]},
        "plan": {
            **make_plan(ckpt, quant_mode=quant_mode, k_pad=k_pad, mla_precision=mla_precision, files=files).to_dict(),
            **_expert_plan(ckpt, repack_experts),
        },
        "hub": _hub(ckpt),
    }


def _expert_plan(ckpt: Checkpoint, repack_experts: str) -> dict:
    """The expert overlay files ``--repack-experts`` would add (PlanError where convert would refuse it)."""
    files = [
        {"name": i.file, "layer": i.layer, "tensors": tensor_count(i), "bytes": expert_file_bytes(ckpt, i)}
        for i in plan_items(ckpt, repack_experts)
        if i.kind == "experts"
    ]
    return {"repack_experts": repack_experts, "expert_files": files, "expert_bytes": sum(f["bytes"] for f in files)}


def _hub(ckpt: Checkpoint) -> dict | None:
    if not is_hub(ckpt):
        return None
    store = ckpt.store
    return {"repo_id": store.repo_id, "revision": store.sha, "bytes_transferred": store.transferred}


def _mla_entry(ckpt: Checkpoint, layer: int) -> dict:
    name = ckpt.card.kv_b_proj(layer)
    info = ckpt.info(name)
    return {
        "layer": layer,
        "tensor": name,
        "format": ckpt.weight_format(name),
        "dtype": info.dtype,
        "shape": list(info.shape),
        "files": list(dict.fromkeys(ckpt.info(t).file for t in ckpt.source_tensors(name))),
    }


def _experts(ckpt: Checkpoint) -> list[dict]:
    """Per MoE layer (the routed-expert weights ``--repack-experts`` would see): experts found, weight formats."""
    return [
        {
            "layer": layer,
            "count": len({int(ckpt.card.expert_pattern.match(name)["expert"]) for name in names}),
            "formats": dict(sorted(Counter(ckpt.weight_format(name) for name in names).items())),
        }
        for layer, names in sorted(expert_groups(ckpt).items())
    ]


def _ranges(ids: list[int]) -> str:
    return compact_ranges(ids) or "-"


def _mtp(ids: list[int]) -> str:
    """The MTP layers by id: 'MTP layer 2', 'MTP layers 78-79' or 'no MTP'."""
    return f"MTP {plural('layer', len(ids))} {_ranges(ids)}" if ids else "no MTP"


def _shape(shape) -> str:
    return "x".join(map(str, shape))


def _shard(name: str) -> str:
    m = re.fullmatch(r"model-(\d+)-of-\d+\.safetensors", name)
    return str(int(m[1])) if m else name


def render(report: dict, console: Console) -> None:
    """The human view of an inspect report."""
    g, layers, plan = report["geometry"], report["layers"], report["plan"]
    console.print(f"[bold]{escape(report['source'])}[/]: {report['card']['title']} (card {report['card']['name']})")
    console.print(
        f"geometry: {g['num_heads']} heads, kv_lora {g['kv_lora_rank']}, nope {g['qk_nope_head_dim']}, "
        f"rope {g['qk_rope_head_dim']}, v {g['v_head_dim']}"
    )
    console.print(
        f"layers: {layers['num_hidden_layers']} decoder, {_mtp(layers['mtp'])}; MLA {_ranges(layers['mla'])}; "
        f"dense {_ranges(layers['dense'])}; indexer {_ranges(layers['indexer'])}"
    )
    fmts = ", ".join(f"{k} {v}" for k, v in report["formats"].items())
    console.print(
        f"{counted(len(report['files']), 'file')}, {counted(report['num_tensors'], 'tensor')}, "
        f"{size_text(report['total_bytes'])}; {fmts}"
    )
    if missing := report["missing_tensors"]["count"]:
        console.print(
            f"[yellow]config.json implies {counted(missing, 'tensor')} the checkpoint lacks, first "
            f"{escape(report['missing_tensors']['first'][0])}: an engine builds the model from config.json and "
            "will not load these weights as they are[/]"
        )
    table = Table(title="MLA layers (kv_b_proj -> w_kc / w_vc)")
    for col in ("layer", "source", "stored", "shard", "w_kc", "w_vc", "overlay"):
        table.add_column(col)
    jobs = {job["layer"]: job for job in plan["jobs"]}
    for entry in report["mla"]:
        outs = {o["name"].rsplit(".self_attn.", 1)[1]: o for o in jobs[entry["layer"]]["outputs"]}
        kc, vc = outs["w_kc.weight"], outs["w_vc.weight"]
        table.add_row(
            str(entry["layer"]),
            entry["format"],
            f"{entry['dtype']} {_shape(entry['shape'])}",
            ",".join(map(_shard, entry["files"])),
            f"{kc['dtype']} {_shape(kc['shape'])}",
            f"{vc['dtype']} {_shape(vc['shape'])}",
            size_text(jobs[entry["layer"]]["nbytes"]),
        )
    console.print(table)
    if report["experts"]:
        groups: dict[tuple, list[int]] = {}
        for e in report["experts"]:
            groups.setdefault((e["count"], tuple(e["formats"].items())), []).append(e["layer"])
        experts = Table(title="routed experts")
        for col in ("layers", "experts", "weight formats"):
            experts.add_column(col)
        for (count, fmts), ids in groups.items():
            experts.add_row(_ranges(ids), str(count), ", ".join(f"{k} {v}" for k, v in fmts))
        console.print(experts)
    console.print(
        f"plan: route {plan['route']} (K {g['qk_nope_head_dim']} -> {plan['k_stored']}), "
        f"{plan['mla_precision']} w_kc/w_vc, quant mode {plan['quant_mode']}; overlay {_overlay_size(plan)} "
        f"in {counted(len(plan['jobs']), 'layer')}; originals reused ({plan['files_mode']}): "
        f"{counted(len(plan['reused_files']), 'file')}, "
        f"{size_text(plan['reused_bytes'])}"
    )
    if plan["expert_files"]:
        layers = sorted({f["layer"] for f in plan["expert_files"]})
        console.print(
            f"experts repacked ({plan['repack_experts']}): {size_text(plan['expert_bytes'])} in "
            f"{counted(len(plan['expert_files']), 'file')} of at most {EXPERT_FILE_BYTES / 1e9:g} GB, "
            f"MoE {plural('layer', len(layers))} "
            f"{_ranges(layers)}"
        )
    if report.get("hub"):
        console.print(f"read {report['hub']['bytes_transferred']:,} bytes from the Hub (config, index, shard headers)")


def _overlay_size(plan: dict) -> str:
    if plan["overlay_bytes_bf16"] is None:
        return size_text(plan["overlay_bytes"])
    return (
        f"{size_text(plan['overlay_bytes'])} (every tensor MXFP4) to {size_text(plan['overlay_bytes_bf16'])} "
        "(every tensor BF16; auto decides per tensor from its MXFP4 error at convert time)"
    )


@click.command("inspect")
@click.argument("src")
@click.option("--json", "as_json", is_flag=True, help="Print the stable JSON report (schema glm-pack.inspect/1).")
@plan_option("--k-pad", "As for convert: 'card', 'none' or N, a multiple of 32.")
@plan_option(
    "--mla-precision",
    "As for convert; with auto the overlay size is a range (every tensor MXFP4 to every tensor BF16).",
)
@plan_option("--quant-mode", "As for convert.")
@plan_option("--files", "As for convert (default: link; none for a Hub SRC).")
@plan_option("--repack-experts", "As for convert: aiter-a4w4 adds the repacked expert files to the plan.")
def inspect_command(src, as_json, k_pad, mla_precision, quant_mode, files, repack_experts):
    """Show a checkpoint's family, geometry, per-layer source formats and the plan convert would carry out.

    SRC is a checkpoint directory or a Hub repo id org/name[@revision] (headers read by HTTP range requests).
    Reads headers only. Example: glm-pack inspect ./GLM-5-FP8 --json > plan.json
    """
    report = inspect_checkpoint(
        src, k_pad=k_pad, mla_precision=mla_precision, files=files, quant_mode=quant_mode, repack_experts=repack_experts
    )
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render(report, console)
