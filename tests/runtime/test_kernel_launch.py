"""``_triton.KernelLaunch``: the first call through the JIT, later ones through the compiled kernel's launcher
with every parameter in order (the GPU tests run it on real kernels; here stand-ins record the calls)."""

from __future__ import annotations

import inspect

import pytest
import torch

from glm_pack.packing.errors import BackendError
from glm_pack.runtime.kernels import _triton
from glm_pack.runtime.kernels.ptx_check import wgmma_a_hazard

pytestmark = pytest.mark.skipif(bool(_triton.IMPORT_ERROR), reason="triton unavailable")


class _Compiled:
    """A compiled kernel: ``[grid]`` gives its launcher, which records what it gets; ``asm`` its PTX."""

    name = "kernel"

    def __init__(self, ptx: str = "", hash: str = "h0"):
        self.launches, self.asm, self.hash = [], {"ptx": ptx}, hash

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Kernel:
    """A JIT function: ``warmup`` (compiling) and ``[grid](*args, **kwargs)`` (launching; the interpreter's way)
    record the call; ``warmup`` returns ``compiled``."""

    params = [_Param("x"), _Param("n"), _Param("BLOCK"), _Param("FLAG", default=False)]

    def __init__(self, compiled):
        self.compiled, self.warmups, self.calls = compiled, [], []

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((grid, args, kwargs))
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_first_call_compiles_then_every_call_launches_directly(monkeypatch):
    monkeypatch.setattr(_triton, "JITFunction", _Kernel)
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    launch = _triton.KernelLaunch(kernel, (7,), {"BLOCK": 64, "num_warps": 4})
    launch("x0", 5)
    launch("x1", 6)
    assert kernel.warmups == [((7, 1, 1), ("x0", 5), {"BLOCK": 64, "num_warps": 4})] and kernel.calls == []
    # constexprs after the runtime arguments, in parameter order, defaults filled in; options (num_warps) left out
    assert compiled.launches == [((7, 1, 1), ("x0", 5, 64, False)), ((7, 1, 1), ("x1", 6, 64, False))]


def test_an_interpreted_kernel_goes_through_the_jit_every_call():
    """The interpreter's kernels are no JITFunction, and it compiles nothing."""
    kernel = _Kernel(None)
    launch = _triton.KernelLaunch(kernel, (2, 3), {"BLOCK": 16})
    launch("a", 1)
    launch("b", 2)
    assert [c[:2] for c in kernel.calls] == [((2, 3, 1), ("a", 1)), ((2, 3, 1), ("b", 2))] and kernel.warmups == []


_UNSAFE_PTX = """
\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1, %f2}, {%r1, %r2, %r3, %r4}, %rd9, %p9, 1, 1, 1;
\twgmma.commit_group.sync.aligned;
\tld.shared.v4.b32 \t{%r1, %r2, %r3, %r4}, [%r20];
"""


def test_a_kernel_whose_code_is_unsafe_is_never_launched(monkeypatch):
    """PTX writing a pending MMA's A registers: every call raises UnsafeKernel (a BackendError) naming the kernel,
    the place and Triton's issue, and launches nothing; the PTX is checked once per compiled kernel."""
    monkeypatch.setattr(_triton, "JITFunction", _Kernel)
    monkeypatch.setattr(_triton, "_HAZARDS", {})
    checked = []
    monkeypatch.setattr(_triton, "wgmma_a_hazard", lambda ptx: checked.append(ptx) or wgmma_a_hazard(ptx))
    compiled = _Compiled(_UNSAFE_PTX, hash="unsafe")
    for _ in range(2):
        launch = _triton.KernelLaunch(_Kernel(compiled), (1,), {"BLOCK": 16})
        for _ in range(2):
            with pytest.raises(BackendError, match=r"^kernel: Triton .*'s code for this launch is unsafe on this GPU: "
                                                   r"line 4 .* writes %r1, %r2, %r3, %r4, .*triton#9433"):  # fmt: skip
                launch("x", 1)
    assert compiled.launches == [] and checked == [_UNSAFE_PTX]


def test_code_without_ptx_is_not_checked(monkeypatch):
    """An AMD GPU's compiled kernel has no PTX (its asm: amdgcn): launched as it is."""
    monkeypatch.setattr(_triton, "JITFunction", _Kernel)
    compiled = _Compiled()
    compiled.asm = {"amdgcn": _UNSAFE_PTX}
    _triton.KernelLaunch(_Kernel(compiled), (1,), {"BLOCK": 16})("x", 1)
    assert compiled.launches == [((1, 1, 1), ("x", 1, 16, False))]


