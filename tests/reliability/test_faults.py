"""Faults while converting: a full disk, read-only or missing locations, a source that changes underneath,
a source that is also the output, symlinks in OUT. Each leaves no temp file, no manifest, an untouched
source, and a clear one-line CLI error; where the run can be continued, ``--resume`` then succeeds.

SIGKILL / Ctrl-C / lock contention are in tests/convert/test_resume.py; tampering in test_tamper.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm_pack.convert import state, writer
from glm_pack.convert.cli import main
from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.verify import verify
from glm_pack.packing.layouts import unpack_bmm_nk
from glm_pack.packing.mxfp4 import dequantize_reference


def tree_digest(root):
    """{relative path: sha256} of every file under ``root`` (through symlinks), plus each file's mtime."""
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def overlay_bytes(out):
    return {p.name: p.read_bytes() for p in sorted((out / "glm-pack").glob("*.safetensors"))}


def temp_files(root):
    return sorted(str(p) for p in root.rglob(".*.tmp"))


def cli(*args):
    r = CliRunner().invoke(main, ["convert", "--workers", "1", *map(str, args)])
    errors = [line for line in r.output.splitlines() if line.startswith("glm-pack: error:")]
    return r, errors


def assert_failed_cleanly(r, errors, out, src, src_digest, phrase):
    assert r.exit_code == 1, r.output
    assert len(errors) == 1 and phrase in errors[0], r.output
    assert "Traceback" not in r.output
    assert not out.exists() or temp_files(out) == []
    assert not (out / "glm-pack" / "manifest.json").exists()
    assert tree_digest(src) == src_digest


@pytest.fixture(scope="module")
def source(synth_ckpt):
    return synth_ckpt("glm-5", "bf16", layers=1, experts=2)  # 2 MLA layers (with the MTP layer)


