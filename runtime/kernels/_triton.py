"""Triton, imported once for the kernel modules, and whether their kernels can run here.

``triton`` / ``tl`` are None when Triton cannot be imported or is older than :data:`MIN_TRITON` (then
``IMPORT_ERROR`` says why); importing this module never fails. Triton picks interpreter or compiler when a kernel is
*defined*, so each kernel module reads :func:`interpreted` at its own import. :func:`dot_fp32`, :func:`to_bf16` and
:func:`bf16_as_fp32` (defined only when Triton imports) are the fp32-accumulating dot and the bf16 conversions the
kernel modules share, exact under the interpreter too.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import subprocess
from collections.abc import Callable

import torch

from glm_pack.packing.errors import BackendError
from glm_pack.runtime.kernels.ptx_check import wgmma_a_hazard

# The Triton release the kernels are written and tested for (interpreter; compiled on an H200). Under 3.5 the Hopper
# Gluon kernels do not compile for sm_90 (an older warp_specialize signature; a failed lowering) and its interpreter's
# TMA descriptors refuse strides the predecode kernel passes; before 3.5 mxfp4_jit fails at import (no
# triton.constexpr_function).
MIN_TRITON = (3, 6)

try:
    import triton
    import triton.language as tl
    from triton.runtime import JITFunction

    IMPORT_ERROR = ""
except Exception as exc:  # any import failure means "unavailable"
    triton = tl = JITFunction = None
    IMPORT_ERROR = f"triton cannot be imported: {exc}"
else:
    _version = re.match(r"(\d+)\.(\d+)", triton.__version__)
    if _version is None or tuple(map(int, _version.groups())) < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        IMPORT_ERROR = f"triton {triton.__version__} is installed; glm-pack's kernels need Triton {need} or later"
        triton = tl = JITFunction = None


if not IMPORT_ERROR:

    @triton.jit
    def bf16_as_fp32(v):
        """bf16 ``v`` as its exact fp32 value, through the bits (the 3.6 interpreter's own cast loses subnormals)."""
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def dot_fp32(a, b, acc, INTERPRET: tl.constexpr):
        """``acc + a @ b`` in fp32 for operands holding bf16-exact values (bf16 x bf16 products are exact in
        fp32): bf16 operands when compiled; under the 3.6 interpreter, which multiplies bf16 bit patterns as
        integers, fp32 operands (bf16 ones widened by :func:`bf16_as_fp32`)."""
        if INTERPRET:
            if a.dtype == tl.bfloat16:
                a = bf16_as_fp32(a)
            if b.dtype == tl.bfloat16:
                b = bf16_as_fp32(b)
            return tl.dot(a, b, acc=acc, input_precision="ieee")
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc=acc)

    @triton.jit
    def to_bf16(v, INTERPRET: tl.constexpr):
        """float32 -> bf16 rounding to nearest even, subnormals included (the 3.6 interpreter's own cast
        truncates and flushes them: there through the bits)."""
        if INTERPRET:
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        return v.to(tl.bfloat16)


def interpreted() -> bool:
    """True when ``TRITON_INTERPRET`` selects Triton's interpreter: kernels defined now run on CPU tensors there.
    Read as Triton reads it (``triton.knobs``: 1, true, on or yes in any case); Triton without knobs reads only
    1. Another reading than Triton's would run interpreted kernels with the compiled path's constants."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETER_SMS = 4  # stand-in multiprocessor count for CPU tensors under the interpreter


@functools.cache
def availability(kernels_interpreted: bool) -> tuple[bool, str]:
    """(usable, reason) for kernels defined with ``kernels_interpreted``: Triton importable, and a GPU visible
    to torch (CUDA or ROCm) unless they run in the interpreter. Fixed per process, so computed once: it is
    on every kernel call's path."""
    if IMPORT_ERROR:
        return False, IMPORT_ERROR
    if not kernels_interpreted and not torch.cuda.is_available():
        return False, "no GPU visible to torch (set TRITON_INTERPRET=1 before import to run on CPU)"
    return True, "ok"