class _Capture:
    """Stands in for the C function Triton builds to launch a kernel (not a Python function): records its
    arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _CompiledCuda:
    """A compiled kernel with a Triton CUDA launcher ``run`` (built without its C module) and a Python launcher
    ``[grid]`` that records what it gets."""

    function, packed_metadata = 0xF00, ("packed",)

    def __init__(self, run):
        self.run, self.fallbacks = run, []

    def __getitem__(self, grid):
        return lambda *args: self.fallbacks.append((grid, args))


class _Driver:
    @staticmethod
    def get_current_device():
        return 0

    @staticmethod
    def get_current_stream(device):
        return 1000 + device


def _cuda_launcher(signature: dict, capture: _Capture, scratch: int = 0):
    """Triton's ``CudaLauncher`` over ``capture``, wrapped by Triton's own descriptor expansion (as
    ``CudaLauncher.__init__`` wraps the C function, whose compilation needs the CUDA toolkit)."""
    from triton.backends.nvidia.driver import CudaLauncher, wrap_handle_tensordesc

    run = CudaLauncher.__new__(CudaLauncher)
    run.launch = wrap_handle_tensordesc(capture, signature, None)
    run.global_scratch_size, run.profile_scratch_size = scratch, 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, True
    return run


def _triton_own_calls(signature: dict, grid: tuple, args: tuple) -> list:
    """What Triton's ``CudaLauncher.__call__`` gives the C function for ``args`` on stream 1000, as
    ``compiled[grid]`` calls it, less the launch metadata and hooks (None, as with no hook registered)."""
    from triton.backends.nvidia.driver import CudaLauncher

    capture = _Capture()
    CudaLauncher.__call__(_cuda_launcher(signature, capture), *grid, 1000, 0xF00, ("packed",), None, None, None, *args)
    return capture.calls


def _descriptor(rows: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(torch.zeros(2, rows, 64, dtype=torch.bfloat16), [1, rows, 64])


_SIGNATURE = {"x_desc": "tensordesc<bf16[1, 16, 64]>", "n": "i32", "y_desc": "tensordesc<bf16[1, 32, 64]>",
              "w": "*u8", "BLOCK": "constexpr", "FLAG": "constexpr"}  # fmt: skip


@pytest.mark.parametrize("signature", [_SIGNATURE, {"x": "*bf16", "n": "i32", "BLOCK": "constexpr"}],
                         ids=["descriptors", "pointers"])  # fmt: skip
def test_c_launcher_passes_what_the_python_launcher_passes(signature):
    """The C function gets the arguments Triton's ``CudaLauncher.__call__`` would give it (descriptors
    expanded by Triton's own code), with no launch metadata or hooks while none is registered."""
    args = {"x_desc": _descriptor(16), "x": 0xA0, "n": 5, "y_desc": _descriptor(32), "w": 0xB0, "BLOCK": 64,
            "FLAG": None}  # fmt: skip
    args = tuple(args[name] for name in signature)
    ours = _Capture()
    launch = _triton.c_launcher(_CompiledCuda(_cuda_launcher(signature, ours)), (3, 2, 1), _Driver)
    launch(*args)
    assert len(ours.calls) == 1 and ours.calls == _triton_own_calls(signature, (3, 2, 1), args)


def test_c_launcher_leaves_hooked_launches_to_the_python_launcher():
    """While a launch hook is registered, calls go through ``compiled[grid]`` (which runs the hooks)."""
    capture = _Capture()
    compiled = _CompiledCuda(_cuda_launcher(_SIGNATURE, capture))
    launch = _triton.c_launcher(compiled, (1, 1, 1), _Driver)
    hooked = (_descriptor(16), 5, _descriptor(32), 0xB0, 64, None)
    after = (_descriptor(16), 6, _descriptor(32), 0xC0, 8, True)
    hook = _triton.triton.knobs.runtime.launch_enter_hook
    hook.add(print)
    try:
        launch(*hooked)
    finally:
        hook.remove(print)
    launch(*after)
    assert compiled.fallbacks == [((1, 1, 1), hooked)]
    assert capture.calls == _triton_own_calls(_SIGNATURE, (1, 1, 1), after)  # after the hook's removal: direct


