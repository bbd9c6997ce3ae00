"""The free-space check ``convert`` makes before it writes (convert/space.py): what it counts on which filesystem,
that a run that cannot fit is refused before OUT changes, and that its estimate bounds what a run really writes.

Free space is faked at ``space.free_bytes`` (and a second filesystem at ``space._nearest``); a real small tmpfs is in
tests/reliability/test_faults.py, the Hub cache in tests/convert/test_hub_source.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from glm_pack.convert import convert as convert_module
from glm_pack.convert import space, writer
from glm_pack.convert.cli import main
from glm_pack.convert.verify import verify
from glm_pack.packing.errors import GlmPackError

MIB = 2**20
# One MLA layer of the synthetic GLM-5 (64 heads, kv_lora 512, nope 192 stored as K = 256, v 256), counted by hand:
LAYER_MXFP4 = 64 * 512 * 128 + 64 * 512 * 8 + 64 * 256 * 256 + 64 * 256 * 16  # w_kc codes + scales, w_vc codes + scales
LAYER_BF16 = 2 * (64 * 512 * 256 + 64 * 256 * 512)
LAYER_FILE = LAYER_MXFP4 + space.overhead(4)  # as counted: w_kc, w_vc and their scales
REAL_FREE_BYTES = space.free_bytes


@pytest.fixture(scope="module")
def source(synth_ckpt):
    return synth_ckpt("glm-5", "bf16", layers=1, experts=2)  # 2 MLA layers (with the MTP layer)


@pytest.fixture(name="free")
def free_fixture(monkeypatch):
    """``free.bytes = N`` fakes the free space of every filesystem; ``free.checks`` holds every Writes checked."""

    class Free:
        bytes = 1 << 60
        checks: list = []

    real_check = space.Writes.check

    def check(self, *args):
        Free.checks.append(self)
        return real_check(self, *args)

    monkeypatch.setattr(space, "free_bytes", lambda folder: Free.bytes)
    monkeypatch.setattr(space.Writes, "check", check)
    Free.checks = []
    return Free


def cli(*args):
    r = CliRunner().invoke(main, ["convert", "--quiet", *map(str, args)])
    return r, [line for line in r.output.splitlines() if line.startswith("glm-pack: error:")]


def tree(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def new_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` that no other hard link shares (what a run added; links add nothing)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


@pytest.fixture(name="peak")
def peak_fixture(monkeypatch):
    """``peak.bytes``: what OUT held at its fullest, as the manifest is written (the journal is still there then),
    counting the manifest's text; the originals are placed by then."""

    class Peak:
        bytes = 0

    real = convert_module.write_text

    def write_text(path, text):
        Peak.bytes = new_bytes(path.parent.parent) + len(text.encode())
        return real(path, text)

    monkeypatch.setattr(convert_module, "write_text", write_text)
    return Peak


def needed(free) -> int:
    """Bytes the last run checked counted (a synthetic checkpoint made on first use is checked too)."""
    writes = free.checks[-1]
    return sum(n for parts in writes.parts.values() for n in parts.values())


def test_a_run_that_cannot_fit_is_refused_before_out_changes(source, tmp_path, free):
    out = tmp_path / "out"
    need = 2 * LAYER_FILE  # 17.1 MiB: two overlay files, nothing else with --files none
    free.bytes = need - 1
    r, errors = cli(source, out, "--files", "none")
    assert r.exit_code == 1 and len(errors) == 1, r.output
    assert f"not enough free space on the filesystem of {out}:" in errors[0]
    assert "writes about 17.1 MiB there (overlay files 17.1 MiB) and 17.1 MiB is free;" in errors[0]
    assert "--skip-space-check" in errors[0] and "Traceback" not in r.output
    assert [p.name for p in out.iterdir()] == [".glm-pack.lock"]  # nothing else: a rerun needs no --resume
    free.bytes = need
    r, _ = cli(source, out, "--files", "none")
    assert r.exit_code == 0, r.output
    assert verify(out).ok


def test_a_filesystem_that_reports_no_size_is_not_judged(source, tmp_path, free, monkeypatch):
    no_size = SimpleNamespace(total=0, used=0, free=0)  # what statvfs gives on some FUSE and network filesystems
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: no_size)
    monkeypatch.setattr(space, "free_bytes", REAL_FREE_BYTES)
    r, _ = cli(source, tmp_path / "out", "--files", "copy")
    assert r.exit_code == 0, r.output
    assert verify(tmp_path / "out").ok and len(free.checks) == 1


def test_skip_space_check_starts_anyway(source, tmp_path, free):
    free.bytes = 0
    r, errors = cli(source, tmp_path / "out", "--files", "none")
    assert r.exit_code == 1 and "not enough free space" in errors[0]
    r, _ = cli(source, tmp_path / "out", "--files", "none", "--skip-space-check")
    assert r.exit_code == 0, r.output
    assert verify(tmp_path / "out").ok and len(free.checks) == 1  # the refused run's alone


