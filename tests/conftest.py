"""Shared pytest fixtures.

``synth_ckpt(card="glm-5", fmt="bf16", *, layers=2, experts=2, mtp=True, seed=0, profile="small")`` returns
the directory of a synthetic checkpoint, cached per argument set for the whole session. Treat it as
read-only; to corrupt one, take ``ckpt_copy(src)``: a fresh directory of symlinks to ``src``'s files (like a
Hugging Face cache snapshot), in which a file can be replaced (unlink the link, write a new file) without
touching the shared original. ``converted`` is a finished conversion of a small MXFP4 (Quark) checkpoint
with repacked experts, so its manifest has every section; also read-only. Defined here, once, so the
convert and reliability suites share one cache and one conversion per session.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.synth import synthesize


@pytest.fixture
def edit_tensor():
    """``edit(ckpt_dir, name, change) -> shard path``: replace one tensor of a sharded safetensors checkpoint
    with ``change(tensor)``. The shard file is replaced (unlinked, then written with its metadata), never
    written through, so hard-linked originals stay untouched."""

    def edit(ckpt: Path, name: str, change) -> Path:
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        shard = ckpt / index["weight_map"][name]
        with safe_open(shard, framework="pt") as f:
            metadata = f.metadata()
        tensors = load_file(shard)
        tensors[name] = change(tensors[name])
        shard.unlink()
        save_file(tensors, shard, metadata=metadata)
        return shard

    return edit


@pytest.fixture(scope="session")
def synth_ckpt(tmp_path_factory):
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("synth")

    def make(card="glm-5", fmt="bf16", *, layers=2, experts=2, mtp=True, seed=0, profile="small") -> Path:
        key = (card, fmt, layers, experts, mtp, seed, profile)
        if key not in cache:
            out = root / "-".join(map(str, key))
            cache[key] = synthesize(
                out, card=card, layers=layers, experts=experts, fmt=fmt, profile=profile, seed=seed, mtp=mtp
            )
        return cache[key]

    return make


@pytest.fixture
def ckpt_copy(tmp_path):
    def copy(src: Path) -> Path:
        dst = tmp_path / f"copy-{len(list(tmp_path.iterdir()))}"
        dst.mkdir()
        for p in Path(src).iterdir():
            os.symlink(p.resolve(), dst / p.name)
        return dst

    return copy


@pytest.fixture(scope="session")
def converted(synth_ckpt, tmp_path_factory):
    """(SRC, OUT) of a finished conversion with MLA layers and repacked experts."""
    src = synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2)
    out = tmp_path_factory.mktemp("reliability") / "out"
    convert(src, out, ConvertOptions(files="copy", repack_experts="aiter-a4w4"))
    return src, out
