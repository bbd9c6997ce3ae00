"""Run aiter's own batched A16WFP4 Triton kernels through glm-pack's aiter backend, in the Triton interpreter on CPU.

No AMD GPU is needed (nor used): ``TRITON_INTERPRET=1`` runs aiter's Triton code (its wrapper, pointer and stride
arithmetic, masks, in-kernel activation quantizer ``_mxfp4_quant_op`` and ``tl.dot_scaled``) in numpy. aiter is
imported from the source tree given (a ROCm/aiter checkout or an unpacked ``amd-aiter`` wheel) without running
``aiter/__init__.py`` (HIP JIT, ROCm checks): stub parent packages, arch reported as gfx950. This says nothing about
speed, about the compiled AMDGPU code, or about aiter's HIP/ASM kernels. Nor about attention: aiter's
``sparse_mla_fwd``, which the backend calls for ``layer.attend``, launches Gluon kernels (``gluon.jit``, gfx950
layouts, buffer loads, inline asm), and ``gluon.jit`` compiles even under ``TRITON_INTERPRET=1``, so on CPU it fails
("0 active drivers"); the script only says what the backend's lookup found for it in the tree given.

    TRITON_INTERPRET=1 python benchmarks/check_aiter_interpreted.py AITER_ROOT [--heads 4] [--tokens 1,3,16,33]

It converts a one-layer synthetic GLM-5 twice (``--k-pad card``: w_kc K padded to 256; ``--k-pad none``: K 192),
opens each with ``backend="aiter"`` (the backend's own lookup finds the stubbed aiter), and prints one line per
case: K-up and V-up outputs (poisoned with NaN first; V-up written into a slice of a larger buffer whose rest must
stay untouched) against the reference (its activation round trip times the dequantized weight, in float64), on
tie-free random inputs (no activation lies exactly between two E2M1 values after scaling): max |err| / tolerance
(fp32 accumulation order, one bf16 ulp) and the share of bit-identical elements. Then a tie case per aiter:
purpose-built activations with exact E2M1 ties, compared with the reference (ties to even) and with the same product
whose ties round away from zero. Then the config check: the pinned config per route and M bucket, and whether
aiter's wrapper takes its even-K path with it; and a negative control: the K-192 route once more with a ragged
BLOCK_SIZE_K (256) instead of the pinned 64.

Needs a Triton whose interpreter implements ``tl.dot_scaled`` (3.7 or later, triton-lang/triton#10311; put it
first on PYTHONPATH when the environment has 3.6). Three interpreter gaps that aiter's kernels meet are bridged
here, each as the compiler does it: a tensor method of a math builtin (``x.floor()``) reaches the builtin without
the interpreter's semantic, ``not tensor`` is Python's ``not`` instead of the elementwise ``__not__``, and an fp32 to
bf16 cast truncates instead of rounding to nearest even.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
import tempfile
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton or any kernel module is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonJITFunction  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from glm_pack import runtime  # noqa: E402
from glm_pack.convert.convert import ConvertOptions, convert  # noqa: E402
from glm_pack.convert.synth import synthesize  # noqa: E402
from glm_pack.packing.mxfp4 import dequantize, even_exponent, pow2  # noqa: E402
from glm_pack.runtime import reference  # noqa: E402
from glm_pack.runtime.backends import aiter_backend  # noqa: E402
from glm_pack.runtime.kernels.triton_bmm import accumulation_tolerance  # noqa: E402

E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints between neighbouring E2M1 magnitudes
GLM5_HEADS = 64


# ---- the interpreter -------------------------------------------------------------------------------------------
def _not(value):
    """``not value`` as Triton's code generator does it: elementwise ``__not__`` on a tensor."""
    return value.__not__() if isinstance(value, tl.tensor) else not value


class _NotToCall(interpreter.ASTTransformer):
    def visit_Assign(self, node):  # the interpreter's visits the targets only
        node.value = self.visit(node.value)
        return super().visit_Assign(node)

    def visit_UnaryOp(self, node):
        node = self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return ast.Call(func=ast.Name(id="_glm_pack_not", ctx=ast.Load()), args=[node.operand], keywords=[])
        return node


