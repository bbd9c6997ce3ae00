"""The Hopper Gluon GEMM (runtime/kernels/gluon_bmm.py): launch planning and dispatch here, an sm_90 compile
of the real kernel on this CPU (Triton's bundled ptxas), and results against the reference on an sm_90 GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glm_pack.packing.errors import BackendError  # noqa: E402
from glm_pack.runtime.kernels import gluon_bmm as gb  # noqa: E402
from glm_pack.runtime.kernels import triton_bmm as tb  # noqa: E402
from tests.runtime.test_triton_bmm import activations, assert_close_to_reference, poisoned_out, weights  # noqa: E402

pytestmark = pytest.mark.skipif(bool(gb.IMPORT_ERROR), reason=f"gluon unavailable: {gb.IMPORT_ERROR}")

H200_SMEM = 232448  # opt-in shared memory per block on H100 / H200 (bytes)
SM90 = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9
sm90_only = pytest.mark.skipif(not SM90, reason="needs an sm_90 NVIDIA GPU")


def test_plans_take_the_most_stages_that_fit():
    # GLM K-up (K 192 / 256): a 256 x K bf16 weight column (96 / 128 KiB) plus 4 x 16 KiB of x plus the
    # 32 KiB y half-tile: 4 stages fit in 227 KiB (at K = 256 a fifth would not; at 192 the cap stops it)
    for K in (192, 256):
        p = gb.plan(128, 256, 64, 8, True, K, H200_SMEM)
        assert (p.stages, p.stationary) == (4, True) and gb.MAX_STAGES == 4
    assert gb.smem_bytes(128, 256, 64, 256, True, 4) <= H200_SMEM < gb.smem_bytes(128, 256, 64, 256, True, 5)
    # V-up's 256 x 512 column is 256 KiB by itself: only the streaming schedule runs, with 4 x (16 + 32) KiB
    assert gb.plan(128, 256, 64, 8, True, 512, H200_SMEM) is None
    assert gb.plan(128, 256, 64, 8, False, 512, H200_SMEM).stages == 4
    # hand count for one case: 3 x 16 KiB x + 3 x 32 KiB w + 32 KiB y + 1 KiB slack
    assert gb.smem_bytes(128, 256, 64, 512, False, 3) == 3 * 16384 + 3 * 32768 + 32768 + 1024
    # fewer stages where less memory is available, none below two
    assert gb.plan(128, 256, 64, 8, False, 512, 150_000).stages == 2
    assert gb.plan(128, 256, 64, 8, False, 512, 100_000) is None


@pytest.mark.parametrize(
    "tiles, bad",
    [((128, 256, 64, 8), ""), ((64, 256, 64, 4), ""), ((128, 256, 64, 4), "16 \\* num_warps"),
     ((256, 256, 64, 16), "4 or 8 warps"), ((128, 16, 64, 8), "multiple of 32"), ((128, 512, 64, 8), "up to 256"),
     ((128, 256, 512, 8), "32 to 256")],
)  # fmt: skip
def test_tile_rules(tiles, bad):
    err = gb.tile_error(*tiles)
    assert (err == "") == (bad == "")
    if bad:
        codes, scales = weights(1, 64, 512, seed=0)
        cfg = tb.BmmConfig(*tiles, 3, 0, predecode=True, wgmma="streaming")
        with pytest.raises(BackendError, match=bad):
            tb.bmm_a16wfp4(activations(4, 1, 512, seed=1), codes, scales, config=cfg)


@pytest.mark.parametrize(
    "change, match",
    [(dict(wgmma="both"), "stationary' or 'streaming"), (dict(predecode=False), "with predecode")],
)
def test_rejects_wgmma_configs_outside_the_contract(change, match):
    cfg = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tiles_m=0, predecode=True)
    cfg.update({"wgmma": "streaming", **change})
    codes, scales = weights(1, 64, 64, seed=0)
    with pytest.raises(BackendError, match=match):
        tb.bmm_a16wfp4(activations(4, 1, 64, seed=1), codes, scales, config=tb.BmmConfig(**cfg))


@pytest.mark.skipif(SM90, reason="checks the fallback where the kernel cannot run")
def test_falls_back_to_the_triton_kernels_where_it_cannot_run(monkeypatch):
    """Here (interpreter or another GPU) a wgmma config runs the TMA / tiled kernels with the same tiles."""
    B, M, N, K = 2, 37, 80, 192
    codes, scales = weights(B, N, K, seed=5)
    x = activations(M, B, K, seed=6, row=256)
    buf, out = poisoned_out(M, B, N)
    assert gb.unusable_reason(x, out)
    monkeypatch.setattr(gb, "launch", lambda *a: pytest.fail("gluon kernel launched"))
    cfg = tb.BmmConfig(64, 64, 64, 4, 1, 0, predecode=True, tma=True, wgmma="stationary")
    tb.bmm_a16wfp4(x, codes, scales, out=out, config=cfg)
    assert torch.isnan(buf[..., N:]).all()
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


def test_large_m_defaults_pick_the_schedule_by_weight_size():
    assert tb._large_m(192).wgmma == tb._large_m(256).wgmma == "stationary"
    assert tb._large_m(512).wgmma == "streaming"


_COMPILE = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from glm_pack.runtime.kernels import gluon_bmm as gb

    K, stationary, act = json.loads(sys.argv[1])
    p = gb.plan(128, 256, 64, 8, stationary, K, 232448)
    def desc(block):
        return f"tensordesc<bf16{block},{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"
    sig = {"x_desc": desc([1, 128, 64]), "w_desc": desc([1, 256, 64]), "y_desc": desc([1, 128, 128]),
           "M": "i32", "N": "i32", "B": "i32", "PROGRAMS": "i32", "SPLITS": "i32", "K": "constexpr",
           "ACT_MXFP4": "constexpr", "STATIONARY": "constexpr", "STAGES": "constexpr", "num_warps": "constexpr"}
    consts = dict(K=K, ACT_MXFP4=act, STATIONARY=stationary, STAGES=p.stages, num_warps=8)
    src = GluonASTSource(fn=gb._bmm_kernel, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = k.asm["ptx"]
    print(json.dumps({"shared": k.metadata.shared, "warps": k.metadata.num_warps, "stages": p.stages,
                      "estimate": gb.smem_bytes(128, 256, 64, K, stationary, p.stages),
                      "wgmma": ptx.count("wgmma.mma_async"), "cubin": len(k.asm["cubin"])}))
    """
)


