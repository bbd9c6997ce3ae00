"""Where a Gluon A16WFP4 GEMM program spends its time: a per-program timeline on one sm_90 GPU.

Writes an instrumented copy of ``runtime/kernels/gluon_bmm.py`` (``%clock64`` read by one thread of each
partition at every hand-off, stored in a device buffer whose address the copy reads as a constexpr) into a
temporary directory, runs a case's default config (the warp-specialised ``decode`` schedule or the ``swap``
schedule) over enough input sets that the weights come from HBM, checks the last output against the
reference, and prints for each event the median and 90th percentile over programs in ns after the program's
start (SM clock at its maximum, ``--clock-mhz``). Events: the first weight step decoded (``decode`` only: the
swap kernel's decode has no memory operation to order a stamp behind), x step i landed (rounding warps), x
step i rounded, the MMA warps seeing it, the MMA loop's end, y stored (by TMA: its store read; plain stores:
issued); only the first 4 K steps are stamped.

    python benchmarks/timeline_gluon_bmm.py kup192,16,64 vup,16,64 [--clock-mhz 1980]

The copy is made by text substitution and fails loudly when an anchor it needs is not in the kernel source.
The stamps cost a few instructions each and order the code around them; compare timelines, not absolute times,
with the benchmark's.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_triton_bmm as bb  # noqa: E402

from glm_pack.runtime.kernels import gluon_bmm, triton_bmm  # noqa: E402

SLOTS = 32  # int64 stamps per program
EVENTS = {1: "weights step 0 decoded", **{2 + i: f"x step {i} rounded, seen by MMA warps" for i in range(4)},
          6: "MMA loop end", 7: "y stored", **{8 + i: f"x step {i} landed" for i in range(4)},
          **{12 + i: f"x step {i} rounded" for i in range(4)}}  # fmt: skip
_STAMP = '''
    T_ADDR = gl.constexpr(0)

    @gluon.jit
    def _stamp(slot):
        """Thread 0 of the calling partition's warps stores %clock64 in this program's ``slot``."""
        NW: gl.constexpr = gl.num_warps()
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        idx = gl.arange(0, 32 * NW, layout=layout)
        t = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [idx], dtype=gl.int64, is_pure=False, pack=1)
        base = gl.full([32 * NW], T_ADDR, gl.int64, layout).to(gl.pointer_type(gl.int64))
        gl.store(base + gl.program_id(0) * 32 + slot + idx * 0, t, mask=idx == 0)
'''
_WAIT_ROUNDED = "            mbarrier.wait(rounded.index(i % STAGES), (i // STAGES) & 1)\n"
_DECODED = "                    fence_async_shared()\n                    acc = _step("
_LOOP_END = "  # fmt: skip\n        tma.store_wait(0)\n"
_WAIT_READY = "            mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)\n            _round_in_place("
_ARRIVE = "            mbarrier.arrive(rounded.index(i % STAGES), count=1)\n"
_STAGE_STAMP = "            if i < 4:\n                _stamp({})\n"
_E2M1 = "    _E2M1_BF16_PTX = gl.constexpr(_e2m1_bf16_ptx())\n"
_START = "        pid = gl.program_id(0)\n        tiles_m = gl.cdiv(M, BM)\n        per = "
_SWAP_START = "        b, m0, n0 = _tile(0, pid, M, N, gl.cdiv(M, BM), BM, BN)  # a split per M tile"
_SWAP_SEEN = "            mbarrier.wait(rounded.index(kk % STAGES), (kk // STAGES) & 1)\n"
_SWAP_STORE = ("        _store_y_part(acc.to(gl.bfloat16).permute((1, 0)), y_desc, y_buf, y_plain, b, m0, n0, "
               "PLAIN_Y)\n        tma.store_wait(0)\n")
# (text, its replacement): each text must occur once in the kernel source
_EDITS = [
    (_E2M1, _E2M1 + _STAMP),
    (_WAIT_ROUNDED, _WAIT_ROUNDED + _STAGE_STAMP.format("2 + i")),
    (_DECODED, _DECODED.replace("acc = _step(", "if kk == 0:\n                        _stamp(1)\n"
                                                "                    acc = _step(")),
    (_LOOP_END, _LOOP_END.replace("        tma", "        _stamp(6)\n        tma") + "        _stamp(7)\n"),
    (_WAIT_READY, _WAIT_READY.replace("            _round_in_place(",
                                      _STAGE_STAMP.format("8 + i") + "            _round_in_place(")),
    (_ARRIVE, _ARRIVE + _STAGE_STAMP.format("12 + i")),
    (_START, _START.replace("(0)\n", "(0)\n        _stamp(0)\n", 1)),
    (_SWAP_START, "        _stamp(0)\n" + _SWAP_START),
    (_SWAP_SEEN, _SWAP_SEEN + "            if kk < 4:\n                _stamp(2 + kk)\n"),
    (_SWAP_STORE, "        _stamp(6)\n" + _SWAP_STORE + "        _stamp(7)\n"),
]  # fmt: skip
ORDER = [1, 8, 12, 2, 9, 13, 3, 10, 14, 4, 11, 15, 5, 6, 7]  # events as a step's hand-offs follow each other


def instrumented_source() -> str:
    """gluon_bmm's source with the stamps (in both kernels)."""
    src = Path(gluon_bmm.__file__).read_text()
    for old, new in _EDITS:
        if src.count(old) != 1:
            raise SystemExit(f"timeline: the kernel source no longer has this text once: {old!r}")
        src = src.replace(old, new)
    return src


