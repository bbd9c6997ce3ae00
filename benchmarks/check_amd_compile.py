"""Compile the Triton backend's portable kernels for AMD GPUs on this machine, as the backend launches them there.

No AMD GPU is needed (nor used): the launches are recorded from the backend's own dispatch (``triton_bmm._prepare``
and ``triton_sparse_mla._launch`` on meta tensors, with torch answering as a ROCm build and the multiprocessor count
of the GPU named), then each distinct launch is compiled by Triton's AMD backend for that GPU: Triton's JIT
``warmup`` with the launch's own arguments (meta tensors of its shapes and strides, its integers), so the kernel is
specialized as a launch specializes it, while Triton's active driver answers with that GPU as its target (the
kernels choose their code by it: no inline PTX, ``tl.dot_scaled`` only on gfx950). This checks that the kernels
lower and link for the GPU and what they take there (registers, scratch spills, LDS against the GPU's, the MFMA
instructions); nothing here ran on an AMD GPU, so it says nothing about their speed or their results there.

    python benchmarks/check_amd_compile.py [--arch gfx950,gfx942] [--jobs 2]

Run without ``TRITON_INTERPRET`` (the kernels must be defined for the compiler). Shapes: GLM's K-up (N 512, K 192 and
256) and V-up (N 256, K 512) at 4-64 heads and 1-8192 tokens, activations rounded to MXFP4 or not; sparse MLA
(latent 512, rope 64 or none, natural-log LSE or not) at 1-8192 tokens and 16-64 heads. One line per distinct
launch; exit status 1 when one fails to compile or does not fit the GPU's LDS (a default launch may exceed it where
the launch the backend falls back to on ``OutOfResources``, one stage for the GEMM, the compact attention launch,
fits).
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget

from glm_pack.runtime.kernels import _triton as kt
from glm_pack.runtime.kernels import triton_bmm as tb
from glm_pack.runtime.kernels import triton_sparse_mla as sm

# Compute units and LDS per workgroup (bytes) of the GPUs checked (AMD's CDNA3 / CDNA4 ISA guides, MI300X / MI355X).
GPUS = {"gfx950": (256, 160 * 1024), "gfx942": (304, 64 * 1024)}
GLM_GEMMS = {"kup192": (512, 192), "kup256": (512, 256), "vup": (256, 512)}  # op -> (N, K)
GEMM_HEADS = (4, 8, 16, 32, 64)
GEMM_TOKENS = (1, 16, 32, 64, 128, 256, 1024, 8192)
ATTENTION_HEADS = (16, 32, 64)
ATTENTION_TOKENS = (1, 8, 64, 256, 8192)
TOPK = 2048  # selected rows per token (GLM-5's index top-k)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the backend makes it: the kernel's name, its runtime arguments in order (a tensor as
    ``(dtype name, shape, strides)``, numbers as they are), its constexprs and compile options (warps, stages); the
    call it serves (for the report)."""

    kernel: str
    args: tuple
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]
    case: str = ""

    def key(self) -> tuple:
        """What tells one compiled kernel from another, as Triton specializes a launch: each tensor's dtype (its
        base, 16-byte aligned, is not recorded), each integer's being 1 (unless the parameter opts out) and a
        multiple of 16, the constexprs and options."""
        spec = []
        for param, arg in zip(KERNELS[self.kernel].params, self.args, strict=False):
            if isinstance(arg, tuple):
                spec.append(arg[0])
            elif isinstance(arg, int) and not isinstance(arg, bool):
                spec.append((arg == 1 and not param.do_not_specialize, arg % 16 == 0, abs(arg) < 2**31))
            else:
                spec.append(type(arg).__name__)
        return self.kernel, tuple(spec), self.constexprs, self.options

    def arguments(self) -> list:
        """The arguments, tensors as meta tensors of their dtype, shape and strides."""
        return [torch.empty_strided(a[1], a[2], dtype=getattr(torch, a[0]), device="meta") if isinstance(a, tuple)
                else a for a in self.args]  # fmt: skip


