"""Runtime: open(), TP slicing, MLA ops, and the end-to-end correctness bar against unabsorbed MLA."""

from __future__ import annotations

import builtins
import errno
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm_pack import runtime
from glm_pack.packing.errors import BackendError, GlmPackError, ManifestError, VerifyError
from glm_pack.packing.mla import MlaGeometry
from glm_pack.packing.mxfp4 import dequantize, quantize
from glm_pack.runtime.backends.base import Backend
from glm_pack.runtime.layer import MlaLayer, ProjectionWeights
from glm_pack.runtime.reference import sparse_mla, unabsorbed_mla

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def read_source_kv_b(src, layer, prefix="model.layers"):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = f"{prefix}.{layer}.self_attn.kv_b_proj.weight"
    with safe_open(src / index["weight_map"][name], framework="pt") as f:
        return f.get_tensor(name).double()


def inputs(geom, T=3, slots=96, topk=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, geom.num_heads, geom.qk_nope_head_dim + geom.qk_rope_head_dim, generator=g).bfloat16()
    cache = torch.randn(slots, geom.cache_row, generator=g).bfloat16()
    indices = torch.randint(0, slots, (T * topk,), generator=g, dtype=torch.int32)
    indices[::7] = -1  # sentinels are skipped
    indptr = torch.arange(0, T * topk + 1, topk, dtype=torch.int32)
    return q, cache, indptr, indices


def run_absorbed(layer, geom, q, cache, indptr, indices, scale, act_quant="mxfp4"):
    latent = layer.k_up(q, act_quant=act_quant)
    q_rope = q[..., geom.qk_nope_head_dim :] if geom.qk_rope_head_dim else None
    o = layer.attend(latent, cache, indptr, indices, scale, q_rope=q_rope)
    return layer.v_up(o, act_quant=act_quant).double(), latent, o


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("card", ["glm-5", "glm-5.3-flash"])
def test_bf16_policy_matches_unabsorbed_mla_at_bf16_level(packed_dirs, card):
    src, out = packed_dirs(card, mla_precision="bf16")
    model = runtime.open(out, backend="torch")
    geom = model.local_geometry
    layer_id = model.layers[0]
    kv_b = read_source_kv_b(src, layer_id, _layers_prefix(model))
    q, cache, indptr, indices = inputs(geom)
    scale = 1 / math.sqrt(geom.qk_nope_head_dim + geom.qk_rope_head_dim)
    y, _, _ = run_absorbed(model.mla(layer_id), geom, q, cache, indptr, indices, scale, act_quant="none")
    ref = unabsorbed_mla(kv_b, geom, q, cache, indptr, indices, scale)
    # bf16 weights, bf16 latent and attention output: a few bf16 roundings (2^-8 each).
    assert rel(y, ref) < 1.5e-2


def _layers_prefix(model):
    return model.manifest["mla"][0]["prefix"].rsplit(".", 1)[0]


@pytest.mark.parametrize("q_scale, cache_scale", [(1, 1), (10, 3)], ids=["flat", "peaked"])
def test_mxfp4_matches_unabsorbed_mla_within_documented_bound(packed_dirs, q_scale, cache_scale):
    src, out = packed_dirs("glm-5")
    model = runtime.open(out, backend="torch")
    geom = model.local_geometry
    layer_id = model.layers[0]
    layer = model.mla(layer_id)
    kv_b = read_source_kv_b(src, layer_id, _layers_prefix(model))
    q, cache, indptr, indices = inputs(geom, seed=1)
    q, cache = (q.float() * q_scale).bfloat16(), (cache.float() * cache_scale).bfloat16()  # peaked: sharp softmax
    scale = 1 / math.sqrt(geom.qk_nope_head_dim + geom.qk_rope_head_dim)
    y, latent, o = run_absorbed(layer, geom, q, cache, indptr, indices, scale)
    ref = unabsorbed_mla(kv_b, geom, q, cache, indptr, indices, scale)
    # Estimate (README, Accuracy): the four relative errors that enter the product chain -- w_kc, w_vc (recorded
    # in the manifest) and the MXFP4 activation quantization of q_nope and of the attention output -- add up
    # (first order), and the softmax is allowed to double the score-side part; sharper attention raises the
    # error (about 0.17 flat, 0.35 peaked) but stays within it.
    e_q = rel(dequantize(*quantize(q[..., : geom.qk_nope_head_dim].float())).double(), q[..., :192].double())
    e_o = rel(dequantize(*quantize(o.float())).double(), o.double())
    bound = 2 * (layer.w_kc.rel_error + e_q) + layer.w_vc.rel_error + e_o
    err = rel(y, ref)
    assert 0.05 < err < bound, (err, bound)


def test_k_up_full_row_is_zero_copy_and_equals_nope_only(packed_dirs):
    _, out = packed_dirs("glm-5")
    model = runtime.open(out, backend="torch")
    layer = model.mla(model.layers[0])
    assert layer.w_kc.k_stored == 256 and layer.w_kc.k_logical == 192
    q, *_ = inputs(model.local_geometry)
    assert layer.k_input(q).data_ptr() == q.data_ptr()  # full [nope | rope] row goes to the kernel as is
    assert torch.equal(layer.k_up(q), layer.k_up(q[..., :192].contiguous()))  # rope meets zero weights
    with pytest.raises(BackendError, match="width 200"):
        layer.k_up(torch.zeros(1, 64, 200, dtype=torch.bfloat16))


def test_unpadded_route_slices_full_row(packed_dirs):
    _, out = packed_dirs("glm-5", k_pad="none")
    model = runtime.open(out, backend="torch")
    layer = model.mla(model.layers[0])
    assert layer.w_kc.k_stored == 192
    q, *_ = inputs(model.local_geometry)
    assert layer.k_input(q).data_ptr() == q.data_ptr() and layer.k_input(q).shape[-1] == 192  # a view
    assert torch.equal(layer.k_up(q), layer.k_up(q[..., :192].contiguous()))


def test_k_padded_past_the_rope_part_takes_both_row_widths(packed_dirs):
    """K stored 512 (``--k-pad 512``) is neither nope (192) nor nope+rope (256): both q widths become q_nope
    zero-padded to 512, and K-up equals the unpadded overlay's (same weights; zero codes meet the padding)."""
    _, out = packed_dirs("glm-5", k_pad="512")
    layer = runtime.open(out, backend="torch").mla(0)
    plain = runtime.open(packed_dirs("glm-5", k_pad="none")[1], backend="torch").mla(0)
    assert layer.w_kc.k_stored == 512
    q, *_ = inputs(layer.geometry)
    x = layer.k_input(q)
    assert x.shape[-1] == 512 and torch.equal(x[..., :192], q[..., :192]) and not x[..., 192:].any()
    want = plain.k_up(q)
    assert torch.equal(layer.k_up(q), want) and torch.equal(layer.k_up(q[..., :192]), want)
    with pytest.raises(BackendError, match="got width 512"):  # the stored K, but no q width: e.g. the latent
        layer.k_up(torch.zeros(3, 64, 512, dtype=torch.bfloat16))


def test_v_up_writes_into_out(packed_dirs):
    _, out = packed_dirs("glm-5")
    model = runtime.open(out, backend="torch")
    layer = model.mla(model.layers[0])
    latent = torch.randn(5, 64, 512).bfloat16()
    buf = torch.full((5, 64, 256), float("nan"), dtype=torch.bfloat16)
    assert layer.v_up(latent, out=buf) is buf and torch.isfinite(buf).all()
    with pytest.raises(BackendError, match="out must be"):
        layer.v_up(latent, out=torch.empty(5, 64, 128, dtype=torch.bfloat16))
    with pytest.raises(BackendError, match=r"out must be bf16 \(5, 64, 256\), got torch.float32"):
        layer.v_up(latent, out=torch.empty(5, 64, 256))


