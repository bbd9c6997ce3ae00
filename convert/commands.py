"""Click commands ``convert``, ``verify`` and ``demo``: presentation only, the work is in convert.py/verify.py."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from glm_pack.packing import manifest as mf
from glm_pack.packing.absorb import POLICIES
from glm_pack.packing.errors import PlanError, VerifyError

from . import state
from .cli_types import KPad
from .convert import ConvertOptions, ConvertReport, convert, output_leftovers
from .humanize import counted, size_text
from .interrupts import stopped_how
from .items import REPACK_MODES
from .machine import default_workers, usable_cores, use_threads
from .modelcard import error_cells, fmt_error, source_error_text, worst_head_text
from .plan import FILE_MODES
from .verify import VerifyReport, verify
from .writer import NoSpaceError, OutputError

console = Console(stderr=False, emoji=False, soft_wrap=True)  # ":cd:" in a path is no emoji code; lines never wrap


def _max_errors(projections) -> str:
    """'max E, worst head W' over one projection of every layer."""
    return f"max {fmt_error(max((p.rel_error for p in projections), default=0))}{worst_head_text(projections)}"


def _summary(report: ConvertReport) -> None:
    # No padding at the table's edges: 79 columns, so piped output (80) does not wrap a header in two.
    table = Table(title=f"MLA overlay in {escape(str(report.out))}", show_lines=False, pad_edge=False)
    for col in ("layer", "w_kc", "w_kc rel err", "worst head", "w_vc", "w_vc rel err", "worst head"):
        table.add_column(col, justify="right" if "err" in col or col in ("layer", "worst head") else "left")
    for r in report.layers:
        table.add_row(str(r.layer), *(cell for p in (r.w_kc, r.w_vc) for cell in error_cells(p)))
    console.print(table)
    bf16 = sum((r.w_kc.precision == "bf16") + (r.w_vc.precision == "bf16") for r in report.layers)
    console.print(
        f"{counted(len(report.layers), 'MLA layer')}, overlay {size_text(report.overlay_bytes)}, "
        f"{counted(report.expert_tensors, 'expert tensor')} repacked, "
        f"{counted(report.original_files, 'original file')} placed, {counted(bf16, 'tensor')} kept in BF16; rel error "
        + ", ".join(f"{name} {_max_errors([getattr(r, name) for r in report.layers])}" for name in ("w_kc", "w_vc"))
        + f"; {report.seconds:.1f} s"
    )
    if note := source_error_text(report.layers):
        console.print(note)
    if report.resumed_items:
        console.print(f"resumed: {counted(report.resumed_items, 'finished overlay file')} re-checked by hash and kept")
    if report.hub_bytes is not None:
        console.print(f"read {report.hub_bytes:,} bytes ({size_text(report.hub_bytes)}) from the Hub")


@contextmanager
def phase_bars(*, disable: bool, transient: bool) -> Iterator:
    """A ``progress(phase, done, total, nbytes)`` callback drawing one bar per phase of the work (done of total,
    MiB/s of the ``nbytes`` its steps moved, where they moved any; a phase of no steps gets none). The bars start
    with the first report: a command refused before it prints nothing but its error line."""
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        "[cyan]{task.fields[rate]}",
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    quiet = disable or (transient and not console.is_terminal)  # off a terminal they would leave just a blank line
    bar = Progress(*columns, console=console, disable=quiet, transient=transient)
    tasks: dict[str, list] = {}  # phase -> [task id, its start time, bytes moved]
    elapsed = console.get_time

    def progress(phase: str, done: int, total: int, nbytes: int) -> None:
        if phase not in tasks and not total:
            return
        if not bar.live.is_started:
            bar.start()
        if phase not in tasks:
            tasks[phase] = [bar.add_task(phase, total=total, rate=""), elapsed(), 0]
        task, start, moved = tasks[phase]
        tasks[phase][2] = moved = moved + nbytes
        rate = moved / max(elapsed() - start, 1e-9) / 2**20
        bar.update(task, completed=done, total=total, rate=f"{rate:.0f} MiB/s" if moved else "")  # none: linked

    try:
        yield progress
    finally:
        if bar.live.is_started:
            bar.stop()


def run_convert(src, out, options: ConvertOptions, quiet: bool = False) -> ConvertReport:
    use_threads(usable_cores())  # the work of --workers 1 runs in this process
    with phase_bars(disable=quiet, transient=False) as progress:
        report = convert(src, out, options, progress=progress)
    if not quiet:
        _summary(report)
    return report


# The options convert and inspect share (inspect shows the plan convert would carry out with them).
_PLAN_OPTIONS = {
    "--quant-mode": {"type": click.Choice(["even", "mse"]), "default": "even", "show_default": True},
    "--k-pad": {"type": KPad(), "default": "card", "show_default": True},
    "--mla-precision": {"type": click.Choice(POLICIES), "default": "mxfp4", "show_default": True},
    "--files": {"type": click.Choice(FILE_MODES), "default": None},
    "--repack-experts": {"type": click.Choice(REPACK_MODES), "default": "none", "show_default": True},
}


def plan_option(name: str, help_text: str):
    """One of the options convert and inspect share (same choices and default), with the command's own help."""
    return click.option(name, help=help_text, **_PLAN_OPTIONS[name])


