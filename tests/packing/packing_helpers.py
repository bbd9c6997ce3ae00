"""Test helpers for the packing tests: a switch to the reference codec and exact-arithmetic MXFP4 math.

The exact helpers are written from ``notes/mxfp4.md`` (value = E2M1[code & 7] * sign * 2**(byte - 127)),
independently of the code under test.
"""

from __future__ import annotations

import contextlib
from fractions import Fraction
from unittest import mock

import torch

from glm_pack.packing import _mxfp4_fast

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@contextlib.contextmanager
def reference_only():
    """Run the public codec on its torch reference path (the fast path reports 'not available')."""
    with (
        mock.patch.object(_mxfp4_fast, "quantize_rows", lambda rows, mode: None),
        mock.patch.object(_mxfp4_fast, "dequantize_rows", lambda codes, scales: None),
    ):
        yield


def nibbles(codes: torch.Tensor) -> list[int]:
    """Packed bytes (last axis) -> flat list of 4-bit codes, element 2i from the low nibble."""
    out = []
    for byte in codes.reshape(-1).tolist():
        out += [byte & 0xF, byte >> 4]
    return out


def exact_value(code: int, scale_byte: int) -> Fraction:
    magnitude = Fraction(E2M1[code & 7]) * Fraction(2) ** (scale_byte - 127)
    return -magnitude if code & 8 else magnitude


def exact_block_error(x: list[float], codes: list[int], scale_byte: int) -> Fraction:
    """Exact sum of squared errors of one 32-block."""
    return sum((Fraction(v) - exact_value(c, scale_byte)) ** 2 for v, c in zip(x, codes, strict=True))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit patterns, except that any NaN matches any NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    both_nan = torch.isnan(a) & torch.isnan(b)
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(((a.view(int_dtype) == b.view(int_dtype)) | both_nan).all())
