"""Click commands ``push`` and ``card``: presentation only, the work is in push.py / modelcard.py."""

from __future__ import annotations

import contextlib
import json
import logging
import math

import click
from rich.markup import escape
from rich.table import Table

from .commands import console
from .humanize import counted, size_text
from .modelcard import card_base_model, write_card
from .push import MAX_COMMIT_BYTES, PushOptions, PushReport, push


def _no_base_model_note(card) -> str | None:
    """The line for a card (path) that names no base model, as one written for a local source without
    ``--base-model`` does; None where it names one."""
    if card is None or card_base_model(card):
        return None
    return (
        f"note: the card {card} names no base model: pass --base-model REPO (the source model's Hub repo) to link "
        "it on the Hub"
    )


def _print_report(report: PushReport, repo_id: str) -> None:
    if note := _no_base_model_note(report.card):
        console.print(note, markup=False)
    plan = report.plan
    if report.dry_run:
        table = Table(title=f"dry run: would upload to {repo_id}@{plan.revision} ({report.endpoint})")
        for col in ("commit", "file", "size", "why"):
            table.add_column(col, justify="right" if col in ("commit", "size") else "left")
        for path in plan.deletes:
            table.add_row("1", escape(path), "-", "deleted first: the remote's manifest differs")
        for i, commit in enumerate(plan.commits):
            for u in commit:
                table.add_row(str(i + 1), escape(u.file.path_in_repo), size_text(u.file.size), u.reason)
        for path in plan.stale:
            table.add_row(str(len(plan.commits)), escape(path), "-", "deleted: stale")
        console.print(table)
        console.print(
            f"{counted(len(plan.uploads), 'file')} ({size_text(plan.upload_bytes)}) in "
            f"{counted(len(plan.commits), 'commit')} would be uploaded{_stale_note(plan.stale, dry_run=True)}; "
            f"{len(plan.unchanged)} already up to date; nothing was uploaded"
        )
        return
    if not plan.commits:
        console.print(
            f"{repo_id}@{plan.revision} is up to date ({counted(len(plan.unchanged), 'file')}); nothing to upload"
        )
        return
    console.print(
        f"uploaded {counted(report.uploaded_files, 'file')} ({size_text(report.uploaded_bytes)})"
        f"{_stale_note(plan.stale, dry_run=False)} in {counted(len(report.commit_urls), 'commit')} to "
        f"{repo_id}@{plan.revision}; {len(plan.unchanged)} already up to date"
    )
    for url in report.commit_urls:
        console.print(f"  {url}")


def _stale_note(stale: list[str], *, dry_run: bool) -> str:
    verb = "would be" if dry_run else "was" if len(stale) == 1 else "were"
    return f" and {counted(len(stale), 'stale glm-pack/ file')} {verb} deleted" if stale else ""


def _report_json(report: PushReport, repo_id: str) -> dict:
    plan = report.plan
    return {
        "repo_id": repo_id,
        "revision": plan.revision,
        "base_commit": plan.base,  # the revision's head commit the plan compares with and commits onto (null: no repo)
        "endpoint": report.endpoint,
        "dry_run": report.dry_run,
        "card": str(report.card) if report.card else None,
        "uploads": [
            {"path": u.file.path_in_repo, "size": u.file.size, "reason": u.reason} for u in plan.uploads
        ],
        "commits": [[u.file.path_in_repo for u in c] for c in plan.commits],
        "deletes": plan.deletes,  # remote paths the first commit deletes
        "stale": plan.stale,  # remote glm-pack/ paths OUT lacks, which the last commit deletes
        "unchanged": plan.unchanged,
        "uploaded_files": report.uploaded_files,
        "uploaded_bytes": report.uploaded_bytes,
        "commit_urls": report.commit_urls,
    }


def _finite_positive(ctx, param, value: float) -> float:
    if not 0 < value < math.inf:
        raise click.BadParameter(f"must be a finite number > 0, got {value}")
    return value


BASE_MODEL_HELP = (
    "Card base_model (the source repo): needed for a local source unless the card in OUT names one (kept on "
    "refresh); wins over that and the manifest's."
)