def prepare_interpreter() -> None:
    if not hasattr(interpreter.InterpreterBuilder, "create_dot_scaled"):
        sys.exit(f"triton {triton.__version__}'s interpreter has no tl.dot_scaled (3.7 or later has it)")
    math_members = [
        name
        for name in dir(tl.math)
        if tl.core.is_builtin(getattr(tl.math, name))
        and hasattr(tl.tensor, name)
        and not tl.core.is_builtin(getattr(tl.tensor, name))
    ]
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        for name in math_members:  # tl.math's builtin, patched by then, as the method
            scope.set_attr(tensor, name, lambda self, *a, _n=name, **k: getattr(tl.math, _n)(self, *a, **k))

    interpreter._patch_lang_tensor = patched
    fp_trunc = interpreter.InterpreterBuilder.create_fp_trunc

    def fp32_to_bf16_nearest_even(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return fp_trunc(self, src, dst_type)
        data = torch.from_numpy(np.ascontiguousarray(src.data)).bfloat16().view(torch.int16).numpy()
        return interpreter.TensorHandle(data.view(np.uint16), tl.bfloat16)

    interpreter.InterpreterBuilder.create_fp_trunc = fp32_to_bf16_nearest_even
    interpreter._glm_pack_not = _not  # the rewriter copies the interpreter module's globals into the kernel's
    interpreter.FunctionRewriter.ast_transformer = _NotToCall()


# ---- aiter from a source tree, without aiter/__init__.py ------------------------------------------------------
class _Gfx950:
    def get_current_target(self):
        return GPUTarget("hip", "gfx950", 64)


def stub_aiter(root: Path) -> None:
    if not (root / "aiter" / "ops" / "triton").is_dir():
        sys.exit(f"{root} has no aiter/ops/triton (give a ROCm/aiter checkout or an unpacked amd-aiter wheel)")
    for name in ("aiter", "aiter.ops", "aiter.ops.triton", "aiter.jit", "aiter.jit.utils"):
        module = types.ModuleType(name)
        module.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = module
    driver = triton.runtime.driver
    driver.set_active(_Gfx950())  # newer arch_info caches the arch at import
    try:
        arch_info = importlib.import_module("aiter.ops.triton.utils._triton.arch_info")
    finally:
        driver._active = None
    arch_info.get_arch = lambda: "gfx950"  # the wheel's asks at every call


def sparse_mla_found(fn) -> str:
    """What the backend's lookup found for attention in this aiter (``layer.attend`` is not run: see the docstring)."""
    module = sys.modules.get(aiter_backend._SPARSE_MODULE)
    if module is None:
        return f"no importable {aiter_backend._SPARSE_MODULE}: attend runs on the fallback backend"
    usable = "usable" if fn.sparse_mla_fwd else "not usable by glm-pack (no return_lse or qk_rope_head_dim)"
    gluon = sorted(name for name, value in vars(module).items() if isinstance(value, GluonJITFunction))
    return f"{module.__name__}.sparse_mla_fwd {usable}; its kernels are Gluon ({', '.join(gluon) or 'none'})"


def open_aiter_on_cpu(out: Path, tp_size: int):
    """``runtime.open(backend="aiter")`` on CPU, its GPU and arch checks answered as on a gfx950 (the interpreter
    runs the kernels on CPU tensors)."""
    aiter_backend.detect_arch = lambda device: "gfx950"
    aiter_backend.gpu_reason = lambda device: ""
    return runtime.open(out, device="cpu", backend="aiter", tp_rank=0, tp_size=tp_size)


# ---- inputs -----------------------------------------------------------------------------------------------------
def _scaled(x: torch.Tensor) -> torch.Tensor:
    """|x| over its 32-block's even-rule scale (float64, exact), ``[..., K]``."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    e = even_exponent(blocks.abs().amax(-1, keepdim=True))
    return (blocks.abs().double() / pow2(e).double()).reshape(x.shape)


def tie_mask(x: torch.Tensor) -> torch.Tensor:
    q = _scaled(x)
    return torch.stack([q == t for t in E2M1_TIES]).any(0)


def tie_free(shape, gen: torch.Generator) -> torch.Tensor:
    """Random bf16 with no exact E2M1 tie: each tie moved one bf16 ulp toward zero (until none is left)."""
    x = torch.randn(shape, generator=gen).bfloat16()
    while (ties := tie_mask(x)).any():
        x = torch.where(ties, (x.view(torch.int16) - 1).view(torch.bfloat16), x)
    return x


def with_ties(shape, gen: torch.Generator) -> torch.Tensor:
    """bf16 ``[..., K]`` whose 32-blocks hold 4 * 2**e (setting the scale 2**e) and otherwise mostly exact ties."""
    lead, K = shape[:-1], shape[-1]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, *E2M1_TIES], dtype=torch.float64)
    pick = torch.randint(0, len(grid), (*lead, K // 32, 32), generator=gen)
    pick[..., 7:] = torch.randint(7, len(grid), pick[..., 7:].shape, generator=gen)  # mostly ties
    q = grid[pick]
    q[..., 0] = 4.0
    sign = torch.randint(0, 2, q.shape, generator=gen) * 2 - 1
    e = torch.randint(-3, 2, (*lead, K // 32, 1), generator=gen).double()
    return (q * sign * 2.0**e).reshape(shape).bfloat16()


def act_ties_away(x: torch.Tensor) -> torch.Tensor:
    """The activation round trip with ties rounded away from zero (what the amd-aiter 0.1.7 wheel's quantizer
    does), float64 ``[..., K]``: magnitudes rounded to the nearest E2M1 value, saturated at 6."""
    blocks = x.double().reshape(*x.shape[:-1], -1, 32)
    scale = pow2(even_exponent(blocks.float().abs().amax(-1, keepdim=True))).double()
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    index = sum((blocks.abs() / scale >= t).long() for t in E2M1_TIES)
    return (values[index] * scale * blocks.sign()).reshape(x.shape)


# ---- comparison ------------------------------------------------------------------------------------------------
def compare(y: torch.Tensor, act: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor) -> tuple[float, float]:
    """(max |y - exact| / tolerance, share of elements equal to the bf16 of the exact product) for y ``[B, M, N]``
    against ``act [B, M, K]`` (the activation values the kernel should multiply) times the dequantized weight."""
    w = dequantize(w_codes, w_scales, axis=-1).double()
    exact = torch.bmm(act.double(), w.transpose(1, 2))
    abs_dot = torch.bmm(act.double().abs(), w.abs().transpose(1, 2))
    tol = accumulation_tolerance(exact.float(), abs_dot.float(), act.shape[-1]).double()
    if not torch.isfinite(y).all():
        return float("inf"), 0.0
    err = (y.double() - exact).abs() / tol
    return err.max().item(), (y == exact.float().bfloat16()).double().mean().item()


def run_case(layer, route: str, T: int, gen: torch.Generator) -> bool:
    g = layer.geometry
    H, L, V = g.num_heads, g.kv_lora_rank, g.v_head_dim
    q = tie_free((T, H, g.qk_nope_head_dim + g.qk_rope_head_dim), gen)
    latent = tie_free((T, H, L), gen)
    ok = True
    # K-up through the backend into a NaN buffer, then through layer.k_up (same bits expected)
    x = layer.k_input(q)
    y = torch.full((T, H, L), float("nan"), dtype=torch.bfloat16)
    layer.backend.bmm_a16wfp4(
        x.transpose(0, 1), layer.w_kc.weight, layer.w_kc.scale, y.transpose(0, 1), op="k_up", act_quant="mxfp4"
    )
    same = torch.equal(layer.k_up(q), y)
    act = reference.activation_as_float(x, "mxfp4").transpose(0, 1)
    err, share = compare(y.transpose(0, 1), act, layer.w_kc.weight, layer.w_kc.scale)
    ok &= err <= 1 and same
    print(
        f"k_up {route:8} K={layer.w_kc.k_stored:3} H={H} T={T:2}  max err/tol {err:6.3f}  bit-identical {share:7.2%}"
        f"  layer.k_up same bits: {same}"
    )
    # V-up into the first V columns of a [T, H, 2V] NaN buffer: the rest must stay NaN
    big = torch.full((T, H, 2 * V), float("nan"), dtype=torch.bfloat16)
    out = layer.v_up(latent, out=big[..., :V])
    act = reference.activation_as_float(latent, "mxfp4").transpose(0, 1)
    err, share = compare(out.transpose(0, 1), act, layer.w_vc.weight, layer.w_vc.scale)
    untouched = bool(big[..., V:].isnan().all())
    ok &= err <= 1 and untouched
    print(
        f"v_up {route:8} K={layer.w_vc.k_stored:3} H={H} T={T:2}  max err/tol {err:6.3f}  bit-identical {share:7.2%}"
        f"  rest of y buffer untouched: {untouched}"
    )
    return ok


def tie_case(layer, gen: torch.Generator) -> None:
    g = layer.geometry
    latent = with_ties((3, g.num_heads, g.kv_lora_rank), gen)
    y = layer.v_up(latent).transpose(0, 1)
    w, s = layer.w_vc.weight, layer.w_vc.scale
    x = latent.transpose(0, 1)
    even, share_even = compare(y, reference.activation_as_float(x, "mxfp4"), w, s)
    away, share_away = compare(y, act_ties_away(x), w, s)
    ties = tie_mask(latent).double().mean().item()
    verdict = "ties to even" if even <= 1 else "ties away from zero" if away <= 1 else "neither"
    print(
        f"ties v_up T=3 ({ties:.0%} of activations are exact ties): vs ties-to-even reference max err/tol "
        f"{even:8.3f} ({share_even:.1%} bit-identical); vs ties-away {away:6.3f} ({share_away:.1%}) -> {verdict}"
    )


def ragged_control(layer, gen: torch.Generator) -> None:
    """The unpadded K-up (K 192) once more with BLOCK_SIZE_K 256 pinned instead of 64: aiter's ragged-K path,
    which glm-pack's configs avoid (a negative control: it should fail or be wrong)."""
    pinned = layer.backend.configs["k_up"]
    layer.backend.configs["k_up"] = {b: {**cfg, "BLOCK_SIZE_K": 256} for b, cfg in pinned.items()}
    g = layer.geometry
    q = tie_free((3, g.num_heads, g.qk_nope_head_dim + g.qk_rope_head_dim), gen)
    try:
        y = layer.k_up(q)
    except Exception as err:  # the wheel's ragged path does not compile
        result = f"raises {type(err).__name__}: {str(err).splitlines()[0][:100]}"
    else:
        act = reference.activation_as_float(layer.k_input(q), "mxfp4").transpose(0, 1)
        err, share = compare(y.transpose(0, 1), act, layer.w_kc.weight, layer.w_kc.scale)
        result = f"max err/tol {err:.3f}, bit-identical {share:.2%}"
    finally:
        layer.backend.configs["k_up"] = pinned
    print(f"control k_up unpadded K=192 T=3 with a ragged BLOCK_SIZE_K=256 (not glm-pack's config): {result}")


def config_check(model, route: str, K: int, op: str) -> None:
    """The pinned config per M bucket and whether aiter's wrapper keeps K unsplit and even with it (it shrinks a
    BLOCK_SIZE_K >= K to the next power of two of K; its ragged-K path is wrong in many versions)."""
    configs = model.backend.configs[op]
    parts = []
    for bucket, cfg in configs.items():
        block = cfg["BLOCK_SIZE_K"] if cfg["BLOCK_SIZE_K"] < K else triton.next_power_of_2(K)
        even = K % block == 0
        parts.append(f"{bucket}: BK {cfg['BLOCK_SIZE_K']} KSPLIT {cfg['NUM_KSPLIT']} {'even' if even else 'RAGGED'}")
    print(f"config {op} {route:8} K={K}: " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("aiter_root", type=Path, help="a ROCm/aiter checkout or an unpacked amd-aiter wheel")
    parser.add_argument("--heads", type=int, default=4, help="heads per rank (GLM-5 has 64)")
    parser.add_argument("--tokens", default="1,3,16,33")
    parser.add_argument("--work", type=Path, help="where the synthetic checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    prepare_interpreter()
    stub_aiter(args.aiter_root.resolve())
    tokens = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        src = work / "src"
        if not src.exists():
            synthesize(src, card="glm-5", layers=1, experts=2, fmt="bf16", profile="small", seed=3)
        ok = True
        for k_pad, route in (("card", "padded"), ("none", "unpadded")):
            out = work / f"out-{k_pad}"
            if not out.exists():
                convert(src, out, ConvertOptions(files="copy", k_pad=k_pad))
            model = open_aiter_on_cpu(out, GLM5_HEADS // args.heads)
            if route == "padded":
                fn = model.backend.fn
                print(f"aiter {args.aiter_root}: {fn.bmm.__module__}.{fn.bmm.__name__} ({fn.bmm_kind})")
                print(f"sparse MLA: {sparse_mla_found(fn)}")
            layer = model.mla(0)
            gen = torch.Generator().manual_seed(0)
            for T in tokens:
                ok &= run_case(layer, route, T, gen)
            if route == "padded":
                tie_case(layer, gen)
            else:
                ragged_control(layer, gen)
            config_check(model, route, layer.w_kc.k_stored, "k_up")
            config_check(model, route, layer.w_vc.k_stored, "v_up")
    print("all tie-free cases within tolerance" if ok else "MISMATCH in a tie-free case")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
