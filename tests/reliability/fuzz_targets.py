"""Fuzz targets shared by the hypothesis tests and ``benchmarks/fuzz_long.py`` (atheris).

Each target takes one untrusted input and checks the outcome contract: the input parses (and then the
result is internally consistent) or a :class:`~glm_pack.packing.errors.GlmPackError` subclass with a
message is raised. Any other exception, or an assertion here, is a bug. Reads are bounded: the in-memory
byte source refuses any read past the end of the input, so a parser can never allocate a buffer sized by
a length the file merely claims.
"""

from __future__ import annotations

import json
import struct
from collections import Counter

from glm_pack.convert.safetensors_io import DTYPES, Header, byte_size, parse_header, read_tensor
from glm_pack.packing import manifest as mf
from glm_pack.packing.errors import CheckpointError, GlmPackError

# How many inputs each target saw and how many it accepted, per target name (printed by the tests).
COUNTS: Counter = Counter()


class MemoryFile:
    """A :class:`ByteSource` over bytes that fails loudly (AssertionError) on any read past the end."""

    name = "fuzz.safetensors"

    def __init__(self, data: bytes):
        self.data = data

    def size(self) -> int:
        return len(self.data)

    def read(self, offset: int, length: int) -> bytearray:
        assert 0 <= offset and 0 <= length and offset + length <= len(self.data), (
            f"read of {length} bytes at {offset} past the end of a {len(self.data)}-byte input"
        )
        return bytearray(self.data[offset : offset + length])


def safetensors_file(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A file of ``header`` (a JSON-able object, or ready text/bytes) + ``data``; ``length`` overrides the prefix."""
    if isinstance(header, bytes | str):
        text = header.encode() if isinstance(header, str) else header
    else:
        text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def safetensors_target(data: bytes) -> Header | None:
    """Parse ``data`` as a safetensors file; on success read every tensor back. None when rightly refused."""
    COUNTS["safetensors"] += 1
    source = MemoryFile(data)
    try:
        header = parse_header(source)
    except CheckpointError as err:
        assert err.message and err.file == source.name
        return None
    COUNTS["safetensors accepted"] += 1
    cursor = header.data_start
    for entry in sorted(header.tensors.values(), key=lambda e: e.begin):
        assert entry.begin == cursor and entry.nbytes == byte_size(entry.dtype, entry.shape)
        tensor = read_tensor(source, entry)
        if DTYPES[entry.dtype][1] is not None:
            assert tuple(tensor.shape) == entry.shape and tensor.dtype == DTYPES[entry.dtype][1]
        else:
            assert tensor.numel() == entry.nbytes
        cursor = entry.end
    assert cursor == len(data)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())
    return header


def manifest_target(text: bytes) -> dict | None:
    """Run every manifest reader on ``text``; the parsed manifest, or None when rightly refused."""
    COUNTS["manifest"] += 1
    try:
        manifest = mf.loads(text)
        layers = mf.parse_mla(manifest)
        tensors = mf.parse_tensors(manifest)
        groups = mf.parse_experts(manifest)
        mf.parse_geometry(manifest)
    except GlmPackError as err:
        assert err.message
        return None
    COUNTS["manifest accepted"] += 1
    for layer in layers:
        for proj in (layer.w_kc, layer.w_vc):
            assert proj.weight in tensors and (proj.scale is None or proj.scale in tensors)
    for _, file, names in groups:
        assert all(tensors[n].file == file for n in names)
    return manifest


# --- seeded mutators (cheap enough for tens of thousands of inputs in CI; the long run uses them too) ----------
AWKWARD = [
    None, True, False, 0, -1, 1, 3, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63), 10**30, 1.5, -0.0,
    float("nan"), float("inf"), "", "x", "bmm_kn", "bmm_nk ", "aiter_shuffle_32x32", "aiter_moe_a8w8", "U8",
    "F4", "../escape.safetensors", [], {}, [0], [-1, 4], {"k": "v"}, [[[]]],
]  # fmt: skip
DEEP = "\x00deep\x00"  # placeholder string replaced by a deeply nested array in the serialized text


def dumps_with_deep(obj, depth: int) -> bytes:
    """JSON text of ``obj`` (NaN/Infinity allowed) with each DEEP placeholder replaced by ``depth`` nested arrays."""
    text = json.dumps(obj, allow_nan=True)
    return text.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


def mutate_bytes(data: bytes, rng) -> bytes:
    """1-4 random byte-level edits: flip, set, truncate, insert, delete, or rewrite the header length."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(out)) if out else 0
        op = rng.randrange(6)
        if op == 0 and out:
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[pos] = rng.randrange(256)
        elif op == 2:
            del out[pos:]
        elif op == 3:
            out[pos:pos] = bytes([rng.randrange(256)]) * rng.randint(1, 9)
        elif op == 4:
            del out[pos : pos + rng.randint(1, 9)]
        else:
            out[:8] = struct.pack("<Q", rng.choice([0, 7, len(out), max(len(out) - 8, 0), 2**63, 2**64 - 1]))
    return bytes(out)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def mutate_manifest(base_text: str, rng) -> bytes:
    """A manifest with 1-3 fields replaced by awkward values, dropped, added, or nested absurdly deep."""
    m = json.loads(base_text)
    depth = 0
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(m) if p]
        if not paths:
            break
        *parents, key = rng.choice(paths)
        parent = m
        for k in parents:
            parent = parent[k]
        op = rng.randrange(5)
        if op == 0:
            del parent[key]
        elif op == 1 and isinstance(parent, dict):
            parent[rng.choice(["extra", "", "layout", "scale"])] = rng.choice(AWKWARD)
        elif op == 2:
            parent[key] = DEEP
            depth = rng.choice([mf.MAX_JSON_DEPTH, mf.MAX_JSON_DEPTH + 8, 2000, 100_000])
        else:
            parent[key] = rng.choice(AWKWARD)
    return dumps_with_deep(m, depth)