@pytest.fixture(scope="module")
def clean(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    convert(source, out, ConvertOptions(files="copy"))
    return out


def enospc_when(predicate):
    """An ``_os_write`` stand-in that raises ENOSPC for the first write that ``predicate(call, data)`` picks."""
    real, calls = writer._os_write, [0]

    def write(fd, data):
        calls[0] += 1
        if predicate(calls[0], bytes(data[:64])):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    return write


def test_a_failed_rewrite_keeps_the_file_it_would_replace(tmp_path, monkeypatch):
    """atomic_write goes through a temp file: until the rename the final name holds the old bytes (also while
    writing), and a write that fails leaves them as they were, with no temp file."""
    path = tmp_path / "x.bin"
    path.write_bytes(b"old contents")
    seen = []
    fail = enospc_when(lambda call, head: call == 2)

    def write(fd, data):
        seen.append(path.read_bytes())
        return fail(fd, data)

    monkeypatch.setattr(writer, "_os_write", write)
    with pytest.raises(writer.OutputError, match="no space left"):
        writer.atomic_write(path, [b"new ", b"bytes"])
    assert seen == [b"old contents", b"old contents"]
    assert path.read_bytes() == b"old contents" and temp_files(tmp_path) == []


def test_atomic_write_finishes_short_writes(tmp_path, monkeypatch):
    """os.write may write fewer bytes than asked (a signal, a pipe-like or network filesystem): the rest follows."""
    real = writer._os_write
    monkeypatch.setattr(writer, "_os_write", lambda fd, data: real(fd, bytes(data[:3])))
    path = tmp_path / "x.bin"
    assert writer.atomic_write(path, [b"0123456789", b"abcdefg"]) == 17
    assert path.read_bytes() == b"0123456789abcdefg"


def test_atomic_write_over_a_longer_stale_temp_file(tmp_path):
    """A killed run's temp file, longer than the new contents, leaves none of its tail in the finished file."""
    path = tmp_path / "x.bin"
    writer.temp_path(path).write_bytes(b"stale bytes of a killed run, longer than the new ones")
    writer.atomic_write(path, [b"new"])
    assert path.read_bytes() == b"new" and temp_files(tmp_path) == []


def test_atomic_write_never_writes_through_a_linked_temp_name(tmp_path):
    """A symlink planted at the temp name is refused, never followed: the file it points to stays as it was."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = tmp_path / "x.bin"
    writer.temp_path(path).symlink_to(victim)
    with pytest.raises(writer.OutputError, match="cannot create"):
        writer.atomic_write(path, [b"new"])
    assert victim.read_bytes() == b"keep" and not path.exists()


@pytest.mark.parametrize("name", ["a", "ab", "abcdefg", "w" * 29])
def test_safetensors_headers_keep_tensor_data_8_byte_aligned(tmp_path, name):
    """The format pads the JSON header with spaces so the data (and every tensor in it) starts 8-byte aligned;
    the metadata is kept, and each tensor's recorded sha256 is that of its own bytes."""
    tensors = {name: torch.arange(3, dtype=torch.uint8), "b": torch.tensor([1.5, -2.0], dtype=torch.float32)}
    path = tmp_path / "t.safetensors"
    digest, shas = writer.write_safetensors(path, tensors, {"format": "pt"})
    data = path.read_bytes()
    assert int.from_bytes(data[:8], "little") % 8 == 0
    assert digest == hashlib.sha256(data).hexdigest()
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    loaded = load_file(path)
    for key, t in tensors.items():
        assert torch.equal(loaded[key], t)
        assert shas[key] == hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("made", [torch.zeros(2, 3, dtype=torch.uint8), torch.zeros(3, 2, dtype=torch.float16)])
def test_a_lazy_tensor_made_unlike_its_declaration_is_refused(tmp_path, made):
    """The header is written before a LazyTensor is made: one made with another shape (same dtype) or dtype would
    leave a file whose header lies; it is refused, naming the tensor, and no file stays."""
    path = tmp_path / "t.safetensors"
    lazy = writer.LazyTensor(torch.uint8, (3, 2), lambda: made)
    with pytest.raises(writer.OutputError, match="declared") as err:
        writer.write_safetensors(path, {"t": lazy})
    assert err.value.tensor == "t" and not path.exists() and temp_files(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fds through /proc")
def test_atomic_write_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Crash safety needs the data on disk before the final name points at it, and the rename itself on disk."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "x.bin"
    writer.atomic_write(path, [b"data"])
    tmp, final, folder = (os.path.realpath(p) for p in (tmp_path / ".x.bin.tmp", path, tmp_path))
    assert events == [("fsync", tmp), ("replace", tmp, final), ("fsync", folder)]
    assert path.read_bytes() == b"data"


MANIFEST_START = b'{\n  "created"'  # mf.dumps sorts keys: the manifest text starts so


@pytest.mark.parametrize(
    "where, predicate",
    [
        ("overlay", lambda call, head: call == 3),  # inside the second overlay file, after its header
        ("manifest", lambda call, head: head.startswith(MANIFEST_START)),
    ],
)
def test_disk_full_at_the_write_seam_then_resume(source, clean, tmp_path, monkeypatch, where, predicate):
    out = tmp_path / "out"
    before = tree_digest(source)
    monkeypatch.setattr(writer, "_os_write", enospc_when(predicate))
    r, errors = cli(source, out, "--files", "copy")
    assert_failed_cleanly(r, errors, out, source, before, "no space left on device")
    resume = f"; finished layers are kept: rerun the same command with --resume to complete {out}, after freeing space"
    assert errors[0].endswith(resume), errors  # the next step, as Ctrl-C's line gives it
    monkeypatch.undo()
    r, errors = cli(source, out, "--files", "copy")  # without --resume: refused, nothing claimed complete
    assert r.exit_code == 1 and "--resume" in errors[0]
    r, errors = cli(source, out, "--files", "copy", "--resume")
    assert r.exit_code == 0, r.output
    assert overlay_bytes(out) == overlay_bytes(clean) and verify(out).ok
    assert temp_files(out) == [] and tree_digest(source) == before


@pytest.mark.parametrize(
    "victim",
    [
        "glm-pack/.layer-001.safetensors.tmp",  # an overlay file before its rename
        "glm-pack/.journal.jsonl",  # a journal line
        "glm-pack",  # the overlay folder after a rename
        "config.json",  # a copied original
        ".",  # OUT, after the originals were copied
    ],
)
def test_a_failing_fsync_is_one_line_naming_the_file(source, clean, tmp_path, monkeypatch, victim):
    """fsync can fail (EIO; ENOSPC / EDQUOT where space is allocated late, e.g. NFS): it was an OSError traceback."""
    out = tmp_path / "out"
    before = tree_digest(source)
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str((out / victim).resolve()):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    r, errors = cli(source, out, "--files", "copy")
    named = out / victim.replace(".layer-001.safetensors.tmp", "layer-001.safetensors")
    assert_failed_cleanly(r, errors, out, source, before, f"cannot write {named}: Input/output error")
    monkeypatch.undo()
    r, errors = cli(source, out, "--files", "copy", "--resume")
    assert r.exit_code == 0, r.output
    assert overlay_bytes(out) == overlay_bytes(clean) and temp_files(out) == []


def test_a_failing_fsync_after_the_manifest_rename_leaves_no_manifest(source, clean, tmp_path, monkeypatch):
    """The manifest's name is on disk only once its folder is fsynced: if that fails, convert fails and OUT must not
    look complete (the renamed manifest stayed, and --resume then said 'already complete')."""
    out = tmp_path / "out"
    before = tree_digest(source)
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str((out / "glm-pack").resolve()) and (
            out / "glm-pack" / "manifest.json"
        ).exists():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    r, errors = cli(source, out, "--files", "copy")
    assert_failed_cleanly(r, errors, out, source, before, f"cannot write {out / 'glm-pack'}: Input/output error")
    assert not verify(out).ok
    monkeypatch.undo()
    r, errors = cli(source, out, "--files", "copy", "--resume")
    assert r.exit_code == 0, r.output
    assert overlay_bytes(out) == overlay_bytes(clean) and temp_files(out) == [] and verify(out).ok


def test_hard_linked_originals_are_durable_before_the_manifest(source, tmp_path, monkeypatch):
    """A hard link's name is on disk only once its folder is fsynced; the manifest must not be durable before it
    (OUT was never fsynced with --files link: a crash could keep the manifest and lose the links)."""
    out, fsynced = tmp_path / "out", []
    real = os.fsync

    def fsync(fd):
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    r, _ = cli(source, out, "--files", "link", "--quiet")
    assert r.exit_code == 0, r.output
    assert os.stat(out / "config.json").st_ino == os.stat(source / "config.json").st_ino  # linked, not copied
    assert str(out.resolve()) in fsynced[: fsynced.index(str((out / "glm-pack" / ".manifest.json.tmp").resolve()))]


def test_originals_copied_where_a_hard_link_fails_are_durable_before_the_manifest(source, tmp_path, monkeypatch):
    """--files link falls back to copying where a hard link cannot be made (another filesystem: EXDEV); those copies
    are bytes written like any other, fsynced before the manifest is."""
    out, fsynced = tmp_path / "out", []
    real = os.fsync

    def fsync(fd):
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    def link(*args, **kwargs):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    r, _ = cli(source, out, "--files", "link", "--quiet")
    assert r.exit_code == 0, r.output
    before_manifest = fsynced[: fsynced.index(str((out / "glm-pack" / ".manifest.json.tmp").resolve()))]
    originals = sorted(p for p in source.iterdir() if p.is_file())
    assert originals and all(os.stat(out / p.name).st_ino != os.stat(p).st_ino for p in originals)  # copies
    assert [p.name for p in originals if str((out / p.name).resolve()) not in before_manifest] == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 12 MiB tmpfs (one overlay file of the test source fits, two do not); skipped where mounting is denied."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip() or 'mount failed'})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_run_too_big_for_a_real_small_filesystem_is_refused_before_it_starts(source, clean, small_tmpfs):
    out = small_tmpfs / "out"
    before = tree_digest(source)
    r, errors = cli(source, out, "--files", "none")
    assert_failed_cleanly(r, errors, out, source, before, f"not enough free space on the filesystem of {out}")
    assert "(overlay files 17.1 MiB) and 12.0 MiB is free;" in errors[0]  # 2 layers of 8.5 MiB + 72 KiB each
    assert [p.name for p in out.iterdir()] == [".glm-pack.lock"]
    r = subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r, errors = cli(source, out, "--files", "none")  # nothing was started: no --resume
    assert r.exit_code == 0, r.output
    assert overlay_bytes(out) == overlay_bytes(clean) and temp_files(out) == []


def test_disk_full_on_a_real_small_filesystem(source, clean, small_tmpfs):
    out = small_tmpfs / "out"
    before = tree_digest(source)
    r, errors = cli(source, out, "--files", "none", "--skip-space-check")  # past the estimate: the disk fills
    assert_failed_cleanly(r, errors, out, source, before, "no space left on device")
    r = subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r, errors = cli(source, out, "--files", "none", "--resume")
    assert r.exit_code == 0, r.output
    assert overlay_bytes(out) == overlay_bytes(clean) and temp_files(out) == []


def test_disk_full_before_the_first_output_byte(source, small_tmpfs):
    """Not even the lock's pid fits: one line (was an OSError traceback from the lock)."""
    with open(small_tmpfs / "filler", "wb") as f, pytest.raises(OSError, match="No space left"):
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()
    out = small_tmpfs / "out"
    before = tree_digest(source)
    r, errors = cli(source, out, "--files", "none")
    assert_failed_cleanly(r, errors, out, source, before, f"no space left on device while writing {out}/.glm-pack.lock")
    assert "--resume" not in errors[0]  # nothing to resume: the run had not started


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write to: chmod for ordinary users; root ignores modes, so a read-only tmpfs."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs ({r.stderr.strip() or 'mount failed'})")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_read_only_output_parent(source, read_only_dir):
    before = tree_digest(source)
    r, errors = cli(source, read_only_dir / "out")
    assert r.exit_code == 1 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert str(read_only_dir / "out") in errors[0]
    assert tree_digest(source) == before


@pytest.mark.parametrize("files", ["link", "copy"])
def test_a_folder_for_the_originals_that_cannot_be_made_is_one_line(source, ckpt_copy, tmp_path, files, refuse):
    """The folder an original in a folder of the source goes to cannot be made (no space: no inode left): one line
    naming the original, exit 1, no manifest, no temp files; it was the raw OSError (a traceback)."""
    src = ckpt_copy(source)
    (src / "original").mkdir()
    (src / "original" / "notes.md").write_text("kept with the checkpoint")
    out = tmp_path / "out"
    refuse(type(out), "mkdir", out / "original", errno.ENOSPC)
    before = tree_digest(source)
    r, errors = cli(src, out, "--files", files)
    phrase = f"no space left on device while placing {out / 'original' / 'notes.md'}"
    assert_failed_cleanly(r, errors, out, source, before, phrase)


@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume"]])
def test_an_output_folder_that_cannot_be_entered_is_one_line(source, tmp_path, monkeypatch, flags, refuse):
    """A converted OUT whose glm-pack/ this user may list but not enter (`chmod -R 644`: stat fails with EACCES, as
    injected here), converted again: one line naming the first file it cannot look at, exit 1, OUT unchanged; it
    was the raw PermissionError from Path.is_file (a traceback)."""
    out = tmp_path / "out"
    convert(source, out, ConvertOptions(files="none", workers=1))
    before = tree_digest(out)
    del before[state.LOCK_NAME]  # rewritten with each run's pid
    refuse(os, "stat", lambda p: out / "glm-pack" in p.parents)
    r, errors = cli(source, out, "--files", "none", *flags)
    run = out / "glm-pack" / ".run.json"
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert len(errors) == 1 and f"cannot read {run}: Permission denied" in errors[0], r.output
    monkeypatch.undo()
    assert {k: v for k, v in tree_digest(out).items() if k != state.LOCK_NAME} == before


@pytest.mark.parametrize("folder", ["out", "out/glm-pack"])
def test_an_output_folder_that_cannot_be_listed_is_one_line(source, tmp_path, monkeypatch, folder, refuse):
    """OUT, or a glm-pack/ folder in it, that this user may write but not list (mode 0300, or an I/O error): one line
    naming it, exit 1, nothing written but the lock; it was the raw OSError (a traceback)."""
    out = tmp_path / "out"
    (tmp_path / folder).mkdir(parents=True)
    refuse(os, "listdir", tmp_path / folder)
    before = tree_digest(source)
    r, errors = cli(source, out)
    assert_failed_cleanly(r, errors, out, source, before, f"cannot list {tmp_path / folder}: Permission denied")
    monkeypatch.undo()
    made = [".glm-pack.lock", "glm-pack"] if folder == "out/glm-pack" else [".glm-pack.lock"]
    assert sorted(p.name for p in out.rglob("*")) == made


def test_output_in_a_folder_that_cannot_be_entered(source, tmp_path, monkeypatch):
    """OUT inside a folder this user cannot enter (another user's home, mode 0700: stat, mkdir and open fail with
    EACCES, as injected here): one line naming where, exit 1, nothing made; it was the raw PermissionError from
    Path.exists (a traceback)."""
    closed = tmp_path / "closed"
    closed.mkdir()

    def refusing(real):
        def call(path, *args, **kwargs):
            if closed in Path(os.fspath(path)).parents:
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path, *args, **kwargs)

        return call

    for name in ("stat", "mkdir", "open"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))
    before = tree_digest(source)
    r, errors = cli(source, closed / "out")
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert len(errors) == 1 and f"output folder: Permission denied (file {closed / 'out'})" in errors[0], r.output
    monkeypatch.undo()
    assert tree_digest(source) == before and list(closed.iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_source_in_a_folder_that_cannot_be_entered(source, tmp_path, command, refuse):
    """SRC inside a folder this user cannot enter (another user's home, mode 0700: stat fails with EACCES, as
    injected here): one line naming SRC, exit 1, OUT not created; it was the raw PermissionError from Path.is_dir."""
    closed = tmp_path / "closed"
    src = closed / "src"
    refuse(os, "stat", lambda p: closed in p.parents)
    out = tmp_path / "out"
    if command == "convert":
        r, errors = cli(src, out)
    else:
        r = CliRunner().invoke(main, ["inspect", str(src)])
        errors = [line for line in r.output.splitlines() if line.startswith("glm-pack: error:")]
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert len(errors) == 1 and f"cannot read: Permission denied (file {src})" in errors[0], r.output
    assert not out.exists()


def test_missing_source_creates_nothing(tmp_path):
    r, errors = cli(tmp_path / "nowhere", tmp_path / "out")
    assert r.exit_code == 1 and len(errors) == 1 and "nowhere" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", ["size", "mtime"])
def test_source_changed_during_conversion_refuses_to_finish(source, ckpt_copy, tmp_path, monkeypatch, change):
    src = ckpt_copy(source)
    victim = src / "config.json"  # replace the link by a private copy, so the shared original stays untouched
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(data)
    real = state.Journal.append

    def append(self, entry):  # the first work item is journalled, then the source file changes
        real(self, entry)
        if change == "size":
            with open(victim, "ab") as f:
                f.write(b" ")
        else:
            st = victim.stat()
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    monkeypatch.setattr(state.Journal, "append", append)
    out = tmp_path / "out"
    r, errors = cli(src, out)
    assert r.exit_code == 1 and len(errors) == 1 and "source files changed" in errors[0], r.output
    assert not (out / "glm-pack" / "manifest.json").exists() and temp_files(out) == []


@pytest.mark.parametrize(
    "files, victim, phrase",
    [
        ("none", "config.json", "source files changed during conversion (this file disappeared)"),
        ("link", "config.json", "source files changed during conversion (this file disappeared)"),
        ("none", "kv_b_proj shard", "file is missing"),
    ],
)
def test_source_file_deleted_during_conversion(source, ckpt_copy, tmp_path, monkeypatch, files, victim, phrase):
    src = ckpt_copy(source)
    if victim == "kv_b_proj shard":  # read by the second work item (layer 1), after the first is journalled
        victim = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][
            "model.layers.1.self_attn.kv_b_proj.weight"
        ]
    real = state.Journal.append

    def append(self, entry):
        real(self, entry)
        (src / victim).unlink(missing_ok=True)

    monkeypatch.setattr(state.Journal, "append", append)
    out = tmp_path / "out"
    r, errors = cli(src, out, "--files", files)
    assert r.exit_code == 1 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert phrase in errors[0] and f"file {src / victim}" in errors[0], errors[0]
    assert not (out / "glm-pack" / "manifest.json").exists() and temp_files(out) == []


