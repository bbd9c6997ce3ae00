"""``ptx_check.wgmma_a_hazard`` on hand-written PTX whose answer is worked out by hand below each case (what is
pending at each write); Triton's own code for sm_90 is checked in test_compile_targets.py."""

from __future__ import annotations

import pytest

from glm_pack.runtime.kernels.ptx_check import wgmma_a_hazard


def _mma(a: str) -> str:
    """A register-A wgmma (A = ``a``, a ``{...}`` vector) or, for ``a`` a 64-bit register, a shared-memory one."""
    return f"\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{%f1, %f2}}, {a}, %rd9, %p9, 1, 1, 1;"


def _loop(wait_at_end: int) -> str:
    """Two K-step MMAs a loop iteration, both A fragments loaded at the top (Triton 3.6's pipelined pattern)."""
    return "\n".join([
        ".reg .b32 %r<40>;",
        "$L__BB0_1:",
        "\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r20];",  # line 3
        "\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r5, %r6, %r7, %r8}, [%r21];",  # line 4
        "\twgmma.fence.sync.aligned;",
        _mma("{%r1, %r2, %r3, %r4}"),  # line 6
        "\twgmma.commit_group.sync.aligned;",
        "\twgmma.wait_group.sync.aligned 1;",
        _mma("{%r5, %r6, %r7, %r8}"),  # line 9
        "\twgmma.commit_group.sync.aligned;",
        f"\twgmma.wait_group.sync.aligned {wait_at_end};",
        "\t@%p1 bra \t$L__BB0_1;",
        "\twgmma.wait_group.sync.aligned 0;",
        "\tret;",
    ])  # fmt: skip


def test_the_next_iteration_loading_a_pending_mmas_a_is_found():
    """Wait 1 at the end leaves line 9's MMA pending into the next iteration, whose second ldmatrix (line 4) writes
    its A fragment; the first ldmatrix writes the A of line 6's MMA, retired by that wait."""
    assert wgmma_a_hazard(_loop(1)) == (
        "line 4 (ldmatrix.sync.aligned.m8n8.x4.shared.b16) writes %r5, %r6, %r7, %r8, the A operand of the "
        "wgmma.mma_async at line 9, which no wgmma.wait_group has retired"
    )


def test_waiting_for_every_mma_at_the_end_of_the_iteration_is_safe():
    assert wgmma_a_hazard(_loop(0)) == ""


def test_a_fragments_written_just_before_their_own_mma_are_safe():
    """Each A written after the wait that retires its previous reader (Triton 3.6's 4-warp, 2-stage code): at the
    top of an iteration only the last MMA (A = %r5) is pending, and %r1 is written; after its wait only line 4's."""
    ptx = "\n".join([
        "$L__BB0_1:",
        "\tmov.b32 \t%r1, {%rs1, %rs2};",
        _mma("{%r1, %r2, %r3, %r4}"),
        "\twgmma.commit_group.sync.aligned;",
        "\twgmma.wait_group.sync.aligned 1;",
        "\tmov.b32 \t%r5, {%rs3, %rs4};",
        _mma("{%r5, %r6, %r7, %r8}"),
        "\twgmma.commit_group.sync.aligned;",
        "\twgmma.wait_group.sync.aligned 1;",
        "\t@%p1 bra \t$L__BB0_1;",
    ])  # fmt: skip
    assert wgmma_a_hazard(ptx) == ""


@pytest.mark.parametrize(
    "write, hazard",
    [
        ("\tadd.s32 \t%r2, %r2, 1;", True),
        ("\t@!%p3 mov.b32 \t%r3, 0;", True),  # a guarded write may happen
        ("\t{ .reg .b32 c; mov.b32 c, 0x40C040C0; min.NaN.bf16x2 %r4, %r9, c; }", True),  # inline assembly's scope
        ("\tst.shared.b32 \t[%r1+16], %r9;", False),  # reads %r1 as an address
        ("\tmov.b32 \t%r9, %r1;", False),  # reads %r1
        ("\tsetp.eq.s32 \t%p2, %r1, 0;", False),
        ("\t// add.s32 %r1, %r1, 1;", False),
    ],
)
def test_what_counts_as_a_write_while_an_mma_is_pending(write, hazard):
    ptx = "\n".join([_mma("{%r1, %r2, %r3, %r4}"), "\twgmma.commit_group.sync.aligned;", write])
    assert bool(wgmma_a_hazard(ptx)) is hazard


@pytest.mark.parametrize("retire", ["\twgmma.wait_group.sync.aligned 0;", ""])
def test_a_wait_retires_an_mma_and_an_uncommitted_one_is_pending(retire):
    """Without a commit the MMA is still in flight; a wait for none pending retires it."""
    commit = "\twgmma.commit_group.sync.aligned;\n" if retire else ""
    ptx = _mma("{%r1, %r2, %r3, %r4}") + "\n" + commit + retire + "\n\tmov.b32 \t%r1, 0;"
    assert bool(wgmma_a_hazard(ptx)) is (not retire)


def test_an_mma_reading_a_from_shared_memory_has_no_register_operand():
    """A 64-bit descriptor for A (its fragments in shared memory): rewriting the descriptor register is no hazard."""
    ptx = "\n".join([_mma("%rd5"), "\twgmma.commit_group.sync.aligned;", "\tmov.b64 \t%rd5, 0;"])
    assert wgmma_a_hazard(ptx) == ""
