"""Synthetic checkpoints: a family's real tensor names, dtypes, config.json and sharded index, random weights.

Everything comes from the card: the config (``[synth.config]``, ``--profile small`` applies
``[synth.small]``: MLA geometry stays true, hidden/vocab/intermediate sizes and q_lora shrink), the tensor
list with shapes (``[[tensors]]``), per-layer config lists (``[synth.per_layer]``) and documented
assumptions (``[synth.assumptions]``). Source formats (``FORMATS``):

``bf16``         every tensor as the card's dtype (zai-org BF16 release).
``fp8-block``    Linear weights F8_E4M3 + F32 ``weight_scale_inv`` per 128x128 block, config
                 ``quantization_config`` ``{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
                 weight_block_size: [128, 128]}`` (zai-org GLM-5-FP8 / DeepSeek-V3 style).
``mxfp4-quark``  AMD Quark MXFP4: MLP/expert weights U8 MXFP4, attention BF16 via ``exclude``
                 (``lm_head``, router ``re:.*mlp.gate$``, the MTP layers, ``re:.*self_attn.*``).
``mxfp4-attn``   as above but attention (kv_b_proj included) MXFP4 too; only the indexer stays BF16
                 (DeepSeek-R1-MXFP4 style).
``fp8-channel``  Quark "AttnFP8": attention FP8 per output channel (``layer_quant_config`` ``*self_attn*``),
                 MLP/experts MXFP4, indexer BF16.

Weights: normal, std 0.02, with a few outlier rows scaled by 8; norms near 1. Each tensor's values come
from a generator seeded by (seed, tensor name): same arguments -> same bytes, and a tensor does not change
when other tensors are added. Shards are written tensor by tensor (memory: one module at a time);
the first kv_b_proj weight that has a scale (else the first scaled weight) ends a shard, so its
scale lives in the next shard.
"""

from __future__ import annotations

import copy
import json
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from glm_pack.packing.errors import PlanError

from . import formats, space
from .cards import Card, load_card
from .checkpoint import INDEX_NAME
from .cli_types import CardName
from .humanize import counted, size_text
from .safetensors_io import DTYPES, byte_size, encode_header
from .writer import OutputError, atomic_write, clear_directory, make_folder, tensor_bytes, write_text

FORMATS = ("bf16", "fp8-block", "mxfp4-quark", "mxfp4-attn", "fp8-channel")
PROFILES = ("full", "small")
SHARD_BYTES = {"small": 48 << 20, "full": 5 << 30}
STD = 0.02
OUTLIER_GAIN = 8.0

_MX = {
    "dtype": "fp4",
    "qscheme": "per_group",
    "ch_axis": -1,
    "group_size": 32,
    "block_size": None,
    "symmetric": None,
    "round_method": "half_even",
    "scale_type": "float",
    "scale_format": "e8m0",
    "scale_calculation_mode": "even",
    "mx_element_dtype": None,
    "observer_cls": "PerBlockMXObserver",
    "is_scale_quant": False,
}
_FP8_CHANNEL = {
    "dtype": "fp8_e4m3",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "group_size": None,
    "symmetric": True,
    "round_method": "half_even",
    "scale_type": "float",
    "observer_cls": "PerChannelMinMaxObserver",
    "is_dynamic": False,
}


def _quark_config(exclude: list[str], layer_quant: dict | None = None) -> dict:
    return {
        "quant_method": "quark",
        "quant_mode": "eager_mode",
        "export": {
            "kv_cache_group": [],
            "min_kv_scale": 0.0,
            "pack_method": "reorder",
            "weight_format": "real_quantized",
        },
        "global_quant_config": {
            "weight": {**_MX, "is_dynamic": False},
            "input_tensors": {**_MX, "is_dynamic": True},
            "output_tensors": None,
            "bias": None,
        },
        "exclude": exclude,
        "layer_quant_config": layer_quant or {},
        "layer_type_quant_config": {},
        "kv_cache_quant_config": {},
        "algo_config": None,
    }


def quantization_config(fmt: str, card: Card, mtp_layers) -> dict | None:
    """config.json's ``quantization_config`` for a synthetic checkpoint of format ``fmt``."""
    if fmt == "bf16":
        return None
    if fmt == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    exclude = ["lm_head", "re:.*mlp.gate$"] + [f"re:{re.escape(card.layer_prefix(m))}\\..*" for m in mtp_layers]
    if fmt == "mxfp4-quark":
        return _quark_config(exclude + ["re:.*self_attn.*"])
    if fmt == "mxfp4-attn":
        return _quark_config(exclude + ["re:.*self_attn\\.indexer.*"])
    if fmt == "fp8-channel":
        fp8 = {"weight": _FP8_CHANNEL, "input_tensors": {**_FP8_CHANNEL, "ch_axis": 1, "is_dynamic": True}}
        return _quark_config(exclude + ["re:.*self_attn\\.indexer.*"], {"*self_attn*": fp8})
    raise PlanError(f"unknown synthetic format {fmt!r}; choose one of {', '.join(FORMATS)}")


