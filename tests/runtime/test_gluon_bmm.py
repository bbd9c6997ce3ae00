"""The Hopper Gluon GEMM (runtime/kernels/gluon_bmm.py): launch planning and dispatch here, an sm_90 compile
of the real kernel on this CPU (Triton's bundled ptxas), and results against the reference on an sm_90 GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from glm_pack.packing.errors import BackendError
from glm_pack.packing.mxfp4 import dequantize
from tests.runtime.kernel_modules import benchmark_module, kernel_module
from tests.runtime.ptx_emulator import run_ptx
from tests.runtime.test_mxfp4_jit import block_scales, round_trip_blocks, round_trip_reference
from tests.runtime.test_triton_bmm import (
    activations,
    assert_close_to_reference,
    identity_weights,
    poisoned_out,
    ran_or_refused_as_unsafe,
    weights,
)

gb = kernel_module("gluon_bmm")
tb = kernel_module("triton_bmm")

pytestmark = pytest.mark.skipif(bool(gb.IMPORT_ERROR), reason=f"gluon unavailable: {gb.IMPORT_ERROR}")

H200_SMEM = 232448  # opt-in shared memory per block on H100 / H200 (bytes)
SM90 = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9
sm90_only = pytest.mark.skipif(not SM90, reason="needs an sm_90 NVIDIA GPU")


def test_plans_take_the_most_stages_that_fit():
    # GLM K-up (K 192 / 256): a 256 x K bf16 weight column (96 / 128 KiB) plus 4 x 16 KiB of x plus the
    # 32 KiB y half-tile: 4 stages fit in 227 KiB (at K = 256 a fifth would not; at 192 the cap stops it)
    for K in (192, 256):
        for schedule in ("stationary", "decode"):
            p = gb.plan(128, 256, 64, 8, schedule, K, H200_SMEM)
            assert (p.stages, p.schedule) == (4, schedule) and gb.MAX_STAGES == 4
    assert gb.smem_bytes(128, 256, 64, 256, "decode", 4) <= H200_SMEM < gb.smem_bytes(128, 256, 64, 256, "decode", 5)
    # V-up's 256 x 512 column is 256 KiB by itself: only the streaming schedule runs, with 4 x (16 + 32) KiB;
    # a 128-column one (128 KiB) fits
    assert gb.plan(128, 256, 64, 8, "stationary", 512, H200_SMEM) is None
    assert gb.plan(128, 256, 64, 8, "decode", 512, H200_SMEM) is None
    assert gb.plan(128, 256, 64, 8, "streaming", 512, H200_SMEM).stages == 4
    assert gb.plan(128, 128, 64, 8, "decode", 512, H200_SMEM).stages == 4
    # hand counts: 3 x 16 KiB x + 3 x 32 KiB w + 32 KiB y (one 128-column half) + 1 KiB slack; at 64 rows the
    # y buffer holds the whole 64 x 256 tile (32 KiB) and the column is 256 x 256 x 2 bytes
    assert gb.smem_bytes(128, 256, 64, 512, "streaming", 3) == 3 * 16384 + 3 * 32768 + 32768 + 1024
    assert gb.smem_bytes(64, 256, 64, 256, "decode", 4) == 4 * 8192 + 131072 + 32768 + 1024
    assert (gb.y_columns(128, 256), gb.y_columns(64, 256)) == (128, 256)
    # fewer stages where less memory is available, none below two, and no more than asked for
    assert gb.plan(128, 256, 64, 8, "streaming", 512, 150_000).stages == 2
    assert gb.plan(128, 256, 64, 8, "streaming", 512, 100_000) is None
    assert gb.plan(128, 256, 64, 8, "streaming", 512, H200_SMEM, max_stages=3).stages == 3
    # exactly the shared memory three stages take (hand count above): three
    assert gb.plan(128, 256, 64, 8, "streaming", 512, 3 * 16384 + 3 * 32768 + 32768 + 1024).stages == 3


@pytest.mark.parametrize(
    "tiles, schedule, bad",
    [((128, 256, 64, 8), "streaming", ""), ((64, 256, 64, 4), "stationary", ""), ((64, 128, 64, 8), "decode", ""),
     ((64, 64, 64, 4), "decode", ""), ((128, 256, 64, 4), "streaming", "64 or 128 <= 16 \\* num_warps"),
     ((32, 256, 64, 4), "decode", "64 or 128"), ((256, 256, 64, 16), "streaming", "4 or 8 warps"),
     ((128, 16, 64, 8), "streaming", "multiple of 32"), ((128, 512, 64, 8), "streaming", "up to 256"),
     ((128, 256, 512, 8), "streaming", "32 to 256"), ((64, 64, 64, 8), "decode", "decode needs >= 128 rows"),
     ((128, 256, 64, 8), "both", "one of"), ((32, 64, 256, 4), "swap", ""), ((16, 128, 32, 8), "swap", ""),
     ((32, 128, 64, 4), "swap", "block_n = 16 \\* warps"), ((128, 64, 64, 4), "swap", "16, 32 or 64"),
     ((32, 64, 512, 4), "swap", "power of two from 32 to 256"), ((64, 256, 128, 16), "swap", ""),
     ((64, 512, 64, 32), "swap", "4, 8 or 16 warps"), ((64, 256, 128, 4), "xreg", ""), ((128, 128, 64, 8), "xreg", ""),
     ((64, 128, 64, 8), "xreg", "xreg needs 16 \\* warps rows"), ((64, 128, 256, 4), "xreg", "block_k <= 128"),
     ((64, 32, 64, 4), "xreg", "xreg needs >= 64 rows")],
)  # fmt: skip
def test_tile_rules(tiles, schedule, bad):
    """Each rule against a hand-picked violation; the decode rule: 32 / (64 / 32) = 16 rows per warp, so 8 warps
    need 128 weight rows (4 warps: 64); swap: 16 weight rows per warp (up to four warpgroups), 16-64 rows of x;
    xreg: one warpgroup per 64 rows of x and none along N, K steps of at most 128."""
    err = gb.tile_error(*tiles, schedule)
    assert (err == "") == (bad == "")
    if bad:
        codes, scales = weights(1, 64, 512, seed=0)
        cfg = tb.BmmConfig(*tiles, 3, 0, predecode=schedule not in ("decode", "xreg"), wgmma=schedule)
        with pytest.raises(BackendError, match=bad):
            tb.bmm_a16wfp4(activations(4, 1, 512, seed=1), codes, scales, config=cfg)


@pytest.mark.parametrize(
    "change, match",
    [(dict(predecode=False), "with predecode"), (dict(wgmma="decode"), "'decode', 'swap' and 'xreg' without"),
     (dict(tiles_m=2, predecode=False, wgmma="decode"), "tiles_m=0"),
     (dict(block_m=32, block_n=128, wgmma="swap"), "'decode', 'swap' and 'xreg' without"),
     (dict(block_m=64, num_warps=4, predecode=False, wgmma="xreg", ws=True), "not of xreg"),
     (dict(round_warps=6), "round_warps: 4, or 8 with ws or swap"),
     (dict(round_warps=8), "round_warps: 4, or 8 with ws or swap"),
     (dict(block_m=64, num_warps=16, predecode=False, wgmma="swap", round_warps=8), "at most 20 warps"),
     (dict(predecode=False, wgmma="decode", ws=True, round_warps=8), "128 registers a thread, 160 needed")],
)  # fmt: skip
def test_rejects_wgmma_configs_outside_the_contract(change, match):
    cfg = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tiles_m=0, predecode=True)
    cfg.update({"wgmma": "streaming", **change})
    codes, scales = weights(1, 64, 64, seed=0)
    with pytest.raises(BackendError, match=match):
        tb.bmm_a16wfp4(activations(4, 1, 64, seed=1), codes, scales, config=tb.BmmConfig(**cfg))


def test_twenty_warps_with_the_rounding_warps_are_allowed():
    """MAX_WARPS is inclusive: 16 swap MMA warps with 4 rounding warps (K-up 256's 64-head 64-row default) run
    (here through the fallback kernels), and give the reference's result."""
    B, M, N, K = 1, 4, 64, 128
    codes, scales = weights(B, N, K, seed=2)
    x = activations(M, B, K, seed=3)
    cfg = tb.BmmConfig(64, 256, 128, 16, 1, 0, wgmma="swap")
    assert cfg.num_warps + cfg.round_warps == gb.MAX_WARPS
    assert_close_to_reference(tb.bmm_a16wfp4(x, codes, scales, config=cfg), x, codes, scales, "mxfp4")


def test_launch_grids_split_each_weight_column_over_the_multiprocessors_left(monkeypatch):
    """:func:`gluon_bmm.prepare`'s grid on an H200's 132 multiprocessors (the kernels stand-ins: it runs on this
    CPU): a program per ``(b, n0)`` weight column and run of its M tiles, the columns' tiles split over the 132 /
    columns multiprocessors each has (2 heads x 256 / 128 = 4 columns: up to 33 runs each), and y written plainly
    where each program has one tile and all run at once; ``swap``, a program per tile, its worker and rounding warps
    by :func:`swap_workers` and :func:`swap_round_warps`."""
    launches = []

    class Recorded:
        def __init__(self, kernel, grid, constants):
            launches.append([kernel, grid, constants])

        def __call__(self, *args):
            launches[-1].append(args)

    monkeypatch.setattr(gb, "KernelLaunch", Recorded)
    monkeypatch.setattr(gb, "sm_count", lambda device: 132)
    monkeypatch.setattr(gb, "smem_limit", lambda device: H200_SMEM)
    monkeypatch.setattr(gb, "_bmm_kernel", "bmm", raising=False)  # Gluon kernels are not defined in the interpreter
    monkeypatch.setattr(gb, "_swap_kernel", "swap", raising=False)

    def launch(M, p, K=192, out_offset=0):
        x = torch.zeros(M, 2, K, dtype=torch.bfloat16).transpose(0, 1)
        out = torch.zeros(M, 2, 264, dtype=torch.bfloat16)[..., out_offset : out_offset + 256].transpose(0, 1)
        codes, scales = torch.zeros(2, 256, K // 2, dtype=torch.uint8), torch.zeros(2, 256, K // 32, dtype=torch.uint8)
        gb.prepare(x, out, True, p, w=codes, w_scales=scales)(x, codes, scales, out)
        kernel, grid, constants, args = launches[-1]
        return kernel, grid, constants["PLAIN_Y"], args, constants

    decode = gb.plan(64, 128, 64, 8, "decode", 192, H200_SMEM, ws=True)
    # 100 rows: two 64-row tiles a column (the second partial), so 2 x 4 programs
    for M, programs, splits, plain in ((16, 4, 1, 8), (100, 8, 2, 8), (1024, 64, 16, 8), (4096, 132, 33, 0)):
        kernel, grid, plain_y, args, _ = launch(M, decode)
        assert (kernel, grid, plain_y) == ("bmm", (programs,), plain) and args[9:12] == (M, 256, splits), M
        assert (args[2] is None) == bool(plain)  # y's descriptor
    # 64-column tiles: 2 x 4 = 8 columns, each split over 132 // 8 = 16 multiprocessors (not 17: 136 programs would
    # leave a second wave)
    kernel, grid, plain_y, args, _ = launch(4096, gb.plan(64, 64, 64, 4, "decode", 192, H200_SMEM, ws=True))
    assert (grid, args[9:12]) == ((128,), (4096, 256, 16))
    # an out starting 2 bytes past 16 is no TMA target: plain stores of one value a thread, however many tiles
    kernel, grid, plain_y, args, _ = launch(4096, decode, out_offset=1)
    assert (grid, plain_y, args[2]) == ((132,), 1, None)
    swap = gb.plan(32, 64, 64, 4, "swap", 192, H200_SMEM, round_warps=8)
    kernel, grid, _, _, constants = launch(100, swap)
    assert (kernel, grid, constants["WS"], constants["WORKERS"]) == ("swap", (32,), True, 8)  # 8 columns x 4 tiles
    # one 64-deep K step and 8 x 40 = 320 programs, more than two a multiprocessor: no workers, 4 rounding warps
    kernel, grid, _, _, constants = launch(1280, gb.plan(32, 64, 64, 4, "swap", 64, H200_SMEM, round_warps=8), K=64)
    assert (grid, constants["WS"], constants["WORKERS"]) == ((320,), False, 4)


@pytest.mark.parametrize("arch, runs", [("sm_90", True), ("sm_80", False), ("sm_100", False), ("sm_120", False),
                                        ("gfx942", False), ("gfx950", False)])  # fmt: skip
def test_the_wgmma_kernels_run_on_sm_90_alone(gpu_as, arch, runs):
    """wgmma is Hopper's: GPUs after it (sm_100's tcgen05, sm_120) have no wgmma either, so only compute capability
    9.x is given the Gluon kernels; AMD GPUs never."""
    gpu_as(arch)
    why = gb._device_reason(torch.device("cuda"))
    assert (why == "") is runs, why


def test_tensors_reason_needs_x_on_16_bytes_and_unit_last_strides():
    """x must be a TMA source (base and row strides 16-byte aligned, unit last stride); out, codes and scales need
    only a unit last stride: an out off 16 bytes is written by plain stores instead of refused, if its rows are
    under 2**24 values apart (the plain stores' 32-bit offsets)."""
    q = torch.zeros(8, 2, 264, dtype=torch.bfloat16)
    x, x_off = q[..., :192].transpose(0, 1), q[..., 1:193].transpose(0, 1)
    y = torch.zeros(8, 2, 264, dtype=torch.bfloat16)
    out, out_off, out_strided = y[..., :256].transpose(0, 1), y[..., 1:257].transpose(0, 1), y[..., ::2].transpose(0, 1)
    codes, scales = torch.zeros(2, 256, 96, dtype=torch.uint8), torch.zeros(2, 256, 6, dtype=torch.uint8)
    assert gb.tensors_reason(x, out, codes, scales) == "" and gb.tensors_reason(x, out_off, codes, scales) == ""
    assert gb.tensors_reason(x_off, out).startswith("x strides")
    assert gb.tensors_reason(q[..., :384:2].transpose(0, 1), out).startswith("x strides")  # K stride 2
    assert gb.tensors_reason(x, out_strided).startswith("out strides")
    assert gb.tensors_reason(x, out, codes.transpose(1, 2).contiguous().transpose(1, 2), scales).startswith("weight")
    far = torch.empty(2**24 + 16, dtype=torch.bfloat16)
    for row, offset, reason in ((2**24 - 1, 1, ""), (2**24, 1, "out strides"), (2**24, 0, "")):
        rows_apart = torch.as_strided(far, (1, 2, 8), (2 * row, row, 1), storage_offset=offset)
        got = gb.tensors_reason(x, rows_apart)
        assert got.startswith(reason) if reason else got == "", (row, offset, got)


def test_e2m1_ptx_decodes_like_dequantize_in_an_emulator():
    """The decode's PTX text, run by a slow interpreter on this CPU: for random code words (all 16 codes in
    every nibble position) and scale bytes across the range (0 = 2**-127, 254 overflowing to inf, 255 = NaN),
    the 8 bf16 results of each word are the float32 dequantization rounded to bf16, bit for bit."""
    g = torch.Generator().manual_seed(3)
    words = torch.randint(0, 2**32, (4096,), generator=g, dtype=torch.int64)
    words[:16] = torch.tensor([int(f"{c:x}" * 8, 16) for c in range(16)])  # every code in every position
    for s in (0, 1, 2, 100, 127, 128, 200, 252, 253, 254, 255):
        scale_bits = 0x40 if s == 0 else 0x7FC0 if s == 255 else s << 7
        regs = {"$4": words.numpy().astype(np.uint64), "$5": np.uint64(scale_bits | (scale_bits << 16))}
        regs = run_ptx(gb._e2m1_bf16_ptx(), regs)
        got = torch.from_numpy(np.stack([regs[f"${i}"] for i in range(4)], axis=1).astype(np.int64))
        got = torch.stack([got & 0xFFFF, got >> 16], dim=2).reshape(-1, 8).to(torch.int16).view(torch.bfloat16)
        codes = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=1).to(torch.uint8)  # [W, 4] bytes
        codes16 = codes.repeat(1, 4)  # dequantize wants 16-byte blocks: 4 copies of the word
        scales = torch.full((len(words), 1), s, dtype=torch.uint8)
        want = dequantize(codes16, scales)[:, :8].to(torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"scale byte {s}")


@pytest.mark.skipif(SM90, reason="checks the fallback where the kernel cannot run")
@pytest.mark.parametrize(
    "cfg",
    [tb.BmmConfig(64, 64, 64, 4, 1, 0, predecode=True, tma=True, wgmma="stationary"),
     tb.BmmConfig(64, 64, 64, 4, 1, 0, wgmma="decode"), tb.BmmConfig(32, 64, 64, 4, 1, 0, wgmma="swap")],
    ids=["stationary", "decode", "swap"],
)  # fmt: skip
def test_falls_back_to_the_triton_kernels_where_it_cannot_run(cfg, monkeypatch):
    """Here (interpreter or another GPU) a wgmma config runs the TMA / tiled kernels with the same tiles."""
    B, M, N, K = 2, 37, 80, 192
    codes, scales = weights(B, N, K, seed=5)
    x = activations(M, B, K, seed=6, row=256)
    buf, out = poisoned_out(M, B, N)
    assert gb.unusable_reason(x, out)
    monkeypatch.setattr(gb, "prepare", lambda *a, **kw: pytest.fail("gluon kernel prepared"))
    tb.bmm_a16wfp4(x, codes, scales, out=out, config=cfg)
    assert torch.isnan(buf[..., N:]).all()
    assert_close_to_reference(out, x, codes, scales, "mxfp4")


def test_large_m_defaults_pick_the_schedule_by_weight_size_and_rows(monkeypatch):
    monkeypatch.setattr(tb, "_INTERPRETED", False)  # the interpreter has one small config for every shape
    rows = tb.XREG_MIN_ROWS  # 16 heads x 1024 tokens: a tie between decode and xreg on the H200
    assert tb._large_m(192, 10**6).wgmma == tb._large_m(256, rows).wgmma == "decode"
    assert not tb._large_m(256, rows).predecode
    assert (tb._large_m(512, 10**6).wgmma, tb._large_m(512, 10**6).predecode) == ("streaming", True)
    assert tb._large_m(192, 10**6).ws and tb._large_m(512, 10**6).ws  # rounding warps from 257 rows on
    xreg = tb._large_m(256, rows + 1)  # K-up 256 above the tie: x rounded in the MMA warps, whole 32-blocks each
    assert (xreg.wgmma, xreg.ws, xreg.block_k, xreg.num_warps * 16) == ("xreg", False, 128, xreg.block_m)
    assert tb.default_config(64, 300, 512, 256) == xreg and tb.default_config(16, 1024, 512, 256).wgmma == "decode"


def test_ws_needs_the_wgmma_kernel():
    x, (codes, scales) = activations(64, 1, 64, seed=0), weights(1, 64, 64, seed=0)
    with pytest.raises(BackendError, match="ws is an option of the wgmma kernel"):
        tb.bmm_a16wfp4(x, codes, scales, config=tb.BmmConfig(64, 64, 64, 4, 2, 0, ws=True))


_COMPILER = textwrap.dedent(
    r"""
    import dataclasses, json, re, subprocess, sys, tempfile, traceback
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from glm_pack.runtime.kernels import gluon_bmm as gb

    def facts(bm, bn, bk, warps, schedule, K, act, ws, per_sm, round_warps, plain):
        p = gb.plan(bm, bn, bk, warps, schedule, K, 232448, ws=ws, round_warps=round_warps)
        if schedule == "swap" and not ws:  # a launch that swap_workers leaves without worker warps
            p = dataclasses.replace(p, ws=False)
        decode, swap = schedule in gb.FROM_CODES, schedule == "swap"
        def desc(block):
            return f"tensordesc<bf16{block},{gb._smem_layout(tuple(block))!r}>"
        weights = {"c_ptr": "*u8" if decode else "*bf16", "s_ptr": "*u8" if decode else "*bf16", "stride_cb": "i32",
                   "stride_cn": "i32", "stride_sb": "i32", "stride_sn": "i32", "M": "i32", "N": "i32"}
        y_desc = "constexpr" if plain else desc([1, bm, gb.y_columns(bm, bn)])
        y = {"y_ptr": "*bf16", "stride_yb": "i32", "stride_ym": "i32"}
        if swap:  # the parameters in each kernel's order
            sig = {"x_desc": desc([1, bm, bk]), "y_desc": y_desc, **weights, **y}
        else:
            sig = {"x_desc": desc([1, bm, bk]), "w_desc": "constexpr" if decode else desc([1, bn, bk]),
                   "y_desc": y_desc, **weights, "SPLITS": "i32", **y}
        consts = gb.kernel_constants(p, K, act, per_sm, plain)  # what a launch passes
        options = {"num_warps": consts["num_warps"]}
        if "maxnreg" in consts:
            options["maxnreg"] = consts.pop("maxnreg")
        consts.update({n: None for n in ("w_desc", "y_desc") if sig.get(n) == "constexpr"})
        sig.update(dict.fromkeys(consts, "constexpr"))
        # pointers, strides and N as a launch specializes them (multiples of 16): codes and y in 16-byte vectors;
        # plain stores of one value a thread are for a y off 16 bytes
        aligned = ("c_ptr", "s_ptr", "stride_cb", "stride_cn", "N") + (() if plain == 1 else
                                                                         ("y_ptr", "stride_yb", "stride_ym"))
        attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = GluonASTSource(fn=gb._swap_kernel if swap else gb._bmm_kernel, signature=sig, constexprs=consts,
                             attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = k.asm["ptx"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            cuobjdump = triton.knobs.nvidia.cuobjdump.path  # Triton's own, or TRITON_CUOBJDUMP_PATH's
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        ins = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+([^;]*);", sass, re.M)
        code_loads = [i for i, t in enumerate(ins) if re.search(r"LDG\.E\.(64|128)\b", t)]  # the codes' vectors
        return {"stack": int(re.search(r"STACK:(\d+)", usage).group(1)), "shared": k.metadata.shared,
                "warps": k.metadata.num_warps, "stages": p.stages, "maxnreg": options.get("maxnreg"),
                "setmaxnreg": ptx.count("setmaxnreg"),
                "estimate": gb.smem_bytes(bm, bn, bk, K, schedule, p.stages),
                "wgmma": ptx.count("wgmma.mma_async"), "prmt": ptx.count("prmt.b32"),
                "byte_loads": ptx.count("ld.global.b8") + ptx.count("ld.global.u8"),
                "code_loads": len(code_loads), "identities": ptx.count("0x3210;"),
                "y_tma_stores": ptx.count("cp.async.bulk.tensor.3d.global.shared"),
                "y_vector_stores": ptx.count("st.global.v4.b32"), "y_b16_stores": ptx.count("st.global.b16"),
                "prmt_between_code_loads": sum("PRMT" in t for t in ins[code_loads[0]:code_loads[-1]])
                if code_loads else 0,
                "cubin": len(k.asm["cubin"])}
    for line in sys.stdin:  # one JSON list of facts' arguments a line; one answer line each
        try:
            answer = {"facts": facts(*json.loads(line))}
        except Exception:
            answer = {"error": traceback.format_exc()}
        print(ANSWER + json.dumps(answer), flush=True)
    """
)


ANSWER = "facts: "  # what starts the compiler's answer lines (Triton or ptxas may print lines of their own)


@pytest.fixture(scope="module")
def compile_sm90(tmp_path_factory):
    """``compile_sm90(tiles, schedule, K, act, ws, per_sm, round_warps=4, plain_y=0) -> dict``: the facts
    :data:`_COMPILER` gives about the real kernel compiled for sm_90a, by one process for the whole module
    (without ``TRITON_INTERPRET``; Triton and torch are imported once, not once a kernel). A kernel that fails to
    compile fails its test only; the process answers the next."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    log = tmp_path_factory.mktemp("compiler") / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", f"ANSWER = {ANSWER!r}\n" + _COMPILER], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
    answers: queue.Queue = queue.Queue()

    def read_answers():
        for line in proc.stdout:
            if line.startswith(ANSWER):
                answers.put(json.loads(line[len(ANSWER) :]))
        answers.put(None)  # the process has ended

    threading.Thread(target=read_answers, daemon=True).start()

    def compile_(tiles, schedule, K, act, ws, per_sm, round_warps=4, plain_y=0) -> dict:
        proc.stdin.write(json.dumps([*tiles, schedule, K, act, ws, per_sm, round_warps, plain_y]) + "\n")
        proc.stdin.flush()
        try:
            answer = answers.get(timeout=300)
        except queue.Empty:
            pytest.fail("no answer from the compiler process in 300 s")
        assert answer is not None, f"the compiler process died: {log.read_text()[-3000:]}"
        assert "error" not in answer, answer["error"][-3000:]
        return answer["facts"]

    yield compile_
    proc.stdin.close()
    proc.wait(timeout=60)


def test_256_deep_k_steps_compile_without_spilling_in_the_rounding_warps(compile_sm90):
    """64 x 64 x 256 decode tiles with rounding warps (K-up 256's default at 64 tokens and 16 heads in session
    9, a sweep candidate since): each rounding thread holds 128 values of x in its 96 registers, which the PTX
    rounding leaves room for (with the Triton-op rounding this kernel spilled 256 bytes of stack, and ran 7.41
    instead of 4.70 us on the H200)."""
    got = compile_sm90((64, 64, 256, 4), "decode", 256, True, True, 1)
    assert got["warps"] == 4 + gb.ROUND_WARPS and got["stack"] == 0


@pytest.mark.parametrize(
    "tiles, schedule, K, act, ws, per_sm",
    [((128, 256, 64, 8), "decode", 192, True, True, 1), ((128, 256, 64, 8), "decode", 256, True, True, 1),
     ((128, 256, 64, 8), "decode", 256, True, False, 1), ((64, 128, 64, 8), "decode", 256, True, False, 1),
     ((128, 128, 64, 8), "decode", 512, True, False, 1), ((128, 256, 64, 8), "stationary", 256, True, True, 1),
     ((128, 256, 64, 8), "streaming", 512, True, True, 1), ((128, 256, 64, 8), "streaming", 512, True, False, 1),
     ((128, 256, 64, 8), "streaming", 512, False, True, 1), ((64, 64, 64, 4), "decode", 192, True, True, 1),
     ((64, 128, 64, 8), "decode", 192, True, True, 2)],
    ids=["kup192-decode-ws", "kup256-decode-ws", "kup256-decode", "kup256-decode-64rows", "vup-decode-128cols",
         "kup256-stationary-ws", "vup-streaming-ws", "vup-streaming", "vup-streaming-none", "kup192-decode-4warps-ws",
         "kup192-decode-ws-2-per-sm"],
)  # fmt: skip
def test_kernel_compiles_for_sm90_within_shared_memory(tiles, schedule, K, act, ws, per_sm, compile_sm90):
    """The real kernel, compiled for sm_90a by Triton's bundled ptxas on this machine (no GPU needed): it
    builds with the warps asked for (plus :data:`ROUND_WARPS` rounding warps with ``ws`` and mxfp4
    activations, two partitions of them where :func:`round_partitions` says so, their registers rebalanced
    within the 65536 of a multiprocessor), the wgmma instructions (and
    for ``decode`` the byte-table lookups) are there, and its shared memory is within the H200's limit and the
    planner's estimate."""
    got = compile_sm90(tiles, schedule, K, act, ws, per_sm)
    assert got["wgmma"] >= 1 and got["cubin"] > 0
    if act and ws:
        parts = gb.round_partitions(gb.plan(*tiles, schedule, K, H200_SMEM, ws=True), K, True, per_sm)
        assert got["warps"] == tiles[3] + parts * gb.ROUND_WARPS and got["setmaxnreg"] > 0
        assert got["warps"] * 32 * got["maxnreg"] * per_sm <= 65536
    else:
        assert got["warps"] == tiles[3] and got["maxnreg"] is None and got["setmaxnreg"] == 0
    assert (got["prmt"] > 0) == (schedule == "decode")
    assert got["shared"] <= got["estimate"] <= H200_SMEM
    assert (got["shared"] + 1024) * per_sm <= H200_SMEM + 1024
    assert got["stages"] == 4


def test_two_rounding_partitions_only_for_one_warpgroup_decoding_alone_with_several_k_steps():
    """:func:`round_partitions`: 2 for a ``decode`` program of 4 MMA warps with 4 rounding warps, more than one K
    step and one program a multiprocessor (K-up 192's 64 x 64 x 64 tiles at 16 heads, V-up's 64 x 128 x 128 at
    64); 1 with two programs a multiprocessor, 8 MMA or 8 rounding warps, one K step, no rounding warps, or
    another schedule."""
    def parts(tiles, K, ws=True, per_sm=1, schedule="decode", round_warps=4):
        return gb.round_partitions(gb.plan(*tiles, schedule, K, H200_SMEM, ws=ws, round_warps=round_warps), K, ws,
                                   per_sm)  # fmt: skip

    assert parts((64, 64, 64, 4), 192) == 2 and parts((64, 128, 128, 4), 512) == 2
    assert parts((64, 128, 64, 4), 192, per_sm=2) == 1 and parts((64, 128, 64, 8), 192) == 1
    assert parts((64, 128, 64, 4), 192, round_warps=8) == 1 and parts((64, 64, 256, 4), 256) == 1
    assert parts((64, 64, 64, 4), 192, ws=False) == 1 and parts((32, 64, 256, 4), 512, schedule="swap") == 1


def test_decode_kernel_with_two_rounding_partitions_compiles_for_sm90(compile_sm90):
    """K-up 192's 16-head 64-row default (64 x 64 x 64, 4 MMA warps, three K steps) with two partitions of 4
    rounding warps, compiled for sm_90a here: 12 warps under a cap of 65536 / 384 registers, no stack."""
    got = compile_sm90((64, 64, 64, 4), "decode", 192, True, True, 1)
    assert got["warps"] == 12 and got["maxnreg"] == 168 and got["stack"] == 0 and got["setmaxnreg"] > 0


def test_swap_plans_one_stage_per_k_step_at_most_and_always_rounding_warps():
    """A swap program owns one tile: its x ring needs no more stages than K steps (V-up at 256-deep steps: 2, K-up
    256: 1), and no weights in shared memory (hand counts: stages x rows x block_k x 2 bytes, the whole
    rows x block_n y tile, 1 KiB slack); its worker warps always run (they reorder x's K), ws asked or not."""
    vup = gb.plan(32, 64, 256, 4, "swap", 512, H200_SMEM)
    kup = gb.plan(16, 128, 256, 8, "swap", 256, H200_SMEM)
    many = gb.plan(16, 64, 64, 4, "swap", 512, H200_SMEM)
    assert (vup.stages, kup.stages, many.stages) == (2, 1, gb.MAX_STAGES)
    assert vup.ws and kup.ws and many.ws
    assert gb.smem_bytes(32, 64, 256, 512, "swap", 2) == 2 * 32 * 256 * 2 + 32 * 64 * 2 + 1024
    assert gb.kernel_constants(vup, 512, False)["maxnreg"] == 255  # 8 warps (act "none" too): 256, capped
    assert gb.plan(64, 64, 256, 4, "swap", 512, 60_000).stages == 1  # less memory: fewer stages, down to one
    assert gb.plan(64, 64, 256, 4, "swap", 512, 30_000) is None


@pytest.mark.parametrize(
    "tiles, K, act, per_sm, round_warps, scale_loads",
    [((32, 64, 256, 4), 512, True, 1, 4, 2 * 2 * 2), ((16, 128, 256, 8), 256, True, 1, 4, 1 * 2 * 2),
     ((16, 64, 32, 4), 192, False, 1, 4, 6 * 2 * 1), ((64, 64, 64, 4), 192, True, 2, 4, 3 * 2 * 1),
     ((64, 128, 256, 8), 512, True, 1, 8, 2 * 2 * 2), ((64, 256, 128, 16), 256, True, 1, 4, 2 * 2 * 1),
     ((64, 128, 128, 8), 512, True, 1, 4, 4 * 2 * 1)],
    ids=["vup-32x64x256", "kup256-16x128x256", "kup192-16x64x32-none", "kup192-64x64x64-2-per-sm",
         "vup-64x128x256-8-rounding-warps", "kup256-64x256x128-four-warpgroups", "vup-64x128x128"],
)  # fmt: skip
def test_swap_kernel_compiles_for_sm90_with_its_weights_in_registers(tiles, K, act, per_sm, round_warps,
                                                                     scale_loads, compile_sm90):  # fmt: skip
    """The swap kernel compiled for sm_90a here: MMA warps plus the worker warps (also with ``act_quant="none"``:
    they reorder x), registers within the multiprocessor's 65536, no stack (the decoded A operand and the
    column's codes stay in registers), and shared memory within the estimate, which counts only the x ring and
    the y tile: moving the decoded weights to the MMA's register layout through shared memory (a 16-64 KiB
    scratch tile) would exceed it. The only byte loads are the scales' (hand counts: per K step, a thread's two
    rows r and r + 8 times the 32-blocks of its run of block_k / 4 k, at least one); codes come in vectors."""
    got = compile_sm90(tiles, "swap", K, act, True, per_sm, round_warps, plain_y=8)
    assert got["warps"] == tiles[3] + round_warps and got["setmaxnreg"] > 0 and got["stack"] == 0
    assert got["warps"] * 32 * got["maxnreg"] * per_sm <= 65536
    assert got["wgmma"] >= 1 and got["prmt"] > 0 and got["byte_loads"] == scale_loads
    assert got["shared"] <= got["estimate"] and got["stages"] == min(gb.MAX_STAGES, K // tiles[2])
    assert got["y_tma_stores"] == 0 and got["y_vector_stores"] == tiles[0] * tiles[1] // (8 * 32 * tiles[3])


@pytest.mark.parametrize(
    "tiles, act", [((32, 64, 256, 4), True), ((32, 64, 256, 4), False), ((32, 128, 256, 8), False),
                   ((16, 128, 256, 8), True)],
    ids=["kup256-32x64x256", "kup256-32x64x256-none", "kup256-32x128x256-none", "kup256-16x128x256-half-blocks"],
)  # fmt: skip
def test_one_step_swap_kernel_compiles_for_sm90_without_worker_warps(tiles, act, compile_sm90):
    """The swap kernel as launched where :func:`swap_workers` drops the worker warps (K-up 256's one 256-deep K
    step), compiled for sm_90a here: only the MMA warps, which round or reorder x themselves (with 16 rows a
    thread holds half a 32-block), no register rebalancing, no stack, and shared memory within the estimate."""
    got = compile_sm90(tiles, "swap", 256, act, False, 1)
    assert got["warps"] == tiles[3] and got["maxnreg"] is None and got["setmaxnreg"] == 0 and got["stack"] == 0
    assert got["wgmma"] >= 1 and got["prmt"] > 0 and got["stages"] == 1
    assert got["shared"] <= got["estimate"]
    assert got["y_tma_stores"] == 1 and got["y_vector_stores"] == 0  # these launches' many programs: y by TMA


@pytest.mark.parametrize("plain", [8, 1, 0], ids=["plain", "plain-unaligned", "tma"])
@pytest.mark.parametrize("tiles, sites", [((64, 64, 64, 4), 2), ((128, 256, 64, 8), 1)],
                         ids=["64x64x64", "128x256x64-halves"])  # fmt: skip
def test_decode_kernel_writes_y_plainly_or_by_tma(tiles, sites, plain, compile_sm90):
    """The ``decode`` kernel compiled for sm_90a here with y written by plain stores (:func:`plain_y`) or by
    TMA: with plain stores no bulk tensor store is left, and y leaves in 16-byte vector stores, or, for a y off 16
    bytes, in 2-byte stores, hand count: the ``[BM, BN]`` tile over the MMA warps' threads, 8 values each (in two
    halves at 128 rows, :func:`y_columns`), or one value a store, per call site (one warpgroup: the first tile's K
    steps, decoding as they go, are unrolled before the loop; two decode the column first, :func:`decode_first`);
    with TMA one bulk store per half and site, no vector stores. None uses a stack or more shared memory than the
    estimate, which counts the y buffer (the 16-byte plain path moves the tile through shared memory the compiler
    allocates instead; the 2-byte one through the y buffer)."""
    got = compile_sm90(tiles, "decode", 192, True, True, 1, plain_y=plain)
    halves = tiles[1] // gb.y_columns(tiles[0], tiles[1])
    per_thread = sites * tiles[0] * tiles[1] // (32 * tiles[3])
    if plain:
        assert got["y_tma_stores"] == 0
        want = (per_thread // 8, 0) if plain == 8 else (0, per_thread)
        assert (got["y_vector_stores"], got["y_b16_stores"]) == want
    else:
        assert got["y_tma_stores"] == sites * halves and got["y_vector_stores"] == got["y_b16_stores"] == 0
    assert got["stack"] == 0 and got["shared"] <= got["estimate"]


def test_y_is_stored_plainly_by_programs_of_one_small_tile_all_running_at_once():
    """:func:`plain_y`: plain stores of 16 bytes a thread for programs of one tile of at most 64 rows where there
    are no more programs than multiprocessors; TMA (0) for programs of several tiles (their stores overlap the next
    tile), 128-row tiles, or more programs than multiprocessors; plain stores of one value a thread for any
    launch whose y is no TMA target."""
    launches = [(1, 64, 128, 132), (1, 32, 132, 132), (1, 16, 1, 132), (2, 64, 128, 132), (1, 128, 128, 132),
                (1, 64, 133, 132)]  # fmt: skip
    assert [gb.plain_y(*launch) for launch in launches] == [8, 8, 8, 0, 0, 0]
    assert [gb.plain_y(*launch, False) for launch in launches] == [1] * 6


def test_swap_launches_drop_their_workers_only_for_one_k_step_and_more_programs_than_two_a_multiprocessor():
    """Worker warps stay wherever a swap program has several K steps (their rounding of step k + 1 overlaps the
    MMAs of step k); with one step they go for ``act_quant="none"`` (they would only reorder x) and where the
    programs exceed two per multiprocessor (K-up 256 at 64 heads and 32 rows: 512 programs on the H200's 132;
    at 32 heads, 256 programs, they stay: there the workers' rounding was faster)."""
    sms = 132
    assert gb.swap_workers(2, True, 2048, sms) and gb.swap_workers(3, False, 128, sms)
    assert gb.swap_workers(1, True, 2 * sms, sms) and gb.swap_workers(1, True, 128, sms)
    assert not gb.swap_workers(1, True, 2 * sms + 1, sms) and not gb.swap_workers(1, True, 512, sms)
    assert not gb.swap_workers(1, False, 128, sms)


def test_swap_launches_keep_eight_rounding_warps_only_where_their_programs_run_at_once():
    """8 rounding warps leave a swap program alone on its multiprocessor, so a launch asking for them keeps them
    only where its programs are no more than the multiprocessors (V-up 16 heads T = 64: 128 programs on the
    H200's 132) and takes 4 beyond (24 heads: 192), where two programs can share one; 4 stay 4."""
    sms = 132
    assert gb.swap_round_warps(8, 128, sms) == 8 and gb.swap_round_warps(8, sms, sms) == 8
    assert gb.swap_round_warps(8, sms + 1, sms) == 4 and gb.swap_round_warps(8, 192, sms) == 4
    assert gb.swap_round_warps(4, 64, sms) == gb.swap_round_warps(4, 512, sms) == 4


@pytest.mark.parametrize(
    "tiles, K, per_sm, round_warps, first",
    [((32, 64, 256, 4), 512, 1, 4, True), ((32, 64, 64, 4), 192, 1, 4, True), ((64, 64, 256, 4), 512, 1, 8, True),
     ((32, 64, 256, 4), 512, 2, 4, False), ((64, 128, 256, 8), 512, 1, 8, False)],
    ids=["vup-32x64x256", "kup192-32x64x64", "vup-64x64x256-rw8", "vup-32x64x256-2-per-sm", "vup-64x128x256-w8"],
)  # fmt: skip
def test_swap_programs_of_one_warpgroup_alone_load_every_k_steps_codes_before_decoding(tiles, K, per_sm, round_warps,
                                                                                        first,
                                                                                        compile_sm90):  # fmt: skip
    """The SASS of the swap kernel compiled for sm_90a here: where :func:`swap_codes_first` says so (one MMA
    warpgroup, several K steps, one program a multiprocessor) no decode instruction (``PRMT``) comes between
    the column's first and last code loads, so every K step's codes are in flight before step 0 is decoded;
    elsewhere ptxas puts step 0's decode before the later steps' loads, which is what the rule works around,
    and the identity PTX is absent. Hand counts, per K step and thread: two rows, each a run of ``block_k / 8``
    code bytes: that many over 16 loads of 16 bytes (one of 8 at 64-deep steps), and ``block_k / 32`` words
    through the identity for each later step."""
    bk = tiles[2]
    steps = K // bk
    assert gb.swap_codes_first(tiles[3], steps, per_sm) == first
    got = compile_sm90(tiles, "swap", K, True, True, per_sm, round_warps)
    assert got["code_loads"] == steps * 2 * max(1, bk // 128) and got["stack"] == 0
    assert got["identities"] == ((steps - 1) * 2 * bk // 32 if first else 0)
    assert (got["prmt_between_code_loads"] == 0) == first


def test_swap_codes_come_first_only_for_one_warpgroup_with_several_k_steps_alone_on_a_multiprocessor():
    """The rule itself: 4 MMA warps, more than one K step, one program a multiprocessor."""
    assert gb.swap_codes_first(4, 2, 1) and gb.swap_codes_first(4, 3, 1)
    assert not gb.swap_codes_first(4, 1, 1) and not gb.swap_codes_first(4, 2, 2)
    assert not gb.swap_codes_first(8, 2, 1) and not gb.swap_codes_first(16, 2, 1)


@pytest.mark.parametrize(
    "tiles, K, act", [((64, 256, 128, 4), 256, True), ((64, 128, 64, 4), 192, True), ((128, 128, 128, 8), 512, False)],
    ids=["kup256-64x256x128", "kup192-64x128x64", "vup-128x128x128-none"],
)  # fmt: skip
def test_xreg_kernel_compiles_for_sm90_with_x_in_registers(tiles, K, act, compile_sm90):
    """The xreg schedule compiled for sm_90a here: only the MMA warps (no rounding warps, no register
    rebalancing), no stack (two x tiles and the accumulator in registers), the weight decode there, and shared
    memory within the estimate, which counts the column, the x ring and the y tile only: taking x into the A
    operand's layout through shared memory (a scratch tile) would exceed it."""
    got = compile_sm90(tiles, "xreg", K, act, False, 1)
    assert got["warps"] == tiles[3] and got["maxnreg"] is None and got["setmaxnreg"] == 0 and got["stack"] == 0
    assert got["wgmma"] >= 1 and got["prmt"] > 0
    assert got["shared"] <= got["estimate"] <= H200_SMEM


def test_two_programs_share_a_multiprocessor_only_where_there_are_more_and_both_fit():
    # K-up 192 at 64 x 128: 4 x 8 KiB x + 3 x 16 KiB column + 16 KiB y + 1 KiB slack = 97 KiB, twice
    # (with 1 KiB reserved each) within the 228 KiB of an sm_90 multiprocessor; at K = 512 (8 x 16 KiB
    # column) one program takes 161 KiB
    kup = gb.plan(64, 128, 64, 8, "decode", 192, H200_SMEM, ws=True)
    vup = gb.plan(64, 128, 64, 8, "decode", 512, H200_SMEM, ws=True)
    assert gb.smem_bytes(64, 128, 64, 192, "decode", kup.stages) == 4 * 8192 + 3 * 16384 + 16384 + 1024
    assert gb.programs_per_sm(kup, 192, 256, 132, H200_SMEM) == 2
    assert gb.programs_per_sm(kup, 192, 132, 132, H200_SMEM) == 1  # one wave: every program has its own
    assert gb.programs_per_sm(vup, 512, 256, 132, H200_SMEM) == 1
    # with two per multiprocessor, rounding warps and all, the registers are capped to share the 65536
    assert gb.kernel_constants(kup, 192, True, 2)["maxnreg"] == 65536 // (2 * 12 * 32) // 8 * 8 == 80
    assert gb.kernel_constants(kup, 192, True, 1)["maxnreg"] == 168
    assert "maxnreg" not in gb.kernel_constants(kup, 192, False, 2)  # no rounding warps without mxfp4


def test_two_programs_fit_up_to_exactly_the_shared_memory_of_two():
    """Two programs share a multiprocessor while twice a program's shared memory plus its 1 KiB system reserve fits
    ``smem`` plus one reserve, down to the byte; one byte less and each runs alone."""
    p = gb.plan(64, 128, 64, 8, "decode", 192, H200_SMEM, ws=True)
    need = gb.smem_bytes(64, 128, 64, 192, "decode", p.stages) + 1024
    assert gb.programs_per_sm(p, 192, 256, 132, 2 * need - 1024) == 2
    assert gb.programs_per_sm(p, 192, 256, 132, 2 * need - 1025) == 1


def test_register_error_allows_an_accumulator_that_exactly_meets_the_cap():
    """8 MMA warps with 8 rounding warps: 65536 / (16 * 32) = 128 registers a thread; a 128 x 192 accumulator needs
    96 of them plus the 32 of headroom (fits exactly), 128 x 224 needs 112 + 32 (does not)."""
    assert gb.register_error(128, 192, 8, 8) == ""
    assert gb.register_error(128, 224, 8, 8) == "8 MMA warps with 8 rounding warps: 128 registers a thread, 144 needed"


def test_programs_of_more_than_twelve_warps_run_alone():
    """Two programs of 16 MMA + 4 rounding warps (swap, 64 x 256) or 8 + 8 would leave each thread 48 or 64
    registers: such programs get a multiprocessor each however many there are and however little shared memory
    they take (32 KiB x ring + 32 KiB y here)."""
    wide = gb.plan(64, 256, 128, 16, "swap", 256, H200_SMEM)
    assert gb.smem_bytes(64, 256, 128, 256, "swap", wide.stages) == 2 * 64 * 128 * 2 + 64 * 256 * 2 + 1024
    assert gb.programs_per_sm(wide, 256, 512, 132, H200_SMEM) == 1
    assert gb.kernel_constants(wide, 256, True, 1)["maxnreg"] == 65536 // (20 * 32) // 8 * 8 == 96
    eight = gb.plan(64, 128, 64, 8, "decode", 192, H200_SMEM, ws=True, round_warps=8)
    assert gb.programs_per_sm(eight, 192, 256, 132, H200_SMEM) == 1  # 8 + 4 warps share (above), 8 + 8 do not
    narrow = gb.plan(32, 128, 64, 8, "swap", 192, H200_SMEM)
    assert gb.programs_per_sm(narrow, 192, 256, 132, H200_SMEM) == 2


def test_programs_pair_only_where_the_register_cap_leaves_the_accumulator_room(compile_sm90):
    """4 MMA warps of 64 x 128 (64 fp32 accumulator registers a thread) with 8 rounding warps: two programs
    would cap every thread at 80 registers, under which ptxas refuses the MMA warps' code (it asked for 90),
    so they run alone, and compile; at 64 x 64 (32 registers) two share a multiprocessor and compile under the
    cap. Shared memory holds two of either (97 and 65 KiB)."""
    wide = gb.plan(64, 128, 64, 4, "decode", 192, H200_SMEM, ws=True, round_warps=8)
    narrow = gb.plan(64, 64, 64, 4, "decode", 192, H200_SMEM, ws=True, round_warps=8)
    assert gb.register_cap(12, 2) == 80 and gb.register_cap(12, 1) == 168
    assert gb.register_error(64, 128, 4, 8, 2) == "4 MMA warps with 8 rounding warps: 80 registers a thread, 96 needed"
    assert not gb.register_error(64, 128, 4, 8, 1) and not gb.register_error(64, 64, 4, 8, 2)
    for p, tiles, programs, per_sm in ((wide, (64, 128, 64, 4), 256, 1), (narrow, (64, 64, 64, 4), 512, 2)):
        assert 2 * (gb.smem_bytes(*tiles[:3], 192, "decode", p.stages) + 1024) <= H200_SMEM + 1024
        assert gb.programs_per_sm(p, 192, programs, 132, H200_SMEM) == per_sm
        got = compile_sm90(tiles, "decode", 192, True, True, per_sm, 8)
        assert got["stack"] == 0 and got["warps"] == 12 and got["maxnreg"] == gb.register_cap(12, per_sm)


def test_only_two_warpgroup_programs_with_rounding_warps_decode_their_column_first():
    """The compile-time choice behind the interleaved decode: programs with rounding warps and 8 MMA warps decode
    the whole weight column before their first MMA; 4-warp programs, and every program without rounding warps
    (``ws`` off, or activations not rounded), decode K step by K step during their first tile."""
    w8 = gb.plan(64, 128, 64, 8, "decode", 192, H200_SMEM, ws=True)
    w4 = gb.plan(64, 64, 64, 4, "decode", 192, H200_SMEM, ws=True)
    assert gb.kernel_constants(w8, 192, True)["DECODE_FIRST"]
    assert not gb.kernel_constants(w8, 192, False)["DECODE_FIRST"]  # act_quant "none": no rounding warps
    assert not gb.kernel_constants(w4, 192, True)["DECODE_FIRST"]
    assert not gb.kernel_constants(dataclasses.replace(w8, ws=False), 192, True)["DECODE_FIRST"]


_GPU_CONFIGS = {
    "stationary": tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma="stationary"),
    "streaming": tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma="streaming"),
    "decode": tb.BmmConfig(128, 256, 64, 8, 3, 0, wgmma="decode"),
    "decode-128cols": tb.BmmConfig(128, 128, 64, 8, 3, 0, wgmma="decode"),
    "decode-64rows": tb.BmmConfig(64, 128, 64, 8, 3, 0, wgmma="decode"),
    "decode-64x64": tb.BmmConfig(64, 64, 64, 4, 3, 0, wgmma="decode"),
    "stationary-ws": tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma="stationary", ws=True),
    "streaming-ws": tb.BmmConfig(128, 256, 64, 8, 3, 0, predecode=True, tma=True, wgmma="streaming", ws=True),
    "decode-ws": tb.BmmConfig(128, 256, 64, 8, 3, 0, wgmma="decode", ws=True),
    "decode-64rows-ws": tb.BmmConfig(64, 128, 64, 8, 3, 0, wgmma="decode", ws=True),
    "decode-64x64-ws": tb.BmmConfig(64, 64, 64, 4, 3, 0, wgmma="decode", ws=True),
    "decode-64x128-rw8": tb.BmmConfig(64, 128, 64, 4, 3, 0, wgmma="decode", ws=True, round_warps=8),
    "swap-32x64": tb.BmmConfig(32, 64, 64, 4, 1, 0, wgmma="swap"),
    "swap-16x128": tb.BmmConfig(16, 128, 32, 8, 1, 0, wgmma="swap"),
    "swap-64x64": tb.BmmConfig(64, 64, 64, 4, 1, 0, wgmma="swap"),
    "swap-32x64-rw8": tb.BmmConfig(32, 64, 64, 4, 1, 0, wgmma="swap", round_warps=8),
    "swap-64x256-w16": tb.BmmConfig(64, 256, 64, 16, 1, 0, wgmma="swap"),
    "xreg-64x128": tb.BmmConfig(64, 128, 64, 4, 3, 0, wgmma="xreg"),
    "xreg-128x128-w8": tb.BmmConfig(128, 128, 64, 8, 3, 0, wgmma="xreg"),
}


def _rule_on_gpu(monkeypatch, rule: str, cfg: tb.BmmConfig, B: int, M: int, N: int, K: int, offset: int = 0) -> list:
    """Run ``cfg`` on fresh inputs through the runtime's strided view of GLM's q rows (256 wide for K-up, as
    wide as K for V-up; mxfp4, then none; output poisoned, ``offset`` elements into its rows) and check it
    against the reference and that nothing outside out was written; returns ``(arguments, result)`` of each
    call of the launch rule ``gluon_bmm.<rule>``."""
    decisions = []
    real = getattr(gb, rule)
    monkeypatch.setattr(gb, rule, lambda *a: decisions.append((a, real(*a))) or decisions[-1][1])
    codes, scales = weights(B, N, K, seed=M + N)
    x = activations(M, B, K, seed=N, row=max(K, 256))
    for act_quant in ("mxfp4", "none"):
        buf, out = poisoned_out(M, B, N, offset=offset)
        tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out, config=cfg)
        assert torch.isnan(buf[..., :offset]).all() and torch.isnan(buf[..., offset + N :]).all()
        assert_close_to_reference(out, x, codes, scales, act_quant)
    return decisions


def _launches(monkeypatch) -> list:
    """Record the plan of every Gluon launch prepared (then prepare it for real)."""
    launched = []
    real = gb.prepare
    monkeypatch.setattr(gb, "prepare", lambda x, out, act, p, **kw: launched.append(p) or real(x, out, act, p, **kw))
    return launched


@sm90_only
@pytest.mark.parametrize("name", list(_GPU_CONFIGS))
@pytest.mark.parametrize(
    "B, M, N, K, row",
    [(16, 300, 512, 192, 256), (16, 300, 512, 256, 256), (16, 300, 256, 512, 512), (3, 1000, 80, 192, 256),
     (1, 5000, 256, 256, 256), (7, 129, 512, 128, 128)],
)  # fmt: skip
def test_matches_reference_on_gpu(B, M, N, K, row, name, monkeypatch):
    """Every schedule on GLM shapes and ragged ones (M and N not multiples of the tiles, programs without
    tiles when a column's M tiles do not split evenly), through the runtime's strided views. Where the weight column
    leaves no room, a Triton kernel serves the config's tiles, or with the activation rounding refuses them as
    unsafe (Triton 3.6's code for 8 warps in 3 stages on sm_90)."""
    launched = _launches(monkeypatch)
    codes, scales = weights(B, N, K, seed=M + N)
    x = activations(M, B, K, seed=K, row=row)
    cfg = _GPU_CONFIGS[name]
    ran = []
    for act_quant in ("mxfp4", "none"):
        buf, out = poisoned_out(M, B, N)
        ran.append(ran_or_refused_as_unsafe(x, codes, scales, act_quant, buf, out, cfg))
        if ran[-1]:
            assert torch.isnan(buf[..., N:]).all()
            assert_close_to_reference(out, x, codes, scales, act_quant)
    smem = gb.smem_limit(x.device)
    if gb.plan(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.wgmma, K, smem) is None:
        assert not launched  # no room for the weight column: a Triton kernel served
    else:
        assert all(ran)  # the Gluon kernels' code has no such hazard
        assert launched and launched[0].schedule == cfg.wgmma and launched[0].ws == (cfg.ws or cfg.wgmma == "swap")
        assert launched[0].round_warps == cfg.round_warps


@sm90_only
@pytest.mark.parametrize("B, M, N", [(64, 300, 512), (5, 3300, 200)])
def test_xreg_default_matches_reference_on_gpu(B, M, N, monkeypatch):
    """K-up 256's default above :data:`XREG_MIN_ROWS` rows (128-deep K steps: whole 32-blocks of x per thread),
    on GLM's shape and a ragged one (N not a multiple of the 256-column tiles, M of the 64 rows)."""
    launched = _launches(monkeypatch)
    codes, scales = weights(B, N, 256, seed=M)
    x = activations(M, B, 256, seed=N, row=256)
    for act_quant in ("mxfp4", "none"):
        buf, out = poisoned_out(M, B, N)
        tb.bmm_a16wfp4(x, codes, scales, act_quant=act_quant, out=out)
        assert torch.isnan(buf[..., N:]).all()
        assert_close_to_reference(out, x, codes, scales, act_quant)
    assert [p.schedule for p in launched] == ["xreg", "xreg"] and not launched[0].ws


@sm90_only
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2**127 -> Inf, in numpy
@pytest.mark.parametrize("cfg", [tb.BmmConfig(64, 256, 128, 4, 3, 0, wgmma="xreg"),
                                 tb.BmmConfig(64, 128, 64, 4, 3, 0, wgmma="xreg")], ids=["whole-blocks", "half-blocks"])
def test_xreg_rounds_x_in_registers_like_the_reference(cfg, monkeypatch):
    """Identity weights make y the rounded x itself, so the MMA warps' in-register rounding (a thread holding a
    32-block's k, or half of it at 64-deep K steps) must give the reference round trip bit for bit, on the
    round-trip test's blocks: both paths of the PTX rounding (scales below 2**120 and from it). Left out: blocks
    with NaN or Inf before or after rounding (times the identity's zeros they spread NaN over the row) and
    blocks of bf16-subnormal results (the module's documented corner case)."""
    launched = _launches(monkeypatch)
    blocks = round_trip_blocks()
    amax = blocks.float().abs().amax(dim=1)
    keep = blocks.isfinite().all(dim=1) & round_trip_reference(blocks).isfinite().all(dim=1)
    keep &= (amax == 0) | (amax >= 2.0**-100)
    assert (block_scales(blocks[keep]) >= 120).any()
    B, K = 2, 256
    flat = blocks[keep].reshape(-1)
    rows = -(-flat.numel() // (B * K))
    x = torch.zeros(B * rows * K, dtype=torch.bfloat16)
    x[: flat.numel()] = flat
    x = x.reshape(B, rows, K).cuda()
    codes, scales = identity_weights(B, K)
    y = tb.bmm_a16wfp4(x, codes, scales, act_quant="mxfp4", config=cfg)
    assert launched and launched[0].schedule == "xreg"
    assert torch.equal(y.cpu(), round_trip_reference(x))  # -0.0 == 0.0; everything else bit for bit


@sm90_only
@pytest.mark.parametrize("name, per_sm", [("decode-64rows-ws", 2), ("decode-64rows", 2), ("decode-64x128-rw8", 1)])
def test_two_programs_per_multiprocessor_on_gpu(name, per_sm, monkeypatch):
    """K-up 192 at 64 heads and 64 rows: 256 programs of 64 x 128 tiles, more than the GPU's multiprocessors,
    two of which fit in one's shared memory: the launch pairs them (with rounding warps, under a shared
    register cap) and the result is still exact; 4 MMA warps with 8 rounding warps run alone (two would leave
    too few registers to compile) and are exact too."""
    decisions = _rule_on_gpu(monkeypatch, "programs_per_sm", _GPU_CONFIGS[name], 64, 64, 512, 192)
    assert [shares for _, shares in decisions] == [per_sm, per_sm]


@sm90_only
@pytest.mark.parametrize(
    "cfg", [tb.BmmConfig(32, 64, 256, 4, 1, 0, wgmma="swap"), tb.BmmConfig(32, 128, 256, 8, 1, 0, wgmma="swap"),
            tb.BmmConfig(16, 128, 256, 8, 1, 0, wgmma="swap")],
    ids=["32x64x256", "32x128x256", "16x128x256"],
)  # fmt: skip
@pytest.mark.parametrize("B, M, N", [(64, 32, 512), (16, 64, 512), (50, 45, 200)])
def test_one_step_swap_without_worker_warps_matches_reference_on_gpu(B, M, N, cfg, monkeypatch):
    """K-up 256's one-step swap tiles where the MMA warps round x themselves (:func:`swap_workers`: with
    ``act_quant="none"`` always, with mxfp4 where the programs exceed two per multiprocessor) and, for mxfp4
    with fewer programs, with their worker warps: GLM's shape at 64 heads and 32 rows (256-512 programs), at 16
    heads and 64 rows (256) and a ragged one (M and N not multiples of the tiles, 200-400), through the
    runtime's strided view of the q rows."""
    decisions = _rule_on_gpu(monkeypatch, "swap_workers", cfg, B, M, N, 256)
    (mxfp4_args, mxfp4_workers), (none_args, none_workers) = decisions
    assert mxfp4_args[:2] == (1, True) and mxfp4_workers == (mxfp4_args[2] <= 2 * mxfp4_args[3])
    assert none_args[:2] == (1, False) and not none_workers


@sm90_only
@pytest.mark.parametrize(
    "cfg, K",
    [(tb.BmmConfig(32, 64, 256, 4, 1, 0, wgmma="swap"), 512), (tb.BmmConfig(32, 64, 64, 4, 1, 0, wgmma="swap"), 192),
     (tb.BmmConfig(64, 64, 256, 4, 1, 0, wgmma="swap", round_warps=8), 512)],
    ids=["vup-32x64x256", "kup192-32x64x64", "vup-64x64x256-rw8"],
)  # fmt: skip
@pytest.mark.parametrize("B, M, N", [(8, 64, 256), (5, 45, 200)])
def test_swap_programs_loading_their_codes_first_match_reference_on_gpu(B, M, N, cfg, K, monkeypatch):
    """Swap tiles whose step 0 waits for every K step's code loads (:func:`swap_codes_first`; V-up's 16-head
    64-row default, K-up 192's 32-row one, the few-heads V-up tile): V-up's shape at 8 heads (at most 64
    programs, so one a multiprocessor on any sm_90 GPU) and a ragged one (M and N not multiples of the tiles),
    mxfp4 and none, through the runtime's strided view of the rows."""
    assert [first for _, first in _rule_on_gpu(monkeypatch, "swap_codes_first", cfg, B, M, N, K)] == [True, True]


@sm90_only
@pytest.mark.parametrize(
    "cfg, N, K",
    [(tb.BmmConfig(64, 64, 64, 4, 3, 0, wgmma="decode", ws=True), 512, 192),
     (tb.BmmConfig(64, 128, 128, 4, 3, 0, wgmma="decode", ws=True), 256, 512)],
    ids=["kup192-64x64x64", "vup-64x128x128"],
)  # fmt: skip
@pytest.mark.parametrize("B, M", [(8, 300), (5, 45)])
def test_decode_with_two_rounding_partitions_matches_reference_on_gpu(B, M, cfg, N, K, monkeypatch):
    """``decode`` programs whose rounding warps come in two partitions taking alternate x tiles
    (:func:`round_partitions`; the K-up 192 16-head 64-row and V-up 64-head 256-row defaults' tiles): several
    M tiles a program (300 rows) and fewer rows than one tile (45), at most 80 programs (one a multiprocessor on
    any sm_90 GPU), mxfp4 and none (no rounding warps, one partition), through the runtime's strided view."""
    assert [parts for _, parts in _rule_on_gpu(monkeypatch, "round_partitions", cfg, B, M, N, K)] == [2, 1]


@sm90_only
@pytest.mark.parametrize(
    "name, B, M, N, K, plain",
    [("decode-64x64-ws", 8, 64, 512, 192, 8), ("decode-64x64-ws", 5, 45, 200, 192, 8),
     ("decode-64x64-ws", 16, 300, 512, 192, 0), ("decode-64x64-ws", 40, 64, 512, 192, 0),
     ("streaming-ws", 3, 1000, 80, 192, 0), ("xreg-64x128", 2, 300, 200, 256, 8),
     ("swap-32x64", 8, 64, 256, 512, 8), ("swap-32x64", 5, 45, 200, 192, 8),
     ("swap-32x64", 64, 32, 512, 256, 0)],
    ids=["decode-one-tile", "decode-ragged", "decode-five-tiles", "decode-320-programs", "streaming-128-rows",
         "xreg-one-tile-ragged", "swap-64-programs", "swap-ragged", "swap-512-programs"],
)  # fmt: skip
def test_y_stored_plainly_or_by_tma_matches_reference_on_gpu(name, B, M, N, K, plain, monkeypatch):
    """y written by plain stores (:func:`plain_y`: programs of one tile of at most 64 rows, at most 64 of them,
    masked to M and N) or by TMA (several tiles a program, 128-row tiles, 320-512 programs: more than any sm_90
    GPU's multiprocessors), in the ``decode``, ``streaming``, ``xreg`` and ``swap`` kernels: GLM's shapes and
    ragged ones (M, N not multiples of the tiles; with N = 80 and 200 y's strides are no multiple of 16 elements,
    so the kernel cannot assume 16-byte rows), mxfp4 and none; the padding past N stays NaN."""
    assert [p for _, p in _rule_on_gpu(monkeypatch, "plain_y", _GPU_CONFIGS[name], B, M, N, K)] == [plain, plain]


@sm90_only
@pytest.mark.parametrize(
    "name, B, M, N, K",
    [("decode-ws", 16, 300, 512, 192), ("decode-64x64-ws", 8, 64, 512, 192), ("streaming-ws", 16, 300, 256, 512),
     ("xreg-64x128", 16, 300, 512, 256), ("swap-32x64", 16, 45, 256, 512)],
)  # fmt: skip
def test_out_off_16_bytes_is_stored_plainly_by_the_gluon_kernels_on_gpu(name, B, M, N, K, monkeypatch):
    """An out starting 2 bytes past 16 (no TMA target) in the ``decode`` (several 128-row tiles a program, and one
    64-row tile), ``streaming``, ``xreg`` and ``swap`` kernels: still the Gluon kernel (its launch rule ran), y by
    2-byte plain stores (:func:`plain_y` 1), the reference's result; the element before out and the padding after
    it stay NaN."""
    assert [p for _, p in _rule_on_gpu(monkeypatch, "plain_y", _GPU_CONFIGS[name], B, M, N, K, offset=1)] == [1, 1]


@sm90_only
@pytest.mark.parametrize("B, M, N, warps", [(8, 64, 256, 8), (5, 45, 200, 8), (64, 64, 256, 4)])
def test_swap_rounding_warps_by_programs_match_reference_on_gpu(B, M, N, warps, monkeypatch):
    """A swap tile asking for 8 rounding warps (V-up's 16-head T = 32 / 64 default) keeps them with at most 64
    programs (V-up's shape at 8 heads, a ragged one) and takes 4 with 512 (64 heads: more than any sm_90 GPU's
    multiprocessors); exact either way, mxfp4 and none, through the runtime's strided view."""
    cfg = tb.BmmConfig(32, 64, 256, 4, 1, 0, wgmma="swap", round_warps=8)
    assert [w for _, w in _rule_on_gpu(monkeypatch, "swap_round_warps", cfg, B, M, N, 512)] == [warps, warps]


@sm90_only
@pytest.mark.parametrize("name", ["decode-128cols", "swap-16x128", "swap-64x256-w16", "xreg-64x128"])
@pytest.mark.parametrize("K", [192, 512])
def test_decode_is_exact_for_every_code_and_scale(K, name, monkeypatch):
    """Identity activations (``act_quant="none"``) make y the decoded weights transposed: every E2M1 code with
    scale bytes across the whole range (0 = 2**-127, bf16-subnormal results, 253 / 254 overflowing to inf,
    255 = NaN) must come out as the float32 dequantization rounded to bf16, bit for bit (NaN where it is)."""
    launched = _launches(monkeypatch)
    B, N = 2, 128
    g = torch.Generator().manual_seed(K)
    codes = torch.randint(0, 256, (B, N, K // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (B, N, K // 32), generator=g, dtype=torch.uint8)
    special = torch.tensor([0, 1, 2, 5, 120, 127, 128, 200, 252, 253, 254, 255], dtype=torch.uint8)
    scales[0, : len(special), 0] = special  # one special block per row keeps the other rows finite
    scales[1, 3, :] = special[: K // 32] if K // 32 <= len(special) else special.repeat(2)[: K // 32]
    x = torch.eye(K, dtype=torch.bfloat16).expand(B, K, K).contiguous()
    expected = torch.bmm(x.float(), dequantize(codes, scales).transpose(1, 2)).to(torch.bfloat16)
    out = torch.full((B, K, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    tb.bmm_a16wfp4(x.cuda(), codes.cuda(), scales.cuda(), act_quant="none", out=out, config=_GPU_CONFIGS[name])
    assert launched and launched[0].schedule == _GPU_CONFIGS[name].wgmma
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def test_the_timeline_benchmark_still_finds_its_places_in_the_kernel_source():
    """benchmarks/timeline_gluon_bmm.py instruments a copy of this kernel by editing its source text: each edit
    still finds its text exactly once, and the result is valid Python with a stamp at each of the 11 places (7 in
    the decode kernel and the rounding loop, 4 in the swap kernel)."""
    src = benchmark_module("timeline_gluon_bmm").instrumented_source()
    compile(src, "gluon_bmm_timeline.py", "exec")
    assert src.count("_stamp(") == 1 + 11 and "T_ADDR = gl.constexpr(0)" in src
