"""Safetensors header parsing, lazy reads and the Checkpoint API, including every bad input of issue 3."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from glm_pack.convert import checkpoint as ckmod
from glm_pack.convert import safetensors_io as sio
from glm_pack.convert.checkpoint import open_checkpoint
from glm_pack.convert.cli import main
from glm_pack.packing.errors import CheckpointError, FormatError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "a.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(4, 64, generator=g).to(torch.float8_e4m3fn),
        "b.weight_scale_inv": torch.rand(1, 1, generator=g),
        "c.codes": torch.randint(0, 256, (3, 16), generator=g, dtype=torch.uint8),
        "d.empty": torch.empty(0, 3),
        "e.half": torch.randn(6, generator=g).half(),
    }


def _raw(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _rewrite(path: Path, header: dict, buffer: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + buffer)


def test_parse_and_read_match_the_safetensors_library(tmp_path):
    path = tmp_path / "x.safetensors"
    tensors = _tensors()
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = sio.parse_header(sio.LocalFile(path))
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    with safe_open(str(path), framework="pt") as f:
        for name, t in tensors.items():
            entry = header.tensors[name]
            got = sio.read_tensor(sio.LocalFile(path), entry)
            assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape) == entry.shape
            assert torch.equal(got.view(torch.uint8), f.get_tensor(name).view(torch.uint8))


def test_encode_header_is_readable_by_the_library(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    u = torch.arange(5, dtype=torch.uint8)
    head = sio.encode_header([("t", "F32", (3, 4)), ("u", "U8", (5,))], {"k": "v"})
    assert (len(head) - 8) % 8 == 0  # padded like the official writer
    path = tmp_path / "w.safetensors"
    path.write_bytes(head + t.numpy().tobytes() + u.numpy().tobytes())
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("t"), t) and torch.equal(f.get_tensor("u"), u)
        assert f.metadata() == {"k": "v"}


def _last(h: dict) -> str:
    return max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])


def _corrupt_cases():
    """(id, mutate(header, buffer) -> (header, buffer, length or None, tensor or None), message)."""

    def overlap(h, b):
        name = _last(h)
        h[name]["data_offsets"] = [o - 2 for o in h[name]["data_offsets"]]
        return h, b, None, name

    def out_of_range(h, b):
        name = _last(h)
        e = h[name]
        row = (e["data_offsets"][1] - e["data_offsets"][0]) // e["shape"][0]
        e["shape"][0] += 1
        e["data_offsets"][1] += row
        return h, b, None, name

    def trailing(h, b):
        return h, b + b"\0" * 4, None, None

    def gap(h, b):
        for k, e in h.items():
            if k != "__metadata__":
                e["data_offsets"] = [o + 4 for o in e["data_offsets"]]
        return h, b"\0" * 4 + b, None, None

    def wrong_size(h, b):
        h["a.weight"]["shape"] = [5, 8]
        return h, b, None, "a.weight"

    def bad_dtype(h, b):
        h["a.weight"]["dtype"] = "BF17"
        return h, b, None, "a.weight"

    def bad_shape(h, b):
        h["a.weight"]["shape"] = [5, -7]
        return h, b, None, "a.weight"

    def metadata_not_str(h, b):
        h["__metadata__"] = {"format": 1}
        return h, b, None, None

    def too_long(h, b):
        return h, b, 200_000_000, None

    def past_end(h, b):
        return h, b[:0], len(json.dumps(h)) + 100, None

    return [
        ("overlap", overlap, "overlap"),
        ("out_of_range", out_of_range, "truncated"),
        ("trailing_bytes", trailing, "trailing bytes"),
        ("gap", gap, "gap"),
        ("size_mismatch", wrong_size, "needs 80 bytes"),
        ("unknown_dtype", bad_dtype, "unknown dtype"),
        ("bad_shape", bad_shape, "not a list of sizes"),
        ("metadata", metadata_not_str, "__metadata__"),
        ("header_too_long", too_long, "100 MB"),
        ("header_past_end", past_end, "past the end"),
    ]


@pytest.mark.parametrize("case", _corrupt_cases(), ids=lambda c: c[0])
def test_corrupt_headers_raise_checkpoint_error_naming_file_and_tensor(tmp_path, case):
    _, mutate, message = case
    path = tmp_path / "x.safetensors"
    save_file(_tensors(), str(path))
    header, buffer = _raw(path)
    header, buffer, length, tensor = mutate(header, buffer)
    _rewrite(path, header, buffer, length)
    with pytest.raises(CheckpointError, match=message) as err:
        sio.parse_header(sio.LocalFile(path))
    assert err.value.file == str(path)
    if tensor is not None:
        assert err.value.tensor == tensor
    # the reference implementation refuses the same file
    with pytest.raises(SafetensorError):
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]


@pytest.mark.parametrize("extra", [1, 8])
def test_a_header_length_just_past_the_end_is_corrupt(tmp_path, extra):
    """A header that would end 1 to 8 bytes past the end of the file (the 8 length bytes counted in): 'past the end',
    checked before any read (a Hub shard's read past its end is a request error, not a short read)."""
    path = tmp_path / "x.safetensors"
    save_file(_tensors(), str(path))
    data = bytearray(path.read_bytes())
    n = len(data) - 8 + extra
    data[:8] = struct.pack("<Q", n)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"header length {n} runs past the end of the {len(data)}-byte file"):
        sio.parse_header(sio.LocalFile(path))


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x01\x02", "not even the 8-byte"),
        (struct.pack("<Q", 5) + b"{nope", "invalid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not an object"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "invalid JSON"),
        (struct.pack("<Q", 19) + b'{"__metadata__":{},', "invalid JSON"),
        (struct.pack("<Q", 0), "invalid JSON"),  # the 8-byte length is there: an empty header is not JSON
    ],
)
def test_unreadable_headers(tmp_path, raw, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=message) as err:
        sio.parse_header(sio.LocalFile(path))
    assert err.value.file == str(path)


