"""``glm-pack push``: publish a converted OUT to the Hugging Face Hub, resumably, through huggingface_hub.

Resumability is glm-pack's own and does not depend on Xet: the local files (size, sha256 / git blob id) are
compared with what the target revision's head commit holds (``get_paths_info`` at that commit's sha, read once
before planning) and only missing or different files are uploaded, in commits of bounded size (``create_commit``;
the client picks the regular or LFS path per file as the Hub's preupload answer says). The manifest and the model
card go in the last commit, so a remote overlay without its manifest is visibly unfinished, and a re-run after an
interruption uploads only what is left. A remote manifest that differs from the local one is deleted in
the first commit when files go up before the new one, so no commit leaves an old manifest over new files.
Files under the revision's ``glm-pack/`` that OUT does not have (an earlier overlay's layers or repacked
experts) are deleted in the last commit, with the new manifest: glm-pack owns that folder. An unchanged OUT
re-pushed uploads and deletes nothing. Each commit is checked to hold all its files (the client silently leaves out
those a .gitignore of the repo matches), so the manifest never goes up over missing overlay files.

The plan holds only while nobody else commits to the revision: every commit names its parent (``parent_commit``:
the planned head, then the previous commit of this push), and the Hub refuses it (412) when the revision moved
meanwhile (another push, a card edited on the Hub), or the client sends no commit at all when the revision
already holds all its files (someone else committed them: the revision moved too). That ends the push in one
line: the commits made so far stay and the same command re-plans against the new head. The same holds for
``refs/pr/N`` (the client sends ``parent_commit`` the same way for any revision; not checked against the live Hub).

The token comes from ``HF_TOKEN`` or the login cache (huggingface_hub's own lookup); it is passed to
the client only and never printed or written. Every failure becomes one :class:`HubError` line.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from glm_pack.packing import manifest as mf
from glm_pack.packing.errors import HubError, VerifyError

from .checkpoint import walk_files
from .convert import file_digest, file_sha256
from .hub_common import (
    answered,
    auth_failed,
    exception_chain,
    first_line,
    hub_says,
    is_kind,
    offline_variable,
    resolve_endpoint,
    token_or_none,
    unreachable,
)
from .interrupts import Terminated
from .modelcard import SOURCE_README, require_originals, write_card_unlocked
from .state import OutputLock
from .writer import OutputError

# Per commit: progress is committed (and reported) in steps of this size; a failed commit's finished uploads stay
# on the Hub either way. At 8 GiB a 1.5 TB checkpoint takes about 190 commits, so an upload faster than about 1 TiB
# an hour can meet the Hub's hourly commit limit (429, whose line says to run the same command again, which resumes).
MAX_COMMIT_BYTES = 8 << 30
MAX_COMMIT_FILES = 64
MANIFEST_PATH = f"{mf.OVERLAY_DIR}/{mf.MANIFEST_NAME}"
PATHS_INFO_CHUNK = 100  # paths per get_paths_info request
PR_REF = re.compile(r"refs/pr/[0-9]+")  # an open pull request's ref: commits go there, it is no branch to create


@dataclass(frozen=True)
class PushOptions:
    revision: str = "main"
    private: bool = False  # True: create the repo private; False: as its namespace creates repos (public by default)
    overlay_only: bool = False
    dry_run: bool = False
    commit_message: str | None = None
    endpoint: str | None = None  # default: HF_ENDPOINT, else https://huggingface.co
    base_model: str | None = None  # card base_model; wins over the card in OUT and the manifest's source repo
    max_commit_bytes: int = MAX_COMMIT_BYTES
    max_commit_files: int = MAX_COMMIT_FILES


@dataclass(frozen=True)
class LocalFile:
    path_in_repo: str  # POSIX path inside the repo
    local: Path
    size: int  # bytes
    sha256: str | None = None  # hex, when already known (overlay files: from the verified manifest)


@dataclass(frozen=True)
class Upload:
    file: LocalFile
    reason: str  # "new" or "changed"


@dataclass
class PushPlan:
    repo_id: str
    revision: str
    base: str | None = None  # sha of the revision's head commit the plan compares with (None: no repo yet)
    uploads: list[Upload] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    commits: list[list[Upload]] = field(default_factory=list)
    deletes: list[str] = field(default_factory=list)  # remote paths deleted in the first commit
    stale: list[str] = field(default_factory=list)  # remote glm-pack/ files OUT lacks, deleted in the last commit

    @property
    def upload_bytes(self) -> int:
        return sum(u.file.size for u in self.uploads)


@dataclass
class PushReport:
    plan: PushPlan
    dry_run: bool
    endpoint: str
    card: Path | None = None
    commit_urls: list[str] = field(default_factory=list)
    uploaded_files: int = 0
    uploaded_bytes: int = 0


def git_blob_id(path: Path) -> str:
    """The git blob sha1 the Hub reports as a regular file's ``oid``."""
    return file_digest(path, hashlib.sha1(b"blob %d\0" % path.stat().st_size))