@pytest.mark.parametrize(
    "args",
    [
        ("--files", "none"),
        ("--files", "copy"),
        ("--files", "link"),
        ("--files", "none", "--mla-precision", "auto", "--max-rel-error", "0"),  # every tensor stays BF16
        ("--files", "none", "--mla-precision", "auto", "--max-rel-error", "1"),  # every tensor MXFP4: over-counted
        ("--files", "copy", "--mla-precision", "bf16"),
    ],
)
def test_the_estimate_bounds_what_a_run_writes(source, tmp_path, free, peak, args):
    out = tmp_path / "out"
    r, _ = cli(source, out, *args)
    assert r.exit_code == 0, r.output
    need = needed(free)
    originals = sum(p.stat().st_size for p in source.iterdir()) if "copy" in args else 0
    layer = LAYER_MXFP4 if "auto" not in args and "bf16" not in args else LAYER_BF16
    assert need == 2 * (layer + space.overhead(4)) + originals
    assert new_bytes(out) <= peak.bytes <= need
    over = 2 * (LAYER_BF16 - LAYER_MXFP4) if "1" in args else 0  # auto kept MXFP4 where BF16 was counted
    assert need - peak.bytes <= 2 * space.overhead(4) + over


def test_experts_are_counted_at_their_source_size(synth_ckpt, tmp_path, free, peak):
    """64 experts in one file: 384 tensors, whose headers, journal lines and manifest entries add up (1.2 KiB each)."""
    src = synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=64)  # layer 3: first MoE layer
    out = tmp_path / "out"
    r, _ = cli(src, out, "--files", "none", "--repack-experts", "aiter-a4w4")
    assert r.exit_code == 0, r.output
    files = list((out / "glm-pack").glob("*.safetensors"))
    experts = [f for f in files if f.name.startswith("experts-")]
    tensors = json.loads((out / "glm-pack" / "manifest.json").read_text())["tensors"]
    assert len(experts) == 1 and sum(t["file"] == experts[0].name for t in tensors.values()) == 64 * 3 * 2
    need, overhead = needed(free), space.overhead(64 * 3 * 2) + (len(files) - 1) * space.overhead(4)
    assert new_bytes(out) <= peak.bytes <= need
    assert need - overhead <= peak.bytes  # the tensors' bytes themselves are counted exactly


def test_originals_count_where_they_are_copied(source, tmp_path, free, monkeypatch):
    overlay_only = 2 * LAYER_FILE
    free.bytes = overlay_only
    r, errors = cli(source, tmp_path / "copy", "--files", "copy")
    assert r.exit_code == 1 and "copies of the original files" in errors[0], r.output
    r, _ = cli(source, tmp_path / "link", "--files", "link")  # the same filesystem: hard links take no space
    assert r.exit_code == 0, r.output
    # The source on another filesystem: --files link copies, so the originals count.
    real = space._nearest
    monkeypatch.setattr(space, "_nearest", lambda p: (real(p)[0], -1) if source in Path(p).parents else real(p))
    r, errors = cli(source, tmp_path / "across", "--files", "link")
    assert r.exit_code == 1 and "copies of the original files" in errors[0], r.output


def test_overwrite_counts_what_it_deletes(source, tmp_path, free):
    copied, linked = tmp_path / "copied", tmp_path / "linked"
    assert cli(source, copied, "--files", "copy")[0].exit_code == 0
    assert cli(source, linked, "--files", "link")[0].exit_code == 0
    free.bytes = 2 * space.overhead(4)  # enough only once what --overwrite deletes counts as free
    r, _ = cli(source, copied, "--files", "copy", "--overwrite")
    assert r.exit_code == 0, r.output
    # The hard-linked originals free nothing; the refusal leaves the earlier output as it was.
    before = tree(linked)
    r, errors = cli(source, linked, "--files", "copy", "--overwrite")
    assert r.exit_code == 1 and "that --overwrite deletes first" in errors[0], r.output
    assert tree(linked) == before and verify(linked).ok


def test_resume_counts_only_what_is_left(source, tmp_path, free, monkeypatch):
    out = tmp_path / "out"
    real = writer._os_write

    def second_file_fails(fd, data):  # the disk fills while the second layer's file is written
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".layer-001.safetensors.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(writer, "_os_write", second_file_fails)
    r, errors = cli(source, out, "--files", "none")
    assert r.exit_code == 1 and "no space left" in errors[0], r.output
    monkeypatch.setattr(writer, "_os_write", real)
    free.bytes = LAYER_FILE  # one layer left to write
    r, errors = cli(source, tmp_path / "fresh", "--files", "none")
    assert r.exit_code == 1 and "not enough free space" in errors[0]
    first = (out / "glm-pack" / "layer-000.safetensors").stat().st_mtime_ns
    r, _ = cli(source, out, "--files", "none", "--resume")
    assert r.exit_code == 0, r.output
    assert (out / "glm-pack" / "layer-000.safetensors").stat().st_mtime_ns == first  # kept, not written again
    assert verify(out).ok


