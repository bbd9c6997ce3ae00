"""A slow, obvious interpreter for the few PTX instructions of the kernels' inline assembly (the E2M1 decode and
the activation rounding), on numpy arrays of 32-bit registers, so their text can be checked on a CPU."""

from __future__ import annotations

import numpy as np
import torch

_U32 = np.uint64(0xFFFFFFFF)


def bf16_bits(v: np.ndarray) -> np.ndarray:
    """float64 values -> bf16 bit patterns (uint64), rounded once to nearest even (subnormals down to 2**-133,
    overflow to Inf, NaN -> 0x7FFF)."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    _, exp = np.frexp(np.where(np.isfinite(a) & (a > 0), a, 1.0))  # a = m * 2**exp, m in [0.5, 1)
    quantum = np.ldexp(1.0, np.maximum(exp - 1, -126) - 7)  # bf16 ulp at a: 8 significant bits
    r = np.where(np.isfinite(a), np.rint(a / quantum) * quantum, a)  # rint: ties to even
    r = np.copysign(np.where(r >= 2.0**128, np.inf, r), v)
    bits = torch.from_numpy(r).to(torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return np.where(np.isnan(v), 0x7FFF, bits.numpy()).astype(np.uint64)


def _halves(x: np.ndarray) -> list[np.ndarray]:
    """The two bf16 halves of 32-bit registers, as float64 (exact)."""
    return [torch.from_numpy(((x >> np.uint64(s)) & np.uint64(0xFFFF)).astype(np.int64)).to(torch.int16)
            .view(torch.bfloat16).to(torch.float64).numpy() for s in (0, 16)]  # fmt: skip


def _bf16x2(op, *regs: np.ndarray) -> np.ndarray:
    """A packed bf16 operation, half by half: ``op`` on exact float64 values, then one rounding."""
    lo, hi = (op(*parts) for parts in zip(*(_halves(r) for r in np.broadcast_arrays(*regs)), strict=True))
    return bf16_bits(lo) | (bf16_bits(hi) << np.uint64(16))


def _ambiguous_fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Threads whose ``a * b + c`` (halves) float64 rounds (a * b alone never does: 16 bits) close enough to a
    bf16 rounding boundary that the bits it lost could change the bf16 result; elsewhere rounding the float64
    sum is rounding the exact one."""
    ambiguous = np.zeros(np.broadcast(a, b, c).shape, dtype=bool)
    for x, y, z in zip(*(_halves(r) for r in np.broadcast_arrays(a, b, c)), strict=True):
        s = x * y + z
        near = bf16_bits(np.nextafter(s, np.inf)) != bf16_bits(np.nextafter(s, -np.inf))
        ambiguous |= np.isfinite(s) & (s - x * y != z) & near
    return ambiguous


_BF16X2 = {
    "mul.rn.bf16x2": lambda a, b: a * b,
    "fma.rn.bf16x2": lambda a, b, c: a * b + c,
    "max.bf16x2": np.fmax,  # a NaN operand gives the other
    "min.NaN.bf16x2": np.minimum,  # a NaN operand gives NaN
}


def _prmt(a, b, c):
    """Default mode: byte i of d is byte ``c.nibble[i] & 7`` of ``{b, a}``, or that byte's sign replicated when
    ``c.nibble[i] & 8``."""
    table, out = (b << np.uint64(32)) | a, np.zeros_like(a | c)
    for i in range(4):
        sel = (c >> np.uint64(4 * i)) & np.uint64(15)
        byte = (table >> (np.uint64(8) * (sel & np.uint64(7)))) & np.uint64(255)
        byte = np.where(sel & np.uint64(8), np.where(byte & np.uint64(128), 255, 0), byte).astype(np.uint64)
        out = out | (byte << np.uint64(8 * i))
    return out


_INT = {
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "shl.b32": lambda a, b: a << b,
    "shr.b32": lambda a, b: a >> b,
    "mov.b32": lambda a: a,
    "prmt.b32": _prmt,
    "setp.ge.u32": lambda a, b: a >= b,
}


def run_ptx(ptx: str, regs: dict) -> dict:
    """Run ``ptx`` (one ``{ ... }`` block) on ``regs`` (name -> numpy uint64 array or scalar, broadcast
    together; each element is one thread) and return them with the results. Branches go forward only: a
    taken ``bra`` parks its threads until the label, so each thread runs exactly its own path."""
    shape = np.broadcast(*(np.asarray(v) for v in regs.values())).shape
    active, parked = np.ones(shape, dtype=bool), {}

    def val(tok):
        return np.asarray(regs[tok] if tok in regs else np.uint64(int(tok, 0)), dtype=np.uint64)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        if line.endswith(":"):
            active = active | parked.pop(line[:-1], False)
            continue
        guard = np.ones(shape, dtype=bool)
        if line.startswith("@"):
            pred, line = line.split(None, 1)
            guard = regs[pred.lstrip("@!")] ^ pred.startswith("@!")
        op, args = line.split(None, 1)
        if op == "bra":
            taken = active & guard
            parked[args.strip()] = parked.get(args.strip(), False) | taken
            active = active & ~taken
            continue
        d, *src = [a.strip() for a in args.split(",")]
        a = [val(t) for t in src]
        if op in _BF16X2:
            out = _bf16x2(_BF16X2[op], *a)
            if op.startswith("fma"):  # one rounding of the exact sum, where float64's own rounding cannot matter
                assert not (_ambiguous_fma(*a) & active & guard).any(), "fma beyond what this emulator models"
        elif op in _INT:
            out = _INT[op](*a)
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
        out = out if out.dtype == bool else out & _U32
        regs[d] = np.where(active & guard, out, regs.get(d, np.zeros((), out.dtype)))
    assert active.all() and not parked, "every thread reaches the end"
    return regs
