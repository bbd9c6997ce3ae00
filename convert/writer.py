"""Crash-safe output files: safetensors written to a temp file, fsynced, renamed into place.

Nothing partial ever carries a final name: a temp file is ``.<name>.tmp``, removed on any failure. OS
writes go through :func:`_os_write` (a seam where tests inject faults such as ENOSPC). A full disk becomes
a :class:`~glm_pack.packing.errors.GlmPackError` that says so.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from glm_pack.packing.errors import GlmPackError

_DTYPE_NAMES = {
    torch.uint8: "U8",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int32: "I32",
}
_os_write = os.write


class OutputError(GlmPackError):
    """Writing an output file failed (no space, read-only location, ...)."""


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor (no copy for contiguous input)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def sha256_tensor(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _write_all(fd: int, data, path: Path) -> None:
    view = memoryview(data).cast("B")
    while view:
        try:
            n = _os_write(fd, view)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise OutputError(f"no space left on device while writing {path}", file=path) from err
            raise OutputError(f"cannot write {path}: {err.strerror or err}", file=path) from err
        view = view[n:]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, chunks: Iterable[bytes | memoryview]) -> int:
    """Write ``chunks`` to ``path`` through a temp file + fsync + rename; returns the byte count."""
    path = Path(path)
    tmp = _temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as err:
        raise OutputError(f"cannot create {tmp}: {err.strerror or err}", file=tmp) from err
    size = 0
    try:
        try:
            for chunk in chunks:
                _write_all(fd, chunk, path)
                size += len(chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Length prefix + JSON header (tensors in the given order, padded with spaces to 8 bytes)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (in order) as a safetensors file, crash-safely; returns the file's sha256."""
    digest = hashlib.sha256()

    def chunks():
        head = safetensors_header(tensors, metadata)
        digest.update(head)
        yield head
        for t in tensors.values():
            data = tensor_bytes(t)
            digest.update(data)
            yield data

    atomic_write(path, chunks())
    return digest.hexdigest()


def write_text(path: Path, text: str) -> None:
    atomic_write(path, [text.encode()])