@click.command("push")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@click.argument("repo_id")
@click.option(
    "--revision",
    default="main",
    show_default=True,
    help="Branch to push to (created if missing), or refs/pr/N to add to that open pull request.",
)
@click.option(
    "--private",
    is_flag=True,
    help="Create the repo private (ignored when it exists). Without it the repo gets its namespace's default "
    "visibility (public unless the organization makes new repos private).",
)
@click.option(
    "--overlay-only",
    is_flag=True,
    help="Upload only glm-pack/ (its card at glm-pack/README.md); the repo's root README is left alone. Required "
    "for an OUT converted with --files none.",
)
@click.option(
    "--dry-run", is_flag=True, help="List what would be uploaded, with sizes, and what deleted; upload nothing."
)
@click.option("--commit-message", default=None, help="Commit summary (a part number is appended when split).")
@click.option(
    "--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT, else https://huggingface.co)."
)
@click.option("--base-model", default=None, help=BASE_MODEL_HELP)
@click.option(
    "--max-commit-gib",
    type=float,
    default=MAX_COMMIT_BYTES / 2**30,
    show_default=True,
    callback=_finite_positive,
    help="Commit size bound: progress is committed in steps of this many GiB (a larger file alone). Raise it for "
    "uploads faster than about 1 TiB an hour, which meet the Hub's hourly commit limit.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
def push_command(
    out,
    repo_id,
    revision,
    private,
    overlay_only,
    dry_run,
    commit_message,
    endpoint,
    base_model,
    max_commit_gib,
    as_json,
):
    """Publish a converted OUT to the Hub repo REPO_ID, uploading only what the revision lacks.

    OUT must pass `glm-pack verify`. The model card is refreshed first. Files already on the revision with
    the same size and hash are skipped, the rest goes in commits of bounded size with the manifest and the
    card last, so a re-run after an interruption finishes the job. Files under the revision's glm-pack/ that
    OUT lacks are deleted in the last commit. A commit by someone else to the revision during the push stops it
    (the Hub refuses the push's next commit); run it again to plan against the new head. OUT stays locked from the
    verify through the last commit: a convert, card or verify of it is refused meanwhile. Token: HF_TOKEN or
    `hf auth login`.

    \b
    Examples:
      glm-pack push /models/GLM-5-gfx950 me/GLM-5-gfx950 --private
      glm-pack push /models/GLM-5-gfx950 zai-org/GLM-5 --overlay-only --revision gfx950
      glm-pack push /models/GLM-5-gfx950 me/GLM-5-gfx950 --dry-run
    """
    options = PushOptions(
        revision=revision,
        private=private,
        overlay_only=overlay_only,
        dry_run=dry_run,
        commit_message=commit_message,
        endpoint=endpoint,
        base_model=base_model,
        max_commit_bytes=max(1, int(max_commit_gib * 2**30)),
    )
    with _quiet_hub():  # its bars and retry warnings would bury the one-line error on stderr
        report = push(out, repo_id, options, progress=None if as_json else _progress)
    if as_json:  # stdout holds the JSON alone; the note goes to stderr
        if note := _no_base_model_note(report.card):
            click.echo(note, err=True)
        click.echo(json.dumps(_report_json(report, repo_id), indent=2))
    else:
        _print_report(report, repo_id)


@contextlib.contextmanager
def _quiet_hub():
    """Mute huggingface_hub's progress bars and its warnings (one per retried request, from http_backoff)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    hub_logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        hub_logger.setLevel(level)
        if not was_disabled:
            enable_progress_bars()


def _progress(done: int, total: int, nbytes: int) -> None:
    console.print(f"committed {done}/{total} files ({size_text(nbytes)})")


@click.command("card")
@click.argument("out", type=click.Path(file_okay=False, exists=True))
@click.option(
    "--overlay-only",
    is_flag=True,
    help="Write glm-pack/README.md instead of README.md. Required for an OUT converted with --files none.",
)
@click.option("--base-model", default=None, help=BASE_MODEL_HELP)
@click.option("--repo-id", default=None, help="The repo the card will live in (used in the loading example).")
@click.option(
    "--revision",
    default=None,
    help="The branch or refs/pr/N the card will live on (used in the loading example; push sets it itself).",
)
def card_command(out, overlay_only, base_model, repo_id, revision):
    """Write or refresh the model card of a converted OUT without pushing.

    The root README.md becomes the glm-pack card; a source model card found there is kept as
    README.source.md (its license is carried over). Refused while another convert, card or push writes OUT or
    a verify reads it.

    \b
    Examples:
      glm-pack card /models/GLM-5-gfx950 --base-model zai-org/GLM-5
      glm-pack card /models/GLM-5-gfx950 --overlay-only
    """
    path = write_card(out, overlay_only=overlay_only, base_model=base_model, repo_id=repo_id, revision=revision)
    console.print(f"model card written: {path}", markup=False)
    if note := _no_base_model_note(path):
        console.print(note, markup=False)