# The kernels the backend can launch on an AMD GPU (not the TMA or Gluon ones), by name: launches cross processes.
KERNELS = {f.__name__: f for f in (tb._bmm_tiled_kernel, tb._bmm_stationary_kernel, tb._decode_kernel, sm._fwd,
                                   sm._combine)}  # fmt: skip


def _record(fn, args: tuple, kwargs: dict, case: str) -> Launch:
    """The launch of ``fn`` with these arguments and keyword arguments (constexprs, warps, stages)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    described = tuple((str(a.dtype).removeprefix("torch."), tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor)
                      else a for a in args)  # fmt: skip
    return Launch(fn.__name__, described, tuple(sorted(kwargs.items())), tuple(sorted(options.items())), case)


@dataclass
class Recording:
    """The launches recorded by :func:`amd_dispatch`, each tagged with ``case`` as it was when made."""

    launches: list[Launch]
    case: str = ""


@contextmanager
def amd_dispatch(compute_units: int) -> Iterator[Recording]:
    """Within it, the backend's dispatch answers as on a ROCm GPU of ``compute_units`` CUs, and the launches it makes
    are recorded instead of run."""
    recording = Recording([])

    class Recorder:
        def __init__(self, fn, grid=None, constexprs=None):
            self.fn, self.constexprs = fn, dict(constexprs or {})

        def __getitem__(self, grid):  # kernel[grid](*args, **constexprs)
            return lambda *args, **kwargs: recording.launches.append(_record(self.fn, args, kwargs, recording.case))

        def __call__(self, *args):  # KernelLaunch(kernel, grid, constexprs)(*args)
            recording.launches.append(_record(self.fn, args, dict(self.constexprs), recording.case))

    with (
        mock.patch.object(torch.version, "hip", "7.0"),
        mock.patch.object(tb, "KernelLaunch", Recorder),
        mock.patch.object(sm, "_fwd", Recorder(sm._fwd)),
        mock.patch.object(sm, "_combine", Recorder(sm._combine)),
        mock.patch.object(tb, "sm_count", lambda device: compute_units),
        mock.patch.object(sm, "sm_count", lambda device: compute_units),
    ):
        yield recording


def gemm_launches(heads: int, tokens: int, N: int, K: int, act_quant: str) -> None:
    """Record the launches of one K-up / V-up call on the runtime's layouts (x ``[H, T, K]``, the transposed view of
    ``[T, H, row]`` rows: q's 256 for K-up, whose K 192 is a slice of them, the attention output's 512 for V-up; y a
    transposed ``[T, H, N]`` buffer) with its default config, then with the one-stage config the backend falls back
    to where the default does not fit the GPU."""
    q = torch.empty(tokens, heads, max(K, 256), dtype=torch.bfloat16, device="meta")
    x = q[..., :K].transpose(0, 1)
    codes = torch.empty(heads, N, K // 2, dtype=torch.uint8, device="meta")
    scales = torch.empty(heads, N, K // 32, dtype=torch.uint8, device="meta")
    out = torch.empty(tokens, heads, N, dtype=torch.bfloat16, device="meta").transpose(0, 1)
    for cfg in (None, tb.unpipelined(tb.default_config(heads, tokens, N, K))):
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


def glm_launches(arch: str) -> list[Launch]:
    """The distinct launches of every GLM case on ``arch``, each tagged with the first case that made it."""
    with amd_dispatch(GPUS[arch][0]) as recording:
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


def compile_for(launch: Launch, target: GPUTarget) -> dict:
    """Compile ``launch`` for ``target`` through Triton's JIT, specialized on its arguments as a launch is; its facts:
    ``ok``, and either ``error`` or the kernel's VGPRs, AGPRs, scratch bytes a lane, occupancy (waves a SIMD), LDS
    bytes, MFMA and FP4-conversion instruction counts (AMDGCN), or ``ptx`` (NVIDIA)."""
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
    if target.backend != "hip":
        return {"ok": True, "ptx": kernel.asm["ptx"]}
    asm = kernel.asm["amdgcn"]

    def stat(name: str) -> int:
        return int(re.search(rf"; {name}: (\d+)", asm).group(1))

    return {"ok": True, "vgpr": stat("NumVgprs"), "agpr": stat("NumAgprs"), "scratch": stat("ScratchSize"),
            "occupancy": stat("Occupancy"), "lds": kernel.metadata.shared, "hsaco": len(kernel.asm["hsaco"]),
            "mfma": len(re.findall(r"^\s*v_mfma_", asm, re.M)),
            "fp4_cvt": len(re.findall(r"^\s*v_cvt_scalef32_pk_bf16_fp4", asm, re.M))}  # fmt: skip


def _compile_on(arch_launch: tuple[str, Launch]) -> dict:
    arch, launch = arch_launch
    return compile_for(launch, GPUTarget("hip", arch, 64))


def _compact(launch: Launch) -> bool:
    """An attention launch of :func:`triton_sparse_mla.compact_config`'s shape (the backend's fallback)."""
    cfg = sm.compact_config(1, 1, 1, torch.device("meta"))
    consts, options = dict(launch.constexprs), dict(launch.options)
    shape = (consts["BLOCK_H"], consts["BLOCK_N"], options["num_warps"], options["num_stages"])
    return shape == (cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages)


def lds_finding(launch: Launch, facts: dict, lds: int) -> str:
    """An empty string when the launch's LDS fits the GPU's ``lds`` bytes; else what happens: a GEMM launch of more
    than one stage falls back to one stage, an attention launch of the default shape to the compact one (each fallback
    checked on its own line); anything else cannot launch."""
    if facts["lds"] <= lds:
        return ""
    if launch.kernel.startswith("_bmm") and dict(launch.options).get("num_stages", 1) > 1:
        return "over the GPU's LDS: the backend falls back to one stage"
    if launch.kernel == "_fwd" and not _compact(launch):
        return "over the GPU's LDS: the backend falls back to the compact launch"
    return f"cannot launch: needs {facts['lds']} B of LDS, the GPU has {lds}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gfx950,gfx942", help="comma-separated, of: " + ", ".join(GPUS))
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes")
    args = parser.parse_args(argv)
    if kt.interpreted():
        sys.exit("run without TRITON_INTERPRET: the kernels must be defined for the compiler")
    failed = 0
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    for arch in args.arch.split(","):
        launches = glm_launches(arch)
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_compile_on, [(arch, launch) for launch in launches]))
        print(f"\n{arch}: {len(launches)} distinct launches; LDS {GPUS[arch][1]} B, {GPUS[arch][0]} CUs\n")
        print("| kernel | constexprs | warps, stages | first case | VGPR | AGPR | scratch B | occupancy | LDS B | "
              "MFMA | FP4 cvt | finding |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for launch, facts in zip(launches, results, strict=True):
            consts = " ".join(f"{k}={v}" for k, v in launch.constexprs if k != "INTERPRET")
            opts = dict(launch.options)
            opts = f"{opts.get('num_warps', 4)}, {opts.get('num_stages', '-')}"
            head = f"| {launch.kernel} | {consts} | {opts} | {launch.case} |"
            if not facts["ok"]:
                failed += 1
                print(f"{head} | | | | | | | FAILED: {facts['error']} |")
                continue
            note = lds_finding(launch, facts, GPUS[arch][1])
            failed += note.startswith("cannot")
            print(f"{head} {facts['vgpr']} | {facts['agpr']} | {facts['scratch']} | {facts['occupancy']} | "
                  f"{facts['lds']} | {facts['mfma']} | {facts['fp4_cvt']} | {note or 'ok'} |")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