def load_instrumented(work: Path, stamps: torch.Tensor):
    path = work / "gluon_bmm_timeline.py"
    path.write_text(instrumented_source())
    spec = importlib.util.spec_from_file_location("gluon_bmm_timeline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    module.T_ADDR = module.gl.constexpr(stamps.data_ptr())  # read when the kernel compiles
    return module


def timeline(module, stamps: torch.Tensor, op: str, H: int, T: int, clock_ghz: float) -> None:
    N, K, _ = bb.OPS[op]
    cfg = triton_bmm.default_config(H, T, N, K)
    if not (cfg.wgmma == "swap" or (cfg.wgmma == "decode" and cfg.ws)):
        print(f"{op} H{H} T{T}: default {cfg} is neither a ws decode nor a swap program; skipped")
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = [bb.make_set(op, H, T, gen) for _ in range(bb.sets_over_l2(l2, bb.set_bytes(op, H, T), most=64))]
    smem = gluon_bmm.smem_limit(torch.device("cuda"))
    plan = gluon_bmm.plan(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.wgmma, K, smem, ws=True,
                          round_warps=cfg.round_warps)  # fmt: skip
    launch = module.prepare(sets[0]["x"], sets[0]["out"], True, plan, w=sets[0]["codes"], w_scales=sets[0]["scales"])
    for s in sets * 3:
        stamps.zero_()
        launch(s["x"], s["codes"], s["scales"], s["out"])
    torch.cuda.synchronize()
    ref, tol = bb.reference(sets[-1], "mxfp4")
    ok = bool(((sets[-1]["out"].float() - ref.float()).abs() <= tol).all())
    t = stamps.view(-1, SLOTS)
    t = t[t[:, 0] != 0].double().cpu()
    print(f"{op} H{H} T{T}, {bb.kernel_label(cfg.__dict__)}, {len(t)} programs, "
          f"output {'within tolerance' if ok else 'WRONG'}; ns after the program's start: median, p90")  # fmt: skip
    for slot in ORDER:
        seen = t[:, slot] != 0
        if seen.any():
            d = (t[seen, slot] - t[seen, 0]) / clock_ghz
            print(f"  {EVENTS[slot]:36s} {float(d.median()):7.0f} {float(d.quantile(0.9)):7.0f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+", help="op,heads,tokens, e.g. vup,16,64")
    p.add_argument("--clock-mhz", type=float, default=1980.0, help="SM clock the cycle counts are converted at")
    args = p.parse_args()
    if gluon_bmm.IMPORT_ERROR or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("timeline: needs Gluon and an sm_90 NVIDIA GPU", file=sys.stderr)
        return 2
    stamps = torch.zeros(65536 * SLOTS, dtype=torch.int64, device="cuda")
    with tempfile.TemporaryDirectory() as work:
        module = load_instrumented(Path(work), stamps)
        for case in args.cases:
            op, H, T = case.split(",")
            timeline(module, stamps, op, int(H), int(T), args.clock_mhz / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
