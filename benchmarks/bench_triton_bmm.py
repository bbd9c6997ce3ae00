"""Check and time the Triton A16WFP4 batched GEMM on GLM's absorbed K-up / V-up shapes (one GPU).

For every case (op x heads x tokens) it checks the kernel against ``glm_pack.runtime.reference.bmm_a16wfp4``
on fresh random inputs (output poisoned with NaN first; every element must be written and lie within
:func:`glm_pack.runtime.kernels.triton_bmm.accumulation_tolerance`; the fraction of bit-identical elements
is printed), then times it next to torch bf16 ``bmm`` on the dequantized weights. Device time is measured as
CUDA-graph replays (as engines run decode; for prefill sizes this leaves out the host's launch cost, which
is reported apart as host microseconds per eager call), rotating over enough input sets that the working set
exceeds L2 (cold weights, as in a real model). With ``--producer`` each call is also timed right after a kernel
that writes its x, as in a model's graph (x fresh in L2): ``mul`` an elementwise kernel, ``gemm`` a bf16 matmul
(``[rows, 64] @ [64, width]``); ours gets the q rows x is a view of written, torch its contiguous x; the time is
that of a graph of such pairs minus one of the producers alone. The roofline column is the kernel's bytes (x, w
codes, scales, y) over the measured copy bandwidth, or its FLOPs over the measured bf16 matmul rate when that
is larger.

    python benchmarks/bench_triton_bmm.py --check [--out DIR] [--ops kup192,kup256,vup] [--heads 16,64]
        [--tokens 1,16,32,64,256,1024,8192] [--sweep] [--jobs N] [--producer mul|gemm]

``--sweep`` also times the candidate configs of each M bucket (checking each) and reports them; ``--jobs N``
compiles every kernel first in N processes, which saves minutes on a machine with an empty Triton cache.
Results go to stdout (a markdown table) and, with ``--out``, to ``DIR/bench_triton_bmm.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import multiprocessing
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from glm_pack.packing.mxfp4 import dequantize, quantize
from glm_pack.runtime.kernels import triton_bmm as tb
from glm_pack.runtime.reference import activation_as_float
from glm_pack.runtime.reference import bmm_a16wfp4 as reference_bmm

# op -> (N, K used by the kernel, width of the q row x is a view of)
OPS = {"kup192": (512, 192, 256), "kup256": (512, 256, 256), "vup": (256, 512, 512)}


def candidates(B: int, M: int, N: int, K: int) -> list[tb.BmmConfig]:
    """Configs worth timing for an M bucket (the default first): tiled shapes for decode (16-row tiles, long
    K steps, few warps; timed up to 64 rows); from 17 rows the Gluon kernel decoding its weight column itself
    (tiles whose column fits in shared memory), each with and without rounding warps, and its swap schedule
    (16-64-row x tiles against 64-256 weight rows, with 4 or 8 rounding warps); from 65 rows also on
    predecoded weights, the Triton kernels on predecoded weights, and the ``xreg`` schedule (x rounded in the
    MMA warps' registers)."""
    C, bk = tb.BmmConfig, tb._block_k

    def pre(bm, bn, warps, stages, tma=False, wgmma=""):
        return C(bm, bn, bk(K, 64), warps, stages, 0, True, tma, wgmma)

    def dec(bm, bn, warps, k_cap=64, schedule="decode"):  # Gluon kernel decoding its weight column itself
        k = bk(K, k_cap)
        if tb.gluon_bmm.tile_error(bm, bn, k, warps, schedule):
            return []
        fits = tb.gluon_bmm.plan(bm, bn, k, warps, schedule, K, tb.gluon_bmm.smem_limit(torch.device("cuda")))
        return [C(bm, bn, k, warps, 3, 0, wgmma=schedule)] if fits else []

    decoded = [*dec(64, 256, 8), *dec(64, 128, 4), *dec(64, 128, 8), *dec(64, 64, 4)]
    # narrower columns and longer K steps: less decoding per program, more programs per head
    narrow = [*dec(64, 32, 4, 128), *dec(64, 64, 4, 128), *dec(64, 128, 4, 128), *dec(64, 128, 8, 128),
              *dec(128, 64, 8), *dec(128, 64, 8, 128), *dec(64, 64, 4, 256), *dec(64, 128, 4, 256)]  # fmt: skip
    gluon = [pre(128, 256, 8, 3, True, "stationary"), pre(128, 256, 8, 3, True, "streaming"),
             *dec(128, 256, 8), *dec(128, 128, 8)]  # fmt: skip
    xreg = [*dec(64, 256, 4, 128, "xreg"), *dec(64, 128, 4, 128, "xreg"), *dec(128, 128, 8, 128, "xreg")]

    def ws(configs):  # the same with rounding warps (warp specialisation)
        return [dataclasses.replace(c, ws=True) for c in configs]

    def swap(bm, warps, k_cap):  # weights decoded into the MMA's registers, one tile a program
        k = bk(K, k_cap)
        return [] if tb.gluon_bmm.tile_error(bm, 16 * warps, k, warps, "swap") else [C(bm, 16 * warps, k, warps, 1, 0,
                                                                                         wgmma="swap")]  # fmt: skip

    def rw8(configs):  # the same with 8 rounding warps, where the program's warps stay within the limit
        return [dataclasses.replace(c, round_warps=8) for c in configs if c.num_warps + 8 <= tb.gluon_bmm.MAX_WARPS]

    swapped_256 = [*swap(64, 4, 256), *swap(64, 8, 256), *swap(64, 8, 128), *swap(64, 8, 64), *swap(64, 16, 128),
                   *swap(64, 16, 64)]  # fmt: skip
    swapped = [*swap(16, 4, 256), *swap(16, 8, 256), *swap(32, 4, 256), *swap(32, 8, 256), *swap(32, 4, 128),
               *swapped_256]  # fmt: skip
    swapped += rw8(swapped)
    swapped_256 += rw8(swapped_256)

    tiled_16 = [C(16, 32, bk(K, 64), 2, 3, 0), C(16, 64, bk(K, 64), 4, 3, 0), C(16, 32, bk(K, 512), 4, 1, 0),
                C(16, 64, bk(K, 128), 4, 3, 0), C(16, 32, bk(K, 256), 4, 1, 0), C(16, 16, bk(K, 512), 4, 1, 0),
                C(16, 32, bk(K, 512), 2, 1, 0), C(16, 64, bk(K, 512), 4, 1, 0)]  # fmt: skip
    if M <= 16:
        extra = tiled_16
    elif M <= 64:
        extra = [*decoded, *narrow, *ws(decoded + narrow), *swapped, C(64, 256, bk(K, 64), 8, 3, 0),
                 C(32, 64, bk(K, 128), 4, 3, 0), *tiled_16]  # fmt: skip
    elif M <= 256:
        extra = [*decoded, *narrow, *gluon, *ws(decoded + narrow + gluon), *swapped_256, *xreg,
                 C(64, 256, bk(K, 64), 8, 3, 0), pre(64, 128, 4, 4, True)]  # fmt: skip
    else:
        extra = [*gluon, *ws(gluon), *decoded[:2], *xreg]
    return list(dict.fromkeys([tb.default_config(B, M, N, K), *extra]))


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except Exception as err:  # noqa: BLE001
        smi = f"nvidia-smi failed: {err}"
    import triton

    return {
        "gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
        "nvidia_smi": smi, "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "command": " ".join(sys.argv),
    }  # fmt: skip


def _events_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second) and dense bf16 matmul rate."""
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = _events_ms(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ b
    mm_ms = _events_ms(lambda: a @ b, 10)
    return {"copy_bytes_per_s": 2 * 2**30 / (copy_ms * 1e-3), "bf16_flops_per_s": 2 * 8192**3 / (mm_ms * 1e-3)}


def make_set(op: str, H: int, T: int, gen: torch.Generator) -> dict:
    """One input set: q rows [T, H, row] bf16 (x = q[..., :K] as [H, T, K]), MXFP4 weights, [T, H, N] out."""
    N, K, row = OPS[op]
    q = (torch.randn(T, H, row, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    w = torch.randn(H, N, K, device="cuda", generator=gen) * 0.05
    if op == "kup256":  # K-padded weights: the last 64 columns are zero codes with scale 0x7F
        w[..., 192:] = 0
    codes, scales = quantize(w, mode="even", check_finite_input=False)
    if op == "kup256":
        scales[..., 6:] = 127
    out_tm = torch.empty(T, H, N, device="cuda", dtype=torch.bfloat16)
    return {"x": q[..., :K].transpose(0, 1), "q": q, "codes": codes, "scales": scales, "out": out_tm.transpose(0, 1)}


def sets_over_l2(l2: int, bytes_per_set: int, most: int = 128) -> int:
    """How many input sets of ``bytes_per_set`` make a working set exceed 3x L2 (``l2`` bytes): 1 to ``most``."""
    return max(1, min(most, math.ceil(3 * l2 / bytes_per_set)))


def make_sets(op: str, H: int, T: int, l2: int, gen: torch.Generator) -> list[dict]:
    """As many input sets (:func:`make_set`) as make the working set exceed 3x L2 (``l2`` bytes), at most 128."""
    return [make_set(op, H, T, gen) for _ in range(sets_over_l2(l2, set_bytes(op, H, T)))]


def set_bytes(op: str, H: int, T: int) -> int:
    N, K, _ = OPS[op]
    return H * (T * K * 2 + N * K // 2 + N * K // 32 + T * N * 2)


def reference(s: dict, act_quant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference output, per-element tolerance) for one input set."""
    x, codes, scales = s["x"], s["codes"], s["scales"]
    ref = reference_bmm(x, codes, scales, act_quant=act_quant)
    xa = activation_as_float(x, act_quant).abs()
    wa = dequantize(codes, scales).abs()
    return ref, tb.accumulation_tolerance(ref, torch.bmm(xa, wa.transpose(1, 2)), x.shape[-1])