def test_source_that_is_also_the_output_is_refused(source, tmp_path):
    before = tree_digest(source)
    link = tmp_path / "alias"
    link.symlink_to(source)
    for out in (source, link, source / "glm-out", source.parent):
        r, errors = cli(source, out, "--overwrite")
        assert r.exit_code == 1 and len(errors) == 1 and "outside the source" in errors[0], (out, r.output)
    assert tree_digest(source) == before


def test_source_reached_through_a_bind_mount_is_refused(source, ckpt_copy, tmp_path, monkeypatch):
    """A bind mount reaches the source's folder by a path no resolve() relates to it: OUT = the mount point
    passed the "outside the source" check and --overwrite emptied the source. The folders' (device, inode)
    decide; here a plain folder reports the identity a mount of the source (or of its parent) would have."""
    from glm_pack.convert import convert as convert_module

    src = ckpt_copy(source)
    before = tree_digest(src)
    real = convert_module._identity
    for mounted, out in (
        (src, tmp_path / "mnt"),  # OUT is the source
        (src, tmp_path / "mnt" / "glm-out"),  # OUT inside it
        (src.parent, tmp_path / "mnt"),  # OUT contains it
    ):
        (tmp_path / "mnt").mkdir(exist_ok=True)
        (tmp_path / "mnt" / "keep.txt").write_text("mine")
        alias = tmp_path / "mnt"
        monkeypatch.setattr(convert_module, "_identity", lambda p, m=mounted, a=alias: real(m if p == a else p))
        r, errors = cli(src, out, "--overwrite")
        assert r.exit_code == 1 and len(errors) == 1 and "outside the source" in errors[0], (out, r.output)
        assert (tmp_path / "mnt" / "keep.txt").read_text() == "mine" and tree_digest(src) == before


