"""Runtime backends and their selection: ``auto`` = aiter on gfx950, then Triton on GPUs, else torch."""

from __future__ import annotations

import torch

from glm_pack.packing.errors import BackendError

from .base import Backend
from .torch_backend import TorchBackend

BACKENDS = ("auto", "aiter", "triton", "torch")


def _aiter(kernel_configs: dict, device) -> Backend:
    from .aiter_backend import AiterBackend, aiter_status

    ok, why = aiter_status(device)
    if not ok:
        raise BackendError(why)
    try:
        fallback = _triton(device)
    except BackendError:
        fallback = TorchBackend()
    return AiterBackend(kernel_configs, fallback=fallback)


def _triton(device) -> Backend:
    from .triton_backend import TritonBackend, triton_status

    ok, why = triton_status(device)
    if not ok:
        raise BackendError(why)
    return TritonBackend()


def select_backend(name: str, device: torch.device, kernel_configs: dict) -> Backend:
    """The backend called ``name`` on ``device``; a forced one that is unavailable raises BackendError saying why."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "torch":
        return TorchBackend()
    if name == "aiter":
        return _aiter(kernel_configs, device)
    if name == "triton":
        return _triton(device)
    for make in (lambda: _aiter(kernel_configs, device), lambda: _triton(device)):
        try:
            return make()
        except BackendError:
            continue
    return TorchBackend()
