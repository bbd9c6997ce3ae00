"""Hopper (sm_90) Gluon kernel for the A16WFP4 batched GEMM: TMA + wgmma, weights decoded in the kernel or
predecoded.

Same function as :func:`glm_pack.runtime.kernels.triton_bmm.bmm_a16wfp4` (which dispatches here): x ``[B, M, K]``
bf16 (unit last stride, 16-byte aligned base and other strides) through a 3-D tensor descriptor and y ``[B, M,
N]`` bf16 (unit last stride; the runtime passes a view of the batch-major ``[T, H, N]`` buffer) through another, or
by plain stores; weights as E2M1 codes ``[B, N, K/2]`` + E8M0
scales ``[B, N, K/32]`` (``decode``) or as predecoded bf16 ``[B, N, K]`` (the others). With ``act_mxfp4`` each
x tile is rounded to MXFP4 in shared memory, in place, by the shared
:func:`~glm_pack.runtime.kernels.mxfp4_jit.mxfp4_even_round_trip` (bit-exact), before the MMAs read it.

``[block_m, block_n]`` output tiles (64 or 128 rows: one or two warpgroups along M, any other warps along N),
``block_k`` K steps, both operands from shared memory (wgmma SS), fp32 accumulators in registers; y leaves
through one buffer (:func:`y_columns`) by TMA, or by plain stores where each program has one tile of at most 64
rows and all fit at once (:func:`plain_y`) or where y is no TMA target (base or strides off 16 bytes). A program
owns one ``(b, n0)`` column of weights and a contiguous run of its M tiles (each column's tiles split over the
multiprocessors left over). Four schedules work this way; a fifth, for small M, swaps the operands:

* ``decode``: the program loads the column's codes and scales into registers at once and decodes them into
  shared memory (bf16; a byte-table lookup per code pair, :func:`_e2m1_dequant_ptx`): K step ``k`` during
  the first tile, just before that step's MMAs, so decoding overlaps the MMAs of step ``k - 1``; with ``ws``
  and 8 MMA warps all of it before the first MMA (:func:`decode_first`), while the rounding warps round the
  first x tiles. The column (``block_n * K * 2`` bytes) stays for the remaining tiles. The weights cross HBM
  once per program and are never written back.
* ``stationary``: the same, with the column loaded by TMA from predecoded bf16 weights.
* ``streaming``: x and predecoded w tiles stream through one ring, for weights too large to keep (GLM's V-up:
  256 x 512 bf16 = 256 KiB per head at 256 columns).
* ``xreg`` (:func:`_xreg_loop`): ``decode``'s column, decoded before the first MMA with K in :func:`_swap_k_order`,
  and x as the wgmma's register operand: the MMA warps load each x tile from its slot into registers
  (:func:`xreg_x_layout`: a thread holds runs of consecutive k, so whole 32-blocks where ``block_k`` = 128),
  round it there and multiply, and the slot is refilled at once; no rounding warps, no rounded copy of x in
  shared memory, no hand-off. Step i + 1's x is rounded while step i's MMAs run. One warpgroup per 64 rows.
* ``swap`` (:func:`_swap_kernel`): the operands swapped, ``y^T = w . x^T``: ``block_n`` = 16 * ``num_warps``
  weight rows are the wgmma's M (one, two or four warpgroups), ``block_m`` = 16-64 rows of x its N, one tile a
  program. The MMA warps decode each K step of codes straight into the A-operand registers (wgmma RS: no
  shared-memory store, fence or barrier for the weights); the worker warps round each x tile (mxfp4) and store
  it with K reordered (:func:`_swap_k_order`; in some one-step launches the MMA warps do it after decoding,
  :func:`swap_workers`) so that a thread's A registers hold one run of consecutive k: its
  codes are one contiguous vector load, and the decoded values reach the A layout by renaming registers. With
  x tiles of 16-64 rows against up to 256 weight rows a head's x is rounded by fewer programs than with the
  decode schedule's tiles (each weight column's program rounds all the x it multiplies), which is where the
  time of small-M calls goes; the weights are decoded once per x tile instead. A program of one MMA warpgroup
  alone on its multiprocessor has all its K steps' codes loaded before it decodes step 0
  (:func:`swap_codes_first`).

The x ring has as many stages as fit in shared memory, up to 4. The first ``stages`` steps are loaded up front
(a program with that many K steps or fewer has all its x in flight at once); the TMA load for step
``i + stages - 1`` (``i`` >= 1) is issued once the MMAs of step ``i - 1`` are done. Without ``ws`` the MMA warps
round step ``i`` while the MMAs of ``i - 1`` run. With ``ws`` (warp specialisation) :data:`ROUND_WARPS` (or 8,
``Plan.round_warps``) more warps round each x tile as soon as it lands and signal an mbarrier, so the MMA warps only
wait, load and decode their weights, issue MMAs, refill the ring and write y; the registers are rebalanced between
the two groups (``setmaxnreg``) within a cap that lets one program, or two where there are more programs than
multiprocessors and shared memory holds two (:func:`programs_per_sm`), share a multiprocessor's 65536; a ``decode``
program of one MMA warpgroup alone on its multiprocessor has two partitions of rounding warps taking alternate x
tiles (:func:`round_partitions`). The rounding
runs in PTX (:func:`~glm_pack.runtime.kernels.mxfp4_jit.round_ptx`), which needs fewer registers: 256-deep K steps
fit the rounding warps' 96.

Gluon has no interpreter: under ``TRITON_INTERPRET=1``, on AMD GPUs and on NVIDIA GPUs other than sm_90 (wgmma
is sm_90-only), :func:`unusable_reason` says why and the caller runs its Triton kernels instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from glm_pack.runtime.kernels._triton import IMPORT_ERROR as _TRITON_ERROR
from glm_pack.runtime.kernels._triton import KernelLaunch, interpreted, sm_count, tma_strides_ok, triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    class _CheckedDescriptor(TensorDescriptor):
        """A Gluon ``TensorDescriptor`` without its constructor's checks (alignment, strides, block shape),
        which :func:`unusable_reason` and the plan made once for the call signature it is launched under (the
        caller's key pins each tensor's shape, strides and alignment): built on every call, so its host time
        counts."""

        def __post_init__(self):
            pass

    IMPORT_ERROR = _TRITON_ERROR
except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
    IMPORT_ERROR = _TRITON_ERROR or f"triton's gluon cannot be imported: {exc}"

MAX_STAGES = 4
ROUND_WARPS = 4  # warps rounding x with warp specialisation (WS), unless a plan asks for 8
ROUND_REGS = 96  # their registers per thread
MAX_SHARED_WARPS = 12  # programs of more warps (16 or 20) run alone on a multiprocessor: two would get <= 64 registers
ACC_HEADROOM = 32  # registers an MMA thread needs beyond its accumulator (register_error)
MAX_WARPS = 20  # MMA and rounding warps of a program: 24 (16 swap MMA warps + 8) fail in ptxas, too few registers
_SMEM_SLACK = 1024  # barriers and alignment, bytes
_INTERPRETED = interpreted()  # read at import, as the kernels below are defined (or not) by it


def _e2m1_bf16_ptx() -> str:
    """PTX for :func:`_e2m1_dequant_ptx`, one invocation per 4 code bytes ``$4`` (8 nibbles, k order) and a bf16
    scale pair ``$5``: writes the 8 scaled bf16 values as pairs ``$0 .. $3``.

    prmt picks bytes out of two 32-bit words by 3-bit selectors, four at a time: with each nibble's magnitude
    bits as selector, the words holding the high (then low) bytes of bf16(E2M1[m]) at byte m give four values'
    high (low) bytes. Their signs come from one more prmt in sign-replicating mode (selector bit 3: the
    selected byte's top bit, in all 8 bits) over the code word (a high nibble's sign is its byte's top bit)
    and the word shifted left by 4 (a low nibble's), masked to each byte's top bit; two prmt then interleave
    the high and low bytes into k-ordered pairs, and one ``mul.rn.bf16x2`` per pair applies the scale."""
    bits = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]).to(torch.bfloat16).view(torch.int16).tolist()

    def word(values: list[int]) -> str:
        return hex(sum(v << (8 * i) for i, v in enumerate(values)))

    high, low = [(b >> 8) & 0xFF for b in bits], [b & 0xFF for b in bits]
    lines = ["and.b32 s0, $4, 0x7777;", "shr.b32 s1, $4, 16;", "and.b32 s1, s1, 0x7777;", "shl.b32 u, $4, 4;"]
    for half in (0, 1):  # nibbles 4 * half .. 4 * half + 3 (code bytes 2 * half, 2 * half + 1) -> pairs 2 * half, + 1
        lines += [f"prmt.b32 h{half}, {word(high[:4])}, {word(high[4:])}, s{half};",
                  f"prmt.b32 l{half}, {word(low[:4])}, {word(low[4:])}, s{half};",
                  f"prmt.b32 g, u, $4, {'0xd9c8' if half == 0 else '0xfbea'};",  # u byte j / code byte j, signs
                  "and.b32 g, g, 0x80808080;", f"or.b32 h{half}, h{half}, g;"]  # fmt: skip
        lines += [f"prmt.b32 t{2 * half + i}, l{half}, h{half}, {sel};" for i, sel in enumerate(("0x5140", "0x7362"))]
    lines += [f"mul.rn.bf16x2 ${i}, t{i}, $5;" for i in range(4)]
    return "{\n.reg .b32 s<2>, h<2>, l<2>, t<4>, g, u;\n" + "\n".join(lines) + "\n}"


if not IMPORT_ERROR and not _INTERPRETED:
    from glm_pack.runtime.kernels.mxfp4_jit import mxfp4_even_round_trip

    @gluon.jit
    def _tile(t, pid, M, N, SPLITS, BM: gl.constexpr, BN: gl.constexpr):
        """(b, m0, n0) of this program's t-th tile: program = (column, split), SPLITS consecutive programs share a
        column and each walks a contiguous run of its M tiles."""
        tiles_m = gl.cdiv(M, BM)
        tiles_n = gl.cdiv(N, BN)
        col = pid // SPLITS
        m_tile = (pid % SPLITS) * gl.cdiv(tiles_m, SPLITS) + t
        return col // tiles_n, m_tile * BM, (col % tiles_n) * BN

    @gluon.jit
    def _load_step(x_desc, w_desc, x_bufs, w_bufs, ready, j, pid, M, N, SPLITS, K: gl.constexpr, BN: gl.constexpr,
                   STATIONARY: gl.constexpr):  # fmt: skip
        """Issue the TMA loads of flattened step j (tile j // KSTEPS, K step j % KSTEPS) into ring slot j % S."""
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        KSTEPS: gl.constexpr = K // BK
        b, m0, n0 = _tile(j // KSTEPS, pid, M, N, SPLITS, BM, BN)
        k = (j % KSTEPS) * BK
        s = j % x_bufs.type.shape[0]
        if STATIONARY:
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
        else:  # one barrier per stage for both tiles
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [b, n0, k], ready.index(s), w_bufs.index(s))
        tma.async_copy_global_to_shared(x_desc, [b, m0, k], ready.index(s), x_bufs.index(s))

    _E2M1_BF16_PTX = gl.constexpr(_e2m1_bf16_ptx())
    _ROUND_REGS = gl.constexpr(ROUND_REGS)

    @gluon.jit
    def _e2m1_dequant_ptx(codes, scales):
        """codes u8 ``[R, NG, G]`` (groups of G consecutive code bytes, G a multiple of 4, each group within one
        32-block) + the groups' E8M0 scales u8 ``[R, NG]`` -> bf16 ``[R, NG * 2G]``, the values of the Triton
        kernels' ``_e2m1_dequant`` (exact: E2M1 values are bf16 values, times a power of two in one bf16
        multiply that rounds only what leaves bf16's range, as the float32 route's final cast does), computed
        by :func:`_e2m1_bf16_ptx` per 4 code bytes; the codes' layout must keep each thread's 4-byte groups
        in its registers."""
        R: gl.constexpr = codes.shape[0]
        NG: gl.constexpr = codes.shape[1]
        G: gl.constexpr = codes.shape[2]
        sc = scales.to(gl.int32)
        bits = gl.where(sc == 0, 0x40, gl.where(sc == 255, 0x7FC0, sc << 7))  # bf16 2**(s - 127); 255 -> NaN
        scale = bits.to(gl.int16).to(gl.bfloat16, bitcast=True)[:, :, None]
        first, second = gl.inline_asm_elementwise(
            _E2M1_BF16_PTX, "=r,=r,=r,=r,r,r,r", [codes, scale], (gl.bfloat16, gl.bfloat16), is_pure=True, pack=4
        )  # per 4 bytes: first holds k 0-3 of their 8 values, second k 4-7
        pairs = gl.join(first.reshape([R, NG, G // 4, 4]), second.reshape([R, NG, G // 4, 4]))
        return pairs.permute((0, 1, 2, 4, 3)).reshape([R, NG * G * 2])

    @gluon.jit
    def _load_column(column, N, BN: gl.constexpr, BK: gl.constexpr, K: gl.constexpr, G: gl.constexpr,
                     DECODE_LAYOUT: gl.constexpr):  # fmt: skip
        """Issue the loads of weight rows ``n0 .. n0 + BN`` of batch b (``column`` = (c_ptr, s_ptr, stride_cb,
        stride_cn, stride_sb, stride_sn, b, n0)), K step by K step: E2M1 codes
        ``[B, N, K/2]`` as ``[BN, BK/2G, G]`` tiles (groups of G bytes, G <= 16 dividing 16) and E8M0 scales
        ``[B, N, K/32]`` as the groups' ``[BN, BK/2G]`` (both unit last stride; rows past N read code 0).
        Returns (codes, scales), tuples of K/BK register tiles in DECODE_LAYOUT (3-D, a thread holding whole
        groups); all loads are in flight together. The MMA warps call it themselves: values passed into a
        ``warp_specialize`` must be there when it starts, which would hold the rounding warps back until the loads
        land (on the H200 about 0.4-0.5 us at 64 rows)."""
        c_ptr, s_ptr, stride_cb, stride_cn, stride_sb, stride_sn, b, n0 = column
        rows_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, DECODE_LAYOUT))
        groups_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, DECODE_LAYOUT))
        bytes_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, DECODE_LAYOUT))
        rows = n0 + gl.arange(0, BN, layout=rows_l)
        groups = gl.arange(0, BK // (2 * G), layout=groups_l)
        byte = gl.arange(0, G, layout=bytes_l)
        r_in = (rows < N)[:, None]
        c_rows = c_ptr + b.to(gl.int64) * stride_cb + rows.to(gl.int64)[:, None, None] * stride_cn
        s_rows = s_ptr + b.to(gl.int64) * stride_sb + rows.to(gl.int64)[:, None] * stride_sn
        codes = ()
        scales = ()
        for kk in gl.static_range(K // BK):
            first = kk * (BK // 2) + groups * G  # each group's first code byte in the row
            codes = codes + (gl.load(c_rows + first[None, :, None] + byte[None, None, :],
                                     mask=r_in[:, :, None], other=0),)  # fmt: skip
            scales = scales + (gl.load(s_rows + (first // 16)[None, :], mask=r_in, other=127),)
        return codes, scales

    @gluon.jit
    def _decode_column(w_bufs, codes, scales, SWAP: gl.constexpr):
        """Decode a whole weight column (:func:`_load_column`'s codes and scales, one tile per K step) into the
        slots of ``w_bufs`` (``[KSTEPS, 1, BN, BK]`` bf16), with SWAP in :func:`_swap_k_order`, and make the
        stores visible to every MMA warp's (async-proxy) reads."""
        BN: gl.constexpr = w_bufs.type.shape[2]
        BK: gl.constexpr = w_bufs.type.shape[3]
        for kk in gl.static_range(len(codes)):
            w = _e2m1_dequant_ptx(codes[kk], scales[kk])
            if SWAP:
                w = _swap_k_order(w)
            w_bufs.index(kk).reshape([BN, BK]).store(w)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _swap_k_order(v):
        """``[R, BK]`` in k order -> the swap schedule's order: k = t * BK/4 + 2j + e (t < 4, e < 2) moves to
        8j + 2t + e. In the wgmma A-operand layout (bf16) lane t of each quad holds k 2t, 2t + 1 of every 8, so
        after this a thread's A registers hold one run of BK/4 consecutive k (whole 32-blocks, or one block's
        halves or quarters): the codes it decodes are contiguous bytes with one scale per 32-block."""
        R: gl.constexpr = v.shape[0]
        BK: gl.constexpr = v.shape[1]
        return v.reshape([R, 4, BK // 8, 2]).permute((0, 2, 1, 3)).reshape([R, BK])

    @gluon.jit
    def _round_in_place(xs, ROUND_LAYOUT: gl.constexpr, ROUND: gl.constexpr = True, SWAP: gl.constexpr = False):
        """Round the x tile ``xs`` (shared memory, ``[BM, BK]`` bf16) to MXFP4 in place (unless not ROUND),
        through registers in ``ROUND_LAYOUT``, with SWAP storing it in :func:`_swap_k_order`, and make the
        stores visible to the MMAs."""
        PAIRS: gl.constexpr = ROUND_LAYOUT.size_per_thread[1] // 2  # a thread's run of k, in pairs
        v = xs.load(ROUND_LAYOUT)
        if ROUND:
            v = mxfp4_even_round_trip(v, xs.shape[0], xs.shape[1], False, PAIRS)
        if SWAP:  # other threads' k: the compiler's barrier after the loads keeps the stores behind them
            v = _swap_k_order(v)
        xs.store(v)
        fence_async_shared()  # generic-proxy writes before the MMA's (async-proxy) reads

    @gluon.jit
    def _store_y_part(v, y_desc, y_buf, y_plain, b, m0, n0, PLAIN: gl.constexpr):
        """Write bf16 ``v`` ``[BM, YN]`` (the shape of ``y_buf``) to y at ``(b, m0, n0)``: through ``y_buf`` by
        TMA (PLAIN 0; the caller waits for the store before its program ends), or by plain stores
        (:func:`plain_y`), masked to y's ``M`` rows and ``N`` columns (``y_plain`` = (y_ptr, stride_yb, stride_ym,
        M, N); unit column stride): with PLAIN 8, ``v`` moved to a layout of 16 bytes of a row a thread (through
        shared memory the compiler allocates); with PLAIN 1 (y off 16 bytes), ``v`` stored in ``y_buf`` and read
        back CH rows at a time, 8 values a thread (16 at 64 x 256), a warp's lanes along a row, so that each store
        writes 64 contiguous bytes, the addresses one tile pointer plus 32-bit offsets (as one layout change with a
        pointer a value, the 128 x 256 tiles spilled 112-152 bytes of registers; with 64-bit offsets, 16; as it is,
        ``xreg`` at 64 x 256 spills 64)."""
        BM: gl.constexpr = v.shape[0]
        YN: gl.constexpr = v.shape[1]
        y_ptr, stride_yb, stride_ym, M, N = y_plain
        if PLAIN == 1:
            ALONG_N: gl.constexpr = min(32, YN)
            ONE: gl.constexpr = gl.BlockedLayout([1, 1], [32 // ALONG_N, ALONG_N], [gl.num_warps(), 1], [1, 0])
            CH: gl.constexpr = min(BM, max(8, 8 * 32 * gl.num_warps() // YN))  # whole 8-row swizzle periods
            yb = y_buf.reshape([BM, YN])
            gl.thread_barrier()  # every thread has read the previous part out of y_buf
            yb.store(v)
            gl.thread_barrier()
            rows = gl.arange(0, CH, layout=gl.SliceLayout(1, ONE))
            cols = n0 + gl.arange(0, YN, layout=gl.SliceLayout(0, ONE))
            offsets = rows[:, None] * stride_ym + cols[None, :]  # 32-bit: tensors_reason bounds stride_ym
            in_n = (cols < N)[None, :]
            tile = y_ptr + b.to(gl.int64) * stride_yb + m0.to(gl.int64) * stride_ym
            for r in gl.static_range(0, BM, CH):
                part = yb.slice(r, CH).load(ONE)
                gl.store(tile + r * stride_ym + offsets, part, mask=(rows < M - m0 - r)[:, None] & in_n)
        elif PLAIN:
            ALONG_N: gl.constexpr = min(32, YN // 8)
            ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [32 // ALONG_N, ALONG_N], [gl.num_warps(), 1], [1, 0])
            rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ROWS))
            cols = n0 + gl.arange(0, YN, layout=gl.SliceLayout(0, ROWS))
            ptrs = y_ptr + b.to(gl.int64) * stride_yb + rows.to(gl.int64)[:, None] * stride_ym + cols[None, :]
            gl.store(ptrs, gl.convert_layout(v, ROWS), mask=(rows < M)[:, None] & (cols < N)[None, :])
        else:
            tma.store_wait(0)  # the previous store has read y_buf
            y_buf.reshape([BM, YN]).store(v)
            fence_async_shared()
            tma.async_copy_shared_to_global(y_desc, [b, m0, n0], y_buf)

    @gluon.jit
    def _store_y(acc, y_desc, y_buf, y_plain, b, m0, n0, PLAIN_Y: gl.constexpr):
        """Write a finished ``[BM, BN]`` accumulator tile as bf16 y through ``y_buf`` (whole or in two halves),
        by TMA or with PLAIN_Y by plain stores (:func:`_store_y_part`, :func:`plain_y`)."""
        BM: gl.constexpr = acc.shape[0]
        BN: gl.constexpr = acc.shape[1]
        YN: gl.constexpr = y_buf.type.shape[2]
        if YN == BN:
            _store_y_part(acc.to(gl.bfloat16), y_desc, y_buf, y_plain, b, m0, n0, PLAIN_Y)
        else:
            y0, y1 = acc.to(gl.bfloat16).reshape([BM, 2, YN]).permute((0, 2, 1)).split()
            _store_y_part(y0, y_desc, y_buf, y_plain, b, m0, n0, PLAIN_Y)
            _store_y_part(y1, y_desc, y_buf, y_plain, b, m0, n0 + YN, PLAIN_Y)

    @gluon.jit
    def _step(i, acc, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_buf, ready, rounded, steps, pid, M, N, SPLITS,
              K: gl.constexpr, BN: gl.constexpr, ACT_MXFP4: gl.constexpr, STATIONARY: gl.constexpr,
              WS: gl.constexpr, ROUND_LAYOUT: gl.constexpr, y_plain, PLAIN_Y: gl.constexpr):  # fmt: skip
        """Flattened step i: wait for the x tile (rounded by the worker warps with WS, else rounded here, in
        place), issue its MMAs, refill the ring slot freed by step i - 1, and after a tile's last K step write its
        y. Returns the accumulator."""
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        KSTEPS: gl.constexpr = K // BK
        xs = x_bufs.index(i % STAGES).reshape([BM, BK])
        if WS:
            mbarrier.wait(rounded.index(i % STAGES), (i // STAGES) & 1)
        else:
            mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
            if ACT_MXFP4:
                _round_in_place(xs, ROUND_LAYOUT)
        if STATIONARY:
            ws = w_bufs.index(i % KSTEPS).reshape([BN, BK])
        else:
            ws = w_bufs.index(i % STAGES).reshape([BN, BK])
        acc = warpgroup_mma(xs, ws.permute((1, 0)), acc, use_acc=(i % KSTEPS) != 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if i > 0 and i + STAGES - 1 < steps:  # into the slot of step i - 1, whose MMAs are done (step 0: prologue)
            _load_step(x_desc, w_desc, x_bufs, w_bufs, ready, i + STAGES - 1, pid, M, N, SPLITS, K, BN, STATIONARY)
        if i % KSTEPS == KSTEPS - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            b, m0, n0 = _tile(i // KSTEPS, pid, M, N, SPLITS, BM, BN)
            _store_y(acc, y_desc, y_buf, y_plain, b, m0, n0, PLAIN_Y)
        return acc

    @gluon.jit
    def _mma_loop(acc, column, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_buf, ready, rounded, w_ready,
                  steps, pid, M, N, SPLITS, K: gl.constexpr, BN: gl.constexpr, ACT_MXFP4: gl.constexpr,
                  STATIONARY: gl.constexpr, DECODE: gl.constexpr, DECODE_FIRST: gl.constexpr, WS: gl.constexpr,
                  ROUND_LAYOUT: gl.constexpr, DECODE_LAYOUT: gl.constexpr, y_plain, PLAIN_Y: gl.constexpr):  # fmt: skip
        """The program's steps, on the MMA warps. With DECODE the weight column (:func:`_load_column`) is decoded
        into shared memory: with DECODE_FIRST all of it before the first MMA, else K step by K step during the
        first tile, each step's slot just before its MMAs, overlapping those of the step before."""
        BK: gl.constexpr = x_desc.block_type.shape[2]
        KSTEPS: gl.constexpr = K // BK
        codes = 0  # placeholders without DECODE
        scales = 0
        if DECODE:
            codes, scales = _load_column(column, N, BN, BK, K, 16, DECODE_LAYOUT)
        first = 0
        if DECODE and DECODE_FIRST:
            _decode_column(w_bufs, codes, scales, False)
        elif DECODE:
            if steps > 0:
                for kk in gl.static_range(KSTEPS):
                    w_bufs.index(kk).reshape([BN, BK]).store(_e2m1_dequant_ptx(codes[kk], scales[kk]))
                    fence_async_shared()
                    acc = _step(kk, acc, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_buf, ready, rounded, steps, pid,
                                M, N, SPLITS, K, BN, ACT_MXFP4, STATIONARY, WS, ROUND_LAYOUT, y_plain,
                                PLAIN_Y)  # fmt: skip
                first = KSTEPS
        if STATIONARY and not DECODE:
            mbarrier.wait(w_ready.index(0), 0)  # also keeps a program without tiles alive until its loads land
        for i in range(first, steps):
            acc = _step(i, acc, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_buf, ready, rounded, steps, pid, M, N,
                        SPLITS, K, BN, ACT_MXFP4, STATIONARY, WS, ROUND_LAYOUT, y_plain, PLAIN_Y)  # fmt: skip
        tma.store_wait(0)

    @gluon.jit
    def _x_operand(x_desc, x_bufs, ready, i, steps, pid, M, N, SPLITS, K: gl.constexpr, BN: gl.constexpr,
                   X_LAYOUT: gl.constexpr, A_LAYOUT: gl.constexpr, ACT_MXFP4: gl.constexpr,
                   PAIRS: gl.constexpr):  # fmt: skip
        """Flattened step i's x tile as the wgmma A operand: wait for its TMA load, load it into registers in
        X_LAYOUT (:func:`xreg_x_layout`), round it to MXFP4 there (with ACT_MXFP4; PAIRS k pairs per PTX
        invocation) and put it in :func:`_swap_k_order`, which A_LAYOUT holds by renaming registers; then, every
        warp having read the slot, refill it with step i + STAGES."""
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        BM: gl.constexpr = x_bufs.type.shape[2]
        BK: gl.constexpr = x_bufs.type.shape[3]
        mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
        v = x_bufs.index(i % STAGES).reshape([BM, BK]).load(X_LAYOUT)
        if ACT_MXFP4:
            v = mxfp4_even_round_trip(v, BM, BK, False, PAIRS)
        a = gl.convert_layout(_swap_k_order(v), A_LAYOUT)
        gl.thread_barrier()  # every warp has read slot i
        if i + STAGES < steps:
            _load_step(x_desc, None, x_bufs, None, ready, i + STAGES, pid, M, N, SPLITS, K, BN, True)
        return a

    @gluon.jit
    def _xreg_loop(acc, column, x_desc, y_desc, x_bufs, w_bufs, y_buf, ready, steps, pid, M, N, SPLITS,
                   K: gl.constexpr, BN: gl.constexpr, ACT_MXFP4: gl.constexpr, X_LAYOUT: gl.constexpr,
                   DECODE_LAYOUT: gl.constexpr, PAIRS: gl.constexpr, y_plain, PLAIN_Y: gl.constexpr):  # fmt: skip
        """The ``xreg`` schedule's steps (no worker warps): decode the weight column into shared memory with K in
        :func:`_swap_k_order`, then per step take x from its slot into A registers (:func:`_x_operand`: rounded
        there, never stored back), refill the slot as soon as every warp has read it, and multiply; step i + 1's
        x is loaded and rounded while step i's MMAs run (the wait's ``deps`` keep step i's A registers alive)."""
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        KSTEPS: gl.constexpr = K // BK
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
        codes, scales = _load_column(column, N, BN, BK, K, 16, DECODE_LAYOUT)
        _decode_column(w_bufs, codes, scales, True)
        if steps > 0:
            a = _x_operand(x_desc, x_bufs, ready, 0, steps, pid, M, N, SPLITS, K, BN, X_LAYOUT, A_LAYOUT, ACT_MXFP4,
                           PAIRS)  # fmt: skip
            for i in range(steps):
                ws = w_bufs.index(i % KSTEPS).reshape([BN, BK])
                acc = warpgroup_mma(a, ws.permute((1, 0)), acc, use_acc=(i % KSTEPS) != 0, is_async=True)
                a_next = a
                if i + 1 < steps:
                    a_next = _x_operand(x_desc, x_bufs, ready, i + 1, steps, pid, M, N, SPLITS, K, BN, X_LAYOUT,
                                        A_LAYOUT, ACT_MXFP4, PAIRS)  # fmt: skip
                acc, a = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a))
                if i % KSTEPS == KSTEPS - 1:
                    b, m0, n0 = _tile(i // KSTEPS, pid, M, N, SPLITS, BM, BN)
                    _store_y(acc, y_desc, y_buf, y_plain, b, m0, n0, PLAIN_Y)
                a = a_next
        tma.store_wait(0)

    @gluon.jit
    def _round_loop(x_bufs, ready, rounded, steps, ROUND_LAYOUT: gl.constexpr, ROUND: gl.constexpr = True,
                    SWAP: gl.constexpr = False, PART: gl.constexpr = 0, PARTS: gl.constexpr = 1):  # fmt: skip
        """The worker warps' steps (WS): round each x tile to MXFP4 in place (:func:`_round_in_place`) once its
        TMA load lands, then signal the MMA warps; with PARTS partitions of workers, this one (PART) takes steps
        PART, PART + PARTS, ..."""
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        BM: gl.constexpr = x_bufs.type.shape[2]
        BK: gl.constexpr = x_bufs.type.shape[3]
        for i in range(PART, steps, PARTS):
            mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
            _round_in_place(x_bufs.index(i % STAGES).reshape([BM, BK]), ROUND_LAYOUT, ROUND, SWAP)
            gl.thread_barrier()  # every worker thread's stores, before one thread arrives
            mbarrier.arrive(rounded.index(i % STAGES), count=1)

    @gluon.jit
    def _bmm_kernel(x_desc, w_desc, y_desc, c_ptr, s_ptr, stride_cb, stride_cn, stride_sb, stride_sn,
                    M, N, SPLITS, y_ptr, stride_yb, stride_ym, K: gl.constexpr, BN: gl.constexpr,
                    W_LAYOUT: gl.constexpr, YN: gl.constexpr, Y_LAYOUT: gl.constexpr, ACT_MXFP4: gl.constexpr,
                    STATIONARY: gl.constexpr, DECODE: gl.constexpr, WS: gl.constexpr,
                    ROUND_LAYOUT: gl.constexpr, DECODE_LAYOUT: gl.constexpr, DECODE_FIRST: gl.constexpr,
                    STAGES: gl.constexpr, WORKERS: gl.constexpr, XREG: gl.constexpr, PAIRS: gl.constexpr,
                    PARTS: gl.constexpr, PLAIN_Y: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        """Grid ``(columns * SPLITS,)``; descriptors over x ``[B, M, K]`` (block ``[1, BM, BK]``), y ``[B, M, N]``
        (``[1, BM, YN]``, YN = :func:`y_columns`; its buffer in Y_LAYOUT; with PLAIN_Y y goes by pointer and strides
        instead, unit last, PLAIN_Y values a thread at once, :func:`plain_y`) and, unless DECODE, bf16 w ``[B, N,
        K]`` (``[1, BN, BK]``); with DECODE (stationary only) the weights come from codes ``c_ptr`` / scales
        ``s_ptr`` instead. WS: the x tiles are rounded by WORKERS more warps (``ROUND_LAYOUT`` over those; PARTS
        partitions of them taking alternate steps, :func:`round_partitions`), else by the MMA warps; XREG (with
        DECODE): the ``xreg`` schedule, ``ROUND_LAYOUT`` its x register layout and PAIRS its rounding's k pairs."""
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        KSTEPS: gl.constexpr = K // BK
        W_SLOTS: gl.constexpr = KSTEPS if STATIONARY else STAGES
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.bfloat16, [W_SLOTS, 1, BN, BK], W_LAYOUT)
        y_buf = gl.allocate_shared_memory(gl.bfloat16, [1, BM, YN], Y_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        rounded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())  # the stationary column
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(rounded.index(st), count=1)
        mbarrier.init(w_ready.index(0), count=1)
        pid = gl.program_id(0)
        tiles_m = gl.cdiv(M, BM)
        per = gl.cdiv(tiles_m, SPLITS)
        n_tiles = gl.maximum(gl.minimum(per, tiles_m - (pid % SPLITS) * per), 0)
        steps = n_tiles * KSTEPS
        for j in gl.static_range(STAGES):  # every slot: step STAGES - 1 needs no MMA to finish first
            if j < steps:
                _load_step(x_desc, w_desc, x_bufs, w_bufs, ready, j, pid, M, N, SPLITS, K, BN, STATIONARY)
        WARPS_M: gl.constexpr = BM // 16  # one warpgroup per 64 rows; the others split N
        WARPS_N: gl.constexpr = num_warps // WARPS_M
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, BN // WARPS_N, 16]
        )
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        b, m0, n0 = _tile(0, pid, M, N, SPLITS, BM, BN)
        column = (c_ptr, s_ptr, stride_cb, stride_cn, stride_sb, stride_sn, b, n0)  # with DECODE
        y_plain = (y_ptr, stride_yb, stride_ym, M, N)  # with PLAIN_Y
        if STATIONARY and not DECODE:
            mbarrier.expect(w_ready.index(0), KSTEPS * w_desc.block_type.nbytes)
            for kk in gl.static_range(KSTEPS):
                tma.async_copy_global_to_shared(w_desc, [b, n0, kk * BK], w_ready.index(0), w_bufs.index(kk))
        if XREG:
            _xreg_loop(acc, column, x_desc, y_desc, x_bufs, w_bufs, y_buf, ready, steps, pid, M, N, SPLITS, K, BN,
                       ACT_MXFP4, ROUND_LAYOUT, DECODE_LAYOUT, PAIRS, y_plain, PLAIN_Y)  # fmt: skip
        elif WS and PARTS == 2:
            gl.warp_specialize([
                (_mma_loop, (acc, column, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_buf, ready, rounded, w_ready,
                             steps, pid, M, N, SPLITS, K, BN, ACT_MXFP4, STATIONARY, DECODE, DECODE_FIRST, WS,
                             ROUND_LAYOUT, DECODE_LAYOUT, y_plain, PLAIN_Y)),
                (_round_loop, (x_bufs, ready, rounded, steps, ROUND_LAYOUT, True, False, 0, 2)),
                (_round_loop, (x_bufs, ready, rounded, steps, ROUND_LAYOUT, True, False, 1, 2)),
            ], [WORKERS, WORKERS], [_ROUND_REGS, _ROUND_REGS])  # fmt: skip
        elif WS:
            gl.warp_specialize([
                (_mma_loop, (acc, column, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_buf, ready, rounded, w_ready,
                             steps, pid, M, N, SPLITS, K, BN, ACT_MXFP4, STATIONARY, DECODE, DECODE_FIRST, WS,
                             ROUND_LAYOUT, DECODE_LAYOUT, y_plain, PLAIN_Y)),
                (_round_loop, (x_bufs, ready, rounded, steps, ROUND_LAYOUT)),
            ], [WORKERS], [_ROUND_REGS])  # fmt: skip
        else:
            _mma_loop(acc, column, x_desc, w_desc, y_desc, x_bufs, w_bufs, y_buf, ready, rounded, w_ready, steps,
                      pid, M, N, SPLITS, K, BN, ACT_MXFP4, STATIONARY, DECODE, DECODE_FIRST, WS, ROUND_LAYOUT,
                      DECODE_LAYOUT, y_plain, PLAIN_Y)  # fmt: skip

    @gluon.jit
    def _reading(t, others):
        """``t`` unchanged (``prmt`` with selector 0x3210 gives its first operand's bytes) through PTX that also
        reads every tensor of ``others`` (each like ``t``: a u8 tile with runs of 4 bytes a thread), so whatever
        uses the result waits for their loads and ptxas issues those first."""
        for i in gl.static_range(len(others)):
            t = gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x3210;", "=r,r,r", [t, others[i]], dtype=t.dtype,
                                          is_pure=True, pack=4)  # fmt: skip
        return t

    @gluon.jit
    def _swap_mma_loop(column, pid, M, N, x_desc, y_desc, y_plain, x_bufs, y_buf, ready, rounded, m0,
                       K: gl.constexpr, CODE_LAYOUT: gl.constexpr, A_LAYOUT: gl.constexpr, MMA_LAYOUT: gl.constexpr,
                       ROUND_LAYOUT: gl.constexpr, ACT_MXFP4: gl.constexpr, ROUND_HERE: gl.constexpr,
                       CODES_FIRST: gl.constexpr, PLAIN_Y: gl.constexpr):  # fmt: skip
        """The swap schedule's MMA warps: load the column's codes (:func:`_load_column`; with CODES_FIRST step 0's
        through :func:`_reading` every later step's, :func:`swap_codes_first`), per K step decode them straight
        into wgmma A registers, wait for the reordered x tile (with ROUND_HERE: wait for its load, then round and
        reorder it themselves, :func:`_round_in_place` in ROUND_LAYOUT), ``acc[BN, BM] += w . x^T``, refill the
        slot just read; then y = acc^T (:func:`_store_y_part`: by TMA, or with PLAIN_Y by plain stores)."""
        STAGES: gl.constexpr = x_bufs.type.shape[0]
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        BN: gl.constexpr = y_buf.type.shape[2]
        _, _, _, _, _, _, b, n0 = column
        codes, scales = _load_column(column, N, BN, BK, K, CODE_LAYOUT.shape[2], CODE_LAYOUT)
        if CODES_FIRST:
            codes = (_reading(codes[0], codes[1:]),) + codes[1:]
        acc = gl.zeros([BN, BM], gl.float32, MMA_LAYOUT)
        for kk in gl.static_range(K // BK):
            a = gl.convert_layout(_swap_k_order(_e2m1_dequant_ptx(codes[kk], scales[kk])), A_LAYOUT)  # registers only
            xs = x_bufs.index(kk % STAGES).reshape([BM, BK])
            if ROUND_HERE:
                mbarrier.wait(ready.index(kk % STAGES), (kk // STAGES) & 1)
                _round_in_place(xs, ROUND_LAYOUT, ACT_MXFP4, True)
                gl.thread_barrier()  # every warp's stores, before the MMA reads the tile
            else:
                mbarrier.wait(rounded.index(kk % STAGES), (kk // STAGES) & 1)
            acc = warpgroup_mma(a, xs.permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if kk + STAGES < K // BK:  # a split per M tile: flattened step kk + STAGES is this tile's
                _load_step(x_desc, None, x_bufs, None, ready, kk + STAGES, pid, M, N, gl.cdiv(M, BM), K, BN, True)
        _store_y_part(acc.to(gl.bfloat16).permute((1, 0)), y_desc, y_buf, y_plain, b, m0, n0, PLAIN_Y)
        tma.store_wait(0)

    @gluon.jit
    def _swap_kernel(x_desc, y_desc, c_ptr, s_ptr, stride_cb, stride_cn, stride_sb, stride_sn, M, N, y_ptr,
                     stride_yb, stride_ym, K: gl.constexpr, Y_LAYOUT: gl.constexpr, ACT_MXFP4: gl.constexpr,
                     ROUND_LAYOUT: gl.constexpr, CODE_LAYOUT: gl.constexpr, STAGES: gl.constexpr,
                     WORKERS: gl.constexpr, WS: gl.constexpr, CODES_FIRST: gl.constexpr, PLAIN_Y: gl.constexpr,
                     num_warps: gl.constexpr):  # fmt: skip
        """The swap schedule. Grid ``(B * tiles_n * tiles_m,)``, one ``[BM, BN]`` y tile a program; descriptors
        over x ``[B, M, K]`` (block ``[1, BM, BK]``) and y ``[B, M, N]`` (``[1, BM, BN]``, its buffer in Y_LAYOUT;
        with PLAIN_Y y goes by pointer and strides instead, unit last); codes / scales as for ``decode``, in
        CODE_LAYOUT (:func:`swap_code_layout`). With WS the WORKERS worker warps round each x tile (with
        ACT_MXFP4) and store it in :func:`_swap_k_order` while the num_warps MMA warps (BN / 16) decode and
        multiply; without, the MMA warps do both (:func:`swap_workers`). CODES_FIRST: see
        :func:`swap_codes_first`."""
        BM: gl.constexpr = x_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[2]
        BN: gl.constexpr = 16 * num_warps
        KSTEPS: gl.constexpr = K // BK
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        y_buf = gl.allocate_shared_memory(gl.bfloat16, [1, BM, BN], Y_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        rounded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
            mbarrier.init(rounded.index(st), count=1)
        pid = gl.program_id(0)
        b, m0, n0 = _tile(0, pid, M, N, gl.cdiv(M, BM), BM, BN)  # a split per M tile: one tile each
        for j in gl.static_range(STAGES):  # STAGES <= KSTEPS
            _load_step(x_desc, None, x_bufs, None, ready, j, pid, M, N, gl.cdiv(M, BM), K, BN, True)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        column = (c_ptr, s_ptr, stride_cb, stride_cn, stride_sb, stride_sn, b, n0)
        y_plain = (y_ptr, stride_yb, stride_ym, M, N)
        if WS:
            gl.warp_specialize([
                (_swap_mma_loop, (column, pid, M, N, x_desc, y_desc, y_plain, x_bufs, y_buf, ready, rounded, m0,
                                  K, CODE_LAYOUT, a_layout, mma_layout, ROUND_LAYOUT, ACT_MXFP4, False, CODES_FIRST,
                                  PLAIN_Y)),
                (_round_loop, (x_bufs, ready, rounded, KSTEPS, ROUND_LAYOUT, ACT_MXFP4, True)),
            ], [WORKERS], [_ROUND_REGS])  # fmt: skip
        else:
            _swap_mma_loop(column, pid, M, N, x_desc, y_desc, y_plain, x_bufs, y_buf, ready, rounded, m0, K,
                           CODE_LAYOUT, a_layout, mma_layout, ROUND_LAYOUT, ACT_MXFP4, True, CODES_FIRST,
                           PLAIN_Y)  # fmt: skip


SCHEDULES = ("stationary", "streaming", "decode", "swap", "xreg")
FROM_CODES = ("decode", "swap", "xreg")  # the schedules that read E2M1 codes and scales, not predecoded bf16 weights


@dataclass(frozen=True)
class Plan:
    """A launch: tile sizes, warps, schedule (one of :data:`SCHEDULES`), x-ring stages (shared memory
    permitting) and whether ``round_warps`` (4 or 8) more warps round mxfp4 activations (``ws``; ``swap``
    always has them: they also reorder x's K, except in the launches :func:`swap_workers` excludes; ``xreg``
    never: its MMA warps round)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    schedule: str
    stages: int
    ws: bool = False
    round_warps: int = ROUND_WARPS


@functools.cache
def _device_reason(device: torch.device) -> str:
    if torch.version.hip is not None:
        return "wgmma kernels are NVIDIA-only (AMD GPU)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"wgmma needs compute capability 9.x (sm_90), this GPU is {major}.{minor}"
    return ""


@functools.cache
def smem_limit(device: torch.device) -> int:
    """Shared memory one program may opt into on this GPU (bytes)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def y_columns(block_m: int, block_n: int) -> int:
    """Columns of the y buffer: at 128 rows the tile leaves in two halves through one buffer (room for x
    stages); below, whole, in at most 32 KiB (with 8 warps each warpgroup holds a different half of N,
    so the accumulator cannot be split in registers)."""
    return block_n // 2 if block_m == 128 else block_n


def smem_bytes(block_m: int, block_n: int, block_k: int, K: int, schedule: str, stages: int) -> int:
    """Shared memory of a launch (bytes): x ring, w (whole column, or a ring; none for ``swap``, whose weights
    stay in registers), the y buffer."""
    x_stage, w_stage = block_m * block_k * 2, block_n * block_k * 2
    w = {"swap": 0, "streaming": stages * w_stage}.get(schedule, (K // block_k) * w_stage)
    return stages * x_stage + w + block_m * y_columns(block_m, block_n) * 2 + _SMEM_SLACK


def tile_error(block_m: int, block_n: int, block_k: int, num_warps: int, schedule: str) -> str:
    """Why these tiles break the kernel's shape rules ("" when they do not): 4 or 8 warps, ``block_m`` 64 or
    128 rows with at least ``block_m / 16`` warps (one or two warpgroups along M, the others along N),
    ``block_n`` a multiple of 32 up to 256, ``block_k`` 32 to 256; ``decode`` and ``xreg`` also need a 32-block
    of weights per thread: ``block_n >= 32 / (block_k / 32) * num_warps``; ``xreg`` one warpgroup per 64 rows
    (``block_m = 16 * num_warps``, no warps along N: each would round the same x) and ``block_k`` <= 128 (a
    thread's run of ``block_k / 4`` k within one 32-block or whole ones). ``swap`` (weights as the MMA's M):
    ``block_n`` = 16 rows per warp (one, two or four warpgroups), ``block_m`` 16, 32 or 64 rows of x,
    ``block_k`` a power of two from 32 to 256."""
    if schedule not in SCHEDULES:
        return f"schedule {schedule!r}: needs one of {SCHEDULES}"
    if schedule == "swap":
        if num_warps not in (4, 8, 16) or block_n != 16 * num_warps:
            return f"block_n={block_n} with num_warps={num_warps}: swap needs 4, 8 or 16 warps, block_n = 16 * warps"
        if block_m not in (16, 32, 64):
            return f"block_m={block_m}: swap needs 16, 32 or 64"
        if block_k not in (32, 64, 128, 256):
            return f"block_k={block_k}: swap needs a power of two from 32 to 256"
        return ""
    if schedule == "xreg" and (block_m != 16 * num_warps or block_k > 128):
        return f"block_m={block_m}, block_k={block_k} on {num_warps} warps: xreg needs 16 * warps rows, block_k <= 128"
    if num_warps not in (4, 8) or block_m not in (64, 128) or block_m > 16 * num_warps:
        return f"block_m={block_m} with num_warps={num_warps}: needs 4 or 8 warps, block_m 64 or 128 <= 16 * num_warps"
    if block_n % 32 or not 32 <= block_n <= 256:
        return f"block_n={block_n}: needs a multiple of 32 up to 256"
    if not 32 <= block_k <= 256:
        return f"block_k={block_k}: needs 32 to 256"
    if schedule in ("decode", "xreg") and block_n < 32 // (block_k // 32) * num_warps:
        return f"block_n={block_n}: {schedule} needs >= {32 // (block_k // 32) * num_warps} rows with these warps"
    return ""


def plan(block_m: int, block_n: int, block_k: int, num_warps: int, schedule: str, K: int, smem: int,
         max_stages: int = MAX_STAGES, ws: bool = False, round_warps: int = ROUND_WARPS) -> Plan | None:  # fmt: skip
    """The launch for tiles that pass :func:`tile_error` (``block_k`` dividing K) with the most x stages
    (<= ``max_stages``, >= 2; ``swap``, one tile a program: up to one per K step, >= 1) fitting ``smem`` bytes;
    None when none fits. ``ws``: round mxfp4 activations in ``round_warps`` more warps (warp specialisation;
    always for ``swap``, whose launches may still go without, :func:`swap_workers`)."""
    swap = schedule == "swap"
    for stages in range(min(max_stages, K // block_k) if swap else max_stages, 0 if swap else 1, -1):
        if smem_bytes(block_m, block_n, block_k, K, schedule, stages) <= smem:
            return Plan(block_m, block_n, block_k, num_warps, schedule, stages, (ws or swap) and schedule != "xreg",
                        round_warps)  # fmt: skip
    return None


def tensors_reason(x: torch.Tensor, out: torch.Tensor, *weights: torch.Tensor) -> str:
    """Why these tensors' layout keeps this kernel off ("" when it does not): x must be a TMA source (unit last
    stride, 16-byte-aligned base and other strides); out needs a unit last stride (where it is no TMA target, y
    leaves by plain stores, :func:`prepare`, whose 32-bit offsets span 128 rows); ``weights`` (codes and scales,
    for ``decode``) a unit last stride."""
    if not tma_strides_ok(x):
        return f"x strides {x.stride()} are not TMA-compatible (unit last, 16-byte aligned others and base)"
    if not tma_strides_ok(out) and out.stride(1) * 128 >= 2**31:
        return f"out strides {out.stride()}: off 16 bytes, its rows must be under 2**24 values apart (32-bit offsets)"
    for name, t in (("out", out), *(("weight", w) for w in weights)):
        if t.stride(-1) != 1:
            return f"{name} strides {t.stride()}: the kernel needs a unit last stride"
    return ""


def unusable_reason(x: torch.Tensor, out: torch.Tensor, *weights: torch.Tensor) -> str:
    """Why this kernel cannot serve these tensors ("" when it can): Gluon importable, compiled kernels, an
    sm_90 NVIDIA GPU, and the tensors' layout (:func:`tensors_reason`)."""
    if IMPORT_ERROR:
        return IMPORT_ERROR
    if _INTERPRETED:
        return "Gluon kernels do not run in Triton's interpreter"
    if x.device.type != "cuda":
        return f"tensors on {x.device}"
    return _device_reason(x.device) or tensors_reason(x, out, *weights)


@functools.cache
def _smem_layout(block: tuple[int, ...]):
    """The swizzled shared-memory layout of a bf16 TMA block (cached: it is on every call's path)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


@functools.cache
def _register_layouts(block_m: int, block_n: int, block_k: int, num_warps: int, round_warps: int):
    """(rounding, decode) register layouts: x ``[block_m, block_k]`` over ``round_warps`` warps with whole
    32-blocks in a thread where there is one per thread (else halves, quarters...), and codes
    ``[block_n, block_k / 32, 16]`` over ``num_warps`` warps with one 16-byte block per thread. In both a warp's
    lanes run along rows first: 8 consecutive lanes hold 8 rows at the same K, so each quarter-warp's 16-byte
    shared-memory accesses fall in 8 different bank groups of the 128-byte swizzle (K first put 2 lanes of a
    quarter-warp on one bank group once a tile row spans two 64-column swizzle blocks, ``block_k`` >= 128)."""
    per_thread = min(32, block_m * block_k // (32 * round_warps))
    along_k = block_k // per_thread
    rounding = gl.BlockedLayout([1, per_thread], [32 // along_k, along_k], [round_warps, 1], [0, 1])
    blocks = block_k // 32
    decode = gl.BlockedLayout([1, 1, 16], [32 // blocks, blocks, 1], [num_warps, 1, 1], [2, 0, 1])
    return rounding, decode


def prepare(x: torch.Tensor, out: torch.Tensor, act_mxfp4: bool, p: Plan, w: torch.Tensor,
            w_scales: torch.Tensor | None = None) -> Callable:  # fmt: skip
    """The launch of ``out[b] = act(x[b]) @ w[b]^T`` for tensors like these (shapes, strides, alignment, device):
    a function of ``(x, w, w_scales, out)``, with ``w`` the E2M1 codes ``[B, N, K/2]`` and ``w_scales`` their
    E8M0 scales ``[B, N, K/32]`` for ``decode``, else bf16 ``[B, N, K]`` (``w_scales`` unused). Each call makes
    the tensor descriptors and launches; grid, constants and the compiled kernel are worked out here, once. The
    caller checked :func:`unusable_reason` and made ``p`` with :func:`plan`."""
    B, M, K = x.shape
    N = w.shape[1]
    bm, bn, bk = p.block_m, p.block_n, p.block_k
    decode = p.schedule in FROM_CODES
    yn = y_columns(bm, bn)
    blocks = {"x": ([1, bm, bk], _smem_layout((1, bm, bk))), "y": ([1, bm, yn], _smem_layout((1, bm, yn))),
              "w": ([1, bn, bk], _smem_layout((1, bn, bk)))}  # fmt: skip
    columns, sms = B * triton.cdiv(N, bn), sm_count(x.device)
    # swap: a program per tile; else each column's M tiles split over the SMs
    splits = triton.cdiv(M, bm) if p.schedule == "swap" else max(1, min(triton.cdiv(M, bm), sms // columns))
    if p.schedule == "swap":
        p = replace(p, ws=swap_workers(K // bk, act_mxfp4, columns * splits, sms) and p.ws,
                    round_warps=swap_round_warps(p.round_warps, columns * splits, sms))  # fmt: skip
    per_sm = programs_per_sm(p, K, columns * splits, sms, smem_limit(x.device))
    plain = plain_y(triton.cdiv(triton.cdiv(M, bm), splits), bm, columns * splits, sms, tma_strides_ok(out))
    constants = kernel_constants(p, K, act_mxfp4, per_sm, plain)
    ints = (*w.stride()[:2], *(w_scales if decode else w).stride()[:2], M, N)

    def descriptor(t: torch.Tensor, which: str):
        return _CheckedDescriptor(t, t.shape, t.stride(), *blocks[which])

    def y_desc(out):  # none where y leaves by plain stores: the kernel takes its pointer and strides
        return None if plain else descriptor(out, "y")

    if p.schedule == "swap":
        kernel = KernelLaunch(_swap_kernel, (columns * splits,), constants)

        def launch(x, w, w_scales, out):
            kernel(descriptor(x, "x"), y_desc(out), w, w_scales, *ints, out, *out.stride()[:2])

        return launch
    kernel = KernelLaunch(_bmm_kernel, (columns * splits,), constants)
    ints = (*ints, splits)
    if decode:

        def launch(x, w, w_scales, out):
            kernel(descriptor(x, "x"), None, y_desc(out), w, w_scales, *ints, out, *out.stride()[:2])

    else:

        def launch(x, w, w_scales, out):
            kernel(descriptor(x, "x"), descriptor(w, "w"), y_desc(out), w, w, *ints, out, *out.stride()[:2])

    return launch


def register_cap(warps: int, programs_per_sm: int) -> int:
    """Registers per thread (``maxnreg``) of a program of ``warps`` warps, rounding warps included, when
    ``programs_per_sm`` such programs share a multiprocessor's 65536 (a multiple of 8, at most 255)."""
    return min(255, 65536 // (32 * warps * programs_per_sm) // 8 * 8)


def register_error(block_m: int, block_n: int, num_warps: int, round_warps: int, programs_per_sm: int = 1) -> str:
    """Why a program of these tiles with ``round_warps`` rounding warps would not compile ("" when it would):
    under the cap of :func:`register_cap` an MMA thread needs its fp32 accumulator (``block_m * block_n /
    (32 * num_warps)`` registers) plus :data:`ACC_HEADROOM` (where ptxas refused, it asked for 26 more: 64 -> 90
    at 64 x 128 on 4 warps with 8 rounding warps, 128 -> 154 at 128 x 256 on 8 with 8)."""
    need = block_m * block_n // (32 * num_warps) + ACC_HEADROOM
    cap = register_cap(num_warps + round_warps, programs_per_sm)
    if cap < need:
        return f"{num_warps} MMA warps with {round_warps} rounding warps: {cap} registers a thread, {need} needed"
    return ""


def programs_per_sm(p: Plan, K: int, programs: int, sms: int, smem: int) -> int:
    """Programs of a launch that share a multiprocessor: 2 where there are more programs than ``sms``, shared
    memory holds two (an sm_90 multiprocessor has ``smem``, the per-program limit, plus the 1 KiB the system
    reserves per program), a program has at most :data:`MAX_SHARED_WARPS` warps (rounding warps included;
    on the H200 two 16-warp programs were much slower than one, and the 16-warp swap tiles do not compile
    under the 48 registers two 20-warp programs would leave) and, with rounding warps, two still compile
    (:func:`register_error`), else 1."""
    need = smem_bytes(p.block_m, p.block_n, p.block_k, K, p.schedule, p.stages) + 1024
    warps = p.num_warps + (p.round_warps if p.ws else 0)
    regs_ok = not p.ws or not register_error(p.block_m, p.block_n, p.num_warps, p.round_warps, 2)
    return 2 if programs > sms and 2 * need <= smem + 1024 and warps <= MAX_SHARED_WARPS and regs_ok else 1


def swap_workers(k_steps: int, act_mxfp4: bool, programs: int, sms: int) -> bool:
    """Whether a ``swap`` launch of ``programs`` programs of ``k_steps`` K steps on ``sms`` multiprocessors
    gives them worker warps that round (and reorder) x while the MMA warps decode and multiply. Yes with more
    than one K step, where rounding step k + 1 overlaps the MMAs of step k. With one step there is nothing to
    overlap, and the MMA warps can round the tile themselves after decoding: without the workers' warps,
    registers and partition protocol a program is cheaper, and more fit on a multiprocessor. That is done
    where x is only reordered (``act_quant="none"``), and where there are more than twice as many programs as
    multiprocessors: with workers at most two share one (:func:`programs_per_sm`), so they would run in more
    than one wave. With fewer programs the workers' rounding beside the decode was faster on the H200
    (BENCHMARKS.md, session 24)."""
    return k_steps > 1 or (act_mxfp4 and programs <= 2 * sms)


def swap_round_warps(round_warps: int, programs: int, sms: int) -> int:
    """Rounding warps of a ``swap`` launch of ``programs`` programs on ``sms`` multiprocessors asked for
    ``round_warps``: 8 only where the programs all run at once, one a multiprocessor, else 4. A program of 4 or 8
    MMA warps with 8 rounding warps runs alone on a multiprocessor (:func:`programs_per_sm`), so more programs than
    multiprocessors would take two waves; with 4 two programs can share one. On the H200 8 made V-up 16 heads T =
    32 / 64 (64 / 128 programs) faster, and the same tile at 24 heads T = 64 (192 programs) took 12.3 us instead of
    5.9 (BENCHMARKS.md, session 26)."""
    return round_warps if programs <= sms else ROUND_WARPS


def swap_codes_first(num_warps: int, k_steps: int, programs_per_sm: int) -> bool:
    """Whether a ``swap`` program's decode of K step 0 waits for the code loads of every later step
    (:func:`_reading`), so that all are issued at its start: for one MMA warpgroup (``num_warps`` = 4) with
    several K steps, alone on its multiprocessor. Left to itself, ptxas issues the later steps' code loads after
    step 0's decode, just before the first wait for x; with the weights coming from HBM their data then arrives
    after step 0's MMAs, and step 1's decode waits for it. On the H200 issuing them first made V-up 16 heads T =
    64 0.2 us faster with x from HBM and 0.5 us with x in L2; it was slower with two warpgroups or two programs
    a multiprocessor, where their loads compete with x's (BENCHMARKS.md, session 25)."""
    return num_warps == 4 and k_steps > 1 and programs_per_sm == 1


def plain_y(tiles_per_program: int, block_m: int, programs: int, sms: int, tma_target: bool = True) -> int:
    """How a launch writes y (:func:`_store_y_part`): 0 by TMA; else by plain stores of that many consecutive
    values a thread. Where y is no TMA target (``tma_target`` False: base or strides off 16 bytes), 1. Else 8
    (16-byte vectors) where each program has one M tile of at most 64 rows and all ``programs`` run at once on the
    ``sms`` multiprocessors, so that each program's store is its last work, waited for at the kernel's end. On the
    H200 that made the 16-head T = 32 / 64 ``swap`` and ``decode`` defaults 0.1-0.2 us faster (K-up 192 at T = 64:
    4.23 -> 4.06 us); a program of several tiles overlaps its TMA stores with its next tile, and plain stores were
    slower with 128-row tiles (V-up 16 heads T = 1024) and with more programs than multiprocessors (BENCHMARKS.md,
    session 26)."""
    if not tma_target:
        return 1
    return 8 if tiles_per_program == 1 and block_m <= 64 and programs <= sms else 0


def round_partitions(p: Plan, K: int, ws: bool, programs_per_sm: int) -> int:
    """Partitions of rounding warps (each of ``p.round_warps``, taking alternate x tiles) in a ``decode``
    program: 2 for one MMA warpgroup with 4 rounding warps (``ws``), several K steps, alone on its
    multiprocessor (``programs_per_sm`` = 1, which the 12 warps keep: two would leave the rounding warps too few
    registers), so that K step i + 1 is rounded beside step i; else 1. On the H200 that made V-up 64 heads T =
    256 4-5% faster and K-up 192 16 heads T = 64 up to 0.1 us; the swap kernel's tiles were slower with two
    (BENCHMARKS.md, session 25)."""
    alone = p.num_warps == 4 and p.round_warps == 4 and programs_per_sm == 1
    return 2 if p.schedule == "decode" and ws and alone and K // p.block_k > 1 else 1


def decode_first(p: Plan, ws: bool) -> bool:
    """Whether a ``decode`` program decodes its whole weight column before its first MMA rather than K step by
    K step during its first tile: with rounding warps (``ws``) and two MMA warpgroups (8 warps). One warpgroup
    interleaves, as does every program without ``ws`` (on the H200, faster in 12 of 14 one-warpgroup configs at
    T = 64 / 256, by up to 9%); for two warpgroups interleaving spilled in session 8 and, without spills in
    session 11, measured the same (BENCHMARKS.md)."""
    return ws and p.num_warps == 8


def _a_operand_runs(cols: int, num_warps: int) -> tuple[list, list, list]:
    """Register, lane and warp bases ``[row, col]`` of the wgmma A-operand rows (lanes 4r + t: rows r and r + 8
    of each warp's 16, warps along rows) with lane t of each quad holding the run of ``cols / 4`` consecutive
    columns from ``t * cols / 4`` (the order :func:`_swap_k_order` makes of k)."""
    regs = [[0, p] for p in _powers(cols // 4)] + [[8, 0]]
    lanes = [[0, cols // 4], [0, cols // 2], [1, 0], [2, 0], [4, 0]]
    return regs, lanes, [[16 * p, 0] for p in _powers(num_warps)]


def _powers(n: int) -> list[int]:
    """1, 2, 4, ... below the power of two n."""
    return [1 << i for i in range(n.bit_length() - 1)]


def swap_code_layout(block_n: int, block_k: int, num_warps: int):
    """Register layout of a ``swap`` program's codes for one K step, ``[block_n, NG, G]`` (G = min(16,
    block_k / 8) bytes a group, NG groups a row): :func:`_a_operand_runs` over the ``block_k / 2`` code bytes of
    a row, a thread holding the block_k / 8 consecutive code bytes its A registers need after
    :func:`_swap_k_order` (lane t: bytes t * block_k / 8 on), so the decoded values only change registers on
    their way to the MMA."""
    g = min(16, block_k // 8)

    def split(bases: list) -> list:  # column c of the row's bytes -> (group, byte)
        return [[row, col // g, col % g] for row, col in bases]

    regs, lanes, warps = _a_operand_runs(block_k // 2, num_warps)
    return gl.DistributedLinearLayout(split(regs), split(lanes), split(warps), [], [block_n, block_k // 2 // g, g])


def xreg_x_layout(block_m: int, block_k: int, num_warps: int):
    """Register layout of an ``xreg`` x tile ``[block_m, block_k]`` bf16: :func:`_a_operand_runs` over k, lane t
    of each quad holding k ``t * block_k / 4`` on, which :func:`_swap_k_order` turns into the A-operand layout by
    renaming registers."""
    regs, lanes, warps = _a_operand_runs(block_k, num_warps)
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [block_m, block_k])


def kernel_constants(p: Plan, K: int, act_mxfp4: bool, programs_per_sm: int = 1, plain: int = 0) -> dict:
    """The compile-time arguments of a launch of ``p`` (``num_warps`` and, with WS, ``maxnreg`` included: the
    registers of ``programs_per_sm`` programs' warps share a multiprocessor's 65536; ``plain``: y by TMA (0) or
    plain stores of that many values a thread, :func:`plain_y`)."""
    swap, xreg = p.schedule == "swap", p.schedule == "xreg"
    ws = p.ws and (act_mxfp4 or swap)  # swap's workers also reorder x; never for xreg (plan() makes it without)
    rounding, decoding = _register_layouts(p.block_m, p.block_n, p.block_k, p.num_warps,
                                           p.round_warps if ws else p.num_warps)  # fmt: skip
    if xreg:
        rounding = xreg_x_layout(p.block_m, p.block_k, p.num_warps)
    yn = y_columns(p.block_m, p.block_n)
    consts = dict(K=K, ACT_MXFP4=act_mxfp4, ROUND_LAYOUT=rounding, STAGES=p.stages, WORKERS=p.round_warps,
                  Y_LAYOUT=_smem_layout((1, p.block_m, yn)), PLAIN_Y=plain, num_warps=p.num_warps)  # fmt: skip
    parts = 1
    if swap:
        consts.update(CODE_LAYOUT=swap_code_layout(p.block_n, p.block_k, p.num_warps), WS=ws,
                      CODES_FIRST=swap_codes_first(p.num_warps, K // p.block_k, programs_per_sm))  # fmt: skip
    else:
        parts = round_partitions(p, K, ws, programs_per_sm)
        consts.update(BN=p.block_n, YN=yn, W_LAYOUT=_smem_layout((1, p.block_n, p.block_k)),
                      STATIONARY=p.schedule != "streaming", DECODE=p.schedule in FROM_CODES, WS=ws,
                      DECODE_LAYOUT=decoding, DECODE_FIRST=decode_first(p, ws), XREG=xreg,
                      PAIRS=min(16, p.block_k // 8), PARTS=parts)  # fmt: skip
    if ws:  # the registers of all warps together: at most 65536 per multiprocessor
        consts["maxnreg"] = register_cap(p.num_warps + parts * p.round_warps, programs_per_sm)
    return consts