def test_mount_table_gives_a_paths_place_in_its_filesystem():
    """Hand-made mountinfo lines (the kernel's format, octal escapes included): a path's location is its deepest
    mount's root joined with the rest, the later of two mounts at one point winning."""
    from pathlib import PurePosixPath as P

    from glm_pack.convert.mounts import fs_location, parse_mountinfo

    table = parse_mountinfo(
        "22 1 0:21 / / rw - overlay overlay rw\n"
        "30 22 0:30 / /tmp rw - tmpfs tmpfs rw\n"
        "31 30 0:30 /data/models /tmp/my\\040models rw - tmpfs tmpfs rw\n"
        "32 30 0:30 /other /tmp/my\\040models rw - tmpfs tmpfs rw\n"
        "short line\n"
    )
    assert table[2] == (P("/tmp/my models"), "0:30", P("/data/models")) and len(table) == 4
    assert fs_location(P("/usr/lib"), table) == ("0:21", P("/usr/lib"))
    assert fs_location(P("/tmp/a/b"), table) == ("0:30", P("/a/b"))
    assert fs_location(P("/tmp/my models/x"), table) == ("0:30", P("/other/x"))  # the later mount covers the earlier
    assert fs_location(P("/tmp/my models/x"), table[:3]) == ("0:30", P("/data/models/x"))
    assert fs_location(P("/tmp"), []) is None


