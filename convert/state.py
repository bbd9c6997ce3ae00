"""Run state of a conversion in progress: the lock, the run descriptor and the progress journal.

* ``OUT/.glm-pack.lock``: an ``flock``-held lock file, held exclusively by a writer (``convert``, ``card``,
  ``push``) and shared by a reader (``verify``; readers coexist). Nobody waits: a writer is refused while
  anyone holds it, a reader while a writer does. The kernel drops the lock when its process dies, so a crashed
  run's lock is stale by construction and the next run takes it (the pid a writer puts inside is only for the
  message).
* ``OUT/glm-pack/.run.json``: what the interrupted run was doing (options, source fingerprint). Its presence
  without a manifest means "interrupted": a new run must say ``--resume`` (or ``--overwrite``).
* ``OUT/glm-pack/.journal.jsonl``: one fsynced JSON line per finished work item (file, size, sha256 and its
  manifest fragments), ``{"entry": ..., "sha256": <sha256 of the entry's sorted-key JSON>}``. A line whose
  checksum does not match (edited or damaged) is not an entry. ``--resume`` keeps an item only if its file
  still hashes to the journalled sha256.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
from pathlib import Path

from glm_pack.packing.errors import PlanError
from glm_pack.packing.manifest import OVERLAY_DIR

from .writer import OutputError, _write_all, atomic_write, fsync, make_folder, read_bytes

LOCK_NAME = ".glm-pack.lock"
RUN_NAME = ".run.json"
JOURNAL_NAME = ".journal.jsonl"


# Why the lock file cannot be opened: OUT missing, or read-only to this user (a folder or mount).
_UNLOCKABLE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS})


class OutputLock:
    """``flock`` on ``OUT/.glm-pack.lock`` for the duration of a ``with`` block; never waits.

    Exclusive (a writer, which writes its pid into the file) or ``shared`` (a reader). A conflicting holder
    makes ``__enter__`` raise a PlanError saying which kind holds it. ``create`` (convert): OUT is made if
    missing and no lock is an OutputError. Without it (card, push, verify) OUT is not made, and where it is
    missing or this user cannot create or open the lock file in it (a read-only folder or mount) the block
    runs without the lock: no glm-pack run of this user can write there either, and the command itself then
    reports what it cannot read or write. A reader also runs unlocked where the lock file is a symlink (a writer
    refuses it: it never writes through a link). Nor do they create a lock file in a folder that has none and no
    ``glm-pack/`` folder (not an output: e.g. ``OUT/glm-pack`` itself, or a wrong path), which they refuse anyway.
    """

    def __init__(self, out: Path, *, shared: bool = False, create: bool = True):
        self.path = Path(out) / LOCK_NAME
        self.shared = shared
        self.create = create
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        mode = os.O_RDONLY if self.shared else os.O_RDWR  # a reader writes nothing: a read-only file will do
        if not (self.create or os.path.lexists(self.path) or os.path.isdir(self.path.parent / OVERLAY_DIR)):
            return self
        if self.create:
            make_folder(self.path.parent, "the output folder")
        try:
            fd = os.open(self.path, mode | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # never write through a link
        except OSError as err:
            if not self.create and err.errno in _UNLOCKABLE:
                return self
            if self.shared and err.errno == errno.ELOOP:  # an OUT copied as links (cp -rs): a reader writes nothing
                return self
            why = "it is a symlink" if err.errno == errno.ELOOP else err.strerror or str(err)
            raise OutputError(f"cannot create the output lock: {why}", file=self.path) from err
        try:
            self._take(fd)
            if not self.shared:
                os.ftruncate(fd, 0)
                _write_all(fd, str(os.getpid()).encode(), self.path)  # a full disk: OutputError saying so
        except OSError as err:
            os.close(fd)
            raise OutputError(f"cannot write the output lock: {err.strerror or err}", file=self.path) from err
        except (OutputError, PlanError):
            os.close(fd)
            raise
        self.fd = fd
        return self

    def _take(self, fd: int) -> None:
        """flock ``fd`` without waiting, or raise the PlanError naming what holds it."""
        if _flock(fd, fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX):
            return
        if not self.shared and _flock(fd, fcntl.LOCK_SH):  # granted only when no writer holds it
            if _flock(fd, fcntl.LOCK_EX):
                return  # its holders all left meanwhile: it is ours after all
            raise PlanError(
                "a glm-pack verify is reading this output; run this again after it finishes", file=self.path
            )
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"  # the writer's own pid
        if self.shared:
            raise PlanError(
                f"a glm-pack run (pid {holder}) is writing this output; verify after it finishes", file=self.path
            )
        raise PlanError(
            f"another glm-pack run (pid {holder}) is writing this output; wait for it or stop it", file=self.path
        )

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock; the file itself may stay (it is not a lock without the flock)
            self.fd = None


def _flock(fd: int, op: int) -> bool:
    """``flock(fd, op)`` without waiting; False when another open file holds a conflicting lock."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def read_run(overlay: Path) -> dict | None:
    path = overlay / RUN_NAME
    if not path.is_file():
        return None
    try:
        run = json.loads(read_bytes(path, "the run state"))
    except ValueError as err:
        raise PlanError(f"unreadable run state ({err}); use --overwrite to start over", file=path) from err
    if not isinstance(run, dict):
        raise PlanError("unreadable run state (not a JSON object); use --overwrite to start over", file=path)
    return run


def write_run(overlay: Path, run: dict) -> None:
    atomic_write(overlay / RUN_NAME, [json.dumps(run, sort_keys=True).encode()])


class Journal:
    """Append-only record of finished work items; each line is fsynced before the next item counts."""

    def __init__(self, overlay: Path):
        self.path = overlay / JOURNAL_NAME

    def entries(self) -> list[dict]:
        """Journalled entries whose line's checksum matches; a torn last line (crash mid-write) is ignored."""
        if not self.path.is_file():
            return []
        out = []
        for text in read_bytes(self.path, "the journal").decode(errors="replace").splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                break
            entry = line.get("entry") if isinstance(line, dict) else None
            if isinstance(entry, dict) and line.get("sha256") == _entry_sha256(entry):
                out.append(entry)
        return out

    def append(self, entry: dict) -> None:
        line = _line(entry)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise OutputError(f"cannot write the journal: {err.strerror or err}", file=self.path) from err
        try:
            _write_all(fd, line, self.path)
            fsync(fd, self.path)
        finally:
            os.close(fd)

    def rewrite(self, entries: list[dict]) -> None:
        atomic_write(self.path, [_line(e) for e in entries])


def _entry_sha256(entry: dict) -> str:
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def _line(entry: dict) -> bytes:
    """A journal line: the entry and the sha256 of its sorted-key JSON."""
    return (json.dumps({"entry": entry, "sha256": _entry_sha256(entry)}, sort_keys=True) + "\n").encode()


def clear_run(overlay: Path) -> None:
    """Remove the run state of a conversion whose manifest is written; OutputError naming a file that cannot be
    removed (an I/O error, a file system gone read-only) and saying the output is complete: beside a manifest a run
    state is ignored."""
    for name in (JOURNAL_NAME, RUN_NAME):
        try:
            (overlay / name).unlink(missing_ok=True)
        except OSError as err:
            raise OutputError(
                f"the conversion is complete (its manifest is written), but its run state cannot be removed: "
                f"{err.strerror or err}",
                file=overlay / name,
            ) from err
