"""Crash-safe output files: safetensors written to a temp file, fsynced, renamed into place.

Nothing partial ever carries a final name: a temp file is ``.<name>.tmp``, removed on any failure. OS
writes go through :func:`_os_write` (a seam where tests inject faults such as ENOSPC). A full disk becomes
a :class:`~glm_pack.packing.errors.GlmPackError` that says so.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from glm_pack.packing.errors import GlmPackError

from .safetensors_io import DTYPES, byte_size, encode_header

_os_write = os.write


class OutputError(GlmPackError):
    """Writing an output file failed (no space, read-only location, ...)."""


class NoSpaceError(OutputError):
    """The output's filesystem filled up (ENOSPC) while writing or placing a file."""


_DTYPE_NAMES = {dtype: name for name, (_, dtype) in DTYPES.items() if dtype is not None}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("BF16" for torch.bfloat16)."""
    return _DTYPE_NAMES[dtype]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor (no copy for contiguous input)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def sha256_tensor(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def temp_path(path: Path) -> Path:
    """Where ``path`` is written before its rename: ``.<name>.tmp`` beside it (see :func:`is_temp`)."""
    return path.with_name(f".{path.name}.tmp")


def is_temp(path: Path) -> bool:
    """A temp file's name (``.<name>.tmp``): bytes a killed run left, never a finished file."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _write_error(err: OSError, path: Path) -> OutputError:
    if err.errno == errno.ENOSPC:
        return NoSpaceError(f"no space left on device while writing {path}", file=path)
    return OutputError(f"cannot write {path}: {err.strerror or err}", file=path)


def _write_all(fd: int, data, path: Path) -> None:
    view = memoryview(data).cast("B")
    while view:
        try:
            n = _os_write(fd, view)
        except OSError as err:
            raise _write_error(err, path) from err
        view = view[n:]


def fsync(fd: int, path: Path) -> None:
    """fsync ``fd``, open on ``path``; a failure (EIO, or ENOSPC / EDQUOT where space is allocated late, as on
    NFS) is an OutputError naming ``path``."""
    try:
        os.fsync(fd)
    except OSError as err:
        raise _write_error(err, path) from err


def fsync_path(path: Path) -> None:
    """fsync a file or folder by name (a folder: the renames and links in it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise _write_error(err, path) from err
    try:
        fsync(fd, path)
    finally:
        os.close(fd)


def atomic_write(path: Path, chunks: Iterable[bytes | memoryview]) -> int:
    """Write ``chunks`` to ``path`` through a temp file + fsync + rename + folder fsync; returns the byte count.
    A failure before the rename leaves a file already at ``path`` as it was; one of the folder fsync after it removes
    ``path`` (its new name may never reach the disk), so no failed write leaves a file that claims to be written."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)  # never through a link
    except OSError as err:
        raise OutputError(f"cannot create {tmp}: {err.strerror or err}", file=tmp) from err
    size = 0
    try:
        try:
            for chunk in chunks:
                _write_all(fd, chunk, path)
                size += len(chunk)
            fsync(fd, path)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except OSError as err:  # e.g. a folder where the file goes
            raise _write_error(err, path) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fsync_path(path.parent)
    except BaseException:  # the new name may never reach the disk: claim nothing (a manifest would look complete)
        path.unlink(missing_ok=True)
        raise
    return size


@dataclass(frozen=True)
class LazyTensor:
    """A tensor declared up front (dtype, shape) and produced only when its bytes are written."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return byte_size(dtype_name(self.dtype), self.shape)


def safetensors_header(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """Length prefix + JSON header (tensors or LazyTensors in the given order, padded with spaces to 8 bytes)."""
    return encode_header([(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()], metadata)


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """Write ``tensors`` (in order) as a safetensors file, crash-safely.

    Values are tensors or :class:`LazyTensor`s (made one at a time while writing, so memory holds one tensor).
    Returns (sha256 of the file, {name: sha256 of the tensor's bytes}).
    """
    digest = hashlib.sha256()
    tensor_digests: dict[str, str] = {}

    def chunks():
        head = safetensors_header(tensors, metadata)
        digest.update(head)
        yield head
        for name, t in tensors.items():
            if isinstance(t, LazyTensor):
                made = t.make()
                if made.dtype != t.dtype or tuple(made.shape) != tuple(t.shape):
                    raise OutputError(
                        f"produced {made.dtype} {tuple(made.shape)}, declared {t.dtype} {t.shape}",
                        file=path,
                        tensor=name,
                    )
                t = made
            data = tensor_bytes(t)
            digest.update(data)
            tensor_digests[name] = hashlib.sha256(data).hexdigest()
            yield data

    atomic_write(path, chunks())
    return digest.hexdigest(), tensor_digests


def write_text(path: Path, text: str) -> None:
    atomic_write(path, [text.encode()])


def read_bytes(path: Path, what: str) -> bytes:
    """A file's bytes (a run file, a model card); OutputError naming it where it cannot be read (a permission, an I/O
    error)."""
    try:
        return path.read_bytes()
    except OSError as err:
        raise OutputError(f"cannot read {what}: {err.strerror or err}", file=path) from err


def make_folder(path: Path, what: str) -> None:
    """``mkdir -p path``; OutputError naming ``what`` and what is in the way where it cannot be made (a symlink to
    nothing, a file in its place or in a folder's above it; else the system's reason, e.g. a permission)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create {what}: {_in_the_way(path) or err.strerror or err}", file=path) from err


def _in_the_way(path: Path) -> str | None:
    """What keeps folder ``path`` from being made: a symlink to nothing or a file, at it or a folder above it."""
    for p in (path, *path.parents):
        if os.path.islink(p) and not os.path.exists(p):
            return f"{p} is a symlink to {os.readlink(p)}, which does not exist; create that folder or remove the link"
        if os.path.lexists(p) and not os.path.isdir(p):
            return f"{p} is a file, not a folder"
    return None


def list_folder(path: Path) -> list[Path]:
    """The entries of folder ``path``, sorted; OutputError naming it where it cannot be listed (a permission, an I/O
    error)."""
    try:
        return sorted(path.iterdir())
    except OSError as err:
        raise OutputError(f"cannot list {path}: {err.strerror or err}", file=path) from err


def clear_directory(path: Path, keep: Collection[str] = ()) -> None:
    """Delete everything in folder ``path`` but the names in ``keep``: links and files are unlinked (a link is
    never followed, so a hard- or soft-linked original elsewhere stays as it is), folders go with their contents."""
    for entry in list_folder(path):
        if entry.name not in keep:
            remove(entry)


def remove(entry: Path) -> None:
    """Delete ``entry`` if it exists: a link or file is unlinked (never followed), a folder goes with its contents."""
    try:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
    except OSError as err:
        raise OutputError(f"cannot remove {entry}: {err.strerror or err}", file=entry) from err
