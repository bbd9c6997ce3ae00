"""``glm-pack push`` end to end: the real huggingface_hub client against the loopback FakeHub.

The pushed OUT is a real conversion (synthetic GLM-5 checkpoint, 1 MLA layer) made once per session.
Xet is disabled so uploads take the Hub's regular (inline) and LFS (batch + PUT) paths.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from click.testing import CliRunner
from fake_hub import Blob as FakeBlob
from fake_hub import FakeHub
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, constants, snapshot_download
from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

from glm_pack.convert import push as push_module
from glm_pack.convert.cli import main
from glm_pack.convert.push import (
    LocalFile,
    PushPlan,
    PushReport,
    Upload,
    group_commits,
    hub_error,
    local_files,
    stale_manifest,
)
from glm_pack.packing.errors import HubError

REPO = "tester/glm-5-small-gfx950"
LFS_THRESHOLD = 64 * 1024  # the text files (json, md) stay regular, every safetensors file goes through LFS
SOURCE_README = b"---\nlicense: apache-2.0\nlibrary_name: transformers\ntags:\n- glm\n---\n# GLM-5 small\n"
SMALL_COMMIT_GIB = 12 / 1024  # 12 MiB: several commits for the ~54 MB synthetic OUT


@pytest.fixture(scope="session", name="converted")
def converted_fixture(tmp_path_factory) -> Path:
    """A converted OUT made by the real converter from a synthetic checkpoint with a source README."""
    from glm_pack.convert.convert import ConvertOptions, convert
    from glm_pack.convert.synth import synthesize

    root = tmp_path_factory.mktemp("converted")
    src = synthesize(
        root / "src", card="glm-5", layers=1, experts=1, fmt="bf16", seed=0, mtp=False, shard_bytes=8 << 20
    )
    (src / "README.md").write_bytes(SOURCE_README)
    convert(src, root / "out", ConvertOptions())
    return root / "out"


@pytest.fixture(scope="session", name="converted_k_none")
def converted_k_none_fixture(converted) -> Path:
    """The same source converted with ``k_pad="none"``: another layer file and manifest, the same originals."""
    from glm_pack.convert.convert import ConvertOptions, convert

    out = converted.parent / "out-k-none"
    convert(converted.parent / "src", out, ConvertOptions(k_pad="none"))
    return out


@pytest.fixture(name="out")
def out_fixture(converted, tmp_path) -> Path:
    """A private copy of the converted OUT (hard links: tests replace files, never write through them)."""
    dst = tmp_path / "out"
    shutil.copytree(converted, dst, copy_function=os.link)
    return dst


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # read at import time by huggingface_hub
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login-cache" / "token"))
    with FakeHub(lfs_threshold=LFS_THRESHOLD) as server:
        monkeypatch.setenv("HF_TOKEN", server.token)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


def run_cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def dry_run_rows(out: Path, *flags: str) -> list[tuple[str, str]]:
    """(file, commit number) of each row of the dry run's table, sorted (wide enough that no cell wraps)."""
    result = CliRunner().invoke(main, ["push", str(out), REPO, *flags, "--dry-run"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in result.stdout.splitlines() if "│" in line]
    return sorted((cells[1], cells[0]) for cells in rows if cells[0].isdigit())


def numbered(commits: list[list[str]]) -> list[tuple[str, str]]:
    return [(path, str(i + 1)) for i, commit in enumerate(commits) for path in commit]


def published(out: Path, overlay_only: bool = False) -> dict[str, bytes]:
    """What a push must publish, listed independently of push.py: the non-hidden files of OUT."""
    root = out / "glm-pack" if overlay_only else out
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                path = Path(dirpath) / name
                files[path.relative_to(out).as_posix()] = path.read_bytes()
    return files


def assert_no_token(hub: FakeHub, result, out: Path) -> None:
    assert hub.token not in result.output
    for path in out.rglob("*"):
        if path.is_file():
            assert hub.token.encode() not in path.read_bytes(), path


def test_full_push_uploads_everything_in_bounded_commits(hub, out):
    result = run_cli("push", out, REPO, "--max-commit-gib", SMALL_COMMIT_GIB, "--commit-message", "GLM-5 overlay")
    assert result.exit_code == 0, result.output
    expected = published(out)
    assert hub.files(REPO) == expected
    assert "README.source.md" in expected and expected["README.source.md"] == SOURCE_README
    assert expected["README.md"].startswith(b"---\n")
    assert f'snapshot_download("{REPO}")'.encode() in expected["README.md"]
    # Both upload paths: every safetensors file through LFS (batch + PUT), the text files inline.
    assert hub.lfs_paths(REPO) == {p for p in expected if p.endswith(".safetensors")}
    put_bytes = sum(r.body_bytes for r in hub.kinds("lfs_put"))
    assert put_bytes == sum(len(b) for p, b in expected.items() if p.endswith(".safetensors"))
    assert len(hub.kinds("validate_yaml")) == 1
    commits = hub.repos[REPO].commits
    assert len(commits) >= 3
    bound = int(SMALL_COMMIT_GIB * 2**30)  # GiB: 2**30 bytes
    sizes = [sum(len(expected[p]) for p in c["files"]) for c in commits]
    for c, size in zip(commits, sizes, strict=True):
        assert len(c["files"]) == 1 or size <= bound
    for size, after in zip(sizes, commits[1:-1], strict=False):  # filled greedily, up to the cards
        assert size + len(expected[after["files"][0]]) > bound, (size, bound)
    last = {"glm-pack/manifest.json", "README.md", "README.source.md", "glm-pack/README.md"}  # the cards + manifest
    assert set(commits[-1]["files"]) == last & set(expected)
    assert [c["summary"] for c in commits] == [
        f"GLM-5 overlay ({i}/{len(commits)})" for i in range(1, len(commits) + 1)
    ]
    assert sorted(p for c in commits for p in c["files"]) == sorted(expected)
    assert_no_token(hub, result, out)


def test_repush_of_unchanged_out_uploads_nothing(hub, out):
    assert run_cli("push", out, REPO).exit_code == 0
    commits = len(hub.repos[REPO].commits)
    hub.reset_requests()
    result = run_cli("push", out, REPO)
    assert result.exit_code == 0, result.output
    assert "up to date" in result.output
    assert not hub.kinds("commit") and not hub.kinds("lfs_put") and not hub.kinds("preupload")
    assert len(hub.repos[REPO].commits) == commits


def test_repush_compares_every_file_when_paths_info_takes_several_requests(hub, out, monkeypatch):
    monkeypatch.setattr(push_module, "PATHS_INFO_CHUNK", 2)
    assert run_cli("push", out, REPO).exit_code == 0
    hub.reset_requests()
    result = run_cli("push", out, REPO)
    assert result.exit_code == 0 and "up to date" in result.output, result.output
    assert not hub.kinds("commit") and len(hub.kinds("paths_info")) == -(-len(published(out)) // 2)


def test_changed_file_is_uploaded_again(hub, out):
    assert run_cli("push", out, REPO).exit_code == 0
    commits = len(hub.repos[REPO].commits)
    config = out / "config.json"
    text = config.read_bytes()
    config.unlink()  # a hard link to the session's converted OUT: replace, do not write through
    config.write_bytes(text.replace(b"{", b"{ ", 1))  # same JSON, different bytes, one byte longer
    hub.reset_requests()
    # verify refuses a changed config (it no longer matches the manifest's fingerprint) ...
    result = run_cli("push", out, REPO)
    assert result.exit_code == 1 and "refusing to push" in result.output
    assert not hub.requests
    # ... while a changed card is a plain re-upload of that one file.
    readme = out / "README.md"
    readme.unlink()
    config.unlink()
    config.write_bytes(text)
    result = run_cli("push", out, REPO, "--base-model", "zai-org/GLM-5")
    assert result.exit_code == 0, result.output
    assert [c["files"] for c in hub.repos[REPO].commits[commits:]] == [["README.md"]]
    assert b"base_model: zai-org/GLM-5" in hub.files(REPO)["README.md"]


def test_a_remote_file_of_the_same_size_but_other_bytes_is_uploaded_again(hub, out):
    """A file on the revision with the local file's size but another LFS sha256 (changed there since) is re-sent:
    the size alone does not make it the same."""
    assert run_cli("push", out, REPO).exit_code == 0
    layer = "glm-pack/layer-000.safetensors"
    ours = (out / layer).read_bytes()
    theirs = ours[:-1] + bytes([ours[-1] ^ 0xFF])
    HfApi(endpoint=hub.endpoint, token=hub.token).create_commit(
        REPO, [CommitOperationAdd(layer, theirs)], commit_message="theirs"
    )
    assert hub.lfs_paths(REPO) >= {layer} and hub.files(REPO)[layer] == theirs
    result = run_cli("push", out, REPO)
    assert result.exit_code == 0, result.output
    assert hub.repos[REPO].commits[-1]["files"] == [layer] and hub.files(REPO)[layer] == ours


def test_overlay_only_push_leaves_the_repo_root_alone(hub, out):
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    api.create_repo(REPO)
    original = b"---\nlicense: mit\n---\n# the original repo card\n"
    api.create_commit(REPO, [CommitOperationAdd("README.md", original)], commit_message="original")
    hub.reset_requests()
    result = run_cli("push", out, REPO, "--overlay-only")
    assert result.exit_code == 0, result.output
    files = hub.files(REPO)
    assert files["README.md"] == original
    expected = published(out, overlay_only=True)
    assert {p: files[p] for p in files if p != "README.md"} == expected
    assert set(expected) == {"glm-pack/manifest.json", "glm-pack/README.md", "glm-pack/layer-000.safetensors"}
    assert expected["glm-pack/README.md"].startswith(b"---\n")
    assert not (out / "README.source.md").exists()  # overlay mode does not touch the root card
    assert not hub.kinds("validate_yaml")  # only a root README.md is validated by the Hub


def test_overlay_only_push_works_without_the_local_source(hub, converted, ckpt_copy, tmp_path):
    """verify cannot re-derive the layers of an overlay whose source is gone, but passes OUT's own files: push
    --overlay-only still publishes it."""
    from glm_pack.convert.convert import ConvertOptions, convert

    src, out = ckpt_copy(converted.parent / "src"), tmp_path / "overlay"
    convert(src, out, ConvertOptions(files="none"))
    src.rename(tmp_path / "moved-away")
    result = run_cli("push", out, REPO, "--overlay-only")
    assert result.exit_code == 0, result.output
    assert set(hub.files(REPO)) == set(published(out, overlay_only=True))


def test_push_to_a_private_repo_branch(hub, out):
    result = run_cli("push", out, REPO, "--revision", "gfx950", "--overlay-only", "--private")
    assert result.exit_code == 0, result.output
    assert hub.repos[REPO].private
    assert hub.files(REPO, "main") == {}
    assert set(hub.files(REPO, "gfx950")) == set(published(out, overlay_only=True))


@pytest.mark.parametrize("revision", ["main", "gfx950"])
def test_the_cards_loading_example_downloads_the_pushed_overlay(hub, out, tmp_path, revision):
    """The card's loading example, run as written against the Hub pushed to, downloads the overlay: pushed to a
    branch, its snapshot_download names that revision (it named none, so it read main, which has no glm-pack/)."""
    hub.seed(REPO, {"config.json": b"{}"})  # main holds the original checkpoint alone
    result = run_cli("push", out, REPO, "--overlay-only", "--revision", revision)
    assert result.exit_code == 0, result.output
    card = hub.files(REPO, revision)["glm-pack/README.md"].decode()
    (call,) = re.findall(r"^path = (snapshot_download\(.*\))$", card, re.MULTILINE)
    download = functools.partial(snapshot_download, endpoint=hub.endpoint, cache_dir=tmp_path / "hf-cache")
    path = Path(eval(call, {"snapshot_download": download}))  # the card's own line
    got = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert got == {"config.json", *published(out, overlay_only=True)}
    assert ("revision=" in call) is (revision != "main")


def test_card_revision_option_names_the_revision_in_the_loading_example(out):
    result = run_cli("card", out, "--repo-id", REPO, "--revision", "refs/pr/3")
    assert result.exit_code == 0, result.output
    assert f'snapshot_download("{REPO}", revision="refs/pr/3")'.encode() in (out / "README.md").read_bytes()


def test_a_token_refreshed_during_the_push_is_the_one_sent(hub, out, monkeypatch):
    """huggingface_hub looks its token up on each request (how it re-exchanges OIDC and refreshes OAuth tokens in a
    run longer than their lifetime), so push pins none: after the first commit the Hub takes only a new token, which
    HF_TOKEN now holds, and the push finishes with it (with the token read at the start it ended in 401)."""

    def rotate(done: int, total: int, nbytes: int) -> None:
        hub.token = "hf_refreshed_token"
        monkeypatch.setenv("HF_TOKEN", hub.token)

    options = push_module.PushOptions(max_commit_bytes=int(SMALL_COMMIT_GIB * 2**30))
    report = push_module.push(out, REPO, options, progress=rotate)
    assert len(report.commit_urls) >= 2 and hub.token == "hf_refreshed_token"
    assert hub.files(REPO) == published(out)


def test_a_failing_token_lookup_is_one_line(hub, out, monkeypatch):
    """huggingface_hub's token lookup can itself fail (HF_OIDC_RESOURCE set and the OIDC exchange refused): one line,
    exit 1, OUT unchanged; it was a traceback."""

    def refused():
        raise RuntimeError("OIDC token exchange failed (403)\nmore detail")

    monkeypatch.setattr(huggingface_hub, "get_token", refused)
    before = published(out)
    for dry_run in (["--dry-run"], []):
        result = CliRunner().invoke(main, ["push", str(out), REPO, *dry_run])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert result.stderr.strip().splitlines() == [
            "glm-pack: error: could not get a Hugging Face token: RuntimeError: OIDC token exchange failed (403)"
        ], result.output
    assert published(out) == before and not hub.requests


@pytest.mark.parametrize("repo_id", ["not a repo id", "a/b/c", "me/-x"])
def test_a_repo_id_the_hub_cannot_hold_is_refused_first(hub, out, repo_id):
    """Refused by huggingface_hub's rule before OUT is verified or its card refreshed, in glm-pack's words (it was
    `push to not a repo id at ... failed: HFValidationError: ...` after the whole verify)."""
    before = published(out)
    for dry_run in (["--dry-run"], []):
        result = CliRunner().invoke(main, ["push", str(out), repo_id, *dry_run])
        assert result.exit_code == 1, result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"glm-pack: error: REPO_ID {repo_id!r} is no Hub repo id (namespace/name or name): ")
        assert "HFValidationError" not in line
    assert published(out) == before and not hub.requests


def test_push_offline_names_the_variable_set(out, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # engine images set it; huggingface_hub goes offline on it too
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = CliRunner().invoke(main, ["push", str(out), REPO])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == ["glm-pack: error: TRANSFORMERS_OFFLINE is set: unset it to push"]


@pytest.mark.parametrize("private_by_default", [True, False], ids=["private-org", "public-org"])
def test_push_without_private_keeps_the_namespace_default_visibility(hub, out, private_by_default):
    """Without --private the repo is created as its namespace creates repos (huggingface_hub sends no visibility
    for private=None, hf_api.create_repo): an organization that makes new repos private keeps this one private."""
    hub.private_by_default = private_by_default
    result = run_cli("push", out, REPO, "--overlay-only")
    assert result.exit_code == 0, result.output
    assert hub.repos[REPO].private is private_by_default


@pytest.mark.parametrize("pattern", ["*.safetensors", "glm-pack/", "manifest.json"])
def test_files_the_repos_gitignore_drops_fail_the_push(hub, out, pattern):
    """huggingface_hub leaves out of a commit every file the Hub's preupload answer marks shouldIgnore (the repo's
    .gitignore matches it: _commit_api._prepare_commit_payload) and still succeeds: a push that reported success
    published an overlay without its layers, or without its manifest. Such a file now fails the push, in one
    line naming it, and the manifest is not committed over missing files."""
    hub.seed(REPO, {".gitignore": f"{pattern}\n".encode()})
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--overlay-only"])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    named = {"*.safetensors": "glm-pack/layer-000.safetensors", "glm-pack/": "glm-pack/layer-000.safetensors"}
    named = named.get(pattern, "glm-pack/manifest.json")  # the layers' commit goes first, the manifest's last
    assert f"the Hub left {named} out of the commit: a .gitignore in {REPO} matches it" in line, line
    assert named in published(out, overlay_only=True) and named not in hub.files(REPO)
    assert "glm-pack/manifest.json" not in hub.files(REPO)  # never published over missing layers


def test_push_into_an_open_pull_request(hub, out):
    """--revision refs/pr/N adds commits to an open pull request (huggingface_hub documents revision="refs/pr/N"
    for that); such a ref cannot be created as a branch (the Hub answers 400), so push does not try to."""
    hub.seed(REPO, {"config.json": b"{}"})
    repo = hub.repos[REPO]
    repo.branches["refs/pr/1"], repo.heads["refs/pr/1"] = dict(repo.branches["main"]), "1" * 40  # the open PR
    for dry_run in (["--dry-run"], []):
        result = run_cli("push", out, REPO, "--overlay-only", "--revision", "refs/pr/1", *dry_run)
        assert result.exit_code == 0, result.output
    assert hub.files(REPO, "refs/pr/1") == {"config.json": b"{}", **published(out, overlay_only=True)}
    assert hub.files(REPO, "main") == {"config.json": b"{}"} and not hub.kinds("branch")
    for dry_run in (["--dry-run"], []):  # a PR that is not open: the plan is refused as the push is
        result = CliRunner().invoke(
            main, ["push", str(out), REPO, "--overlay-only", "--revision", "refs/pr/2", *dry_run]
        )
        assert result.exit_code == 1 and result.stderr.strip().splitlines() == [
            f"glm-pack: error: revision 'refs/pr/2' not found in {REPO} at {hub.endpoint}"
        ], result.output
    for dry_run in (["--dry-run"], []):  # no such repo: no pull request either (the dry run planned a success, and
        # the push created the repo before its commit was refused)
        result = CliRunner().invoke(main, ["push", str(out), "org/none", "--revision", "refs/pr/1", *dry_run])
        assert result.exit_code == 1 and result.stderr.strip().splitlines() == [
            f"glm-pack: error: repository org/none not found at {hub.endpoint}, or the token cannot see it"
        ], result.output
    assert "org/none" not in hub.repos and not hub.kinds("create")


def test_interrupted_push_resumes_and_uploads_only_the_rest(hub, out):
    hub.fail("commit", drop=True, after_files=1)  # the first commit lands, the next one loses its connection
    result = run_cli("push", out, REPO, "--max-commit-gib", SMALL_COMMIT_GIB)
    assert result.exit_code == 1
    assert "interrupted" in result.output and "run the same command again" in result.output
    expected = published(out)  # the card was written before the first upload
    first = hub.files(REPO)
    assert first and set(first) < set(expected)
    assert "glm-pack/manifest.json" not in first  # an unfinished remote overlay has no manifest
    hub.clear_faults()
    hub.reset_requests()
    result = run_cli("push", out, REPO, "--max-commit-gib", SMALL_COMMIT_GIB)
    assert result.exit_code == 0, result.output
    assert hub.files(REPO) == expected
    resumed = [p for c in hub.repos[REPO].commits[1:] for p in c["files"]]
    assert sorted(resumed) == sorted(set(expected) - set(first))
    put = sum(r.body_bytes for r in hub.kinds("lfs_put"))
    assert put <= sum(len(expected[p]) for p in resumed if p.endswith(".safetensors"))


@pytest.mark.parametrize("overlay_only", [True, False], ids=["overlay-only", "full"])
def test_interrupted_push_of_a_changed_out_leaves_no_old_manifest(hub, out, converted_k_none, tmp_path, overlay_only):
    flags = ["--overlay-only"] if overlay_only else []
    assert run_cli("push", out, REPO, *flags).exit_code == 0
    new = tmp_path / "new"
    shutil.copytree(converted_k_none, new, copy_function=os.link)
    layer, manifest = "glm-pack/layer-000.safetensors", "glm-pack/manifest.json"
    local = published(new)
    assert local[layer] != hub.files(REPO)[layer] and local[manifest] != hub.files(REPO)[manifest]
    pushed = len(hub.repos[REPO].commits)
    dry = run_cli("push", new, REPO, *flags, "--dry-run", "--json")
    assert dry.exit_code == 0 and json.loads(dry.stdout)["deletes"] == [manifest], dry.output
    assert "deleted first" in run_cli("push", new, REPO, *flags, "--dry-run").output
    rows = sorted([(manifest, "1"), *numbered(json.loads(dry.stdout)["commits"])])  # deleted first, then uploaded
    assert dry_run_rows(new, *flags) == rows
    hub.fail("commit", drop=True, after_files=hub.committed_files + 1)  # the first commit lands, the next is dropped
    result = run_cli("push", new, REPO, *flags)
    assert result.exit_code == 1 and "interrupted" in result.output, result.output
    remote = hub.files(REPO)
    assert remote[layer] == local[layer]
    assert manifest not in remote  # the old manifest went in the first commit: visibly unfinished
    assert hub.repos[REPO].commits[pushed]["files"] == [manifest, layer]
    hub.clear_faults()
    result = run_cli("push", new, REPO, *flags)
    assert result.exit_code == 0, result.output
    assert hub.files(REPO) == published(new, overlay_only)  # the card was written by the first try


STALE = {"glm-pack/experts-000.safetensors": b"s" * 100, "glm-pack/old/layer-000.safetensors": b"o" * 10}


@pytest.mark.parametrize("overlay_only", [True, False], ids=["overlay-only", "full"])
def test_stale_overlay_files_go_in_the_last_commit(hub, out, overlay_only):
    """Files under the remote glm-pack/ that OUT lacks are deleted with the new manifest; others are kept."""
    flags = ["--overlay-only"] if overlay_only else []
    hub.seed(REPO, {**STALE, "notes.txt": b"the user's own file"})
    dry = run_cli("push", out, REPO, *flags, "--max-commit-gib", SMALL_COMMIT_GIB, "--dry-run", "--json")
    assert dry.exit_code == 0 and json.loads(dry.stdout)["stale"] == sorted(STALE), dry.output
    assert "deleted: stale" in run_cli("push", out, REPO, *flags, "--dry-run").output
    commits = json.loads(dry.stdout)["commits"]
    rows = dry_run_rows(out, *flags, "--max-commit-gib", SMALL_COMMIT_GIB)
    assert rows == sorted(numbered(commits) + [(p, str(len(commits))) for p in STALE])  # stale: the last commit
    assert hub.files(REPO).keys() == {*STALE, "notes.txt"}  # the dry run deleted nothing
    result = run_cli("push", out, REPO, *flags, "--max-commit-gib", SMALL_COMMIT_GIB)
    assert result.exit_code == 0 and "2 stale glm-pack/ files were deleted" in result.output, result.output
    assert hub.files(REPO) == {**published(out, overlay_only), "notes.txt": b"the user's own file"}
    commits = hub.repos[REPO].commits
    assert len(commits) >= 2 and {"glm-pack/manifest.json", *STALE} <= set(commits[-1]["files"])
    assert not any(set(STALE) & set(c["files"]) for c in commits[:-1])  # until then the old overlay stands


THEIRS = b"their new experts, committed while the push ran"


def moved_line(revision: str, planned: str, committed: int, total: int) -> str:
    return (
        f"glm-pack: error: revision {revision!r} of {REPO} changed during the push: another commit landed on it after "
        f"the upload was planned against {planned}; {committed} of {total} files committed so far are kept; run the "
        "same command again: it plans against the new head and uploads the rest"
    )


def test_a_commit_landing_between_the_plan_and_the_first_commit_refuses_the_push(hub, out, monkeypatch):
    """Someone else commits to the revision after the push planned against it, here the earlier overlay's experts
    file (stale for OUT) and the card: the push committed on top without noticing, deleted their new experts file
    as stale, replaced their card and reported success. Its first commit now names the planned head as its parent,
    the Hub refuses it (412), the push ends in one line and nothing of theirs is touched; a re-run re-plans."""
    planned = hub.seed(REPO, {**STALE, "notes.txt": b"the user's own file"})
    card = b"---\nlicense: mit\n---\n# their card\n"
    real = push_module.plan_push

    def plan_then_someone_commits(*args):
        plan = real(*args)
        ops = [CommitOperationAdd("glm-pack/experts-000.safetensors", THEIRS), CommitOperationAdd("README.md", card)]
        HfApi(endpoint=hub.endpoint, token=hub.token).create_commit(REPO, ops, commit_message="theirs")
        return plan

    monkeypatch.setattr(push_module, "plan_push", plan_then_someone_commits)
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--max-commit-gib", str(SMALL_COMMIT_GIB)])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [moved_line("main", planned, 0, len(published(out)))]
    theirs = {**STALE, "notes.txt": b"the user's own file", "glm-pack/experts-000.safetensors": THEIRS}
    assert hub.files(REPO) == {**theirs, "README.md": card}
    assert [c["summary"] for c in hub.repos[REPO].commits] == ["theirs"]
    monkeypatch.setattr(push_module, "plan_push", real)
    result = run_cli("push", out, REPO, "--max-commit-gib", SMALL_COMMIT_GIB)
    assert result.exit_code == 0, result.output  # planned against their commit: their experts file is stale now
    assert hub.files(REPO) == {**published(out), "notes.txt": b"the user's own file"}


def test_a_commit_landing_between_two_commits_of_the_push_refuses_the_next(hub, out, monkeypatch):
    """Someone else commits between two commits of a push: its next commit went on top, and its last one deleted
    their file as stale (planned before it changed) and put the manifest up over it. Each commit now names the
    previous one as its parent: the next is refused, the first one's files stay, no manifest goes up."""
    planned = hub.seed(REPO, STALE)
    real, calls = HfApi.create_commit, []

    def commit(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 2:  # the push's first commit landed
            ops = [CommitOperationAdd("glm-pack/experts-000.safetensors", THEIRS)]
            real(self, REPO, ops, commit_message="theirs")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", commit)
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--max-commit-gib", str(SMALL_COMMIT_GIB)])
    assert result.exit_code == 1, result.output
    first, theirs = hub.repos[REPO].commits  # nothing of the push after their commit
    assert theirs["summary"] == "theirs" and len(calls) == 2
    assert result.stderr.strip().splitlines() == [moved_line("main", planned, len(first["files"]), len(published(out)))]
    local = published(out)
    kept = {**STALE, **{p: local[p] for p in first["files"]}, "glm-pack/experts-000.safetensors": THEIRS}
    assert hub.files(REPO) == kept and "glm-pack/manifest.json" not in kept  # no manifest over their file
    assert run_cli("push", out, REPO).exit_code == 0  # re-planned: their experts file is stale for OUT now
    assert hub.files(REPO) == local


def test_a_commit_landing_with_the_next_commits_files_still_refuses_the_push(hub, out, monkeypatch):
    """Someone else commits the very files of the push's next commit (another push of the same OUT, say) and more:
    huggingface_hub then sends no commit (hf_api.create_commit drops files the revision already holds and returns
    its head when none is left), so parent_commit was never checked and the push went on from their commit, its
    last commit deleting their file as stale. The skipped commit now ends the push in the same line."""
    planned = hub.seed(REPO, STALE)
    real, calls = HfApi.create_commit, []

    def commit(self, repo_id, operations, **kwargs):
        calls.append(operations)
        if len(calls) == 2:  # the push's first commit landed: they commit its second one's files, and more
            same = [CommitOperationAdd(op.path_in_repo, op.path_or_fileobj) for op in operations]
            theirs = CommitOperationAdd("glm-pack/experts-000.safetensors", THEIRS)
            real(self, REPO, [*same, theirs], commit_message="theirs")
        return real(self, repo_id, operations, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", commit)
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--max-commit-gib", str(SMALL_COMMIT_GIB)])
    assert result.exit_code == 1, result.output
    first, theirs = hub.repos[REPO].commits
    assert theirs["summary"] == "theirs" and len(calls) == 2
    assert result.stderr.strip().splitlines() == [moved_line("main", planned, len(first["files"]), len(published(out)))]
    assert hub.files(REPO)["glm-pack/experts-000.safetensors"] == THEIRS
    assert "glm-pack/manifest.json" not in hub.files(REPO)


def test_the_plan_compares_with_the_head_commit_it_names(hub, out, monkeypatch):
    """The plan compares OUT with one commit, the revision's head when the push starts, by sha, and names it
    (``base_commit``): a commit landing while the plan is made (here: the stale files removed) does not mix in."""
    planned = hub.seed(REPO, STALE)
    real = push_module._head

    def head_then_someone_commits(*args):
        sha = real(*args)
        ops = [CommitOperationDelete(p) for p in STALE]
        HfApi(endpoint=hub.endpoint, token=hub.token).create_commit(REPO, ops, commit_message="theirs")
        return sha

    monkeypatch.setattr(push_module, "_head", head_then_someone_commits)
    result = run_cli("push", out, REPO, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["base_commit"] == planned and plan["stale"] == sorted(STALE)
    assert hub.files(REPO) == {}  # their commit landed meanwhile


def test_a_revision_without_a_head_commit_is_one_line():
    api = SimpleNamespace(repo_info=lambda repo_id, revision: SimpleNamespace(sha=None))
    with pytest.raises(HubError, match=f"^the Hub named no head commit for revision 'main' of {REPO}$"):
        push_module._head(api, REPO, "main")


def test_stale_overlay_files_alone_make_one_commit_of_deletions(hub, out):
    assert run_cli("push", out, REPO).exit_code == 0
    with hub.lock:  # an earlier overlay's leftover, beside an OUT that is otherwise up to date
        hub.repos[REPO].branches["main"]["glm-pack/experts-000.safetensors"] = FakeBlob(b"s" * 100, lfs=False)
    before = len(hub.repos[REPO].commits)
    result = run_cli("push", out, REPO)
    assert result.exit_code == 0 and "uploaded 0 files" in result.output, result.output
    assert " and 1 stale glm-pack/ file was deleted in 1 commit to " in result.output, result.output  # not '1 commits'
    assert hub.files(REPO) == published(out)
    assert [c["files"] for c in hub.repos[REPO].commits[before:]] == [["glm-pack/experts-000.safetensors"]]
    hub.reset_requests()
    assert "up to date" in run_cli("push", out, REPO).output and not hub.kinds("commit")


def test_dry_run_lists_and_uploads_nothing(hub, out):
    (out / "notes[draft].md").write_text("a file of OUT whose name rich's markup took for a style tag")
    (out / "notes:cd:.md").write_text("one whose name rich took for an emoji code (listed as 'notes💿.md')")
    result = run_cli("push", out, REPO, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "nothing was uploaded" in result.output
    for path in published(out):
        assert path in result.output
    assert REPO not in hub.repos
    assert not hub.kinds("create") and not hub.kinds("commit") and not hub.kinds("lfs_put")


def test_push_of_a_card_without_a_base_model_says_so(hub, out):
    """The pushed card of a local source names no base model unless --base-model gives one (README): a note says so
    and how to name it, and is gone once it is named (kept by later refreshes)."""
    note = f"note: the card {out / 'README.md'} names no base model: pass --base-model REPO"
    result = run_cli("push", out, REPO, "--dry-run")
    assert result.exit_code == 0 and result.output.splitlines()[0].startswith(note), result.output
    result = run_cli("push", out, REPO, "--dry-run", "--json")  # the note on stderr, stdout the JSON alone
    assert result.exit_code == 0 and result.stderr.startswith(note), result.output  # --json dropped it
    assert json.loads(result.stdout)["dry_run"] is True
    for flags in (["--base-model", "zai-org/GLM-5"], []):
        result = run_cli("push", out, REPO, *flags)
        assert result.exit_code == 0 and "note:" not in result.output, result.output
    assert b"base_model: zai-org/GLM-5" in hub.files(REPO)["README.md"]


def test_dry_run_to_a_new_branch_plans_against_main(hub, out, converted_k_none):
    """A new branch starts at main's head (huggingface_hub's create_branch without revision=): a dry run to it
    compares OUT with main, as the push then does, and lists what the push really uploads and deletes."""
    old = None
    flags = ("--revision", "gfx950", "--json")
    for changed in (False, True):
        if changed:  # another conversion of the same source: its layer file and manifest differ from main's
            shutil.rmtree(out)
            shutil.copytree(converted_k_none, out, copy_function=os.link)
        assert run_cli("card", out, "--repo-id", REPO, "--revision", "gfx950").exit_code == 0  # as the push writes it
        local = published(out)
        if old is None:  # main holds this OUT and an earlier overlay's repacked experts (stale for OUT)
            old = {**local, "glm-pack/experts-000.safetensors": b"an earlier overlay's repacked experts"}
            main_head = hub.seed(REPO, old)
        expected = sorted(p for p in local if local[p] != old.get(p))
        assert bool(expected) is changed
        result = run_cli("push", out, REPO, *flags, "--dry-run")
        assert result.exit_code == 0, result.output
        plan = json.loads(result.stdout)
        assert sorted(u["path"] for u in plan["uploads"]) == expected
        assert sorted(plan["unchanged"]) == sorted(set(local) - set(expected))
        assert plan["stale"] == ["glm-pack/experts-000.safetensors"] and plan["base_commit"] == main_head
        assert "gfx950" not in hub.repos[REPO].branches and not hub.kinds("branch")  # a dry run creates nothing
    pushed = json.loads(run_cli("push", out, REPO, *flags).stdout)
    keys = ("uploads", "commits", "deletes", "stale", "unchanged", "base_commit")
    assert {k: pushed[k] for k in keys} == {k: plan[k] for k in keys}
    assert hub.files(REPO, "gfx950") == published(out) and hub.files(REPO, "main") == old


def test_json_report_of_an_upload(hub, out):
    """--json prints the report alone (no progress lines), with every file and byte committed and each commit."""
    result = run_cli("push", out, REPO, "--json", "--max-commit-gib", SMALL_COMMIT_GIB)
    assert result.exit_code == 0, result.output
    report, expected = json.loads(result.stdout), published(out)
    assert report["uploaded_files"] == len(expected) and report["dry_run"] is False
    assert report["uploaded_bytes"] == sum(len(b) for b in expected.values())
    assert len(report["commit_urls"]) == len(hub.repos[REPO].commits) >= 3
    assert [sorted(c) for c in report["commits"]] == [sorted(c["files"]) for c in hub.repos[REPO].commits]


def test_sizes_are_printed_in_binary_units():
    from glm_pack.convert.humanize import size_text

    sizes = (0, 1023, 1024, 1536, 2**20, 5 * 2**30 + 2**29, 1500 * 2**30)
    assert [size_text(n) for n in sizes] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "1.0 MiB", "5.5 GiB", "1,500.0 GiB"
    ]  # fmt: skip


def test_push_refuses_an_out_verify_rejects(hub, out):
    layer = out / "glm-pack" / "layer-000.safetensors"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0x01
    layer.unlink()
    layer.write_bytes(bytes(data))
    result = run_cli("push", out, REPO)
    assert result.exit_code == 1
    assert "refusing to push" in result.output and "verify" in result.output
    assert not hub.requests


@pytest.mark.parametrize("holder", ["writer", "reader"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_push_refuses_an_out_whose_lock_is_held(hub, out, lock_holder, holder, dry_run):
    """push took no lock: it refreshed the card and uploaded while a convert --overwrite rewrote OUT. A held
    lock now refuses it (the dry run too: it refreshes the card) before the card or the Hub is touched."""
    held = lock_holder(out, shared=holder == "reader")
    card = out / "README.md"  # the source's, which a push would replace by the glm-pack card
    before = card.read_bytes()
    result = run_cli("push", out, REPO, *(["--dry-run"] if dry_run else []))
    errors = [line for line in result.output.splitlines() if line.startswith("glm-pack: error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert f"file {out / '.glm-pack.lock'}" in errors[0]
    if holder == "writer":
        assert f"another glm-pack run (pid {held.pid}) is writing this output" in errors[0]
    else:
        assert "a glm-pack verify is reading this output" in errors[0] and "pid" not in errors[0]
    assert card.read_bytes() == before == SOURCE_README and not (out / "README.source.md").exists()
    assert not hub.requests


@pytest.mark.parametrize("dry_run", [False, True])
def test_push_holds_the_lock_from_the_card_through_the_last_commit(hub, out, converted, monkeypatch, dry_run):
    """A convert --overwrite, a card or a verify started during a push is refused, once the card is refreshed
    and after every commit: the files the manifest describes are the files uploaded."""
    src = converted.parent / "src"
    refusals = []

    def others_refused(*_):
        runs = [
            ["convert", src, out, "--overwrite", "--quiet"],
            ["card", out, "--overlay-only"],
            ["verify", out],
        ]
        results = [CliRunner().invoke(main, [str(a) for a in args]) for args in runs]
        refusals.append([r.exit_code == 1 and "is writing this output" in r.output for r in results])

    real_files = push_module.local_files

    def files(*args):  # listed after the card refresh, before the first commit
        others_refused()
        return real_files(*args)

    monkeypatch.setattr(push_module, "local_files", files)
    options = push_module.PushOptions(dry_run=dry_run, max_commit_bytes=int(SMALL_COMMIT_GIB * 2**30))
    report = push_module.push(out, REPO, options, progress=others_refused)
    assert len(report.commit_urls) == (0 if dry_run else len(report.plan.commits)) and len(report.plan.commits) >= 3
    assert refusals == [[True, True, True]] * (1 + len(report.commit_urls))
    if not dry_run:
        assert hub.files(REPO) == published(out)
    assert run_cli("verify", out).exit_code == 0  # released: OUT is free again


def test_push_of_a_read_only_out_with_an_up_to_date_card_still_works(hub, out, read_only):
    """A push writes nothing but a card that changed: as before the lock, a read-only OUT whose card is
    already current pushes (without the lock: no glm-pack run can write there), one that is not is one line."""
    assert run_cli("push", out, REPO).exit_code == 0
    view = read_only(out)
    result = run_cli("push", view, REPO)
    assert result.exit_code == 0 and "up to date" in result.output, result.output
    result = run_cli("push", view, REPO + "-other")  # its card names the other repo: it must be rewritten
    errors = [line for line in result.output.splitlines() if line.startswith("glm-pack: error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "cannot create" in errors[0], result.output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ERRORS = {
    "no token": (lambda hub, mp: mp.delenv("HF_TOKEN"), "no Hugging Face token"),
    "401": (lambda hub, mp: mp.setenv("HF_TOKEN", "hf_wrong_token_value"), "authentication failed (401)"),
    "403": (
        lambda hub, mp: hub.fail("create", 403, headers={"X-Error-Message": NO_RIGHTS}),
        f"permission denied (403): the token may not write to {REPO} at http://127.0.0.1:",
    ),
    "repo not found": (lambda hub, mp: hub.fail("paths_info", 404, error_code="RepoNotFound"), "not found"),
    "rate limit": (
        lambda hub, mp: hub.fail("commit", 429, after_files=1, headers={"X-Error-Message": COMMIT_RATE}),
        "rate limited (429)",
    ),
    "network refused": (
        lambda hub, mp: mp.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}"),
        "cannot connect to http://127.0.0.1:",
    ),
    "interrupted": (lambda hub, mp: hub.fail("commit", drop=True, after_files=1), "upload interrupted"),
    "commit refused (400)": (  # the Hub's reason, not huggingface_hub's "Bad request for commit endpoint:"
        lambda hub, mp: hub.fail("commit", 400, headers={"X-Error-Message": REJECTED}),
        f"the Hub answered 400 for {REPO} at http://127.0.0.1:",
    ),
}
REJECTED = "Your push was rejected because it contains files larger than 10 MiB"
NO_RIGHTS = 'You don\'t have the rights to create a model under the namespace "tester"'
COMMIT_RATE = "You have exceeded the rate limit for repository commits (128 per hour). You can retry in 43 minutes."
SAID = {"403": NO_RIGHTS, "rate limit": COMMIT_RATE}  # the Hub's reason, after glm-pack's own line


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_give_one_clear_line(hub, out, monkeypatch, case):
    setup, expected = ERRORS[case]
    setup(hub, monkeypatch)
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--max-commit-gib", str(SMALL_COMMIT_GIB)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("glm-pack: error: ") and expected in lines[0], lines[0]
    if "(400)" in case:
        assert lines[0].endswith(f": {REJECTED}"), lines[0]
    if case == "network refused":
        assert lines[0].endswith(": connection refused or unreachable; no commit was made"), lines[0]
    if case in SAID:
        assert lines[0].endswith(f"; the Hub says: {SAID[case]}"), lines[0]
    assert "Traceback" not in result.output
    assert_no_token(hub, result, out)


def test_a_push_without_a_token_leaves_out_as_it_was(hub, out, monkeypatch):
    """The token is looked for before the card is refreshed: a push refused for lack of one changes nothing in OUT
    (it rewrote README.md into the glm-pack card and kept the source card as README.source.md first)."""
    monkeypatch.delenv("HF_TOKEN")
    before = published(out)
    result = CliRunner().invoke(main, ["push", str(out), REPO])
    assert result.exit_code == 1 and "no Hugging Face token" in result.stderr, result.output
    assert published(out) == before
    assert not hub.requests


# glm-pack's CLI in a fresh interpreter, so its real stderr is seen (huggingface_hub's log handler keeps the
# stderr of its import, which CliRunner does not capture); huggingface_hub's waits between retries are skipped.
CLI_NO_RETRY_WAIT = (
    "import sys, time, types, huggingface_hub.utils._http as http;"
    "http.time = types.SimpleNamespace(**{**vars(time), 'sleep': lambda s: None});"
    "from glm_pack.convert.cli import main; main(sys.argv[1:], prog_name='glm-pack')"
)
RETRIED = {
    "preupload 429": (lambda hub: hub.fail("preupload", 429), "preupload", "rate limited (429)"),
    "lfs batch 503": (lambda hub: hub.fail("lfs_batch", 503), "lfs_batch", "the Hub answered 503"),
    "lfs put dropped": (lambda hub: hub.fail("lfs_put", drop=True), "lfs_put", "lost before any file was committed"),
}


@pytest.mark.parametrize("case", list(RETRIED))
def test_retried_requests_still_give_one_error_line(hub, out, tmp_path, case):
    setup, kind, expected = RETRIED[case]
    setup(hub)
    cmd = [sys.executable, "-c", CLI_NO_RETRY_WAIT, "push", str(out), REPO]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert len(hub.kinds(kind)) > 1  # the client did retry
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("glm-pack: error: ") and expected in lines[0], lines[0]
    assert hub.token not in result.stdout + result.stderr


def test_push_restores_the_hub_log_level(hub, out):
    """push mutes huggingface_hub's warnings and progress bars while it runs, then restores both."""
    hub_logger = logging.getLogger("huggingface_hub")
    before = hub_logger.level
    enable_progress_bars()
    assert run_cli("push", out, REPO, "--dry-run").exit_code == 0
    assert hub_logger.level == before and not are_progress_bars_disabled()
    hub.fail("create", 403)
    assert run_cli("push", out, REPO).exit_code == 1
    assert hub_logger.level == before


def _upload(path: str, size: int, reason: str = "new") -> Upload:
    return Upload(LocalFile(path, Path(path), size), reason)


@pytest.mark.parametrize("overlay_only", [False, True], ids=["full", "overlay-only"])
def test_files_in_hidden_folders_are_not_published(out, overlay_only):
    """``hf download --local-dir`` leaves ``.cache/huggingface/``; a hidden folder's files stay local."""
    for folder in (out / ".cache" / "huggingface" / "download", out / "glm-pack" / ".staging"):
        folder.mkdir(parents=True)
        (folder / "model.safetensors.metadata").write_text("x")
    listed = sorted(f.path_in_repo for f in local_files(out, overlay_only))
    assert listed == sorted(published(out, overlay_only)) and not any("/." in p for p in listed)


def test_a_folder_of_out_that_cannot_be_listed_is_refused(hub, out, refuse):
    """A folder of OUT that cannot be listed (a permission, an I/O error): one line naming it, exit 1, nothing
    committed; the walk skipped it, so its files were silently left out of the push, which reported success."""
    (out / "original").mkdir()
    (out / "original" / "notes.md").write_text("kept with the checkpoint")
    refuse(os, "scandir", out / "original")
    r = CliRunner().invoke(main, ["push", str(out), REPO])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert f"cannot list this folder of the output: Permission denied (file {out / 'original'})" in r.output, r.output
    assert not hub.kinds("commit")


@pytest.mark.parametrize("committed", [0, 1])
def test_a_connection_lost_says_whether_anything_was_committed(committed):
    """A connection lost or timed out before the first commit changed nothing on the Hub, and is not worded as an
    interrupted upload of "0 of 0 files" (a dry run said that); after one, what is kept and to rerun."""
    uploads = [_upload(f"f{i}", 1) for i in range(3)]
    report = PushReport(PushPlan(REPO, "main", uploads=uploads), False, "http://hub.test", uploaded_files=committed)
    for err, why in (
        (ConnectionResetError(104, "reset"), "connection to http://hub.test lost"),
        (TimeoutError("read"), "timed out talking to http://hub.test"),
    ):
        line = str(hub_error(err, REPO, "http://hub.test", "main", report))
        assert line == (
            f"{why} before any file was committed (no commit was made); run the same command again"
            if committed == 0
            else f"upload interrupted ({why}) after 1 of 3 files were committed; run the same command again to "
            "upload the rest"
        )


@pytest.mark.parametrize("endpoint", ["notaurl", "ftp://hub.test", "http://", "https://hub.test:99999", "http://h:x"])
@pytest.mark.parametrize("given", ["--endpoint", "HF_ENDPOINT"])
def test_an_endpoint_that_is_no_url_is_refused_by_name(hub, out, tmp_path, monkeypatch, endpoint, given):
    """An endpoint that is no http(s) URL with a host is refused naming the option or variable and the value, before
    any request, by push and by a Hub source (the client's error said "upload interrupted (connection to notaurl
    lost) after 0 of 0 files")."""
    args = ["--endpoint", endpoint] if given == "--endpoint" else []
    if given == "HF_ENDPOINT":
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
    commands = [["push", str(out), REPO, "--dry-run", *args]]
    if given == "HF_ENDPOINT":
        commands.append(["convert", REPO, str(tmp_path / "new")])
    for command in commands:
        r = CliRunner().invoke(main, command)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert r.stderr == (
            f"glm-pack: error: {given} must be an http(s) URL such as https://huggingface.co, got {endpoint!r}\n"
        )
    assert hub.requests == [] and not (tmp_path / "new").exists()


@pytest.mark.parametrize("committed", [0, 1])
def test_refused_connection_after_a_commit_says_what_is_kept(committed):
    """Refused before any commit: the Hub is unreachable; after one: the push was interrupted, rerun it."""
    uploads = [_upload(f"f{i}", 1) for i in range(3)]
    report = PushReport(PushPlan(REPO, "main", uploads=uploads), False, "http://hub.test", uploaded_files=committed)
    err = hub_error(ConnectionRefusedError(111, "Connection refused"), REPO, "http://hub.test", "main", report)
    assert str(err) == (
        "cannot connect to http://hub.test: connection refused or unreachable; no commit was made"
        if committed == 0
        else "upload interrupted (connection to http://hub.test lost) after 1 of 3 files were committed; "
        "run the same command again to upload the rest"
    )


def test_group_commits_bounds_and_order():
    uploads = [
        _upload("README.md", 10),
        _upload("a.safetensors", 40),
        _upload("b.safetensors", 40),
        _upload("c.safetensors", 150),
        _upload("d.safetensors", 10),
        _upload("glm-pack/manifest.json", 5),
        _upload("glm-pack/layer-000.safetensors", 30),
    ]
    commits = [[u.file.path_in_repo for u in c] for c in group_commits(uploads, max_bytes=100, max_files=2)]
    assert commits == [
        ["a.safetensors", "b.safetensors"],
        ["c.safetensors"],  # larger than the bound: alone
        ["d.safetensors", "glm-pack/layer-000.safetensors"],
        ["README.md", "glm-pack/manifest.json"],
    ]
    names = [f"glm-pack/layer-{i:03d}.safetensors" for i in range(5)]
    small = group_commits([_upload(n, 1) for n in names], max_bytes=100, max_files=2)
    assert [[u.file.path_in_repo for u in c] for c in small] == [names[:2], names[2:4], names[4:]]  # files bound
    cards = [_upload(n, 1) for n in ("README.source.md", "glm-pack/README.md", "README.md")]
    ends = group_commits([*cards, _upload("z.safetensors", 1)], max_bytes=100, max_files=8)
    assert [[u.file.path_in_repo for u in c] for c in ends] == [["z.safetensors"], [u.file.path_in_repo for u in cards]]


@pytest.mark.parametrize(
    "manifest, others, deleted",
    [
        ("changed", ["glm-pack/layer-000.safetensors"], True),  # new files go up before the new manifest
        ("changed", ["README.md"], False),  # one commit: the manifest is replaced in place
        ("new", ["glm-pack/layer-000.safetensors"], False),  # no remote manifest to delete
    ],
)
def test_stale_manifest_is_deleted_only_before_other_commits(manifest, others, deleted):
    uploads = [_upload("glm-pack/manifest.json", 5, manifest)] + [_upload(p, 10, "changed") for p in others]
    plan = PushPlan(REPO, "main", uploads=uploads, commits=group_commits(uploads, max_bytes=100, max_files=8))
    assert stale_manifest(plan) == (["glm-pack/manifest.json"] if deleted else [])


def test_fake_hub_serves_byte_ranges(hub, out):
    """The loopback Hub answers Range reads like the Hub's resolve endpoint (for later byte-range readers)."""
    from urllib.request import Request, urlopen

    assert run_cli("push", out, REPO, "--overlay-only").exit_code == 0
    data = (out / "glm-pack" / "layer-000.safetensors").read_bytes()
    url = f"{hub.endpoint}/{REPO}/resolve/main/glm-pack/layer-000.safetensors"
    auth = {"Authorization": f"Bearer {hub.token}"}
    for rng, want in (("bytes=0-7", data[:8]), ("bytes=100-", data[100:]), ("bytes=-16", data[-16:])):
        with urlopen(Request(url, headers={**auth, "Range": rng})) as resp:
            assert resp.status == 206 and resp.read() == want
            first = len(data) - len(want) if rng.startswith("bytes=-") else int(rng[6:].split("-")[0])
            assert resp.headers["Content-Range"] == f"bytes {first}-{first + len(want) - 1}/{len(data)}"
    with urlopen(Request(url, headers=auth)) as resp:
        assert resp.status == 200 and resp.read() == data


@pytest.mark.parametrize("gib, want", [("0.5", 2**29), ("2", 2**31), ("1e-12", 1)])
def test_commit_bound_is_in_binary_gigabytes(out, monkeypatch, gib, want):
    """--max-commit-gib counts GiB (2**30 bytes), as its help says; the smallest bound is one byte."""
    from glm_pack.convert import push_commands

    given = []

    def push(out, repo_id, options, progress=None):
        given.append(options.max_commit_bytes)
        raise HubError("stop here")

    monkeypatch.setattr(push_commands, "push", push)
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--dry-run", "--max-commit-gib", gib])
    assert result.exit_code == 1 and given == [want], result.output


@pytest.mark.parametrize("bound", ["nan", "inf", "0", "-1"])
def test_commit_bound_must_be_finite_and_positive(hub, out, bound):
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--dry-run", "--max-commit-gib", bound])
    assert result.exit_code == 2 and "must be a finite number > 0" in result.output, result.output
    assert "Traceback" not in result.output and hub.requests == []  # refused before any call


@pytest.mark.parametrize(
    "stop, code, why", [("ctrl-c", 130, "interrupted by the user"), ("sigterm", 143, "terminated by SIGTERM")]
)
def test_a_stop_during_the_upload_is_its_one_line_and_exit_code(hub, out, monkeypatch, stop, code, why):
    """README: Ctrl-C ends every command with one line and exit code 130, SIGTERM (a real one, to this process) with
    143. push turned a Ctrl-C between commits into a HubError, which exited 1 like a failure."""
    real, calls = HfApi.create_commit, []

    def commit(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 2:  # the first commit landed
            if stop == "ctrl-c":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler raises in this thread before the sleep ends
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", commit)
    result = CliRunner().invoke(main, ["push", str(out), REPO, "--max-commit-gib", str(SMALL_COMMIT_GIB)])
    assert result.exit_code == code, result.output
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert f"upload interrupted ({why}) after " in result.stderr
    assert "run the same command again to upload the rest" in result.stderr