@pytest.mark.parametrize("layout", ["source inside a mount of a folder of OUT", "OUT inside a mount of a folder of it"])
def test_a_bind_mount_of_a_folder_inside_the_other_is_refused(source, tmp_path, monkeypatch, layout):
    """A bind mount of a folder *inside* OUT (or inside the source) shares no identity with OUT (or the source)
    itself: `convert MNT/src OUT --overwrite` with MNT a mount of OUT/sub deleted the source and everything in OUT
    (a container mounting /data/models at /models and /data/models/GLM-5 at /src); `convert SRC MNT/out` with MNT
    a mount of SRC/sub wrote the output into the source. The mount table relates them; here a made-up table says
    tmp/mnt is a mount of the folder the layout names, and the files at both paths are copies."""
    from glm_pack.convert import convert as convert_module
    from glm_pack.convert.mounts import parse_mountinfo

    mnt = tmp_path / "mnt"
    if layout.startswith("source inside"):
        out = tmp_path / "outdir"
        real_src = shutil.copytree(source, out / "sub" / "src")
        src = shutil.copytree(source, mnt / "src")  # what the mount would show
        mounted = out / "sub"
        (out / "keep.txt").write_text("mine")
    else:
        src = real_src = shutil.copytree(source, tmp_path / "src")
        mounted = src / "sub"
        mounted.mkdir()
        out = mnt / "out"
        mnt.mkdir()
    table = f"1 0 0:99 / / rw - overlay o rw\n2 1 0:99 {mounted} {mnt} rw - overlay o rw\n"
    monkeypatch.setattr(convert_module, "read_mounts", lambda: parse_mountinfo(table))
    before = tree_digest(real_src)
    r, errors = cli(src, out, "--overwrite")
    assert r.exit_code == 1 and len(errors) == 1 and "outside the source" in errors[0], r.output
    assert tree_digest(real_src) == before and not (out / "glm-pack").exists()
    if layout.startswith("source inside"):
        assert (out / "keep.txt").read_text() == "mine"