def check(s: dict, act_quant: str, cfg: tb.BmmConfig | None, ref_tol) -> dict:
    """Poison, run, compare with the reference; returns error stats (ok = all written and within tolerance)."""
    x, codes, scales, out = s["x"], s["codes"], s["scales"], s["out"]
    ref, tol = ref_tol
    out.fill_(float("nan"))
    tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out, config=cfg)
    torch.cuda.synchronize()
    diff = (out.float() - ref.float()).abs()
    unwritten = int(torch.isnan(out).sum())
    return {
        "ok": unwritten == 0 and bool((diff <= tol).all()),
        "unwritten": unwritten,
        "max_diff_over_tol": float((diff / tol).max()),
        "bit_identical": float((out.view(torch.int16) == ref.view(torch.int16)).float().mean()),
    }


def time_ours(sets: list[dict], act_quant: str, cfg) -> float:
    def run():
        for s in sets:
            tb.bmm_a16wfp4(s["x"], s["codes"], s["scales"], act_quant=act_quant, out=s["out"], config=cfg)

    return _time(run, len(sets))


def torch_sets(sets: list[dict], op: str, H: int, T: int, l2: int) -> list[dict]:
    """torch's input sets for :func:`time_torch`, from ours: contiguous x and y (no copies inside torch) and the
    dequantized bf16 weights, as many as make the working set exceed 3x L2 (``l2`` bytes)."""
    N, K, _ = OPS[op]
    n_torch = sets_over_l2(l2, H * (T * K * 2 + N * K * 2 + T * N * 2))
    return [{"xc": s["x"].contiguous(), "wt": dequantize(s["codes"], s["scales"], dtype=torch.bfloat16).transpose(1, 2),
             "yc": torch.empty(H, T, N, device="cuda", dtype=torch.bfloat16)}
            for s in (sets[i % len(sets)] for i in range(n_torch))]  # fmt: skip


