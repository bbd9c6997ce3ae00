"""``_triton.KernelLaunch``: the first call through the JIT, later ones through the compiled kernel's launcher
with every parameter in order (the GPU tests run it on real kernels; here stand-ins record the calls)."""

from __future__ import annotations

import inspect

import pytest

from glm_pack.runtime.kernels import _triton

pytestmark = pytest.mark.skipif(bool(_triton.IMPORT_ERROR), reason="triton unavailable")


class _Compiled:
    """A compiled kernel: ``[grid]`` gives its launcher, which records what it gets."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Kernel:
    """A JIT function: ``[grid](*args, **kwargs)`` records the call and returns ``result``."""

    params = [_Param("x"), _Param("n"), _Param("BLOCK"), _Param("FLAG", default=False)]

    def __init__(self, result):
        self.result, self.calls = result, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs)) or self.result


def test_first_call_compiles_later_calls_launch_directly(monkeypatch):
    monkeypatch.setattr(_triton, "CompiledKernel", _Compiled)
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    launch = _triton.KernelLaunch(kernel, (7,), {"BLOCK": 64, "num_warps": 4})
    launch("x0", 5)
    launch("x1", 6)
    launch("x2", 7)
    assert kernel.calls == [((7, 1, 1), ("x0", 5), {"BLOCK": 64, "num_warps": 4})]
    # constexprs after the runtime arguments, in parameter order, defaults filled in; options (num_warps) left out
    assert compiled.launches == [((7, 1, 1), ("x1", 6, 64, False)), ((7, 1, 1), ("x2", 7, 64, False))]


def test_without_a_compiled_kernel_every_call_goes_through_the_jit(monkeypatch):
    """The interpreter's JIT returns no compiled kernel."""
    monkeypatch.setattr(_triton, "CompiledKernel", _Compiled)
    kernel = _Kernel(None)
    launch = _triton.KernelLaunch(kernel, (2, 3), {"BLOCK": 16})
    launch("a", 1)
    launch("b", 2)
    assert [c[:2] for c in kernel.calls] == [((2, 3, 1), ("a", 1)), ((2, 3, 1), ("b", 2))]