def test_source_bind_mounted_as_out_is_refused(source, ckpt_copy, tmp_path):
    """The same through a real bind mount, where this machine lets a private mount namespace make one: of the source
    as OUT, and of a folder of OUT holding the source."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here (unshare -m needs root or user namespaces)")
    src = ckpt_copy(source)
    before = tree_digest(src)
    (tmp_path / "mnt").mkdir()
    script = 'mount --bind "$1" "$2" && exec "$3" -m glm_pack.convert.cli convert "$1" "$2" --overwrite --workers 1'
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(src), str(tmp_path / "mnt"), sys.executable],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "must be outside the source" in r.stderr + r.stdout, (r.returncode, r.stderr)
    assert tree_digest(src) == before
    # a mount of a folder inside OUT holding the source (it deleted the source with everything else in OUT)
    out = tmp_path / "outdir"
    real_src = shutil.copytree(source, out / "sub" / "src")
    (out / "keep.txt").write_text("mine")
    script = 'mount --bind "$1" "$2" && exec "$3" -m glm_pack.convert.cli convert "$2/src" "$4" --overwrite --workers 1'
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(out / "sub"), str(tmp_path / "mnt"), sys.executable, str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "must be outside the source" in r.stderr + r.stdout, (r.returncode, r.stderr)
    assert tree_digest(real_src) == before and (out / "keep.txt").read_text() == "mine"


def test_out_holding_the_files_behind_a_snapshot_is_refused(source, tmp_path):
    """A HF-cache layout: snapshots/rev/NAME -> ../../blobs/HASH. OUT = blobs/ contains no source *path*, but
    --overwrite emptied it, deleting every file the snapshot's links point to (the source was gone)."""
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        os.link(f, blobs / hashlib.sha256(f.name.encode()).hexdigest())  # a hard link: the shared source stays
        (snapshot / f.name).symlink_to(f"../../blobs/{hashlib.sha256(f.name.encode()).hexdigest()}")
    before = tree_digest(snapshot)
    r, errors = cli(snapshot, blobs, "--overwrite")
    assert r.exit_code == 1 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert f"output {blobs} must not hold the source's files: {snapshot / 'config.json'} is" in errors[0], errors
    assert tree_digest(snapshot) == before and not (blobs / "glm-pack").exists()


@pytest.mark.parametrize("files", ["link", "copy", "none"])
def test_broken_symlink_in_the_source_is_refused(source, ckpt_copy, tmp_path, files):
    """A snapshot link whose blob never arrived (tokenizer.json -> a missing blob): the output would silently lack
    that file, and the manifest's source list omit it. One line naming the link; nothing written."""
    src = ckpt_copy(source)
    (src / "tokenizer.json").symlink_to(tmp_path / "blobs" / "never-downloaded")
    before = tree_digest(source)
    out = tmp_path / "out"
    r, errors = cli(src, out, "--files", files)
    assert_failed_cleanly(r, errors, out, source, before, f"broken symlink in the source: it points to {tmp_path}")
    assert f"file {src / 'tokenizer.json'}" in errors[0], errors
    assert not out.exists()


def test_broken_symlink_in_the_source_fails_inspect_too(source, ckpt_copy, tmp_path):
    """inspect shows the plan convert would carry out: it listed the originals to reuse without the broken link
    (the walk it shares with convert skipped it) and reported a plan that convert then refused."""
    src = ckpt_copy(source)
    (src / "tokenizer.json").symlink_to(tmp_path / "blobs" / "never-downloaded")
    r = CliRunner().invoke(main, ["inspect", str(src)])
    errors = [line for line in r.output.splitlines() if line.startswith("glm-pack: error:")]
    assert r.exit_code == 1 and len(errors) == 1 and "broken symlink in the source" in errors[0], r.output
    assert f"file {src / 'tokenizer.json'}" in errors[0], errors