def time_torch(sets: list[dict]) -> float:
    def run():
        for s in sets:
            torch.bmm(s["xc"], s["wt"], out=s["yc"])

    return _time(run, len(sets))


def make_producer(kind: str, out: torch.Tensor) -> Callable[[], None]:
    """A launch of one kernel that writes all of ``out`` (contiguous, bf16): ``mul`` copies a saved copy of it
    through ``torch.mul``; ``gemm`` writes it as ``out.view(-1, width) = a @ b``, ``a`` ``[rows, 64]``."""
    if kind == "mul":
        src = out.clone()
        return lambda: torch.mul(src, 1, out=out)
    rows = out.view(-1, out.shape[-1])
    a = torch.randn(rows.shape[0], 64, device=out.device, dtype=out.dtype)
    b = torch.randn(64, rows.shape[1], device=out.device, dtype=out.dtype)
    return lambda: torch.matmul(a, b, out=rows)


def time_after_producer(sets: list[dict], kind: str, written: str, call: Callable[[dict], None]) -> float:
    """Device microseconds per ``call(s)`` right after a ``kind`` producer (:func:`make_producer`) writes
    ``s[written]``: a graph of producer + call per set, minus a graph of the producers alone."""
    produce = [make_producer(kind, s[written]) for s in sets]

    def pairs():
        for p, s in zip(produce, sets, strict=True):
            p()
            call(s)

    def producers():
        for p in produce:
            p()

    return _time(pairs, len(sets)) - _time(producers, len(sets))


def host_us(call, n: int = 50, rounds: int = 5) -> float:
    """Host (CPU) microseconds per eager call: the launch cost a caller pays outside CUDA graphs. The best of
    ``rounds`` runs of ``n`` back-to-back calls (no synchronisation between the calls of a run), since other
    work on the host only ever adds to it."""
    call()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, time.perf_counter() - start)
        torch.cuda.synchronize()
    return best * 1e6 / n


