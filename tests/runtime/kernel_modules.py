"""The Triton kernel modules and the benchmark scripts (which are no package) as the tests import them. On a machine
without a GPU the kernels are defined for Triton's interpreter: ``tests/runtime/conftest.py`` sets
``TRITON_INTERPRET=1`` there before anything imports Triton (it must be set when a kernel is defined)."""

from __future__ import annotations

import importlib
import os
import sys


def kernel_module(name: str):
    """``glm_pack.runtime.kernels.<name>``, interpreted where no CUDA GPU is visible (see the module docstring)."""
    return importlib.import_module(f"glm_pack.runtime.kernels.{name}")


def benchmark_module(name: str):
    """``benchmarks/<name>.py`` imported as a module (the directory on ``sys.path`` only while importing)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
