"""Check and time GLM's GEMM calls whose x or out starts off 16-byte alignment (one GPU).

The Gluon and TMA kernels address x and y through tensor descriptors, which need 16-byte aligned starts and row
strides; the table of ``bench_triton_bmm.py`` passes aligned views. Here, for every case (op x heads x tokens, no
config), x (``--tensor x``) or out (``--tensor out``) is moved one element (2 bytes) into rows 8 elements longer
(:func:`one_element_in`). Each case is checked against the reference (output poisoned first) and timed as
``bench_triton_bmm.py`` times (CUDA-graph replays over sets exceeding 3x L2), next to the same call on the aligned
tensors and torch bf16 ``bmm`` on the dequantized weights. With ``--staged`` it also times the alternative of an
aligned copy: x copied into an aligned buffer before the call, or y written to an aligned buffer and copied into out
after it. "fell back" says whether the call took the one-stage fallback (:func:`triton_bmm.unpipelined`).

    python benchmarks/bench_bmm_alignment.py [--tensor x|out] [--staged] [--ops kup192,kup256,vup]
        [--heads 16,64] [--tokens 1,16,64,256,1024,8192] [--out DIR]

Results go to stdout (a markdown table) and, with ``--out``, to ``DIR/bench_bmm_alignment.{md,json}``; the exit
code is 1 if a check failed, 2 where no GPU or Triton is available.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bench_triton_bmm as bt
import torch

from glm_pack.runtime.kernels import triton_bmm as tb


def one_element_in(rows: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` values of each row of ``rows`` ``[T, H, W]`` (bf16), copied one element into new rows of
    ``W + 8``, as a ``[H, T, width]`` view: its start 2 bytes past a 16-byte boundary (a new allocation's start is
    aligned), the rows' strides those of the new rows."""
    T, H, W = rows.shape
    wider = torch.empty(T, H, W + 8, dtype=rows.dtype, device=rows.device)
    wider[..., 1 : W + 1] = rows
    return wider[..., 1 : width + 1].transpose(0, 1)


def _call(s: dict, x: torch.Tensor, out: torch.Tensor) -> None:
    tb.bmm_a16wfp4(x, s["codes"], s["scales"], act_quant="mxfp4", out=out)


def time_staged(sets: list[dict], tensor: str) -> float:
    """Device microseconds per call with an aligned copy standing in for the shifted tensor: x copied in before the
    call, or out copied out after it."""
    for s in sets:
        s["staged"] = torch.empty_like(s["aligned_" + tensor].transpose(0, 1)).transpose(0, 1)

    def run():
        for s in sets:
            if tensor == "x":
                s["staged"].copy_(s["x"])
                _call(s, s["staged"], s["out"])
            else:
                _call(s, s["x"], s["staged"])
                s["out"].copy_(s["staged"])

    return bt._time(run, len(sets))


def bench_case(op: str, H: int, T: int, tensor: str, staged: bool, l2: int, gen: torch.Generator) -> dict:
    N, K, _ = bt.OPS[op]
    sets = bt.make_sets(op, H, T, l2, gen)
    aligned = [dict(s) for s in sets]
    for s in sets:
        s["aligned_" + tensor] = s[tensor]
        s[tensor] = one_element_in(s["q"], K) if tensor == "x" else one_element_in(s["out"].transpose(0, 1), N)
    fallbacks = []
    unpipelined = tb.unpipelined
    tb.unpipelined = lambda cfg: fallbacks.append(cfg) or unpipelined(cfg)
    try:
        row = {"op": op, "H": H, "T": T, "tensor": tensor, "default": tb.default_config(H, T, N, K).__dict__,
               "check": bt.check(sets[0], "mxfp4", None, bt.reference(sets[0], "mxfp4"))}  # fmt: skip
    finally:
        tb.unpipelined = unpipelined
    row["fell_back"] = bool(fallbacks)
    row["us"] = bt.time_ours(sets, "mxfp4", None)
    if staged:
        row["staged_us"] = time_staged(sets, tensor)
    row["aligned_us"] = bt.time_ours(aligned, "mxfp4", None)
    row["torch_us"] = bt.time_torch(bt.torch_sets(aligned, op, H, T, l2))
    del sets, aligned
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    staged = any("staged_us" in r for r in rows)
    head = (f"| op | H | T | {rows[0]['tensor'] if rows else ''} off 16 bytes: default config | fell back | check "
            f"| us |{' staged us |' if staged else ''} aligned us | torch us | us / aligned |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        c, fell = r["check"], "yes" if r["fell_back"] else "no"
        staged_us = f" {r['staged_us']:.2f} |" if staged else ""
        lines.append(
            f"| {r['op']} | {r['H']} | {r['T']} | {bt.kernel_label(r['default'])} | {fell} "
            f"| {'ok' if c['ok'] else 'FAIL'} {c['max_diff_over_tol']:.2f}, {100 * c['bit_identical']:.1f}% "
            f"| {r['us']:.2f} |{staged_us} {r['aligned_us']:.2f} | {r['torch_us']:.2f} "
            f"| {r['us'] / r['aligned_us']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor", choices=("x", "out"), default="out", help="the tensor moved off 16-byte alignment")
    p.add_argument("--staged", action="store_true", help="also time the call with an aligned copy standing in")
    p.add_argument("--ops", default="kup192,kup256,vup")
    p.add_argument("--heads", default="16,64")
    p.add_argument("--tokens", default="1,16,64,256,1024,8192")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    why = bt.unavailable()
    if why:
        print(why)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 bmm must be true fp32
    env = bt.environment()
    print(json.dumps(env, indent=1), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(20261202)
    rows = []
    for op, H, T in bt.benchmark_cases(args.ops, args.heads, args.tokens):
        rows.append(bench_case(op, H, T, args.tensor, args.staged, env["l2_bytes"], gen))
        print(json.dumps(rows[-1]), flush=True)
    md = table(rows)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_bmm_alignment.json").write_text(json.dumps({"env": env, "rows": rows}))
        (args.out / "bench_bmm_alignment.md").write_text(md + "\n")
    return 1 if any(not r["check"]["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