def test_v_up_into_a_view_of_its_own_input_is_right():
    """An ``out`` that is a view of ``latent`` (reusing its buffer) gets the result of a separate ``out`` on the
    Triton kernel (interpreted here), whose programs would otherwise read the columns other programs already
    overwrote; so does an ``out`` beside ``latent`` in one buffer."""
    from tests.runtime.kernel_modules import kernel_module

    ok, why = kernel_module("triton_bmm").available()
    if not ok:
        pytest.skip(f"triton bmm unavailable: {why}")
    from glm_pack.runtime.backends.triton_backend import TritonBackend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    geom = MlaGeometry(num_heads=2, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=0, v_head_dim=128)
    gen = torch.Generator().manual_seed(0)
    codes, scales = quantize(torch.randn(2, 128, 256, generator=gen))
    vc = ProjectionWeights("mxfp4", codes.to(dev), scales.to(dev), 256, 256, 0.0)
    kc = ProjectionWeights("bf16", torch.zeros(2, 256, 32, dtype=torch.bfloat16, device=dev), None, 32, 32, 0.0)
    latent = torch.randn(3, 2, 256, generator=gen).bfloat16().to(dev)
    layer = MlaLayer(0, geom, kc, vc, TritonBackend())
    want = layer.v_up(latent)
    x = latent.clone()
    assert torch.equal(layer.v_up(x, out=x[..., :128]), want)
    buf = torch.empty(3, 2, 384, dtype=torch.bfloat16, device=dev)
    buf[..., :256] = latent
    assert torch.equal(layer.v_up(buf[..., :256], out=buf[..., 256:]), want)
    assert torch.equal(buf[..., :256], latent)


@pytest.mark.parametrize("tp_size", [2, 8])
def test_tp_rank_gets_its_head_slice(packed_dirs, tp_size):
    _, out = packed_dirs("glm-5")
    full = runtime.open(out, backend="torch").mla(0)
    for rank in (0, tp_size - 1):
        part = runtime.open(out, backend="torch", tp_rank=rank, tp_size=tp_size).mla(0)
        heads = slice(rank * 64 // tp_size, (rank + 1) * 64 // tp_size)
        assert part.geometry.num_heads == 64 // tp_size
        assert torch.equal(part.w_kc.weight, full.w_kc.weight[heads])
        assert torch.equal(part.w_vc.scale, full.w_vc.scale[heads])
        q = torch.randn(2, 64, 256).bfloat16()
        assert torch.equal(part.k_up(q[:, heads]), full.k_up(q)[:, heads])


def test_open_refusals(packed_dirs, tmp_path):
    _, out = packed_dirs("glm-5")
    with pytest.raises(GlmPackError, match="cannot be split evenly over tp_size=3"):
        runtime.open(out, tp_size=3)
    with pytest.raises(GlmPackError, match=r"tp_rank 2 is not in \[0, tp_size=2\)"):
        runtime.open(out, tp_rank=2, tp_size=2)  # ranks are 0 and 1
    for tp_size in (0, -2):  # the size is named, not the rank 0 a default gave
        with pytest.raises(GlmPackError) as err:
            runtime.open(out, tp_size=tp_size)
        assert str(err.value) == f"tp_size must be at least 1, got {tp_size}"
    with pytest.raises(GlmPackError, match="tp_size must be an integer, got 2.0"):
        runtime.open(out, tp_size=2.0)
    with pytest.raises(GlmPackError, match="tp_rank must be an integer, got True"):
        runtime.open(out, tp_rank=True, tp_size=2)
    with pytest.raises(GlmPackError, match=r"tp_rank must be an integer, got tensor\(True\)"):
        runtime.open(out, tp_rank=torch.tensor(True), tp_size=2)
    for rank in (torch.tensor([1]), np.array([[1]])):  # one element, not a number (it was taken as 1)
        with pytest.raises(GlmPackError, match="tp_rank must be an integer, got "):
            runtime.open(out, tp_rank=rank, tp_size=2)
    with pytest.raises(GlmPackError, match="verify must be True or False, got 'no'"):  # "no" was truthy: it verified
        runtime.open(out, verify="no")
    model = runtime.open(out, tp_rank=torch.tensor(1), tp_size=np.int64(2))  # integer types of other libraries
    assert (model.tp_rank, model.tp_size) == (1, 2) and type(model.tp_size) is int
    with pytest.raises(GlmPackError, match="layer must be an integer, got '0'"):
        model.mla("0")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = bad / "glm-pack" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["schema_version"] = 99
    manifest.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="schema_version 99"):
        runtime.open(bad)
    m["schema_version"] = 1
    manifest.write_text(json.dumps(m))
    config = json.loads((bad / "config.json").read_text())
    config["kv_lora_rank"] = 256
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestError, match="kv_lora_rank: config 256 vs manifest 512"):
        runtime.open(bad)
    (bad / "config.json").write_text(json.dumps({**config, "kv_lora_rank": "512"}))  # a string: told apart
    with pytest.raises(ManifestError, match="kv_lora_rank: config '512' vs manifest 512"):
        runtime.open(bad)
    (bad / "config.json").write_text(json.dumps({**config, "kv_lora_rank": 512, "text_config": "x"}))
    runtime.open(bad)  # a text_config that is no object is not where the geometry is
    for text in ("[1, 2]", "null", "[" * 100_000, "\udcff"):  # nesting past the parser's depth: a RecursionError
        (bad / "config.json").write_text(text, errors="surrogateescape")
        with pytest.raises(ManifestError, match="config.json is not a JSON object"):
            runtime.open(bad)
    shutil.copy(out / "config.json", bad / "config.json")
    overlay = bad / "glm-pack" / "layer-000.safetensors"
    data = bytearray(overlay.read_bytes())
    data[-1] ^= 1
    overlay.write_bytes(bytes(data))
    runtime.open(bad)  # without verify the flipped byte goes unnoticed by open()
    with pytest.raises(VerifyError, match="layer-000.safetensors"):
        runtime.open(bad, verify=True)
    shutil.rmtree(bad / "glm-pack")
    with pytest.raises(ManifestError, match="no glm-pack manifest"):
        runtime.open(bad)
    # a mistyped path, or a file given for the output folder, says what is wrong with the path
    for path, why in ((tmp_path / "nope", "does not exist"), (bad / "config.json", "is a file")):
        with pytest.raises(ManifestError) as err:
            runtime.open(path)
        assert str(err.value) == f"not a glm-pack output directory: the path {why} (file {path})"


