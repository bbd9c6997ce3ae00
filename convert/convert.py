"""``glm-pack convert``: derive, quantize and lay out every MLA layer's w_kc / w_vc into an overlay.

Output directory::

    OUT/<original files>                 hard-linked, copied or left out; the index is never edited
    OUT/glm-pack/layer-NNN.safetensors   one overlay file per MLA layer (w_kc/w_vc weight + weight_scale)
    OUT/glm-pack/experts-NNN-PP.safetensors  repacked routed experts of MoE layer NNN, part PP (repack_experts only)
    OUT/glm-pack/manifest.json           written last: its presence marks a complete conversion

Work items run in ``workers`` processes; results enter the manifest in item order, so the output is
byte-identical for every worker count. Run state (lock, journal) is in :mod:`.state`; an interrupted run
continues with ``resume=True``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import NamedTuple

from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import check_bound, check_choices
from glm_pack.packing.errors import CheckpointError, GlmPackError, PlanError
from glm_pack.packing.experts import moe_layout_description

from . import space, state
from .checkpoint import INDEX_NAME, Checkpoint, hub_spec, open_checkpoint
from .hub_common import hub_taken
from .items import (
    Settings,
    is_entry_of,
    payload_bytes,
    plan_items,
    run_item,
    run_item_in_worker,
    tensor_count,
    worker_init,
)
from .machine import usable_cores
from .modelcard import holds_card
from .mounts import Mount, fs_location, read_mounts
from .plan import check_files_mode, kernel_route, resolve_k_up
from .writer import (
    NoSpaceError,
    OutputError,
    clear_directory,
    fsync_path,
    is_temp,
    list_folder,
    remove,
    temp_path,
    write_text,
)

TOOL_VERSION = "0.1.0"


@dataclass(frozen=True)
class ConvertOptions:
    quant_mode: str = "even"
    k_pad: str = "card"  # "card" (the card's default), "none", or a multiple such as "256"
    mla_precision: str = "mxfp4"
    max_rel_error: float | None = None
    files: str | None = None  # None: "link" for a local source, "none" for a Hub source
    overwrite: bool = False
    resume: bool = False
    workers: int = 1
    repack_experts: str = "none"
    space_check: bool = True  # refuse a run whose writes exceed the free space (:mod:`.space`)

    def recorded(self, k_multiple: int | None) -> dict:
        """The options that shape the output (recorded in the manifest; a resume must match them)."""
        return {
            "quant_mode": self.quant_mode,
            "k_pad": k_multiple,
            "mla_precision": self.mla_precision,
            "max_rel_error": self.max_rel_error,
            "files": self.files,
            "repack_experts": self.repack_experts,
        }


class ProjectionReport(NamedTuple):
    precision: str  # stored: "mxfp4" or "bf16"
    rel_error: float  # of the stored tensor vs the float source split
    mxfp4_rel_error: float  # what MXFP4 gives (equals rel_error when MXFP4 was kept)
    max_head_rel_error: float | None  # of the stored tensor, its worst head (None from a journal that predates it)
    quant_mode: str | None  # the recorded scale rule ("even", ..., "source"); None for BF16


@dataclass
class LayerReport:
    layer: int
    source_format: str  # of the layer's kv_b_proj, e.g. "bf16", "fp8-block", "mxfp4"
    w_kc: ProjectionReport
    w_vc: ProjectionReport


@dataclass
class ConvertReport:
    out: Path
    layers: list[LayerReport] = field(default_factory=list)
    overlay_bytes: int = 0
    expert_tensors: int = 0
    original_files: int = 0
    resumed_items: int = 0
    hub_bytes: int | None = None  # payload bytes fetched from the Hub (None for a local source)
    seconds: float = 0.0


def file_digest(path: Path, h) -> str:
    """Hex digest of the hashlib object ``h`` (possibly fed a prefix already) once the file's bytes follow, read in
    16 MiB blocks; OutputError naming the file where it cannot be read (a permission, an I/O error)."""
    try:
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
    except OSError as err:
        raise OutputError(f"cannot read: {err.strerror or err}", file=path) from err
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return file_digest(path, hashlib.sha256())


def store_sha256(store, rel: str) -> str:
    """sha256 of a whole (small) source file read through the checkpoint's store."""
    source = store.open(rel)
    return hashlib.sha256(source.read(0, source.size())).hexdigest()


