"""Open a glm-pack output at run time: read the manifest, check it, load this rank's w_kc / w_vc lazily.

Only files are read here (the runtime's one I/O module); everything it trusts comes from the manifest.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from glm_pack.packing import manifest as mf
from glm_pack.packing.errors import BackendError, GlmPackError, ManifestError, VerifyError
from glm_pack.packing.mla import MlaGeometry

from .backends import select_backend
from .layer import MlaLayer, ProjectionWeights

_GEOMETRY_KEYS = {
    "num_heads": "num_attention_heads",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
}


def file_sha256(path: Path) -> str:
    """sha256 hex digest of a file's bytes, read in 16 MiB blocks; VerifyError naming the file where it cannot be
    read (a permission, an I/O error)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    except OSError as err:
        raise VerifyError(f"cannot read: {err.strerror or err}", file=path) from err
    return h.hexdigest()


def raw_tensor_sha256(path: Path, name: str) -> str:
    """sha256 of one tensor's stored bytes in a safetensors file (the fingerprint the converter records);
    VerifyError naming the file (and tensor) for one that cannot be read, has no header, or lacks the tensor."""
    try:
        with open(path, "rb") as f:
            start, header = _read_header(f, path)
            if name not in header:
                raise VerifyError("the checkpoint lacks a tensor the overlay was built from", file=path, tensor=name)
            offsets = header[name].get("data_offsets") if isinstance(header[name], dict) else None
            begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 else (None, None)
            if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
                raise VerifyError(f"data_offsets {offsets!r:.40} are not [begin, end]", file=path, tensor=name)
            if start + end > os.fstat(f.fileno()).st_size:
                raise VerifyError("safetensors file is truncated", file=path, tensor=name)
            f.seek(start + begin)
            h = hashlib.sha256()
            left = end - begin
            while left:
                block = f.read(min(left, 16 << 20))
                if not block:
                    raise VerifyError("safetensors file is truncated", file=path, tensor=name)
                h.update(block)
                left -= len(block)
    except OSError as err:
        raise VerifyError(f"cannot read: {err.strerror or err}", file=path, tensor=name) from err
    return h.hexdigest()


def check_source_tensors(files: dict[str, Path], digests: dict[str, str], advice: str = "") -> None:
    """Every source tensor in ``digests`` (name -> the sha256 the converter recorded) must be in ``files`` (name ->
    safetensors file, :func:`tensor_files`) and still hash as recorded; else VerifyError naming it, ``advice``
    appended to its text."""
    for name, digest in sorted(digests.items()):
        if name not in files:
            raise VerifyError(f"the checkpoint's index lacks a source tensor of the overlay{advice}", tensor=name)
        if raw_tensor_sha256(files[name], name) != digest:
            raise VerifyError(
                f"source tensor differs from the one the overlay was made from{advice}", file=files[name], tensor=name
            )


