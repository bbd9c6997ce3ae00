"""Interrupted conversions: SIGKILL at several points, --resume, refusal without it, locking, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from glm_pack.convert.cli import main
from glm_pack.convert.convert import ConvertOptions, convert
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
    convert(src, out, ConvertOptions(files="copy", workers=1, repack_experts=sys.argv[4]))
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


def test_resume_with_other_options_is_refused(converted, tmp_path):
    src, _ = converted
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out), "between-files", "none"], capture_output=True)
    with pytest.raises(PlanError, match="other options"):
        convert(src, out, ConvertOptions(files="copy", resume=True, quant_mode="mse"))
    with pytest.raises(PlanError, match="already complete"):
        convert(src, tmp_path / "done", ConvertOptions(files="none"))
        convert(src, tmp_path / "done", ConvertOptions(files="none", resume=True))


def test_second_concurrent_run_is_refused(converted, tmp_path):
    src, _ = converted
    out = tmp_path / "out"
    with OutputLock(out):
        r = CliRunner().invoke(main, ["convert", str(src), str(out)])
        assert r.exit_code == 1 and f"pid {os.getpid()}" in r.output and "another glm-pack run" in r.output


def test_stale_lock_of_a_killed_process_is_recovered(converted, tmp_path):
    src, _ = converted
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time
        from glm_pack.convert.state import OutputLock
        with OutputLock({str(out)!r}):
            print("locked", flush=True)
            time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(PlanError, match="another glm-pack run"):
        convert(src, out, ConvertOptions(files="none"))
    holder.kill()
    holder.wait()
    assert (out / ".glm-pack.lock").exists()  # the file stays, the lock died with its process
    convert(src, out, ConvertOptions(files="none"))
    assert verify(out).ok


def test_ctrl_c_exits_cleanly_and_leaves_a_resumable_state(converted, tmp_path):
    src, clean = converted
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "glm_pack.convert.cli",
            "convert",
            str(src),
            str(out),
            "--files",
            "copy",
            "--workers",
            "1",
            "--repack-experts",
            "aiter-a4w4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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
