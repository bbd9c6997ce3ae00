"""What glm-pack may use of the machine, read from hand-made cgroup trees (the layouts Docker, Kubernetes and
systemd leave) and /proc/meminfo."""

from __future__ import annotations

import os

import pytest

from glm_pack.convert import machine


@pytest.fixture
def cgroup(tmp_path, monkeypatch):
    """Point the module at a fake cgroup mount, /proc/self/cgroup and /proc/meminfo (none of them written yet);
    returns (write_self, write_file)."""
    mount, self_file = tmp_path / "sys-fs-cgroup", tmp_path / "proc-self-cgroup"
    mount.mkdir()
    monkeypatch.setattr(machine, "CGROUP_FS", mount)
    monkeypatch.setattr(machine, "SELF_CGROUP", self_file)
    monkeypatch.setattr(machine, "MEMINFO", tmp_path / "proc-meminfo")

    def write_self(*lines: str) -> None:
        self_file.write_text("".join(line + "\n" for line in lines))

    def write_file(rel: str, text: str) -> None:
        path = mount / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    return write_self, write_file


def test_v2_quota_is_the_smallest_along_the_path_rounded_up(cgroup):
    write_self, write_file = cgroup
    write_self("0::/kubepods/pod1/ctr")
    write_file("kubepods/pod1/ctr/cpu.max", "max 100000")  # the container sets none
    write_file("kubepods/pod1/cpu.max", "250000 100000")  # the pod's limit: 2.5 cores -> 3
    write_file("kubepods/cpu.max", "800000 100000")
    write_file("cpu.max", "max 100000")
    assert machine.cpu_quota() == 3
    write_file("kubepods/pod1/ctr/cpu.max", "50000 100000")  # half a core still runs one worker
    assert machine.cpu_quota() == 1


def test_v2_namespace_root_with_and_without_a_quota(cgroup):
    write_self, write_file = cgroup
    write_self("0::/")  # a container with its own cgroup namespace sees its cgroup as the root
    write_file("cpu.max", "200000 100000")
    assert machine.cpu_quota() == 2
    write_file("cpu.max", "max 100000")
    assert machine.cpu_quota() is None


@pytest.mark.parametrize("folder", ["cpu,cpuacct", "cpu"])
def test_v1_cfs_quota_under_either_mount_name(cgroup, folder):
    """cgroup v1: the cpu controller's folder is "cpu,cpuacct" (with a "cpu" link) or "cpu"; -1 means no quota."""
    write_self, write_file = cgroup
    write_self("4:memory:/docker/abc", "3:cpu,cpuacct:/docker/abc", "0::/docker/abc")
    write_file(f"{folder}/docker/abc/cpu.cfs_quota_us", "300000")
    write_file(f"{folder}/docker/abc/cpu.cfs_period_us", "100000")
    write_file(f"{folder}/docker/cpu.cfs_quota_us", "-1")
    write_file(f"{folder}/docker/cpu.cfs_period_us", "100000")
    write_file("memory/docker/abc/cpu.cfs_quota_us", "100000")  # another controller's folder is not read
    write_file("memory/docker/abc/cpu.cfs_period_us", "100000")
    assert machine.cpu_quota() == 3
    write_file(f"{folder}/docker/abc/cpu.cfs_quota_us", "-1")
    assert machine.cpu_quota() is None


def test_v1_docker_mounts_the_container_s_own_cgroup_as_the_root(cgroup):
    """Docker on cgroup v1 lists "/docker/ID" in /proc/self/cgroup but mounts that cgroup's own folder at the
    controller's root, so no docker/ID folder exists: the walk up the path reaches the root and reads it there."""
    write_self, write_file = cgroup
    write_self("3:cpu,cpuacct:/docker/0123abcd", "4:memory:/docker/0123abcd")
    write_file("cpu,cpuacct/cpu.cfs_quota_us", "200000")
    write_file("cpu,cpuacct/cpu.cfs_period_us", "100000")
    write_file("memory/memory.limit_in_bytes", str(6 << 30))
    assert (machine.cpu_quota(), machine.memory_limit()) == (2, 6 << 30)


def test_hybrid_layout_reads_both_hierarchies(cgroup):
    """A hybrid host (v1 controllers, an empty v2 tree beside them): the v2 line finds no cpu.max, the v1 line does."""
    write_self, write_file = cgroup
    write_self("1:cpu:/glm", "0::/")
    write_file("unified/cgroup.procs", "")
    write_file("cpu/glm/cpu.cfs_quota_us", "100000")
    write_file("cpu/glm/cpu.cfs_period_us", "100000")
    assert machine.cpu_quota() == 1


@pytest.mark.parametrize(
    "self_lines, files",
    [
        (None, {}),  # no /proc/self/cgroup (not Linux)
        (["0::/"], {}),  # no cpu.max at all
        (["0::/"], {"cpu.max": "lots 100000"}),
        (["0::/"], {"cpu.max": "100000"}),
        (["0::/"], {"cpu.max": "100000 0"}),
        (["1:cpu:/a"], {"cpu/a/cpu.cfs_quota_us": "100000"}),  # no period file
        (["0::/../outside"], {"cpu.max": "100000 100000", "outside/cpu.max": "100000 100000"}),
        (["garbage"], {"cpu.max": "100000 100000"}),
    ],
)
def test_no_quota_when_none_can_be_read(cgroup, self_lines, files):
    write_self, write_file = cgroup
    if self_lines is not None:
        write_self(*self_lines)
    for rel, text in files.items():
        write_file(rel, text)
    assert machine.cpu_quota() is None