def test_backend_selection_on_cpu(packed_dirs):
    _, out = packed_dirs("glm-5")
    assert runtime.open(out).backend.name == "torch"  # auto: no gfx950, no GPU
    with pytest.raises(BackendError, match="triton backend needs a GPU"):
        runtime.open(out, backend="triton")
    with pytest.raises(BackendError, match="aiter backend needs a GPU device, got cpu"):
        runtime.open(out, backend="aiter")
    with pytest.raises(BackendError, match="unknown backend"):
        runtime.open(out, backend="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_select_backend_says_torch_sees_no_gpu_for_a_cuda_device():
    """select_backend itself (open() refuses such a device earlier): a forced triton backend on "cuda" without a GPU
    says so, and auto takes torch rather than Triton, whose kernels would find no GPU."""
    from glm_pack.runtime.backends import select_backend

    with pytest.raises(BackendError, match="triton backend needs a GPU, but torch sees none"):
        select_backend("triton", torch.device("cuda"), {})
    assert select_backend("auto", torch.device("cuda"), {}).name == "torch"


@pytest.mark.parametrize("capability, usable", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((12, 0), True)])
def test_the_triton_backend_needs_an_nvidia_gpu_of_compute_capability_8(monkeypatch, gpu_as, capability, usable):
    """Triton supports NVIDIA GPUs from compute capability 8.0 (its README); below (V100 7.0, T4 7.5) there is no bf16
    MMA and ptxas refuses the activation rounding's bf16x2 PTX. There the Triton backend is unavailable, saying which
    GPU and what it needs, and auto takes torch; from 8.0 on it is usable."""
    from glm_pack.runtime.backends import select_backend
    from glm_pack.runtime.backends.triton_backend import triton_status

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu_as(f"sm_{capability[0]}{capability[1]}")
    ok, why = triton_status(torch.device("cuda"))
    assert (ok, why == "ok") == (usable, usable)
    if not usable:
        assert why == (f"triton backend needs an NVIDIA GPU of compute capability 8.0 or later (Triton's floor), cuda "
                       f"is {capability[0]}.{capability[1]}")  # fmt: skip
        with pytest.raises(BackendError, match="compute capability 8.0 or later"):
            select_backend("triton", torch.device("cuda"), {})
        assert select_backend("auto", torch.device("cuda"), {}).name == "torch"


def _fake_ptxas(folder: Path, gpus: str) -> Path:
    """An executable answering as a CUDA 13.0 ptxas whose ``--help`` lists ``gpus`` (quoted names, comma-separated;
    no list at all when empty) as ``--gpu-name``'s allowed values. Named by what it lists: what a ptxas knows is
    cached by its path, and pytest may give a later test the folder of one that passed."""
    listed = f"        Allowed values for this option:  {gpus}.\n        Default value:  'sm_75'.\n" if gpus else ""
    path = folder / ("ptxas-" + (gpus.replace("'", "").replace(",", "-") or "unlisted"))
    path.write_text("#!/bin/sh\n"
                    'if [ "$1" = --version ]; then echo "Cuda compilation tools, release 13.0, V13.0.48"; exit 0; fi\n'
                    f"cat <<'EOF'\n--gpu-name <gpu name>  (-arch)\n        Specify name of NVIDIA GPU.\n{listed}"
                    "--help  (-h)\nEOF\n")  # fmt: skip
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("ptxas_lists, usable", [(None, False), ("'sm_100a','sm_110a'", True),
                                                 ("'sm_100a','sm_120a'", False), ("", True)])  # fmt: skip
def test_the_triton_backend_needs_a_ptxas_that_knows_the_gpu(monkeypatch, gpu_as, tmp_path, ptxas_lists, usable):
    """The ptxas PyPI's Triton 3.6.0 ships (CUDA 12.9's, from sm_100) does not know sm_110 (Jetson Thor, compute
    capability 11.0), so the first kernel would fail in ptxas there. The backend is unavailable, naming that ptxas
    and the variable that picks another, and auto takes torch. A ptxas named by ``TRITON_PTXAS_BLACKWELL_PATH`` that
    lists sm_110a lifts the refusal (one that lists other GPUs does not); one that lists no GPUs cannot tell, and is
    not refused."""
    from glm_pack.runtime.backends import select_backend
    from glm_pack.runtime.backends.triton_backend import triton_status

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu_as("sm_110")
    if ptxas_lists is None:  # Triton's own
        from triton.backends.nvidia.compiler import get_ptxas

        monkeypatch.delenv("TRITON_PTXAS_BLACKWELL_PATH", raising=False)
        ptxas, version = "ptxas-blackwell", "12.9"
        if get_ptxas(110).version != version:
            pytest.skip(f"this Triton ships CUDA {get_ptxas(110).version}'s ptxas, not 12.9's (PyPI's Triton 3.6.0)")
    else:
        ptxas, version = str(_fake_ptxas(tmp_path, ptxas_lists)), "13.0"
        monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", ptxas)
    ok, why = triton_status(torch.device("cuda"))
    assert (ok, why == "ok") == (usable, usable)
    if not usable:
        assert why.startswith("triton backend unavailable on cuda: Triton's ptxas (") and ptxas in why
        assert why.endswith(f", CUDA {version}) cannot compile for sm_110a; TRITON_PTXAS_BLACKWELL_PATH can name a "
                            "ptxas that can")  # fmt: skip
        with pytest.raises(BackendError, match="cannot compile for sm_110a"):
            select_backend("triton", torch.device("cuda"), {})
        assert select_backend("auto", torch.device("cuda"), {}).name == "torch"


@pytest.mark.parametrize("arch, knob", [("sm_100", "TRITON_PTXAS_BLACKWELL_PATH"), ("sm_90", "TRITON_PTXAS_PATH")])
def test_a_ptxas_that_does_not_know_the_gpu_names_the_variable_of_that_gpu(monkeypatch, tmp_path, arch, knob):
    """Triton picks its ptxas by a variable of its own from sm_100 on, by TRITON_PTXAS_PATH below: the refusal names the
    one that picks the ptxas for this GPU (sm_100 is the first of the Blackwell variable's)."""
    from glm_pack.runtime.kernels._triton import ptxas_reason

    ptxas = str(_fake_ptxas(tmp_path, "'sm_70'"))
    monkeypatch.setenv(knob, ptxas)
    why = ptxas_reason(divmod(int(arch[3:]), 10))
    assert f"cannot compile for {arch}a; {knob} can name a ptxas that can" in why and ptxas in why, why


_OLD_TRITON_CHILD = """
import torch
torch.cuda.is_available = lambda: True  # as on a GPU machine: only the Triton release decides
from glm_pack.runtime.backends import select_backend
from glm_pack.runtime.backends.triton_backend import TritonBackend, triton_status
from glm_pack.runtime.kernels import gluon_bmm, mxfp4_jit, triton_bmm, triton_sparse_mla
print(triton_status(torch.device("cuda"))[1])
print(triton_bmm.available()[1])
print(select_backend("auto", torch.device("cuda"), {}).name)
TritonBackend()
"""