def _file(tmp_path: Path, header: dict, data: bytes) -> Path:
    path = tmp_path / "h.safetensors"
    _rewrite(path, header, data)
    return path


def _u8(shape, begin, end, dtype="U8") -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    "entry, data, message",
    [
        (_u8([True], 0, 1), b"\0", "not a list of sizes"),  # a JSON bool is no size, though Python's True == 1
        ({**_u8([1], 0, 1), "data_offsets": [0, 1, 1]}, b"\0", r"is not \[begin, end\]"),
        (_u8([3], 0, 1, "F4"), b"\0", "does not fill whole bytes"),  # 12 bits
        (_u8([0], 1, 0), b"\0", r"data_offsets \[1, 0\] end before begin"),
    ],
    ids=["bool_dim", "three_offsets", "part_byte", "end_before_begin"],
)
def test_malformed_entries_are_refused_like_the_library_does(tmp_path, entry, data, message):
    path = _file(tmp_path, {"t": entry}, data)
    with pytest.raises(CheckpointError, match=message) as err:
        sio.parse_header(sio.LocalFile(path))
    assert (err.value.file, err.value.tensor) == (str(path), "t")
    with pytest.raises(SafetensorError):
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({**_u8([1], 0, 1), "scale": 2}, "exactly dtype, shape, data_offsets"),  # a field we would not understand
        (_u8([0, 2**62, 2], 0, 0), "too large"),  # no bytes, but torch cannot hold its strides (2**63)
    ],
    ids=["extra_field", "strides_past_int64"],
)
def test_entries_the_library_takes_but_torch_or_we_cannot_are_refused(tmp_path, entry, message):
    path = _file(tmp_path, {"t": entry}, b"\0" * entry["data_offsets"][1])
    with pytest.raises(CheckpointError, match=message) as err:
        sio.parse_header(sio.LocalFile(path))
    assert (err.value.file, err.value.tensor) == (str(path), "t")


