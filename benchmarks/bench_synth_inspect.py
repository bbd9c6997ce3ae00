"""Time synthetic checkpoint writing and header-only inspection.

Usage: python benchmarks/bench_synth_inspect.py [--out /tmp/glm-pack-bench] [--big-layers 78] [--big-experts 64]

Prints, per source format, the wall time of `synthesize` for a 4-layer small GLM-5 checkpoint (2 experts),
then the time to write a big small-profile GLM-5 checkpoint (78 layers + MTP) and to open it and build the
full inspect report (config + index + every shard header, no tensor data).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from glm_pack.convert.inspect import inspect_checkpoint
from glm_pack.convert.synth import FORMATS, synthesize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/glm-pack-bench")
    ap.add_argument("--big-layers", type=int, default=78)
    ap.add_argument("--big-experts", type=int, default=64)
    args = ap.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    for fmt in FORMATS:
        start = time.perf_counter()
        path = synthesize(root / fmt, card="glm-5", layers=4, experts=2, fmt=fmt)
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        print(f"synth glm-5 small 4 layers {fmt:12s} {time.perf_counter() - start:6.2f} s  {size / 2**20:7.1f} MiB")
        shutil.rmtree(path)
    start = time.perf_counter()
    big = synthesize(root / "big", card="glm-5", layers=args.big_layers, experts=args.big_experts, fmt="bf16")
    size = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    print(
        f"synth glm-5 small {args.big_layers} layers x {args.big_experts} experts bf16 "
        f"{time.perf_counter() - start:6.2f} s  {size / 2**30:.2f} GiB"
    )
    start = time.perf_counter()
    report = inspect_checkpoint(big)
    print(
        f"inspect (headers only): {time.perf_counter() - start:.2f} s for {report['num_tensors']} tensors "
        f"in {len(report['files'])} shards, {len(report['mla'])} MLA layers"
    )
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
