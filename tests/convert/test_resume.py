"""Interrupted conversions: SIGKILL at several points, --resume, refusal without it, locking (convert, card,
verify; push's in test_push.py), Ctrl-C."""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from click.testing import CliRunner

from glm_pack.convert import state
from glm_pack.convert.cli import main
from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.items import WorkItem, is_entry_of, write_item
from glm_pack.convert.state import OutputLock
from glm_pack.convert.verify import verify
from glm_pack.packing.errors import PlanError

# Runs a conversion in a child process that SIGKILLs itself at a chosen point (test-side injection).
DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    from glm_pack.convert import convert as conv, state, writer
    from glm_pack.convert.convert import ConvertOptions, convert
    src, out, point = sys.argv[1], sys.argv[2], sys.argv[3]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "mid-file":  # during the second overlay file's write, after its header
        real, calls = writer._os_write, [0]
        def write(fd, data):
            calls[0] += 1
            n = real(fd, data[: len(data) // 2] if calls[0] == 3 else data)
            if calls[0] == 3:
                die()
            return n
        writer._os_write = write
    elif point == "between-files":  # right after the second item is journalled
        real_append = state.Journal.append
        def append(self, entry):
            real_append(self, entry)
            if len(self.entries()) == 2:
                die()
        state.Journal.append = append
    elif point == "manifest":  # half of the manifest written to its temp file
        def write_text(path, text):
            with open(path.with_name("." + path.name + ".tmp"), "w") as f:
                f.write(text[: len(text) // 2])
            die()
        conv.write_text = write_text
    elif point == "placed":  # right after the third original file is placed
        real_place, placed = conv.place_original, [0]
        def place(*args):
            copied = real_place(*args)
            placed[0] += 1
            if placed[0] == 3:
                die()
            return copied
        conv.place_original = place
    elif point == "run-record":  # glm-pack/ created, its run record not yet written
        def write_run(overlay, run):
            die()
        state.write_run = write_run
    elif point == "run-record-written":  # the run record's temp file written, not yet renamed into place
        real = writer._os_write
        def write(fd, data):
            n = real(fd, data)
            if bytes(data[:1]) == b"{":  # the run record's JSON (the lock's pid is written before it)
                die()
            return n
        writer._os_write = write
    elif point == "with-workers":  # workers running: write their pids, then die (the workers must die too)
        import multiprocessing
        real_append = state.Journal.append
        def append(self, entry):
            real_append(self, entry)
            with open(sys.argv[6], "w") as f:
                f.write(" ".join(str(c.pid) for c in multiprocessing.active_children()))
            die()
        state.Journal.append = append
    files = sys.argv[5] if len(sys.argv) > 5 else "copy"
    workers = 2 if point == "with-workers" else 1
    convert(src, out, ConvertOptions(files=files, workers=workers, repack_experts=sys.argv[4]))
    """
)

# The CLI with two workers, one of which a watcher thread SIGKILLs once the first overlay file is journalled.
KILL_A_WORKER = textwrap.dedent(
    """
    import multiprocessing, os, pathlib, signal, sys, threading, time
    from glm_pack.convert.cli import main
    journal = pathlib.Path(sys.argv[2]) / "glm-pack" / ".journal.jsonl"

    def watch():
        while not (journal.is_file() and journal.read_text().strip()):
            time.sleep(0.05)
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    main(["convert", sys.argv[1], sys.argv[2], "--files", "copy", "--workers", "2", "--repack-experts", "aiter-a4w4",
          "--quiet"], prog_name="glm-pack")
    """
)

# The CLI with two workers, pausing in the main process once the first overlay file is journalled: it writes the
# flag file sys.argv[3] and sleeps, so that the test's SIGTERM lands mid-run.
PAUSE_AFTER_ONE = textwrap.dedent(
    """
    import pathlib, sys, time
    from glm_pack.convert import state
    from glm_pack.convert.cli import main
    real_append = state.Journal.append

    def append(self, entry):
        real_append(self, entry)
        pathlib.Path(sys.argv[3]).write_text("journalled")
        time.sleep(60)

    state.Journal.append = append
    main(["convert", sys.argv[1], sys.argv[2], "--files", "copy", "--workers", "2", "--repack-experts", "aiter-a4w4",
          "--quiet"], prog_name="glm-pack")
    """
)


def overlay(out):
    return {p.name: p.read_bytes() for p in sorted((out / "glm-pack").glob("*.safetensors"))}


def manifest_without_time(out):
    m = json.loads((out / "glm-pack" / "manifest.json").read_text())
    m.pop("created")
    return m


@pytest.mark.parametrize("point", ["mid-file", "between-files", "manifest"])
def test_sigkill_then_resume_is_byte_identical(converted, tmp_path, point):
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(src), str(out), point, "aiter-a4w4"], capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (out / "glm-pack" / "manifest.json").exists()
    report = verify(out)
    assert not report.ok and report.incomplete
    runner = CliRunner()
    refused = runner.invoke(main, ["convert", str(src), str(out), "--files", "copy", "--repack-experts", "aiter-a4w4"])
    assert refused.exit_code == 1 and "interrupted conversion" in refused.output and "--resume" in refused.output
    resumed = runner.invoke(
        main,
        [
            "convert",
            str(src),
            str(out),
            "--files",
            "copy",
            "--repack-experts",
            "aiter-a4w4",
            "--resume",
            "--quiet",
            "--workers",
            "2",
        ],
    )
    assert resumed.exit_code == 0, resumed.output
    assert overlay(out) == overlay(clean)
    assert manifest_without_time(out) == manifest_without_time(clean)
    assert sorted(p.name for p in (out / "glm-pack").iterdir()) == sorted(
        p.name for p in (clean / "glm-pack").iterdir()
    )
    assert verify(out).ok


def test_resume_redoes_a_corrupted_finished_file(converted, tmp_path):
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "manifest", "none"], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    victim = out / "glm-pack" / "layer-001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    report = convert(src, out, ConvertOptions(files="copy", resume=True))
    assert report.resumed_items == sum(name.startswith("layer-") for name in overlay(clean)) - 1  # all but the bad one
    assert overlay(out)["layer-001.safetensors"] == overlay(clean)["layer-001.safetensors"]
    assert verify(out).ok


def test_resume_redoes_a_deleted_finished_file_and_skips_a_torn_journal_line(converted, tmp_path):
    """A finished file deleted since is redone (not a FileNotFoundError traceback), and a journal line torn by the
    kill (no newline, not JSON) is ignored, not an error."""
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "manifest", "none"], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    (out / "glm-pack" / "layer-001.safetensors").unlink()
    with open(out / "glm-pack" / ".journal.jsonl", "a") as f:
        f.write('{"file": "layer-0')
    report = convert(src, out, ConvertOptions(files="copy", resume=True))
    layers = {name: data for name, data in overlay(clean).items() if name.startswith("layer-")}
    assert report.resumed_items == len(layers) - 1
    assert overlay(out) == layers and verify(out).ok


@pytest.mark.parametrize("name", ["notes.tmp", ".notes"])
def test_an_overlay_folder_holding_other_files_is_not_unstarted(converted, tmp_path, name):
    """Only ``.<name>.tmp`` files are what a killed run leaves in an unstarted glm-pack/: a user's file named like
    half of that is content, refused without --overwrite and left where it is."""
    out = tmp_path / "out"
    (out / "glm-pack").mkdir(parents=True)
    (out / "glm-pack" / name).write_text("mine")
    with pytest.raises(PlanError, match="is not empty; pass --overwrite"):
        convert(converted[0], out, ConvertOptions(files="none"))
    assert os.listdir(out / "glm-pack") == [name]


@pytest.mark.parametrize(
    "edit",
    [
        lambda e: e.pop("sha256"),
        lambda e: e.pop("tensors"),
        lambda e: e.update(item={**e["item"], "layer": e["item"]["layer"] + 1}),
        lambda e: e.clear(),
        lambda e: e.update(size=e["size"] + 1),
        lambda e: next(iter(e["tensors"].values())).update(sha256="0" * 64),
    ],
    ids=["no-sha256", "no-tensors", "another-item", "empty", "size", "a-tensor-sha256"],
)
def test_resume_redoes_an_edited_journal_entry(converted, tmp_path, edit):
    """A journal line edited by hand (a key dropped, another item, a size or a tensor's sha256 changed to another
    value of its type) is redone like a changed file: it was a KeyError traceback, or its item taken as done with the
    edited value in the manifest (a tensor's sha256: verify then passed). The line's checksum no longer matches."""
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "manifest", "none"], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    journal = out / "glm-pack" / ".journal.jsonl"
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    edit(lines[0]["entry"])  # the line's sha256 stays that of the entry as written
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = convert(src, out, ConvertOptions(files="copy", resume=True))
    assert report.resumed_items == len(lines) - 1
    assert overlay(out) == {name: data for name, data in overlay(clean).items() if name.startswith("layer-")}
    assert verify(out).ok


def test_resume_redoes_a_journal_line_with_a_right_checksum_but_not_its_items_entry(converted, tmp_path):
    """A line whose checksum was recomputed after the edit (its entry lacks the MLA entry the manifest is built from)
    is redone, as ``is_entry_of`` says; it was a KeyError traceback once past the checksum."""
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "manifest", "none"], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    journal = out / "glm-pack" / state.JOURNAL_NAME
    entries = [json.loads(line)["entry"] for line in journal.read_text().splitlines()]
    edited = next(e for e in entries if "mla" in e)
    edited.pop("mla")
    journal.write_bytes(b"".join(state._line(e) for e in entries))
    report = convert(src, out, ConvertOptions(files="copy", resume=True))
    assert report.resumed_items == len(entries) - 1
    assert overlay(out) == {name: data for name, data in overlay(clean).items() if name.startswith("layer-")}
    assert verify(out).ok


@pytest.mark.parametrize(
    "edit",
    [
        lambda e: e.pop("source_tensors"),
        lambda e: e.pop("mla"),
        lambda e: e.update(mla=[e["mla"]]),
        lambda e: e.update(size=str(e["size"])),
        lambda e: e.update(size=True),
    ],
    ids=["no-source-tensors", "no-mla", "mla-not-an-object", "size-as-text", "size-a-bool"],
)
def test_a_journal_line_missing_what_the_manifest_needs_is_not_its_items(tmp_path, edit):
    """A journal line is kept only if it holds every key the manifest is built from, of its type: one without its
    source fingerprint or MLA entry, or a size that is not an int, would end in a KeyError / TypeError traceback."""
    item = WorkItem("mla", 3, "layer-003.safetensors")
    entry = write_item(tmp_path, item, {"t": torch.ones(4, dtype=torch.uint8)}, {}, {"src": "0" * 64}, mla={"layer": 3})
    entry = json.loads(json.dumps(entry))  # as the journal holds it
    assert is_entry_of(entry, item)
    edit(entry)
    assert not is_entry_of(entry, item)


def test_a_finished_conversion_leaves_no_run_state(converted):
    """The run record and the journal go once the manifest is written: glm-pack/ then holds the manifest and the
    files it lists, nothing else."""
    overlay_dir = converted[1] / "glm-pack"
    files = json.loads((overlay_dir / "manifest.json").read_text())["files"]
    assert sorted(os.listdir(overlay_dir)) == sorted(["manifest.json", *files])


def test_the_lock_stays_held_while_overwrite_empties_out(converted, tmp_path, monkeypatch):
    """--overwrite empties OUT but its lock file: deleting it would let a second run create a new one and take it
    while this run still writes."""
    src, _ = converted
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real, refused = state.write_run, []

    def write_run(overlay, run):  # called right after OUT is emptied
        try:
            with OutputLock(out):
                refused.append(False)
        except PlanError as err:
            refused.append("another glm-pack run" in str(err))
        real(overlay, run)

    monkeypatch.setattr(state, "write_run", write_run)
    convert(src, out, ConvertOptions(files="none", overwrite=True))
    assert refused == [True] and not (out / "old.txt").exists()


def test_resume_with_other_options_is_refused_naming_each_difference(converted, tmp_path, ckpt_copy):
    src = ckpt_copy(converted[0])
    out = tmp_path / "out"
    subprocess.run(
        [sys.executable, "-c", DRIVER, str(src), str(out), "between-files", "aiter-a4w4"], capture_output=True
    )
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--resume"])  # README's line, without the options
    assert r.exit_code == 1, r.output
    assert "--repack-experts: aiter-a4w4 (interrupted run) vs none (this run)" in r.stderr  # as typed, not recorded
    assert "--files: copy (interrupted run) vs link (this run)" in r.stderr and "quant-mode" not in r.stderr
    assert "rerun with the interrupted run's options and --resume to finish it" in r.stderr
    assert "or with --overwrite instead of --resume to start over" in r.stderr  # --resume --overwrite: refused too
    again = CliRunner().invoke(main, ["convert", str(src), str(out), "--resume", "--overwrite"])
    assert again.exit_code == 1 and again.stderr == r.stderr, again.output
    same = ConvertOptions(files="copy", resume=True, repack_experts="aiter-a4w4")
    other = ckpt_copy(src)  # the same files through another path
    with pytest.raises(PlanError) as err:
        convert(other, out, same)
    assert f"interrupted one: source: {src} (interrupted run) vs {other} (this run); rerun" in str(err.value)
    config = (src / "config.json").read_bytes()
    (src / "config.json").unlink()  # a new file (new mtime): the shared original stays as it is
    (src / "config.json").write_bytes(config)
    with pytest.raises(PlanError, match="interrupted one: source files changed since: config.json; rerun"):
        convert(src, out, same)
    with pytest.raises(PlanError, match="already complete"):
        convert(src, tmp_path / "done", ConvertOptions(files="none"))
        convert(src, tmp_path / "done", ConvertOptions(files="none", resume=True))


def test_run_differences_name_options_either_run_lacks_and_never_come_back_empty():
    from glm_pack.convert.convert import run_differences

    run = {"tool": "0.1.0", "options": {"quant_mode": "even"}, "source": "/s", "stats": {"a": [1, 2]}}
    older = {**run, "options": {"quant_mode": "even", "k_multiple": 64}}  # a key this build does not record
    assert run_differences(older, run) == ["--k-multiple: 64 (interrupted run) vs null (this run)"]
    padded = {**run, "options": {"quant_mode": "even", "k_pad": 256}}  # --k-pad card or 256; --k-pad none records null
    assert run_differences(padded, {**run, "options": {"quant_mode": "even", "k_pad": None}}) == [
        "--k-pad: 256 (interrupted run) vs none (this run)"
    ]
    odd = {**run, "extra": 1}  # differs only outside options, source, tool and stats
    assert run_differences(odd, run) == ["its run record (glm-pack/.run.json) differs from this run's"]


def test_resume_summary_counts_the_kept_files(converted, tmp_path):
    """The summary of a resumed run says how many finished overlay files it re-checked and kept: the 2 journalled."""
    src, _ = converted
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "between-files", "none"], capture_output=True)
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume"])
    assert r.exit_code == 0, r.output
    assert "resumed: 2 finished overlay files re-checked by hash and kept" in r.stdout.splitlines(), r.stdout
    assert "holds no interrupted conversion" not in r.stdout, r.stdout


@pytest.mark.parametrize("name", [".run.json", ".journal.jsonl"])
def test_resume_with_an_unreadable_run_file_is_one_line(converted, tmp_path, name, refuse):
    """An interrupted run's record or journal that cannot be read (a permission, an I/O error): one line naming it,
    exit 1, OUT left as it was; it was the raw OSError (a traceback)."""
    src, _ = converted
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "between-files", "none"], capture_output=True)
    target = out / "glm-pack" / name
    assert target.is_file()
    before = sorted((p.name, p.stat().st_size) for p in (out / "glm-pack").iterdir())
    refuse(type(target), "read_bytes", target)
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    what = "the run state" if name == ".run.json" else "the journal"
    assert f"cannot read {what}: Permission denied (file {target})" in r.stderr, r.output
    assert sorted((p.name, p.stat().st_size) for p in (out / "glm-pack").iterdir()) == before


def test_resume_with_an_unreadable_finished_file_is_one_line(converted, tmp_path, refuse):
    """A journalled overlay file that cannot be read (a permission, an I/O error) when --resume re-hashes it: one line
    naming it, exit 1, OUT left as it was; it was the raw OSError (a traceback)."""
    src, _ = converted
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "between-files", "none"], capture_output=True)
    entries = state.Journal(out / "glm-pack").entries()
    assert len(entries) == 2
    target = out / "glm-pack" / entries[0]["file"]
    before = sorted((p.name, p.stat().st_size) for p in (out / "glm-pack").iterdir())
    refuse(builtins, "open", target)
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    assert f"cannot read: Permission denied (file {target})" in r.stderr, r.output
    assert sorted((p.name, p.stat().st_size) for p in (out / "glm-pack").iterdir()) == before


def test_a_run_state_that_cannot_be_removed_at_the_end_is_one_line(converted, tmp_path, monkeypatch, refuse):
    """The journal cannot be removed once the manifest is written (an I/O error): one line naming it and saying the
    conversion is complete, exit 1, and so it is (verify passes); it was the raw OSError (a traceback)."""
    src, _ = converted
    out = tmp_path / "out"
    journal = out / "glm-pack" / state.JOURNAL_NAME
    refuse(type(journal), "unlink", journal, errno.EIO)
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "none", "--workers", "1", "--quiet"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.exception
    complete = "the conversion is complete (its manifest is written), but its run state cannot be removed"
    assert f"{complete}: Input/output error (file {journal})" in r.stderr, r.output
    monkeypatch.undo()
    assert verify(out).ok


def test_resume_with_nothing_to_resume_says_so_before_converting(converted, tmp_path):
    """--resume on an OUT with no interrupted run (e.g. a mistyped path) converts from the start and says so first,
    not only through a summary without its 'resumed:' line at the end."""
    src, _ = converted
    out = tmp_path / "typo"
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == f"--resume: {out} holds no interrupted conversion; converting from the start", r.stdout
    assert not any(line.startswith("resumed:") for line in lines) and verify(out).ok
    again = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume"])
    assert again.exit_code == 1 and "already complete; nothing to resume" in again.stderr, again.output
    assert "holds no interrupted conversion" not in again.output, again.output
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != state.LOCK_NAME}
    again = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy"])  # the same command, again
    assert again.exit_code == 1 and again.stderr.strip().splitlines() == [
        f"glm-pack: error: output {out} already holds a finished conversion: `glm-pack verify {out}` checks it; "
        "pass --overwrite to convert again into it (everything in it is replaced)"
    ], again.output  # it said only "is not empty", as for a folder of other files
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != state.LOCK_NAME} == before
    for flags in ([], ["--overwrite"]):  # into its overlay folder: --overwrite replaced the overlay with a checkpoint
        inner = CliRunner().invoke(main, ["convert", str(src), str(out / "glm-pack"), "--files", "copy", *flags])
        assert inner.exit_code == 1 and inner.stderr.strip().splitlines() == [
            f"glm-pack: error: output {out / 'glm-pack'} is the overlay folder of the conversion in {out}: convert "
            f"into {out} (--overwrite redoes that conversion) or into another folder"
        ], inner.output
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != state.LOCK_NAME} == before
    assert verify(out).ok


def test_resume_into_a_folder_of_other_files_is_refused_without_saying_it_converts(converted, tmp_path):
    """--resume into a non-empty folder that holds no conversion: the refusal (pass --overwrite) is all it prints, not
    first "converting from the start"; with --overwrite it says so and converts."""
    src, _ = converted
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("not a checkpoint")
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume"])
    assert r.exit_code == 1 and "is not empty; pass --overwrite" in r.stderr, r.output
    assert r.stdout == "", r.stdout
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0] == f"--resume: {out} holds no interrupted conversion; converting from the start"
    assert verify(out).ok


@pytest.mark.parametrize("older", ["all", "first"])
def test_resume_keeps_journal_entries_written_before_worst_head_errors(converted, tmp_path, older):
    """A journal written by a glm-pack build that did not record max_head_rel_error yet (same tool version, so its
    run resumes): its layers are kept and lack the key in the manifest, as older manifests do, and the summary says
    n/a for them rather than ending in a KeyError traceback. Where only some entries lack it, the summary's worst
    head says over how many layers it was taken."""
    src, _ = converted
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "manifest", "none"], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    journal = out / "glm-pack" / ".journal.jsonl"
    entries = [json.loads(line)["entry"] for line in journal.read_text().splitlines()]
    mla_entries = [entry["mla"] for entry in entries if "mla" in entry]
    stripped = mla_entries if older == "all" else mla_entries[:1]
    assert len(mla_entries) > 1 and all("max_head_rel_error" in e[p] for e in stripped for p in ("w_kc", "w_vc"))
    for entry in stripped:
        for p in ("w_kc", "w_vc"):
            del entry[p]["max_head_rel_error"]
    journal.write_bytes(b"".join(state._line(entry) for entry in entries))
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume"])
    assert r.exit_code == 0, r.output
    assert f"resumed: {len(entries)} finished overlay files re-checked by hash and kept" in r.stdout, r.stdout
    mla = json.loads((out / "glm-pack" / "manifest.json").read_text())["mla"]
    recorded = [e for e in mla if "max_head_rel_error" in e["w_kc"]]
    assert len(mla) == len(mla_entries) and len(recorded) == len(mla_entries) - len(stripped)
    rows = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == len(mla) and sum(row.count("n/a") == 2 for row in rows) == len(stripped), r.stdout
    (summary,) = [line for line in r.stdout.splitlines() if " MLA layers, overlay " in line]
    if older == "all":
        assert "rel error w_kc max " in summary and "worst head" not in summary, summary
    else:
        for p in ("w_kc", "w_vc"):
            worst = max(e[p]["max_head_rel_error"] for e in recorded)
            assert f"worst head {worst:.4f} (recorded in {len(recorded)} of {len(mla)} layers)" in summary, summary
    assert verify(out).ok


def test_resume_onto_a_folder_where_an_overlay_file_goes_is_one_line(converted, tmp_path):
    src, _ = converted
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "between-files", "none"], capture_output=True)
    blocker = out / "glm-pack" / "layer-003.safetensors"  # not written yet: 2 items were journalled
    blocker.mkdir()
    (blocker / "mine").write_text("mine")
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--resume", "--quiet"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"cannot write {blocker}: Is a directory" in r.stderr and (blocker / "mine").read_text() == "mine"
    assert not (out / "glm-pack" / "manifest.json").exists() and list(out.rglob(".*.tmp")) == []


def test_second_concurrent_run_is_refused(converted, tmp_path):
    src, _ = converted
    out = tmp_path / "out"
    with OutputLock(out):
        r = CliRunner().invoke(main, ["convert", str(src), str(out)])
        assert r.exit_code == 1 and f"pid {os.getpid()}" in r.output and "another glm-pack run" in r.output


def test_json_reports_and_errors_keep_to_their_streams(converted, tmp_path):
    """README: with --json stdout holds the report alone. verify prints one for every verdict (FAILED for a missing
    OUT too); an error that stops a command first (OUT locked by a writer, a SRC that is no checkpoint) leaves stdout
    empty and says it in one line on stderr."""
    src, out = converted
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "missing"), "--json"])
    assert r.exit_code == 1 and r.stderr == "" and json.loads(r.stdout)["ok"] is False, r.output
    with OutputLock(out):
        r = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert r.exit_code == 1 and r.stdout == "" and "is writing this output" in r.stderr, r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "missing"), "--json"])
    assert r.exit_code == 1 and r.stdout == "" and r.stderr.startswith("glm-pack: error: not a checkpoint"), r.output


def test_stale_lock_of_a_killed_process_is_recovered(converted, tmp_path, lock_holder):
    src, _ = converted
    out = tmp_path / "out"
    holder = lock_holder(out)
    with pytest.raises(PlanError, match="another glm-pack run"):
        convert(src, out, ConvertOptions(files="none"))
    holder.kill()
    holder.wait()
    assert (out / ".glm-pack.lock").exists()  # the file stays, the lock died with its process
    convert(src, out, ConvertOptions(files="none"))
    assert verify(out).ok


def test_a_stale_longer_pid_in_the_lock_file_is_not_reported(converted, tmp_path, lock_holder):
    """The lock file keeps the pid of the last writer; a writer with a shorter pid replaces it whole, so a refusal
    names the live writer, not its digits over the tail of the stale one."""
    src, _ = converted
    out = tmp_path / "out"
    out.mkdir()
    (out / state.LOCK_NAME).write_text("9" * 40)  # left by a writer long gone
    holder = lock_holder(out)
    with pytest.raises(PlanError, match=rf"another glm-pack run \(pid {holder.pid}\) is writing this output"):
        convert(src, out, ConvertOptions(files="none"))


def test_a_writer_takes_the_lock_when_the_readers_leave_while_it_looks(converted, tmp_path, monkeypatch):
    """A writer finding the lock held looks whether a writer or only readers hold it (by taking it shared); when the
    readers left meanwhile (here: its first attempt is refused as if a verify held it), it is granted the lock, not
    refused naming a verify that is gone."""
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    real, attempts = state._flock, []

    def flock(fd, op):
        attempts.append(op)
        return len(attempts) > 1 and real(fd, op)  # the first attempt meets a verify that then finishes

    monkeypatch.setattr(state, "_flock", flock)
    with OutputLock(out):
        assert (out / state.LOCK_NAME).read_text() == str(os.getpid())


@pytest.mark.parametrize("holder", ["writer", "reader"])
def test_a_refused_run_leaves_no_file_open(converted, tmp_path, lock_holder, holder):
    """A refusal closes the lock file it opened: a long-lived process (a notebook, a service) refused again and again
    must not run out of file descriptors."""
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    lock_holder(out, shared=holder == "reader")
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(PlanError, match="is (writing|reading) this output"):
            convert(src, out, ConvertOptions(files="none", overwrite=True))
    assert sorted(os.listdir("/proc/self/fd")) == before


def private_out(clean, dst):
    """A private copy of a converted OUT (hard links: a card is written by rename, never through them); its
    lock file is left out, as in a downloaded OUT."""
    shutil.copytree(clean, dst, copy_function=os.link, ignore=shutil.ignore_patterns(state.LOCK_NAME))
    return dst


def files_state(out):
    """(inode, size, mtime in ns) of every file under OUT: a write or a replacement changes it."""
    return {p: (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()}


def refusal(r, out):
    """The one error line of a refused command: exit code 1, no traceback, naming OUT's lock file."""
    errors = [line for line in r.output.splitlines() if line.startswith("glm-pack: error:")]
    assert r.exit_code == 1 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert f"file {out / state.LOCK_NAME}" in errors[0], errors[0]
    return errors[0]


LOCKING_COMMANDS = {
    "convert": lambda src, out: ["convert", src, out, "--overwrite", "--files", "none", "--quiet"],
    "card": lambda src, out: ["card", out],
    "verify": lambda src, out: ["verify", out],
}


@pytest.mark.parametrize("command", list(LOCKING_COMMANDS))
def test_a_writer_holding_the_lock_refuses_every_command(converted, tmp_path, lock_holder, command):
    """card and verify took no lock: a card could land in an OUT a convert --overwrite was emptying, and a
    verify read half-written files. Now each is refused, naming the writer's pid, and writes nothing."""
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    holder = lock_holder(out)
    before = files_state(out)
    line = refusal(CliRunner().invoke(main, [str(a) for a in LOCKING_COMMANDS[command](src, out)]), out)
    if command == "verify":
        assert f"a glm-pack run (pid {holder.pid}) is writing this output; verify after it finishes" in line
    else:
        assert f"another glm-pack run (pid {holder.pid}) is writing this output" in line
    assert files_state(out) == before


@pytest.mark.parametrize("command", ["convert", "card"])
def test_a_verify_holding_the_lock_refuses_writers_without_naming_a_stale_pid(
    converted, tmp_path, lock_holder, command
):
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    assert CliRunner().invoke(main, ["card", str(out)]).exit_code == 0  # leaves this (live) process's pid inside
    assert (out / state.LOCK_NAME).read_text() == str(os.getpid())
    lock_holder(out, shared=True)
    before = files_state(out)
    line = refusal(CliRunner().invoke(main, [str(a) for a in LOCKING_COMMANDS[command](src, out)]), out)
    assert "a glm-pack verify is reading this output" in line and "pid" not in line
    assert files_state(out) == before


def test_verifies_share_the_lock(converted, tmp_path, lock_holder):
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    lock_holder(out, shared=True)
    with OutputLock(out, shared=True):  # another open file of this process: as good as a third reader
        r = CliRunner().invoke(main, ["verify", str(out)])
        assert r.exit_code == 0 and f"verify {out}: OK" in r.output, r.output
        with pytest.raises(PlanError, match="a glm-pack verify is reading this output"):
            convert(src, out, ConvertOptions(files="none", overwrite=True))


def test_verify_of_a_read_only_out_without_a_lock_file_runs_unlocked(converted, tmp_path, read_only):
    """A downloaded overlay on a read-only mount has no lock file and none can be made there: verify checks it
    all the same, and so does a card that is already up to date (it writes nothing)."""
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    assert CliRunner().invoke(main, ["card", str(out)]).exit_code == 0
    (out / state.LOCK_NAME).unlink(missing_ok=True)  # the card's
    view = read_only(out)
    r = CliRunner().invoke(main, ["verify", str(view)])
    assert r.exit_code == 0 and f"verify {view}: OK" in r.output, r.output
    r = CliRunner().invoke(main, ["card", str(view)])
    assert r.exit_code == 0 and "model card written" in r.output, r.output
    assert not (view / state.LOCK_NAME).exists()


@pytest.mark.parametrize("code", ["EACCES", "EPERM", "EROFS"])
def test_verify_runs_unlocked_where_the_lock_file_cannot_be_opened(converted, tmp_path, refuse, code):
    """Each reason the lock file cannot be opened on an OUT this user cannot write (a folder of another user: EACCES;
    a read-only mount: EROFS; an immutable folder, chattr +i: EPERM) lets verify check OUT unlocked. The
    read_only fixture can give only one of them per user (chmod or, for root, a mount), so each is injected here."""
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    refuse(os, "open", lambda path: path.name == state.LOCK_NAME, getattr(errno, code))
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 0 and f"verify {out}: OK" in r.output, r.output


@pytest.mark.parametrize("code", ["EACCES", "EPERM"])
def test_convert_does_not_run_unlocked_where_the_lock_file_cannot_be_opened(converted, tmp_path, refuse, code):
    """A writer never goes on without the lock (verify may: it writes nothing): a lock file of another user, or an
    immutable one, refuses convert in one line, and no glm-pack/ is made."""
    src, _ = converted
    out = tmp_path / "out"
    refuse(os, "open", lambda path: path.name == state.LOCK_NAME, getattr(errno, code))
    line = refusal(CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "none"]), out)
    assert f"cannot create the output lock: {os.strerror(getattr(errno, code))}" in line
    assert not (out / "glm-pack").exists()


def test_verify_of_a_read_only_view_still_sees_a_writer(converted, tmp_path, lock_holder, read_only):
    """A lock file that is there is locked through a read-only view too: a writer on OUT refuses the verify."""
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    holder = lock_holder(out)
    view = read_only(out)
    line = refusal(CliRunner().invoke(main, ["verify", str(view)]), view)
    assert f"a glm-pack run (pid {holder.pid}) is writing this output" in line


def test_a_linked_lock_file_lets_verify_read_and_refuses_writers(converted, tmp_path):
    """An OUT copied as links (cp -rs, or a test's ckpt_copy) has its lock file as a link: verify, which writes
    nothing, checks it unlocked (it refused: 'cannot create the output lock: it is a symlink'); a writer still
    refuses to write through it."""
    src, clean = converted
    out = private_out(clean, tmp_path / "out")
    target = tmp_path / "elsewhere.lock"
    target.write_text("12345")
    (out / state.LOCK_NAME).unlink(missing_ok=True)
    (out / state.LOCK_NAME).symlink_to(target)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 0 and f"verify {out}: OK" in r.output, r.output
    assert "it is a symlink" in refusal(CliRunner().invoke(main, ["card", str(out)]), out)
    assert target.read_text() == "12345"


def test_ctrl_c_exits_cleanly_and_leaves_a_resumable_state(converted, tmp_path):
    src, clean = converted
    out = tmp_path / "out"
    # The CLI, held for a minute after its first journalled item, so the Ctrl-C lands mid-run on a loaded machine too.
    # Ctrl-C's default action is restored first: a test run started as a shell's background job inherits SIGINT
    # ignored (POSIX shells without job control do that), and the CLI would then never see it.
    held = textwrap.dedent(
        """
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from glm_pack.convert import state
        from glm_pack.convert.cli import main
        real = state.Journal.append
        def append(self, entry):
            real(self, entry)
            time.sleep(60)
        state.Journal.append = append
        main(sys.argv[1:], prog_name="glm-pack")
        """
    )
    args = ["convert", str(src), str(out), "--files", "copy", "--workers", "1", "--repack-experts", "aiter-a4w4"]
    proc = subprocess.Popen(
        [sys.executable, "-c", held, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    journal = out / "glm-pack" / ".journal.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (journal.exists() and journal.read_text().count("\n") >= 1):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "--resume" in err and "Traceback" not in err
    assert not (out / "glm-pack" / "manifest.json").exists()
    convert(src, out, ConvertOptions(files="copy", resume=True, repack_experts="aiter-a4w4"))
    assert overlay(out) == overlay(clean)


def test_ctrl_c_while_copying_an_original_leaves_no_partial_copy(converted, tmp_path, monkeypatch):
    """Copying a multi-GB shard is where a Ctrl-C lands: its half-written temp file stayed in OUT."""
    import shutil

    src, clean = converted
    out = tmp_path / "out"
    real = shutil.copyfile

    def copyfile(a, b):
        if str(a).endswith("model-00002-of-00005.safetensors"):
            with open(a, "rb") as f, open(b, "wb") as g:
                g.write(f.read(1 << 20))
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(shutil, "copyfile", copyfile)
    args = ["convert", str(src), str(out), "--files", "copy", "--repack-experts", "aiter-a4w4", "--workers", "1"]
    r = CliRunner().invoke(main, [*args, "--quiet"])
    assert r.exit_code == 130 and "--resume" in r.stderr, r.output
    assert list(out.rglob(".*.tmp")) == [] and not (out / "glm-pack" / "manifest.json").exists()
    monkeypatch.undo()
    assert CliRunner().invoke(main, [*args, "--quiet", "--resume"]).exit_code == 0
    assert overlay(out) == overlay(clean) and list(out.rglob(".*.tmp")) == []


def test_ctrl_c_after_the_manifest_does_not_ask_for_a_resume(converted, tmp_path, monkeypatch):
    """Interrupted once the manifest is written (while the run state is cleared): the output is complete and
    --resume would refuse ('already complete'), so the line must not send the user there."""
    from glm_pack.convert import state

    src, _ = converted
    out = tmp_path / "out"

    def clear_run(overlay):
        raise KeyboardInterrupt

    monkeypatch.setattr(state, "clear_run", clear_run)
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "none", "--workers", "1", "--quiet"])
    assert r.exit_code == 130 and "--resume" not in r.stderr, r.stderr
    assert f"{out} holds a complete conversion" in r.stderr and verify(out).ok


@pytest.mark.parametrize("stage", ["before-output", "after-manifest"])
def test_ctrl_c_of_an_overwrite_of_a_complete_out(converted, tmp_path, monkeypatch, stage):
    """--overwrite over a complete OUT, interrupted before OUT is touched (e.g. while a Hub source's headers are
    read): its earlier conversion is still there, not one this run completed; interrupted once this run's
    manifest is written: a complete conversion of this run."""
    from glm_pack.convert import convert as convert_module
    from glm_pack.convert import state

    src, _ = converted
    out = tmp_path / "out"
    args = ["convert", str(src), str(out), "--files", "none", "--workers", "1", "--quiet"]
    assert CliRunner().invoke(main, args).exit_code == 0
    earlier = (out / "glm-pack" / "manifest.json").read_bytes()

    def interrupt(*args):
        raise KeyboardInterrupt

    target = (convert_module, "plan_items") if stage == "before-output" else (state, "clear_run")
    monkeypatch.setattr(*target, interrupt)
    r = CliRunner().invoke(main, [*args, "--overwrite", "--mla-precision", "bf16"])
    assert r.exit_code == 130 and "--resume" not in r.stderr, r.stderr
    now = json.loads((out / "glm-pack" / "manifest.json").read_text())
    if stage == "before-output":
        assert f"{out} was not changed: it still holds its earlier conversion" in r.stderr, r.stderr
        assert (out / "glm-pack" / "manifest.json").read_bytes() == earlier
    else:
        assert f"{out} holds a complete conversion" in r.stderr, r.stderr
        assert now["options"]["mla_precision"] == "bf16"
    assert verify(out).ok


def test_ctrl_c_while_overwrite_clears_out_says_to_rerun_the_same_command(converted, tmp_path, monkeypatch):
    """--overwrite interrupted while emptying OUT (its manifest already removed, no run record yet): nothing of this
    run is finished, so the line says to rerun the same command, which works; it used to advise --resume, which
    then refused (no interrupted conversion to resume)."""
    from glm_pack.convert import convert as convert_module

    src, clean = converted
    out = tmp_path / "out"
    args = ["convert", str(src), str(out), "--files", "none", "--workers", "1", "--quiet"]
    assert CliRunner().invoke(main, args).exit_code == 0

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "clear_directory", interrupt)
    r = CliRunner().invoke(main, [*args, "--overwrite"])
    assert r.exit_code == 130 and "--resume" not in r.stderr, r.stderr
    assert f"nothing of this run is finished: rerun the same command to convert into {out}" in r.stderr, r.stderr
    assert not (out / "glm-pack" / "manifest.json").exists()
    monkeypatch.undo()
    assert CliRunner().invoke(main, [*args, "--overwrite"]).exit_code == 0 and verify(out).ok


def test_resume_after_placing_linked_originals_leaves_no_temp_files(converted, tmp_path):
    """Placing a hard link onto a link to the same file is a no-op rename that used to leave its temp name."""
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(src), str(out), "placed", "aiter-a4w4", "link"], capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL
    convert(src, out, ConvertOptions(files="link", resume=True, repack_experts="aiter-a4w4"))
    assert [p.name for p in out.rglob(".*.tmp")] == []
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in clean.iterdir() if not p.name.startswith(".")
    )
    assert overlay(out) == overlay(clean) and verify(out).ok


