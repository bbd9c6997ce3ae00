"""Triton JIT helpers shared by the Triton (:mod:`triton_bmm`) and Gluon (:mod:`gluon_bmm`) GEMM kernels.

:func:`mxfp4_even_round_trip` is the one in-kernel entry to the activation path (``dequant(quant_even(x))``
per 32-block): portable steps in Triton operations, or, for callers whose layout gives each thread whole runs of
k (the Gluon kernels), the same function in PTX (:func:`round_ptx`, fewer instructions and registers). Gluon
kernels call it as is, so it uses no layout-bearing constructors (typed scalars instead of ``tl.full``).
Defined only when Triton imports (:func:`round_ptx`, plain text, always).
"""

from __future__ import annotations

from glm_pack.runtime.kernels._triton import IMPORT_ERROR, tl, triton

FAST_MAX_SCALE_BITS = 0x7B80  # bf16 2**120: blocks with this scale or more take the PTX's slow path


def round_ptx(pairs: int) -> str:
    """PTX rounding ``pairs`` bf16 pairs of x (``$pairs ..``) of one 32-block to ``dequant(quant_even(x))``
    (``$0 ..``), given the block's ``2**e`` and ``2**-e`` as bf16 bits in both halves of an int32 (``$2pairs``
    and ``$4pairs``: an int32 operand has one register per element, ``2 * pairs`` equal copies, the rest unused).

    Fast path (scales below 2**120): with E = max(2**floor(log2 |x|), 2**e) (x's exponent bits, then a packed
    max) the E2M1 grid step at |x| is E / 2, the bf16 ulp of ``96 * E``, so ``fma(E, 96, x)`` rounds x to the
    grid with ties to even (the even code) and ``fma(E, -96, .)`` takes 96 * E back off, exactly; no clamp is
    needed (the even rule's e keeps |x| < 7 * 2**e, which rounds to at most 6 * 2**e), and 96 * E stays finite.
    Then x's sign goes back on (-0 for negatives rounding to zero): 5 instructions per pair.
    Slow path (2**e >= 2**120, where 96 * E could overflow; Inf blocks have e = 127): the steps of the portable
    path in :func:`mxfp4_even_round_trip`: a = min(|x| * 2**-e, 6) (keeping NaN), the same rounding on a's grid
    (E = max(2**floor(log2 a), 1)), times 2**e, x's sign."""
    x = [f"${pairs + i}" for i in range(pairs)]
    up, down, six, one = "0x42C042C0", "0xC2C0C2C0", "0x40C040C0", "0x3F803F80"  # bf16 pairs 96, -96, 6, 1
    scale, inverse = f"${2 * pairs}", f"${4 * pairs}"  # int32 operands: one register per element
    lines = [".reg .b32 a, q, t, m;", ".reg .pred slow;",
             f"setp.ge.u32 slow, {scale}, {FAST_MAX_SCALE_BITS * 0x10001:#x};", "@slow bra SLOW;"]  # fmt: skip
    for i in range(pairs):
        lines += [f"and.b32 a, {x[i]}, 0x7F807F80;", f"max.bf16x2 a, a, {scale};",
                  f"mov.b32 m, {up};", f"fma.rn.bf16x2 t, a, m, {x[i]};", f"mov.b32 m, {down};",
                  "fma.rn.bf16x2 t, a, m, t;", f"and.b32 a, {x[i]}, 0x80008000;", f"or.b32 ${i}, t, a;"]  # fmt: skip
    lines += ["bra DONE;", "SLOW:"]
    for i in range(pairs):
        lines += [f"and.b32 a, {x[i]}, 0x7FFF7FFF;", f"mul.rn.bf16x2 q, a, {inverse};", f"mov.b32 m, {six};",
                  "min.NaN.bf16x2 q, q, m;", f"mov.b32 m, {one};", "max.bf16x2 t, q, m;",
                  "and.b32 t, t, 0x7F807F80;", f"mov.b32 m, {up};", "fma.rn.bf16x2 a, t, m, q;",
                  f"mov.b32 m, {down};", "fma.rn.bf16x2 a, t, m, a;", f"mul.rn.bf16x2 a, a, {scale};",
                  f"and.b32 t, {x[i]}, 0x80008000;", f"or.b32 ${i}, a, t;"]  # fmt: skip
    return "{\n" + "\n".join(lines + ["DONE:"]) + "\n}"


