"""Strict safetensors header parsing and lazy tensor reads through a small byte-source seam.

File layout: 8-byte little-endian u64 ``N``, ``N`` bytes of UTF-8 JSON, then the data buffer. The header
maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data
buffer) plus an optional ``"__metadata__"`` of str -> str. :func:`parse_header` checks everything the
reference implementation checks, before allocating anything sized by the file's own claims: the length
fits the file and 100 MB, the JSON is an object without duplicate keys, dtypes are known, each tensor's
byte size equals ``prod(shape) * itemsize``, and the tensors tile the data buffer exactly (no gap, no
overlap, no trailing bytes, nothing past the end of the file).

All file access goes through a :class:`ByteSource` (``name``, ``size()``, ``read(offset, length)``), so a
remote range-reading source (Hub) plugs in without touching parsing or dequantization. A tensor read
fetches exactly that tensor's byte range: never a whole shard.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from glm_pack.packing.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000

# safetensors dtype name -> (bits per element, torch dtype or None when read back as raw uint8 bytes)
DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "BOOL": (8, torch.bool),
    "U8": (8, torch.uint8),
    "I8": (8, torch.int8),
    "F8_E4M3": (8, torch.float8_e4m3fn),
    "F8_E5M2": (8, torch.float8_e5m2),
    "F8_E8M0": (8, getattr(torch, "float8_e8m0fnu", None)),
    "I16": (16, torch.int16),
    "U16": (16, torch.uint16),
    "F16": (16, torch.float16),
    "BF16": (16, torch.bfloat16),
    "I32": (32, torch.int32),
    "U32": (32, torch.uint32),
    "F32": (32, torch.float32),
    "I64": (64, torch.int64),
    "U64": (64, torch.uint64),
    "F64": (64, torch.float64),
    "C64": (64, torch.complex64),
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}


class ByteSource(Protocol):
    """Random access to one file's bytes. ``name`` is what error messages call the file."""

    name: str

    def size(self) -> int: ...

    def read(self, offset: int, length: int) -> bytearray: ...


class LocalFile:
    """A local file (symlinks followed, as in Hugging Face cache snapshots), read with positional reads."""

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        self.path = Path(path)
        self.name = name if name is not None else str(path)

    def _error(self, err: OSError) -> CheckpointError:
        if isinstance(err, FileNotFoundError):
            return CheckpointError("file is missing (or a dangling symlink)", file=self.name)
        return CheckpointError(f"cannot read: {err.strerror or err}", file=self.name)

    def size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError as err:
            raise self._error(err) from err

    def read(self, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        try:
            with open(self.path, "rb", buffering=0) as f:
                got = os.preadv(f.fileno(), [buf], offset) if length else 0
        except OSError as err:
            raise self._error(err) from err
        if got != length:
            raise CheckpointError(f"short read: wanted {length} bytes at offset {offset}, got {got}", file=self.name)
        return buf


@dataclass(frozen=True)
class TensorEntry:
    """One header entry; ``begin``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    data_start: int  # 8 + N
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def byte_size(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` (safetensors name) and ``shape``; sub-byte types must fill whole bytes."""
    bits = DTYPES[dtype][0] * math.prod(shape)
    if bits % 8:
        raise ValueError(f"{dtype} tensor of shape {shape} does not fill whole bytes")
    return bits // 8


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(name: str, raw, data_start: int, file: str) -> TensorEntry:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(
            "corrupt header: entry must be an object with exactly dtype, shape, data_offsets", file=file, tensor=name
        )
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"corrupt header: unknown dtype {dtype!r}", file=file, tensor=name)
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise CheckpointError(f"corrupt header: shape {shape!r} is not a list of sizes", file=file, tensor=name)
    if math.prod(d for d in shape if d) >= 2**63:  # even with a zero dim: torch's strides must fit int64
        raise CheckpointError(f"corrupt header: shape {shape!r} is too large", file=file, tensor=name)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(o) for o in offsets):
        raise CheckpointError(f"corrupt header: data_offsets {offsets!r} is not [begin, end]", file=file, tensor=name)
    begin, end = offsets
    if end < begin:
        raise CheckpointError(f"corrupt header: data_offsets [{begin}, {end}] end before begin", file=file, tensor=name)
    try:
        expected = byte_size(dtype, tuple(shape))
    except ValueError as err:
        raise CheckpointError(f"corrupt header: {err}", file=file, tensor=name) from err
    if end - begin != expected:
        raise CheckpointError(
            f"corrupt header: {dtype} {tuple(shape)} needs {expected} bytes but data_offsets span {end - begin}",
            file=file,
            tensor=name,
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def parse_header(source: ByteSource) -> Header:
    """Read and validate one file's header (two small reads); raises :class:`CheckpointError` naming file/tensor."""
    file = source.name
    size = source.size()
    if size < 8:
        raise CheckpointError(f"truncated: {size} bytes, not even the 8-byte header length", file=file)
    (n,) = struct.unpack("<Q", bytes(source.read(0, 8)))
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"corrupt header: length {n} exceeds the 100 MB limit", file=file)
    if 8 + n > size:
        raise CheckpointError(
            f"corrupt or truncated: header length {n} runs past the end of the {size}-byte file", file=file
        )
    try:
        raw = json.loads(bytes(source.read(8, n)).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # RecursionError: absurdly deep nesting
        raise CheckpointError(f"corrupt header: invalid JSON ({err})", file=file) from err
    if not isinstance(raw, dict):
        raise CheckpointError("corrupt header: JSON is not an object", file=file)
    metadata = raw.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null means none; [], 0, "" are not a map
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError("corrupt header: __metadata__ must map strings to strings", file=file)
    data_start = 8 + n
    tensors = {name: _entry(name, entry, data_start, file) for name, entry in raw.items()}
    _check_tiling(tensors, data_start, size, file)
    return Header(data_start, tensors, metadata)


def _check_tiling(tensors: dict[str, TensorEntry], data_start: int, size: int, file: str) -> None:
    cursor = data_start
    for e in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < cursor:
            raise CheckpointError("corrupt header: data_offsets overlap the previous tensor", file=file, tensor=e.name)
        if e.begin > cursor:
            raise CheckpointError(
                f"corrupt header: {e.begin - cursor}-byte gap before this tensor", file=file, tensor=e.name
            )
        if e.end > size:
            raise CheckpointError(
                f"truncated: tensor ends at byte {e.end} but the file has {size} bytes", file=file, tensor=e.name
            )
        cursor = e.end
    if cursor != size:
        raise CheckpointError(f"corrupt: {size - cursor} trailing bytes after the last tensor", file=file)


def read_tensor(source: ByteSource, entry: TensorEntry) -> torch.Tensor:
    """Exactly ``entry``'s bytes as a CPU tensor of its stored dtype and shape (sub-byte types: raw uint8)."""
    torch_dtype = DTYPES[entry.dtype][1]
    buf = source.read(entry.begin, entry.nbytes)
    if torch_dtype is None:
        return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    if not buf:
        return torch.empty(entry.shape, dtype=torch_dtype)
    return torch.frombuffer(buf, dtype=torch_dtype).reshape(entry.shape)


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> bytes:
    """Header bytes (length prefix + JSON padded with spaces to a multiple of 8) for tensors laid out in order.

    ``entries`` are ``(name, dtype, shape)``; offsets follow one another from 0 in the given order.
    """
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = byte_size(dtype, tuple(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
