"""Compile the Triton backend's portable kernels for GPUs this machine lacks, as the backend launches them there.

The GPUs: AMD's gfx950 (MI350 / MI355), gfx942 (MI300) and gfx90a (MI200), and NVIDIA GPUs other than sm_90 (the
H200, sm_90, runs the kernels for real; sm_80 A100, sm_86 A40, sm_89 L40S, sm_100 B200, sm_120 RTX 5090), none of
which is needed or used. The launches are recorded from the backend's own dispatch (``triton_bmm._prepare`` and
``triton_sparse_mla._launch`` on meta tensors, with torch answering as a ROCm build or with the NVIDIA GPU's compute
capability, and the GPU's multiprocessor count), then each distinct launch is compiled by Triton for that GPU:
Triton's JIT ``warmup`` with the launch's own arguments (meta tensors of its shapes and strides, its integers), so the
kernel is specialized as a launch specializes it, while Triton's active driver answers with that GPU as its target
(the kernels choose their code by it: inline PTX only on NVIDIA, ``tl.dot_scaled`` only on NVIDIA and gfx950). This
checks that the kernels lower, assemble and link for the GPU and what they take there (registers, spills, shared
memory against the GPU's, the matrix instructions); nothing here ran on those GPUs, so it says nothing about the
kernels' speed or results there.

    python benchmarks/check_compile.py [--arch gfx950,gfx942,gfx90a,sm_80,sm_86,sm_89,sm_100,sm_120] [--jobs 2]

Run without ``TRITON_INTERPRET`` (the kernels must be defined for the compiler). Shapes: GLM's K-up (N 512, K 192 and
256) and V-up (N 256, K 512) at 4-64 heads and 1-8192 tokens, activations rounded to MXFP4 or not; sparse MLA
(latent 512, rope 64 or none, natural-log LSE or not) at 1-8192 tokens and 16-64 heads. One line per distinct
launch; exit status 1 when one fails to compile, does not fit the GPU's shared memory (a default launch may exceed it
where the launch the backend falls back to on ``OutOfResources``, one stage for the GEMM, the compact attention
launch, fits), or fits and spills registers.
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.tools.tensor_descriptor import TensorDescriptor

from glm_pack.runtime.kernels import _triton as kt
from glm_pack.runtime.kernels import triton_bmm as tb
from glm_pack.runtime.kernels import triton_sparse_mla as sm


@dataclass(frozen=True)
class Gpu:
    """A GPU the kernels are compiled for: Triton's target, its multiprocessors (compute units), the shared memory
    (LDS) one program may use in bytes, and a product that has it."""

    target: GPUTarget
    units: int
    shared: int
    example: str


# AMD: CDNA2 / CDNA3 / CDNA4 ISA guides (MI250X, MI300X, MI355X); NVIDIA: the CUDA programming guide's per-capability
# limits (shared memory a block may opt into) and each product's multiprocessor count.
GPUS = {
    "gfx950": Gpu(GPUTarget("hip", "gfx950", 64), 256, 160 * 1024, "MI355X"),
    "gfx942": Gpu(GPUTarget("hip", "gfx942", 64), 304, 64 * 1024, "MI300X"),
    "gfx90a": Gpu(GPUTarget("hip", "gfx90a", 64), 110, 64 * 1024, "MI250X, one of its two dies"),
    "sm_80": Gpu(GPUTarget("cuda", 80, 32), 108, 163 * 1024, "A100"),
    "sm_86": Gpu(GPUTarget("cuda", 86, 32), 84, 99 * 1024, "A40"),
    "sm_89": Gpu(GPUTarget("cuda", 89, 32), 142, 99 * 1024, "L40S"),
    "sm_100": Gpu(GPUTarget("cuda", 100, 32), 148, 227 * 1024, "B200"),
    "sm_120": Gpu(GPUTarget("cuda", 120, 32), 170, 99 * 1024, "RTX 5090"),
}
# The GPU the kernels run on for real, so not among GPUS: for checks of its code.
H200 = Gpu(GPUTarget("cuda", 90, 32), 132, 227 * 1024, "H200")
GLM_GEMMS = {"kup192": (512, 192), "kup256": (512, 256), "vup": (256, 512)}  # op -> (N, K)
GEMM_HEADS = (4, 8, 16, 32, 64)
GEMM_TOKENS = (1, 16, 32, 64, 128, 256, 1024, 8192)
ATTENTION_HEADS = (16, 32, 64)
ATTENTION_TOKENS = (1, 8, 64, 256, 8192)
TOPK = 2048  # selected rows per token (GLM-5's index top-k)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the backend makes it: the kernel's name, its runtime arguments in order (a tensor as
    ``(dtype name, shape, strides)``, a tensor descriptor as ``("desc", dtype name, shape, strides, block shape)``,
    numbers as they are), its constexprs and compile options (warps, stages); the call it serves (for the report)."""

    kernel: str
    args: tuple
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]
    case: str = ""

    def key(self) -> tuple:
        """What tells one compiled kernel from another, as Triton specializes a launch: each tensor's dtype (its
        base, 16-byte aligned, is not recorded), each descriptor's dtype and block shape, each integer's being 1
        (unless the parameter opts out) and a multiple of 16, the constexprs and options."""
        spec = []
        for param, arg in zip(KERNELS[self.kernel].params, self.args, strict=False):
            if isinstance(arg, tuple):
                spec.append((arg[1], arg[4]) if arg[0] == "desc" else arg[0])
            elif isinstance(arg, int) and not isinstance(arg, bool):
                spec.append((arg == 1 and not param.do_not_specialize, arg % 16 == 0, abs(arg) < 2**31))
            else:
                spec.append(type(arg).__name__)
        return self.kernel, tuple(spec), self.constexprs, self.options

    def arguments(self) -> list:
        """The arguments, tensors as meta tensors of their dtype, shape and strides (descriptors over them)."""

        def meta(dtype: str, shape: tuple, strides: tuple) -> torch.Tensor:
            return torch.empty_strided(shape, strides, dtype=getattr(torch, dtype), device="meta")

        return [TensorDescriptor.from_tensor(meta(*a[1:4]), list(a[4])) if isinstance(a, tuple) and a[0] == "desc"
                else meta(*a) if isinstance(a, tuple) else a for a in self.args]  # fmt: skip