def test_sub_byte_and_zero_size_entries_read_like_the_library(tmp_path):
    """F4 packs two elements a byte; a zero-size tensor may sit at the offset where the next one begins, whatever the
    header's key order; the largest shape whose strides fit int64 is read as an empty tensor of that shape."""
    header = {
        "b": _u8([2], 0, 2),
        "a": _u8([0], 0, 0),  # listed after b, at b's begin
        "f": _u8([2, 2], 2, 4, "F4"),
        "z": _u8([0, 2**62, 1], 4, 4),
    }
    path = _file(tmp_path, header, bytes([1, 2, 0x21, 0xF9]))
    parsed = sio.parse_header(sio.LocalFile(path))
    with safe_open(str(path), framework="pt") as f:
        assert {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()} == {
            n: (e.dtype, e.shape) for n, e in parsed.tensors.items()
        }
    read = {n: sio.read_tensor(sio.LocalFile(path), e) for n, e in parsed.tensors.items()}
    assert read["b"].tolist() == [1, 2] and read["a"].shape == (0,)
    assert read["f"].dtype == torch.uint8 and read["f"].tolist() == [0x21, 0xF9]  # raw bytes of the four codes
    assert read["z"].shape == (0, 2**62, 1)


def test_a_read_past_the_end_of_a_local_file_is_a_short_read(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"0123456789")
    assert sio.LocalFile(path).read(6, 4) == bytearray(b"6789")
    with pytest.raises(CheckpointError, match="short read: wanted 5 bytes at offset 6, got 4") as err:
        sio.LocalFile(path).read(6, 5)  # never the 4 bytes there and a zero filled in
    assert err.value.file == str(path)


def test_encode_header_pads_every_length_to_a_multiple_of_8(tmp_path):
    for n in range(1, 9):  # names of 1..8 characters: every remainder of the JSON's length modulo 8
        head = sio.encode_header([("t" * n, "U8", (1,))])
        (size,) = struct.unpack("<Q", head[:8])
        assert size == len(head) - 8 and size % 8 == 0
        text = head[8:].decode()
        assert text.rstrip(" ") == json.dumps({"t" * n: _u8([1], 0, 1)}, separators=(",", ":"))
        assert len(text) - len(text.rstrip(" ")) < 8


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.safetensors"
    text = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0")
    with pytest.raises(CheckpointError, match="duplicate key"):
        sio.parse_header(sio.LocalFile(path))


# ---- Checkpoint API ---------------------------------------------------------------------------------


