"""A tiny served checkpoint (BF16 kv_b_proj only) and a glm-pack overlay beside it, assembled by hand from
the packing functions and the manifest schema (the converter's synthetic-checkpoint helper is not in the
tree yet). The source fingerprint is hashed here independently of the adapters' code."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from glm_pack.convert.formats import encode_fp8_block
from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import absorb_layer
from glm_pack.packing.mla import MlaGeometry

GEOM = MlaGeometry(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=32)
LAYERS = (0, 1)


def kv_b_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def kv_b_weights(seed: int = 0, geom: MlaGeometry = GEOM) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        kv_b_name(i): (torch.randn(geom.kv_b_rows, geom.kv_lora_rank, generator=g) * 0.05).bfloat16() for i in LAYERS
    }


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(root: Path, weights: dict[str, torch.Tensor], geom: MlaGeometry = GEOM) -> None:
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "num_attention_heads": geom.num_heads,
        "kv_lora_rank": geom.kv_lora_rank,
        "qk_nope_head_dim": geom.qk_nope_head_dim,
        "qk_rope_head_dim": geom.qk_rope_head_dim,
        "v_head_dim": geom.v_head_dim,
        "num_hidden_layers": len(LAYERS),
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(root / "model-00001-of-00001.safetensors"))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in weights}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def write_overlay(root: Path, weights: dict[str, torch.Tensor], *, k_stored: int, policy: str = "mxfp4") -> None:
    """Absorb every layer of ``weights`` into ``root/glm-pack`` with a complete manifest."""
    geom = GEOM
    tensors, entries, table = {}, [], {}
    for layer in LAYERS:
        kc, vc = absorb_layer(weights[kv_b_name(layer)], geom, k_stored=k_stored, policy=policy)
        entry = {"layer": layer, "prefix": f"model.layers.{layer}.self_attn", "source": {}}
        entry["source"] = {"tensor": kv_b_name(layer), "format": "bf16"}
        for proj_name, stored in (("w_kc", kc), ("w_vc", vc)):
            w = f"model.layers.{layer}.self_attn.{proj_name}.weight"
            s = f"model.layers.{layer}.self_attn.{proj_name}.weight_scale" if stored.scale is not None else None
            tensors[w] = stored.weight.contiguous()
            if s:
                tensors[s] = stored.scale.contiguous()
            entry[proj_name] = mf.projection_entry(stored, w, s)
        entries.append(entry)
    out = root / mf.OVERLAY_DIR
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "overlay-00001.safetensors"))
    dtypes = {torch.uint8: "U8", torch.bfloat16: "BF16"}
    for name, t in tensors.items():
        digest = _sha(t.contiguous().view(torch.uint8).numpy().tobytes())
        table[name] = {"file": "overlay-00001.safetensors", "dtype": dtypes[t.dtype], "shape": list(t.shape)}
        table[name]["sha256"] = digest
    blob = (out / "overlay-00001.safetensors").read_bytes()
    manifest = {
        "schema": mf.SCHEMA,
        "schema_version": mf.SCHEMA_VERSION,
        "tool": {"name": "glm-pack", "version": "test"},
        "source": {
            "kind": "local",
            "path": str(root),
            "config_sha256": _sha((root / "config.json").read_bytes()),
            "index_sha256": _sha((root / "model.safetensors.index.json").read_bytes()),
            "tensors": {n: _sha(t.view(torch.uint8).numpy().tobytes()) for n, t in weights.items()},
        },
        "model": {"card": "glm-5", "architectures": ["GlmMoeDsaForCausalLM"], "geometry": geom.as_dict()},
        "options": {"k_pad": k_stored, "mla_precision": policy},
        "mla": entries,
        "tensors": table,
        "files": {"overlay-00001.safetensors": {"size": len(blob), "sha256": _sha(blob)}},
    }
    (out / mf.MANIFEST_NAME).write_text(mf.dumps(manifest))


def make_served(root: Path, *, k_stored: int = GEOM.qk_nope_head_dim, policy: str = "mxfp4", seed: int = 0):
    """Checkpoint + overlay in ``root``; returns the kv_b_proj weights written."""
    weights = kv_b_weights(seed)
    write_checkpoint(root, weights)
    write_overlay(root, weights, k_stored=k_stored, policy=policy)
    return weights


def fp8_block_dequant(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The engines' FP8 block dequantization (SGLang's ``block_quant_dequant``): scales repeated over their
    blocks, times the FP8 values, in float32."""
    s = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * s[: weight.shape[0], : weight.shape[1]]


def make_served_fp8(root: Path, block: tuple[int, int], seed: int = 0):
    """An FP8 (block-scaled) kv_b_proj per layer, as an engine loads it, and, beside a checkpoint of its values,
    a BF16-policy overlay converted from them; returns ({name: F8_E4M3 weight}, {name: F32 scale})."""
    weights, scales = {}, {}
    for name, w in kv_b_weights(seed).items():
        weights[name], scales[name] = encode_fp8_block(w.float(), block)
    values = {n: fp8_block_dequant(weights[n], scales[n], block).bfloat16() for n in weights}
    write_checkpoint(root, values)
    write_overlay(root, values, k_stored=GEOM.qk_nope_head_dim, policy="bf16")
    return weights, scales