@functools.cache
def tuned_here(device: torch.device) -> bool:
    """Whether the kernels' tiles and launch shapes, tuned on an H200, serve ``device`` as they are: an sm_90 GPU
    (Hopper: wgmma, so the Gluon kernels), or CPU tensors (the interpreter, whose tests assume them). Compiled for
    other GPUs they spill registers (NVIDIA's sm_80-sm_120, AMD's gfx942; BENCHMARKS.md, "compiled for GPUs this
    project does not have"); on gfx950 they do not, but were never timed there either."""
    if device.type == "cpu":
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9


def ptxas_reason(capability: tuple[int, int]) -> str:
    """Why Triton cannot build kernels for an NVIDIA GPU of ``capability``; '' when it can, or when its ptxas does
    not list the GPUs it knows. Triton compiles for ``sm_XY`` (``sm_XYa`` from 9.0) with the ptxas it picks for that
    GPU: its own, or the one ``TRITON_PTXAS_PATH`` (``TRITON_PTXAS_BLACKWELL_PATH`` from sm_100) names. The one
    PyPI's Triton 3.6.0 ships for sm_100 on (CUDA 12.9's) does not know sm_110 (Jetson Thor): there the first kernel
    would fail in ptxas."""
    from triton.backends.nvidia import compiler

    arch = capability[0] * 10 + capability[1]
    target = compiler.sm_arch_from_capability(arch)
    try:
        ptxas = compiler.get_ptxas(arch)
    except RuntimeError as exc:  # no ptxas Triton can run
        return f"Triton cannot compile for {target}: {exc}"
    known = _ptxas_targets(ptxas.path)
    if known and target not in known:
        knob = "TRITON_PTXAS_BLACKWELL_PATH" if arch >= 100 else "TRITON_PTXAS_PATH"
        return (f"Triton's ptxas ({ptxas.path}, CUDA {ptxas.version}) cannot compile for {target}; {knob} can name "
                f"a ptxas that can")  # fmt: skip
    return ""


@functools.cache
def _ptxas_targets(path: str) -> frozenset[str]:
    """The GPU names the ptxas at ``path`` accepts, as its ``--help`` lists them for ``--gpu-name``; empty when it
    does not list them."""
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    listed = re.search(r"--gpu-name\b.*?Allowed values for this option:(.*?)Default value", usage, re.S)
    return frozenset(re.findall(r"'([\w.]+)'", listed.group(1))) if listed else frozenset()


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a GPU; :data:`INTERPRETER_SMS` for CPU tensors (the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_strides_ok(t: torch.Tensor) -> bool:
    """A 2-byte (bf16) tensor a TMA descriptor can address: unit last stride, base and other strides
    16-byte aligned."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1])


def _hooks_idle(runtime, chain: type) -> bool:
    """No launch hook is registered in Triton's ``knobs.runtime`` (profilers such as proton add them); ``chain``
    is Triton's ``HookChain``."""
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    return all(h is None or (isinstance(h, chain) and not h.calls) for h in hooks)


def c_launcher(compiled, grid: tuple[int, int, int], driver=None) -> Callable | None:
    """A launch of ``compiled`` over ``grid`` through the C function Triton (3.6) builds to launch it on
    CUDA, called directly with every parameter (constexprs included, as ``compiled[grid]`` takes them) on the
    current device's current stream; None where ``compiled`` has another launcher (other backends or
    versions) or needs scratch memory. ``driver`` defaults to Triton's active driver.

    It passes the C function what ``compiled[grid]`` would (its 13 leading arguments, then the parameters with
    each TMA descriptor expanded by Triton's own ``make_tensordesc_arg``: the CUtensorMap, shape, strides),
    without the Python layers between (``runner``, ``CudaLauncher.__call__``, the descriptor wrapper): about a
    third of a Gluon call's host time. Calls made while a launch hook is registered go through
    ``compiled[grid]``, which runs the hooks."""
    try:
        from triton.backends.nvidia import driver as nvidia
        from triton.backends.nvidia.driver import CudaLauncher, make_tensordesc_arg
        from triton.knobs import HookChain

        run = compiled.run
        if type(run) is not CudaLauncher or run.global_scratch_size or run.profile_scratch_size:
            return None
        if nvidia._BASE_ARGS_FORMAT_LEN != 13:  # grid (3), stream, function, cooperative, pdl, 2 scratch, 4 below
            return None
        wrapped = inspect.getclosurevars(run.launch).nonlocals if inspect.isfunction(run.launch) else {}
        launch = wrapped.get("launcher", run.launch)
        indices, metas = sorted(wrapped.get("tensordesc_indices", ())), wrapped.get("tensordesc_meta", ())
        descriptors = list(zip(indices, metas, strict=True))
        if inspect.isfunction(launch) or (inspect.isfunction(run.launch) and not descriptors):
            return None  # not the wrapper over the C function this was written against
        driver = driver or triton.runtime.driver.active
        device, stream = driver.get_current_device, driver.get_current_stream
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata)
        runtime, fallback = triton.knobs.runtime, compiled[grid]
    except Exception:  # noqa: BLE001 - any other layout of Triton's internals means "not this launcher"
        return None

    def launch_direct(*args) -> None:
        if not _hooks_idle(runtime, HookChain):
            fallback(*args)
            return
        if descriptors:
            args = list(args)
            for i, meta in reversed(descriptors):  # from the last, so that the earlier indices hold
                args[i : i + 1] = make_tensordesc_arg(args[i], meta)
        launch(*grid, stream(device()), *head, None, None, None, *args)  # no launch metadata or hooks

    return launch_direct