def is_hub(ckpt: Checkpoint) -> bool:
    return getattr(ckpt.store, "kind", "local") == "hub"


def files_mode(src: str | os.PathLike, files: str | None) -> str:
    """``--files`` for the source ``src``: default link (local directory) or none (Hub repo). Decided before the
    source is opened, so a refusal reaches no Hub: a Hub repo has no local files to link, and offline none can be
    copied (its full file list is unknown)."""
    spec = hub_spec(src)
    files = files or ("none" if spec else "link")
    check_files_mode(files)
    if spec and files == "link":
        raise PlanError(
            f"--files link needs a local source: {src} is {hub_taken(src)}, which has no "
            "local files to link; use --files copy "
            "(downloads the originals into the Hugging Face cache and links them into OUT) or --files none "
            "(overlay only)"
        )
    if spec and files == "copy":
        from .hub_source import refuse_copy_offline

        refuse_copy_offline(*spec)
    return files


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path``, None where it does not exist or cannot be read."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _within(path: Path, folder: Path, mounts: list[Mount]) -> bool:
    """``path`` is ``folder`` or lies inside it: by resolved path, by identity (a bind mount of ``folder`` or of a
    folder above it reaches it by a path no path comparison relates), or by the location inside one filesystem
    the mount table gives (a bind mount of a folder inside ``folder``, which shares no identity with it)."""
    path, folder = path.resolve(), folder.resolve()
    if path == folder or folder in path.parents:
        return True
    target = _identity(folder)
    if target is not None and any(_identity(p) == target for p in (path, *path.parents)):
        return True
    inner, outer = fs_location(path, mounts), fs_location(folder, mounts)
    return inner is not None and outer is not None and inner[0] == outer[0] and (
        inner[1] == outer[1] or outer[1] in inner[1].parents
    )


def check_locations(src: Path, out: Path, files: Iterable[Path] = (), what: str = "the source") -> None:
    """Refuse an OUT that is ``src``, inside it, contains it, or contains the file behind one of the source ``files``
    (a HF cache snapshot's links point into ``blobs/``, which ``--overwrite`` would empty), by path or through a
    bind mount, or that is the ``glm-pack/`` folder of a conversion. For a Hub source ``src`` is the repo's folder in
    the local HF cache, ``what`` says so."""
    mounts = read_mounts()
    if _within(out, src, mounts) or _within(src, out, mounts):
        raise PlanError(f"output {out} must be outside {what} {src} (and not contain it)", file=out)
    for rel in files:
        if _within(src / rel, out, mounts):
            raise PlanError(
                f"output {out} must not hold the source's files: {src / rel} is {(src / rel).resolve()}", file=out
            )
    if os.path.exists(out) and not os.path.isdir(out):  # False in a folder this user cannot enter: the lock says so
        raise PlanError(f"output {out} exists and is not a directory", file=out)
    if out.name == mf.OVERLAY_DIR and any(os.path.isfile(out / name) for name in (mf.MANIFEST_NAME, state.RUN_NAME)):
        raise PlanError(  # --overwrite there would replace that conversion's overlay with a checkpoint in it
            f"output {out} is the overlay folder of the conversion in {out.parent}: convert into {out.parent} "
            "(--overwrite redoes that conversion) or into another folder",
            file=out,
        )


def run_differences(previous: dict, run: dict) -> list[str]:
    """What differs between an interrupted run's record and this run's: options, source, tool, source files."""

    def show(key: str, value) -> str:
        if key == "--k-pad" and value is None:  # the recorded K multiple; --k-pad none records none
            return "none"
        return value if isinstance(value, str) else json.dumps(value)

    before = previous.get("options") or {}
    options = sorted(before.keys() | run["options"].keys())
    pairs = [("--" + key.replace("_", "-"), before.get(key), run["options"].get(key)) for key in options]
    pairs += [(key, previous.get(key), run[key]) for key in ("source", "tool")]
    found = [f"{key}: {show(key, a)} (interrupted run) vs {show(key, b)} (this run)" for key, a, b in pairs if a != b]
    if not found:  # same options and source: its files changed since
        stats = previous.get("stats") or {}
        changed = sorted(f for f in stats.keys() | run["stats"].keys() if stats.get(f) != run["stats"].get(f))
        if changed:
            found = [f"source files changed since: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}"]
    return found or ["its run record (glm-pack/.run.json) differs from this run's"]


