"""The Triton backend's kernels compiled on this machine for GPUs it does not have, as the backend launches them
there: AMD's gfx950 (MI350 / MI355), gfx942 (MI300) and gfx90a (MI200), NVIDIA's sm_80 (A100), sm_100 (B200) and
sm_120 (RTX 5090). ``benchmarks/check_compile.py`` records the launches from the backend's own dispatch (torch
answering as a ROCm build or with the NVIDIA GPU's compute capability) and compiles each with Triton for that GPU. No
such GPU runs anything here; on an NVIDIA GPU, the kernels compiled with gfx942's code paths and dispatch, and the
launches dispatched as on an NVIDIA GPU without wgmma, are checked against the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.kernel_modules import kernel_module

ROOT = Path(__file__).resolve().parents[2]
_ok, _why = kernel_module("triton_bmm").available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"triton unavailable: {_why}")

# One call of each kind the backend makes (check_compile records what it launches for them): 16-row tiles with 64-deep
# K steps (the tiles Triton 3.6 cannot give tl.dot_scaled for gfx942), a large tile, the H200's 256-deep 32 x 128 tile
# (it spilled 308 bytes a lane on gfx942), V-up on predecoded weights (a decode kernel, then the GEMM on bf16
# weights), an untuned shape (the weights-stationary kernel), attention split over the top-k axis (and combined) with
# rope and LSE, and 64-head attention blocks.
CASES = [
    ("gemm", 64, 1, 512, 192, "mxfp4"),
    ("gemm", 16, 1, 512, 192, "none"),
    ("gemm", 64, 256, 512, 256, "mxfp4"),
    ("gemm", 16, 64, 512, 256, "none"),
    ("gemm", 16, 1024, 256, 512, "mxfp4"),
    ("gemm", 1, 16, 64, 64, "mxfp4"),
    ("attention", 64, 16, 64, True),
    ("attention", 8192, 64, 0, False),
]

_RECORD_AND_COMPILE = """
cases, archs = json.loads(sys.argv[1]), sys.argv[2].split(",")
for arch in archs:
    gpu = cc.GPUS[arch]
    with cc.dispatch_for(gpu) as recording:
        for kind, *args in cases:
            recording.case = json.dumps([kind, *args])
            if kind == "gemm":
                cc.gemm_launches(*args)
            else:
                cc.attention_launches(*args)
    for launch in recording.launches:
        facts = cc._compile_on((arch, launch))
        print(json.dumps({"arch": arch, "kernel": launch.kernel, "case": json.loads(launch.case),
                          "constexprs": dict(launch.constexprs), "options": dict(launch.options),
                          "findings": cc.findings(launch, facts, gpu) if facts["ok"] else [], "facts": facts}))
"""


_ROUNDING_ON_BOTH_TARGETS = """
with cc.dispatch_for(cc.GPUS["gfx950"]) as recording:
    cc.gemm_launches(4, 1, 512, 192, "mxfp4")
launch = recording.launches[0]  # the default config's (the fallback's follows)
nvidia = cc.compile_for(launch, cc.GPUTarget("cuda", 90, 32))
amd = cc.compile_for(launch, cc.GPUS["gfx950"].target)
print(json.dumps({"nvidia_min": nvidia["ptx"].count("min.NaN.bf16x2"), "amd_ok": amd["ok"]}))
"""


def _compiler_env(**extra: str) -> dict:
    """The environment of a process that compiles the kernels: no ``TRITON_INTERPRET`` (the kernels must be defined
    for the compiler), the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env | extra


