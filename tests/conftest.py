"""Shared pytest fixtures.

``synth_ckpt(card="glm-5", fmt="bf16", *, layers=2, experts=2, mtp=True, seed=0, profile="small")`` returns
the directory of a synthetic checkpoint, cached per argument set for the whole session. Treat it as
read-only; to corrupt one, take ``ckpt_copy(src)``: a fresh directory of symlinks to ``src``'s files (like a
Hugging Face cache snapshot), in which a file can be replaced (unlink the link, write a new file) without
touching the shared original. ``converted`` is a finished conversion of a small MXFP4 (Quark) checkpoint
with repacked experts, so its manifest has every section; also read-only. Defined here, once, so the
convert and reliability suites share one cache and one conversion per session. ``lock_holder(out,
shared=False)`` starts a second process that holds OUT's lock until the test ends (or it is killed);
``read_only(out)`` gives a view of OUT nobody may write to. ``refuse(owner, name, hit, code=EACCES)`` makes one
file-system call fail for some paths, as the OS would (the tests run as root, whom chmod does not stop).

``glm-pack convert`` run without ``--workers`` uses one process here (``GLM_PACK_WORKERS=1``, for this process and
the ones it starts): spawning workers, each importing torch, took 4-5 s a conversion of these small checkpoints.
Tests of several workers say ``--workers N``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# Before glm_pack's Rich consoles are made: a console made while COLUMNS is set keeps that width for good (pytest-xdist
# sets COLUMNS=80 in its workers); made without, it reads COLUMNS at each print, which the tests set per invocation.
os.environ.pop("COLUMNS", None)
os.environ["GLM_PACK_WORKERS"] = "1"

from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.synth import synthesize


@pytest.fixture
def refuse(monkeypatch):
    """``refuse(owner, name, hit, code=errno.EACCES)``: ``owner.name``, a call whose first argument is a path
    (``os.stat``, ``os.scandir``, ``builtins.open``, ``Path.read_bytes``...), raises ``OSError(code)`` naming the path
    for every path ``hit`` names: a ``Path`` (that one alone) or a predicate on ``Path`` (e.g. every path under a
    folder this user may not enter). Other arguments (file descriptors, other paths) reach the real call."""

    def install(owner, name, hit, code=errno.EACCES):
        real = getattr(owner, name)
        hits = hit if callable(hit) else Path(hit).__eq__

        def refused(path=".", *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and hits(Path(os.fspath(path))):
                raise OSError(code, os.strerror(code), os.fspath(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(owner, name, refused)

    return install


@pytest.fixture
def edit_index():
    """``edit(ckpt_dir, change)``: replace the index's weight_map with ``change(weight_map)``. The index file is
    replaced (unlinked, then written), never written through, so a linked or hard-linked original stays as it is."""

    def edit(ckpt: Path, change) -> None:
        path = ckpt / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        index["weight_map"] = change(index["weight_map"])
        path.unlink()
        path.write_text(json.dumps(index))

    return edit


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


_HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from glm_pack.convert.state import OutputLock
    with OutputLock(sys.argv[1], shared=True) if sys.argv[2:] == ["shared"] else OutputLock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(600)
    """
)


@pytest.fixture
def lock_holder():
    """``hold(out, shared=False) -> Popen``: another process holding OUT's lock, exclusive (a writer: its pid
    goes into the lock file) or shared (a reader), until the test ends or it is killed."""
    holders = []

    def hold(out: Path, shared: bool = False) -> subprocess.Popen:
        args = [sys.executable, "-c", _HOLD_LOCK, str(out), *(["shared"] if shared else [])]
        holder = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        holders.append(holder)
        assert holder.stdout.readline().strip() == "locked"
        return holder

    yield hold
    for holder in holders:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@pytest.fixture
def read_only(tmp_path):
    """``read_only(out) -> view``: OUT behind a view nobody may write: OUT itself chmod 555 for an ordinary
    user; root ignores modes, so a read-only bind mount of OUT."""
    undo = []

    def make(out):
        if os.geteuid() != 0:
            out.chmod(0o555)
            undo.append(lambda: out.chmod(0o755))
            return out
        view = tmp_path / "view"
        view.mkdir()
        for args in (["--bind", out, view], ["-o", "remount,ro,bind", view]):
            r = subprocess.run(["mount", *map(str, args)], capture_output=True, text=True)
            if r.returncode:
                pytest.skip(f"running as root and cannot mount a read-only view ({r.stderr.strip() or 'mount failed'})")
            if not undo:
                undo.append(lambda: subprocess.run(["umount", "-l", str(view)], check=False))
        return view

    yield make
    for step in undo:
        step()
