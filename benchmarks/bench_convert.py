"""Whole-command speed and memory of ``glm-pack convert`` on all 79 MLA layers of GLM-5 (issue 6).

A small-profile synthetic GLM-5 (78 layers + MTP; kv_b_proj [28672, 512] BF16 true shape, everything else
small) is converted with ``--files none`` by the real CLI in fresh processes:
* cold: the numba JIT cache emptied first (the first run on a machine), then cold process with warm cache;
* 1 and 2 workers; wall time and peak RSS of the whole process tree.
Compared with the I/O floor: reading the 79 kv_b_proj tensors' bytes and writing the overlay's bytes (fsync).
Then ``--files copy``'s copy step against ``cp`` on the same shard files.

    python benchmarks/bench_convert.py [--workdir /tmp/glm-pack-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_caches, glm5_79_layers, run_measured  # noqa: E402


def io_floor(src: Path, out: Path) -> float:
    """Seconds to read every kv_b_proj byte range of the source and write the overlay's bytes (fsynced)."""
    from glm_pack.convert.checkpoint import open_checkpoint

    ckpt = open_checkpoint(src)
    overlay = sorted((out / "glm-pack").glob("*.safetensors"))
    start = time.perf_counter()
    for layer in ckpt.mla_layers():
        info = ckpt.info(ckpt.card.kv_b_proj(layer))
        with open(src / info.file, "rb") as f:
            f.seek(info.begin)
            f.read(info.end - info.begin)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        for path in overlay:
            data = path.read_bytes()
            with open(Path(tmp) / path.name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    return time.perf_counter() - start


def copy_vs_cp(src: Path, work: Path, rounds: int = 3) -> tuple[float, float, float, int]:
    """Best of ``rounds`` (cold page cache each time): glm-pack's copy step (fsynced), cp, and cp + sync."""
    from glm_pack.convert.checkpoint import LocalStore
    from glm_pack.convert.convert import fsync_files, place_original

    listing = LocalStore(src).list_files()
    files, nbytes = [Path(rel) for rel, _ in listing], sum(size for _, size in listing)
    best = [float("inf")] * 3
    for _ in range(rounds):
        for i, step in enumerate(("ours", "cp", "cp+sync")):
            dst = work / "copy-bench"
            shutil.rmtree(dst, ignore_errors=True)
            dst.mkdir()
            drop_caches()
            start = time.perf_counter()
            if step == "ours":
                for f in files:
                    place_original(src / f, dst / f, "copy")
                fsync_files([dst / f for f in files])  # durable before the manifest; cp does not do this
            else:
                subprocess.run(["cp", *[str(src / f) for f in files], str(dst)], check=True)
                if step == "cp+sync":
                    subprocess.run(["sync"], check=True)
            best[i] = min(best[i], time.perf_counter() - start)
    shutil.rmtree(work / "copy-bench")
    return best[0], best[1], best[2], nbytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/glm-pack-bench"))
    args = parser.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    src = glm5_79_layers(work)
    cache = work / "numba-cache"
    env = {"NUMBA_CACHE_DIR": str(cache)}
    rows = []
    for label, workers, clear in (
        ("cold, empty JIT cache", 1, True),
        ("cold process", 1, False),
        ("cold, empty JIT cache", 2, True),
        ("cold process", 2, False),
    ):
        if clear:
            shutil.rmtree(cache, ignore_errors=True)
        out = work / f"out-{workers}"
        cmd = [
            sys.executable,
            "-m",
            "glm_pack.convert.cli",
            "convert",
            str(src),
            str(out),
            "--files",
            "none",
            "--workers",
            str(workers),
            "--overwrite",
            "--quiet",
        ]
        seconds, rss = run_measured(cmd, env)
        rows.append((label, workers, seconds, rss))
    floor = io_floor(src, work / "out-1")
    overlay_bytes = sum(p.stat().st_size for p in (work / "out-1" / "glm-pack").glob("*.safetensors"))
    print(f"source {src}: 79 MLA layers, overlay {overlay_bytes / 2**20:.0f} MiB")
    print("| run | workers | wall s | peak RSS MiB | / I/O floor |")
    print("|---|---|---|---|---|")
    for label, workers, seconds, rss in rows:
        print(f"| {label} | {workers} | {seconds:.1f} | {rss / 2**20:.0f} | {seconds / floor:.1f}x |")
    print(f"I/O floor (read 79 kv_b_proj, write + fsync the overlay): {floor:.2f} s")
    ours, cp_s, cp_sync_s, nbytes = copy_vs_cp(src, work)
    print(
        f"--files copy step (copies fsynced): {nbytes / 2**30:.2f} GiB in {ours:.2f} s "
        f"({nbytes / ours / 2**20:.0f} MiB/s); cp: {cp_s:.2f} s ({cp_s / ours:.2f}x of cp's throughput); "
        f"cp + sync: {cp_sync_s:.2f} s ({cp_sync_s / ours:.2f}x)"
    )


if __name__ == "__main__":
    main()