def _unstarted_dir(path: Path) -> bool:
    """A real folder with nothing but temp files in it (what a run killed right after creating ``glm-pack/``, or
    while writing its run record there, leaves)."""
    return path.is_dir() and not path.is_symlink() and all(is_temp(p) for p in list_folder(path))


def output_leftovers(out: Path) -> list[Path]:
    """What of an existing folder OUT a new conversion has to delete first (``--overwrite``): every entry but the
    lock and a ``glm-pack/`` holding only temp files. OutputError naming OUT where it cannot be listed."""
    return [p for p in list_folder(out) if p.name != state.LOCK_NAME and not _unstarted_dir(p)]


FitCheck = Callable[[set[str], list[Path]], None]  # (overlay files a resume keeps, what --overwrite deletes first)


def prepare_output(out: Path, overlay: Path, options: ConvertOptions, run: dict, fits: FitCheck) -> list[dict]:
    """Decide what an existing OUT means; returns journal entries a resume may keep (re-checked later). ``fits`` is
    called once the decision is made and before anything is deleted or written. OutputError naming the path that
    cannot be looked at (a folder of OUT this user cannot enter, as after ``chmod -R 644``, an I/O error)."""
    try:
        return _prepare_output(out, overlay, options, run, fits)
    except OSError as err:
        raise OutputError(f"cannot read {err.filename}: {err.strerror or err}", file=err.filename) from err


def _prepare_output(out: Path, overlay: Path, options: ConvertOptions, run: dict, fits: FitCheck) -> list[dict]:
    try:
        previous = state.read_run(overlay)
    except PlanError:  # a run record that is no JSON object, nothing to resume: --overwrite starts over, as it says
        if not options.overwrite:
            raise
        previous = None
    complete = (overlay / mf.MANIFEST_NAME).is_file()
    if options.resume and previous is not None and not complete:
        if previous != run:
            raise PlanError(
                f"this run differs from the interrupted one: {'; '.join(run_differences(previous, run))}; rerun "
                "with the interrupted run's options and --resume to finish it, or with --overwrite instead of "
                "--resume to start over",
                file=overlay / state.RUN_NAME,
            )
        entries = state.Journal(overlay).entries()
        fits({e["file"] for e in entries if isinstance(e.get("file"), str) and (overlay / e["file"]).is_file()}, [])
        return entries
    if options.resume and complete:
        raise PlanError("the output is already complete; nothing to resume", file=overlay / mf.MANIFEST_NAME)
    if previous is not None and not complete and not options.overwrite:
        raise PlanError(
            "the output holds an interrupted conversion; rerun with --resume to finish it, "
            "or --overwrite to start over",
            file=out,
        )
    leftovers = output_leftovers(out)
    if leftovers and not options.overwrite:
        if complete:  # convert run again on its own output (or into another conversion)
            raise PlanError(
                f"output {out} already holds a finished conversion: `glm-pack verify {out}` checks it; pass "
                "--overwrite to convert again into it (everything in it is replaced)",
                file=out,
            )
        raise PlanError(f"output {out} is not empty; pass --overwrite to replace its contents", file=out)
    fits(set(), leftovers)
    if leftovers:  # --overwrite: nothing of the old contents may stay beside the new output
        if overlay.is_dir() and not overlay.is_symlink():  # a link is replaced itself, never what it points to
            remove(overlay / mf.MANIFEST_NAME)  # first: never a manifest over partial files
        clear_directory(out, keep={state.LOCK_NAME})
    try:
        overlay.mkdir(exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create {overlay}: {err.strerror or err}", file=overlay) from err
    state.write_run(overlay, run)
    return []


def place_original(src_file: Path, dst: Path, mode: str) -> bool:
    """Hard-link (falling back to copy across filesystems) or copy one original file, via a temp name.

    Returns True when the bytes were copied: the caller fsyncs copies, and the folders of every placed file (see
    :func:`fsync_files`), before the manifest claims completeness.
    """
    tmp = temp_path(dst)
    copied = mode != "link"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)  # an original in a folder of the source
        tmp.unlink(missing_ok=True)
        if not copied:
            try:
                os.link(src_file.resolve(), tmp)  # a symlinked source (HF cache): link the real blob
            except OSError:
                copied = True
        if copied:
            shutil.copyfile(src_file, tmp)
        os.replace(tmp, dst)
        tmp.unlink(missing_ok=True)  # renaming onto a link to the same file (a resumed run) leaves tmp as it is
    except BaseException as err:
        tmp.unlink(missing_ok=True)  # whatever stopped it: no partial copy stays (a Ctrl-C lands mid-copy)
        if not isinstance(err, OSError):
            raise
        if not src_file.is_file():  # the source vanished, not the destination's fault
            raise source_changed(src_file, vanished=True) from err
        if err.errno == errno.ENOSPC:
            raise NoSpaceError(f"no space left on device while placing {dst}", file=dst) from err
        raise OutputError(f"cannot place {dst}: {err.strerror or err}", file=dst) from err
    return copied


