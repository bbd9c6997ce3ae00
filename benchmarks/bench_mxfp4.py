"""MXFP4 codec speed on one GLM-5 kv_b_proj: quantize [28672, 512] bf16 in every mode, and dequantize.

Warm: best and median of ``--repeat`` calls after one untimed call, for the torch reference path and the
numba fast path. Cold: the first call in a fresh process (numba import and JIT included), once with the
on-disk kernel cache as it is and once with an empty cache (a machine's very first run).

    python benchmarks/bench_mxfp4.py [--repeat 7] [--skip-cold]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch

from glm_pack.packing import _mxfp4_fast
from glm_pack.packing.mxfp4 import MODES, dequantize, quantize

SHAPE = (28672, 512)  # GLM-5 kv_b_proj: H*(nope+v) = 64*(192+256) rows, kv_lora = 512


def weight(dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(*SHAPE, generator=g) * 0.02).to(dtype)


@contextlib.contextmanager
def codec_path(path: str):
    """``fast``: as shipped; ``reference``: the fast path reports 'unavailable' so the torch reference runs."""
    if path == "fast":
        yield
        return
    with (
        mock.patch.object(_mxfp4_fast, "quantize_rows", lambda rows, mode: None),
        mock.patch.object(_mxfp4_fast, "dequantize_rows", lambda codes, scales: None),
    ):
        yield


def timed(fn, repeat: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def warm_rows(repeat: int) -> list[tuple[str, str, float, float]]:
    x = weight()
    rows = []
    for path in ("reference", "fast"):
        with codec_path(path):
            for mode in MODES:
                best, median = timed(lambda mode=mode: quantize(x, mode=mode), repeat)
                rows.append((path, f"quantize {mode}", best, median))
            packed = quantize(x)
            for dtype in (torch.float32, torch.bfloat16):
                best, median = timed(lambda dtype=dtype, packed=packed: dequantize(*packed, dtype=dtype), repeat)
                rows.append((path, f"dequantize -> {str(dtype).removeprefix('torch.')}", best, median))
    return rows


def cold_child(mode: str) -> None:
    """In a fresh process: time the first quantize call (lazy numba import, cache load or JIT)."""
    x = weight()
    start = time.perf_counter()
    quantize(x, mode=mode)
    print(time.perf_counter() - start)


def cold_seconds(mode: str, cache_dir: str | None) -> float:
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    out = subprocess.run(
        [sys.executable, __file__, "--cold-child", mode], env=env, check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--cold-child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold_child:
        cold_child(args.cold_child)
        return

    n = SHAPE[0] * SHAPE[1]
    print(f"MXFP4 codec, one GLM-5 kv_b_proj {list(SHAPE)} bf16 ({n / 1e6:.1f} M elements)")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), numba {_mxfp4_fast.numba.__version__ if _mxfp4_fast.numba else 'absent'}"
        f", load average {os.getloadavg()[0]:.1f}"
    )
    print(f"\n{'path':<10} {'operation':<22} {'best s':>8} {'median s':>9} {'M elem/s':>9}")
    rows = warm_rows(args.repeat)
    for path, op, best, median in rows:
        print(f"{path:<10} {op:<22} {best:8.4f} {median:9.4f} {n / best / 1e6:9.0f}")
    fast = {op: best for path, op, best, _ in rows if path == "fast"}
    ref = {op: best for path, op, best, _ in rows if path == "reference"}
    print(f"\nfast: mse / even = {fast['quantize mse'] / fast['quantize even']:.2f}x (best times)")
    print(f"speed-up over the reference, quantize even: {ref['quantize even'] / fast['quantize even']:.1f}x")

    if not args.skip_cold:
        print(f"\n{'cold: first call in a fresh process':<40} {'seconds':>8}")
        for mode in ("even", "mse"):
            print(f"{f'fast {mode}, kernel cache on disk':<40} {cold_seconds(mode, None):8.2f}")
        with tempfile.TemporaryDirectory() as empty:
            print(f"{'fast even, empty cache (JIT compile)':<40} {cold_seconds('even', empty):8.2f}")
            print(f"{'fast mse, cache from the previous line':<40} {cold_seconds('mse', empty):8.2f}")


if __name__ == "__main__":
    main()