@pytest.mark.parametrize("version", ["3.0.0", "3.5.1+git1234abcd"])
def test_a_triton_older_than_the_kernels_need_is_refused_saying_so(tmp_path, version):
    """A Triton before 3.6 (the one an engine image's older torch brings) is unavailable, saying which one is there
    and which is needed, rather than taken: the kernels fail under it (mxfp4_jit at import before 3.5, the Gluon
    kernels' compilation under 3.5). Every kernel module still imports; auto takes torch. The fake ``triton``
    package carries only what a release's import would give."""
    fake = tmp_path / "triton"
    (fake / "language").mkdir(parents=True)
    (fake / "runtime").mkdir()
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (fake / "language" / "__init__.py").write_text("")
    (fake / "runtime" / "__init__.py").write_text("class JITFunction:\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, "-c", _OLD_TRITON_CHILD], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    why = f"triton {version} is installed; glm-pack's kernels need Triton 3.6 or later"
    assert run.stdout.splitlines() == [f"triton backend unavailable: {why}", why, "torch"]


def _identity_mxfp4(heads: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 identity ``[heads, k, k]`` (code 2 = 1.0 on the diagonal, scale byte 127): ``y = act(x)`` exactly."""
    codes = torch.zeros(heads, k, k // 2, dtype=torch.uint8)
    n = torch.arange(k)
    codes[:, n, n // 2] = torch.where(n % 2 == 0, 0x02, 0x20).to(torch.uint8)
    return codes, torch.full((heads, k, k // 32), 127, dtype=torch.uint8)


def _backends_here() -> list:
    """The torch backend, and the Triton one where its kernels run here (interpreted without a GPU)."""
    from glm_pack.runtime.backends.torch_backend import TorchBackend
    from tests.runtime.kernel_modules import kernel_module

    found = [TorchBackend()]
    if kernel_module("triton_bmm").available()[0] and kernel_module("triton_sparse_mla").available()[0]:
        from glm_pack.runtime.backends.triton_backend import TritonBackend

        found.append(TritonBackend())
    return found


def test_backends_pass_act_quant_and_return_lse_through():
    """Against identity weights a backend's GEMM gives x itself with act_quant="none" and x's MXFP4 round trip with
    "mxfp4" (1.1 lies between E2M1 grid points); sparse MLA gives the LSE only when asked. Each backend passes
    both options on to its kernels (a backend that dropped them returned rounded results or no LSE)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    codes, scales = (t.to(dev) for t in _identity_mxfp4(2, 64))
    x = (torch.linspace(-3, 3, 3 * 2 * 64).reshape(2, 3, 64) * 1.1).bfloat16().to(dev)
    rounded = dequantize(*quantize(x.float().cpu(), mode="even")).bfloat16().to(dev)
    assert not torch.equal(rounded, x)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 16, 64, generator=g).bfloat16().to(dev)
    cache = torch.randn(8, 64, generator=g).bfloat16().to(dev)
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32, device=dev)
    indices = torch.tensor([0, 7, 2, 5, 5], dtype=torch.int32, device=dev)
    for backend in _backends_here():
        for act_quant, want in (("none", x), ("mxfp4", rounded)):
            out = torch.full((2, 3, 64), float("nan"), dtype=torch.bfloat16, device=dev)
            backend.bmm_a16wfp4(x, codes, scales, out, op="k_up", act_quant=act_quant)
            assert torch.equal(out, want), (backend.name, act_quant)
        assert backend.sparse_mla(q, None, cache, indptr, indices, 0.1, return_lse=False)[1] is None
        scores = 0.1 * torch.einsum("hl,sl->hs", q[0].double(), cache[[0, 7, 2]].double())
        lse = backend.sparse_mla(q, None, cache, indptr, indices, 0.1, return_lse=True)[1]
        assert lse.shape == (2, 16) and (lse[0].double() - torch.logsumexp(scores, -1)).abs().max() < 1e-4, backend.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_a_gpu_device_without_a_gpu_is_refused_at_open(packed_dirs, backend):
    _, out = packed_dirs("glm-5")
    with pytest.raises(BackendError, match="device 'cuda' cannot be used here"):
        runtime.open(out, device="cuda", backend=backend)
    with pytest.raises(BackendError, match="device 'cpu:x' cannot be used here"):
        runtime.open(out, device="cpu:x", backend=backend)


