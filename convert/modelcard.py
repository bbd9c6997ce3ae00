"""The Hub model card of a converted output: YAML metadata + a body rendered from ``cards/model_card.md``.

Full mode writes ``OUT/README.md`` and keeps a source model card found there as ``OUT/README.source.md``;
overlay-only mode writes ``OUT/glm-pack/README.md`` and leaves the root alone. The card is a pure
function of the manifest and the source card, so rewriting it for an unchanged OUT gives the same bytes.
The body template uses ``string.Template`` (``$name``) placeholders, no Jinja2.
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from importlib import resources
from pathlib import Path
from string import Template

from glm_pack.packing import manifest as mf
from glm_pack.packing.errors import PlanError

from .formats import FLOAT_FORMATS
from .humanize import plural
from .state import OutputLock
from .writer import atomic_write, read_bytes, write_text

CARD_MARKER = (
    "<!-- glm-pack model card: generated from glm-pack/manifest.json; refresh with `glm-pack card` -->"
)
SOURCE_README = "README.source.md"
TAGS = ("glm", "mla", "rocm", "gfx950", "glm-pack")  # plus "mxfp4" where a projection is stored so
OVERLAY_LIBRARY = "glm-pack"
# Metadata carried over from the source model card when present.
CARRIED_KEYS = ("license", "license_name", "license_link", "language", "pipeline_tag")
# What fills the padded K columns of a stored projection, per stored precision.
PAD_FILL = {
    "mxfp4": "zero codes and scale byte 0x7F in the extra 32-blocks of the MXFP4 tensors",
    "bf16": "zero columns in the BF16 tensors",
}
# The GEMM K-up / V-up run on a projection, per stored precision.
GEMM = {
    "mxfp4": "aiter's batched A16WFP4 GEMM `aiter.ops.triton.gemm.batched.batched_gemm_a16wfp4` (weights"
    " `[B, N, K/2]` U8 + scales `[B, N, K/32]` U8 E8M0, plain)",
    "bf16": "a plain BF16 batched matmul",
}
# What each recorded MXFP4 scale rule (manifest quant.mode) means.
SCALE_RULES = {
    "even": "the aiter/Quark rule",
    "floor": "the OCP text's floor rule",
    "roundup": "the next power of two >= amax / 6",
    "mse": "best of three exponents per block",
    "source": "the source checkpoint's MXFP4 bytes, kept as they are",
}
# How a stored projection's values sit in the bmm_nk layout, per stored precision.
PACKING = {
    "mxfp4": "MXFP4 codes are packed two per byte (low nibble = even k) with one E8M0 scale byte per 32 values"
    " along K",
    "bf16": "BF16 values are stored as they are",
}


def card_path(out: Path, overlay_only: bool) -> Path:
    return out / mf.OVERLAY_DIR / "README.md" if overlay_only else out / "README.md"


def is_generated(text: str) -> bool:
    return CARD_MARKER in text


def holds_card(path: Path) -> bool:
    """Whether ``path`` is a file holding a model card glm-pack wrote (OutputError where it cannot be read)."""
    return path.is_file() and is_generated(_read_card(path))


def card_base_model(path: Path) -> str | list | None:
    """The base_model the glm-pack card at ``path`` names (what ``--base-model`` or the manifest's source repo
    set), else None (no such file, not a glm-pack card, or none named)."""
    text = _read_card(path) if path.is_file() else ""
    return source_metadata(text).get("base_model") if is_generated(text) else None


def _source_card_text(out: Path, manifest: dict) -> str | None:
    """The source card: README.source.md, else a root README.md glm-pack did not write, else the source's."""
    candidates = [out / SOURCE_README, out / "README.md"]
    if manifest["source"].get("path"):
        candidates.append(Path(manifest["source"]["path"]) / "README.md")
    for path in candidates:
        if os.path.isfile(path):  # False in a source folder this user cannot enter
            text = _read_card(path)
            if not is_generated(text):
                return text
    return None


def _read_card(path: Path) -> str:
    """A model card's text (bytes that are no UTF-8 replaced); OutputError naming it where it cannot be read."""
    return read_bytes(path, "the model card").decode("utf-8", errors="replace")