@pytest.mark.parametrize("fault", ["file", "folder"])
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_a_source_folder_that_cannot_be_entered_or_listed_is_refused(
    source, ckpt_copy, tmp_path, command, fault, refuse
):
    """A folder of the source that this user may list but not enter (`chmod 644 SRC/original`: stat of its file fails
    with EACCES, as injected here), or that cannot be listed (a permission, an I/O error): one line naming the file
    or the folder, nothing written. The first was the raw PermissionError (a traceback); the walk skipped the second,
    so the output silently lacked its files (and the manifest's source list them) and verify passed."""
    src = ckpt_copy(source)
    (src / "original").mkdir()
    (src / "original" / "notes.md").write_text("kept with the checkpoint")
    if fault == "file":
        refuse(os, "stat", lambda p: src / "original" in p.parents)
        phrase = f"cannot read: Permission denied (file {src / 'original' / 'notes.md'})"
    else:
        refuse(os, "scandir", src / "original")
        phrase = f"cannot list this folder of the source: Permission denied (file {src / 'original'})"
    before = tree_digest(source)
    out = tmp_path / "out"
    if command == "convert":
        r, errors = cli(src, out, "--files", "copy")
    else:
        r = CliRunner().invoke(main, ["inspect", str(src)])
        errors = [line for line in r.output.splitlines() if line.startswith("glm-pack: error:")]
    assert_failed_cleanly(r, errors, out, source, before, phrase)
    assert not out.exists()


@pytest.mark.parametrize("files", ["none", "copy", "link"])
def test_a_linked_folder_in_the_source_is_placed_like_a_real_one(source, ckpt_copy, tmp_path, files):
    """A link to an existing folder (notes kept elsewhere) is no unfinished download; its files are the source's
    like a linked file's: placed in OUT as a real folder (the walk did not enter it: with --files copy / link OUT
    silently lacked them and verify passed)."""
    src = ckpt_copy(source)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "eval.md").write_text("results")
    (src / "notes").symlink_to(tmp_path / "notes", target_is_directory=True)
    out = tmp_path / "out"
    r, errors = cli(src, out, "--files", files)
    assert r.exit_code == 0 and errors == [], r.output
    assert verify(out).ok
    if files != "none":
        assert not (out / "notes").is_symlink() and (out / "notes" / "eval.md").read_text() == "results"
        (out / "notes" / "eval.md").unlink()
        assert any("notes/eval.md" in p for p in verify(out).problems)


def test_a_folder_link_looping_back_is_refused(source, ckpt_copy, tmp_path):
    """A folder link to the source itself (or a folder above it): following it never ends. One line naming it."""
    src = ckpt_copy(source)
    (src / "nested").mkdir()
    (src / "nested" / "again").symlink_to(src, target_is_directory=True)
    before = tree_digest(source)
    out = tmp_path / "out"
    r, errors = cli(src, out, "--files", "copy")
    phrase = f"a folder link in the source leads back to a folder it lies in ({src})"
    assert_failed_cleanly(r, errors, out, source, before, phrase)
    assert f"file {src / 'nested' / 'again'}" in errors[0] and not out.exists()


def test_symlinks_in_out_are_replaced_never_written_through(source, ckpt_copy, tmp_path):
    """With --overwrite, links planted in OUT (to source files, to a victim dir) are replaced, targets kept."""
    src = ckpt_copy(source)  # a HF-cache-like snapshot of links: read through them
    before = tree_digest(source)
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "keep").write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    shard = sorted(p.name for p in src.glob("model-*.safetensors"))[0]
    (out / shard).symlink_to(source / shard)
    (out / "config.json").symlink_to(source / "config.json")
    (out / ".glm-pack.lock").symlink_to(source / shard)  # the lock file is written: never through a link
    (out / "glm-pack").symlink_to(victim_dir)
    r, errors = cli(src, out, "--files", "copy", "--overwrite")
    assert r.exit_code == 1 and len(errors) == 1 and "symlink" in errors[0], r.output
    (out / ".glm-pack.lock").unlink()
    r, errors = cli(src, out, "--files", "copy", "--overwrite")
    assert r.exit_code == 0, r.output
    assert tree_digest(source) == before and (victim_dir / "keep").read_text() == "keep"
    assert sorted(os.listdir(victim_dir)) == ["keep"]
    for name in (shard, "config.json", "glm-pack"):
        assert not (out / name).is_symlink()
    assert verify(out).ok


def test_a_linked_overlay_folder_is_not_taken_for_an_unstarted_one(source, tmp_path):
    """An OUT whose glm-pack/ is a link to an empty folder is not the empty glm-pack/ a killed run leaves: without
    --overwrite it is refused as not empty, and nothing is written into the folder it points to."""
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "glm-pack").symlink_to(victim)
    r, errors = cli(source, out, "--files", "none")
    assert r.exit_code == 1 and len(errors) == 1 and "is not empty; pass --overwrite" in errors[0], r.output
    assert list(victim.iterdir()) == [] and (out / "glm-pack").is_symlink()