def check_space(
    ckpt: Checkpoint,
    out: Path,
    options: ConvertOptions,
    stats: dict,
    sizes: dict[str, int],
    kept: set[str],
    clearing: list[Path],
) -> None:
    """OutputError unless this run's writes fit (:mod:`.space`): the overlay files (``sizes``: bytes counted by file)
    a resume does not keep (``kept``); the originals (``stats``: {file: [size, ...]}) copied into OUT (all of them with
    ``--files copy``; with ``link``, those on another filesystem) or downloaded into the HF cache. ``clearing``: what
    ``--overwrite`` deletes first (its freed bytes count as free, and nothing of OUT as placed already)."""
    if not options.space_check:
        return
    writes = space.Writes("this conversion")
    writes.add(out, "overlay files", sum(n for file, n in sizes.items() if file not in kept))
    cache = ckpt.store.cache_folder() if is_hub(ckpt) else None  # a Hub source's originals: downloaded, then linked
    out_device = space.device(out)
    placed = stats.items() if options.files != "none" else ()
    for rel, (size, *_) in placed:
        if cache and not ckpt.store.in_cache(rel):
            writes.add(cache, "downloads into the Hugging Face cache", size)
        if not clearing and (out / rel).is_file() and (out / rel).stat().st_size == size:
            continue  # placed by the interrupted run this one resumes
        copied = options.files == "copy" and not cache
        if copied or space.device(cache or ckpt.root / rel) != out_device:
            writes.add(out, "copies of the original files", size)
    writes.check(space.freed_bytes(clearing), out)


def fsync_files(paths: list[Path], folders: Iterable[Path] = ()) -> None:
    """fsync copied files, then their folders and ``folders`` (those of hard-linked files: a link's name is on disk
    only then). Called after all copies: the kernel writes back meanwhile."""
    for path in [*paths, *sorted({p.parent for p in paths}.union(folders))]:
        fsync_path(path)


def source_files(ckpt: Checkpoint) -> tuple[list[Path], dict[str, list[int]]]:
    """The source's files (relative; hidden and glm-pack/ entries skipped) and their stats; a Hub commit is
    immutable, so its listing is its fingerprint."""
    listing = ckpt.store.list_files()
    originals = [Path(rel) for rel, _ in listing]
    if is_hub(ckpt):
        return originals, {rel: [size, 0] for rel, size in listing}
    return originals, source_stats(ckpt.root, originals)


def source_changed(file: Path, vanished: bool = False) -> GlmPackError:
    """The error of a source that changed (``vanished``: this file disappeared) under a running conversion."""
    why = " (this file disappeared)" if vanished else ""
    return GlmPackError(f"source files changed during conversion{why}; no manifest written", file=file)


def source_stats(root: Path, files: list[Path]) -> dict[str, list[int]]:
    """{file: [size, mtime_ns]} of the source files: a conversion refuses to finish if these change."""
    out = {}
    for rel in files:
        try:
            st = (root / rel).stat()
        except FileNotFoundError as err:
            raise source_changed(root / rel, vanished=True) from err
        except OSError as err:
            raise CheckpointError(f"cannot read: {err.strerror or err}", file=str(root / rel)) from err
        out[str(rel)] = [st.st_size, st.st_mtime_ns]
    return out


def _kept(entries: list, overlay: Path, items) -> dict[str, dict]:
    """Journalled items whose entry is the one their item wrote and whose file still hashes to its sha256; the
    others (a changed file, a line from another item or another glm-pack) are redone (a line edited by hand or
    damaged is not an entry: :meth:`state.Journal.entries`)."""
    planned = {item.file: item for item in items}
    kept = {}
    for entry in entries:
        file = entry.get("file") if isinstance(entry, dict) else None
        item = planned.get(file) if isinstance(file, str) else None
        if item and is_entry_of(entry, item) and (overlay / file).is_file():
            if file_sha256(overlay / file) == entry["sha256"]:
                kept[file] = entry
    return kept


