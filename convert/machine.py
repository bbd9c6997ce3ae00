"""What glm-pack may use of the machine: cores (CPU affinity, a cgroup CPU quota) and memory (a cgroup memory limit,
the memory available), and the worker count they allow.

A container limited by a quota (Docker ``--cpus``, a Kubernetes CPU limit, systemd ``CPUQuota=``) still sees every
core of the host in its affinity, and every byte of the host's memory in ``/proc/meminfo``: one worker per host
core there would be throttled to the quota, and killed for memory past the container's limit. Linux only;
elsewhere the affinity (or the machine's core count) alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path, PurePosixPath

CGROUP_FS = Path("/sys/fs/cgroup")  # where cgroup v2 (or v1's per-controller folders) is mounted
SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup per hierarchy: "ID:CONTROLLERS:PATH" lines
MEMINFO = Path("/proc/meminfo")
# Memory to plan per worker process, with room: under a cgroup limit two workers and the converting process fitted
# 1.25 GiB but not 1 GiB, i.e. about 0.5 GiB a worker (RSS 0.55-0.75 GiB each, counting shared pages; MLA layers
# and a layer's routed experts alike; BENCHMARKS "convert at scale").
WORKER_BYTES = 1 << 30
_NO_V1_LIMIT = 1 << 60  # v1 reports "no memory limit" as a page-rounded 2**63 - 1


def default_workers() -> int:
    """``convert --workers``' default: one per usable core (:func:`usable_cores`), at most one per
    :data:`WORKER_BYTES` of the memory this process may take (:func:`usable_memory`); at least 1."""
    memory = usable_memory()
    cores = usable_cores()
    return max(1, cores if memory is None else min(cores, memory // WORKER_BYTES))


def usable_cores() -> int:
    """The cores this process may use: the fewer of its CPU affinity (a container's cpuset, taskset; every core of
    the machine where the OS keeps none) and its cgroup CPU quota (:func:`cpu_quota`); at least 1."""
    try:
        cores = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, quota))


def usable_memory() -> int | None:
    """Bytes this process may take: the fewer of its cgroup memory limit (:func:`memory_limit`) and the machine's
    available memory (``MemAvailable``); None where neither can be read."""
    known = [m for m in (memory_limit(), available_memory()) if m is not None]
    return min(known, default=None)


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
    return min(_cgroup_limits("cpu", _v2_cpu, _v1_cpu), default=None)


def memory_limit() -> int | None:
    """Bytes the cgroup memory limit of this process allows, the smallest set on its cgroup or any ancestor (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``); None where none is set or none can be read."""
    return min(_cgroup_limits("memory", _v2_memory, _v1_memory), default=None)


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (the whole machine's, also inside a container); None where
    there is none (not Linux)."""
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * 1024 if number.isdigit() and unit == "kB" else None
    return None


def _cgroup_limits(controller: str, v2_limit, v1_limit) -> list[int]:
    """The limits found along this process's cgroups: ``v2_limit(folder)`` in the v2 hierarchy ("0::/path") and
    ``v1_limit(folder)`` in v1's ``controller`` hierarchy (mounted as e.g. "cpu,cpuacct" or "cpu")."""
    try:
        lines = SELF_CGROUP.read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            continue
        _, controllers, path = fields
        if controllers == "":
            limits += _limits_along(CGROUP_FS, path, v2_limit)
        elif controller in controllers.split(","):
            folders = [CGROUP_FS / controllers, CGROUP_FS / controller]
            mount = next((f for f in folders if f.is_dir()), None)
            limits += _limits_along(mount, path, v1_limit) if mount else []
    return limits


def _limits_along(mount: Path, path: str, limit) -> list[int]:
    """The limits ``limit(folder)`` finds on cgroup ``path`` and each of its ancestors up to ``mount``."""
    parts = PurePosixPath(path).parts[1:]
    if ".." in parts:  # the cgroup lies outside this namespace's root: its folders are not under the mount
        return []
    found = (limit(mount.joinpath(*parts[:depth])) for depth in range(len(parts) + 1))
    return [value for value in found if value is not None]


def _read(folder: Path, name: str) -> str | None:
    try:
        return (folder / name).read_text().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _v2_cpu(folder: Path) -> int | None:
    """``cpu.max`` holds "QUOTA PERIOD" (microseconds) or "max PERIOD"."""
    fields = (_read(folder, "cpu.max") or "").split()
    return _cores(*fields) if len(fields) == 2 else None


def _v1_cpu(folder: Path) -> int | None:
    """``cpu.cfs_quota_us`` is -1 where no quota is set."""
    return _cores(_read(folder, "cpu.cfs_quota_us"), _read(folder, "cpu.cfs_period_us"))


def _cores(quota: str | None, period: str | None) -> int | None:
    quota_us, period_us = _number(quota), _number(period)  # "max" reads as no number: no quota
    if quota_us is None or period_us is None or quota_us <= 0 or period_us <= 0:
        return None
    return math.ceil(quota_us / period_us)


def _v2_memory(folder: Path) -> int | None:
    """``memory.max`` holds bytes or "max"."""
    return _number(_read(folder, "memory.max"))


def _v1_memory(folder: Path) -> int | None:
    """``memory.limit_in_bytes`` holds bytes, about 2**63 where no limit is set."""
    limit = _number(_read(folder, "memory.limit_in_bytes"))
    return limit if limit is not None and limit < _NO_V1_LIMIT else None