@pytest.mark.parametrize(
    "change, tp_size, tp_rank",
    [("dtype", 1, 0), ("k", 1, 0), ("fewer heads", 1, 0), ("fewer heads", 2, 1), ("more heads", 2, 0)],
)
def test_an_overlay_tensor_unlike_its_manifest_entry_is_refused_at_load(
    packed_dirs, tmp_path, change, tp_size, tp_rank
):
    """Without verify, a layer's file whose w_kc is not the manifest's U8 [H, kv_lora, k_stored/2] (another
    dtype, K cut to 192/2, half or twice the heads) is refused when the layer loads, naming file and tensor,
    whatever this rank's slice of the heads (the head axis went unchecked: a short file gave rank 1 no heads and
    the torch bmm a raw error, a long one gave rank 0 the first heads of a longer tensor without a word)."""
    _, out = packed_dirs("glm-5")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    name = "model.layers.0.self_attn.w_kc.weight"
    path = bad / "glm-pack" / "layer-000.safetensors"
    tensors = load_file(path)
    w = tensors[name]
    heads = w.shape[0]
    tensors[name] = {
        "dtype": w.view(torch.int8),
        "k": w[..., :96].contiguous(),
        "fewer heads": w[: heads // 2].contiguous(),
        "more heads": torch.cat([w, w]),
    }[change]
    path.unlink()
    save_file(tensors, path)
    model = runtime.open(bad, backend="torch", tp_size=tp_size, tp_rank=tp_rank)
    with pytest.raises(ManifestError, match="disagrees with the manifest: stored ") as err:
        model.mla(0)
    assert err.value.tensor == name and err.value.file == str(path)
    assert f"manifest U8 [{heads}, " in str(err.value)


def tiny_layer(backend: Backend, vc_k_stored: int = 64) -> MlaLayer:
    """A rope-free MXFP4 layer of 2 heads (kv_lora 64, nope 32, v 32) with zero weights on the CPU, w_vc stored with
    ``vc_k_stored`` (>= 64) columns of K, for tests that watch what reaches ``backend``."""
    geom = MlaGeometry(num_heads=2, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=0, v_head_dim=32)

    def zeros(n: int, k: int) -> ProjectionWeights:  # [H, n, k] codes and scales
        codes, scales = torch.zeros(2, n, k // 2, dtype=torch.uint8), torch.zeros(2, n, k // 32, dtype=torch.uint8)
        return ProjectionWeights("mxfp4", codes, scales, min(k, 64), k, 0.0)

    return MlaLayer(0, geom, zeros(64, 32), zeros(32, vc_k_stored), backend)


def test_a_width_other_than_the_stored_k_never_reaches_the_backend():
    """aiter checks no K and returns garbage: a w_vc stored padded past kv_lora (a manifest may record k_stored >
    k_logical for it) meets a kv_lora-wide latent; the layer refuses before any backend call."""

    class Recording(Backend):
        name, calls = "recording", []

        def bmm_a16wfp4(self, x, w_codes, w_scales, out, *, op, act_quant):
            self.calls.append(op)

    layer = tiny_layer(Recording(), vc_k_stored=96)  # a w_vc stored padded past kv_lora 64
    layer.k_up(torch.zeros(3, 2, 32, dtype=torch.bfloat16))
    assert Recording.calls == ["k_up"]
    with pytest.raises(BackendError, match="v_up: x has K=64, weight stores K=96"):
        layer.v_up(torch.zeros(3, 2, 64, dtype=torch.bfloat16))
    assert Recording.calls == ["k_up"]


def test_k_up_names_the_one_q_width_of_a_rope_free_layer():
    """Rope-free (nope+rope == nope): the refusal names the one width, not the same width twice as nope and
    nope+rope."""
    with pytest.raises(BackendError) as err:
        tiny_layer(Backend()).k_up(torch.zeros(3, 2, 48, dtype=torch.bfloat16))
    assert str(err.value) == "layer 0: q must be [T, H, 32] (nope; this model is rope-free), got width 48"


def test_v_up_writes_an_out_apart_from_latent_directly_and_one_sharing_its_memory_through_a_copy():
    """The kernel gets ``out``'s own memory when no byte of it is one of ``latent``'s (no extra copy), and a
    temporary when even one is: an out right after latent in one buffer is direct, one reaching back a single
    element into latent's last row is not."""
    written = []

    class Recording(Backend):
        name = "recording"

        def bmm_a16wfp4(self, x, w_codes, w_scales, out, *, op, act_quant):
            written.append(out.data_ptr())
            out.fill_(1.0)

    layer = tiny_layer(Recording())
    n_latent, n_out = 3 * 2 * 64, 3 * 2 * 32  # elements of latent [3, 2, 64] and out [3, 2, 32]
    flat = torch.zeros(n_latent + n_out, dtype=torch.bfloat16)
    latent = flat[:n_latent].view(3, 2, 64)
    for start, direct in ((n_latent, True), (n_latent - 1, False)):  # adjacent; sharing latent's last element
        flat.zero_()
        written.clear()
        out = flat[start : start + n_out].view(3, 2, 32)
        assert layer.v_up(latent, out=out) is out and (out == 1).all()
        assert (written == [out.data_ptr()]) == direct, (start, written, out.data_ptr())
    out = torch.empty(3, 2, 32, dtype=torch.bfloat16)  # a buffer of its own
    written.clear()
    layer.v_up(latent, out=out)
    assert written == [out.data_ptr()]


def test_backend_calls_run_with_the_layers_gpu_current(monkeypatch):
    """Triton and aiter launch on the current CUDA device: a layer on cuda:1 called while cuda:0 is current makes
    cuda:1 current for each backend call, then restores cuda:0 (CUDA's device state stands in for a fake here; the
    two-GPU run is test_triton_backend.py::test_layer_on_a_gpu_other_than_the_current_one)."""
    current = [0]

    class FakeDevice:  # torch.cuda.device: makes idx current inside the block
        def __init__(self, device):
            self.idx = torch.device(device).index

        def __enter__(self):
            self.prev, current[0] = current[0], self.idx

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    seen = []

    class Recording(Backend):
        name = "recording"

        def bmm_a16wfp4(self, x, w_codes, w_scales, out, *, op, act_quant):
            seen.append((op, current[0]))

        def sparse_mla(self, q_latent, q_rope, kv_cache, kv_indptr, kv_indices, softmax_scale, *, return_lse):
            seen.append(("attend", current[0]))
            return torch.zeros(q_latent.shape, dtype=torch.bfloat16), None

    layer = tiny_layer(Recording())
    latent = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    calls = lambda: (  # noqa: E731
        layer.k_up(torch.zeros(3, 2, 32, dtype=torch.bfloat16)),
        layer.v_up(latent),
        layer.attend(
            latent,
            torch.zeros(8, 64, dtype=torch.bfloat16),
            torch.tensor([0, 1, 2, 3], dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32),
            0.1,
        ),
    )
    calls()  # a CPU layer: no device switch, CUDA never asked
    assert seen == [("k_up", 0), ("v_up", 0), ("attend", 0)]
    seen.clear()
    monkeypatch.setattr(layer, "device", torch.device("cuda", 1))
    monkeypatch.setattr(layer, "_check_tensor", lambda t, name: None)  # the inputs stay on the CPU here
    calls()
    assert seen == [("k_up", 1), ("v_up", 1), ("attend", 1)] and current == [0]
    seen.clear()
    current[0] = 1  # already current: used as it is
    calls()
    assert seen == [("k_up", 1), ("v_up", 1), ("attend", 1)] and current == [1]


def test_reference_sparse_mla_hand_vector_with_lse():
    """Scores scale * (q_latent . c + q_rope . k_rope) over a token's valid rows (-1 skipped); lse is the natural
    log-sum-exp of the *scaled* scores; a token without a valid row gives lse -inf and a zero output."""
    q_latent = torch.tensor([[[1.0, 0, 0, 0]], [[1.0, 0, 0, 0]]]).bfloat16()  # [T=2, H=1, L=4]
    q_rope = torch.tensor([[[0.0, 1]], [[0.0, 1]]]).bfloat16()  # [T, H, R=2]
    cache = torch.tensor([[2.0, 0, 0, 0, 0, 0], [0, 0, 3, 0, 0, 1], [0, 1, 0, 0, 0, 0]]).bfloat16()
    indptr = torch.tensor([0, 3, 4], dtype=torch.int32)
    indices = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    out, lse = sparse_mla(q_latent, q_rope, cache, indptr, indices, 0.5, return_lse=True)
    # token 0: raw scores 2 (row 0: 1 * 2) and 1 (row 1: rope 1 * 1), scaled by 0.5 -> 1 and 0.5
    p0 = math.e / (math.e + math.exp(0.5))
    assert lse[0, 0].item() == pytest.approx(math.log(math.e + math.exp(0.5)), rel=1e-6)
    assert out[0, 0].float().tolist() == pytest.approx([2 * p0, 0.0, 3 * (1 - p0), 0.0], rel=1e-2)
    assert lse[1, 0].item() == -math.inf and out[1].float().abs().sum().item() == 0.0
    # a row pointer past the 4 ids (the slice would silently stop at 4) or falling is refused, never cut
    for wrong in ([0, 3, 5], [0, 3, 2], [-1, 3, 4]):
        with pytest.raises(BackendError, match=r"kv_indptr must rise monotonically within \[0, 4\]"):
            sparse_mla(q_latent, q_rope, cache, torch.tensor(wrong, dtype=torch.int32), indices, 0.5)


def test_out_of_cache_slot_ids_are_named_by_the_torch_backend(packed_dirs):
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="torch").mla(0)
    q, cache, indptr, indices = inputs(layer.geometry, slots=96)
    latent = layer.k_up(q)
    for bad in (96, -2):
        wrong = indices.clone()
        wrong[5] = bad
        says = rf"^layer 0: kv_indices\[5\] = {bad} is not a slot of the 96-slot cache"  # named like the layer's own
        with pytest.raises(BackendError, match=says):
            layer.attend(latent, cache, indptr, wrong, 0.1, q_rope=q[..., 192:])
    wrong[5] = 95  # the last slot is one
    assert torch.isfinite(layer.attend(latent, cache, indptr, wrong, 0.1, q_rope=q[..., 192:]).float()).all()


def test_every_argument_refusal_names_the_layer(packed_dirs):
    """The layer's argument checks all start with 'layer N: ' (six of them named the argument only, so a log line
    of a model with 78 MLA layers did not say which layer's call was wrong)."""
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="torch").mla(1)
    q, cache, indptr, indices = inputs(layer.geometry)
    latent, rope = layer.k_up(q), q[..., 192:]
    calls = [
        lambda: layer.k_up(q, act_quant="fp8"),
        lambda: layer.attend(latent, cache.float(), indptr, indices, 0.1, q_rope=rope),
        lambda: layer.attend(latent, cache[:, :512], indptr, indices, 0.1, q_rope=rope),
        lambda: layer.attend(latent, cache, indptr, indices[:24].reshape(3, 8), 0.1, q_rope=rope),
        lambda: layer.attend(latent, cache, indptr, indices, 0.0, q_rope=rope),
        lambda: layer.attend(latent, cache, indptr[:-1], indices, 0.1, q_rope=rope),
    ]
    for call in calls:
        with pytest.raises(BackendError) as err:
            call()
        assert str(err.value).startswith("layer 1: "), err.value


