"""Where a path lies inside its filesystem, from the mount table (``/proc/self/mountinfo``, Linux): a bind mount
shows one folder under two paths, and only that location relates them (a folder inside the mounted one, or above
it, has another device and inode than anything on the other path)."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

MOUNTINFO = Path("/proc/self/mountinfo")

Mount = tuple[PurePosixPath, str, PurePosixPath]  # (mount point, device "major:minor", its root inside the filesystem)


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo table, in its order (fields 3-5: major:minor, root, mount point)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5:
            mounts.append((PurePosixPath(_unescape(fields[4])), fields[2], PurePosixPath(_unescape(fields[3]))))
    return mounts


def read_mounts() -> list[Mount]:
    """This process's mounts; none where the table cannot be read (not Linux)."""
    try:
        return parse_mountinfo(MOUNTINFO.read_text())
    except OSError:
        return []


def fs_location(path: Path, mounts: list[Mount]) -> tuple[str, PurePosixPath] | None:
    """(device, path inside that filesystem) of the absolute, resolved ``path``: under the deepest mount point above
    it, the last listed there (a later mount covers an earlier one); None without a mount table."""
    best = None
    for point, device, root in mounts:
        if (point == path or point in path.parents) and (best is None or len(point.parts) >= len(best[0].parts)):
            best = (point, device, root)
    if best is None:
        return None
    point, device, root = best
    return device, root.joinpath(PurePosixPath(path).relative_to(point))
