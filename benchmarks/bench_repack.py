"""Whole-command speed and memory of ``glm-pack convert --repack-experts aiter-a4w4`` on real-size routed experts.

A full-profile synthetic GLM-5 in Quark MXFP4 (``--layers 4 --no-mtp``: three dense layers and one MoE layer whose
experts have GLM-5's true shapes, gate/up ``[2048, 6144]`` and down ``[6144, 2048]``, MXFP4 codes + E8M0 scales) is
converted by the real CLI in fresh processes, page cache dropped first (root; a real checkpoint never fits in it):
* ``--repack-experts none`` (the 4 MLA layers alone), then ``aiter-a4w4`` with 1 and 2 workers, each ``--repeats``
  times; wall time and peak RSS of the whole process tree, the load average before each run;
* with ``--split``, also 1 and 2 workers with the layer's experts written as 2 files (2 work items, the file bound
  lowered in the converting process): one MoE layer is one item (two at 256 experts, 5 GB + 0.13 GB), so this is
  what 2 workers give on a real checkpoint, whose ~75 MoE layers are separate items;
* the I/O floor: reading the expert tensors' byte ranges of the source and writing + fsyncing as many bytes.
``--files none``: the originals' copy step is measured by bench_convert.py. One source per ``--experts`` count, made,
measured and deleted in turn (a layer of 256 experts is ~5.2 GB; time and memory per expert count show the scaling).

    python benchmarks/bench_repack.py [--workdir /tmp/glm-pack-bench] [--experts 32 64 128] [--repeats 2] [--split]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_caches, run_measured  # noqa: E402


def glm5_moe_full(work: Path, experts: int) -> Path:
    """Full-profile GLM-5, MXFP4 (Quark), 3 dense layers + 1 MoE layer of ``experts`` routed experts, no MTP."""
    src = work / f"glm5-full-moe-{experts}"
    if not (src / "config.json").is_file():
        from glm_pack.convert.synth import synthesize

        synthesize(  # overwrite: what an interrupted run left (no config.json yet)
            src, card="glm-5", layers=4, experts=experts, fmt="mxfp4-quark", profile="full", mtp=False, overwrite=True
        )
    return src


def expert_ranges(src: Path) -> list[tuple[Path, int, int]]:
    """(file, begin, length) of every tensor ``--repack-experts aiter-a4w4`` reads (expert weights and scales)."""
    from glm_pack.convert.checkpoint import open_checkpoint
    from glm_pack.convert.items import plan_items

    ckpt = open_checkpoint(src)
    names = [
        t
        for item in plan_items(ckpt, "aiter-a4w4")
        if item.kind == "experts"
        for weight in item.weights
        for t in ckpt.source_tensors(weight)
    ]
    return [(src / ckpt.info(t).file, ckpt.info(t).begin, ckpt.info(t).nbytes) for t in names]


def io_floor(ranges: list[tuple[Path, int, int]], work: Path, block: int = 64 << 20) -> float:
    """Seconds (cold page cache) to read ``ranges`` and write + fsync as many bytes to one file, 64 MiB at a time."""
    drop_caches()
    target = work / "io-floor.bin"
    start = time.perf_counter()
    with open(target, "wb") as out:
        for path, begin, length in ranges:
            with open(path, "rb") as f:
                f.seek(begin)
                while length:
                    data = f.read(min(block, length))
                    out.write(data)
                    length -= len(data)
        out.flush()
        os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    target.unlink()
    return seconds


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# The CLI with convert's expert file bound set to {} bytes (the items then go to the workers as usual).
SPLIT_CLI = (
    "import functools, sys; import glm_pack.convert.convert as c; "
    "c.plan_items = functools.partial(c.plan_items, file_bytes={}); from glm_pack.convert.cli import main; main()"
)


def convert(src: Path, out: Path, repack: str, workers: int, file_bytes: int | None) -> tuple[float, int, str]:
    """One cold run of the CLI (expert files of at most ``file_bytes`` when given): (wall seconds, peak RSS of the
    process tree, load average before it)."""
    drop_caches()
    before = load()
    cli = ["-c", SPLIT_CLI.format(file_bytes)] if file_bytes else ["-m", "glm_pack.convert.cli"]
    cmd = [sys.executable, *cli, "convert", str(src), str(out), "--files", "none"]
    cmd += ["--repack-experts", repack, "--workers", str(workers), "--overwrite", "--quiet"]
    seconds, rss = run_measured(cmd)
    return seconds, rss, before


def row(experts: int, gib: float, *cells) -> None:
    print(f"| {experts} | {gib:.2f} | {' | '.join(map(str, cells))} |", flush=True)


def file_hashes(out: Path) -> dict:
    return json.loads((out / "glm-pack" / "manifest.json").read_text())["files"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/glm-pack-bench"))
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--split", action="store_true", help="also runs with the layer's experts in 2 files")
    args = parser.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    print("| experts | expert bytes GiB | run | workers | wall s | peak RSS MiB | load before |")
    print("|---|---|---|---|---|---|---|")
    for experts in args.experts:
        src = glm5_moe_full(work, experts)
        ranges = expert_ranges(src)
        gib = sum(n for _, _, n in ranges) / 2**30
        out = work / "out"
        half = sum(n for _, _, n in ranges) // 2 + 1  # two files of about half the layer each
        runs = [("MLA only (--repack-experts none)", "none", 1, None)] * args.repeats
        for label, file_bytes in [("aiter-a4w4", None)] + [("aiter-a4w4, experts in 2 files", half)] * args.split:
            runs += [(label, "aiter-a4w4", w, file_bytes) for w in (1, 2) for _ in range(args.repeats)]
        hashes = {}
        for label, repack, workers, file_bytes in runs:
            seconds, rss, before = convert(src, out, repack, workers, file_bytes)
            if repack != "none":
                hashes.setdefault((workers, file_bytes), file_hashes(out))
            row(experts, gib, label, workers, f"{seconds:.1f}", f"{rss / 2**20:.0f}", before)
        if any(hashes[1, f] != hashes[2, f] for _, _, _, f in runs[args.repeats :]):
            raise SystemExit(f"{experts} experts: the overlay differs between 1 and 2 workers")
        shutil.rmtree(out)
        for _ in range(args.repeats):
            before = load()
            seconds = io_floor(ranges, work)
            row(experts, gib, "I/O floor (read, write + fsync as many bytes)", "-", f"{seconds:.1f}", "-", before)
        shutil.rmtree(src)


if __name__ == "__main__":
    main()