def test_activations_of_another_head_count_are_refused(packed_dirs):
    """A TP rank's layer takes its own heads only: activations with fewer or more heads (e.g. the whole model's, or
    another rank size's) are refused by name, not computed with the heads there are (attend) or left to torch's own
    shape error (k_up, v_up)."""
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="torch", tp_rank=1, tp_size=2).mla(0)  # 32 of the 64 heads
    q, cache, indptr, indices = inputs(runtime.open(out, backend="torch").mla(0).geometry)  # 64 heads
    latent = torch.randn(3, 64, 512).bfloat16()
    calls = {
        "q": lambda: layer.k_up(q),
        "latent": lambda: layer.v_up(latent),
        "q_latent": lambda: layer.attend(latent, cache, indptr, indices, 0.1, q_rope=q[:, :32, 192:]),
        "q_rope": lambda: layer.attend(latent[:, :32], cache, indptr, indices, 0.1, q_rope=q[..., 192:]),
    }
    for name, call in calls.items():
        with pytest.raises(
            BackendError, match=rf"^layer 0: {name} must be bf16 \[T, 32, \.\.\.\], got torch.bfloat16 \(3, 64, "
        ):
            call()


def test_attend_checks(packed_dirs):
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="torch").mla(0)
    q, cache, indptr, indices = inputs(layer.geometry)
    latent = layer.k_up(q)
    with pytest.raises(BackendError, match="pass q_rope"):
        layer.attend(latent, cache, indptr, indices, 0.1)
    with pytest.raises(BackendError, match="FP8 caches are not supported"):
        layer.attend(latent, cache.float(), indptr, indices, 0.1, q_rope=q[..., 192:])
    with pytest.raises(BackendError, match=r"kv_cache must be \[slots, 576\], .* got \(96, 512\)"):
        layer.attend(latent, cache[:, :512], indptr, indices, 0.1, q_rope=q[..., 192:])
    with pytest.raises(BackendError, match="q_rope has 5 tokens, q_latent 3"):
        layer.attend(latent, cache, indptr, indices, 0.1, q_rope=torch.cat([q, q[:2]])[..., 192:])
    with pytest.raises(BackendError, match="q_rope has 2 tokens, q_latent 3"):
        layer.attend(latent, cache, indptr, indices, 0.1, q_rope=q[:2, :, 192:])
    with pytest.raises(BackendError, match=r"kv_indices must be flat \(1-D\) global slot ids, got \(3, 8\)"):
        layer.attend(latent, cache, indptr, indices[:24].reshape(3, 8), 0.1, q_rope=q[..., 192:])
    with pytest.raises(BackendError, match="layer 0: kv_indices must be int32, got torch.int64"):
        layer.attend(latent, cache, indptr, indices.long(), 0.1, q_rope=q[..., 192:])
    with pytest.raises(BackendError, match="layer 0: kv_indptr must be int32, got torch.int64"):
        layer.attend(latent, cache, indptr.long(), indices, 0.1, q_rope=q[..., 192:])
    # 0: every row weighs the same; past float32's range (1e39, 10**400: a raw OverflowError) the float32 scores are
    # inf and the output NaN
    for scale in (float("nan"), float("inf"), None, "0.1", 0.0, -0.1, True, 1e39, 10**400):
        with pytest.raises(BackendError, match="softmax_scale must be a positive number within float32's range"):
            layer.attend(latent, cache, indptr, indices, scale, q_rope=q[..., 192:])
    # any real number will do, a Fraction too (it reached torch as one: a raw TypeError)
    assert torch.equal(
        layer.attend(latent, cache, indptr, indices, Fraction(1, 16), q_rope=q[..., 192:]),
        layer.attend(latent, cache, indptr, indices, 0.0625, q_rope=q[..., 192:]),
    )
    with pytest.raises(BackendError, match="return_lse must be True or False, got 'no'"):  # "no" was truthy
        layer.attend(latent, cache, indptr, indices, 0.1, q_rope=q[..., 192:], return_lse="no")
    with pytest.raises(BackendError) as err:  # a 0-d tensor (a scale computed in torch) is a number only in looks
        layer.attend(latent, cache, indptr, indices, torch.tensor(0.1), q_rope=q[..., 192:])
    assert str(err.value).endswith("got tensor(0.1000) (a tensor, not a number: pass float(softmax_scale))")
    for wrong in (indptr[:-1], torch.cat([indptr, indptr[-1:]])):  # one row pointer short (or extra) for T = 3
        with pytest.raises(BackendError, match=rf"kv_indptr must be \[T\+1\] = \[4\], got \({len(wrong)},\)"):
            layer.attend(latent, cache, wrong, indices, 0.1, q_rope=q[..., 192:])
    o, lse = layer.attend(latent, cache, indptr, indices, 0.1, q_rope=q[..., 192:], return_lse=True)
    assert o.shape == (3, 64, 512) and lse.shape == (3, 64)


def test_tensors_off_the_layers_device_are_refused_by_name(packed_dirs):
    """Every tensor argument must be on the device the layer was opened on (no GPU here: the meta device stands in
    for another one; a torch-backend attend with a meta cache used to return zeros, a meta q a meta latent)."""
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="torch").mla(0)
    q, cache, indptr, indices = inputs(layer.geometry)
    latent = layer.k_up(q)
    meta = lambda t: t.to("meta")  # noqa: E731
    calls = {
        "q": lambda: layer.k_up(meta(q)),
        "latent": lambda: layer.v_up(meta(latent)),
        "out": lambda: layer.v_up(latent, out=torch.empty(3, 64, 256, dtype=torch.bfloat16, device="meta")),
        "q_latent": lambda: layer.attend(meta(latent), cache, indptr, indices, 0.1, q_rope=q[..., 192:]),
        "q_rope": lambda: layer.attend(latent, cache, indptr, indices, 0.1, q_rope=meta(q[..., 192:])),
        "kv_cache": lambda: layer.attend(latent, meta(cache), indptr, indices, 0.1, q_rope=q[..., 192:]),
        "kv_indptr": lambda: layer.attend(latent, cache, meta(indptr), indices, 0.1, q_rope=q[..., 192:]),
        "kv_indices": lambda: layer.attend(latent, cache, indptr, meta(indices), 0.1, q_rope=q[..., 192:]),
    }
    for name, call in calls.items():
        with pytest.raises(BackendError, match=rf"layer 0: {name} is on meta, but the layer's weights are on cpu"):
            call()
    with pytest.raises(BackendError, match="layer 0: q must be a torch.Tensor, got ndarray"):
        layer.k_up(q.float().numpy())
    with pytest.raises(BackendError, match="layer 0: kv_cache must be a torch.Tensor, got list"):
        layer.attend(latent, [cache], indptr, indices, 0.1, q_rope=q[..., 192:])


