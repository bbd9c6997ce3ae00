"""Session fixtures shared by the convert tests: synthetic checkpoints written once per session.

``synth_ckpt(card="glm-5", fmt="bf16", *, layers=2, experts=2, mtp=True, seed=0, profile="small")`` returns
the directory of a synthetic checkpoint, cached per argument set for the whole session. Treat it as
read-only; to corrupt one, take ``ckpt_copy(src)``: a fresh directory of symlinks to ``src``'s files (like a
Hugging Face cache snapshot), in which a file can be replaced (unlink the link, write a new file) without
touching the shared original.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glm_pack.convert.synth import synthesize


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