def tensor_files(served: Path) -> dict[str, Path]:
    """Source tensor name -> the served safetensors file holding it (from the index, or the single file);
    VerifyError naming the index or the file when it cannot be read as one."""
    index = served / mf.INDEX_NAME
    if os.path.isfile(index):  # False in a folder this user cannot enter (another user's source): unreachable
        weight_map = _json_object(_read_bytes(index), index, "the index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
            raise VerifyError("the index's weight_map must map tensor names to file names", file=index)
        return {name: served / file for name, file in weight_map.items()}
    single = served / mf.SINGLE_NAME
    return {name: single for name in _header(single)} if os.path.isfile(single) else {}


def _read_bytes(path: Path, error: type[GlmPackError] = VerifyError) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise error(f"cannot read: {err.strerror or err}", file=path) from err


def _json_object(data: bytes, path: Path, what: str, error: type[GlmPackError] = VerifyError) -> dict:
    """``data`` parsed as a JSON object; ``error`` naming ``what`` and ``path`` for anything else (invalid UTF-8 or
    JSON, nesting too deep for the parser, another JSON type)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        value = None
    if not isinstance(value, dict):
        raise error(f"{what} is not a JSON object", file=path)
    return value


def _read_header(f, path: Path) -> tuple[int, dict]:
    """(data start, header object) of an open safetensors file; VerifyError when it has no complete header."""
    head = f.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 <= n <= os.fstat(f.fileno()).st_size - 8:
        raise VerifyError("safetensors file is truncated: no complete header", file=path)
    return 8 + n, _json_object(f.read(n), path, "the safetensors header")


def _header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            header = _read_header(f, path)[1]
    except OSError as err:
        raise VerifyError(f"cannot read: {err.strerror or err}", file=path) from err
    header.pop("__metadata__", None)
    return header


def config_geometry(config: dict) -> dict:
    """The MLA fields of a HF config (top level, or ``text_config`` for multimodal wrappers); {} where neither is
    an object holding them all."""
    for section in (config, config.get("text_config")):
        if isinstance(section, dict) and all(k in section for k in _GEOMETRY_KEYS.values()):
            return {field: section[key] for field, key in _GEOMETRY_KEYS.items()}
    return {}


class PackedModel:
    """A loaded glm-pack overlay for one tensor-parallel rank. ``mla(layer)`` gives the layer object."""

    def __init__(self, root: Path, manifest: dict, device, backend, tp_rank: int, tp_size: int):
        self.root = root
        self.manifest = manifest
        self.device = torch.device(device)
        self.backend = backend
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.geometry = mf.parse_geometry(manifest)
        self.tensors = mf.parse_tensors(manifest)
        self._entries = {entry.layer: entry for entry in mf.parse_mla(manifest)}
        per_rank = self.geometry.num_heads // tp_size
        self.heads = slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        self.local_geometry = MlaGeometry(**{**self.geometry.as_dict(), "num_heads": per_rank})
        self._loaded: dict[int, MlaLayer] = {}

    @property
    def layers(self) -> list[int]:
        return sorted(self._entries)

    def _read_heads(self, name: str | None) -> torch.Tensor | None:
        """This rank's slice of the head axis of one overlay tensor (only those bytes are read)."""
        if name is None:
            return None
        entry = self.tensors[name]
        path = self.root / mf.OVERLAY_DIR / entry.file
        try:
            with safe_open(path, framework="pt") as f:
                stored = f.get_slice(name)
                shape, dtype = tuple(stored.get_shape()), stored.get_dtype()
                if shape != tuple(entry.shape) or dtype != entry.dtype:
                    raise ManifestError(
                        f"overlay tensor disagrees with the manifest: stored {dtype} {list(shape)}, "
                        f"manifest {entry.dtype} {list(entry.shape)}",
                        file=path,
                        tensor=name,
                    )
                t = stored[self.heads.start : self.heads.stop]
        except ManifestError:
            raise
        except Exception as err:
            raise GlmPackError(f"cannot read overlay tensor: {err}", file=path, tensor=name) from err
        return t.to(self.device)

    def _projection(self, p: mf.Projection) -> ProjectionWeights:
        return ProjectionWeights(
            p.precision, self._read_heads(p.weight), self._read_heads(p.scale), p.k_logical, p.k_stored, p.rel_error
        )

    def mla(self, layer: int) -> MlaLayer:
        """The MLA layer object of ``layer`` (loaded onto the device on first use)."""
        layer = _integer(layer, "layer")
        if layer not in self._entries:
            raise GlmPackError(f"layer {layer} has no MLA overlay; MLA layers are {self.layers}")
        if layer not in self._loaded:
            e = self._entries[layer]
            self._loaded[layer] = MlaLayer(
                layer, self.local_geometry, self._projection(e.w_kc), self._projection(e.w_vc), self.backend
            )
        return self._loaded[layer]

    def load_all(self) -> list[MlaLayer]:
        return [self.mla(layer) for layer in self.layers]


def _integer(value, name: str) -> int:
    """``value`` as an int (a Python or numpy integer, a 0-d integer tensor); bools, floats and tensors of more
    dimensions (one element or not) are refused."""
    if not isinstance(value, bool) and getattr(value, "dtype", None) != torch.bool and getattr(value, "ndim", 0) == 0:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise GlmPackError(f"{name} must be an integer, got {value!r}")


def _check_config(root: Path, manifest: dict, geometry: MlaGeometry) -> None:
    candidates = [root / "config.json"]
    if manifest["source"].get("path"):
        candidates.append(Path(manifest["source"]["path"]) / "config.json")
    config_path = next((p for p in candidates if os.path.isfile(p)), None)  # a source this user cannot enter: none
    if config_path is None:
        return
    config = _json_object(_read_bytes(config_path, ManifestError), config_path, "config.json", ManifestError)
    found = config_geometry(config)
    expected = geometry.as_dict()
    wrong = {k: (found[k], expected[k]) for k in found if found[k] != expected[k]}
    if wrong:
        detail = ", ".join(f"{k}: config {a!r} vs manifest {b!r}" for k, (a, b) in wrong.items())
        raise ManifestError(f"the manifest's geometry contradicts config.json ({detail})", file=config_path)


def _verify_source(root: Path, manifest: dict) -> None:
    """The source tensors the overlay was made from still hash as recorded: OUT's originals where convert placed
    them and OUT holds them (its config.json; VerifyError naming OUT's index or single file where that is gone: the
    source elsewhere would stand in for the originals an engine loads), else (``--files none``, or the overlay
    folder alone copied) the recorded source where it is reachable."""
    source = manifest["source"]
    placed = manifest["options"].get("files") != "none" and os.path.isfile(root / "config.json")
    base = root if placed else Path(source["path"]) if source.get("path") else None
    files = tensor_files(base) if base is not None else {}
    if placed and not files:
        gone = root / (mf.INDEX_NAME if source.get("index_sha256") else mf.SINGLE_NAME)
        raise VerifyError("the originals were placed in OUT, but this file of them is missing", file=gone)
    if files:  # else an overlay-only output of an unreachable source: nothing to compare with
        check_source_tensors(files, source["tensors"])


def _verify_files(root: Path, manifest: dict) -> None:
    overlay = root / mf.OVERLAY_DIR
    for name, info in sorted(manifest["files"].items()):
        path = overlay / name
        if not path.is_file():
            why = "is not a file" if path.exists() else "is missing"
            raise VerifyError(f"overlay file listed in the manifest {why}", file=path)
        if path.stat().st_size != info.get("size") or file_sha256(path) != info.get("sha256"):
            raise VerifyError("overlay file does not match its sha256 in the manifest (changed or corrupt)", file=path)


def open_packed(
    path, *, device="cpu", backend="auto", tp_rank: int = 0, tp_size: int = 1, verify: bool = False
) -> PackedModel:
    """Open a converted output directory (the one holding ``glm-pack/manifest.json``) for one TP rank.

    ``device``: where the weights go and every operation's tensors must be (a torch device). ``backend``: "auto"
    (aiter on gfx950, then Triton on a GPU, else torch), or "aiter", "triton" or "torch" (a forced one that is
    unavailable raises BackendError saying why). Rank r of ``tp_size`` t gets the H heads' slice ``[r*H/t, (r+1)*H/t)``.
    ``verify=True`` also checks every overlay file's sha256 and, where the original files are reachable (in OUT or
    at the recorded source path), that the source tensors still hash as recorded.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ManifestError(f"path must be a str or os.PathLike folder, got {type(path).__name__}: {path!r:.80}")
    root = Path(path)
    manifest_path = root / mf.OVERLAY_DIR / mf.MANIFEST_NAME
    try:
        is_dir, found = root.is_dir(), manifest_path.is_file()
    except OSError as err:  # a folder this user may not enter (as after `chmod -R 644`), an I/O error
        raise ManifestError(f"cannot read: {err.strerror or err}", file=err.filename or manifest_path) from err
    if not is_dir:  # a typo, or a file given for the output folder
        why = "is a file" if root.exists() else "does not exist"
        raise ManifestError(f"not a glm-pack output directory: the path {why}", file=root)
    if not found:
        raise ManifestError(
            "no glm-pack manifest: not a converted output, or the conversion did not finish", file=manifest_path
        )
    manifest = mf.loads_checked(_read_bytes(manifest_path, ManifestError), str(manifest_path))
    geometry = mf.parse_geometry(manifest)
    tp_rank, tp_size = _integer(tp_rank, "tp_rank"), _integer(tp_size, "tp_size")
    if tp_size < 1:
        raise GlmPackError(f"tp_size must be at least 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise GlmPackError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
    if geometry.num_heads % tp_size:
        raise GlmPackError(f"{geometry.num_heads} heads cannot be split evenly over tp_size={tp_size}")
    _check_config(root, manifest, geometry)
    if not isinstance(verify, bool):  # "no" would be truthy
        raise GlmPackError(f"verify must be True or False, got {verify!r}")
    if verify:
        _verify_files(root, manifest)
        _verify_source(root, manifest)
    try:
        device = torch.empty(0, device=device).device  # "cuda" without a GPU, a missing index, a typo
    except Exception as err:
        raise BackendError(f"device {device!r} cannot be used here: {err}") from err
    if device.type == "meta":  # its tensors hold no data: the ops would return empty results or fail inside torch
        raise BackendError(f"device {str(device)!r} cannot be used here: meta tensors hold no data to compute with")
    configs = (manifest.get("kernel_configs") or {}).get("configs", {})
    chosen = select_backend(backend, device, configs)
    return PackedModel(root, manifest, device, chosen, tp_rank, tp_size)