def _run_items(ckpt: Checkpoint, todo, settings: Settings, overlay: Path, workers: int, on_done) -> None:
    if workers <= 1 or len(todo) <= 1:
        for item in todo:
            on_done(run_item(ckpt, item, settings, overlay))
        return
    threads = max(1, usable_cores() // workers)
    ctx = get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=worker_init, initargs=(threads, os.getpid())
    ) as pool:
        files = {pool.submit(run_item_in_worker, str(ckpt.root), i, settings, str(overlay)): i.file for i in todo}
        pending = set(files)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    on_done(fut.result())
        except BrokenProcessPool as err:
            unfinished = sorted(files[f] for f in pending | {f for f in files if f.done() and f.exception()})
            raise OutputError(
                f"a worker process died (killed, or out of memory?) while writing {', '.join(unfinished[:4])}"
                f"{' ...' if len(unfinished) > 4 else ''}; finished files are kept: rerun with --resume, and with "
                f"--workers below {workers} if memory ran out (each worker process holds about 0.5 GiB)",
                file=overlay,
            ) from err
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise


def convert(src: str | os.PathLike, out: str | os.PathLike, options: ConvertOptions, progress=None) -> ConvertReport:
    """Run the whole conversion; raises a GlmPackError subclass on any problem (no manifest is written then).

    ``progress(phase, done, total, nbytes)`` is called as the work goes: phase ``"overlay files"`` once a run has
    decided what to do (``nbytes`` 0) and after each work item (its file's bytes), ``"original files"`` before the
    originals are placed and after each one (``nbytes``: its bytes where copied, else 0).
    """
    started = time.monotonic()
    if options.workers < 1:
        raise PlanError(f"--workers must be at least 1, got {options.workers}")
    check_choices(options.quant_mode, options.mla_precision)
    check_bound(options.mla_precision, options.max_rel_error)
    options = replace(options, files=files_mode(src, options.files))
    ckpt = open_checkpoint(src)
    hub = is_hub(ckpt)
    out = Path(out)
    originals, stats = source_files(ckpt)
    if hub:  # --overwrite must not empty the cached files a Hub source is read from (and linked into OUT)
        check_locations(ckpt.store.cache_folder(), out, what=f"the Hugging Face cache of {ckpt.store.repo_id}")
    else:
        check_locations(ckpt.root, out, originals)
    geom = ckpt.geometry
    k_multiple, k_kc = resolve_k_up(ckpt.card, geom, options.k_pad, options.mla_precision)
    settings = Settings(k_kc, options.quant_mode, options.mla_precision, options.max_rel_error)
    run = {
        "tool": TOOL_VERSION,
        "options": options.recorded(k_multiple),
        "source": ckpt.store.where("") if hub else str(ckpt.root.resolve()),
        "stats": stats,
    }
    overlay = out / mf.OVERLAY_DIR
    items = plan_items(ckpt, options.repack_experts)
    sizes = {item.file: payload_bytes(ckpt, item, settings) + space.overhead(tensor_count(item)) for item in items}
    report = ConvertReport(out=out)

    def fits(kept: set[str], clearing: list[Path]) -> None:
        check_space(ckpt, out, options, stats, sizes, kept, clearing)

    with state.OutputLock(out):
        journal_entries = prepare_output(out, overlay, options, run, fits)
        journal = state.Journal(overlay)
        results = _kept(journal_entries, overlay, items)
        journal.rewrite(list(results.values()))
        report.resumed_items = len(results)
        todo = [i for i in items if i.file not in results]

        def on_done(entry: dict) -> None:
            journal.append(entry)
            results[entry["file"]] = entry
            if progress is not None:
                progress("overlay files", len(results), len(items), entry["size"])

        if hub and options.files == "copy":  # download first: the work items then read the local copies
            for rel in originals:
                ckpt.store.download(rel.as_posix())
        if progress is not None:
            progress("overlay files", len(results), len(items), 0)
        # A Hub source read by ranges is read by this process alone (one reader; the network is the bottleneck).
        workers = 1 if hub and options.files != "copy" else options.workers
        _run_items(ckpt, todo, settings, overlay, workers, on_done)
        if options.files != "none":
            copied = []
            if progress is not None:
                progress("original files", 0, len(originals), 0)
            for done, rel in enumerate(originals):
                # A Hub source: hard-link the HF cache blob (copied across filesystems).
                src_file = ckpt.store.download(rel.as_posix()) if hub else ckpt.root / rel
                nbytes = 0
                if place_original(src_file, out / rel, "link" if hub else options.files):
                    copied.append(out / rel)
                    nbytes = stats[str(rel)][0]
                if progress is not None:
                    progress("original files", done + 1, len(originals), nbytes)
            fsync_files(copied, {(out / rel).parent for rel in originals})
            report.original_files = len(originals)
        if not hub and source_stats(ckpt.root, originals) != stats:
            raise source_changed(ckpt.root)
        ordered = [results[i.file] for i in items]
        # a source that is itself a glm-pack output brings its card, which `card` replaces without keeping it
        cards = {"README.md"} if options.files != "none" and holds_card(out / "README.md") else set()
        manifest = build_manifest(ckpt, options, k_multiple, settings, ordered, stats, cards)
        mf.parse_mla(manifest)  # never write a manifest the runtime would refuse
        write_text(overlay / mf.MANIFEST_NAME, mf.dumps(manifest))
        state.clear_run(overlay)
    for entry in ordered:
        report.overlay_bytes += entry["size"]
        if "experts" in entry:
            report.expert_tensors += len(entry["experts"]["tensors"])
            continue
        m = entry["mla"]
        report.layers.append(
            LayerReport(
                m["layer"],
                m["source"]["format"],
                *(
                    ProjectionReport(
                        m[p]["precision"],
                        m[p]["rel_error"],
                        m[p]["mxfp4_rel_error"],
                        m[p].get("max_head_rel_error"),
                        m[p]["quant"].get("mode"),
                    )
                    for p in ("w_kc", "w_vc")
                ),
            )
        )
    report.hub_bytes = ckpt.store.transferred if hub else None
    report.seconds = time.monotonic() - started
    return report


