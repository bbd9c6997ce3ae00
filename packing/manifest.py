"""The manifest: the contract between the converter and the runtime (``OUT/glm-pack/manifest.json``).

Pure data: building, serialising and validating the JSON object; no file I/O here.

Top-level keys (schema ``glm-pack/manifest`` version 1)::

    schema, schema_version, tool {name, version}, created (ISO time; the only non-deterministic field)
    source   {kind "local"|"hub", path, repo_id, revision, config_sha256, index_sha256,
              files {name: {size, glm_pack_card: true where
              the original is a glm-pack model card}}, tensors {source tensor name: sha256 of its stored bytes}}
    model    {card, architectures, model_type, geometry {num_heads, kv_lora_rank, qk_nope_head_dim,
              qk_rope_head_dim, v_head_dim}}
    options  {quant_mode, k_pad, mla_precision, max_rel_error, files, repack_experts}
    mla      [ {layer, prefix, source {tensor, format}, w_kc: PROJ, w_vc: PROJ} ]  (one per MLA layer)
    experts  (only with --repack-experts) {layout "aiter_moe_a4w4", ...its description,
              groups [ {layer, file, tensors [names]} ]} (one group per overlay file; a layer whose experts
              pass convert's file bound, as GLM-5's 256 do, fills several): routed-expert tensors under their
              source names, each shuffled (tensors[name].layout says how, e.g. {"layout": "aiter_shuffle_16x16"})
    tensors  {overlay tensor name: {file, dtype, shape, sha256, layout (experts only)}}
    files    {overlay file name (relative to glm-pack/): {size, sha256}}
    kernel_configs {route, configs {arch: {op: {M bucket: {config key: value}}}}}

PROJ (one absorbed projection) is::

    {precision "mxfp4"|"bf16", weight <tensor name>, scale <tensor name> | null,
     layout {name, k_logical, k_stored}, quant {format, mode, block, scale, rounding} | {format "bf16"},
     rel_error (of the stored tensor vs the float source split, Frobenius over all heads and the logical K;
     the source as dequantized to float32, so an FP8 / MXFP4 source's own error is not in it), mxfp4_rel_error
     (what MXFP4 would give; equals rel_error when MXFP4 was kept), max_head_rel_error (of the stored tensor, the
     largest of each head's own relative error; optional: manifests from glm-pack builds before 2026-12-01 lack
     it, and readers take them)}

``w_kc`` is stored ``[H, kv_lora, k_stored]`` (MXFP4 codes ``[H, kv_lora, k_stored/2]``), ``w_vc``
``[H, v, kv_lora]``; layout ``bmm_nk`` means row-major, reduction axis last, K padded from ``k_logical`` to
``k_stored`` with zero codes and scale bytes 0x7F (MXFP4) or zero values (BF16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import GlmPackError, ManifestError
from .layouts import padded_scale_shape
from .mla import MlaGeometry
from .mxfp4 import MODES

SCHEMA = "glm-pack/manifest"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
OVERLAY_DIR = "glm-pack"
INDEX_NAME = "model.safetensors.index.json"  # a sharded source's index (the manifest pins its sha256)
SINGLE_NAME = "model.safetensors"  # the one file of an unsharded source
PRECISIONS = ("mxfp4", "bf16")
PROJECTIONS = ("w_kc", "w_vc")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 32
SHUFFLE_LAYOUTS = ("aiter_shuffle_16x16", "aiter_e8m0_shuffle")
KNOWN_DTYPES = ("U8", "BF16", "F16", "F32")
QUANT_MODES = (*MODES, "source")


@dataclass(frozen=True)
class Projection:
    """One absorbed projection of one layer as stored in the overlay."""

    name: str  # "w_kc" or "w_vc"
    precision: str  # "mxfp4" or "bf16"
    weight: str  # overlay tensor holding codes (U8) or bf16 values
    scale: str | None  # overlay tensor of E8M0 bytes (mxfp4 only)
    k_logical: int
    k_stored: int
    rel_error: float
    mxfp4_rel_error: float
    max_head_rel_error: float | None  # None in manifests that predate it
    quant_mode: str | None  # MXFP4 scale rule ("even", "mse", ...) or "source" (bytes kept); None for bf16


@dataclass(frozen=True)
class MlaLayer:
    layer: int
    prefix: str
    source_tensor: str
    source_format: str
    w_kc: Projection
    w_vc: Projection


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str


def _fail(msg: str, tensor: str | None = None):
    raise ManifestError(f"manifest: {msg}", tensor=tensor)


def _get(obj: dict, key: str, typ, where: str):
    if not isinstance(obj, dict) or key not in obj:
        _fail(f"{where} lacks {key!r}")
    value = obj[key]
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        _fail(f"{where}.{key} must be {getattr(typ, '__name__', typ)}, got {type(value).__name__}")
    return value


def _check_depth(value, depth: int = 0) -> None:
    if depth > MAX_JSON_DEPTH:
        _fail(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        for v in value.values():
            _check_depth(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_depth(v, depth + 1)


def loads(text: str | bytes) -> dict:
    """Parse manifest JSON with size (in UTF-8 bytes, also for str input) and depth limits; no validation of the
    content."""
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)  # lone surrogates: 3 bytes
    if size > MAX_MANIFEST_BYTES:
        _fail(f"{size} bytes, larger than the {MAX_MANIFEST_BYTES} byte limit")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as err:
        _fail(f"not valid JSON ({err})")
    _check_depth(obj)
    if not isinstance(obj, dict):
        _fail("top level is not a JSON object")
    return obj


def loads_checked(data: bytes, file: str) -> dict:
    """The manifest in ``data`` (the bytes of ``file``) as the runtime reads it: :func:`loads`, then
    :func:`parse_mla`, which checks every section it depends on; errors name ``file``."""
    try:
        manifest = loads(data)
        parse_mla(manifest)
    except GlmPackError as err:
        err.file = file
        raise
    return manifest


def dumps(manifest: dict) -> str:
    """Deterministic JSON text (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _projection(obj: dict, name: str, where: str, tensors: dict) -> Projection:
    p = _get(obj, name, dict, where)
    where = f"{where}.{name}"
    precision = _get(p, "precision", str, where)
    if precision not in PRECISIONS:
        _fail(f"{where}.precision {precision!r} is not one of {PRECISIONS}")
    layout = _get(p, "layout", dict, where)
    lname = _get(layout, "name", str, f"{where}.layout")
    if lname != "bmm_nk":
        _fail(f"{where}.layout {lname!r} is not a layout the runtime reads (bmm_nk)")
    k_logical = _get(layout, "k_logical", int, f"{where}.layout")
    k_stored = _get(layout, "k_stored", int, f"{where}.layout")
    if not 0 < k_logical <= k_stored or k_stored % 32:
        _fail(f"{where}.layout needs 0 < k_logical <= k_stored and k_stored % 32 == 0, got {k_logical}/{k_stored}")
    weight = _get(p, "weight", str, where)
    scale = p.get("scale")
    if precision == "mxfp4" and not isinstance(scale, str):
        _fail(f"{where} is mxfp4 but names no scale tensor")
    if precision == "bf16" and scale is not None:
        _fail(f"{where} is bf16 but names a scale tensor")
    for t in (weight, scale):
        if t is not None and t not in tensors:
            _fail(f"{where} names tensor {t!r} that the tensors table lacks", tensor=t)
    errors = []
    for key in ("rel_error", "mxfp4_rel_error", "max_head_rel_error"):
        if key == "max_head_rel_error" and key not in p:
            errors.append(None)
            continue
        v = _get(p, key, (int, float), where)
        if isinstance(v, bool) or not 0 <= v <= 1e300:  # false for NaN and inf; huge ints would not fit a float
            _fail(f"{where}.{key} must be a finite non-negative number, got {v}")
        errors.append(float(v))
    quant = _get(p, "quant", dict, where)
    mode = quant.get("mode") if precision == "mxfp4" else None
    if precision == "mxfp4" and mode not in QUANT_MODES:
        _fail(f"{where}.quant.mode {mode!r} is not one of {QUANT_MODES}")
    if precision == "mxfp4" and quant != mxfp4_quant(mode):
        _fail(f"{where}.quant must be {mxfp4_quant(mode)}: the one MXFP4 encoding glm-pack reads")
    return Projection(name, precision, weight, scale, k_logical, k_stored, *errors, mode)


def _plain_file(file: str, where: str, tensor: str | None = None) -> str:
    if not file or "/" in file or "\\" in file or file.startswith("."):
        _fail(f"{where} {file!r} must be a plain file name inside glm-pack/", tensor=tensor)
    return file


def _sha256_hex(value, where: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or value.strip("0123456789abcdef"):
        _fail(f"{where} is not a sha256 hex digest")
    return value


def parse_files(manifest: dict) -> dict[str, tuple[int, str]]:
    """The overlay file table: {file name inside glm-pack/: (size in bytes, sha256 hex)}."""
    out = {}
    for name, info in _get(manifest, "files", dict, "manifest").items():
        where = f"files[{name!r}]"
        _plain_file(name, "file name")
        size = _get(info, "size", int, where)
        if size < 0:
            _fail(f"{where}.size {size} is negative")
        out[name] = (size, _sha256_hex(_get(info, "sha256", str, where), f"{where}.sha256"))
    return out


def check_sections(manifest: dict) -> None:
    """The sections readers use besides mla/tensors/experts: source, options, files, kernel_configs."""
    source = _get(manifest, "source", dict, "manifest")
    if source.get("path") is not None and not isinstance(source["path"], str):
        _fail("source.path must be a string or null")
    if source.get("index_sha256") is not None:
        _sha256_hex(source["index_sha256"], "source.index_sha256")
    _sha256_hex(_get(source, "config_sha256", str, "source"), "source.config_sha256")
    for name, sha in _get(source, "tensors", dict, "source").items():
        _sha256_hex(sha, f"source.tensors[{name!r}]")
    _get(manifest, "options", dict, "manifest")
    parse_files(manifest)
    configs = manifest.get("kernel_configs")
    if configs is not None and not (isinstance(configs, dict) and isinstance(configs.get("configs", {}), dict)):
        _fail("kernel_configs must be an object whose configs is an object")


def parse_tensors(manifest: dict) -> dict[str, TensorEntry]:
    table = _get(manifest, "tensors", dict, "manifest")
    out = {}
    for name, entry in table.items():
        where = f"tensors[{name!r}]"
        file = _plain_file(_get(entry, "file", str, where), f"{where}.file", name)
        dtype = _get(entry, "dtype", str, where)
        if dtype not in KNOWN_DTYPES:
            _fail(f"{where}.dtype {dtype!r} is not one of {KNOWN_DTYPES}", tensor=name)
        shape = _get(entry, "shape", list, where)
        if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            _fail(f"{where}.shape {shape!r} must be a non-empty list of positive integers", tensor=name)
        sha = _sha256_hex(_get(entry, "sha256", str, where), f"{where}.sha256")
        out[name] = TensorEntry(name, file, dtype, tuple(shape), sha)
    return out


def parse_geometry(manifest: dict) -> MlaGeometry:
    model = _get(manifest, "model", dict, "manifest")
    g = _get(model, "geometry", dict, "model")
    fields = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    try:
        return MlaGeometry(**{f: _get(g, f, int, "model.geometry") for f in fields})
    except ManifestError:
        raise
    except Exception as err:  # FormatError from MlaGeometry's own checks
        _fail(f"model.geometry is invalid: {err}")


def check_schema(manifest: dict) -> None:
    schema = manifest.get("schema")
    version = manifest.get("schema_version")
    if schema != SCHEMA:
        _fail(f"schema {schema!r} is not {SCHEMA!r}: not a glm-pack manifest")
    if version != SCHEMA_VERSION:
        _fail(f"schema_version {version!r} is not supported (this glm-pack knows {SCHEMA_VERSION}); upgrade glm-pack")


def parse_mla(manifest: dict) -> list[MlaLayer]:
    """Validate the manifest and return its MLA layers (raises ManifestError naming the bad field)."""
    check_schema(manifest)
    check_sections(manifest)
    parse_experts(manifest)
    geom = parse_geometry(manifest)
    tensors = parse_tensors(manifest)
    layers = []
    seen = set()
    for i, entry in enumerate(_get(manifest, "mla", list, "manifest")):
        where = f"mla[{i}]"
        layer = _new_layer(entry, seen, where)
        source = _get(entry, "source", dict, where)
        kc = _projection(entry, "w_kc", where, tensors)
        vc = _projection(entry, "w_vc", where, tensors)
        _check_projection_shapes(kc, tensors, (geom.num_heads, geom.kv_lora_rank), geom.qk_nope_head_dim)
        _check_projection_shapes(vc, tensors, (geom.num_heads, geom.v_head_dim), geom.kv_lora_rank)
        layers.append(
            MlaLayer(
                layer,
                _get(entry, "prefix", str, where),
                _get(source, "tensor", str, f"{where}.source"),
                _get(source, "format", str, f"{where}.source"),
                kc,
                vc,
            )
        )
    return layers


def _layer_id(entry: dict, where: str) -> int:
    """``entry``'s layer id; ManifestError when it is missing, no integer or negative."""
    layer = _get(entry, "layer", int, where)
    if layer < 0:
        _fail(f"{where}.layer {layer} is negative")
    return layer


def _new_layer(entry: dict, seen: set[int], where: str) -> int:
    """``entry``'s layer id (:func:`_layer_id`), added to ``seen``; ManifestError when already in ``seen``."""
    layer = _layer_id(entry, where)
    if layer in seen:
        _fail(f"{where}.layer {layer} is repeated")
    seen.add(layer)
    return layer


def parse_experts(manifest: dict) -> list[tuple[int, str, list[str]]]:
    """Validate the optional experts section; returns [(layer, file, tensor names)] (empty when absent). A layer may
    have several groups (its experts split over files), a file only one."""
    section = manifest.get("experts")
    if section is None:
        return []
    if not isinstance(section, dict) or section.get("layout") != "aiter_moe_a4w4":
        _fail("experts.layout must be 'aiter_moe_a4w4'")
    tensors = parse_tensors(manifest)
    out, files = [], set()
    for i, group in enumerate(_get(section, "groups", list, "experts")):
        where = f"experts.groups[{i}]"
        names = _get(group, "tensors", list, where)
        file = _get(group, "file", str, where)
        layer = _layer_id(group, where)
        if file in files:
            _fail(f"{where}.file {file[:80]!r} is repeated")
        files.add(file)
        for name in names:
            if not isinstance(name, str) or name not in tensors or tensors[name].file != file:
                _fail(f"{where} names tensor {str(name)[:80]!r} that the tensors table lacks in {file}")
            if tensors[name].dtype != "U8":
                _fail(f"{where}: tensor {name!r} must be U8 (MXFP4 codes or scales), not {tensors[name].dtype}", name)
            if not _shuffle_layout_ok(manifest["tensors"][name].get("layout"), tensors[name]):
                _fail(f"{where}: tensor {name!r} has no known shuffle layout (or wrong parameters)", tensor=name)
        out.append((layer, file, names))
    return out


def _shuffle_layout_ok(layout, entry: TensorEntry) -> bool:
    """Exactly the parameters the layout registry's unpack takes, consistent with the stored shape."""
    if not isinstance(layout, dict) or layout.get("layout") not in SHUFFLE_LAYOUTS:
        return False
    if layout["layout"] == "aiter_shuffle_16x16":
        return layout == {"layout": "aiter_shuffle_16x16"}
    shape = layout.get("shape")
    return (
        set(layout) == {"layout", "shape"}
        and isinstance(shape, list)
        and len(shape) == len(entry.shape) >= 2
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        and tuple(shape[:-2]) == entry.shape[:-2]
        and padded_scale_shape(*shape[-2:]) == entry.shape[-2:]
    )


def _check_projection_shapes(p: Projection, tensors, lead: tuple[int, int], k_logical: int) -> None:
    """``p``'s tensors are what its precision stores for ``[*lead, K]`` (K = its k_stored) of ``k_logical``."""
    if p.k_logical != k_logical:
        _fail(f"{p.weight}: k_logical {p.k_logical} contradicts the geometry ({k_logical})", tensor=p.weight)
    w = tensors[p.weight]
    if p.precision == "mxfp4":
        expect_w, expect_s = (*lead, p.k_stored // 2), (*lead, p.k_stored // 32)
        s = tensors[p.scale]
        if w.dtype != "U8" or s.dtype != "U8" or w.shape != expect_w or s.shape != expect_s:
            _fail(
                f"{p.weight}: mxfp4 tensors must be U8 {expect_w} + U8 {expect_s}, "
                f"got {w.dtype} {w.shape} + {s.dtype} {s.shape}",
                tensor=p.weight,
            )
    elif w.dtype != "BF16" or w.shape != (*lead, p.k_stored):
        _fail(f"{p.weight}: bf16 tensor must be BF16 {(*lead, p.k_stored)}, got {w.dtype} {w.shape}", tensor=p.weight)


def mxfp4_quant(mode: str) -> dict:
    """PROJ.quant of an MXFP4 projection stored with scale rule ``mode``: E2M1 codes, one E8M0 scale per 32 along K,
    elements rounded half to even. Readers accept exactly this object."""
    return {"format": "mxfp4", "mode": mode, "block": 32, "scale": "e8m0", "rounding": "half_even"}


def projection_tensor_names(prefix: str, name: str) -> tuple[str, str]:
    """The overlay tensors of projection ``name`` ("w_kc" / "w_vc") of the layer at ``prefix`` (e.g.
    ``model.layers.7``): ``(weight, MXFP4 scale)``; a BF16 projection has only the weight."""
    base = f"{prefix}.self_attn.{name}"
    return f"{base}.weight", f"{base}.weight_scale"


def projection_entry(stored, weight: str, scale: str | None) -> dict:
    """Manifest PROJ object for a :class:`~glm_pack.packing.absorb.StoredProjection`."""
    quant = mxfp4_quant(stored.quant_mode) if stored.precision == "mxfp4" else {"format": "bf16"}
    return {
        "precision": stored.precision,
        "weight": weight,
        "scale": scale,
        "layout": {"name": "bmm_nk", "k_logical": stored.k_logical, "k_stored": stored.k_stored},
        "quant": quant,
        "rel_error": stored.rel_error,
        "mxfp4_rel_error": stored.mxfp4_rel_error,
        "max_head_rel_error": stored.max_head_rel_error,
    }


# Every key aiter's batched A16WFP4 GEMM reads from a config; a pinned config must carry all of them.
AITER_BMM_CONFIG_KEYS = (
    "BLOCK_SIZE_M",
    "BLOCK_SIZE_N",
    "BLOCK_SIZE_K",
    "GROUP_SIZE_M",
    "NUM_KSPLIT",
    "num_warps",
    "num_stages",
    "waves_per_eu",
    "matrix_instr_nonkdim",
    "cache_modifier",
)


def k_up_block_sizes(configs: dict) -> list[int]:
    """The BLOCK_SIZE_K values (sorted, each once) of the K-up configs in ``configs``
    ``{arch: {op: {M bucket: config}}}`` (the manifest's ``kernel_configs.configs``, or a card's for one route)."""
    return sorted({cfg["BLOCK_SIZE_K"] for ops in configs.values() for cfg in ops.get("k_up", {}).values()})
