"""The torch backend's sparse MLA (``glm_pack.runtime.reference.sparse_mla``, what ``attend`` runs on CPU): time per
call and the peak-memory growth of the process, against the cache's size (slots), for GLM-5's per-rank geometry at
TP 8 (8 heads, latent 512, rope 64), top-k 2048. Each case runs in a fresh process, so the peak it reports is its
own (best time of ``--repeat`` calls).

    python benchmarks/bench_torch_attend.py [--slots 16384,131072,524288] [--tokens 1,4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASE = """
import json, resource, sys, time, torch
from glm_pack.runtime.reference import sparse_mla
slots, T, topk, repeat = (int(a) for a in sys.argv[1:5])
g = torch.Generator().manual_seed(0)
cache = torch.randn(slots, 576, generator=g, dtype=torch.bfloat16)  # no float32 copy first: the peak is attend's
q = torch.randn(T, 8, 512, generator=g).bfloat16()
rope = torch.randn(T, 8, 64, generator=g).bfloat16()
idx = torch.randint(0, slots, (T * topk,), generator=g, dtype=torch.int32)
ptr = torch.arange(0, T * topk + 1, topk, dtype=torch.int32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
best = float("inf")
for _ in range(repeat):
    start = time.perf_counter()
    sparse_mla(q, rope, cache, ptr, idx, 0.0625)
    best = min(best, time.perf_counter() - start)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"ms": best * 1e3, "peak_mib": grown / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="16384,131072,524288")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| slots | cache (bf16) | tokens | ms per call (best) | peak memory growth |")
    print("|---:|---:|---:|---:|---:|")
    for slots in (int(s) for s in args.slots.split(",")):
        for tokens in (int(t) for t in args.tokens.split(",")):
            argv = [str(v) for v in (slots, tokens, args.topk, args.repeat)]
            done = subprocess.run([sys.executable, "-c", CASE, *argv], capture_output=True, text=True, check=True)
            result = json.loads(done.stdout)
            mib = slots * 576 * 2 / 2**20
            print(f"| {slots} | {mib:.0f} MiB | {tokens} | {result['ms']:.1f} | {result['peak_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