def _compile_in_a_process(script: str, *args: str) -> list[dict]:
    """Run ``script`` (with ``json``, ``sys`` and ``benchmarks/check_compile.py`` as ``cc`` imported, ``args`` in
    ``sys.argv``) in a process of :func:`_compiler_env`; the JSON objects it prints, a line each."""
    preamble = "import json, sys\nsys.path.insert(0, 'benchmarks')\nimport check_compile as cc\n"
    proc = subprocess.run([sys.executable, "-c", preamble + script, *args], cwd=ROOT, env=_compiler_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


AMD = ("gfx950", "gfx942", "gfx90a")  # MI355X, MI300X, MI250X
NVIDIA = ("sm_80", "sm_100", "sm_120")  # A100, B200, RTX 5090 (99 KiB of shared memory, as sm_86 / sm_89)


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    """Each launch the backend makes for :data:`CASES` on the GPUs of :data:`AMD` and :data:`NVIDIA`, with its
    compile facts and findings."""
    return _compile_in_a_process(_RECORD_AND_COMPILE, json.dumps(CASES), ",".join(AMD + NVIDIA))


def _on(launches: list[dict], arch: str) -> list[dict]:
    return [launch for launch in launches if launch["arch"] == arch]


PORTABLE = {"_bmm_tiled_kernel", "_bmm_stationary_kernel", "_decode_kernel", "_fwd", "_combine"}


@pytest.mark.parametrize("arch", AMD + NVIDIA)
def test_the_backend_launches_only_its_portable_kernels(launches, arch):
    """No Gluon (sm_90 only) or tensor-descriptor launch (the TMA kernel spills on sm_120): every kind of portable
    kernel appears; V-up on predecoded weights is the decode kernel, then the tiled kernel on bf16 weights, for the
    default config (3 stages) and its one-stage fallback."""
    kernels = [launch["kernel"] for launch in _on(launches, arch)]
    assert set(kernels) == PORTABLE, kernels
    case = ["gemm", 16, 1024, 256, 512, "mxfp4"]
    predecoded = [launch for launch in _on(launches, arch) if launch["case"] == case]
    assert [launch["kernel"] for launch in predecoded] == ["_decode_kernel", "_bmm_tiled_kernel"] * 2
    assert [launch["options"]["num_stages"] for launch in predecoded[1::2]] == [3, 1]
    assert all(launch["constexprs"]["W_BF16"] for launch in predecoded[1::2])


@pytest.mark.parametrize("arch", AMD + NVIDIA)
def test_every_launch_compiles_and_links_for_the_gpu(launches, arch):
    """Each launch lowers, assembles and links (a code object), and every GEMM and attention kernel runs its dots on
    the matrix cores (MFMA on AMD; ``mma.sync`` on sm_80 / sm_120, ``tcgen05.mma`` on sm_100)."""
    failed = [(launch["kernel"], launch["case"], launch["facts"]["error"]) for launch in _on(launches, arch)
              if not launch["facts"]["ok"]]  # fmt: skip
    assert not failed
    for launch in _on(launches, arch):
        assert launch["facts"]["binary"] > 0
        assert (launch["facts"]["mma"] > 0) == (launch["kernel"] not in ("_decode_kernel", "_combine")), launch


def test_fp4_weights_reach_the_dot_as_each_gpu_converts_them(launches):
    """gfx950 hands the weight codes to ``tl.dot_scaled``, which converts them with its FP4 instruction
    (``v_cvt_scalef32_pk_bf16_fp4``); gfx942 and gfx90a have none and decode them in the kernel, also for the 16-row,
    64-deep tiles whose ``dot_scaled`` Triton 3.6 cannot lower for gfx942. Kernels on bf16 weights convert nothing."""
    amd = [launch for launch in launches if launch["arch"] in AMD]
    from_codes = [launch for launch in amd if launch["kernel"] == "_bmm_tiled_kernel"
                  and not launch["constexprs"]["W_BF16"]]  # fmt: skip
    assert {launch["arch"] for launch in from_codes} == set(AMD)
    assert any(launch["constexprs"]["BLOCK_M"] == 16 and launch["constexprs"]["BLOCK_K"] == 64 for launch in from_codes)
    for launch in from_codes:
        assert (launch["facts"]["fp4_cvt"] > 0) == (launch["arch"] == "gfx950"), launch
    for launch in amd:
        if launch["kernel"] != "_bmm_tiled_kernel" or launch["constexprs"]["W_BF16"]:
            assert launch["facts"]["fp4_cvt"] == 0, launch


def test_launches_fit_the_gpus_shared_memory_or_fall_back(launches):
    """A default launch may exceed the GPU's shared memory (LDS): Triton refuses it at its first launch
    (``OutOfResources``) and the backend falls back, the GEMM to one stage, attention to its compact launch; those
    always fit. gfx950's 160 KiB does not hold attention's 5-stage 16-head blocks, gfx942's 64 KiB not attention's
    blocks of 64 key rows with rope, sm_120's 99 KiB not the 5-stage blocks either. The GEMM's tiles fit everywhere
    (gfx942's 3-stage H200 tiles on predecoded weights needed 81,920 bytes; its :func:`triton_bmm.register_fit` ones
    fit)."""
    over = [(launch["arch"], launch["kernel"], launch["options"]["num_stages"], finding) for launch in launches
            for finding in launch["findings"] if "shared memory" in finding]  # fmt: skip
    assert all("falls back" in finding for *_, finding in over), over
    over_by = {tuple(where) for *where, _ in over}
    assert {("gfx950", "_fwd", 5), ("gfx942", "_fwd", 2), ("sm_120", "_fwd", 5)} <= over_by
    assert {kernel for _, kernel, _ in over_by} == {"_fwd"} and not {w for w in over_by if w[0] == "sm_100"}


def test_no_launch_that_runs_spills_registers(launches):
    """Every launch that fits the GPU's shared memory keeps its values in registers: off sm_90 the GEMM runs
    :func:`triton_bmm.register_fit` tiles (the H200's spilled: K-up 256 at 64 heads and 256 tokens, 128 x 256 in 3
    stages, 3,280 bytes of stack a thread on sm_80; the 32 x 128 tile 256 deep 308 bytes a lane on gfx942), and
    attention its 16-head launches (64-head blocks spilled 8-104 bytes a thread on NVIDIA GPUs, 1.0-1.5 KB a lane on
    AMD's). A launch over the GPU's shared memory never runs there: the backend falls back."""
    assert {launch["arch"] for launch in launches} == set(AMD + NVIDIA)
    spilled = [(launch["arch"], launch["kernel"], launch["case"], launch["facts"]["spill"]) for launch in launches
               if launch["facts"]["spill"] and not any("shared memory" in f for f in launch["findings"])]  # fmt: skip
    assert not spilled
    assert all(launch["facts"]["registers"] <= 255 for launch in launches if launch["arch"] in NVIDIA)


def test_attention_takes_16_head_blocks_off_sm_90(launches):
    """64 heads of 8192 tokens take 64-head blocks on the H200 (wgmma); compiled for these GPUs that kernel spilled
    972-1,456 bytes a lane on gfx950 / gfx942 and 8-104 bytes a thread on NVIDIA's. Here every attention launch has
    16-head blocks, and none spills on gfx950 (nor on NVIDIA, above)."""
    attention = [launch for launch in launches if launch["kernel"] == "_fwd"]
    assert {launch["constexprs"]["BLOCK_H"] for launch in attention} == {16}
    assert not [launch for launch in attention if launch["arch"] == "gfx950" and launch["facts"]["spill"]]


def test_the_compile_target_picks_the_rounding_code():
    """The activation rounding uses an inline PTX min where the kernels are compiled for an NVIDIA GPU, a select
    elsewhere: the same launch compiles for sm_90 with the PTX in it and for gfx950 without (before, gfx950's
    assembler met the PTX and failed)."""
    (got,) = _compile_in_a_process(_ROUNDING_ON_BOTH_TARGETS)
    assert got["nvidia_min"] > 0 and got["amd_ok"]


_WGMMA_HAZARD_ON_SM_90 = """
import dataclasses
from glm_pack.runtime.kernels import triton_bmm as tb
from glm_pack.runtime.kernels.ptx_check import wgmma_a_hazard
tiled = tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True)  # V-up's large-M tiles where Gluon cannot run
x, codes, scales, out = cc.gemm_operands(16, 1025, 256, 512)
for name, cfg in [("tiled", tiled), ("tma", dataclasses.replace(tiled, tma=True)),
                  ("unpipelined", tb.unpipelined(tiled))]:
    with cc.dispatch_for(cc.H200) as recording:
        tb._prepare(x, codes, scales, "mxfp4", out, cfg)(x, codes, scales, out)
    (gemm,) = [launch for launch in recording.launches if launch.kernel != "_decode_kernel"]
    ptx = cc.compile_for(gemm, cc.H200.target)["ptx"]
    print(json.dumps({"config": name, "kernel": gemm.kernel, "hazard": wgmma_a_hazard(ptx)}))
"""


@pytest.mark.skipif(not kernel_module("triton_bmm").triton.__version__.startswith("3.6."),
                    reason="the hazard is Triton 3.6's (triton-lang/triton#9433)")  # fmt: skip
def test_triton_3_6_code_for_pipelined_tiles_on_sm_90_has_the_wgmma_hazard_the_check_finds():
    """The H200's 128 x 256 tiles on predecoded weights with the activation rounding, compiled for sm_90: in the
    tiled and the TMA kernel (3 stages), the next K step's A fragments are loaded into registers that MMAs still in
    flight read (the launch that gave call-varying wrong results on the H200 with AMD's rounding), so the runtime
    refuses to launch them; unpipelined, as the backend falls back, every MMA is waited for."""
    got = {g["config"]: g for g in _compile_in_a_process(_WGMMA_HAZARD_ON_SM_90)}
    assert [got[c]["kernel"] for c in ("tiled", "tma", "unpipelined")] == [
        "_bmm_tiled_kernel", "_bmm_tma_kernel", "_bmm_tiled_kernel"]  # fmt: skip
    assert "the A operand of the wgmma.mma_async" in got["tiled"]["hazard"]
    assert "the A operand of the wgmma.mma_async" in got["tma"]["hazard"]
    assert got["unpipelined"]["hazard"] == ""


_ATTENTION_ON_SM_90 = """
import re
from glm_pack.runtime.kernels.ptx_check import wgmma_a_hazard
with cc.dispatch_for(cc.H200) as recording:
    for tokens in (8, 8192):  # split over the top-k axis, and not
        cc.attention_launches(tokens, 64, 64, True)
for launch in recording.launches:
    if launch.kernel == "_fwd":
        ptx, constexprs = cc.compile_for(launch, cc.H200.target)["ptx"], dict(launch.constexprs)
        print(json.dumps({"heads": constexprs["BLOCK_H"], "split": constexprs["SPLIT"],
                          "wgmma": ptx.count("wgmma.mma_async"), "hazard": wgmma_a_hazard(ptx),
                          "a_in_registers": len(re.findall(r"wgmma\\.mma_async[^;]*\\}\\s*,\\s*\\{", ptx))}))
"""


def test_attention_code_for_sm_90_has_no_wgmma_hazard():
    """Sparse MLA launches through the JIT, without the GEMM's PTX check before a first launch; its code for sm_90 must
    not need it. The H200's 64-head blocks (split over the top-k axis and not) run their dots as wgmma with P in
    registers as the A operand, and each K step rescales the accumulator, so every MMA is waited for before the next
    step writes P; the 16-head compact launches have no wgmma."""
    got = _compile_in_a_process(_ATTENTION_ON_SM_90)
    assert sorted((g["heads"], g["split"]) for g in got) == [(16, False), (16, True), (64, False), (64, True)]
    assert all((g["wgmma"] > 0) == (g["heads"] == 64) == (g["a_in_registers"] > 0) for g in got), got
    assert [g["hazard"] for g in got] == [""] * 4


nvidia_gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None,
                                     reason="needs an NVIDIA GPU")  # fmt: skip


