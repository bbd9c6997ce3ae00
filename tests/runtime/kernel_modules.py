"""The Triton kernel modules as the tests import them: on a machine without a GPU, with their kernels defined for
Triton's interpreter (``TRITON_INTERPRET=1`` must be set before a kernel is defined, i.e. before the module is
imported; a module imported earlier without it is reloaded). Also the benchmark scripts, which are no package."""

from __future__ import annotations

import importlib
import os
import sys

import torch


def kernel_module(name: str):
    """``glm_pack.runtime.kernels.<name>``, interpreted where no CUDA GPU is visible."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module(f"glm_pack.runtime.kernels.{name}")
    if not torch.cuda.is_available() and not module._INTERPRETED:
        module = importlib.reload(module)
    return module


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported as a module (the directory on ``sys.path`` only while importing)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