def _time(run, n_calls: int) -> float:
    """Median microseconds per call over 30 CUDA-graph replays of ``run`` (``n_calls`` calls)."""
    run()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        run()
    g.replay()
    torch.cuda.synchronize()
    return _events_ms(g.replay, 30) * 1e3 / n_calls


def bench_case(op, H, T, env, ceilings, args, gen) -> dict:
    N, K, _ = OPS[op]
    l2 = env["l2_bytes"]
    sets = make_sets(op, H, T, l2, gen)
    default = tb.default_config(H, T, N, K)
    row = {"op": op, "H": H, "T": T, "N": N, "K": K, "sets": len(sets), "default": default.__dict__}
    refs = {aq: reference(sets[0], aq) for aq in tb.ACT_QUANT_MODES} if args.check else {}
    if args.check:
        row["check"] = {aq: check(sets[0], aq, None, refs[aq]) for aq in tb.ACT_QUANT_MODES}
    row["us"] = {aq: time_ours(sets, aq, None) for aq in tb.ACT_QUANT_MODES}
    s0 = sets[0]
    row["host_us"] = host_us(lambda: tb.bmm_a16wfp4(s0["x"], s0["codes"], s0["scales"], out=s0["out"]))
    if args.sweep:
        sweep = []
        for cfg in candidates(H, T, N, K)[1:]:
            entry = {"config": cfg.__dict__}
            try:
                if args.check:
                    entry["check"] = check(sets[0], "mxfp4", cfg, refs["mxfp4"])
                entry["us"] = time_ours(sets, "mxfp4", cfg)
            except Exception as err:  # noqa: BLE001 - a config that fails to compile or launch is reported
                entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            sweep.append(entry)
        row["sweep"] = sweep
    if args.producer:  # last: the gemm producer overwrites x, which the checks above compared with refs
        row["after_producer_us"] = time_after_producer(
            sets, args.producer, "q", lambda s: tb.bmm_a16wfp4(s["x"], s["codes"], s["scales"], out=s["out"])
        )
    tsets = torch_sets(sets, op, H, T, l2)
    row["torch_us"] = time_torch(tsets)
    if args.producer:
        row["torch_after_producer_us"] = time_after_producer(
            tsets, args.producer, "xc", lambda t: torch.bmm(t["xc"], t["wt"], out=t["yc"])
        )
    t0 = tsets[0]
    row["torch_host_us"] = host_us(lambda: torch.bmm(t0["xc"], t0["wt"], out=t0["yc"]))
    flops = 2 * H * T * N * K
    row["roofline_us"] = 1e6 * max(set_bytes(op, H, T) / ceilings["copy_bytes_per_s"],
                                   flops / ceilings["bf16_flops_per_s"])  # fmt: skip
    del sets, tsets, refs
    torch.cuda.empty_cache()
    if args.out:
        with open(args.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def kernel_label(c: dict) -> str:
    """Which kernel a config (as a dict) selects, and its tiles: e.g. ``wgmma stationary 128x256x64 w8``."""
    tiles = f"{c['block_m']}x{c['block_n']}x{c['block_k']} w{c['num_warps']}"
    if c.get("wgmma"):
        rw = f" rw{c['round_warps']}" if c.get("round_warps", 4) != 4 else ""
        return f"wgmma {c['wgmma']}{' ws' if c.get('ws') else ''} {tiles}{rw}"
    if c.get("tma"):
        return f"predecode+TMA {tiles}s{c['num_stages']}"
    kind = "predecode tiled" if c.get("predecode") else f"stationary t{c['tiles_m']}" if c["tiles_m"] else "tiled"
    return f"{kind} {tiles}s{c['num_stages']}"


def _after_producer(r: dict) -> str:
    """Ours, torch (ratio) in us, each timed after a producer kernel."""
    ours, torch_us = r["after_producer_us"], r["torch_after_producer_us"]
    return f"{ours:.2f}, {torch_us:.2f} ({ours / torch_us:.2f})"


def table(rows: list[dict], producer: str | None = None) -> str:
    after = f"| after a {producer} producer: mxfp4, torch us (ratio) " if producer else ""
    head = ("| op | N | K | H | T | kernel (default config) | triton mxfp4 us | triton none us "
            f"| torch bf16 bmm us | mxfp4 / torch {after}| roofline us | host us/call ours, torch "
            "| check (max err/tol, bit-identical) |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        chk = r.get("check")
        chk_s = "-" if chk is None else "; ".join(
            f"{aq}: {'ok' if c['ok'] else 'FAIL'} {c['max_diff_over_tol']:.2f}, {100 * c['bit_identical']:.1f}%"
            for aq, c in chk.items()
        )  # fmt: skip
        lines.append(
            f"| {r['op']} | {r['N']} | {r['K']} | {r['H']} | {r['T']} | {kernel_label(r['default'])} "
            f"| {r['us']['mxfp4']:.2f} | {r['us']['none']:.2f} "
            f"| {r['torch_us']:.2f} | {r['us']['mxfp4'] / r['torch_us']:.2f} "
            f"{f'| {_after_producer(r)} ' if producer else ''}| {r['roofline_us']:.2f} "
            f"| {r['host_us']:.1f}, {r['torch_host_us']:.1f} | {chk_s} |"
        )
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        for e in r.get("sweep", []):
            cfg = kernel_label(e["config"])
            res = e.get("error") or f"{e['us']:.2f} us" + (
                "" if "check" not in e else f" {'ok' if e['check']['ok'] else 'FAIL'}"
            )
            lines.append(f"{r['op']} H{r['H']} T{r['T']} default {r['us']['mxfp4']:.2f} | {cfg}: {res}")
    return "\n".join(lines)


def _compile_case(case: tuple[str, int, int, bool]) -> None:
    """Worker of ``--jobs``: run every config a case will time once, filling Triton's on-disk kernel cache."""
    op, H, T, sweep = case
    N, K, _ = OPS[op]
    s = make_set(op, H, T, torch.Generator(device="cuda").manual_seed(0))
    for cfg in candidates(H, T, N, K) if sweep else [tb.default_config(H, T, N, K)]:
        for aq in tb.ACT_QUANT_MODES:
            try:
                tb.bmm_a16wfp4(s["x"], s["codes"], s["scales"], act_quant=aq, out=s["out"], config=cfg)
            except Exception:  # noqa: BLE001, S110 - the timed run reports configs that fail
                pass
    torch.cuda.synchronize()


def precompile(cases: list[tuple[str, int, int, bool]], jobs: int) -> None:
    """Compile the kernels of all cases in ``jobs`` spawned processes (compiling is CPU-bound and serial)."""
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile_case, cases, chunksize=1)


def benchmark_cases(ops: str, heads: str, tokens: str) -> list[tuple[str, int, int]]:
    """(op, heads, tokens) for every combination of the comma-separated lists of ``--ops``, ``--heads``,
    ``--tokens``."""
    return [(op, H, T) for op in ops.split(",") for H in map(int, heads.split(","))
            for T in map(int, tokens.split(","))]  # fmt: skip


def unavailable() -> str:
    """Why these benchmarks cannot run here ("" when they can): they need a GPU and the Triton kernels."""
    ok, why = tb.available()
    return "" if ok and torch.cuda.is_available() else f"needs a GPU and triton: {why}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="check every case against the reference first")
    p.add_argument("--sweep", action="store_true", help="also time the candidate configs per M bucket")
    p.add_argument("--ops", default="kup192,kup256,vup")
    p.add_argument("--heads", default="16,64")
    p.add_argument("--tokens", default="1,16,32,64,256,1024,8192")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--jobs", type=int, default=0, help="compile all kernels first in this many processes")
    p.add_argument("--producer", choices=("mul", "gemm"), help="also time each call after a kernel writing its x")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(why)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 bmm must be true fp32
    env = environment()
    ceilings = measure_ceilings()
    print(json.dumps({**env, **ceilings}, indent=1), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(20261118)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    todo = benchmark_cases(args.ops, args.heads, args.tokens)
    if args.jobs:
        precompile([(*c, args.sweep) for c in todo], args.jobs)
    rows = []
    for op, H, T in todo:
        rows.append(bench_case(op, H, T, env, ceilings, args, gen))
        r = rows[-1]
        after = f", after a producer {_after_producer(r)}" if args.producer else ""
        print(f"{op} H={H} T={T}: mxfp4 {r['us']['mxfp4']:.2f} us, none {r['us']['none']:.2f} us, "
              f"torch {r['torch_us']:.2f} us{after}, roofline {r['roofline_us']:.2f} us "
              f"{json.dumps(r.get('check', {}))}", flush=True)  # fmt: skip
    md = table(rows, args.producer)
    if args.sweep:
        print(sweep_table(rows))
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_triton_bmm.json").write_text(json.dumps({"env": env, "ceilings": ceilings, "rows": rows}))
        (args.out / "bench_triton_bmm.md").write_text(md + "\n\n" + sweep_table(rows) + "\n")
    failed = [r for r in rows if any(not c["ok"] for c in r.get("check", {}).values())]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