def synth_config(card: Card, *, layers: int, experts: int, fmt: str, profile: str, mtp: bool) -> dict:
    """The config.json of a synthetic checkpoint (per-layer lists rewritten for ``layers``)."""
    if profile not in PROFILES:
        raise PlanError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if layers < 1 or experts < 1:
        raise PlanError(f"need at least one layer and one expert, got layers={layers} experts={experts}")
    config = copy.deepcopy(card.synth["config"])
    text = card.text_config(config)
    if profile == "small":
        text.update(card.synth.get("small", {}))
    per_layer = card.synth.get("per_layer", {})
    for key in per_layer:
        text.pop(key, None)
    text[card.layers_spec["count_key"]] = layers
    text["n_routed_experts"] = experts
    text["num_experts_per_tok"] = min(int(text.get("num_experts_per_tok", 1)), experts)
    if "mtp_count_key" in card.layers_spec:
        text[card.layers_spec["mtp_count_key"]] = 1 if mtp else 0
    plan = card.layer_plan(config)
    for key, rule in per_layer.items():
        chosen = set(getattr(plan, rule["set"]))
        ids = range(layers)
        text[key] = (
            [i for i in ids if i in chosen]
            if rule.get("list")
            else [rule["yes"] if i in chosen else rule["no"] for i in ids]
        )
    qc = quantization_config(fmt, card, plan.mtp)
    if qc is not None:
        config["quantization_config"] = qc
    return config