def test_a_run_killed_before_its_run_record_leaves_a_startable_out(converted, tmp_path):
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "run-record", "none"], capture_output=True)
    assert proc.returncode == -signal.SIGKILL and (out / "glm-pack").is_dir()
    result = CliRunner().invoke(main, ["convert", str(src), str(out), "--files", "copy", "--quiet"])
    assert result.exit_code == 0, result.output
    assert verify(out).ok


def test_a_run_killed_while_writing_its_run_record_resumes(converted, tmp_path):
    """Its only trace is the run record's temp file: --resume (or a plain rerun) must start, not call OUT non-empty."""
    src, clean = converted
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", DRIVER, str(src), str(out), "run-record-written", "aiter-a4w4"]
    assert subprocess.run(cmd, capture_output=True).returncode == -signal.SIGKILL
    assert [p.name for p in (out / "glm-pack").iterdir()] == ["..run.json.tmp"] and verify(out).incomplete
    args = ["convert", str(src), str(out), "--files", "copy", "--repack-experts", "aiter-a4w4", "--resume", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert overlay(out) == overlay(clean) and list(out.rglob(".*.tmp")) == []
    assert manifest_without_time(out) == manifest_without_time(clean)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers die with their parent on Linux")
def test_workers_die_with_a_killed_conversion(converted, tmp_path):
    """Workers must not go on writing into an OUT whose run was killed (and no longer holds its lock)."""
    src, _ = converted
    out, pids = tmp_path / "out", tmp_path / "pids"
    cmd = [sys.executable, "-c", DRIVER, str(src), str(out), "with-workers", "aiter-a4w4", "copy", str(pids)]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)  # no pipes to hold
    assert proc.returncode == -signal.SIGKILL
    written = sorted(p.name for p in (out / "glm-pack").glob("*.safetensors"))
    workers = [int(pid) for pid in pids.read_text().split()]
    assert workers and len(written) < len(overlay(converted[1]))  # items were left when it died
    time.sleep(3)  # unfinished items take longer than this
    alive = [pid for pid in workers if _alive(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "workers outlived the killed conversion"
    assert sorted(p.name for p in (out / "glm-pack").glob("*.safetensors")) == written


def test_a_killed_worker_gives_one_line_and_a_resumable_out(converted, tmp_path):
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_A_WORKER, str(src), str(out)], capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "a worker process died" in lines[0] and "--resume" in lines[0], lines[0]
    assert "--workers below 2 if memory ran out" in lines[0], lines[0]  # KILL_A_WORKER runs 2
    convert(src, out, ConvertOptions(files="copy", resume=True, repack_experts="aiter-a4w4"))
    assert overlay(out) == overlay(clean) and verify(out).ok


def test_sigterm_stops_convert_like_ctrl_c_with_exit_143(converted, tmp_path):
    """`kill PID` (a scheduler's stop, a container's shutdown) ended convert with exit code 143 and not a word, its
    workers left to finish. Now it stops as a Ctrl-C does: one line saying what is kept, no temp files, no manifest,
    and --resume finishes byte-identical to a clean run."""
    src, clean = converted
    out, flag = tmp_path / "out", tmp_path / "journalled"
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSE_AFTER_ONE, str(src), str(out), str(flag)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, (proc.returncode, stderr)
    assert stderr.splitlines() == [
        f"glm-pack: terminated; finished layers are kept: rerun the same command with --resume to complete {out}"
    ]
    assert not (out / "glm-pack" / "manifest.json").exists() and list(out.rglob(".*.tmp")) == []
    convert(src, out, ConvertOptions(files="copy", resume=True, repack_experts="aiter-a4w4"))
    assert overlay(out) == overlay(clean) and verify(out).ok


@pytest.mark.parametrize("text", ["{", "[1, 2]", "null", '"run"'])
def test_a_run_record_that_is_not_an_object_is_one_line(tmp_path, text):
    from glm_pack.convert.state import RUN_NAME, read_run

    (tmp_path / RUN_NAME).write_text(text)
    with pytest.raises(PlanError, match="unreadable run state .*use --overwrite to start over"):
        read_run(tmp_path)


@pytest.mark.parametrize("resume", [False, True])
def test_overwrite_starts_over_from_an_unreadable_run_record(converted, tmp_path, resume):
    """The refusal of an unreadable run record says "use --overwrite to start over": doing so must work, also with
    --resume kept in the command (there is nothing it could resume)."""
    src, clean = converted
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    (out / "glm-pack" / "manifest.json").unlink()
    (out / "glm-pack" / state.RUN_NAME).write_text("garbage")
    with pytest.raises(PlanError, match="unreadable run state .*use --overwrite to start over"):
        convert(src, out, ConvertOptions(files="copy", repack_experts="aiter-a4w4"))
    with pytest.raises(PlanError, match="unreadable run state .*use --overwrite to start over"):
        convert(src, out, ConvertOptions(files="copy", repack_experts="aiter-a4w4", resume=True))
    convert(src, out, ConvertOptions(files="copy", repack_experts="aiter-a4w4", overwrite=True, resume=resume))
    assert overlay(out) == overlay(clean) and verify(out).ok