def test_arguments_the_ops_cannot_honour_are_refused_by_name(packed_dirs):
    """What the ops cannot honour is refused naming the layer and argument, on every backend alike (each was a raw
    IndexError / RuntimeError from inside torch, or a silent answer): a cache of a layout no backend reads (0-D;
    1-D, taken as one slot; 4-D other than [slots, 1, 1, W] and strided rows, which the GPU backends refused but
    the torch one read), an out whose elements share memory, an inference-mode out outside that mode, and inputs or
    an out asking for a gradient while autograd records (the torch backend's output claimed a gradient, and
    backward gave q zeros)."""
    _, out = packed_dirs("glm-5")
    layer = runtime.open(out, backend="torch").mla(0)
    q, cache, indptr, indices = inputs(layer.geometry)
    latent = layer.k_up(q)
    rope = q[..., 192:]
    shapes = r"kv_cache must be \[slots, 576\], \[blocks, block, 576\] or \[slots, 1, 1, 576\], got "
    for bad, shape in (
        (cache[0, 0], r"\(\)"),
        (cache[0], r"\(576,\)"),
    ):
        with pytest.raises(BackendError, match="layer 0: " + shapes + shape):
            layer.attend(latent, bad, indptr, indices, 0.1, q_rope=rope)
    for bad, says in (  # what the GPU backends refuse, the torch backend refuses too
        (cache.view(48, 2, 1, 576), r"a 4-D kv_cache must be \[slots, 1, 1, 576\]"),
        (torch.stack([cache, cache], dim=-1)[..., 0], r"kv_cache rows must be contiguous"),
    ):
        with pytest.raises(BackendError, match="layer 0: torch sparse MLA: " + says):
            layer.attend(latent, bad, indptr, indices, 0.1, q_rope=rope)
    # an out of overlapping elements (expand, or as_strided: that one was silently wrong) is refused
    expanded = torch.empty(1, 64, 256, dtype=torch.bfloat16).expand(3, 64, 256)
    overlapping = torch.empty(3 * 64 * 256, dtype=torch.bfloat16).as_strided((3, 64, 256), (64 * 256, 1, 1))
    for bad, strides in ((expanded, r"\(0, 256, 1\)"), (overlapping, r"\(16384, 1, 1\)")):
        with pytest.raises(BackendError, match=rf"layer 0: out's strides {strides} can give two elements one memory"):
            layer.v_up(latent, out=bad)
    bf16 = torch.bfloat16
    for good in (torch.empty(64, 3, 256, dtype=bf16).transpose(0, 1), torch.empty(3, 64, 512, dtype=bf16)[..., ::2]):
        assert torch.equal(layer.v_up(latent, out=good), layer.v_up(latent))  # permuted and sliced views are fine
    with torch.inference_mode():
        frozen = torch.empty(3, 64, 256, dtype=torch.bfloat16)
    with pytest.raises(BackendError, match=r"layer 0: out was made under torch.inference_mode\(\)"):
        layer.v_up(latent, out=frozen)
    with torch.inference_mode():  # inside the mode it is written
        assert torch.equal(layer.v_up(latent, out=frozen), layer.v_up(latent))
    grad = {
        "q": lambda: layer.k_up(q.clone().requires_grad_()),
        "latent": lambda: layer.v_up(latent.clone().requires_grad_()),
        "out": lambda: layer.v_up(latent, out=torch.empty(3, 64, 256, dtype=torch.bfloat16, requires_grad=True)),
        "q_latent": lambda: layer.attend(latent.clone().requires_grad_(), cache, indptr, indices, 0.1, q_rope=rope),
        "q_rope": lambda: layer.attend(latent, cache, indptr, indices, 0.1, q_rope=rope.clone().requires_grad_()),
        "kv_cache": lambda: layer.attend(latent, cache.clone().requires_grad_(), indptr, indices, 0.1, q_rope=rope),
    }
    for name, call in grad.items():
        with pytest.raises(BackendError, match=rf"layer 0: {name} requires grad, but these operations are inference"):
            call()
        with torch.no_grad():  # where autograd records nothing, the same tensors are fine
            call()
    assert torch.equal(layer.k_up(q.clone().requires_grad_().detach()), latent)


def test_open_refuses_the_meta_device_and_a_path_of_another_type(packed_dirs):
    """The meta device holds no data (k_up returned empty meta tensors, attend raised from inside torch); a path
    must be a str or os.PathLike (None and bytes raised a raw TypeError)."""
    _, out = packed_dirs("glm-5")
    for backend in ("auto", "torch"):
        with pytest.raises(BackendError, match="device 'meta' cannot be used here: meta tensors hold no data"):
            runtime.open(out, device="meta", backend=backend)
    for path in (None, bytes(out)):
        with pytest.raises(ManifestError, match=f"path must be a str or os.PathLike folder, got {type(path).__name__}"):
            runtime.open(path)


def test_a_tensor_on_another_gpu_than_the_layers_is_refused(monkeypatch):
    """The device index counts, not just its type: a q on cuda:0 against a layer on cuda:1 is refused (no GPU here:
    a fake tensor stands in for the cuda:0 one, the layer's device is set as open(device="cuda:1") sets it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = tiny_layer(Backend())
    monkeypatch.setattr(layer, "device", torch.device("cuda", 1))
    with FakeTensorMode():
        q = torch.zeros(3, 2, 32, dtype=torch.bfloat16, device="cuda:0")
    with pytest.raises(BackendError, match="layer 0: q is on cuda:0, but the layer's weights are on cuda:1"):
        layer.k_up(q)


def test_open_verify_detects_a_changed_source_tensor(packed_dirs, tmp_path, edit_tensor):
    _, out = packed_dirs("glm-5")
    assert runtime.open(out, verify=True).layers == [0, 1, 2]  # every recorded sha256 holds on the untouched output
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)

    def bump(t):
        t[0, 0] += 1
        return t

    name = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = edit_tensor(bad, name, bump)
    runtime.open(bad)  # the overlay itself is intact
    with pytest.raises(VerifyError, match="source tensor differs") as err:
        runtime.open(bad, verify=True)
    assert err.value.tensor == name and shard.name in str(err.value)
    index = bad / "model.safetensors.index.json"
    index.unlink()  # OUT's originals unlisted: the untouched source must not stand in for them (it passed)
    with pytest.raises(VerifyError, match="the originals were placed in OUT, but this file of them is missing") as err:
        runtime.open(bad, verify=True)
    assert err.value.file == str(index)


def test_cache_rows_views_every_layout_with_one_row_stride():
    """The Triton and aiter sparse MLA read the cache as ``[slots, W]`` rows at one row stride: the view shares the
    cache's memory, and layouts without such a view are refused by name (a copy would not be the engine's cache)."""
    from glm_pack.runtime.reference import cache_rows

    flat = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    for cache in (flat, flat.view(4, 16, 8), flat.view(64, 1, 1, 8), torch.zeros(64, 12)[:, :8]):
        rows = cache_rows(cache, "k")
        assert rows.shape == (64, 8) and rows.data_ptr() == cache.data_ptr()
        assert rows.stride() == (cache.stride(-2) if cache.dim() < 4 else cache.stride(0), 1)
        assert torch.equal(rows, cache.reshape(64, 8))
    padded = torch.zeros(4, 17, 8)[:, :16]  # rows of a block 8 apart, blocks 136 apart, not 128
    for cache, says in (
        (padded, r"k: kv_cache leading dims cannot be flattened to slots without a copy \(shape \(4, 16, 8\)"),
        (flat.view(32, 2, 1, 8), r"k: a 4-D kv_cache must be \[slots, 1, 1, 8\], got \(32, 2, 1, 8\)"),
        (flat.t().contiguous().t(), r"k: kv_cache rows must be contiguous \(last stride 1\)"),
    ):
        with pytest.raises(BackendError, match=says) as err:
            cache_rows(cache, "k")
        assert err.value.tensor == "kv_cache"


def test_open_verify_names_what_is_missing(packed_dirs, tmp_path):
    """verify=True: an overlay file the manifest lists, or a source tensor the manifest fingerprints, that is gone is
    named (never a FileNotFoundError, never skipped)."""
    _, out = packed_dirs("glm-5")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(VerifyError, match="the checkpoint's index lacks a source tensor of the overlay") as err:
        runtime.open(bad, verify=True)
    assert err.value.tensor == name
    (bad / "glm-pack" / "layer-001.safetensors").unlink()
    with pytest.raises(VerifyError, match="overlay file listed in the manifest is missing") as err:
        runtime.open(bad, verify=True)
    assert err.value.file == str(bad / "glm-pack" / "layer-001.safetensors")
    (bad / "glm-pack" / "layer-001.safetensors").mkdir()  # a folder in its place is no file, not a missing one
    with pytest.raises(VerifyError, match="overlay file listed in the manifest is not a file") as err:
        runtime.open(bad, verify=True)
    assert err.value.file == str(bad / "glm-pack" / "layer-001.safetensors")


def test_open_verify_names_an_overlay_file_that_cannot_be_read(packed_dirs, refuse):
    """verify=True: an overlay file that cannot be read (a permission, an I/O error) is a VerifyError naming it; it
    was the raw OSError."""
    _, out = packed_dirs("glm-5")
    layer = out / "glm-pack" / "layer-001.safetensors"
    refuse(builtins, "open", layer, errno.EIO)
    with pytest.raises(VerifyError) as err:
        runtime.open(out, verify=True)
    assert str(err.value) == f"cannot read: Input/output error (file {layer})"


def test_open_checks_the_recorded_source_when_out_holds_no_originals(packed_dirs, tmp_path, ckpt_copy, edit_tensor):
    """An overlay-only OUT is checked against the source path its manifest records: that config's geometry, and with
    verify=True that source's tensors."""
    src, out = packed_dirs("glm-5")
    bad = tmp_path / "bad"
    shutil.copytree(out / "glm-pack", bad / "glm-pack")  # the overlay only: no config.json, no index
    source = ckpt_copy(src)
    manifest_path = bad / "glm-pack" / "manifest.json"
    m = json.loads(manifest_path.read_text())
    m["source"]["path"] = str(source)
    manifest_path.write_text(json.dumps(m))
    runtime.open(bad, verify=True)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").unlink()
    (source / "config.json").write_text(json.dumps({**config, "v_head_dim": 128}))
    with pytest.raises(ManifestError, match="v_head_dim: config 128 vs manifest 256") as err:
        runtime.open(bad)
    assert err.value.file == str(source / "config.json")
    (source / "config.json").write_text(json.dumps(config))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = edit_tensor(source, name, lambda t: t.neg())
    with pytest.raises(VerifyError, match="source tensor differs") as err:
        runtime.open(bad, verify=True)
    assert (err.value.file, err.value.tensor) == (str(shard), name)