@dataclass(frozen=True)
class _Entry:
    """One stored tensor: ``module``/``fmt`` set for Linear weights (``part`` = weight or scale suffix)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: str  # the tensor whose values are generated (the module weight for encoded parts)
    role: str
    fmt: str | None = None
    part: str | None = None


def _linear_format(fmt: str, module: str, quant: formats.QuantConfig) -> str:
    if fmt == "bf16":
        return "bf16"
    if fmt == "fp8-block":
        return "fp8-block"
    return quant.expected_format(module) or "bf16"


def tensor_entries(card: Card, config: dict, fmt: str) -> list[_Entry]:
    """Every stored tensor of the synthetic checkpoint, in write order (a scale right after its weight)."""
    quant = formats.QuantConfig(config.get("quantization_config"))
    entries = []
    for name, t, shape in card.iter_tensors(config):
        if not t.is_linear:
            entries.append(_Entry(name, t.dtype, shape, name, t.role))
            continue
        wfmt = _linear_format(fmt, formats.module_of(name), quant)
        module = formats.module_of(name)
        for part, (dtype, stored_shape) in formats.stored_specs(wfmt, shape).items():
            if part == "weight" and wfmt in formats.FLOAT_DTYPES:
                dtype = t.dtype
            entries.append(_Entry(f"{module}.{part}", dtype, stored_shape, name, t.role, wfmt, part))
    return entries


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
    return g


def values(name: str, role: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic float32 values for one tensor (std 0.02, a few outlier rows; norms near 1)."""
    g = _generator(seed, name)
    x = torch.randn(shape, generator=g, dtype=torch.float32).mul_(STD)
    if role == "norm" and not name.endswith(".bias"):
        return x.add_(1.0)
    if len(shape) >= 2 and shape[0] >= 8:
        rows = torch.randperm(shape[0], generator=g)[: min(4, max(1, shape[0] // 256))]
        x[rows] *= OUTLIER_GAIN
    return x


def _shards(entries: list[_Entry], shard_bytes: int) -> list[list[_Entry]]:
    scaled = [e.name for e in entries if e.part == "weight" and e.fmt not in formats.FLOAT_DTYPES]
    split_after = next((n for n in scaled if n.endswith("kv_b_proj.weight")), scaled[0] if scaled else None)
    shards, current, size = [], [], 0
    for e in entries:
        n = byte_size(e.dtype, e.shape)
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += n
        if e.name == split_after:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    return shards


def _write_shard(path: Path, entries: list[_Entry], seed: int, cache: dict) -> None:
    atomic_write(path, _shard_chunks(entries, seed, cache))


def _shard_chunks(entries: list[_Entry], seed: int, cache: dict) -> Iterator[bytes | memoryview]:
    """A shard's bytes: its header, then each tensor's values (generated one at a time)."""
    yield encode_header([(e.name, e.dtype, e.shape) for e in entries], {"format": "pt"})
    for e in entries:
        if e.fmt is None:
            t = values(e.name, e.role, e.shape, seed).to(DTYPES[e.dtype][1])
        else:
            if cache.get("source") != e.source:
                w = values(e.source, e.role, _logical_shape(e), seed)
                cache.clear()
                cache.update(source=e.source, parts=formats.encode(e.fmt, w))
            t = cache["parts"][e.part]
            if e.part == "weight" and e.dtype in formats.FLOAT_FORMATS:
                t = t.to(DTYPES[e.dtype][1])
        if tuple(t.shape) != tuple(e.shape) or t.nbytes != byte_size(e.dtype, e.shape):
            raise PlanError(f"synth produced {t.dtype} {tuple(t.shape)} for {e.dtype} {e.shape}", tensor=e.name)
        yield tensor_bytes(t)


def _logical_shape(e: _Entry) -> tuple[int, ...]:
    if e.fmt == "mxfp4" and e.part == "weight":
        return (e.shape[0], e.shape[1] * 2)
    return e.shape


def synthesize(
    out_dir: str | os.PathLike,
    *,
    card: str,
    layers: int,
    experts: int,
    fmt: str,
    profile: str = "small",
    seed: int = 0,
    mtp: bool = True,
    shard_bytes: int | None = None,
    overwrite: bool = False,
    space_check: bool = True,
) -> Path:
    """Write a synthetic checkpoint (config.json, index, shards) into ``out_dir``; returns its path. A non-empty
    ``out_dir`` is refused unless ``overwrite`` (then emptied first: files are replaced, never rewritten in
    place, so outputs hard-linked to an earlier checkpoint there keep theirs); so is one whose filesystem has not
    the room for it (:mod:`.space`; ``--profile full`` of a whole GLM-5 is terabytes), unless not ``space_check``."""
    family = load_card(card)
    config = synth_config(family, layers=layers, experts=experts, fmt=fmt, profile=profile, mtp=mtp)
    entries = tensor_entries(family, config, fmt)
    total = sum(byte_size(e.dtype, e.shape) for e in entries)
    out = Path(out_dir)
    try:
        leftovers = list(out.iterdir()) if out.is_dir() else []
        if leftovers and not overwrite:
            raise PlanError(f"output {out} is not empty; pass --overwrite to replace its contents", file=out)
        if space_check:
            writes = space.Writes("this synthetic checkpoint")
            writes.add(out, "shards", total + space.overhead(len(entries)))
            writes.check(space.freed_bytes(leftovers), out)
        if leftovers:
            clear_directory(out)
    except OSError as err:  # a folder that cannot be listed or emptied (no permission, a read-only file system)
        raise OutputError(f"cannot prepare the output folder: {err.strerror or err}", file=out) from err
    make_folder(out, "the output folder")
    shards = _shards(entries, shard_bytes or SHARD_BYTES[profile])
    weight_map, cache = {}, {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(out / name, shard, seed, cache)
        weight_map.update({e.name: name for e in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out


def assumptions(card: str, *, mtp: bool = True) -> dict[str, str]:
    """The card's documented assumptions (values no public config confirms), key -> explanation; without the MTP
    layer (``mtp=False``) those about it (keys ``mtp_*``) do not apply and are left out."""
    return {k: why for k, why in load_card(card).assumptions.items() if mtp or not k.startswith("mtp_")}


@click.command("synth")
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--card",
    "card_name",
    type=CardName(),
    required=True,
    help="Model family card (glm-5 covers GLM-5 and GLM-5.1), or a card file (*.toml).",
)
@click.option(
    "--layers", type=click.IntRange(min=1), required=True, help="Decoder layers (the MTP layer comes on top)."
)
@click.option("--experts", type=click.IntRange(min=1), required=True, help="Routed experts per MoE layer.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True, help="Source format to imitate.")
@click.option(
    "--profile",
    type=click.Choice(PROFILES),
    default="small",
    show_default=True,
    help="small: the true MLA geometry, everything else shrunk; full: every dimension of the family.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Weight seed; the same arguments give the same bytes."
)
@click.option("--mtp/--no-mtp", default=True, show_default=True, help="Write the MTP layer.")
@click.option(
    "--shard-mb",
    type=click.IntRange(min=1),
    default=None,
    help="Target shard size in MiB (default: 48 small, 5120 full).",
)
@click.option("--overwrite", is_flag=True, help="Replace the contents of a non-empty OUT (everything in it goes).")
@click.option(
    "--skip-space-check",
    "space_check",
    flag_value=False,
    default=True,
    help="Start even when the shards exceed the free space of OUT's filesystem (one that compresses what it stores).",
)
def synth_command(out, card_name, layers, experts, fmt, profile, seed, mtp, shard_mb, overwrite, space_check):
    """Write a synthetic checkpoint with the family's real names, dtypes, config and sharded index.

    Example: glm-pack synth /tmp/glm5-fp8 --card glm-5 --layers 4 --experts 8 --format fp8-block
    """
    path = synthesize(
        out,
        card=card_name,
        layers=layers,
        experts=experts,
        fmt=fmt,
        profile=profile,
        seed=seed,
        mtp=mtp,
        shard_bytes=None if shard_mb is None else shard_mb << 20,
        overwrite=overwrite,
        space_check=space_check,
    )
    shards = sorted(path.glob("model-*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    click.echo(f"wrote {path}: {counted(len(shards), 'shard')}, {size_text(size)} ({card_name}, {fmt}, {profile})")
    for key, why in assumptions(card_name, mtp=mtp).items():
        click.echo(f"assumed {key}: {why}")