def test_usable_cores_is_the_fewer_of_affinity_and_quota(cgroup, monkeypatch):
    write_self, write_file = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    write_self("0::/")
    assert machine.usable_cores() == 8  # no quota
    write_file("cpu.max", "350000 100000")
    assert machine.usable_cores() == 4
    write_file("cpu.max", "3200000 100000")
    assert machine.usable_cores() == 8
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows: every core of the machine
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert machine.usable_cores() == 16  # 32-core quota, 16 cores


@pytest.fixture
def restore_threads():
    """Put torch's and numba's thread counts back after a test that lets the CLI change them."""
    import numba
    import torch

    before = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])


def test_cli_convert_runs_on_the_quota_s_threads(cgroup, monkeypatch, tmp_path, restore_threads):
    """The CLI's own process (where --workers 1 does the work) gives torch and numba no more threads than the quota
    allows: both size their pools by the cores they see, which a quota does not shrink."""
    import numba
    import torch
    from click.testing import CliRunner

    from glm_pack.convert import commands
    from glm_pack.convert.cli import main
    from glm_pack.packing.errors import GlmPackError

    write_self, write_file = cgroup
    write_self("0::/")
    write_file("cpu.max", "100000 100000")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    torch.set_num_threads(2)
    numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
    seen = []

    def spy(src, out, options, progress=None):
        seen.append((options.workers, torch.get_num_threads(), numba.get_num_threads()))
        raise GlmPackError("spied")

    monkeypatch.setattr(commands, "convert", spy)
    args = ["convert", str(tmp_path / "src"), str(tmp_path / "out")]
    r = CliRunner().invoke(main, args, env={"GLM_PACK_WORKERS": None})
    assert r.exit_code == 1 and "spied" in r.output and seen == [(1, 1, 1)], (r.output, seen)


def test_memory_limit_is_the_smallest_along_the_path(cgroup):
    write_self, write_file = cgroup
    write_self("0::/kubepods/pod1/ctr")
    write_file("kubepods/pod1/ctr/memory.max", "max")
    write_file("kubepods/pod1/memory.max", str(12 << 30))
    write_file("kubepods/memory.max", str(64 << 30))
    assert machine.memory_limit() == 12 << 30
    write_file("kubepods/pod1/memory.max", "max")
    assert machine.memory_limit() == 64 << 30
    write_file("kubepods/memory.max", "max")
    assert machine.memory_limit() is None


def test_v1_memory_limit_and_its_no_limit_value(cgroup):
    write_self, write_file = cgroup
    write_self("4:memory:/docker/abc", "3:cpu,cpuacct:/docker/abc")
    write_file("memory/docker/abc/memory.limit_in_bytes", str(3 << 30))
    write_file("memory/memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit" (2**63 - 1, page-rounded)
    write_file("cpu,cpuacct/docker/abc/memory.limit_in_bytes", str(1 << 30))  # another controller's folder
    assert machine.memory_limit() == 3 << 30
    write_file("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712")
    assert machine.memory_limit() is None


@pytest.mark.parametrize(
    "meminfo, expected",
    [
        ("MemTotal:       24570404 kB\nMemFree:         1000000 kB\nMemAvailable:   23714384 kB\n", 23714384 * 1024),
        ("MemTotal: 1000 kB\n", None),  # kernels before 3.14 have no MemAvailable
        ("MemAvailable: lots kB\n", None),
        (None, None),
    ],
)
def test_available_memory_reads_memavailable(cgroup, tmp_path, meminfo, expected):
    if meminfo is not None:
        (tmp_path / "proc-meminfo").write_text(meminfo)
    assert machine.available_memory() == expected


def test_default_workers_one_per_core_and_per_gib(cgroup, tmp_path, monkeypatch):
    """One worker per usable core, at most one per GiB of the fewer of the cgroup limit and MemAvailable; at least
    one; cores alone where no memory figure can be read."""
    write_self, write_file = cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    meminfo = tmp_path / "proc-meminfo"
    assert machine.default_workers() == 8  # nothing to read
    write_self("0::/")
    meminfo.write_text(f"MemAvailable: {(5 << 30) // 1024 + 10} kB\n")
    assert machine.default_workers() == 5
    write_file("memory.max", str((7 << 29) - 1))  # just under 3.5 GiB
    assert machine.default_workers() == 3
    write_file("cpu.max", "200000 100000")
    assert machine.default_workers() == 2
    write_file("memory.max", str(1 << 28))
    assert machine.default_workers() == 1
    write_file("memory.max", str(64 << 30))
    meminfo.write_text(f"MemAvailable: {64 << 20} kB\n")
    assert machine.default_workers() == 2  # the quota