# The kernels the backend can launch on these GPUs (not the Gluon ones, sm_90 only), by name: launches cross processes.
KERNELS = {f.__name__: f for f in (tb._bmm_tiled_kernel, tb._bmm_stationary_kernel, tb._bmm_tma_kernel,
                                   tb._decode_kernel, sm._fwd, sm._combine)}  # fmt: skip


def _described(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return str(a.dtype).removeprefix("torch."), tuple(a.shape), a.stride()
    if isinstance(a, TensorDescriptor):
        return ("desc", *_described(a.base), tuple(a.block_shape))
    return a


def _record(fn, args: tuple, kwargs: dict, case: str) -> Launch:
    """The launch of ``fn`` with these arguments and keyword arguments (constexprs, warps, stages)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    described = tuple(_described(a) for a in args)
    return Launch(fn.__name__, described, tuple(sorted(kwargs.items())), tuple(sorted(options.items())), case)


@dataclass
class Recording:
    """The launches recorded by :func:`dispatch_for`, each tagged with ``case`` as it was when made."""

    launches: list[Launch]
    case: str = ""


@contextmanager
def dispatch_for(gpu: Gpu) -> Iterator[Recording]:
    """Within it, the backend's dispatch answers as on ``gpu`` (torch a ROCm build for an AMD GPU, the compute
    capability of an NVIDIA one; its multiprocessor count), and the launches it makes are recorded instead of run."""
    recording = Recording([])

    class Recorder:
        def __init__(self, fn, grid=None, constexprs=None):
            self.fn, self.constexprs = fn, dict(constexprs or {})

        def __getitem__(self, grid):  # kernel[grid](*args, **constexprs)
            return lambda *args, **kwargs: recording.launches.append(_record(self.fn, args, kwargs, recording.case))

        def __call__(self, *args):  # KernelLaunch(kernel, grid, constexprs)(*args)
            recording.launches.append(_record(self.fn, args, dict(self.constexprs), recording.case))

    amd = gpu.target.backend == "hip"
    capability = (0, 0) if amd else divmod(gpu.target.arch, 10)
    tb.forget_gpu()  # per device, and meta tensors have one device
    try:
        with (
            mock.patch.object(torch.version, "hip", "7.0" if amd else None),
            mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: capability),
            mock.patch.object(tb, "KernelLaunch", Recorder),
            mock.patch.object(sm, "_fwd", Recorder(sm._fwd)),
            mock.patch.object(sm, "_combine", Recorder(sm._combine)),
            mock.patch.object(tb, "sm_count", lambda device: gpu.units),
            mock.patch.object(sm, "sm_count", lambda device: gpu.units),
        ):
            yield recording
    finally:
        tb.forget_gpu()


def gemm_operands(heads: int, tokens: int, N: int, K: int) -> tuple[torch.Tensor, ...]:
    """Meta tensors ``(x, codes, scales, out)`` of one K-up / V-up call on the runtime's layouts: x ``[H, T, K]``, the
    transposed view of ``[T, H, row]`` rows (q's 256 for K-up, whose K 192 is a slice of them, the attention output's
    512 for V-up); y a transposed ``[T, H, N]`` buffer."""
    q = torch.empty(tokens, heads, max(K, 256), dtype=torch.bfloat16, device="meta")
    codes = torch.empty(heads, N, K // 2, dtype=torch.uint8, device="meta")
    scales = torch.empty(heads, N, K // 32, dtype=torch.uint8, device="meta")
    out = torch.empty(tokens, heads, N, dtype=torch.bfloat16, device="meta").transpose(0, 1)
    return q[..., :K].transpose(0, 1), codes, scales, out


def gemm_launches(heads: int, tokens: int, N: int, K: int, act_quant: str) -> None:
    """Record the launches of one K-up / V-up call (:func:`gemm_operands`) with its default config, then with the
    one-stage config the backend falls back to where the default does not fit the GPU."""
    x, codes, scales, out = gemm_operands(heads, tokens, N, K)
    for cfg in (None, tb.unpipelined(tb.config_for(heads, tokens, N, K, x.device))):
        tb._prepare(x, codes, scales, act_quant, out, cfg)(x, codes, scales, out)


def attention_launches(tokens: int, heads: int, rope: int, lse: bool) -> None:
    """Record the launches of one sparse MLA call with its default launch shape, then with the compact one (the
    backend's fallback when the default does not fit the GPU)."""
    dev = torch.device("meta")
    q = torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device=dev)
    qr = torch.empty(tokens, heads, rope, dtype=torch.bfloat16, device=dev) if rope else q
    rows = torch.empty(4096, 512 + rope, dtype=torch.bfloat16, device=dev)
    indptr = torch.empty(tokens + 1, dtype=torch.int32, device=dev)
    indices = torch.empty(tokens * TOPK, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    lse_out = torch.empty(tokens, heads, dtype=torch.float32, device=dev) if lse else None
    n = indices.numel()
    for cfg in (sm.default_config(tokens, heads, n, dev), sm.compact_config(tokens, heads, n, dev)):
        sm._launch(q, qr, rope, rows, indptr, indices, 0.0625, out, lse_out, cfg)


def glm_launches(name: str) -> list[Launch]:
    """The distinct launches of every GLM case on the GPU ``name``, each tagged with the first case that made it."""
    with dispatch_for(GPUS[name]) as recording:
        for (op, (N, K)), heads, tokens, act in itertools.product(GLM_GEMMS.items(), GEMM_HEADS, GEMM_TOKENS,
                                                                  ("mxfp4", "none")):  # fmt: skip
            recording.case = f"{op} H={heads} T={tokens} {act}"
            gemm_launches(heads, tokens, N, K, act)
        for tokens, heads, rope, lse in itertools.product(ATTENTION_TOKENS, ATTENTION_HEADS, (64, 0), (True, False)):
            recording.case = f"attention T={tokens} H={heads} rope={rope} lse={lse}"
            attention_launches(tokens, heads, rope, lse)
    unique: dict[tuple, Launch] = {}
    for launch in recording.launches:
        unique.setdefault(launch.key(), launch)
    return list(unique.values())


class _Target:
    """Triton's active driver as its JIT asks it while compiling for ``target``: the target, a device (named after the
    target, so each target has its own compiled kernels) and a stream (unused: nothing is launched)."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> str:
        return f"{self.target.backend}:{self.target.arch}"

    def get_current_stream(self, device) -> int:
        return 0


def _count(pattern: str, asm: str) -> int:
    return len(re.findall(pattern, asm, re.M))


def _cubin_resources(cubin: bytes) -> dict:
    """Registers a thread and stack bytes a thread (spills; these kernels have no local arrays) of a cubin, as CUDA's
    ``cuobjdump -res-usage`` (the one Triton uses: its own, or ``TRITON_CUOBJDUMP_PATH``'s) reports them."""
    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    return {"registers": int(found.group(1)), "spill": int(found.group(2))}


def compile_for(launch: Launch, target: GPUTarget) -> dict:
    """Compile ``launch`` for ``target`` through Triton's JIT, specialized on its arguments as a launch is; its facts:
    ``ok``, and either ``error`` or ``registers`` (a lane's VGPRs / a thread's registers), ``spill`` (scratch / stack
    bytes a lane), ``shared`` (LDS / shared memory bytes), ``binary`` (code object bytes), ``mma`` (matrix-core
    instructions: MFMA, ``mma.sync``, ``tcgen05.mma``), ``fp4_cvt`` (gfx950's FP4 conversions) and the assembly
    (``amdgcn`` or ``ptx``); for AMD also ``agpr`` and ``occupancy`` (waves a SIMD)."""
    driver = triton.runtime.driver
    previous = driver._active  # reset_active() would look for a GPU
    driver.set_active(_Target(target))
    try:
        kernel = KERNELS[launch.kernel].warmup(*launch.arguments(), grid=(1,), **dict(launch.constexprs),
                                               **dict(launch.options))  # fmt: skip
    except Exception as exc:  # any compiler failure is the finding
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][-300:]}"}
    finally:
        driver._active = previous
    facts = {"ok": True, "shared": kernel.metadata.shared}
    if target.backend == "cuda":
        ptx = kernel.asm["ptx"]
        return facts | _cubin_resources(kernel.asm["cubin"]) | {
            "binary": len(kernel.asm["cubin"]), "ptx": ptx, "fp4_cvt": 0,
            "mma": _count(r"^\s*(@!?%\w+\s+)?(mma\.sync|tcgen05\.mma|wgmma\.mma_async)", ptx)}  # fmt: skip
    asm = kernel.asm["amdgcn"]

    def stat(name: str) -> int:
        return int(re.search(rf"; {name}: (\d+)", asm).group(1))

    return facts | {"registers": stat("NumVgprs"), "agpr": stat("NumAgprs"), "spill": stat("ScratchSize"),
                    "occupancy": stat("Occupancy"), "binary": len(kernel.asm["hsaco"]), "amdgcn": asm,
                    "mma": _count(r"^\s*v_mfma_", asm),
                    "fp4_cvt": _count(r"^\s*v_cvt_scalef32_pk_bf16_fp4", asm)}  # fmt: skip