def test_freed_bytes_counts_only_files_nothing_else_keeps(tmp_path):
    folder = tmp_path / "old"
    (folder / "sub").mkdir(parents=True)
    own = folder / "sub" / "own.bin"
    own.write_bytes(os.urandom(3 * MIB))
    shared = tmp_path / "shared.bin"
    shared.write_bytes(os.urandom(2 * MIB))
    os.link(shared, folder / "linked.bin")  # a hard-linked original: deleting this name frees nothing
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.bin").write_bytes(os.urandom(4 * MIB))
    (folder / "to-file").symlink_to(shared)
    (folder / "to-folder").symlink_to(outside)  # deleting a link never deletes what it points to
    freed = space.freed_bytes([folder])
    assert 3 * MIB <= freed < 3 * MIB + 64 * 1024  # the one file's blocks
    assert space.freed_bytes([own, folder / "to-folder"]) == freed


def test_device_of_a_path_not_made_yet_is_its_ancestors(tmp_path, monkeypatch):
    assert space.device(tmp_path / "a" / "b" / "c") == os.stat(tmp_path).st_dev
    # The free space asked of the nearest existing ancestor (a stand-in answers: the real free space moves while
    # other tests write, between this call and a second statvfs here).
    asked = []
    usage = SimpleNamespace(total=10 * MIB, used=3 * MIB, free=7 * MIB)
    monkeypatch.setattr(space.shutil, "disk_usage", lambda path: asked.append(Path(path)) or usage)
    assert space.free_bytes(tmp_path / "a" / "b") == 7 * MIB and asked == [tmp_path]


def test_the_check_names_the_first_filesystem_that_does_not_fit(tmp_path, monkeypatch):
    devices = {tmp_path / "small": 1, tmp_path / "big": 2}
    monkeypatch.setattr(space, "_nearest", lambda p: (p, devices[p]))
    monkeypatch.setattr(space, "free_bytes", lambda p: {1: 10 * MIB, 2: 100 * MIB}[devices[p]])
    writes = space.Writes("this conversion")
    writes.add(tmp_path / "big", "downloads", 60 * MIB)
    writes.add(tmp_path / "small", "overlay files", 6 * MIB)
    writes.add(tmp_path / "small", "copies", 6 * MIB)
    writes.add(tmp_path / "small", "nothing", 0)
    with pytest.raises(GlmPackError) as err:
        writes.check()
    assert err.value.file == str(tmp_path / "small")
    assert "writes about 12.0 MiB there (overlay files 6.0 MiB, copies 6.0 MiB) and 10.0 MiB is free;" in str(err.value)
    writes.check(2 * MIB, tmp_path / "small")  # what is deleted there first counts
    with pytest.raises(GlmPackError, match="that --overwrite deletes first"):
        writes.check(MIB, tmp_path / "small")
    with pytest.raises(GlmPackError):
        writes.check(2 * MIB, tmp_path / "big")  # freed on another filesystem counts nothing here


def test_synth_refuses_a_checkpoint_its_disk_cannot_hold(tmp_path, free):
    """``synth --profile full`` of a whole GLM-5 is terabytes: refused at once, OUT not made; the estimate (tensor
    bytes plus 64 KiB and 2 KiB a tensor) bounds what synth then writes."""
    args = ["synth", "--card", "glm-5", "--layers", "1", "--experts", "2", "--format", "bf16"]
    free.bytes = 1 << 60
    r = CliRunner().invoke(main, [*args, str(tmp_path / "big")])
    assert r.exit_code == 0, r.output
    need, written = needed(free), new_bytes(tmp_path / "big")  # shards, index, config
    tensors = len(json.loads((tmp_path / "big" / "model.safetensors.index.json").read_text())["weight_map"])
    assert written <= need <= written + space.overhead(tensors)  # the tensors' bytes themselves are counted exactly
    free.bytes = need - 1
    r = CliRunner().invoke(main, [*args, str(tmp_path / "small")])
    assert r.exit_code == 1 and "not enough free space" in r.output and "this synthetic checkpoint" in r.output
    assert not (tmp_path / "small").exists()
    r = CliRunner().invoke(main, [*args, "--skip-space-check", str(tmp_path / "small")])
    assert r.exit_code == 0, r.output
