"""Triton sparse MLA against the torch reference (Triton's interpreter on CPU; compiled kernels on a GPU).

Tolerance: the kernel rounds P to bf16 before ``P @ V`` (each weight off by <= 2**-9 relative, so an output
element by <= 2**-9 * sum(p * |c|), which exceeds max|ref| when many rows average out) and rounds the output
to bf16 like the reference. On these inputs max|out - ref| / max|ref| stays <= 7.3e-3; the bar here is 1e-2
(the issue's is 2e-2). Scores are exact bf16 products summed in fp32 in both, so LSE agrees to ~1e-6; the
bar is 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from glm_pack.packing.errors import BackendError
from glm_pack.runtime import reference
from tests.runtime.kernel_modules import kernel_module

tsm = kernel_module("triton_sparse_mla")
_ok, _why = tsm.available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"triton sparse MLA unavailable: {_why}")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
L, R = 512, 64
SCALE = 0.07
REL_TOL, LSE_TOL = 1e-2, 1e-4


def make_case(T, H, rope, *, slots=96, lens=None, seed=0, invalid=0.1):
    """Random q / cache / indices; ``lens`` rows per token (0 = empty token); -1 entries and repeats."""
    g = torch.Generator().manual_seed(seed)
    lens = lens or [24] * T
    q = torch.randn(T, H, L + R, generator=g).bfloat16()  # q_latent / q_rope are views of one row
    cache = torch.randn(slots, L + (R if rope else 0), generator=g).bfloat16()
    idx = torch.randint(0, slots, (sum(lens),), generator=g, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=g) < invalid] = -1
    if idx.numel() > 4:
        idx[1] = idx[3]  # a repeated id inside one token
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q_lat, q_rope = q[..., :L], (q[..., L:] if rope else None)
    to = lambda x: None if x is None else x.to(DEV)  # noqa: E731
    return to(q_lat), to(q_rope), to(cache), to(indptr), to(idx)


def check(args, out, lse=None):
    ref, ref_lse = reference.sparse_mla(*args, SCALE, return_lse=True)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < REL_TOL, f"max|out-ref|/max|ref| = {err:.3g}"
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        fin = torch.isfinite(ref_lse)
        assert (lse[fin] - ref_lse[fin]).abs().max() < LSE_TOL
    return ref, ref_lse


def poisoned(T, H):
    return torch.full((T, H, L), float("nan"), dtype=torch.bfloat16, device=DEV)


@pytest.mark.parametrize(
    ("T", "H", "rope", "cfg"),
    [
        (1, 16, False, None),  # default: split over top-k (interpreter stands in for 4 SMs)
        (1, 16, True, tsm.SparseMlaConfig(16, 16, 1)),  # one program per token, no combine pass
        (3, 8, True, tsm.SparseMlaConfig(16, 16, 3)),  # H < block_h, splits of uneven length
        (2, 32, False, tsm.SparseMlaConfig(16, 32, 2)),  # two head blocks per token
    ],
)
def test_matches_reference(T, H, rope, cfg):
    args = make_case(T, H, rope, lens=[40, 17, 33][:T], seed=T * 100 + H)
    out, lse = tsm.sparse_mla(*args, SCALE, return_lse=True, out=poisoned(T, H), config=cfg)
    check(args, out, lse)


@pytest.mark.parametrize("split", [1, 2])
def test_empty_token_gives_zeros_and_minus_inf(split):
    args = make_case(4, 16, True, lens=[20, 0, 9, 12], seed=7)
    args[4][29:41] = -1  # token 3 has only -1 entries
    out, lse = tsm.sparse_mla(
        *args, SCALE, return_lse=True, out=poisoned(4, 16), config=tsm.SparseMlaConfig(16, 16, split)
    )
    check(args, out, lse)
    for t in (1, 3):
        assert torch.equal(out[t], torch.zeros_like(out[t]))
        assert torch.isneginf(lse[t]).all()


@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_paged_cache_layouts(layout):
    q_lat, q_rope, cache, indptr, idx = make_case(2, 16, True, slots=64, seed=11)
    paged = cache.view(4, 16, L + R) if layout == "3d" else cache.view(64, 1, 1, L + R)
    out, _ = tsm.sparse_mla(q_lat, q_rope, paged, indptr, idx, SCALE, out=poisoned(2, 16))
    check((q_lat, q_rope, cache, indptr, idx), out)


def test_strided_out_and_repeats_count_each_time():
    q_lat, _, cache, indptr, _ = make_case(1, 16, False, seed=5)
    idx = torch.tensor([3, 3, 3, 8, -1, 8], dtype=torch.int32, device=DEV)
    indptr = torch.tensor([0, 6], dtype=torch.int32, device=DEV)
    big = torch.full((1, 16, 2 * L), float("nan"), dtype=torch.bfloat16, device=DEV)
    out, lse = tsm.sparse_mla(q_lat, None, cache, indptr, idx, SCALE, return_lse=True, out=big[..., :L])
    assert out.data_ptr() == big.data_ptr() and torch.isnan(big[..., L:]).all()
    # Hand check: rows 3 (x3) and 8 (x2) -> weights 3 e^{s3} : 2 e^{s8}; lse = log(3 e^{s3} + 2 e^{s8}).
    s = SCALE * (q_lat[0].float() @ cache[[3, 8]].float().T)  # [H, 2]
    w = torch.tensor([3.0, 2.0], device=DEV) * s.exp()
    want = (w / w.sum(1, keepdim=True)) @ cache[[3, 8]].float()
    assert (out[0].float() - want).abs().max() / want.abs().max() < REL_TOL
    assert (lse[0] - w.sum(1).log()).abs().max() < LSE_TOL


def test_strided_indices_and_indptr_read_like_contiguous_ones():
    """Column views of kv_indices / kv_indptr (stride 2) give the reference's answer, not other slots'."""
    q_lat, q_rope, cache, indptr, idx = make_case(2, 16, True, seed=4)
    wide_idx = torch.stack([idx, torch.flip(idx, (0,))], dim=1)  # [n, 2]: column 0 is idx, stride 2
    wide_ptr = torch.stack([indptr, indptr.flip(0)], dim=1)
    out, lse = tsm.sparse_mla(q_lat, q_rope, cache, wide_ptr[:, 0], wide_idx[:, 0], SCALE, return_lse=True)
    assert wide_idx[:, 0].stride() == (2,)
    check((q_lat, q_rope, cache, indptr, idx), out, lse)


def test_out_of_range_ids_are_skipped_like_minus_one():
    q_lat, q_rope, cache, indptr, idx = make_case(2, 16, True, seed=9)
    bad = idx.clone()
    bad[[0, 5, 30]] = torch.tensor([96, 10_000, -7], dtype=torch.int32, device=DEV)  # cache has 96 slots
    out, lse = tsm.sparse_mla(q_lat, q_rope, cache, indptr, bad, SCALE, return_lse=True)
    skipped = idx.clone()
    skipped[[0, 5, 30]] = -1
    check((q_lat, q_rope, cache, indptr, skipped), out, lse)


def test_token_ranges_are_cut_to_kv_indices():
    """A kv_indptr reaching before or past kv_indices reads nothing outside it: each range is cut to
    ``[0, len]`` (the reference refuses such an indptr, so the cut ranges are its expectation)."""
    q_lat, q_rope, cache, indptr, idx = make_case(3, 16, True, seed=4)
    n = idx.numel()
    wild = torch.tensor([-5, 10, 30, n + 7], dtype=torch.int32, device=DEV)
    for config in (None, tsm.SparseMlaConfig(16, 16, 1), tsm.SparseMlaConfig(16, 16, 4)):
        out, lse = tsm.sparse_mla(q_lat, q_rope, cache, wild, idx, SCALE, return_lse=True, config=config)
        check((q_lat, q_rope, cache, wild.clamp(0, n), idx), out, lse)
    with pytest.raises(BackendError, match="kv_indptr must rise monotonically within"):
        reference.sparse_mla(q_lat, q_rope, cache, wild, idx, SCALE)


def test_subnormal_cache_values_are_exact():
    """Latent rows all equal to one bf16 subnormal average to it exactly (the Triton interpreter's own bf16 ->
    fp32 cast would flush or misread it)."""
    q_lat, q_rope, cache, indptr, idx = make_case(2, 16, True, seed=6)
    tiny = torch.tensor([3], dtype=torch.int16).view(torch.bfloat16).to(DEV)  # 3 * 2**-133
    cache = cache.clone()
    cache[:, :L] = tiny
    out = tsm.sparse_mla(q_lat, q_rope, cache, indptr, idx, SCALE)[0]
    assert torch.equal(out, tiny.expand_as(out))


def test_default_config_splits_only_when_tokens_are_few():
    dev = torch.device("cuda") if DEV == "cuda" else torch.device("cpu")
    few = tsm.default_config(1, 16, 2048, dev)
    many = tsm.default_config(4096, 64, 4096 * 2048, dev)
    assert few.num_splits > 1 and many.num_splits == 1
    assert few.num_splits * few.block_n <= 2048  # no split is empty by construction


def test_falls_back_to_compact_tiles_when_shared_memory_is_short(monkeypatch):
    """A GPU with less shared memory than an H200 rejects the default tiles at load time (OutOfResources); later
    calls of that kernel go to the compact tiles at once (another kernel, here with rope, is tried again)."""
    monkeypatch.setattr(tsm, "_UNFIT", set())
    launched = []

    def small_gpu_launch(*args):
        cfg = args[-1]
        launched.append(cfg)
        if cfg.block_n > 16:
            raise tsm.triton.runtime.errors.OutOfResources(200_000, 100_000, "shared memory")
        real_launch(*args)

    real_launch = tsm._launch
    monkeypatch.setattr(tsm, "_launch", small_gpu_launch)
    args = make_case(2, 16, True, seed=13)
    out, lse = tsm.sparse_mla(*args, SCALE, return_lse=True, out=poisoned(2, 16))
    check(args, out, lse)
    assert [c.block_n for c in launched] == [64, 16]
    out, lse = tsm.sparse_mla(*args, SCALE, return_lse=True, out=poisoned(2, 16))
    check(args, out, lse)
    assert [c.block_n for c in launched] == [64, 16, 16]
    rope_free = make_case(2, 16, False, seed=14)
    out, _ = tsm.sparse_mla(*rope_free, SCALE, out=poisoned(2, 16))
    check(rope_free, out, None)
    assert [c.block_n for c in launched] == [64, 16, 16, 64, 16]
    with pytest.raises(BackendError, match="does not fit"):
        tsm.sparse_mla(*args, SCALE, config=tsm.SparseMlaConfig(16, 32, 1))
    default = tsm.default_config(2, 16, args[4].numel(), args[0].device)  # the launch found unfit above
    with pytest.raises(BackendError, match="does not fit"):  # named by the caller: tried as given, never swapped
        tsm.sparse_mla(*args, SCALE, return_lse=True, config=default)
    assert launched[-1] == default


def test_no_heads_or_no_tokens_launch_nothing(monkeypatch):
    """Empty outputs of their shapes: nothing to compute (a launch shape for no head blocks has no splits)."""
    monkeypatch.setattr(tsm, "_launch", lambda *args: pytest.fail("a kernel was launched"))
    q_lat, q_rope, cache, indptr, idx = make_case(2, 16, True, seed=15)
    out, lse = tsm.sparse_mla(q_lat[:, :0], q_rope[:, :0], cache, indptr, idx, SCALE, return_lse=True)
    assert out.shape == (2, 0, L) and lse.shape == (2, 0)
    out, lse = tsm.sparse_mla(q_lat[:0], q_rope[:0], cache, indptr[:1], idx[:0], SCALE, return_lse=True)
    assert out.shape == (0, 16, L) and lse.shape == (0, 16)


def _bad_calls():
    q_lat, q_rope, cache, indptr, idx = make_case(2, 16, True)
    yield "q_latent", (q_lat.float(), q_rope, cache, indptr, idx), {}
    yield "q_rope", (q_lat, q_rope[:1], cache, indptr, idx), {}
    yield "kv_cache", (q_lat, None, cache, indptr, idx), {}  # 576-wide rows but no q_rope
    yield "kv_cache", (q_lat, q_rope, cache.view(2, 48, 1, L + R), indptr, idx), {}
    yield "kv_cache", (q_lat, q_rope, cache.t().contiguous().t(), indptr, idx), {}
    yield "kv_indptr", (q_lat, q_rope, cache, indptr[:2], idx), {}
    yield "kv_indptr", (q_lat, q_rope, cache, torch.cat([indptr, indptr[-1:]]), idx), {}  # T + 2 row pointers
    yield "kv_indices", (q_lat, q_rope, cache, indptr, idx.long()), {}
    yield "out", (q_lat, q_rope, cache, indptr, idx), {"out": poisoned(2, 8)}
    yield "config", (q_lat, q_rope, cache, indptr, idx), {"config": tsm.SparseMlaConfig(8, 16, 1)}
    yield "config", (q_lat, q_rope, cache, indptr, idx), {"config": tsm.SparseMlaConfig(16, 24, 1)}  # no power of 2
    yield "config", (q_lat, q_rope, cache, indptr, idx), {"config": tsm.SparseMlaConfig(16, 16, 0)}  # launched nothing
    yield "q_latent", (q_lat[..., :48], None, cache[:, :48], indptr, idx), {}  # L = 48: no power of two
    yield "q_rope", (q_lat, q_rope[..., :48], cache[:, : L + 48], indptr, idx), {}  # R = 48
    yield "kv_indices", (q_lat, q_rope, cache, indptr, idx.to("meta")), {}  # another device
    yield "out", (q_lat, q_rope, cache, indptr, idx), {"out": poisoned(2, 16).to("meta")}


@pytest.mark.parametrize(("what", "args", "kw"), list(_bad_calls()), ids=lambda v: v if isinstance(v, str) else "")
def test_contract_violations_raise_backend_error(what, args, kw):
    with pytest.raises(BackendError) as info:
        tsm.sparse_mla(*args, SCALE, **kw)
    assert what in str(info.value)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_a_non_finite_softmax_scale_is_refused(scale):
    """A NaN or infinite scale would turn every output NaN; refused before the launch."""
    with pytest.raises(BackendError, match="softmax_scale must be finite"):
        tsm.sparse_mla(*make_case(1, 16, False), scale)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    """Compiled kernels (no TRITON_INTERPRET at import) take GPU tensors only: CPU ones are refused by name."""
    monkeypatch.setattr(tsm, "_INTERPRETED", False)
    monkeypatch.setattr(tsm, "available", lambda: (True, "ok"))
    args = [t.cpu() if t is not None else None for t in make_case(1, 16, True)]
    with pytest.raises(BackendError, match="needs GPU tensors .*tensor q_latent"):
        tsm.sparse_mla(*args, SCALE)


def test_default_config_by_heads_tokens_and_rows_on_an_h200(monkeypatch):
    """The H200's 132 multiprocessors: 64-head blocks only with more than 16 heads and more than 256 token-heads;
    the deeper-pipelined one-program-per-SM shape from a quarter (33) up to one wave (131) of token x 16-head
    blocks; a token's top-k split in 64-row tiles, no further (64 rows a token: no split; 640: at most 10), and only