class UnsafeKernel(BackendError):
    """A compiled kernel's code has a hazard Triton is known to emit (:func:`unsafe_code`): it is not launched."""


_HAZARDS: dict[str, str] = {}  # compiled kernel's hash -> its hazard, "" for none


def unsafe_code(compiled) -> str:
    """What makes a compiled kernel's code unsafe to run, or "": on NVIDIA GPUs, a wgmma A-operand register written
    while its MMA may be in flight (:func:`ptx_check.wgmma_a_hazard`). Once per compiled kernel."""
    if compiled.hash not in _HAZARDS:
        _HAZARDS[compiled.hash] = wgmma_a_hazard(compiled.asm["ptx"]) if "ptx" in compiled.asm else ""
    return _HAZARDS[compiled.hash]


class KernelLaunch:
    """``kernel[grid](*args, **constexprs)`` with grid, constexprs and options fixed, for arguments whose
    specialization the caller holds fixed (it keeps one instance per key covering what Triton specializes a
    compiled kernel on: each int's width and whether it is 1 or a multiple of 16, each pointer's dtype and
    16-byte alignment, each descriptor's block type and layout).

    The first call compiles the kernel or finds it compiled (the JIT's ``warmup``: argument binding,
    specialization) and loads it (Triton's ``OutOfResources`` where it does not fit the GPU), raises
    :class:`UnsafeKernel` without launching it where :func:`unsafe_code` finds a hazard (every call then does), else
    launches it. Every launch goes straight to the compiled kernel's C launcher (:func:`c_launcher`) or, where that is
    not available, its Python launcher (``compiled[grid](*args)``), which skips the JIT's per-call work: tens of
    microseconds of host time per launch. An interpreted kernel (not a ``JITFunction``: the interpreter compiles
    nothing) goes through the JIT every call."""

    def __init__(self, kernel, grid: tuple[int, ...], constexprs: dict):
        self.kernel, self.constexprs = kernel, constexprs
        self.grid = (*grid, *(1,) * (3 - len(grid)))  # the compiled kernel's launcher takes all three
        self._runner = None
        self._tail: tuple = ()

    def __call__(self, *args) -> None:
        if self._runner is None:
            if not isinstance(self.kernel, JITFunction):
                self.kernel[self.grid](*args, **self.constexprs)
                return
            compiled = self.kernel.warmup(*args, grid=self.grid, **self.constexprs)
            runner = c_launcher(compiled, self.grid) or compiled[self.grid]  # loads it: OutOfResources first
            if hazard := unsafe_code(compiled):
                raise UnsafeKernel(f"{compiled.name}: Triton {triton.__version__}'s code for this launch is unsafe "
                                   f"on this GPU: {hazard} (triton-lang/triton#9433)")  # fmt: skip
            params = self.kernel.params[len(args) :]  # the launcher takes every parameter, constexprs included
            self._tail = tuple(self.constexprs.get(p.name, p.default) for p in params)
            self._runner = runner
        self._runner(*args, *self._tail)