def _compile_on(name_launch: tuple[str, Launch]) -> dict:
    name, launch = name_launch
    facts = compile_for(launch, GPUS[name].target)
    return {k: v for k, v in facts.items() if k not in ("ptx", "amdgcn")}  # what crosses back from the worker


def _compact(launch: Launch) -> bool:
    """An attention launch of :func:`triton_sparse_mla.compact_config`'s shape (the backend's fallback)."""
    cfg = sm.compact_config(1, 1, 1, torch.device("meta"))
    consts, options = dict(launch.constexprs), dict(launch.options)
    shape = (consts["BLOCK_H"], consts["BLOCK_N"], options["num_warps"], options["num_stages"])
    return shape == (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages)


def shared_finding(launch: Launch, facts: dict, shared: int) -> str:
    """An empty string when the launch's shared memory fits the GPU's ``shared`` bytes; else what happens: a GEMM
    launch of more than one stage falls back to one stage, an attention launch of the default shape to the compact
    one (each fallback checked on its own line); anything else cannot launch."""
    if facts["shared"] <= shared:
        return ""
    if launch.kernel.startswith("_bmm") and dict(launch.options).get("num_stages", 1) > 1:
        return "over the GPU's shared memory: the backend falls back to one stage"
    if launch.kernel == "_fwd" and not _compact(launch):
        return "over the GPU's shared memory: the backend falls back to the compact launch"
    return f"cannot launch: needs {facts['shared']} B of shared memory, the GPU has {shared}"


