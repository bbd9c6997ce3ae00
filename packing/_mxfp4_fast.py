"""Compiled fast path of the MXFP4 codec (placeholder: returns None so the reference runs)."""

from __future__ import annotations


def quantize_blocks(xb, mode):
    return None