def _pytest_in_a_process(tmp_path, env: dict[str, str], headers: tuple[str, ...], *args: str) -> None:
    """pytest with ``args``, in a process of :func:`_compiler_env` with ``env`` (read by tests/runtime/conftest.py)
    and a Triton cache of its own: it passes, its header saying each of ``headers``."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
        env=_compiler_env(**env, TRITON_CACHE_DIR=str(tmp_path / "triton")), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert " passed" in proc.stdout.splitlines()[-1]
    assert all(header in proc.stdout for header in headers)


NO_WGMMA = {"GLM_PACK_TEST_NO_WGMMA": "1"}
NO_WGMMA_HEADER = "dispatched as on an NVIDIA GPU without wgmma"
DISPATCH_TESTS = "test_dispatch_"  # they set the GPU they test: not under NO_WGMMA


@nvidia_gpu_only
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_amd_code_paths_match_the_reference_on_an_nvidia_gpu(tmp_path, arch):
    """The GEMM and rounding tests, in a process whose kernels compile as for ``arch`` (no inline PTX; on gfx942 the
    weights decoded in the kernel, on gfx950 given to ``tl.dot_scaled``: ``GLM_PACK_TEST_AMD_PATHS``,
    tests/runtime/conftest.py) and are dispatched as there (the defaults' :func:`triton_bmm.register_fit` tiles, no
    Gluon or TMA kernel: ``GLM_PACK_TEST_NO_WGMMA``), on this GPU. Left out: the dispatch tests, and for gfx942 the
    test pinning ``dot_scaled``'s reading of scale byte 0, which its paths do not call."""
    left_out = f"not ({DISPATCH_TESTS})" + (" and not scale_byte_0" if arch == "gfx942" else "")
    _pytest_in_a_process(tmp_path, {"GLM_PACK_TEST_AMD_PATHS": arch, **NO_WGMMA},
                         (f"with {arch}'s code paths", NO_WGMMA_HEADER), "tests/runtime/test_triton_bmm.py",
                         "tests/runtime/test_mxfp4_jit.py", "-k", left_out)  # fmt: skip


@nvidia_gpu_only
def test_dispatch_without_wgmma_matches_the_reference_on_an_nvidia_gpu(tmp_path):
    """The GEMM and attention tests, in a process whose backend dispatches as on an NVIDIA GPU without wgmma
    (``GLM_PACK_TEST_NO_WGMMA``, tests/runtime/conftest.py): the defaults' :func:`triton_bmm.register_fit` tiles
    and the 16-head attention launches, run on this GPU against the reference. Left out: the tests of the dispatch
    itself, which set the GPU they test."""
    _pytest_in_a_process(tmp_path, NO_WGMMA, (NO_WGMMA_HEADER,), "tests/runtime/test_triton_bmm.py",
                         "tests/runtime/test_triton_sparse_mla.py", "-k", f"not ({DISPATCH_TESTS})")  # fmt: skip
