"""Converted synthetic outputs shared by the runtime tests (made once per session)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # before any test module imports Triton or a kernel module: Triton defines its own jit functions (tl.zeros, ...)
    # and glm-pack its kernels for the interpreter only when it is set at their import
    os.environ["TRITON_INTERPRET"] = "1"

from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.synth import synthesize

AMD_PATHS = os.environ.get("GLM_PACK_TEST_AMD_PATHS", "")  # gfx942 or gfx950: set by test_compile_targets.py


def _compile_with_amd_paths(arch: str) -> None:
    """Make the kernels compile, on whatever GPU runs them, with the code they have on AMD's ``arch``: no inline PTX
    in the activation rounding; on gfx942 (and every AMD GPU but gfx950) the weights decoded in the tiled kernel
    instead of given to ``tl.dot_scaled``. Before any kernel compiles: the predicates are read when a kernel is
    compiled."""
    import triton

    from glm_pack.runtime.kernels import mxfp4_jit, triton_bmm

    if arch not in ("gfx942", "gfx950"):
        raise pytest.UsageError(f"GLM_PACK_TEST_AMD_PATHS={arch!r}: gfx942 or gfx950")

    @triton.constexpr_function
    def compiling_for_nvidia():
        return False

    mxfp4_jit.is_cuda = compiling_for_nvidia
    if arch == "gfx942":
        triton_bmm._dot_scaled_here = compiling_for_nvidia


NO_WGMMA = bool(os.environ.get("GLM_PACK_TEST_NO_WGMMA"))  # set by test_compile_targets.py's GPU test


def _dispatch_as_without_wgmma() -> None:
    """Make the backend dispatch, on whatever NVIDIA GPU runs the tests, as on an sm_80 GPU (A100; no wgmma, no TMA):
    the defaults take :func:`triton_bmm.register_fit` tiles in the portable kernels, neither Gluon nor TMA kernels
    run, and attention takes its 16-head blocks. The kernels still compile for the GPU that runs them (so torch's
    compute capability is left alone: Triton's driver asks it for the compile target)."""
    from glm_pack.runtime.kernels import gluon_bmm, triton_bmm, triton_sparse_mla

    triton_bmm.tuned_here = triton_sparse_mla.tuned_here = lambda device: device.type != "cuda"
    triton_bmm._has_tma = lambda device: False
    gluon_bmm._device_reason = lambda device: "dispatched as on an NVIDIA GPU without wgmma (GLM_PACK_TEST_NO_WGMMA)"


if AMD_PATHS:
    _compile_with_amd_paths(AMD_PATHS)
if NO_WGMMA:
    _dispatch_as_without_wgmma()


def pytest_report_header():
    return [line for on, line in (
        (AMD_PATHS, f"glm-pack kernels compiled with {AMD_PATHS}'s code paths (GLM_PACK_TEST_AMD_PATHS)"),
        (NO_WGMMA, "glm-pack kernels dispatched as on an NVIDIA GPU without wgmma (GLM_PACK_TEST_NO_WGMMA)"),
    ) if on]  # fmt: skip


@pytest.fixture(scope="session")
def packed_dirs(tmp_path_factory):
    """Lazily built {(card, options-key): OUT} cache of small converted checkpoints."""
    cache = {}

    def make(card="glm-5", layers=2, **options):
        key = (card, layers, tuple(sorted(options.items())))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"rt-{card}")
            src = synthesize(root / "src", card=card, layers=layers, experts=2, fmt="bf16", profile="small", seed=3)
            out = root / "out"
            convert(src, out, ConvertOptions(files="copy", **options))
            cache[key] = (src, out)
        return cache[key]

    return make


@pytest.fixture
def gpu_as(monkeypatch):
    """``gpu_as(arch)``: torch answers as on that GPU (``sm_80``, ``gfx942``, ...) for the kernels' dispatch: CUDA with
    its compute capability, or a ROCm build (with HIP's capability, 9.4 for gfx942); what the runtime caches about
    the GPU is cleared then and after the test."""
    from glm_pack.runtime.kernels.triton_bmm import forget_gpu

    def answer(arch: str) -> None:
        amd = arch.startswith("gfx")
        capability = (int(arch[3:-2]), int(arch[-2])) if amd else divmod(int(arch[3:]), 10)
        monkeypatch.setattr(torch.version, "hip", "7.0" if amd else None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        forget_gpu()

    yield answer
    forget_gpu()


@pytest.fixture(autouse=True)
def _bmm_calls_prepared_afresh():
    """Every test's Triton GEMM calls prepare their launches anew (a test watching the planning functions sees
    them run, whatever signatures earlier tests prepared)."""
    module = sys.modules.get("glm_pack.runtime.kernels.triton_bmm")
    if module is not None:
        module._PREPARED.clear()