def local_files(out: Path, overlay_only: bool) -> list[LocalFile]:
    """What a push publishes: every non-hidden file of OUT, or of OUT/glm-pack with ``overlay_only``."""
    root = out / mf.OVERLAY_DIR if overlay_only else out
    manifest = mf.loads((out / mf.OVERLAY_DIR / mf.MANIFEST_NAME).read_bytes())
    known = {f"{mf.OVERLAY_DIR}/{name}": info["sha256"] for name, info in manifest["files"].items()}
    files = []
    for path in walk_files(root, lambda parts: not any(p.startswith(".") for p in parts), OutputError, "the output"):
        rel = path.relative_to(out)
        if not path.is_file():
            continue
        key = rel.as_posix()
        files.append(LocalFile(key, path, path.stat().st_size, known.get(key)))
    return files


def _last(path: str) -> bool:
    """Files that go in the final commit: the manifest (marks the overlay complete) and the cards."""
    return path in (
        MANIFEST_PATH,
        "README.md",
        SOURCE_README,
        f"{mf.OVERLAY_DIR}/README.md",
    )


def group_commits(uploads: list[Upload], max_bytes: int, max_files: int) -> list[list[Upload]]:
    """Split uploads into commits of at most ``max_files`` files and ``max_bytes`` bytes (larger files alone).

    Order: every other file by path, then the manifest and the cards together in the last commit.
    """
    body = [u for u in uploads if not _last(u.file.path_in_repo)]
    tail = [u for u in uploads if _last(u.file.path_in_repo)]
    commits: list[list[Upload]] = []
    current: list[Upload] = []
    size = 0
    for u in body:
        if current and (len(current) >= max_files or size + u.file.size > max_bytes):
            commits.append(current)
            current, size = [], 0
        current.append(u)
        size += u.file.size
    if current:
        commits.append(current)
    if tail:
        commits.append(tail)
    return commits


def _same(local: LocalFile, remote) -> bool:
    if remote.size != local.size:
        return False
    if remote.lfs is not None:
        return (local.sha256 or file_sha256(local.local)) == remote.lfs.sha256
    return git_blob_id(local.local) == remote.blob_id


def plan_push(api, repo_id: str, files: list[LocalFile], options: PushOptions, base: str | None) -> PushPlan:
    """Compare local files with the paths info of commit ``base`` (the sha of the target revision's head before
    the upload, read once: the plan does not follow a branch that moves; None: nothing, a repo not created yet);
    plan uploads of what is missing or different."""
    plan = PushPlan(repo_id, options.revision, base)
    remote = {}
    if base is not None:
        plan.stale = stale_overlay(api, repo_id, files, base)
        remote = paths_info(api, repo_id, [f.path_in_repo for f in files], base)
    for f in files:
        r = remote.get(f.path_in_repo)
        if r is None or not hasattr(r, "size"):  # missing, or a folder where a file should be
            plan.uploads.append(Upload(f, "new"))
        elif _same(f, r):
            plan.unchanged.append(f.path_in_repo)
        else:
            plan.uploads.append(Upload(f, "changed"))
    plan.commits = group_commits(plan.uploads, options.max_commit_bytes, options.max_commit_files)
    if plan.stale and not plan.commits:
        plan.commits = [[]]  # nothing to upload, but stale files to delete: one commit of deletions
    plan.deletes = stale_manifest(plan)
    return plan