@click.command("convert")
@click.argument("src")
@click.argument("out", type=click.Path(file_okay=False))
@plan_option("--quant-mode", "MXFP4 scale rule: even (aiter/Quark) or mse (best of three exponents per block).")
@plan_option(
    "--k-pad",
    "K padding of w_kc: 'card' (family default: 192 -> 256 for GLM-5), 'none', or N, a multiple of 32 "
    "(K rounded up to a multiple of N).",
)
@plan_option(
    "--mla-precision",
    "Storage of w_kc/w_vc; auto keeps a tensor in BF16 when its MXFP4 error exceeds --max-rel-error.",
)
@click.option(
    "--max-rel-error",
    type=float,
    default=None,
    help="Threshold for --mla-precision auto (e.g. 0.12): a finite relative error >= 0; only with auto.",
)
@plan_option(
    "--files",
    "Original files: hard-link (copy across filesystems), copy, or leave out. Default: link for a local "
    "SRC, none for a Hub SRC (copy downloads the originals into the HF cache and hard-links them into OUT).",
)
@click.option("--overwrite", is_flag=True, help="Replace the contents of a non-empty OUT (everything in it goes).")
@click.option(
    "--resume",
    is_flag=True,
    help="Finish an interrupted conversion run with the same options (finished files are re-hashed, kept).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=default_workers,
    show_default="one per core glm-pack may use, at most one per GiB of memory it may take",
    envvar="GLM_PACK_WORKERS",
    show_envvar=True,
    help="Worker processes, one work item (layer) each; output is identical for every count. A Hub SRC read by "
    "range requests (--files other than copy) is read by one process.",
)
@plan_option(
    "--repack-experts", "Also write MXFP4 routed experts in aiter's gfx950 fused-MoE a4w4 layout (shuffled)."
)
@click.option(
    "--skip-space-check",
    "space_check",
    flag_value=False,
    default=True,
    help="Start even when the bytes this run writes exceed the free space of a filesystem it writes to (for one that "
    "compresses or deduplicates what it stores).",
)
@click.option("--quiet", is_flag=True, help="No progress bar or summary.")
def convert_command(src, out, quiet, **option_values):
    """Write the kernel-ready MLA overlay of SRC into OUT.

    SRC is a checkpoint directory or a Hub repo id org/name[@revision]: from the Hub only the shard headers
    and the tensors the overlay needs are read, by HTTP range requests.

    \b
    Example:
      glm-pack convert /models/GLM-5 /models/GLM-5-gfx950
      glm-pack convert zai-org/GLM-5 ./GLM-5-gfx950
      glm-pack convert ckpt out --mla-precision auto --max-rel-error 0.12 --quant-mode mse
    """
    options = ConvertOptions(**option_values)  # the options are named as ConvertOptions' fields
    manifest = Path(out) / mf.OVERLAY_DIR / mf.MANIFEST_NAME
    before = _file_identity(manifest)  # an earlier conversion's manifest, which --overwrite replaces
    interrupted = os.path.isfile(manifest.parent / state.RUN_NAME)  # an interrupted run's record: --resume continues
    # e.g. a mistyped OUT: said before hours of work, not before a refusal (a non-empty OUT without --overwrite)
    if options.resume and not quiet and not interrupted and before is None:
        if options.overwrite or not os.path.isdir(out) or not output_leftovers(Path(out)):
            console.print(f"--resume: {out} holds no interrupted conversion; converting from the start")
    try:
        run_convert(src, out, options, quiet)
    except NoSpaceError as err:
        if os.path.isfile(manifest.parent / state.RUN_NAME):  # this run's record: --resume continues it
            err.message += f"; {_resumable(out)}, after freeing space"
        raise
    except KeyboardInterrupt as err:
        word, code = stopped_how(err)
        if (now := _file_identity(manifest)) is not None and now == before:  # stopped before OUT was touched
            what = f"{out} was not changed: it still holds its earlier conversion"
        elif now is not None:  # stopped after this run's manifest was written
            what = f"{out} holds a complete conversion (its manifest is written); `glm-pack verify {out}` checks it"
        elif os.path.isfile(manifest.parent / state.RUN_NAME):  # this run's record: --resume continues it
            what = _resumable(out)
        else:  # e.g. while --overwrite emptied OUT
            what = f"nothing of this run is finished: rerun the same command to convert into {out}"
        click.echo(f"glm-pack: {word}; {what}", err=True)
        raise SystemExit(code) from None


