"""``glm-pack convert``: derive, quantize and lay out every MLA layer's w_kc / w_vc into an overlay.

Output directory::

    OUT/<original files>          hard-linked, copied or left out; index.json never edited
    OUT/glm-pack/layer-NNN.safetensors   one overlay file per MLA layer (w_kc/w_vc weight + weight_scale)
    OUT/glm-pack/manifest.json    written last: its presence marks a complete conversion
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import absorb_layer
from glm_pack.packing.errors import GlmPackError, PlanError
from glm_pack.packing.layouts import stored_k

from .checkpoint import open_checkpoint
from .writer import OutputError, sha256_tensor, write_safetensors, write_text

FILE_MODES = ("link", "copy", "none")
TOOL_VERSION = "0.1.0"


@dataclass(frozen=True)
class ConvertOptions:
    quant_mode: str = "even"
    k_pad: str = "card"  # "card" (the card's default), "none", or a multiple such as "256"
    mla_precision: str = "mxfp4"
    max_rel_error: float | None = None
    files: str = "link"
    overwrite: bool = False

    def as_dict(self, k_multiple: int | None) -> dict:
        return {
            "quant_mode": self.quant_mode,
            "k_pad": k_multiple,
            "mla_precision": self.mla_precision,
            "max_rel_error": self.max_rel_error,
            "files": self.files,
        }


@dataclass
class LayerReport:
    layer: int
    w_kc: tuple[str, float, float]  # precision, stored rel error, mxfp4 rel error
    w_vc: tuple[str, float, float]


@dataclass
class ConvertReport:
    out: Path
    layers: list[LayerReport] = field(default_factory=list)
    overlay_bytes: int = 0
    original_files: int = 0
    seconds: float = 0.0


def file_sha256(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def overlay_file_name(layer: int) -> str:
    return f"layer-{layer:03d}.safetensors"


def check_locations(src: Path, out: Path, overwrite: bool) -> None:
    """Refuse an OUT that is SRC, inside it, contains it, or already holds something (unless overwrite)."""
    src_r, out_r = src.resolve(), out.resolve()
    if src_r == out_r or src_r in out_r.parents or out_r in src_r.parents:
        raise PlanError(f"output {out} must be outside the source {src} (and not contain it)", file=out)
    if out.exists() and not out.is_dir():
        raise PlanError(f"output {out} exists and is not a directory", file=out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise PlanError(f"output {out} is not empty; pass --overwrite to replace its contents", file=out)


def _clear_previous(out: Path) -> None:
    overlay = out / mf.OVERLAY_DIR
    (overlay / mf.MANIFEST_NAME).unlink(missing_ok=True)  # first: never leave a manifest over partial files
    if overlay.exists():
        shutil.rmtree(overlay)


def resolve_k_multiple(option: str, card_default: int | None) -> int | None:
    if option == "card":
        return card_default
    if option == "none":
        return None
    try:
        value = int(option)
    except ValueError:
        value = 0
    if value <= 0 or value % 32:
        raise PlanError(f"--k-pad must be 'card', 'none' or a positive multiple of 32, got {option!r}")
    return value


def place_original(src_file: Path, dst: Path, mode: str) -> None:
    """Hard-link (falling back to copy across filesystems) or copy one original file, via a temp name."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        if mode == "link":
            try:
                os.link(src_file, tmp)  # follows a symlinked source (HF cache) to the real blob
            except OSError:
                shutil.copyfile(src_file, tmp)
        else:
            shutil.copyfile(src_file, tmp)
        os.replace(tmp, dst)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot place {dst}: {err.strerror or err}", file=dst) from err