def test_config_geometry_is_read_at_the_top_or_in_text_config():
    from glm_pack.runtime.loader import config_geometry

    geometry = {
        "num_attention_heads": 8,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    }
    want = {"num_heads": 8, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}
    assert config_geometry(geometry) == want
    assert config_geometry({"architectures": ["X"], "text_config": geometry}) == want  # a multimodal wrapper
    partial = {k: v for k, v in geometry.items() if k != "v_head_dim"}
    assert config_geometry({**partial, "text_config": geometry}) == want  # the section holding them all
    assert config_geometry({**partial, "text_config": partial}) == {}


def test_reference_bmm_a16wfp4_hand_vector():
    """Y = act(X) @ W^T. W row 0: code 2 (1.0) x 32 at scale byte 127 (2**0); row 1: code 9 (-0.5) in element 0 only,
    at byte 128 (2**1), i.e. -1.0. X = [4, 2, 1, 0.5, 0.25, 0...]: its block's amax 4 gives scale 2**0 and 0.25 ties
    to the even code 0, so the MXFP4 activation drops it; a NaN activation makes its whole output row NaN."""
    from glm_pack.runtime.reference import bmm_a16wfp4

    codes = torch.zeros(1, 2, 16, dtype=torch.uint8)
    codes[0, 0] = 0x22
    codes[0, 1, 0] = 0x09
    scales = torch.tensor([[[127], [128]]], dtype=torch.uint8)
    x = torch.zeros(1, 2, 32)
    x[0, :, :5] = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.25])
    x[0, 1, 7] = float("nan")
    y = bmm_a16wfp4(x.bfloat16(), codes, scales)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 2, 2)
    assert y[0, 0].tolist() == [7.5, -4.0] and y[0, 1].isnan().all()
    assert bmm_a16wfp4(x.bfloat16(), codes, scales, act_quant="none")[0, 0].tolist() == [7.75, -4.0]
    with pytest.raises(BackendError, match=r"act_quant must be one of \('mxfp4', 'none'\), got 'fp8'"):
        bmm_a16wfp4(x.bfloat16(), codes, scales, act_quant="fp8")  # the package's one error family, not ValueError


def test_open_verify_names_a_corrupt_original(packed_dirs, tmp_path):
    """verify=True reads OUT's index and the headers of its shards: one that is not what it claims is a VerifyError
    naming it (they were a JSONDecodeError, KeyError, AttributeError, TypeError, ValueError, struct.error or
    FileNotFoundError)."""
    _, out = packed_dirs("glm-5")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    index = bad / "model.safetensors.index.json"
    good = index.read_bytes()
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    shard = bad / json.loads(good)["weight_map"][name]
    for text, says in (
        (b"{", "the index is not a JSON object"),
        (b"[]", "the index is not a JSON object"),
        (b"{}", "weight_map must map tensor names to file names"),
        (b'{"weight_map": []}', "weight_map must map tensor names to file names"),
        (json.dumps({"weight_map": {name: 5}}).encode(), "weight_map must map tensor names to file names"),
    ):
        index.write_bytes(text)
        with pytest.raises(VerifyError, match=says) as err:
            runtime.open(bad, verify=True)
        assert err.value.file == str(index)
    index.write_bytes(good)
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])

    def with_offsets(offsets) -> bytes:
        text = json.dumps({**header, name: {**header[name], "data_offsets": offsets}}).encode()
        return struct.pack("<Q", len(text)) + text + data[8 + n :]

    for corrupt, says in (
        (struct.pack("<Q", 5) + b"{nope" + data[13:], "the safetensors header is not a JSON object"),
        (data[:1000], "truncated: no complete header"),
        (b"", "truncated: no complete header"),
        (with_offsets([8, 4]), r"data_offsets \[8, 4\] are not \[begin, end\]"),
        (with_offsets(["0", 4]), r"data_offsets \['0', 4\] are not \[begin, end\]"),
        (with_offsets([2**70, 2**70 + 4]), "safetensors file is truncated"),  # past the end (seek overflowed)
    ):
        shard.unlink()
        shard.write_bytes(corrupt)
        with pytest.raises(VerifyError, match=says) as err:
            runtime.open(bad, verify=True)
        assert err.value.file == str(shard)
    shard.unlink()
    with pytest.raises(VerifyError, match="cannot read: No such file or directory") as err:
        runtime.open(bad, verify=True)
    assert err.value.file == str(shard)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=GPU)])
def test_the_readmes_runtime_example_runs_as_written(packed_dirs, dev):
    """README's Runtime example, with only its path, layer id and (on CPU) device replaced (the test output has
    layers 0-2): every input it uses is defined there, in the shapes and dtypes the layer accepts."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    code = readme.split("## Runtime\n\n```python\n", 1)[1].split("```\n", 1)[0]
    _, out = packed_dirs("glm-5")
    edits = {'"/models/GLM-5-gfx950"': repr(str(out)), 'dev = "cuda"': f"dev = {dev!r}", "model.mla(7)": "model.mla(1)"}
    for old, new in edits.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    scope = {}
    exec(compile(code, "README.md (Runtime)", "exec"), scope)
    y = scope["y"]
    assert y.shape == (4, 8, 256) and y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert y.device.type == dev and scope["model"].backend.name == ("triton" if dev == "cuda" else "torch")
