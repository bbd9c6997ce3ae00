"""Triton JIT helpers shared by the Triton (:mod:`triton_bmm`) and Gluon (:mod:`gluon_bmm`) GEMM kernels.

:func:`mxfp4_even_round_trip` is the one in-kernel implementation of the activation path
(``dequant(quant_even(x))`` per 32-block); Gluon kernels call it as is, so it uses no layout-bearing
constructors (typed scalars instead of ``tl.full``). Defined only when Triton imports.
"""

from __future__ import annotations

from glm_pack.runtime.kernels._triton import IMPORT_ERROR, tl, triton

if not IMPORT_ERROR:

    @triton.jit
    def pow2(e):
        """Exact float32 ``2**e`` for int32 ``e`` in [-127, 127] (2**-127 is the one subnormal needed)."""
        return tl.where(e >= -126, (e + 127) << 23, 0x400000).to(tl.float32, bitcast=True)

    @triton.jit
    def mxfp4_even_round_trip(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        """bf16 x ``[BLOCK_M, BLOCK_K]`` -> ``dequant(quant_even(x))`` per 32-block along K, as bf16 (exact; NaN
        stays NaN, as :func:`glm_pack.runtime.reference.activation_as_float` keeps it).

        Even rule: round amax's fp32 mantissa to 1 bit, e = floor(log2) - 2 clamped to [-127, 127] (255 after
        rounding -> 127). Elements: a = min(|x| / 2**e, 6) rounded to the E2M1 grid with ties to the even code:
        adding then subtracting ``1.5 * 2**(p-1) * step`` (p = significand bits) rounds to a multiple of the
        grid step (0.5 below 2, 1 below 4, else 2) with ties to even, which on this grid is the even code; the
        sign of x goes back on last. Every step is exact in bf16, so the GPU runs it on packed bf16 pairs; the
        3.6 interpreter has no bf16 arithmetic (and its bf16 conversions lose subnormals), so there the same
        steps run in fp32 on values converted by their bits.
        """
        if INTERPRET:
            xb = tl.reshape(x.to(tl.int16, bitcast=True).to(tl.int32) << 16, (BLOCK_M, BLOCK_K // 32, 4, 8))
            xb = xb.to(tl.float32, bitcast=True)
            bits = xb.to(tl.int32, bitcast=True)
            EXP_MASK: tl.constexpr = 0x7F800000
            SIGN_MASK: tl.constexpr = -(2**31)
            MAGIC: tl.constexpr = 6291456.0  # 3 * 2**21
        else:
            xb = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 4, 8))
            bits = xb.to(tl.int16, bitcast=True)
            EXP_MASK: tl.constexpr = 0x7F80
            SIGN_MASK: tl.constexpr = -(2**15)
            MAGIC: tl.constexpr = 96.0  # 3 * 2**5
        one = tl.cast(1.0, xb.dtype)  # typed scalars: no promotion to fp32, and no layout (Gluon callers)
        six = tl.cast(6.0, xb.dtype)
        amax = tl.max(tl.max(tl.abs(xb), axis=3), axis=2).to(tl.float32)  # 4 short chains, not one of 32
        biased = (amax.to(tl.int32, bitcast=True) + 0x200000) >> 23
        e = tl.where(biased == 255, 127, tl.maximum(biased - 129, -127))
        q = tl.abs(xb) * pow2(-e).to(xb.dtype)[:, :, None, None]
        if INTERPRET:
            a = tl.where(q > six, six, q)
        else:  # one packed min that keeps NaN (tl.minimum would go through fp32, a where through selects)
            a = tl.inline_asm_elementwise("{.reg .b32 c; mov.b32 c, 0x40C040C0; min.NaN.bf16x2 $0, $1, c;}", "=r,r",
                                          [q], dtype=xb.dtype, is_pure=True, pack=2)  # fmt: skip
        t = tl.where(a > one, a, one)
        magic = (t.to(bits.dtype, bitcast=True) & EXP_MASK).to(xb.dtype, bitcast=True) * MAGIC
        r = (a + magic) - magic
        r = (r.to(bits.dtype, bitcast=True) | (bits & SIGN_MASK)).to(xb.dtype, bitcast=True)
        r = r * pow2(e).to(xb.dtype)[:, :, None, None]
        if INTERPRET:
            r = (r.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.reshape(r, (BLOCK_M, BLOCK_K))
