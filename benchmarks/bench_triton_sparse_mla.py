"""Check and time the Triton sparse MLA kernel on a GPU against the torch reference and the copy roofline.

    python benchmarks/bench_triton_sparse_mla.py --check [--sweep] [--aiter DIR] [--out DIR]

Cases: top-k 2048 rows per token from a cache of 2**17 slots, H in --heads (16, 64), T in {1, 16, 64, 256}, rope-free
(512-wide rows) and rope (576). Bytes per call = selected rows read once (T * 2048 * row bytes); the roofline
is a measured device-to-device copy (bytes read + written over time). Kernel times are medians of CUDA-graph
replays; when one call's rows fit in L2, the graph runs the kernel over several input sets drawn from the
whole cache and the time is divided by their number. Every timed configuration is compared with
``glm_pack.runtime.reference.sparse_mla`` (fp32) on fresh inputs holding -1 entries, repeated ids and, for
T >= 4, a token with no valid row (always; ``--check`` makes a failure the exit status). ``--sweep`` also
times alternative launch configurations. Every configuration is checked and timed with ``return_lse=True``.
``--aiter DIR`` imports aiter's pure-Triton ``unified_attention_sparse_mla`` (files ``aiter_usmla.py`` +
``aiter_usmla_kernel.py`` copied from ROCm/aiter into DIR, never committed here) and times it on the rope
cases (it has no rope-free path).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import torch
import triton
import triton.testing

from glm_pack.runtime import reference
from glm_pack.runtime.kernels import triton_sparse_mla as tsm

SLOTS, TOPK, L, R = 2**17, 2048, 512, 64
SCALE = 1.0 / math.sqrt(L + R)
TS = (1, 16, 64, 256)
DEV = "cuda"


def env_info() -> dict:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
    )
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "driver": smi.stdout.strip(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    src = torch.randint(0, 255, (2**31,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * 2**31 / (ms * 1e-3)


def make_inputs(T, H, rope, cache, gen, *, holes=False):
    """q views of one [T, H, L+R] buffer, uniform top-k indices; ``holes``: -1 entries, repeats, empty token."""
    q = torch.randn(T, H, L + R, device=DEV, generator=gen).bfloat16()
    idx = torch.randint(0, SLOTS, (T, TOPK), device=DEV, generator=gen, dtype=torch.int32)
    if holes:
        idx[torch.rand(T, TOPK, device=DEV, generator=gen) < 0.05] = -1
        idx[:, 1:64:2] = idx[:, 0:63:2]  # repeated ids
        if T >= 4:
            idx[T // 2] = -1
    indptr = torch.arange(0, (T + 1) * TOPK, TOPK, dtype=torch.int32, device=DEV)
    return q[..., :L], (q[..., L:] if rope else None), cache, indptr, idx.view(-1)


def graph_time_us(fn, n_sets) -> float:
    """Median microseconds per call of ``fn(i)`` for i in range(n_sets), replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_sets):
            fn(i)  # warm-up / compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_sets):
            fn(i)
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median")
    return ms * 1e3 / n_sets


def events_time_us(fn, reps=3) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / reps


