"""Runtime loading of all 79 MLA layers of a small-profile GLM-5 overlay (issue 5), three ways:

* ``open``: ``glm_pack.runtime.open(OUT, tp_size=T).load_all()`` (manifest checks + this rank's head slices);
* ``read``: reading the same overlay files' bytes (the floor for any loader);
* ``derive``: what engines do at start: read each BF16 kv_b_proj, split, quantize w_kc/w_vc (even rule,
  K padded to 256) for the same heads.
Each in a fresh process with the page cache dropped first (root; best effort), JIT compiled beforehand for
``derive``; wall seconds of the step only.

    python benchmarks/bench_runtime_load.py [--workdir /tmp/glm-pack-bench] [--tp-size 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_caches, glm5_79_layers  # noqa: E402

STEP = r"""
import json, sys, time
from pathlib import Path
mode, src, out, tp = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
import torch
from glm_pack import runtime
from glm_pack.convert.checkpoint import open_checkpoint
from glm_pack.packing.absorb import absorb_layer
from glm_pack.packing.mla import MlaGeometry
if mode == "derive":  # compile the codec first: engines pay that once too, but not per layer
    absorb_layer(torch.zeros(64 * 448, 512), MlaGeometry(64, 512, 192, 64, 256), k_stored=256)
start = time.perf_counter()
if mode == "open":
    model = runtime.open(out, backend="torch", tp_size=tp)
    # touch one byte per 4 KiB page so that memory-mapped tensors are really read
    n = sum(int(t.reshape(-1)[::4096].sum()) for l in model.load_all() for p in (l.w_kc, l.w_vc)
            for t in (p.weight, p.scale) if t is not None)
elif mode == "read":
    n = sum(len(p.read_bytes()) for p in sorted((out / "glm-pack").glob("*.safetensors")))
else:
    ckpt = open_checkpoint(src)
    g = ckpt.geometry
    rows = g.kv_b_rows // tp
    local = MlaGeometry(g.num_heads // tp, g.kv_lora_rank, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim)
    n = 0
    for layer in ckpt.mla_layers():
        kv_b = ckpt.read_float(ckpt.card.kv_b_proj(layer))[:rows]
        kc, vc = absorb_layer(kv_b, local, k_stored=256)
        n += kc.weight.numel() + vc.weight.numel()
print(json.dumps({"seconds": time.perf_counter() - start, "n": n}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/glm-pack-bench"))
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args()
    src = glm5_79_layers(args.workdir)
    out = args.workdir / "out-load"
    if not (out / "glm-pack" / "manifest.json").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "glm_pack.convert.cli",
                "convert",
                str(src),
                str(out),
                "--files",
                "none",
                "--overwrite",
                "--quiet",
            ],
            check=True,
        )
    print(f"| step (79 layers, tp_size {args.tp_size}) | seconds |")
    print("|---|---|")
    for mode in ("open", "read", "derive"):
        drop_caches()
        res = subprocess.run(
            [sys.executable, "-c", STEP, mode, str(src), str(out), str(args.tp_size)],
            capture_output=True,
            text=True,
            check=True,
        )
        print(f"| {mode} | {json.loads(res.stdout.strip().splitlines()[-1])['seconds']:.2f} |")


if __name__ == "__main__":
    main()
