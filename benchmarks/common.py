"""Shared helpers of the benchmark scripts: the 79-layer synthetic GLM-5 and process-tree peak RSS."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path


def glm5_79_layers(work: Path, fmt: str = "bf16") -> Path:
    """A small-profile GLM-5 with all 78 layers + MTP (79 MLA layers, kv_b_proj [28672, 512] true shape)."""
    src = work / f"glm5-79-{fmt}"
    if not (src / "config.json").is_file():
        from glm_pack.convert.synth import synthesize

        synthesize(src, card="glm-5", layers=78, experts=1, fmt=fmt, profile="small", seed=0)
    return src


def drop_caches() -> None:
    """Write back and drop the page cache (root only; best effort) so a step starts cold."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (from /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """Run ``cmd``; return (wall seconds, peak RSS in bytes of its whole process tree, sampled every 20 ms)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.02)

    thread = threading.Thread(target=sample)
    thread.start()
    rc = proc.wait()
    elapsed = time.perf_counter() - start
    thread.join()
    if rc:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {rc}")
    return elapsed, peak[0]