def torch_batched(q_lat, q_rope, cache, idx2d):
    """The obvious torch version (gather, fp32 scores, softmax, P @ V) for uniform top-k, -1 masked."""
    valid = idx2d >= 0
    sel = cache[idx2d.clamp_min(0).long()]  # [T, K, L+R]
    s = torch.einsum("thl,tkl->thk", q_lat.float(), sel[..., :L].float())
    if q_rope is not None:
        s = s + torch.einsum("thr,tkr->thk", q_rope.float(), sel[..., L:].float())
    p = torch.softmax((s * SCALE).masked_fill(~valid[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("thk,tkl->thl", p, sel[..., :L].float()).bfloat16()


def sweep_configs(T, H):
    """Alternative launch shapes (block_h, block_n, warps, stages) with the split counts that fill 1/4 to 3
    waves of one program per multiprocessor."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(16, 64, 4, 2), (16, 32, 4, 5), (16, 64, 4, 5), (16, 32, 8, 5), (16, 64, 8, 5), (16, 64, 8, 3)]
    if H > 16:
        shapes = [(64, 64, 8, 3), (64, 32, 8, 5), (16, 64, 4, 2), (16, 32, 8, 5), (32, 32, 8, 5)]
    out = []
    for bh, bn, w, st in shapes:
        programs = T * -(-H // bh)
        max_splits = -(-TOPK // bn)
        splits = [s for s in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128) if s <= max_splits]
        splits = [s for s in splits if sms / 4 <= programs * s <= 3 * sms] or [1]
        out += [tsm.SparseMlaConfig(bh, bn, s, num_warps=w, num_stages=st) for s in splits]
    return out


def load_aiter(path):
    sys.path.insert(0, os.path.abspath(path))
    import aiter_usmla  # noqa: PLC0415 (optional, carried copy)

    return aiter_usmla.unified_attention_sparse_mla


def aiter_call(fn, q_lat, q_rope, cache, idx, out):
    """aiter's API: q [T, H, 576], kv [blocks, 64, 1, 576] (global slot = block * 64 + offset), topk [T, K]."""
    T = q_lat.shape[0]
    q = torch.cat([q_lat, q_rope], dim=-1)
    cu = torch.arange(T + 1, dtype=torch.int32, device=DEV)
    seqused = torch.full((T,), SLOTS, dtype=torch.int32, device=DEV)
    table = torch.zeros(T, 1, dtype=torch.int32, device=DEV)
    kv = cache.view(-1, 64, 1, L + R)
    return lambda: fn(q, kv, out, cu, 1, seqused, SLOTS, SCALE, idx.view(T, TOPK), table, L)


def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_case(T, H, rope, cache, gen, args, bw, l2, aiter_fn, rows):
    row_bytes = (L + (R if rope else 0)) * 2
    nbytes = T * TOPK * row_bytes
    n_sets = max(1, min(64, math.ceil(4 * l2 / nbytes)))
    sets = [make_inputs(T, H, rope, cache, gen) for _ in range(n_sets)]
    outs = [torch.empty(T, H, L, dtype=torch.bfloat16, device=DEV) for _ in range(n_sets)]
    chk = make_inputs(T, H, rope, cache, gen, holes=True)
    ref, ref_lse = reference.sparse_mla(*chk, SCALE, return_lse=True)
    default = tsm.default_config(T, H, T * TOPK, torch.device(DEV))
    configs = [default] + ([c for c in sweep_configs(T, H) if c != default] if args.sweep else [])
    results = []
    for cfg in configs:
        try:
            poison = torch.full_like(ref, float("nan"))
            out, lse = tsm.sparse_mla(*chk, SCALE, return_lse=True, out=poison, config=cfg)
            fin = torch.isfinite(ref_lse)
            err = rel_err(out, ref) if torch.isfinite(out).all() else float("inf")
            lse_ok = torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and not lse.isnan().any()  # errors: no NaN
            lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if lse_ok else float("inf")
            us = graph_time_us(
                lambda i, c=cfg: tsm.sparse_mla(*sets[i], SCALE, return_lse=True, out=outs[i], config=c), n_sets
            )
        except Exception as exc:  # a shape that does not fit (shared memory) is reported, not fatal
            print(f"  T={T} H={H} rope={rope} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        results.append({"config": cfg.__dict__, "us": us, "rel_err": err, "lse_err": lse_err})
        print(f"  T={T} H={H} rope={rope} {cfg}: {us:.1f} us err={err:.2e} lse={lse_err:.1e}", flush=True)
    best = min(results, key=lambda r: r["us"])
    row = {
        "T": T, "H": H, "row": L + (R if rope else 0), "mbytes": nbytes / 1e6, "n_sets": n_sets,
        "default_us": results[0]["us"], "default_cfg": results[0]["config"],
        "best_us": best["us"], "best_cfg": best["config"],
        "max_rel_err": max(r["rel_err"] for r in results), "max_lse_err": max(r["lse_err"] for r in results),
        "pct_copy_bw": 100 * nbytes / (results[0]["us"] * 1e-6) / bw,
    }  # fmt: skip
    idx2d = sets[0][4].view(T, TOPK)
    row["torch_batched_rel_err"] = rel_err(torch_batched(chk[0], chk[1], cache, chk[4].view(T, TOPK)), ref)
    row["torch_batched_us"] = graph_time_us(lambda i: torch_batched(sets[0][0], sets[0][1], cache, idx2d), 1)
    row["torch_reference_us"] = events_time_us(lambda: reference.sparse_mla(*sets[0], SCALE), reps=2)
    if aiter_fn is not None and rope and H % 16 == 0:  # aiter's kernel takes heads in blocks of 16
        try:
            a_out = torch.empty(T, H, L, dtype=torch.bfloat16, device=DEV)
            a_chk = torch.full_like(ref, float("nan"))
            aiter_call(aiter_fn, chk[0], chk[1], cache, chk[4], a_chk)()
            has_rows = torch.isfinite(ref_lse[:, 0])  # aiter leaves 0/0 for a token with no valid row
            a_chk, a_ref = a_chk[has_rows], ref[has_rows]
            row["aiter_rel_err"] = rel_err(a_chk, a_ref) if torch.isfinite(a_chk).all() else float("nan")
            calls = [aiter_call(aiter_fn, s[0], s[1], cache, s[4], a_out) for s in sets]
            row["aiter_us"] = graph_time_us(lambda i: calls[i](), n_sets)
        except Exception as exc:
            row["aiter_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rows.append(row)
    print(json.dumps(row), flush=True)


def table(rows, bw) -> str:
    head = (
        "| row | H | T | MB read | Triton us | % copy BW | best sweep us (cfg) | torch batched us | torch ref us "
        "| aiter us | x vs aiter | max rel err |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        b = r["best_cfg"]
        best = f"{b['block_h']}/{b['block_n']}/s{b['num_splits']}/w{b['num_warps']}/st{b['num_stages']}"
        aiter = f"{r['aiter_us']:.1f}" if "aiter_us" in r else ("n/a" if r["row"] == L else "-")
        ratio = f"{r['aiter_us'] / r['default_us']:.1f}x" if "aiter_us" in r else "-"
        lines.append(
            f"| {r['row']} | {r['H']} | {r['T']} | {r['mbytes']:.1f} | {r['default_us']:.1f} | {r['pct_copy_bw']:.0f}% "
            f"| {r['best_us']:.1f} ({best}) | {r['torch_batched_us']:.0f} | {r['torch_reference_us']:.0f} "
            f"| {aiter} | {ratio} | {r['max_rel_err']:.1e} |"
        )
    return "\n".join(lines) + f"\n\ncopy bandwidth (read + write): {bw / 1e12:.2f} TB/s\n"


def write_results(folder, info, bw, rows):
    """(all checks passed, markdown table); written to results.json / results.md after every case."""
    ok = all(r["max_rel_err"] < 2e-2 and r["max_lse_err"] < 1e-3 for r in rows)
    md = table(rows, bw) + f"\ncheck: {'PASS' if ok else 'FAIL'} (max rel err < 2e-2, LSE abs err < 1e-3)\n"
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump({"env": info, "copy_bw": bw, "rows": rows}, f, indent=1)
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(json.dumps(info) + "\n\n" + md)
    return ok, md


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare each timed configuration with the reference")
    ap.add_argument("--sweep", action="store_true", help="also time alternative launch configurations")
    ap.add_argument("--aiter", default=None, help="folder with aiter's unified_attention_sparse_mla copy")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for results.json / results.md")
    ap.add_argument("--heads", default="16,64", help="head counts per rank, comma-separated")
    ap.add_argument("--cases", default=None, help="subset, e.g. '576:64:256,512:16:1' (row:H:T)")
    args = ap.parse_args()
    info = env_info()
    print(json.dumps(info), flush=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    aiter_fn = None
    if args.aiter:
        try:
            aiter_fn = load_aiter(args.aiter)
        except Exception as exc:
            info["aiter_error"] = f"{type(exc).__name__}: {exc}"
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for rope in (False, True):
        cache = (torch.randn(SLOTS, L + (R if rope else 0), device=DEV, generator=gen) * 0.5).bfloat16()
        for H in [int(h) for h in args.heads.split(",")]:
            for T in TS:
                if args.cases and f"{L + (R if rope else 0)}:{H}:{T}" not in args.cases.split(","):
                    continue
                run_case(T, H, rope, cache, gen, args, bw, info["l2_bytes"], aiter_fn, rows)
                ok, md = write_results(args.out, info, bw, rows)
        del cache
    print(md)
    if args.check and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