def paths_info(api, repo_id: str, paths: list[str], revision: str) -> dict:
    """``{path: RepoFile or RepoFolder}`` for those of ``paths`` that exist at ``revision``."""
    found = {}
    for i in range(0, len(paths), PATHS_INFO_CHUNK):
        for entry in api.get_paths_info(repo_id, paths[i : i + PATHS_INFO_CHUNK], revision=revision):
            found[entry.path] = entry
    return found


def check_committed(api, repo_id: str, commit: list[Upload], oid: str) -> None:
    """Raise HubError unless commit ``oid`` holds every file of ``commit``: huggingface_hub leaves out of a commit,
    without an error, each file the Hub's preupload answer marks ignored (a .gitignore of the repo matches it)."""
    paths = [u.file.path_in_repo for u in commit]
    there = paths_info(api, repo_id, paths, oid)
    missing = [p for p in paths if p not in there]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise HubError(
            f"the Hub left {missing[0]}{more} out of the commit: a .gitignore in {repo_id} matches it; remove that "
            "pattern from the repo's .gitignore and run the same command again"
        )


def stale_overlay(api, repo_id: str, files: list[LocalFile], revision: str) -> list[str]:
    """Files under the revision's ``glm-pack/`` that the local OUT does not have, sorted."""
    from huggingface_hub import RepoFile
    from huggingface_hub.errors import EntryNotFoundError

    local = {f.path_in_repo for f in files}
    try:
        entries = list(api.list_repo_tree(repo_id, mf.OVERLAY_DIR, recursive=True, revision=revision))
    except EntryNotFoundError:  # no glm-pack/ folder there yet
        return []
    return sorted(e.path for e in entries if isinstance(e, RepoFile) and e.path not in local)


def stale_manifest(plan: PushPlan) -> list[str]:
    """``[manifest path]`` when the remote manifest differs from the local one and other commits precede the
    new one (it goes last): deleting it in the first commit keeps an interrupted push visibly unfinished."""
    changed = any(u.file.path_in_repo == MANIFEST_PATH and u.reason == "changed" for u in plan.uploads)
    return [MANIFEST_PATH] if changed and len(plan.commits) > 1 else []


def _check_out(out: Path, overlay_only: bool) -> None:
    from .verify import read_manifest, verify_unlocked

    report = verify_unlocked(out)
    if not report.ok:
        first = report.problems[0] if report.problems else "unknown problem"
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise VerifyError(f"refusing to push {out}: verify rejects it: {first}{more}; run `glm-pack verify {out}`")
    if not overlay_only:
        require_originals(out, read_manifest(out), "push it")


def _ensure_target(api, repo_id: str, options: PushOptions) -> None:
    """Create the repo and the branch where missing; not for a pull request's ``refs/pr/N``, which needs both to
    exist (a new repo has no pull request: the push would create it, then be refused)."""
    if PR_REF.fullmatch(options.revision):
        return
    # private=False would send visibility "public" and override a namespace that makes new repos private
    api.create_repo(repo_id, private=True if options.private else None, exist_ok=True)
    if _creates_branch(options.revision):
        api.create_branch(repo_id, branch=options.revision, exist_ok=True)


def _creates_branch(revision: str) -> bool:
    """Whether a push creates ``revision`` (at main's head) when it is missing: not for main, nor for a pull
    request's ``refs/pr/N``, which the Hub makes when the PR is opened and refuses as a branch name (400)."""
    return revision != "main" and not PR_REF.fullmatch(revision)


def _head(api, repo_id: str, revision: str) -> str:
    """The sha of the commit ``revision`` points at now: the push plans against it and commits onto it."""
    sha = api.repo_info(repo_id, revision=revision).sha
    if sha is None:
        raise HubError(f"the Hub named no head commit for revision {revision!r} of {repo_id}")
    return sha