def source_metadata(text: str | None) -> dict:
    """YAML metadata of a source model card as a dict (empty when absent or unparsable)."""
    if not text:
        return {}
    from huggingface_hub import ModelCard

    try:
        return ModelCard(text, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # a broken source card must not block publishing; its metadata is just not carried
        return {}


def card_metadata(manifest: dict, source_meta: dict, *, overlay_only: bool, base_model: str | None):
    """The card's :class:`huggingface_hub.ModelCardData`."""
    from huggingface_hub import ModelCardData

    base = base_model or manifest["source"].get("repo_id")
    carried = {k: source_meta[k] for k in CARRIED_KEYS if source_meta.get(k)}
    library = OVERLAY_LIBRARY if overlay_only else source_meta.get("library_name") or OVERLAY_LIBRARY
    source_tags = [t for t in source_meta.get("tags") or [] if isinstance(t, str)]
    mxfp4 = ["mxfp4"] if "mxfp4" in _stored(mf.parse_mla(manifest)) else []
    tags = list(dict.fromkeys([*TAGS, *mxfp4, *source_tags]))
    # "quantized" only where glm-pack quantized something: an all-BF16 overlay re-lays the base's weights, for which
    # the Hub has no relation value, so it is left to the Hub to infer
    extra = {"base_model_relation": "quantized"} if base and mxfp4 else {}
    return ModelCardData(base_model=base, library_name=library, tags=tags, **carried, **extra)


def fmt_error(x: float | None) -> str:
    """A relative error as the card and convert's summary print it; ``n/a`` where the manifest lacks it."""
    return "n/a" if x is None else f"{x:.4f}"


def compact_ranges(ids: list[int]) -> str:
    """Sorted integers as compact ranges, e.g. [0, 1, 2, 5] -> '0-2, 5' ('' for none)."""
    parts, start = [], None
    for i, n in enumerate(ids):
        start = n if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


def _projections(layers) -> list:
    return [p for lay in layers for p in (lay.w_kc, lay.w_vc)]


def _stored(layers, *, padded: bool = False) -> list[str]:
    """Stored precisions of the projections (of the K-padded ones with ``padded``), in manifest order."""
    stored = {p.precision for p in _projections(layers) if not padded or p.k_stored != p.k_logical}
    return [x for x in mf.PRECISIONS if x in stored]


def _stored_label(layers) -> str:
    """'MXFP4', 'BF16' or 'MXFP4 and BF16': what the projections are stored as."""
    return " and ".join(x.upper() for x in _stored(layers))


def _layout_text(layers) -> str:
    packing = "; ".join(PACKING[x] for x in _stored(layers))
    return f"Layout `bmm_nk`: row-major, reduction axis (K) last, plain (no shuffle); {packing}."


def _k_pad_text(layers) -> str:
    padded = sorted({(p.k_logical, p.k_stored) for p in _projections(layers) if p.k_stored != p.k_logical})
    if not padded:
        return "No K padding."
    fills = _stored(layers, padded=True)
    even = " and K takes the kernels' even path" if "mxfp4" in fills else ""
    return (
        "K padding: "
        + ", ".join(f"{a} → {b}" for a, b in padded)
        + " with "
        + " and ".join(PAD_FILL[x] for x in fills)
        + ", so the whole `[nope | rope]` q row can be passed as the activation (rope columns meet zero"
        f" weights){even}."
    )


def _layout_fields(layers, tensors) -> dict:
    rows, seen = [], set()
    for p in _projections(layers):
        entry = tensors[p.weight]
        key = (p.name, p.precision, entry.shape, p.k_logical, p.k_stored)
        if key not in seen:
            seen.add(key)
            dtype = "MXFP4 (U8 codes + U8 E8M0 scales)" if p.precision == "mxfp4" else "BF16"
            rows.append(
                f"| {p.name} | {dtype} | {list(entry.shape)} | bmm_nk | {p.k_logical} | {p.k_stored} |"
            )
    return {"layout_rows": "\n".join(rows), "layout_text": _layout_text(layers), "k_pad_text": _k_pad_text(layers)}


def _quant_text(manifest: dict, layers) -> str:
    """The quantization paragraph: format, then each scale rule the MXFP4 projections were stored with (and how
    many when they differ, e.g. ``even`` for w_kc and ``source`` for w_vc from an MXFP4 source)."""
    mxfp4 = [p for p in _projections(layers) if p.precision == "mxfp4"]
    if not mxfp4:
        return "No projection is quantized: every w_kc / w_vc is stored in BF16."
    q = next(e[n]["quant"] for e in manifest["mla"] for n in mf.PROJECTIONS if e[n]["precision"] == "mxfp4")
    modes = Counter(p.quant_mode for p in mxfp4)
    rules = " and ".join(
        f"`{mode}` ({SCALE_RULES[mode]}{f': {n} projections' if len(modes) > 1 else ''})"
        for mode, n in sorted(modes.items())
    )
    rounding = f", rounding `{q['rounding']}`" if set(modes) != {"source"} else ""
    return (
        f"MXFP4 (OCP MX): E2M1 codes, one E8M0 power-of-two scale per block of {q['block']} along K; "
        f"scale rule {rules}{rounding}. {len(mxfp4)} of {2 * len(layers)} projections are MXFP4."
    )


def source_error_text(layers) -> str:
    """What the errors leave out when the source kv_b_proj was itself quantized (FP8 or MXFP4): its own
    quantization error, which glm-pack cannot see; that a w_vc kept as the MXFP4 source's bytes has error 0 by
    construction; and that a w_kc stored as MXFP4 is quantized again (unlike a BF16 one). The layers are named where
    only some are concerned (a float MTP layer beside MXFP4 attention). Empty for float sources.
    ``layers``: each with ``source_format`` and ``w_kc`` / ``w_vc`` having ``precision`` and ``quant_mode`` (the
    manifest's :class:`~glm_pack.packing.manifest.MlaLayer`, or convert's ``LayerReport``). Shared by the card and
    convert's summary."""
    floats = set(FLOAT_FORMATS.values())
    quantized = [lay for lay in layers if lay.source_format not in floats]
    if not quantized:
        return ""
    formats = ", ".join(sorted({lay.source_format for lay in quantized}))
    text = (
        f"The source `kv_b_proj`{_of_layers(quantized, layers)} is already quantized ({formats}): these errors are"
        " measured against its dequantized values and do not include the error of that quantization, which glm-pack"
        " cannot see."
    )
    if kept := [lay for lay in layers if lay.w_vc.quant_mode == "source"]:
        text += (
            f" w_vc{_of_layers(kept, layers)} keeps the source's MXFP4 bytes (scale rule `source`), so its error here"
            " is 0 by construction"
        )
        text += (
            "; w_kc stored as MXFP4 is quantized again along its own reduction axis, an error on top of the source's."
            if any(lay.w_kc.precision == "mxfp4" for lay in layers)
            else "."
        )
    return text


def _of_layers(some, layers) -> str:
    """' of layers 0-1' when ``some`` is not all of ``layers`` (a mixed source, e.g. a float MTP layer), else ''."""
    if len(some) == len(layers):
        return ""
    return f" of {plural('layer', len(some))} {compact_ranges(sorted(lay.layer for lay in some))}"


def error_cells(p) -> tuple[str, str, str]:
    """One projection's cells in an error table: stored precision, relative error, its worst head's."""
    return p.precision, fmt_error(p.rel_error), fmt_error(p.max_head_rel_error)


def worst_head_text(projections) -> str:
    """``, worst head E``: the largest per-head error over ``projections`` that record one, saying how many do
    where not all do (a run resumed from a journal that predates it); empty if none does."""
    heads = [p.max_head_rel_error for p in projections if p.max_head_rel_error is not None]
    if not heads:
        return ""
    some = "" if len(heads) == len(projections) else f" (recorded in {len(heads)} of {len(projections)} layers)"
    return f", worst head {fmt_error(max(heads))}{some}"


def _error_summary(layers) -> str:
    """Max and mean relative error per projection and stored precision, never mixing MXFP4 and BF16 errors, with
    the worst head's error over the same layers where the manifest records it."""
    parts = []
    for name in mf.PROJECTIONS:
        for precision in mf.PRECISIONS:
            projs = [getattr(lay, name) for lay in layers if getattr(lay, name).precision == precision]
            if projs:
                errors = [p.rel_error for p in projs]
                parts.append(
                    f"{name} {precision.upper()} max {fmt_error(max(errors))} "
                    f"(mean {fmt_error(statistics.fmean(errors))}{worst_head_text(projs)}) over {len(errors)} layer(s)"
                )
    return "; ".join(parts) or "no MLA layers"


def _quant_fields(manifest: dict, layers) -> dict:
    rows = [
        f"| {lay.layer} | " + " | ".join(cell for p in (lay.w_kc, lay.w_vc) for cell in error_cells(p)) + " |"
        for lay in layers
    ]
    return {
        "quant_text": _quant_text(manifest, layers),
        "source_error_text": source_error_text(layers),
        "error_rows": "\n".join(rows),
        "error_summary": _error_summary(layers),
    }


def _precision_text(options: dict, layers) -> str:
    policy = options.get("mla_precision")
    if policy == "auto":
        text = (
            "Policy `auto`: a projection stays in BF16 when its MXFP4 relative error would exceed "
            f"{options.get('max_rel_error')}."
        )
    else:
        text = f"Policy `{policy}`: every projection stored as {str(policy).upper()}."
    kept = [(lay.layer, p) for lay in layers for p in (lay.w_kc, lay.w_vc) if p.precision == "bf16"]
    if kept:
        text += (
            " Kept in BF16: "
            + ", ".join(f"layer {n} {p.name} (MXFP4 error would be {fmt_error(p.mxfp4_rel_error)})" for n, p in kept)
            + "."
        )
    elif policy == "auto":
        text += " No projection exceeded it."
    return text


def _default_split_is_ragged(k: int) -> bool:
    """Whether aiter's batched A16WFP4 wrapper, under its default ``BLOCK_SIZE_K=256`` (shrunk to the next power
    of two >= K when one block covers K), takes its ragged-K path for K (elements)."""
    block = 256 if k > 256 else 1 << (k - 1).bit_length()
    return k % block != 0


def _kernel_fields(manifest: dict, layers) -> dict:
    kcfg = manifest.get("kernel_configs") or {}
    route = kcfg.get("route", "unpadded")
    kc = [lay.w_kc for lay in layers if lay.w_kc.precision == "mxfp4"]  # what aiter's A16WFP4 K-up runs on
    if not kc:
        text = "w_kc is stored in BF16: K-up is a plain BF16 batched matmul, no aiter K-up GEMM."
    elif route == "padded":
        text = (
            "w_kc is K-padded, so the K-up GEMM takes the even-K path under default configs (this avoids the"
            " ragged-K bug of several aiter versions)."
        )
    else:
        k = kc[0].k_stored
        blocks = mf.k_up_block_sizes(kcfg.get("configs") or {})
        pinned = ", ".join(f"`BLOCK_SIZE_K={b}`" for b in blocks)
        text = f"w_kc is stored unpadded (K = {k}); " + (
            f"the pinned K-up configs use {pinned}." if blocks else "no K-up configs are pinned."
        )
        if _default_split_is_ragged(k):
            text += (
                " aiter's default configs (256-deep K blocks, what engines call it with) split this K raggedly, and"
                " its batched A16WFP4 kernel gets ragged K wrong (ROCm/aiter main at e4048607, 2026-08-22, still"
                " masks the activation against the packed K): run K-up with the pinned configs."
            )
    archs = sorted((kcfg.get("configs") or {}).keys())
    stored = _stored(layers)
    return {
        "route": route,
        "route_text": text,
        "projection_kernels": "; ".join(
            f"{'the ' + x.upper() + ' projections: ' if len(stored) > 1 else ''}{GEMM[x]}" for x in stored
        ),
        "config_archs": ", ".join(f"`{a}`" for a in archs) or "none (the kernels' defaults apply)",
    }


def _overlay_text(layers) -> str:
    """What the overlay holds, as stored: all MXFP4, all BF16, or how many of each."""
    projections = _projections(layers)
    n_mxfp4 = sum(p.precision == "mxfp4" for p in projections)
    aiter = "in the layouts AMD aiter's gfx950 kernels read"
    if n_mxfp4 == 0:
        stored = " kept in BF16 (none quantized), reduction axis last (`bmm_nk`)"
    elif n_mxfp4 == len(projections):
        stored = f" quantized to MXFP4 {aiter}"
    else:
        stored = f", {n_mxfp4} of {len(projections)} quantized to MXFP4 {aiter} and the rest kept in BF16"
    return f"absorbed MLA projections (`w_kc`, `w_vc`){stored}, with a manifest"


def _audience_fields(name: str, overlay_only: bool, overlay: str) -> dict:
    if overlay_only:
        return {
            "intro": f"This folder holds a kernel-ready overlay for **{name}** made by glm-pack: {overlay}. "
            "The repository's own files are untouched.",
            "engines_text": "## Stock engines\nNothing outside `glm-pack/` was changed: vLLM, SGLang and"
            " transformers keep loading the original weights exactly as before (they read only the files"
            " `model.safetensors.index.json` names).",
        }
    return {
        "intro": f"**{name}** with its original weights unchanged, plus a kernel-ready overlay in `glm-pack/`"
        f" made by glm-pack: {overlay}.",
        "engines_text": "## Stock engines\nThe original files and `model.safetensors.index.json` are"
        " byte-identical to the source: vLLM, SGLang and transformers load this repository exactly like the"
        " base model and ignore `glm-pack/` (they read only the files the index names).",
    }


def _attend_call(geom) -> str:
    """The snippet's attend call: q's rope part goes in as ``q_rope`` when the model has rope."""
    rope = f", q_rope=q[..., {geom.qk_nope_head_dim}:]" if geom.qk_rope_head_dim else ""
    return f"layer.attend(latent, cache, kv_indptr, kv_indices, softmax_scale{rope})"


def _experts_text(manifest: dict) -> str:
    """What was done besides the MLA split: the repacked routed experts, when the manifest has them."""
    groups = mf.parse_experts(manifest)
    if not groups:
        return "No other tensor was changed."
    expert_layers = sorted({layer for layer, _, _ in groups})
    files = sorted({file for _, file, _ in groups})
    return (
        f"The routed experts of {len(expert_layers)} layer(s) ({compact_ranges(expert_layers)}) were repacked too:"
        f" {sum(len(names) for _, _, names in groups)} expert tensors (MXFP4 weights and their scales), values"
        f" unchanged, shuffled into aiter's gfx950 fused-MoE a4w4 layout (`{manifest['experts']['layout']}`), in"
        f" {len(files)} overlay file(s) (`{mf.OVERLAY_DIR}/{files[0]}`) under their source names."
    )


def _download_args(repo_id: str | None, revision: str | None, overlay_only: bool) -> str:
    """The loading example's ``snapshot_download`` arguments: the repo, the revision where it is not main (the
    client's default), and for an overlay-only card the overlay and config.json alone."""
    args = f'"{repo_id or "<this repo>"}"'
    if revision and revision != "main":
        args += f', revision="{revision}"'
    return args + (', allow_patterns=["glm-pack/*", "config.json"]' if overlay_only else "")


def _body_fields(
    manifest: dict, overlay_only: bool, has_source_readme: bool, repo_id: str | None, revision: str | None
) -> dict:
    layers = mf.parse_mla(manifest)
    geom = mf.parse_geometry(manifest)
    options, source = manifest["options"], manifest["source"]
    name = source.get("repo_id") or Path(source.get("path") or "model").name
    if source.get("repo_id"):
        revision = f" at revision `{source['revision']}`" if source.get("revision") else ""
        source_text = f"`{source['repo_id']}`{revision}"
    else:
        source_text = f"a local copy (`{name}`)"
    names = sorted({lay.source_tensor for lay in layers})
    tensors = mf.parse_tensors(manifest)
    return {
        "marker": CARD_MARKER,
        "download_args": _download_args(repo_id, revision, overlay_only),
        "title": f"{name} — glm-pack {_stored_label(layers)} MLA overlay for gfx950",
        "n_layers": len(layers),
        "layer_list": compact_ranges([lay.layer for lay in layers]),
        "overlay_dir": mf.OVERLAY_DIR,
        "num_heads": geom.num_heads,
        "kv_lora_rank": geom.kv_lora_rank,
        "qk_nope_head_dim": geom.qk_nope_head_dim,
        "v_head_dim": geom.v_head_dim,
        "attend_call": _attend_call(geom),
        "source_example": names[0] if names else "-",
        "source_formats": "source format " + ", ".join(sorted({lay.source_format for lay in layers})),
        "file_example": f"{mf.OVERLAY_DIR}/{tensors[layers[0].w_kc.weight].file}" if layers else "-",
        "experts_text": _experts_text(manifest),
        **_layout_fields(layers, tensors),
        **_quant_fields(manifest, layers),
        "precision_text": _precision_text(options, layers),
        **_kernel_fields(manifest, layers),
        **_audience_fields(name, overlay_only, _overlay_text(layers)),
        "tool": manifest["tool"]["name"],
        "tool_version": manifest["tool"]["version"],
        "created": manifest.get("created", "?"),
        "source_text": source_text,
        "config_sha256": source.get("config_sha256", "?"),
        "quant_mode": options.get("quant_mode"),
        "k_pad": options.get("k_pad"),
        "mla_precision": options.get("mla_precision"),
        "max_rel_error": "none" if options.get("max_rel_error") is None else options["max_rel_error"],
        "source_readme_text": f"- The source model card is kept as `{SOURCE_README}`."
        if has_source_readme
        else "",
    }


def require_originals(out: Path, manifest: dict, action: str) -> None:
    """Refuse to treat OUT as a full checkpoint (root card, full push) when the originals are not in it."""
    if manifest["options"].get("files") == "none":
        why = "holds no original files (converted with --files none)"
    elif not (out / "config.json").is_file():
        why = "lacks its original config.json"
    else:
        return
    raise PlanError(f"{out} {why}: {action} with --overlay-only", file=out)


def _template() -> Template:
    return Template(resources.files("glm_pack.cards").joinpath("model_card.md").read_text(encoding="utf-8"))


def render_card(
    out: str | Path,
    *,
    overlay_only: bool = False,
    base_model: str | None = None,
    repo_id: str | None = None,
    revision: str | None = None,
) -> str:
    """The card text (``---`` YAML ``---`` + body) of a converted OUT; reads only the manifest and cards.

    ``base_model`` wins over the one the card already at OUT names, which wins over the manifest's source repo.
    """
    from .verify import read_manifest

    out = Path(out)
    manifest = read_manifest(out)
    if not overlay_only:
        require_originals(out, manifest, "write its card")
    source_text = _source_card_text(out, manifest)
    base_model = base_model or card_base_model(card_path(out, overlay_only))
    data = card_metadata(
        manifest, source_metadata(source_text), overlay_only=overlay_only, base_model=base_model
    )
    has_source = not overlay_only and source_text is not None
    body = _template().substitute(_body_fields(manifest, overlay_only, has_source, repo_id, revision))
    return f"---\n{data.to_yaml()}\n---\n{body.rstrip()}\n"


def write_card(
    out: str | Path,
    *,
    overlay_only: bool = False,
    base_model: str | None = None,
    repo_id: str | None = None,
    revision: str | None = None,
) -> Path:
    """Write (or refresh) the card; in full mode first keep a source README.md as README.source.md (the card,
    rendered before anything is written, already names it).

    Files are replaced by rename, never written through: an original README.md hard-linked from the
    source stays untouched in the source. Holds OUT's lock (exclusive): refused while another glm-pack run
    writes OUT or a verify reads it.
    """
    with OutputLock(Path(out), create=False):
        return write_card_unlocked(
            out, overlay_only=overlay_only, base_model=base_model, repo_id=repo_id, revision=revision
        )


def write_card_unlocked(
    out: str | Path,
    *,
    overlay_only: bool = False,
    base_model: str | None = None,
    repo_id: str | None = None,
    revision: str | None = None,
) -> Path:
    """:func:`write_card` without taking OUT's lock: for a caller that holds it (push)."""
    out = Path(out)
    target = card_path(out, overlay_only)
    text = render_card(out, overlay_only=overlay_only, base_model=base_model, repo_id=repo_id, revision=revision)
    if not overlay_only:
        readme, kept = out / "README.md", out / SOURCE_README
        if readme.is_file():
            data = read_bytes(readme, "the model card")
            if not is_generated(data.decode("utf-8", errors="replace")):
                if kept.is_file() and read_bytes(kept, "the model card") != data:
                    raise PlanError(
                        f"{readme} is not a glm-pack card and {kept} already holds a different source card; "
                        "remove one of them",
                        file=readme,
                    )
                atomic_write(kept, [data])
    if not target.is_file() or read_bytes(target, "the model card") != text.encode():  # no UTF-8 needed
        write_text(target, text)
    return target
