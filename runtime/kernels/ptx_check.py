"""A check of compiled PTX for a register hazard of Hopper's asynchronous MMA (``wgmma``) that Triton 3.6 emits.

PTX leaves it undefined to write a register that a ``wgmma.mma_async`` still in flight reads as its A operand (A
in registers rather than in shared memory); a ``wgmma.wait_group N`` retires all but the N most recent groups.
Triton 3.6 pipelines a dot whose A operand is computed in registers (the kernels' activation rounding) with waits
that leave the previous K step's MMAs pending, then loads the next step's A fragments into the same registers
(triton-lang/triton#9433, open). On an H200 one such kernel gave wrong results that vary from call to call
(BENCHMARKS.md); others with the same hazard happened to give right ones. The issue's thread reports its own repro
fixed by ptxas 13.3; this hazard is in the PTX, and 13.3 assembles it to the same waits (on the H200, wrong results
then with either rounding), so the check reads the PTX, whatever ptxas Triton uses.
"""

from __future__ import annotations

import re

_LABEL = re.compile(r"^\s*(\$?[\w.$]+):")
_PREDICATE = re.compile(r"^@!?%\w+\s+")


def _instructions(ptx: str) -> tuple[list[tuple[int, str, str]], dict[str, int]]:
    """The PTX's instructions as (line number, opcode, operands), and each label's index in that list; directives
    (``.reg``, ``.param``...) and comments left out, a predicate guard dropped (a guarded write may happen)."""
    found, labels = [], {}
    for number, line in enumerate(ptx.splitlines(), 1):
        code = line.split("//", 1)[0]
        if label := _LABEL.match(code):
            labels[label.group(1)] = len(found)
            code = code[label.end() :]
        for statement in code.split(";")[:-1]:  # text after the last ';' is no complete instruction
            statement = statement.strip().lstrip("{").strip()  # inline assembly's "{ ... }" scopes
            if statement.count("}") > statement.count("{"):
                statement = statement.rstrip("}").strip()
            statement = _PREDICATE.sub("", statement)
            if statement and not statement.startswith("."):
                opcode, *operands = statement.split(None, 1)
                found.append((number, opcode, operands[0].strip() if operands else ""))
    return found, labels


def _registers(operand: str) -> set[str]:
    return set(re.findall(r"%\w+", operand))


def _written(opcode: str, operands: str) -> set[str]:
    """The registers an instruction writes: its first operand, a register or a ``{...}`` vector of them; none when
    that operand is an address (``[...]``: stores, ``cp.async``, reductions) or the instruction has none."""
    if opcode.startswith("wgmma.") or not operands.startswith(("%", "{")):
        return set()
    first = operands[: operands.index("}") + 1] if operands.startswith("{") else operands.split(",", 1)[0]
    return _registers(first)


def wgmma_a_hazard(ptx: str) -> str:
    """Where ``ptx`` writes a register that a ``wgmma.mma_async`` reads as its A operand before a
    ``wgmma.wait_group`` has retired that MMA: the first such place, or "" when there is none.

    Followed in program order, each loop's body a second time with what is still pending at its end (once per
    backward branch), so a write in the next iteration meets the MMAs the last one left in flight; forward branches
    fall through (both ways counted). MMAs chained on one accumulator are not a hazard (PTX allows it)."""
    if "wgmma.mma_async" not in ptx:  # most kernels: nothing to follow
        return ""
    instructions, labels = _instructions(ptx)
    pending: list[list[tuple[int, set[str]]]] = []  # committed groups, oldest first: (line, A registers) each
    uncommitted: list[tuple[int, set[str]]] = []
    looped: set[int] = set()
    i = 0
    while i < len(instructions):
        number, opcode, operands = instructions[i]
        if opcode.startswith("wgmma.mma_async"):
            vectors = re.findall(r"\{[^}]*\}", operands)  # the accumulator, then A when it is in registers
            if len(vectors) > 1 and operands.split("}", 1)[1].lstrip(", ").startswith("{"):
                uncommitted.append((number, _registers(vectors[1])))
        elif opcode.startswith("wgmma.commit_group"):
            pending, uncommitted = [*pending, uncommitted], []
        elif opcode.startswith("wgmma.wait_group"):
            keep = int(operands)  # the most recent groups left in flight
            pending = pending[max(0, len(pending) - keep) :] if keep else []
        elif written := _written(opcode, operands):
            for line, a_operand in (mma for group in [*pending, uncommitted] for mma in group):
                if clash := sorted(written & a_operand):
                    return (f"line {number} ({opcode}) writes {', '.join(clash)}, the A operand of the "
                            f"wgmma.mma_async at line {line}, which no wgmma.wait_group has retired")  # fmt: skip
        target = labels.get(operands) if opcode.startswith("bra") else None
        if target is not None and target <= i and i not in looped:
            looped.add(i)
            i = target
            continue
        i += 1
    return ""