def _dry_run_base(api, repo_id: str, revision: str) -> str | None:
    """For a dry run, without creating anything: the head commit the push would upload onto, i.e. that of
    ``revision`` when it exists, else main's when the push would create it (at main's head), None when the repo
    does not exist; RevisionNotFoundError, as the push gets, for a missing revision it cannot create (``refs/pr/N``)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    for candidate in (revision, "main") if _creates_branch(revision) else (revision,):
        try:
            return _head(api, repo_id, candidate)
        except (RepositoryNotFoundError, RevisionNotFoundError) as err:
            if PR_REF.fullmatch(candidate):  # no such repo or open pull request: the push is refused, so is its plan
                raise
            if isinstance(err, RepositoryNotFoundError):
                return None
    return None


def push(
    out: str | os.PathLike,
    repo_id: str,
    options: PushOptions = PushOptions(),
    progress: Callable[[int, int, int], None] | None = None,
) -> PushReport:
    """Verify OUT, refresh its card, upload what the revision lacks; raises HubError/VerifyError/PlanError.

    ``progress(files_done, files_total, bytes_done)`` is called after each commit. A dry run refreshes the
    local card and plans, but creates and uploads nothing (it needs no token for a public repo). OUT's lock
    is held (exclusive) from the verify through the last commit: refused while another glm-pack run writes
    OUT or a verify reads it, and no convert or card changes OUT under the upload.
    """
    out = Path(out)
    endpoint = resolve_endpoint(options.endpoint)
    check_repo_id(repo_id)
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise HubError(f"{offline_variable()} is set: unset it to push")
    with OutputLock(out, create=False):
        return _push_held(out, repo_id, options, endpoint, progress)


def check_repo_id(repo_id: str) -> None:
    """HubError for a REPO_ID the Hub cannot hold (huggingface_hub's own rule), before OUT is verified."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        reason = first_line(err).split(": '")[0].replace(" Use `repo_type` argument if needed.", "")
        raise HubError(f"REPO_ID {repo_id!r} is no Hub repo id (namespace/name or name): {reason}") from None


def _push_held(
    out: Path, repo_id: str, options: PushOptions, endpoint: str, progress: Callable[[int, int, int], None] | None
) -> PushReport:
    """:func:`push`'s work, under OUT's lock."""
    from huggingface_hub import HfApi

    _check_out(out, options.overlay_only)
    if token_or_none() is None and not options.dry_run:  # before the card: a push refused at once leaves OUT as it was
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    card = write_card_unlocked(
        out,
        overlay_only=options.overlay_only,
        base_model=options.base_model,
        repo_id=repo_id,
        revision=options.revision,
    )
    api = HfApi(endpoint=endpoint)  # no token pinned: the client looks it up per request, refreshing short-lived ones
    files = local_files(out, options.overlay_only)
    report = PushReport(plan=PushPlan(repo_id, options.revision), dry_run=options.dry_run, endpoint=endpoint, card=card)
    what = "glm-pack overlay" if options.overlay_only else "glm-pack converted checkpoint"
    message = options.commit_message or f"Upload {what}"
    try:
        if options.dry_run:
            base = _dry_run_base(api, repo_id, options.revision)
        else:
            _ensure_target(api, repo_id, options)
            base = _head(api, repo_id, options.revision)  # a new branch: main's head, where it was created
        plan = plan_push(api, repo_id, files, options, base)
        report.plan = plan
        if options.dry_run:
            return report
        total = len(plan.uploads)
        parent = plan.base
        for i, commit in enumerate(plan.commits):
            last = i == len(plan.commits) - 1
            ops = (
                _deletions(plan.deletes if i == 0 else [])
                + [_operation(u.file) for u in commit]
                + _deletions(plan.stale if last else [])
            )
            suffix = f" ({i + 1}/{len(plan.commits)})" if len(plan.commits) > 1 else ""
            info = api.create_commit(
                repo_id, ops, commit_message=message + suffix, revision=options.revision, parent_commit=parent
            )
            if not _sent(ops):
                raise HubError(_moved(report, repo_id, options.revision))
            check_committed(api, repo_id, commit, info.oid)
            parent = info.oid
            report.commit_urls.append(info.commit_url)
            report.uploaded_files += len(commit)
            report.uploaded_bytes += sum(u.file.size for u in commit)
            if progress is not None:
                progress(report.uploaded_files, total, report.uploaded_bytes)
    except KeyboardInterrupt as err:
        cause = "terminated by SIGTERM" if isinstance(err, Terminated) else "interrupted by the user"
        raise HubError(_interrupted(report, cause)) from None
    except Exception as err:
        raise hub_error(err, repo_id, endpoint, options.revision, report) from err
    return report


def _operation(f: LocalFile):
    from huggingface_hub import CommitOperationAdd

    op = CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.local))
    if f.sha256 is not None:  # known from the verified manifest: spare the client a second read
        op.upload_info.sha256 = bytes.fromhex(f.sha256)
    return op