@pytest.mark.parametrize(
    "K, stationary, act",
    [(192, True, True), (256, True, True), (512, False, True), (512, False, False)],
    ids=["kup192-stationary", "kup256-stationary", "vup-streaming", "vup-streaming-none"],
)
def test_kernel_compiles_for_sm90_within_shared_memory(K, stationary, act):
    """The real kernel, compiled for sm_90a by Triton's bundled ptxas on this machine (no GPU needed): it
    builds, uses 8 warps, the wgmma instructions are there, and its shared memory is within the H200's limit
    and the planner's estimate."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([K, stationary, act])],
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["warps"] == 8 and got["wgmma"] >= 1 and got["cubin"] > 0
    assert got["shared"] <= got["estimate"] <= H200_SMEM
    assert got["stages"] == 4


@sm90_only
@pytest.mark.parametrize("schedule", ["stationary", "streaming"])
@pytest.mark.parametrize(
    "B, M, N, K, row",
    [(16, 300, 512, 192, 256), (16, 300, 512, 256, 256), (16, 300, 256, 512, 512), (3, 1000, 80, 192, 256),
     (1, 5000, 256, 256, 256), (7, 129, 512, 128, 128)],
)  # fmt: skip
def test_matches_reference_on_gpu(B, M, N, K, row, schedule, monkeypatch):
    """Both schedules on GLM shapes and ragged ones (M and N not multiples of the tiles, programs without
    tiles when a column's M tiles do not split evenly), through the runtime's strided views."""
    launched = []
    real = gb.launch
    monkeypatch.setattr(gb, "launch", lambda *a: launched.append(a[-1]) or real(*a))
    codes, scales = weights(B, N, K, seed=M + N)
    x = activations(M, B, K, seed=K, row=row)
    cfg = tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma=schedule)
    for act_quant in ("mxfp4", "none"):
        buf, out = poisoned_out(M, B, N)
        tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out, config=cfg)
        assert torch.isnan(buf[..., N:]).all()
        assert_close_to_reference(out, x, codes, scales, act_quant)
    if gb.plan(128, 256, 64, 8, schedule == "stationary", K, gb.smem_limit(x.device)) is None:
        assert not launched  # no room for the weight column: the TMA kernel served
    else:
        assert launched and launched[0].stationary == (schedule == "stationary")