# --- hostile and degenerate weights ------------------------------------------------------------------------------
KV_B = "model.layers.0.self_attn.kv_b_proj.weight"


def replace_kv_b(src, edit):
    """In a ckpt_copy ``src``: rewrite the shard holding layer 0's kv_b_proj with ``edit(tensor)`` applied."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][KV_B]
    tensors = load_file(shard)
    edit(tensors[KV_B])
    shard.unlink()  # drop the link; the shared original stays untouched
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


@pytest.mark.parametrize("value, row, col", [(float("nan"), 7, 500), (float("-inf"), 12_000, 0)])
def test_non_finite_source_weight_is_named_with_its_index(source, ckpt_copy, tmp_path, value, row, col):
    src = ckpt_copy(source)

    def plant(t):
        t[row, col] = value

    shard = replace_kv_b(src, plant)
    r, errors = cli(src, tmp_path / "out")
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert KV_B in errors[0] and f"({row}, {col})" in errors[0] and shard.name in errors[0]
    assert not (tmp_path / "out" / "glm-pack" / "manifest.json").exists()


def test_finite_source_values_near_float_max_are_named_before_any_output(source, ckpt_copy, tmp_path):
    """Two legal bf16 values of +-3e38: MXFP4 (block scale 2**127, code 2) decodes them to Inf.
    Refused at the layer (naming kv_b_proj and its shard), not after every file is written by the manifest."""
    src = ckpt_copy(source)

    def plant(t):
        t[7, 100], t[7, 101] = 3.0e38, -3.0e38

    shard = replace_kv_b(src, plant)
    r, errors = cli(src, tmp_path / "out", "--files", "none")
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert "w_kc overflows to Inf in MXFP4" in errors[0] and f"(file {shard}, tensor {KV_B})" in errors[0]
    assert not (tmp_path / "out" / "glm-pack" / "manifest.json").exists()
    assert not (tmp_path / "out" / "glm-pack" / "layer-000.safetensors").exists()


def test_zero_and_denormal_range_blocks_round_trip(source, ckpt_copy, tmp_path):
    """Head 0 all zeros; head 1 values k * 2**-127 (k in E2M1, most of them bf16 subnormals).

    Hand-checked expectation: every block of both heads gets the smallest E8M0 scale (byte 0, 2**-127), so a
    zero block stores codes 0 and dequantizes to exact zeros, and every value k * 2**-127 is an exact E2M1
    multiple of that scale: the round trip is exact, with no NaN/Inf anywhere.
    """
    g = json.loads((source / "config.json").read_text())
    nope, v, lora = g["qk_nope_head_dim"], g["v_head_dim"], g["kv_lora_rank"]
    rows = nope + v
    steps = torch.tensor([0, 0.5, -0.5, 1, -1.5, 2, -3, 4, -4, 3, 1.5, -2, -1])
    pattern = steps[(torch.arange(rows)[:, None] * 5 + torch.arange(lora)[None, :]) % len(steps)] * 2.0**-127

    def plant(t):
        t[:rows] = 0
        t[rows : 2 * rows] = pattern.to(t.dtype)

    src = ckpt_copy(source)
    replace_kv_b(src, plant)
    assert torch.equal(pattern.bfloat16().float(), pattern)  # the values really are representable in bf16
    out = tmp_path / "out"
    r, _ = cli(src, out, "--files", "none")
    assert r.exit_code == 0, r.output
    m = json.loads((out / "glm-pack" / "manifest.json").read_text())
    layer = m["mla"][0]
    expected = {  # [head 0, head 1] of each projection, from the source pattern
        "w_kc": torch.stack([torch.zeros(lora, nope), pattern[:nope].T]),
        "w_vc": torch.stack([torch.zeros(v, lora), pattern[nope:]]),
    }
    with safe_open(out / "glm-pack" / m["tensors"][layer["w_kc"]["weight"]]["file"], framework="pt") as f:
        for proj, want in expected.items():
            codes = f.get_tensor(layer[proj]["weight"])[:2]
            scales = f.get_tensor(layer[proj]["scale"])[:2]
            codes, scales = unpack_bmm_nk(codes, scales, k_logical=want.shape[-1])  # drops the K padding
            assert torch.all(scales == 0) and torch.all(codes[0] == 0)
            got = dequantize_reference(codes, scales)
            assert torch.equal(got, want), proj
        assert all(math.isfinite(layer[p]["rel_error"]) for p in expected)
    assert verify(out).ok


def test_a_source_file_that_cannot_be_read_is_not_called_disappeared(tmp_path):
    """Only a missing file is "changed during conversion (this file disappeared)"; any other OS error on a source
    file (here a symlink loop) is a CheckpointError with its own reason."""
    from glm_pack.convert.convert import source_stats
    from glm_pack.packing.errors import CheckpointError

    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(CheckpointError, match="cannot read: Too many levels of symbolic links") as err:
        source_stats(tmp_path, [tmp_path / "loop"])
    assert "disappeared" not in str(err.value)
