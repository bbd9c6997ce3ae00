"""Will a conversion fit? The bytes a run adds to each filesystem it writes to, against what is free there.

``convert`` asks once, before it writes or deletes anything, so a run that cannot fit stops at once rather than
when the disk fills hours later (a GLM-5 ``--repack-experts`` writes hundreds of GB; ``--files copy`` as much
again). The estimate is an upper bound on plain filesystems: an overlay file counts its tensors' bytes (with
``--mla-precision auto`` as all BF16) plus :func:`overhead`, its share of what a run writes besides tensors (headers,
journal lines and manifest entries, which coexist at the end). A compressing or deduplicating filesystem stores less:
``--skip-space-check`` is for those.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from .humanize import size_text
from .writer import OutputError

FILE_SLACK = 64 << 10  # bytes an overlay file is counted beyond its tensors, and ...
TENSOR_SLACK = 2 << 10  # ... per tensor it holds: measured about 1.2 KiB (header 0.1, journal 0.5, manifest 0.6)


def overhead(tensors: int) -> int:
    """Bytes an overlay file of ``tensors`` tensors is counted beyond them (its header, journal line, manifest entries,
    the manifest's fixed part, filesystem blocks)."""
    return FILE_SLACK + TENSOR_SLACK * tensors


def _nearest(path: Path) -> tuple[Path, int]:
    """(``path`` or, where it cannot be looked at (not there yet), its nearest ancestor that can, its ``st_dev``).
    Symlinks are followed: bytes written through a linked folder land where it points."""
    path = Path(os.path.abspath(path))
    for candidate in (path, *path.parents):
        try:
            return candidate, os.stat(candidate).st_dev
        except OSError:
            continue
    return Path("/"), os.stat("/").st_dev


def device(path: Path) -> int:
    """``st_dev`` of the filesystem ``path`` is (or, while it does not exist, would be) on."""
    return _nearest(path)[1]


def free_bytes(folder: Path) -> int | None:
    """Bytes this user may still write to ``folder``'s filesystem (root's reserve aside; ``folder`` may not exist yet);
    None where the filesystem reports no size at all (some FUSE and network filesystems): nothing can be judged."""
    usage = shutil.disk_usage(_nearest(folder)[0])
    return usage.free if usage.total else None


def freed_bytes(paths: Iterable[Path]) -> int:
    """Bytes deleting ``paths`` (files and folders, their links not followed) gives back: the blocks of regular
    files no other hard link keeps (a hard-linked original frees nothing)."""
    total = 0

    def add(path: str) -> None:
        nonlocal total
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            total += st.st_blocks * 512

    for path in paths:
        if path.is_symlink() or not path.is_dir():
            add(str(path))
            continue
        for folder, _, files in os.walk(path):  # never into a linked folder
            for name in files:
                add(os.path.join(folder, name))
    return total


class Writes:
    """What a run adds to filesystems: ``add(folder, what, nbytes)`` files bytes under the filesystem of
    ``folder``; :meth:`check` compares each filesystem's total with its free space. ``writer`` names the run in the
    error ("this conversion")."""

    def __init__(self, writer: str) -> None:
        self.writer = writer
        self.folders: dict[int, Path] = {}  # device -> the first folder named on it (for the message)
        self.parts: dict[int, dict[str, int]] = {}  # device -> {what: bytes}

    def add(self, folder: Path, what: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        dev = device(folder)
        self.folders.setdefault(dev, folder)
        parts = self.parts.setdefault(dev, {})
        parts[what] = parts.get(what, 0) + nbytes

    def check(self, freed: int = 0, freed_from: Path | None = None) -> None:
        """OutputError naming the first filesystem whose bytes exceed its free space, plus ``freed`` bytes where
        that is ``freed_from``'s filesystem (what the run deletes there first)."""
        credit_dev = device(freed_from) if freed_from is not None else None
        for dev, parts in self.parts.items():
            folder = self.folders[dev]
            need = sum(parts.values())
            free = free_bytes(folder)
            credit = freed if dev == credit_dev else 0
            if free is None or need <= free + credit:
                continue
            what = ", ".join(f"{name} {size_text(n)}" for name, n in parts.items())
            deleted = f" (and {size_text(credit)} that --overwrite deletes first)" if credit else ""
            raise OutputError(
                f"not enough free space on the filesystem of {folder}: {self.writer} writes about {size_text(need)} "
                f"there ({what}) and {size_text(free)} is free{deleted}; free some space or write elsewhere, or pass "
                "--skip-space-check if that filesystem compresses or deduplicates what it stores",
                file=folder,
            )
