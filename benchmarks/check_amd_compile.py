"""Compile the Triton backend's portable kernels for AMD GPUs on this machine, as the backend launches them there.

No AMD GPU is needed (nor used): the launches are recorded from the backend's own dispatch (``triton_bmm._prepare``
and ``triton_sparse_mla._launch`` on meta tensors, with torch answering as a ROCm build and the multiprocessor count
of the GPU named), then each distinct kernel is compiled by Triton's AMD backend for that GPU (``triton.compile``
with a ``hip`` target; Triton's active driver answers with the same target, since the kernels choose their code by
it: no inline PTX, ``tl.dot_scaled`` only on gfx950). This checks that the kernels lower and link for the GPU and what
they take there (registers, scratch spills, LDS against the GPU's, the MFMA instructions); nothing here ran on an AMD
GPU, so it says nothing about their speed or their results there.

    python benchmarks/check_amd_compile.py [--arch gfx950,gfx942] [--jobs 2]

Run without ``TRITON_INTERPRET`` (the kernels must be defined for the compiler). Shapes: GLM's K-up (N 512, K 192 and
256) and V-up (N 256, K 512) at 4-64 heads and 1-8192 tokens, activations rounded to MXFP4 or not; sparse MLA
(latent 512, rope 64 or none, natural-log LSE or not) at 1-8192 tokens and 16-64 heads. One line per distinct
launch; exit status 1 when one fails to compile or does not fit the GPU's LDS (the attention's default launch may
exceed it where its compact launch, which the backend falls back to on ``OutOfResources``, fits).
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
from triton.compiler import ASTSource

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
_TYPES = {torch.bfloat16: "bf16", torch.uint8: "u8", torch.float32: "fp32", torch.int32: "i32"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the backend makes it: the kernel's name, its runtime parameters' Triton types (in the
    kernel's order), its constexprs and compile options (warps, stages); the call it serves (for the report)."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, int], ...]
    case: str = ""

    def key(self) -> tuple:
        return self.kernel, self.signature, self.constexprs, self.options


KERNELS = {f.__name__: f for f in (tb._bmm_tiled_kernel, tb._bmm_stationary_kernel, tb._decode_kernel,
                                   tb._bmm_tma_kernel, sm._fwd, sm._combine)}  # fmt: skip


def _record(fn, args: tuple, kwargs: dict, case: str) -> Launch:
    """The launch of ``fn`` with these arguments: tensors as pointers of their dtype, floats as fp32, ints as i32."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    types = []
    for name, value in zip(fn.arg_names, args, strict=False):
        if isinstance(value, torch.Tensor):
            types.append((name, "*" + _TYPES[value.dtype]))
        else:
            types.append((name, "fp32" if isinstance(value, float) else "i32"))
    return Launch(fn.__name__, tuple(types), tuple(sorted(kwargs.items())), tuple(sorted(options.items())), case)


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
    """Record the launches of one K-up / V-up call on the runtime's layouts: x ``[H, T, K]``, the transposed view of
    ``[T, H, row]`` rows (q's 256 for K-up, whose K 192 is a slice of them; the attention output's 512 for V-up), y a
    transposed ``[T, H, N]`` buffer."""
    q = torch.empty(tokens, heads, max(K, 256), dtype=torch.bfloat16, device="meta")
    x = q[..., :K].transpose(0, 1)
    codes = torch.empty(heads, N, K // 2, dtype=torch.uint8, device="meta")
    scales = torch.empty(heads, N, K // 32, dtype=torch.uint8, device="meta")
    out = torch.empty(tokens, heads, N, dtype=torch.bfloat16, device="meta").transpose(0, 1)
    tb._prepare(x, codes, scales, act_quant, out, None)(x, codes, scales, out)


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
    """Triton's active driver as the kernels see it while compiling: only its target is asked."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target


def compile_for(launch: Launch, target: GPUTarget) -> dict:
    """Compile ``launch`` for ``target`` (its ints as plain i32: a real launch also specializes 1 and multiples of 16);
    its facts: ``ok``, and either ``error`` or the kernel's VGPRs, AGPRs, scratch bytes a lane, occupancy (waves a
    SIMD), LDS bytes, MFMA and FP4-conversion instruction counts (AMDGCN), or ``ptx`` (NVIDIA)."""
    fn = KERNELS[launch.kernel]
    constexprs = dict(launch.constexprs)
    signature = dict(launch.signature) | dict.fromkeys(constexprs, "constexpr")
    src = ASTSource(fn=fn, signature={n: signature[n] for n in fn.arg_names}, constexprs=constexprs)
    driver = triton.runtime.driver
    previous = driver._active  # reset_active() would look for a GPU
    driver.set_active(_Target(target))
    try:
        kernel = triton.compile(src, target=target, options=dict(launch.options))
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
    """An empty string when the launch's LDS fits the GPU's ``lds`` bytes; else what happens: an attention launch of
    the default shape falls back to the compact one (checked on its own line), anything else cannot launch."""
    if facts["lds"] <= lds:
        return ""
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
