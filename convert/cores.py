"""How many cores glm-pack may keep busy: its CPU affinity, capped by a cgroup CPU quota.

A container limited by a quota (Docker ``--cpus``, a Kubernetes CPU limit, systemd ``CPUQuota=``) still sees every
core of the host in its affinity; one worker process per host core there would be throttled to the quota and hold
a worker's memory each. Linux only; elsewhere the affinity (or the machine's core count) alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath

CGROUP_FS = Path("/sys/fs/cgroup")  # where cgroup v2 (or v1's per-controller folders) is mounted
SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup per hierarchy: "ID:CONTROLLERS:PATH" lines


def usable_cores() -> int:
    """The cores this process may use: the fewer of its CPU affinity (a container's cpuset, taskset; every core of
    the machine where the OS keeps none) and its cgroup CPU quota (:func:`cpu_quota`); at least 1."""
    try:
        cores = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, quota))


def use_threads(threads: int) -> None:
    """Run torch's and numba's parallel work in this process on at most ``threads`` threads (never more than each
    would use anyway). Both size their pools by the cores they see, which a CPU quota does not shrink."""
    import torch

    torch.set_num_threads(max(1, min(threads, torch.get_num_threads())))
    try:
        import numba

        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    except ImportError:
        pass


def cpu_quota() -> int | None:
    """Cores the cgroup CPU quota of this process allows: quota / period rounded up, the smallest set on its cgroup
    or any ancestor (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); None where none is
    set or none can be read (no cgroup filesystem, a cgroup outside this mount namespace's view)."""
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        _, controllers, path = fields
        if controllers == "":  # the v2 hierarchy ("0::/path")
            limits += _limits_along(CGROUP_FS, path, _v2_limit)
        elif "cpu" in controllers.split(","):  # v1's cpu controller, mounted as "cpu" or "cpu,cpuacct"
            folders = [CGROUP_FS / controllers, CGROUP_FS / "cpu"]
            mount = next((f for f in folders if f.is_dir()), None)
            limits += _limits_along(mount, path, _v1_limit) if mount else []
    return min(limits, default=None)


def _limits_along(mount: Path, path: str, limit) -> list[int]:
    """The quotas ``limit(folder)`` finds on cgroup ``path`` and each of its ancestors up to ``mount``."""
    parts = PurePosixPath(path).parts[1:]
    if ".." in parts:  # the cgroup lies outside this namespace's root: its folders are not under the mount
        return []
    found = (limit(mount.joinpath(*parts[:depth])) for depth in range(len(parts) + 1))
    return [cores for cores in found if cores is not None]


def _v2_limit(folder: Path) -> int | None:
    """``cpu.max`` holds "QUOTA PERIOD" (microseconds) or "max PERIOD"."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _cores(quota, period)


def _v1_limit(folder: Path) -> int | None:
    """``cpu.cfs_quota_us`` is -1 where no quota is set."""
    try:
        quota, period = ((folder / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    except OSError:
        return None
    return _cores(quota, period)


def _cores(quota: str, period: str) -> int | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return math.ceil(quota_us / period_us) if quota_us > 0 and period_us > 0 else None