def _experts_section(entries) -> dict:
    groups = [e["experts"] for e in entries if "experts" in e]
    return {"experts": {**moe_layout_description(), "groups": groups}} if groups else {}


def build_manifest(
    ckpt: Checkpoint, options: ConvertOptions, k_multiple, settings: Settings, entries, stats, cards: set[str]
) -> dict:
    """The manifest; ``cards``: the originals placed in OUT that are glm-pack model cards."""
    geom = ckpt.geometry
    route = kernel_route(settings.k_kc, geom.qk_nope_head_dim)
    source_tensors: dict[str, str] = {}
    tensors: dict[str, dict] = {}
    for entry in entries:
        source_tensors.update(entry["source_tensors"])
        tensors.update(entry["tensors"])
    return {
        "schema": mf.SCHEMA,
        "schema_version": mf.SCHEMA_VERSION,
        "tool": {"name": "glm-pack", "version": TOOL_VERSION},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {
            "kind": "hub" if is_hub(ckpt) else "local",
            "path": None if is_hub(ckpt) else str(ckpt.root.resolve()),
            "repo_id": ckpt.store.repo_id if is_hub(ckpt) else None,
            "revision": ckpt.store.sha if is_hub(ckpt) else None,  # the resolved commit: immutable
            "config_sha256": store_sha256(ckpt.store, "config.json"),
            "index_sha256": store_sha256(ckpt.store, INDEX_NAME) if ckpt.index_path else None,
            "files": {
                name: {"size": size, **({"glm_pack_card": True} if name in cards else {})}
                for name, (size, _) in sorted(stats.items())
            },
            "tensors": dict(sorted(source_tensors.items())),
        },
        "model": {
            "card": ckpt.card.name,
            "architectures": ckpt.config.get("architectures", []),
            "model_type": ckpt.config.get("model_type"),
            "geometry": geom.as_dict(),
        },
        "options": options.recorded(k_multiple),
        "mla": [e["mla"] for e in entries if "mla" in e],
        **_experts_section(entries),
        "tensors": tensors,
        "files": {e["file"]: {"size": e["size"], "sha256": e["sha256"]} for e in entries},
        "kernel_configs": {"route": route, "configs": ckpt.card.kernel_configs(route)},
    }