def _resumable(out) -> str:
    return f"finished layers are kept: rerun the same command with --resume to complete {out}"


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    """(device, inode, mtime in ns) of a regular file, None if there is none: a file replaced by a rename differs."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns) if path.is_file() else None


def print_verify(report: VerifyReport, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
        return
    for line in report.checked:
        console.print(f"[green]checked[/green] {escape(line)}")
    for line in report.problems:
        console.print(f"[red]problem[/red] {escape(line)}")
    console.print(f"verify {report.out}: {report.verdict}", markup=False)


@click.command("verify")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
def verify_command(out, as_json):
    """Check a converted OUT: hashes, geometry, untouched index, errors recomputed from the source.

    Exit code 0 when every check passed; an interrupted output (no manifest) is reported incomplete (exit code
    1, as for a failed check). When the
    source cannot be reached only OUT's own files are checked: the verdict says so, exit code still 0.
    Refused while a convert, card or push writes OUT; other verifies may run beside it.
    """
    with phase_bars(disable=as_json, transient=True) as progress:  # gone once done: the report follows
        report = verify(out, progress)
    print_verify(report, as_json)
    if not report.ok:
        raise SystemExit(1)


@click.command("demo")
@click.argument("workdir", required=False, type=click.Path(file_okay=False))
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Decoder layers of the synthetic GLM-5 checkpoint (MTP on top).",
)
def demo_command(workdir, layers):
    """Synthesize a small GLM-5 checkpoint, convert it, verify it and run one layer through the runtime."""
    from glm_pack import runtime

    from .synth import synthesize

    try:
        root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="glm-pack-demo-"))
    except OSError as err:  # a temp folder that is full, read-only or not this user's (or none usable)
        raise OutputError(f"cannot create the demo's work folder: {err.strerror or err}", file=err.filename) from err
    src, out = root / "glm-5-small", root / "glm-5-small-gfx950"
    for folder in (src, out):  # replaced below: through a link, the folder it points to would be emptied
        if folder.is_symlink():
            raise PlanError(
                f"{folder} is a symlink (to {os.readlink(folder)}); the demo replaces this folder and does not "
                "write through links: remove the link or choose another WORKDIR",
                file=folder,
            )
    console.print(f"[bold]1/4 synthesize[/bold] GLM-5 (true MLA geometry, small everything else) -> {escape(str(src))}")
    synthesize(src, card="glm-5", layers=layers, experts=4, fmt="bf16", profile="small", seed=0, overwrite=True)
    console.print(f"[bold]2/4 convert[/bold] -> {escape(str(out))}")
    run_convert(src, out, ConvertOptions(overwrite=True))
    console.print("[bold]3/4 verify[/bold]")
    report = verify(out)
    print_verify(report, False)
    if not report.ok:
        raise VerifyError("demo output failed verification")
    console.print("[bold]4/4 runtime[/bold] (torch backend): k_up -> attend -> v_up on layer 0")
    _demo_runtime(runtime.open(out, backend="torch"), src)
    console.print(
        "These errors are the MXFP4 rounding of weights and activations, not a failure: the README's first-order "
        "estimate (Accuracy), 2 * (e_kc + e_q) + e_vc + e_o, is about 0.67 for all-MXFP4 GLM-5 layers.",
        markup=False,
    )
    console.print(f"done: both folders are in {root}; next: glm-pack inspect {src}", markup=False)


def _demo_runtime(model, src: Path) -> None:
    """One layer through the runtime, against plain unabsorbed MLA on the original float kv_b_proj."""
    import torch

    from glm_pack.runtime.reference import unabsorbed_mla

    from .checkpoint import open_checkpoint

    g = model.local_geometry
    entry = model.manifest["mla"][0]
    layer = model.mla(entry["layer"])
    kv_b = open_checkpoint(src).read_float(entry["source"]["tensor"])
    gen = torch.Generator().manual_seed(0)
    T, slots, topk = 4, 256, 64
    q = torch.randn(T, g.num_heads, g.qk_nope_head_dim + g.qk_rope_head_dim, generator=gen).bfloat16()
    cache = torch.randn(slots, g.cache_row, generator=gen).bfloat16()
    indices = torch.randint(0, slots, (T * topk,), generator=gen, dtype=torch.int32)
    indptr = torch.arange(0, T * topk + 1, topk, dtype=torch.int32)
    scale = (g.qk_nope_head_dim + g.qk_rope_head_dim) ** -0.5
    q_rope = q[..., g.qk_nope_head_dim :] if g.qk_rope_head_dim else None
    ref = unabsorbed_mla(kv_b, g, q, cache, indptr, indices, scale)
    for act in ("mxfp4", "none"):
        latent = layer.k_up(q, act_quant=act)
        y = layer.v_up(layer.attend(latent, cache, indptr, indices, scale, q_rope=q_rope), act_quant=act)
        err = float((y.double() - ref).norm() / ref.norm())
        what = "activations MXFP4 (as aiter's A16WFP4)" if act == "mxfp4" else "activations bf16"
        console.print(
            f"layer {layer.layer}: [T={T}, H={g.num_heads}] absorbed MXFP4 weights, {what}: "
            f"output rel error {err:.4f} vs unabsorbed float MLA"
        )