@pytest.mark.parametrize("case", ["other launcher", "scratch memory", "other leading arguments"])
def test_c_launcher_declines_what_it_was_not_written_for(case, monkeypatch):
    from triton.backends.nvidia import driver

    scratch = 256 if case == "scratch memory" else 0
    run = object() if case == "other launcher" else _cuda_launcher(_SIGNATURE, _Capture(), scratch)
    if case == "other leading arguments":
        monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT_LEN", 14)
    assert _triton.c_launcher(_CompiledCuda(run), (1, 1, 1), _Driver) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (compiled kernels)")
@pytest.mark.parametrize(
    "H, T, N, K",
    [(16, 16, 512, 192), (16, 64, 256, 512), (16, 64, 512, 192), (16, 1024, 256, 512)],
    ids=["tiled", "swap", "decode", "predecode-streaming"],
)
def test_repeated_calls_go_through_the_c_function_on_gpu(H, T, N, K, monkeypatch):
    """The default kernels of four GLM-like calls (Triton pointers; Gluon with two or three TMA descriptors):
    from the first call on, every launch goes through :func:`_triton.c_launcher`'s function, and every call
    writes the same output, within tolerance of the reference (outputs poisoned before each call); a call
    captured in a CUDA graph (launched on the capture stream) replays on new x."""
    from tests.runtime.kernel_modules import kernel_module
    from tests.runtime.test_triton_bmm import activations, assert_close_to_reference, poisoned_out, weights

    tb = kernel_module("triton_bmm")
    direct = []

    def counted(compiled, grid, driver=None):
        launch = c_launcher(compiled, grid, driver)
        assert launch is not None, "the C launcher was declined"
        return lambda *args: direct.append(grid) or launch(*args)

    c_launcher = _triton.c_launcher
    monkeypatch.setattr(_triton, "c_launcher", counted)
    monkeypatch.setattr(tb, "_PREPARED", {})  # launches prepared by other tests would not be counted
    codes, scales = weights(H, N, K, seed=T)
    x = activations(T, H, K, seed=K)
    outputs = []
    for _ in range(3):
        buf, out = poisoned_out(T, H, N)
        tb.bmm_a16wfp4(x, codes, scales, out=out)
        torch.cuda.synchronize()
        outputs.append(out.clone())
    launches_per_call = len(direct) // 3
    assert launches_per_call in (1, 2) and len(direct) == 3 * launches_per_call
    assert all(torch.equal(o.view(torch.int16), outputs[0].view(torch.int16)) for o in outputs[1:])
    assert_close_to_reference(outputs[2], x, codes, scales, "mxfp4")
    graph = torch.cuda.CUDAGraph()
    buf, out = poisoned_out(T, H, N)
    with torch.cuda.graph(graph):
        tb.bmm_a16wfp4(x, codes, scales, out=out)
    x.copy_(activations(T, H, K, seed=K + 1))
    graph.replay()
    torch.cuda.synchronize()
    assert len(direct) == 4 * launches_per_call
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


@pytest.mark.parametrize("value, interpret", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                              ("false", False), ("", False)])  # fmt: skip
def test_interpreted_reads_triton_interpret_as_triton_does(value, interpret, monkeypatch):
    """Triton defines interpreted kernels for TRITON_INTERPRET=true, on or yes too; the kernel modules, reading
    only "1", then ran them with the compiled path's constants (bf16 dots the 3.6 interpreter multiplies as
    integers) or called the interpreter unavailable without a GPU."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _triton.interpreted() is interpret


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_compiled_kernels_need_a_gpu_interpreted_ones_do_not():
    assert _triton.availability(True) == (True, "ok")
    ok, why = _triton.availability(False)
    assert not ok and "no GPU visible to torch" in why


def test_tma_strides_ok_wants_unit_last_stride_and_16_byte_alignment():
    """bf16 tensors: a contiguous one qualifies; a view starting one element in (2 bytes off), a column view
    (stride 2 along the last axis), rows 68 elements (136 bytes) apart, or a transposed one do not."""
    t = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert t.data_ptr() % 16 == 0 and _triton.tma_strides_ok(t)
    assert _triton.tma_strides_ok(t[:, 64:])  # 128 bytes in: still aligned
    assert not _triton.tma_strides_ok(t[:, 1:65])
    assert not _triton.tma_strides_ok(t[:, ::2])
    assert not _triton.tma_strides_ok(torch.zeros(4, 68, dtype=torch.bfloat16)[:, :64])
    assert not _triton.tma_strides_ok(torch.zeros(64, 8, dtype=torch.bfloat16).t())