if not IMPORT_ERROR:
    from triton.language.target_info import is_cuda

    from glm_pack.runtime.kernels._triton import bf16_as_fp32

    _round_ptx = triton.constexpr_function(round_ptx)

    @triton.constexpr_function
    def _round_ptx_constraints(pairs):
        """Outputs: the pairs; inputs: the pairs, then 2**e and 2**-e (int32, one register per element)."""
        return ",".join(["=r"] * pairs + ["r"] * (5 * pairs))

    @triton.jit
    def pow2(e):
        """Exact float32 ``2**e`` for int32 ``e`` in [-127, 127] (2**-127 is the one subnormal needed)."""
        return tl.where(e >= -126, (e + 127) << 23, 0x400000).to(tl.float32, bitcast=True)

    @triton.jit
    def mxfp4_even_round_trip(
        x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PTX_PAIRS: tl.constexpr = 0
    ):
        """bf16 x ``[BLOCK_M, BLOCK_K]`` -> ``dequant(quant_even(x))`` per 32-block along K, as bf16 (exact; NaN
        stays NaN, as :func:`glm_pack.runtime.reference.activation_as_float` keeps it).

        Even rule: round amax's fp32 mantissa to 1 bit, e = floor(log2) - 2 clamped to [-127, 127] (255 after
        rounding -> 127). Elements: a = min(|x| / 2**e, 6) rounded to the E2M1 grid with ties to the even code:
        adding then subtracting ``1.5 * 2**(p-1) * step`` (p = significand bits) rounds to a multiple of the
        grid step (0.5 below 2, 1 below 4, else 2) with ties to even, which on this grid is the even code; the
        sign of x goes back on last. Every step is exact in bf16, so the GPU runs it on packed bf16 pairs; the
        3.6 interpreter has no bf16 arithmetic (and its bf16 conversions lose subnormals), so there the same
        steps run in fp32 on values converted by their bits.

        ``PTX_PAIRS`` > 0 (compiled only; the caller's layout must give each thread runs of ``2 * PTX_PAIRS``
        consecutive k, a divisor of 32, starting at a multiple of it): the rounding runs in :func:`round_ptx`
        instead, that many pairs per invocation: the same function in fewer instructions (a fast path for scales
        below 2**120, these steps above).
        """
        if INTERPRET:
            xb = tl.reshape(bf16_as_fp32(x), (BLOCK_M, BLOCK_K // 32, 4, 8))
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
        if PTX_PAIRS:  # bf16 bits of 2**e and 2**-e (2**-127: the subnormal 0x40), in both halves of an int32
            up = tl.where(e >= -126, (e + 127) << 7, 0x40)
            down = tl.where(e <= 126, (127 - e) << 7, 0x40)
            up = (up | (up << 16))[:, :, None, None]
            down = (down | (down << 16))[:, :, None, None]
            r = tl.inline_asm_elementwise(_round_ptx(PTX_PAIRS), _round_ptx_constraints(PTX_PAIRS), [xb, up, down],
                                          dtype=xb.dtype, is_pure=True, pack=2 * PTX_PAIRS)  # fmt: skip
            return tl.reshape(r, (BLOCK_M, BLOCK_K))
        q = tl.abs(xb) * pow2(-e).to(xb.dtype)[:, :, None, None]
        if INTERPRET or not is_cuda():  # a select keeps NaN (NaN > 6 is false); AMD GPUs take no PTX
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
