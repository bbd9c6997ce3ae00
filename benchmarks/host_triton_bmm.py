"""Host (CPU) cost of eager A16WFP4 GEMM calls: microseconds per call of ``bmm_a16wfp4`` with its default config
next to torch bf16 ``bmm`` (one GPU; device time is ``bench_triton_bmm.py``'s job).

For each case (op x heads x tokens) it calls both with the same tensors, back to back without synchronising,
and reports the best of 5 runs of ``--calls`` calls (``bench_triton_bmm.host_us``): the host's other work only
ever adds to a run. Where a call's device time exceeds its host time the launch queue fills and the figure is
the device's; the default cases stay below that on an H200. To compare two versions of ``glm_pack``, run this
with each on ``PYTHONPATH`` in turn, alternating, and keep each case's lower figure.

    python benchmarks/host_triton_bmm.py [--ops kup192,kup256,vup] [--heads 16,64] [--tokens 1,64,256,1024]
        [--calls 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_triton_bmm import OPS, benchmark_cases, host_us, kernel_label, make_set, unavailable  # noqa: E402

from glm_pack.runtime.kernels import triton_bmm as tb  # noqa: E402


def host_case(op: str, H: int, T: int, calls: int, gen: torch.Generator) -> dict:
    """Host us per call of ours (default config, mxfp4) and of torch ``bmm`` on contiguous bf16 operands."""
    N, K, _ = OPS[op]
    s = make_set(op, H, T, gen)
    xc = s["x"].contiguous()
    wt = torch.randn(H, K, N, device="cuda", generator=gen).to(torch.bfloat16)
    yc = torch.empty(H, T, N, device="cuda", dtype=torch.bfloat16)
    ours = host_us(lambda: tb.bmm_a16wfp4(s["x"], s["codes"], s["scales"], out=s["out"]), calls)
    theirs = host_us(lambda: torch.bmm(xc, wt, out=yc), calls)
    return {"op": op, "H": H, "T": T, "kernel": kernel_label(tb.default_config(H, T, N, K).__dict__),
            "host_us": ours, "torch_host_us": theirs}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="kup192,kup256,vup")
    p.add_argument("--heads", default="16,64")
    p.add_argument("--tokens", default="1,64,256,1024")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(why)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [host_case(op, H, T, args.calls, gen) for op, H, T in benchmark_cases(args.ops, args.heads, args.tokens)]
    print("| op | H | T | kernel (default config) | host us per call: ours | torch bmm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['H']} | {r['T']} | {r['kernel']} | {r['host_us']:.1f} | {r['torch_host_us']:.1f} |")
    if args.out:
        args.out.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