def original_files(root: Path) -> list[Path]:
    """Every regular file of the source (through symlinks), relative, skipping hidden and glm-pack/ entries."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or rel.parts[0] == mf.OVERLAY_DIR:
            continue
        if path.is_file():
            found.append(rel)
    return found


def _stat_key(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def convert(src: str | os.PathLike, out: str | os.PathLike, options: ConvertOptions, progress=None) -> ConvertReport:
    """Run the whole conversion; raises a GlmPackError subclass on any problem (no manifest is written then)."""
    started = time.monotonic()
    if options.files not in FILE_MODES:
        raise PlanError(f"--files must be one of {', '.join(FILE_MODES)}, got {options.files!r}")
    ckpt = open_checkpoint(src)
    out = Path(out)
    check_locations(ckpt.root, out, options.overwrite)
    card, geom = ckpt.card, ckpt.geometry
    k_multiple = resolve_k_multiple(options.k_pad, card.default_k_pad(geom))
    k_kc = stored_k(geom.qk_nope_head_dim, k_multiple)
    originals = original_files(ckpt.root)
    before = {str(rel): _stat_key(ckpt.root / rel) for rel in originals}

    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out)
    overlay = out / mf.OVERLAY_DIR
    overlay.mkdir()
    report = ConvertReport(out=out)
    tensors: dict[str, dict] = {}
    files: dict[str, dict] = {}
    source_tensors: dict[str, str] = {}
    mla_entries = []
    layers = card.mla_layers(ckpt.config)
    for i, layer in enumerate(layers):
        prefix = card.layer_prefix(layer)
        kv_b_name = card.kv_b_proj(layer)
        fmt = ckpt.weight_format(kv_b_name)
        try:
            kv_b = ckpt.read_float(kv_b_name)
            vc_source = None
            if fmt == "mxfp4":
                from glm_pack.packing.mla import split_kv_b_mxfp4_vc

                vc_source = split_kv_b_mxfp4_vc(*ckpt.read_mxfp4(kv_b_name), geom)
            kc, vc = absorb_layer(
                kv_b,
                geom,
                k_stored=k_kc,
                quant_mode=options.quant_mode,
                policy=options.mla_precision,
                max_rel_error=options.max_rel_error,
                vc_mxfp4_source=vc_source,
            )
        except GlmPackError as err:
            if err.tensor is None:
                err.tensor = kv_b_name
            if err.file is None:
                err.file = str(ckpt.root / ckpt.info(kv_b_name).file)
            raise
        for name in ckpt.source_tensors(kv_b_name):
            source_tensors[name] = ckpt.raw_sha256(name)
        file_name = overlay_file_name(layer)
        layer_tensors = {}
        entry = {"layer": layer, "prefix": prefix, "source": {"tensor": kv_b_name, "format": fmt}}
        for proj_name, stored in (("w_kc", kc), ("w_vc", vc)):
            weight = f"{prefix}.self_attn.{proj_name}.weight"
            scale = f"{prefix}.self_attn.{proj_name}.weight_scale" if stored.scale is not None else None
            layer_tensors[weight] = stored.weight
            if scale:
                layer_tensors[scale] = stored.scale
            entry[proj_name] = mf.projection_entry(stored, weight, scale)
        for name, t in layer_tensors.items():
            tensors[name] = {
                "file": file_name,
                "dtype": "U8" if t.dtype.is_floating_point is False else "BF16",
                "shape": list(t.shape),
                "sha256": sha256_tensor(t),
            }
        digest = write_safetensors(overlay / file_name, layer_tensors, {"format": "pt", "producer": "glm-pack"})
        size = (overlay / file_name).stat().st_size
        files[file_name] = {"size": size, "sha256": digest}
        report.overlay_bytes += size
        mla_entries.append(entry)
        report.layers.append(
            LayerReport(
                layer,
                (kc.precision, kc.rel_error, kc.mxfp4_rel_error),
                (vc.precision, vc.rel_error, vc.mxfp4_rel_error),
            )
        )
        if progress is not None:
            progress(i + 1, len(layers), size)

    if options.files != "none":
        for rel in originals:
            place_original(ckpt.root / rel, out / rel, options.files)
        report.original_files = len(originals)

    after = {str(rel): _stat_key(ckpt.root / rel) for rel in originals}
    changed = sorted(name for name in before if before[name] != after.get(name))
    if changed:
        raise GlmPackError(
            f"source changed during conversion ({', '.join(changed[:3])}); no manifest written", file=ckpt.root
        )
    manifest = {
        "schema": mf.SCHEMA,
        "schema_version": mf.SCHEMA_VERSION,
        "tool": {"name": "glm-pack", "version": TOOL_VERSION},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {
            "kind": "local",
            "path": str(ckpt.root.resolve()),
            "repo_id": None,
            "revision": None,
            "config_sha256": file_sha256(ckpt.root / "config.json"),
            "index_sha256": file_sha256(ckpt.index_path) if ckpt.index_path else None,
            "files": {name: {"size": size} for name, (size, _) in sorted(before.items())},
            "tensors": source_tensors,
        },
        "model": {
            "card": card.name,
            "architectures": ckpt.config.get("architectures", []),
            "model_type": ckpt.config.get("model_type"),
            "geometry": geom.as_dict(),
        },
        "options": options.as_dict(k_multiple),
        "mla": mla_entries,
        "tensors": tensors,
        "files": files,
        "kernel_configs": {
            "route": "padded" if k_kc != geom.qk_nope_head_dim else "unpadded",
            "configs": card.kernel_configs("padded" if k_kc != geom.qk_nope_head_dim else "unpadded"),
        },
    }
    mf.parse_mla(manifest)  # never write a manifest the runtime would refuse
    write_text(overlay / mf.MANIFEST_NAME, mf.dumps(manifest))
    report.seconds = time.monotonic() - started
    return report