def _deletions(paths: list[str]) -> list:
    from huggingface_hub import CommitOperationDelete

    return [CommitOperationDelete(path_in_repo=p) for p in paths]


def _sent(ops: list) -> bool:
    """Whether ``create_commit`` sent ``ops`` as a commit. It sends none, so parent_commit is never checked, when the
    revision already holds every added file and nothing is deleted: it returns the revision's head instead
    (hf_api.create_commit, "Return early if empty commit"; additions of a sent commit get ``_is_committed``, taken as
    sent where a client lacks it). Each planned file differs at the commit's parent: a commit not sent means that
    someone else committed those files, i.e. the revision moved."""
    from huggingface_hub import CommitOperationDelete

    return any(isinstance(op, CommitOperationDelete) or getattr(op, "_is_committed", True) for op in ops)


def _moved(report: PushReport, repo_id: str, revision: str) -> str:
    """The line for a revision that another commit moved after the plan (the Hub refused ``parent_commit``)."""
    return (
        f"revision {revision!r} of {repo_id} changed during the push: another commit landed on it after the upload "
        f"was planned against {report.plan.base}; {report.uploaded_files} of {len(report.plan.uploads)} files "
        "committed so far are kept; run the same command again: it plans against the new head and uploads the rest"
    )


def _interrupted(report: PushReport, why: str) -> str:
    """The line for a connection that failed: before the first commit, that no commit was made."""
    if report.uploaded_files == 0:
        return f"{why} before any file was committed (no commit was made); run the same command again"
    total = len(report.plan.uploads)
    return (
        f"upload interrupted ({why}) after {report.uploaded_files} of {total} files were committed; "
        "run the same command again to upload the rest"
    )


def hub_error(err: Exception, repo_id: str, endpoint: str, revision: str, report: PushReport) -> Exception:
    """Turn a client exception into one clear HubError line (never containing the token)."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(err, HubError):
        return err
    for e in exception_chain(err):
        if isinstance(e, RepositoryNotFoundError):
            return HubError(f"repository {repo_id} not found at {endpoint}, or the token cannot see it")
        if isinstance(e, RevisionNotFoundError):
            return HubError(f"revision {revision!r} not found in {repo_id} at {endpoint}")
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            status = e.response.status_code
            if status == 401:
                return HubError(auth_failed(endpoint, e))
            if status == 403:
                return HubError(
                    f"permission denied (403): the token may not write to {repo_id} at {endpoint}{hub_says(e)}"
                )
            if status == 412:  # parent_commit is no longer the head (huggingface_hub's test_create_commit_conflict)
                return HubError(_moved(report, repo_id, revision))
            if status == 429:
                return HubError(
                    f"rate limited (429) by {endpoint}; wait and run the same command again "
                    f"({report.uploaded_files} of {len(report.plan.uploads)} files committed so far are kept)"
                    f"{hub_says(e)}"
                )
            return HubError(answered(status, repo_id, endpoint, e))
        if is_kind(e, "ConnectError", "ConnectionRefusedError") and report.uploaded_files == 0:
            return HubError(f"{unreachable(endpoint)}; no commit was made")
        if is_kind(e, "TimeoutException", "TimeoutError"):
            return HubError(_interrupted(report, f"timed out talking to {endpoint}"))
        if is_kind(e, "TransportError", "ConnectionError"):
            return HubError(_interrupted(report, f"connection to {endpoint} lost"))
        if isinstance(e, ValueError) and "Invalid metadata in README.md" in str(e):
            return HubError(f"the Hub rejected the model card metadata: {first_line(e, skip=1)}")
    return HubError(f"push to {repo_id} at {endpoint} failed: {type(err).__name__}: {first_line(err)}")