def test_checkpoint_api_on_a_sharded_checkpoint(synth_ckpt):
    path = synth_ckpt("glm-5", "fp8-block")
    ck = open_checkpoint(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert ck.root == path and ck.index_path == path / "model.safetensors.index.json"
    assert ck.weight_map == index["weight_map"]
    assert ck.files == list(dict.fromkeys(index["weight_map"].values())) and len(ck.files) > 1
    assert ck.names() == list(index["weight_map"])
    assert ck.card.name == "glm-5" and ck.quant_config["quant_method"] == "fp8"
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    info = ck.info(name)
    assert (info.dtype, info.shape, info.end - info.begin) == ("F8_E4M3", (28672, 512), 28672 * 512)
    with safe_open(str(path / info.file), framework="pt") as f:
        ref = f.get_tensor(name)
    raw = ck.read_raw(name)
    assert raw.dtype == torch.float8_e4m3fn and torch.equal(raw.view(torch.uint8), ref.view(torch.uint8))
    assert ck.source_tensors(name) == [name, "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    import hashlib

    assert ck.raw_sha256(name) == hashlib.sha256(ref.view(torch.uint8).numpy().tobytes()).hexdigest()
    with pytest.raises(CheckpointError, match="no such tensor"):
        ck.info("model.layers.0.nothing.weight")
    with pytest.raises(FormatError, match="read_mxfp4 needs an mxfp4 weight, this one is fp8-block") as err:
        ck.read_mxfp4(name)
    assert (err.value.file, err.value.tensor) == (str(path / info.file), name)


def test_reads_touch_only_the_tensor_bytes(synth_ckpt, monkeypatch):
    ck = open_checkpoint(synth_ckpt("glm-5", "fp8-block"))
    calls = []
    original = sio.LocalFile.read

    def spy(self, offset, length):
        calls.append((offset, length))
        return original(self, offset, length)

    monkeypatch.setattr(sio.LocalFile, "read", spy)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    ck.read_float(name)
    spans = {(ck.info(t).begin, ck.info(t).nbytes) for t in ck.source_tensors(name)}
    assert set(calls) == spans


@pytest.mark.parametrize("indexed", [True, False])
def test_each_shard_header_is_parsed_once(synth_ckpt, ckpt_copy, monkeypatch, indexed):
    """Without an index the headers give the tensor map; they are not read again (for a Hub source each parse is
    a request)."""
    d = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    if not indexed:
        (d / "model.safetensors.index.json").unlink()
    parsed = []
    original = ckmod.parse_header
    monkeypatch.setattr(ckmod, "parse_header", lambda f: parsed.append(f.name) or original(f))
    ck = open_checkpoint(d)
    assert sorted(parsed) == sorted(str(d / rel) for rel in ck.files) and len(ck.files) > 1


def test_weight_and_scale_in_different_shards(synth_ckpt):
    ck = open_checkpoint(synth_ckpt("glm-5", "fp8-block"))
    split = [
        n
        for n in ck.names()
        if n.endswith(".weight")
        and ck.weight_format(n) == "fp8-block"
        and len({ck.info(t).file for t in ck.source_tensors(n)}) == 2
    ]
    assert "model.layers.0.self_attn.kv_b_proj.weight" in split
    w, s = (ck.read_raw(t) for t in ck.source_tensors(split[0]))
    ref = w.float() * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    assert torch.equal(ck.read_float(split[0]), ref)


def test_single_file_checkpoint(synth_ckpt, tmp_path):
    src = synth_ckpt("deepseek-v3", "bf16", layers=1, mtp=False)
    ck_src = open_checkpoint(src)
    tensors = {n: ck_src.read_raw(n) for n in ck_src.names()}
    out = tmp_path / "single"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    save_file({"extra.weight": torch.zeros(2)}, str(out / "consolidated.safetensors"))  # beside it: not read
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    ck = open_checkpoint(out)
    assert ck.files == ["model.safetensors"] and ck.index_path is None and "extra.weight" not in ck
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(ck.read_float(name), ck_src.read_float(name))
    assert ck.mla_layers() == [0]


def test_hf_cache_snapshot_of_symlinks(synth_ckpt, ckpt_copy):
    src = synth_ckpt("glm-5", "bf16")
    snap = ckpt_copy(src)
    assert all(p.is_symlink() for p in snap.iterdir())
    ck = open_checkpoint(snap)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(ck.read_float(name), open_checkpoint(src).read_float(name))


def test_os_errors_on_source_files_are_checkpoint_errors(tmp_path):
    folder = tmp_path / "dir.safetensors"
    folder.mkdir()
    with pytest.raises(CheckpointError, match="cannot read") as err:
        sio.LocalFile(folder).read(0, 8)
    assert err.value.file == str(folder)
    gone = sio.LocalFile(tmp_path / "gone.safetensors")
    for call in (gone.size, lambda: gone.read(0, 8)):
        with pytest.raises(CheckpointError, match="missing") as err:
            call()
        assert err.value.file == str(tmp_path / "gone.safetensors")


def test_a_folder_named_like_a_shard_is_not_a_shard(synth_ckpt, ckpt_copy):
    d = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    (d / "model.safetensors.index.json").unlink()  # shards found by listing *.safetensors
    (d / "zz.safetensors").mkdir()
    assert "zz.safetensors" not in open_checkpoint(d).files
    r = CliRunner().invoke(main, ["inspect", str(d)])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("indexed", [True, False])
def test_a_tensor_held_by_two_shards_is_refused(synth_ckpt, ckpt_copy, tmp_path, indexed):
    """Which copy an engine loads would depend on whether it reads the index or every shard."""
    d = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    name, first = _kv_b_shard(d)
    other = next(p.name for p in sorted(d.glob("model-*.safetensors")) if p.name != first)
    tensors = load_file(d / other)
    tensors[name] = torch.zeros(open_checkpoint(d).info(name).shape, dtype=torch.bfloat16)
    (d / other).unlink()  # a new file: the shared original stays as it is
    save_file(tensors, str(d / other))
    if not indexed:
        (d / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="two shards hold this tensor") as err:
        open_checkpoint(d)
    assert err.value.tensor == name and str(d / first) in str(err.value) and str(d / other) in str(err.value)
    for args in (["inspect", str(d)], ["convert", str(d), str(tmp_path / "out")]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and str(err.value) in r.stderr, r.output
    assert not (tmp_path / "out").exists()


# ---- bad checkpoints: Python API and CLI ------------------------------------------------------------


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


def _kv_b_shard(ck_dir: Path) -> tuple[str, str]:
    wm = json.loads((ck_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    return name, wm[name]


def _missing_shard(d: Path):
    name, shard = _kv_b_shard(d)
    (d / shard).unlink()
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    return "shard named by the index is missing", shard, next(t for t, f in wm.items() if f == shard)


def _truncated_shard(d: Path):
    name, shard = _kv_b_shard(d)
    data = (d / shard).resolve().read_bytes()
    _replace(d / shard, data[:-1000])
    return "truncated", shard, None


def _bad_header_length(d: Path):
    _, shard = _kv_b_shard(d)
    data = (d / shard).resolve().read_bytes()
    _replace(d / shard, struct.pack("<Q", 1 << 40) + data[8:])
    return "100 MB", shard, None


def _invalid_json(d: Path):
    _, shard = _kv_b_shard(d)
    data = bytearray((d / shard).resolve().read_bytes())
    data[8] = ord("[")
    _replace(d / shard, bytes(data))
    return "invalid JSON", shard, None


def _offsets_overlap(d: Path):
    _, shard = _kv_b_shard(d)
    header, buffer = _raw((d / shard).resolve())
    name = _last(header)
    header[name]["data_offsets"] = [o - 2 for o in header[name]["data_offsets"]]
    text = json.dumps(header).encode()
    _replace(d / shard, struct.pack("<Q", len(text)) + text + buffer)
    return "overlap", shard, name


def _index_names_absent_tensor(d: Path):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.0.input_layernorm.weight"
    others = [f for f in dict.fromkeys(index["weight_map"].values()) if f != index["weight_map"][name]]
    index["weight_map"][name] = others[0]
    _replace(d / "model.safetensors.index.json", json.dumps(index).encode())
    return "shard lacks it", others[0], name


def _shape_contradicts_config(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["v_head_dim"] = 128
    _replace(d / "config.json", json.dumps(config).encode())
    name, shard = _kv_b_shard(d)
    return "contradicts the config", None, "model.layers.0.self_attn.kv_b_proj.weight"


def _columns_cut(d: Path):
    """A Linear weight whose row count is right but whose columns are not (in = 255, config says 256)."""
    name = "model.layers.1.self_attn.indexer.wk.weight"
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(d / shard)
    tensors[name] = tensors[name][:, :255].contiguous()
    (d / shard).unlink()
    save_file(tensors, str(d / shard))
    return r"shape \(128, 255\) contradicts the config: expected \(128, 256\)", shard, name


def _unknown_architecture(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["architectures"], config["model_type"] = ["LlamaForCausalLM"], "llama"
    _replace(d / "config.json", json.dumps(config).encode())
    return "unknown architecture LlamaForCausalLM", "config.json", None


BAD = [
    _missing_shard,
    _truncated_shard,
    _bad_header_length,
    _invalid_json,
    _offsets_overlap,
    _index_names_absent_tensor,
    _shape_contradicts_config,
    _columns_cut,
    _unknown_architecture,
]


@pytest.mark.parametrize("break_it", BAD, ids=lambda f: f.__name__.strip("_"))
def test_bad_checkpoints_fail_clearly(synth_ckpt, ckpt_copy, break_it):
    d = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    message, file, tensor = break_it(d)
    with pytest.raises(CheckpointError, match=message) as err:
        open_checkpoint(d)
    if file is not None:
        assert err.value.file == str(d / file)
    if tensor is not None:
        assert err.value.tensor == tensor
    result = CliRunner().invoke(main, ["inspect", str(d)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("glm-pack: error: ") and str(err.value) in lines[0]


# ---- index entries must name files inside the checkpoint ---------------------------------------------


def _point_kv_b_at(d: Path, value) -> str:
    """Rewrite the index so layer 0's kv_b_proj maps to ``value``; returns the tensor name."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    index["weight_map"][name] = value
    _replace(d / "model.safetensors.index.json", json.dumps(index).encode())
    return name


@pytest.mark.parametrize(
    "where",
    [
        "parent",
        "absolute",
        "dotdot-inside",
        "linked-folder",
        "hidden",
        "overlay-dir",
        "empty-part",
        "backslash",
        5,
        None,
    ],
)
def test_index_entries_outside_the_checkpoint_are_refused(synth_ckpt, ckpt_copy, tmp_path, where):
    d = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.0.self_attn.kv_b_proj.weight"
    ]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / shard).symlink_to((d / shard).resolve())  # a real shard outside the checkpoint
    (d / "linked").symlink_to(tmp_path / "other", target_is_directory=True)
    (d / f"linked\\{shard}").symlink_to((d / shard).resolve())  # a folder on Windows and the Hub, a name here
    value = {
        "parent": f"../other/{shard}",
        "absolute": str(tmp_path / "other" / shard),
        "dotdot-inside": f"linked/../{shard}",
        "linked-folder": f"linked/{shard}",
        "hidden": f".{shard}",
        "overlay-dir": f"glm-pack/{shard}",
        "empty-part": f"linked//{shard}",
        "backslash": f"linked\\{shard}",
    }.get(where, where)
    name = _point_kv_b_at(d, value)
    with pytest.raises(CheckpointError, match="not a file name inside the checkpoint") as err:
        open_checkpoint(d)
    assert err.value.file == str(d / "model.safetensors.index.json") and err.value.tensor == name


def test_index_entry_in_a_real_subfolder_is_accepted(synth_ckpt, ckpt_copy):
    d = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    (d / "shards").mkdir()
    (d / "shards" / shard).symlink_to((d / shard).resolve())  # a linked file is fine, as in a HF cache snapshot
    (d / shard).unlink()  # moved: one shard per tensor
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {t: f"shards/{shard}" if f == shard else f for t, f in index["weight_map"].items()}
    _replace(d / "model.safetensors.index.json", json.dumps(index).encode())
    assert open_checkpoint(d).info(name).file == f"shards/{shard}"


def test_an_export_without_its_mtp_layer_opens_and_a_missing_mla_layer_is_refused(synth_ckpt, ckpt_copy):
    """Layer 2 is glm-5's MTP layer here (config: num_nextn_predict_layers 1): an export may drop all of it, and then
    it is no MLA layer of the checkpoint; layer 1's kv_b_proj missing is a broken checkpoint."""
    d = ckpt_copy(synth_ckpt("glm-5", "bf16"))
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    full = dict(index["weight_map"])
    index["weight_map"] = {t: f for t, f in full.items() if not t.startswith("model.layers.2.")}
    _replace(index_path, json.dumps(index).encode())
    assert open_checkpoint(d).mla_layers() == [0, 1]
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    index["weight_map"] = {t: f for t, f in full.items() if t != name}
    _replace(index_path, json.dumps(index).encode())
    with pytest.raises(CheckpointError, match="MLA layer 1 has no kv_b_proj") as err:
        open_checkpoint(d)
    assert (err.value.file, err.value.tensor) == (str(index_path), name)


def test_a_folder_without_safetensors_is_no_checkpoint(synth_ckpt, tmp_path):
    (tmp_path / "config.json").write_bytes((synth_ckpt("glm-5", "bf16") / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match=r"no model.safetensors.index.json and no \*.safetensors file") as err:
        open_checkpoint(tmp_path)
    assert err.value.file == str(tmp_path)