def findings(launch: Launch, facts: dict, gpu: Gpu) -> list[str]:
    """What is wrong with a compiled launch on ``gpu``, or what the backend does about it: its shared memory
    (:func:`shared_finding`), or, where that fits, a spill."""
    if shared := shared_finding(launch, facts, gpu.shared):
        return [shared]  # a launch that never runs there
    if facts["spill"]:
        where = "of stack a thread" if gpu.target.backend == "cuda" else "of scratch a lane"
        return [f"spills: {facts['spill']} B {where}"]
    return []


def fatal(finding: str) -> bool:
    """A finding that fails the check: a launch that cannot run, or one that spills (on a GPU that runs it)."""
    return finding.startswith(("cannot", "spills"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=",".join(GPUS), help="comma-separated, of: " + ", ".join(GPUS))
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes")
    args = parser.parse_args(argv)
    if kt.interpreted():
        sys.exit("run without TRITON_INTERPRET: the kernels must be defined for the compiler")
    failed = 0
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    for name in args.arch.split(","):
        gpu = GPUS[name]
        launches = glm_launches(name)
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_compile_on, [(name, launch) for launch in launches]))
        print(f"\n{name} ({gpu.example}): {len(launches)} distinct launches; shared memory {gpu.shared} B, "
              f"{gpu.units} multiprocessors\n")  # fmt: skip
        print("| kernel | constexprs | warps, stages | first case | registers | spill B | shared B | matrix instr. | "
              "FP4 cvt | finding |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for launch, facts in zip(launches, results, strict=True):
            consts = " ".join(f"{k}={v}" for k, v in launch.constexprs if k != "INTERPRET")
            opts = dict(launch.options)
            opts = f"{opts.get('num_warps', 4)}, {opts.get('num_stages', '-')}"
            head = f"| {launch.kernel} | {consts} | {opts} | {launch.case} |"
            if not facts["ok"]:
                failed += 1
                print(f"{head} | | | | | FAILED: {facts['error']} |")
                continue
            notes = findings(launch, facts, gpu)
            failed += any(fatal(n) for n in notes)
            registers = f"{facts['registers']} + {facts['agpr']} AGPR" if "agpr" in facts else facts["registers"]
            print(f"{head} {registers} | {facts['spill']} | {facts['shared']} | {facts['mma']} | {facts['fp4_cvt']} | "
                  f"{'; '.join(notes) or 'ok'} |")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
