"""``glm-pack verify``: re-check a converted output against its manifest and its source.

Checks, each reported by name: manifest present and valid; every overlay file's size and sha256 (and, on a
mismatch, which tensor changed); stored precisions allowed by the recorded ``mla_precision``; OUT's config.json
and index (when present, and always when the originals were placed) those the overlay was made from;
geometry against config.json; the source's config and index untouched; source tensors unchanged (sha256
against the fingerprint); the MLA layers exactly those of the source; every overlay tensor re-derived from
its source split as convert does and compared byte for byte, its scale rule and its recorded errors
(``rel_error``, ``mxfp4_rel_error``, and ``max_head_rel_error`` where recorded) recomputed; repacked experts
unshuffled and compared with the source's bytes.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import POLICIES, rel_errors, store_projection, stored_precision
from glm_pack.packing.errors import GlmPackError, HubError, ManifestError
from glm_pack.packing.layouts import get_layout, unpack_bmm_nk
from glm_pack.packing.mla import split_kv_b, split_kv_b_mxfp4_vc
from glm_pack.packing.mxfp4 import MODES, dequantize

from .checkpoint import INDEX_NAME
from .convert import file_sha256, store_sha256
from .humanize import counted
from .modelcard import SOURCE_README, holds_card
from .safetensors_io import LocalFile, parse_header, read_tensor
from .state import OutputLock
from .writer import OutputError, sha256_tensor

VERIFY_SCHEMA = "glm-pack.verify/1"
# Recomputed errors may differ from the recorded ones only by float32 summation order (thread count).
ERROR_TOLERANCE = 1e-4

Progress = Callable[[str, int, int, int], None]  # (phase, done, total, bytes read for that step)


def _silent(phase: str, done: int, total: int, nbytes: int) -> None:
    """A :data:`Progress` that reports nowhere."""


class IncompleteOutputError(GlmPackError):
    """OUT has no manifest: the conversion did not finish."""


@dataclass
class VerifyReport:
    out: Path
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    incomplete: bool = False
    source_checked: bool = False  # the source was read and the layers re-derived from it

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        """INCOMPLETE, FAILED, OK, or an OK that says the source was not reached (OUT's own files only)."""
        if self.incomplete or not self.ok:
            return "INCOMPLETE" if self.incomplete else "FAILED"
        return "OK" if self.source_checked else "OK (overlay files only: source not reachable, layers not re-derived)"

    def as_dict(self) -> dict:
        """The ``--json`` report (schema ``glm-pack.verify/1``): ``out`` (the folder), ``verdict`` (the line the
        human report ends with: OK, OK (overlay files only: ...), FAILED or INCOMPLETE), ``ok`` (every check that ran
        passed), ``incomplete`` (no manifest: the conversion did not finish), ``source_checked`` (the source was
        read and the layers re-derived), ``problems`` and ``checked`` (one sentence each)."""
        return {
            "schema": VERIFY_SCHEMA,
            "out": str(self.out),
            "verdict": self.verdict,
            "ok": self.ok,
            "incomplete": self.incomplete,
            "source_checked": self.source_checked,
            "problems": self.problems,
            "checked": self.checked,
        }


def read_manifest(out: Path) -> dict:
    """Load and validate ``OUT/glm-pack/manifest.json`` (raises IncompleteOutputError when it is missing from an
    existing ``glm-pack/``, ManifestError / GlmPackError; a ManifestError naming the path that cannot be looked at
    or read: a folder this user may not enter, as after ``chmod -R 644``, an I/O error)."""
    path = Path(out) / mf.OVERLAY_DIR / mf.MANIFEST_NAME
    try:
        data = _manifest_bytes(Path(out), path)
    except OSError as err:
        raise ManifestError(f"cannot read: {err.strerror or err}", file=err.filename or path) from err
    return mf.loads_checked(data, str(path))


def _manifest_bytes(out: Path, path: Path) -> bytes:
    """The bytes of ``path``, OUT's manifest, or the GlmPackError saying why OUT has none."""
    if not out.is_dir():
        why = "is a file, not a folder" if out.exists() else "does not exist"
        raise GlmPackError(f"{out} {why}: there is no converted output to check")
    if not path.is_file() and (out / mf.MANIFEST_NAME).is_file():
        raise GlmPackError(
            f"{out} is the {mf.OVERLAY_DIR}/ folder of a converted output: pass the output itself, "
            f"{out.resolve().parent}"  # resolved: 'verify .' inside it named '.'
        )
    if not path.parent.is_dir():  # every conversion makes glm-pack/ first: this folder was never an output
        raise GlmPackError(
            f"{out} is not a glm-pack output: it has no {mf.OVERLAY_DIR}/ folder "
            "(`glm-pack convert SRC OUT` writes one)"
        )
    if not path.is_file():
        raise IncompleteOutputError(
            f"incomplete output: {path} is missing (the conversion did not finish); it is not a valid glm-pack output",
            file=path,
        )
    return path.read_bytes()


def _load_overlay_tensor(overlay: Path, entry: mf.TensorEntry) -> torch.Tensor:
    """One overlay tensor, through glm-pack's own reader (any path: the safetensors library needs UTF-8)."""
    path = overlay / entry.file
    stat = path.stat()
    source, header = _overlay_header(path, stat.st_size, stat.st_mtime_ns)
    stored = header.tensors.get(entry.name)
    if stored is None:
        raise ManifestError("the overlay file lacks this tensor", file=source.name, tensor=entry.name)
    return read_tensor(source, stored)


@functools.lru_cache(maxsize=4)
def _overlay_header(path: Path, size: int, mtime_ns: int):
    """An overlay file and its parsed header, parsed once for its many tensors (an experts file holds hundreds);
    keyed by size and mtime too, so a rewritten file is parsed again."""
    source = LocalFile(path)
    return source, parse_header(source)


def stored_to_float(proj: mf.Projection, overlay: Path, tensors: dict[str, mf.TensorEntry]) -> torch.Tensor:
    """Dequantize a stored projection back to float32 ``[H, N, k_logical]``."""
    weight = _load_overlay_tensor(overlay, tensors[proj.weight])
    if proj.precision == "bf16":
        return weight[..., : proj.k_logical].float()
    scale = _load_overlay_tensor(overlay, tensors[proj.scale])
    codes, scales = unpack_bmm_nk(weight, scale, k_logical=proj.k_logical)
    return dequantize(codes, scales, axis=-1)


def _check_files(report: VerifyReport, overlay: Path, manifest: dict, tensors, progress: Progress) -> set[str]:
    """Hash every overlay file against the manifest; returns the files that failed (missing, unreadable, changed)."""
    bad_files, unhashed = set(), set()
    files = sorted(manifest["files"].items())
    progress("overlay files hashed", 0, len(files), 0)
    for done, (name, info) in enumerate(files, 1):
        hashed = _check_file(report, overlay, name, info, tensors)
        if hashed is not True:
            bad_files.add(name)
        if hashed is None:
            unhashed.add(name)
        progress("overlay files hashed", done, len(files), (overlay / name).stat().st_size if hashed is not None else 0)
    report.checked.append(f"{counted(len(files) - len(unhashed), 'overlay file')} hashed")
    return bad_files


def _check_file(report: VerifyReport, overlay: Path, name: str, info: dict, tensors) -> bool | None:
    """One overlay file against its manifest entry: True (same size and sha256), False (changed: the problem names
    the tensors that changed), None (missing or unreadable: not hashed, its layers not re-derived)."""
    path = overlay / name
    if not path.is_file():
        report.problems.append(f"overlay file missing: {path}")
        return None
    try:
        same = path.stat().st_size == info.get("size") and file_sha256(path) == info.get("sha256")
    except OutputError as err:  # unreadable (a permission, an I/O error)
        report.problems.append(str(err))
        return None
    if not same:
        changed = _changed_tensors(overlay, name, tensors)
        what = f" (changed tensors: {', '.join(changed)})" if changed else " (header or layout changed)"
        report.problems.append(f"overlay file {path} does not match its sha256 in the manifest{what}")
    return same


def _changed_tensors(overlay: Path, file: str, tensors) -> list[str]:
    changed = []
    for entry in tensors.values():
        if entry.file != file:
            continue
        try:
            if sha256_tensor(_load_overlay_tensor(overlay, entry)) != entry.sha256:
                changed.append(entry.name)
        except Exception:
            changed.append(entry.name)
    return changed


def _check_out_metadata(report: VerifyReport, out: Path, manifest: dict) -> None:
    """OUT's own config.json and index, which the runtime and engines read whatever ``--files`` was, must be those
    the overlay was made from; with the originals placed in OUT every one of them must be there, of its size
    (the source's README.md as README.source.md once a glm-pack card took its place; none for a source's README.md
    that is itself a glm-pack card, which ``card`` replaces)."""
    for name, key in (("config.json", "config_sha256"), (INDEX_NAME, "index_sha256")):
        path, recorded = out / name, manifest["source"].get(key)
        try:
            if path.is_file() and file_sha256(path) != recorded:
                report.problems.append(f"{path} differs from the {name} the overlay was made from")
        except OutputError as err:
            report.problems.append(str(err))
    if manifest["options"].get("files") == "none":
        return
    originals = manifest["source"].get("files", {})
    for name, info in sorted(originals.items()):
        path = out / name
        try:
            if name == "README.md" and info.get("glm_pack_card") and holds_card(path):
                continue  # a source's glm-pack card (it was a glm-pack output): `card` replaces it with OUT's own
            if name == "README.md" and SOURCE_README not in originals and (out / SOURCE_README).is_file():
                path = out / SOURCE_README  # `card` / `push` moved the source's card aside for glm-pack's own
            size = path.stat().st_size if path.is_file() else None
        except OSError as err:  # in a folder this user may list but not enter (chmod -R 644), an I/O error
            report.problems.append(f"cannot read {path}: {err.strerror or err}")
            continue
        except OutputError as err:  # the card named by holds_card
            report.problems.append(str(err))
            continue
        if size is None:
            report.problems.append(f"{path} is missing although the originals were placed in OUT")
        elif size != info.get("size"):
            report.problems.append(f"{path} has {size} bytes, the original {info.get('size')}")


def _source_root(out: Path, manifest: dict) -> Path | str | None:
    """Where the source tensors can be read: OUT itself when originals were placed, else the recorded path
    (or the recorded Hub commit, ``hf://org/name@sha``)."""
    if manifest["options"].get("files") != "none" and (out / "config.json").is_file():
        return out
    if manifest["source"].get("kind") == "hub":
        return f"hf://{manifest['source']['repo_id']}@{manifest['source']['revision']}"
    path = manifest["source"].get("path")
    return Path(path) if path and os.path.isfile(Path(path, "config.json")) else None  # False where it cannot be seen


def verify(out: str | Path, progress: Progress = _silent) -> VerifyReport:
    """Verify a converted output; never raises for a bad output, reports problems instead. ``ok`` with
    ``source_checked`` false: OUT's own files passed, but the source could not be reached to re-derive them.
    ``progress(phase, done, total, nbytes)`` is called before each phase's first step and after every step
    (phases: overlay files hashed, source tensors hashed, MLA layers re-derived, expert tensors unshuffled).

    Holds OUT's lock shared (other verifies may run beside it) and raises PlanError while a glm-pack run
    writes OUT; an OUT this user cannot write (no lock file there, none can be made) is verified without it.
    """
    with OutputLock(Path(out), shared=True, create=False):
        return verify_unlocked(out, progress)


def verify_unlocked(out: str | Path, progress: Progress = _silent) -> VerifyReport:
    """:func:`verify` without taking OUT's lock: for a caller that holds it (push)."""
    out = Path(out)
    report = VerifyReport(out=out)
    try:
        manifest = read_manifest(out)
    except GlmPackError as err:
        report.incomplete = isinstance(err, IncompleteOutputError)
        report.problems.append(str(err))
        return report
    overlay = out / mf.OVERLAY_DIR
    tensors = mf.parse_tensors(manifest)
    layers = mf.parse_mla(manifest)
    geom = mf.parse_geometry(manifest)
    bad_files = _check_files(report, overlay, manifest, tensors, progress)
    _check_precisions(report, manifest["options"], layers)
    quant_mode = manifest["options"].get("quant_mode")  # the run's scale rule, which BF16-kept errors need
    if quant_mode not in MODES:
        report.problems.append(
            f"options.quant_mode {quant_mode!r} is not one of {', '.join(MODES)}: MLA layers not re-derived"
        )
    _check_out_metadata(report, out, manifest)

    src_root = _source_root(out, manifest)
    if src_root is None:
        report.checked.append("overlay files only: source not reachable, layers not re-derived, errors not recomputed")
        return report
    from .checkpoint import open_checkpoint

    try:
        ckpt = open_checkpoint(src_root)
    except HubError as err:
        report.checked.append(
            f"overlay files only: source not reachable ({err}), layers not re-derived, errors not recomputed"
        )
        return report
    except (GlmPackError, OSError) as err:
        report.problems.append(f"cannot open the source at {src_root}: {err}")
        return report
    config = ckpt.store.where("config.json")
    same_geometry = ckpt.geometry == geom
    if not same_geometry:
        report.problems.append(
            f"geometry in the manifest {geom} contradicts {config} ({ckpt.geometry}): layers not re-derived"
        )
    if src_root != out:  # OUT's own were checked above
        if store_sha256(ckpt.store, "config.json") != manifest["source"]["config_sha256"]:
            report.problems.append(f"{config} differs from the config the overlay was made from")
        index_sha = manifest["source"].get("index_sha256")
        if index_sha and (ckpt.index_path is None or store_sha256(ckpt.store, INDEX_NAME) != index_sha):
            report.problems.append(f"the original index in {src_root} was changed or removed")
    hashed = 0
    sources = sorted(manifest["source"]["tensors"].items())
    progress("source tensors hashed", 0, len(sources), 0)
    for done, (name, sha) in enumerate(sources, 1):
        nbytes = 0
        try:
            if ckpt.raw_sha256(name) != sha:
                report.problems.append(f"source tensor {name} differs from the one the overlay was made from")
            hashed += 1
            nbytes = ckpt.info(name).nbytes
        except (GlmPackError, OSError) as err:
            report.problems.append(f"source tensor {name} unreadable: {err}")
        progress("source tensors hashed", done, len(sources), nbytes)
    report.checked.append(f"{counted(hashed, 'source tensor')} hashed")
    _check_layer_set(report, ckpt, layers)
    if not same_geometry:
        return report

    report.source_checked = True
    derived = unshuffled = 0
    todo = [
        layer
        for layer in (layers if quant_mode in MODES else [])
        if not any(tensors[t].file in bad_files for p in (layer.w_kc, layer.w_vc) for t in (p.weight, p.scale) if t)
    ]
    progress("MLA layers re-derived", 0, len(todo), 0)
    for done, layer in enumerate(todo, 1):
        with _rederiving(report, ckpt, f"MLA layer {layer.layer}", layer.source_tensor):
            _check_layer(report, ckpt, layer, geom, overlay, tensors, quant_mode)
            derived += 1
        progress("MLA layers re-derived", done, len(todo), 0)
    report.checked.append(f"{counted(derived, 'MLA layer')} re-derived from the source and compared byte for byte")
    groups = mf.parse_experts(manifest)
    experts = [name for _, file, names in groups if file not in bad_files for name in names]
    if experts:
        progress("expert tensors unshuffled", 0, len(experts), 0)
    for done, name in enumerate(experts, 1):
        with _rederiving(report, ckpt, "repacked expert tensor", name):
            _check_expert(report, ckpt, overlay, manifest, tensors, name)
            unshuffled += 1
        progress("expert tensors unshuffled", done, len(experts), 0)
    if groups:
        report.checked.append(f"{counted(unshuffled, 'repacked expert tensor')} unshuffled to the source bytes")
    return report


@contextmanager
def _rederiving(report: VerifyReport, ckpt, what: str, source_tensor: str):
    """Around one re-derivation: a source (or overlay) that cannot be read or derived becomes a problem naming
    ``what``, the source tensor and its file, and the block is left there."""
    try:
        yield
    except (GlmPackError, OSError) as err:
        rel = ckpt.weight_map.get(source_tensor)
        where = f"file {ckpt.store.where(rel)}" if rel else "absent from the source"
        report.problems.append(f"{what}: cannot re-derive from source tensor {source_tensor} ({where}): {err}")


def _check_precisions(report: VerifyReport, options: dict, layers: list[mf.MlaLayer]) -> None:
    """Every stored precision must be the one the recorded ``--mla-precision`` gives (``auto``: MXFP4 exactly
    where its recorded error is within ``max_rel_error``; the errors themselves are recomputed later)."""
    policy, threshold = options.get("mla_precision"), options.get("max_rel_error")
    if policy not in POLICIES:
        report.problems.append(f"options.mla_precision {policy!r} is not one of {', '.join(POLICIES)}")
        return
    if policy == "auto" and not isinstance(threshold, (int, float)):
        report.problems.append(f"options.max_rel_error {threshold!r} is not the number auto needs")
        return
    for proj in (p for layer in layers for p in (layer.w_kc, layer.w_vc)):
        want = stored_precision(policy, proj.mxfp4_rel_error, threshold)
        if proj.precision != want:
            auto = policy == "auto"
            rule = f" with max_rel_error {threshold} (MXFP4 error {proj.mxfp4_rel_error:.4g})" if auto else ""
            report.problems.append(
                f"{proj.weight}: stored {proj.precision}, but options.mla_precision {policy}{rule} gives {want}"
            )


def _check_layer_set(report: VerifyReport, ckpt, layers: list[mf.MlaLayer]) -> None:
    """The manifest must hold exactly the MLA layers convert derives from this source, each from its own
    kv_b_proj (the runtime serves a layer from the entry that names it)."""
    recorded, planned = {layer.layer for layer in layers}, set(ckpt.mla_layers())
    if recorded - planned:
        report.problems.append(f"the manifest has MLA layers the source lacks: {sorted(recorded - planned)}")
    if planned - recorded:
        report.problems.append(f"the manifest lacks MLA layers of the source: {sorted(planned - recorded)}")
    for layer in layers:
        if layer.layer in planned and layer.source_tensor != ckpt.card.kv_b_proj(layer.layer):
            report.problems.append(
                f"MLA layer {layer.layer} is recorded as derived from {layer.source_tensor}, "
                f"not from its own {ckpt.card.kv_b_proj(layer.layer)}"
            )


def _check_layer(report: VerifyReport, ckpt, layer: mf.MlaLayer, geom, overlay: Path, tensors, quant_mode) -> None:
    """Re-derive the layer's stored tensors from the source as convert does (with the run's ``quant_mode``; w_vc of
    an MXFP4 source from its bytes); bytes, scale rule and both recorded errors must be what that gives."""
    kv_b, kv_b_mxfp4 = ckpt.read_float_and_mxfp4(layer.source_tensor)
    w_kc, w_vc = split_kv_b(kv_b, geom)
    vc_source = split_kv_b_mxfp4_vc(*kv_b_mxfp4, geom) if kv_b_mxfp4 else None
    for proj, ref, mx_source in ((layer.w_kc, w_kc, None), (layer.w_vc, w_vc, vc_source)):
        expected = store_projection(
            ref,
            k_stored=proj.k_stored,
            quant_mode=quant_mode,
            policy=proj.precision,
            max_rel_error=None,
            mxfp4_source=mx_source,
        )
        stored = [_load_overlay_tensor(overlay, tensors[proj.weight])]
        if proj.scale:
            stored.append(_load_overlay_tensor(overlay, tensors[proj.scale]))
        derived = [expected.weight] + ([expected.scale] if expected.scale is not None else [])
        differ = f"stored bytes differ from those re-derived from {layer.source_tensor}"
        if len(stored) != len(derived):  # a scale where the source gives none, or none where it gives one
            report.problems.append(f"{proj.weight}: {differ}")
        else:  # name the tensor that differs: the weight, its scale or both
            names = [proj.weight, proj.scale][: len(stored)]
            report.problems += [
                f"{name}: {differ}" for name, a, b in zip(names, stored, derived, strict=True) if not torch.equal(a, b)
            ]
        if proj.quant_mode != expected.quant_mode:
            report.problems.append(
                f"{proj.weight}: recorded scale rule {proj.quant_mode!r}, but the source gives {expected.quant_mode!r}"
            )
        err, head_err = rel_errors(stored_to_float(proj, overlay, tensors), ref)
        if not _same_error(err, proj.rel_error):
            report.problems.append(
                f"{proj.weight}: error vs source {err:.6g} differs from the recorded {proj.rel_error:.6g}"
            )
        if proj.max_head_rel_error is not None and not _same_error(head_err, proj.max_head_rel_error):
            report.problems.append(
                f"{proj.weight}: worst head's error vs source {head_err:.6g} differs from the recorded "
                f"max_head_rel_error {proj.max_head_rel_error:.6g}"
            )
        if not _same_error(expected.mxfp4_rel_error, proj.mxfp4_rel_error):
            report.problems.append(
                f"{proj.weight}: MXFP4 error vs source {expected.mxfp4_rel_error:.6g} differs from the recorded "
                f"mxfp4_rel_error {proj.mxfp4_rel_error:.6g}"
            )


def _same_error(recomputed: float, recorded: float) -> bool:
    return math.isfinite(recomputed) and abs(recomputed - recorded) <= ERROR_TOLERANCE * recorded + 1e-7


def _check_expert(report: VerifyReport, ckpt, overlay: Path, manifest: dict, tensors, name: str) -> None:
    """A repacked expert tensor, unshuffled with its recorded layout, must equal the source tensor's bytes."""
    params = dict(manifest["tensors"][name]["layout"])
    layout = get_layout(params.pop("layout"))
    restored = layout.unpack(_load_overlay_tensor(overlay, tensors[name]), **params)
    if not torch.equal(restored, ckpt.read_raw(name)):
        report.problems.append(f"{name}: unshuffled bytes differ from the source tensor")
