"""Shared pytest fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file


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
