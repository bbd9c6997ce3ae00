"""What the engine adapters save: the engines' load-time absorbed-MLA rebuild from kv_b_proj vs loading the
glm-pack overlay, for every MLA layer of GLM-5 (78 decoder layers + the MTP layer = 79) at one TP rank.

Reproduced on CPU from the engines' algorithm (vLLM ``MLAAttention.process_weights_after_loading`` FP4
path = SGLang's ``quark_post_load_weights``): the rank's BF16 kv_b_proj slice ``[H_r*(192+256), 512]``
-> transpose / view / split -> even-rule MXFP4 quantization of W_K along nope and W_V along kv_lora
(aiter's ``dynamic_mxfp4_quant`` stands as glm-pack's codec, its numba fast path). The overlay side is
what the adapter does per process: open the manifest, check config.json (and with ``--check full`` hash
the 79 source kv_b_proj tensors), read this rank's head slice of each w_kc / w_vc, compare each layer
with the engine's loaded slice. Both sides start from the engine having loaded its kv_b_proj slices.

Each side runs in a fresh subprocess (the rebuild's codec kernels compiled before timing); peak memory = peak RSS
(VmHWM, reset before the step) minus RSS before it.
Files go under --workdir (default /tmp/glm-pack-bench-engines; ~2.6 GB, reused between runs).

    python benchmarks/bench_engine_rebuild.py --tp-size 8 --tp-rank 0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from glm_pack.packing.mla import MlaGeometry

GEOM = MlaGeometry(num_heads=64, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)
LAYERS = range(79)


def kv_b_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def prepare(work: Path) -> None:
    """Write a served checkpoint (79 synthetic BF16 kv_b_proj [28672, 512]) and its overlay (--k-pad none)."""
    if (work / "glm-pack" / "manifest.json").is_file():
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))
    from engine_standins import overlay_fixture as fx

    fx.GEOM, fx.LAYERS = GEOM, tuple(LAYERS)
    g = torch.Generator().manual_seed(0)
    weights = {kv_b_name(i): (torch.randn(GEOM.kv_b_rows, 512, generator=g) * 0.02).bfloat16() for i in LAYERS}
    fx.write_checkpoint(work, weights, GEOM)
    fx.write_overlay(work, weights, k_stored=GEOM.qk_nope_head_dim)


def engine_slices(work: Path, rank: int, size: int) -> dict[int, torch.Tensor]:
    from safetensors import safe_open

    rows = GEOM.kv_b_rows // size
    with safe_open(work / "model-00001-of-00001.safetensors", framework="pt") as f:
        return {i: f.get_slice(kv_b_name(i))[rank * rows : (rank + 1) * rows].clone() for i in LAYERS}


def rebuild(slices: dict[int, torch.Tensor], heads: int) -> dict:
    """vLLM's FP4-path process_weights_after_loading for every layer (kept, as the engine keeps them)."""
    from glm_pack.packing.mxfp4 import quantize

    P, V, L = GEOM.qk_nope_head_dim, GEOM.v_head_dim, GEOM.kv_lora_rank
    kept = {}
    for i, w in slices.items():
        kv_b = w.T.view(L, heads, P + V)
        w_uk, w_uv = kv_b.split([P, V], dim=-1)
        w_k, w_k_s = quantize(w_uk, mode="even", axis=-1)
        w_v, w_v_s = quantize(w_uv.permute(1, 2, 0), mode="even", axis=-1)
        kept[i] = (w_k.transpose(0, 1), w_k_s.transpose(0, 1), w_v, w_v_s)
    return kept


def load_overlay(work: Path, slices: dict[int, torch.Tensor], rank: int, size: int, level: str) -> dict:
    from glm_pack.runtime.engines import common

    overlay = common.open_overlay(str(work), work, tp_rank=rank, tp_size=size, device="cpu", level=level)
    kept = {}
    for i, w in slices.items():
        mla = overlay.layer(i, overlay.model.local_geometry)
        common.check_slice(mla, w, "kv_b_proj")
        kept[i] = (mla.w_kc.weight, mla.w_kc.scale, mla.w_vc.weight, mla.w_vc.scale)
    return kept


def rss_mib(field: str = "VmRSS:") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def child(args) -> None:
    work, rank, size = Path(args.workdir), args.tp_rank, args.tp_size
    torch.set_num_threads(args.threads)
    slices = engine_slices(work, rank, size)
    if args.mode == "rebuild":  # compile the codec's numba kernels first (an engine's Triton kernels are cached)
        rebuild({0: slices[0]}, GEOM.num_heads // size)
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS mark (VmHWM) to the current RSS
        f.write("5")
    before = rss_mib()
    start = time.perf_counter()
    if args.mode == "rebuild":
        kept = rebuild(slices, GEOM.num_heads // size)
    else:
        kept = load_overlay(work, slices, rank, size, args.mode.split("-", 1)[1])
    seconds = time.perf_counter() - start
    peak = rss_mib("VmHWM:")
    kept_mib = sum(t.numel() * t.element_size() for ts in kept.values() for t in ts) / 2**20
    print(json.dumps({"mode": args.mode, "seconds": seconds, "peak_extra_mib": peak - before, "kept_mib": kept_mib}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/glm-pack-bench-engines")
    ap.add_argument("--tp-size", type=int, default=8)
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    prepare(work)
    print(f"# data ready in {time.perf_counter() - t:.1f} s under {work}", flush=True)
    print(f"# GLM-5, {len(LAYERS)} MLA layers, TP {args.tp_size} rank {args.tp_rank}, {args.threads} threads")
    print(f"{'step':<28}{'seconds':>10}{'peak extra MiB':>16}{'kept MiB':>10}")
    for mode in ("rebuild", "overlay-full", "overlay-fast"):
        cmd = [sys.executable, __file__, "--mode", mode, "--workdir", str(work)]
        cmd += ["--tp-size", str(args.tp_size), "--tp-rank", str(args.tp_rank), "--threads", str(args.threads)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        label = {"rebuild": "engine rebuild (FP4 path)", "overlay-full": "overlay, check full"}.get(
            mode, "overlay, check fast"
        )
        print(f"{label:<28}{r['seconds']:>10.2f}{r['peak_extra_mib']:>16.0f}{r['kept_mib']:>10.1f}", flush=True)
    return None


if __name__ == "__main__":
    main()