as far as one wave of programs (a partly filled head block counting as one)."""
    monkeypatch.setattr(tsm, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert tsm.default_config(8, 64, 8 * 2048, cpu).block_h == 64  # 512 token-heads
    assert tsm.default_config(4, 64, 4 * 2048, cpu).block_h == 16  # 256
    assert tsm.default_config(100, 16, 100 * 2048, cpu).block_h == 16  # 16 heads
    deep = [tsm.default_config(T, 16, T * 2048, cpu) for T in (33, 131)]
    plain = [tsm.default_config(T, 16, T * 2048, cpu) for T in (32, 132)]
    assert all(d.num_stages > p.num_stages and d.num_warps > p.num_warps for d in deep for p in plain)
    assert tsm.default_config(2, 16, 2 * 64, cpu).num_splits == 1
    few = tsm.default_config(2, 16, 2 * 640, cpu)
    assert few.block_n == 64 and few.num_splits == 10
    assert tsm.default_config(40, 8, 40 * 2048, cpu).num_splits == 3  # 40 programs of 8 heads in one wave of 132
    assert tsm.default_config(2, 16, 2 * 650, cpu).num_splits == 11  # 650 rows a token: 11 tiles, the last partial
    # 24 heads: 2 head blocks a token, 16 programs, 2 a multiprocessor: 264 / 16 splits
    assert tsm.default_config(8, 24, 8 * 2048, cpu).num_splits == 16


@pytest.mark.parametrize("arch, wide", [("sm_90", True), ("sm_80", False), ("sm_100", False), ("sm_120", False),
                                        ("gfx950", False), ("gfx942", False)])  # fmt: skip
def test_dispatch_of_64_head_blocks_only_where_the_gpu_has_wgmma(gpu_as, arch, wide):
    """The 64-head blocks, tuned for the H200's wgmma, spill registers on other GPUs (8-104 bytes a thread on NVIDIA's
    sm_80, sm_86, sm_89, sm_100 and sm_120, 1.0-1.5 KB a lane on AMD's gfx950 and gfx942, compiled here:
    benchmarks/check_compile.py): there many heads and tokens take the 16-head launches."""
    gpu_as(arch)
    cfg = tsm.default_config(64, 64, 64 * 2048, torch.device("meta"))  # 4096 token-heads: the 64-head blocks' case
    assert (cfg.block_h, cfg.num_warps) == ((64, 8) if wide else (16, 4))
