"""Hub sources (``SRC = org/name[@revision]``) end to end: the real huggingface_hub client against FakeHub.

The synthetic GLM-5 checkpoint is served by the loopback fake Hub; every request is recorded with its Range
header, so the tests check which bytes were read: the shard headers, the tensors the overlay needs, and
nothing else. Expected byte counts come from the local files (header length prefixes, tensor offsets).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import socket
import struct
import types
from pathlib import Path

import pytest
from click.testing import CliRunner
from fake_hub import FakeHub
from huggingface_hub import constants
from huggingface_hub.utils import _http

from glm_pack.convert import hub_source, space
from glm_pack.convert.checkpoint import open_checkpoint
from glm_pack.convert.cli import main
from glm_pack.convert.convert import ConvertOptions, convert
from glm_pack.convert.hub_common import exception_chain, first_line, is_kind, resolve_endpoint
from glm_pack.convert.hub_source import parse_repo_spec
from glm_pack.convert.verify import verify
from glm_pack.packing.errors import GlmPackError, HubError, PlanError

REPO = "org/glm-5-small"
RANGE_CHECK = "bytes=0-0"  # the Range of the request checking that the endpoint serves ranges


@pytest.fixture(name="src")
def src_fixture(synth_ckpt) -> Path:
    return synth_ckpt("glm-5", "bf16")  # 3 MLA layers (one MTP), 3 shards


@pytest.fixture(name="hub")
def hub_fixture(monkeypatch, tmp_path, src):
    """FakeHub serving ``src`` as REPO; a private HF cache; retries without sleeping."""
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    set_offline(monkeypatch, False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login-cache" / "token"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda s: None, time=_http.time.time))
    with FakeHub(lfs_threshold=64 * 1024) as server:
        monkeypatch.setenv("HF_TOKEN", server.token)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        server.sha = server.seed(REPO, {p.name: p.read_bytes() for p in src.iterdir()})
        yield server


def set_offline(monkeypatch, offline: bool) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def run_cli(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def header_end(path: Path) -> int:
    """8 + N: where a safetensors file's data buffer starts (read by hand, not by the code under test)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def shard_reads(hub: FakeHub) -> list[tuple[str, str | None]]:
    """(file, Range header) of every GET of a safetensors file."""
    return [
        (r.path.rsplit("/", 1)[1], r.range)
        for r in hub.kinds("resolve")
        if r.method == "GET" and r.path.endswith(".safetensors")
    ]


def parse_range(header: str) -> tuple[int, int]:
    first, last = header.removeprefix("bytes=").split("-")
    return int(first), int(last) + 1


def small_files(src: Path) -> int:
    return (src / "config.json").stat().st_size + (src / "model.safetensors.index.json").stat().st_size


def overlay_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "glm-pack").glob("*.safetensors"))}


def test_repo_spec_parsing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse_repo_spec("zai-org/GLM-5") == ("zai-org/GLM-5", None)
    assert parse_repo_spec("zai-org/GLM-5@refs/pr/3") == ("zai-org/GLM-5", "refs/pr/3")
    assert parse_repo_spec("hf://org/m@main") == ("org/m", "main")
    (tmp_path / "org" / "m").mkdir(parents=True)
    assert parse_repo_spec("org/m") is None  # a local directory of that name wins
    assert parse_repo_spec("hf://org/m") == ("org/m", None)
    for local in ("./a/b", "/abs/path", "a/b/c", "one", "../x/y", "org/m@"):
        assert parse_repo_spec(local) is None, local


def test_endpoint_resolution(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert resolve_endpoint(None) == "https://huggingface.co"
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.local:8080/")
    assert resolve_endpoint(None) == "http://mirror.local:8080"  # read now; no trailing slash to double up
    assert resolve_endpoint("https://hub.example//") == "https://hub.example"  # --endpoint wins


def test_error_chain_and_line_helpers():
    """exception_chain follows causes, else contexts, each error once (a cycle ends); is_kind matches a base
    class's name; first_line skips blank lines and takes the last line when asked past it."""
    inner, outer = OSError("inner"), ValueError("outer")
    outer.__context__ = inner
    inner.__cause__ = outer  # a cycle
    assert list(itertools.islice(exception_chain(outer), 5)) == [outer, inner]
    assert is_kind(ConnectionRefusedError(), "ConnectionError") and not is_kind(ValueError(), "ConnectionError")
    err = RuntimeError("\n  Bad request: \n\n  the card's license is not valid  \n")
    assert first_line(err) == "Bad request:" and first_line(err, skip=1) == "the card's license is not valid"
    assert first_line(RuntimeError("only line"), skip=1) == "only line"
    assert first_line(RuntimeError(" \n")) == "RuntimeError"


def test_inspect_reads_headers_only(hub, src):
    result = run_cli("inspect", REPO, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    local = json.loads(run_cli("inspect", src, "--json", "--files", "none").stdout)
    assert report["source"] == f"hf://{REPO}@{hub.sha}" and report["plan"]["files_mode"] == "none"
    for key in set(local) - {"source", "hub"}:
        assert report[key] == local[key], key
    reads = shard_reads(hub)
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted({f for f, _ in reads}) == shards
    for file, rng in reads:  # every read is a range inside the header: never tensor data, never a whole shard
        assert rng is not None
        assert parse_range(rng)[1] <= header_end(src / file)
    expected = sum(header_end(src / f) for f in shards) + small_files(src)
    assert report["hub"] == {"repo_id": REPO, "revision": hub.sha, "bytes_transferred": expected}
    again = json.loads(run_cli("inspect", REPO, "--json").stdout)["hub"]  # config and index now in the HF cache
    assert again["bytes_transferred"] == sum(header_end(src / f) for f in shards)


def test_convert_reads_only_needed_tensors_and_matches_local(hub, src, tmp_path):
    out_local, out_hub = tmp_path / "local", tmp_path / "hub"
    convert(src, out_local, ConvertOptions(files="none", workers=1))
    report = convert(REPO, out_hub, ConvertOptions(workers=2))  # default files for a Hub source: none
    assert overlay_bytes(out_hub) == overlay_bytes(out_local) and len(overlay_bytes(out_hub)) == 3
    assert sorted(p.name for p in out_hub.iterdir()) == [".glm-pack.lock", "glm-pack"]  # no originals
    manifest = json.loads((out_hub / "glm-pack" / "manifest.json").read_text())
    local = json.loads((out_local / "glm-pack" / "manifest.json").read_text())
    source = manifest["source"]
    assert (source["kind"], source["repo_id"], source["revision"], source["path"]) == ("hub", REPO, hub.sha, None)
    for key in ("config_sha256", "index_sha256", "files", "tensors"):
        assert source[key] == local["source"][key], key
    assert manifest["tensors"] == local["tensors"] and manifest["options"]["files"] == "none"

    ckpt = open_checkpoint(src)
    needed = {}
    for name in source["tensors"]:  # the kv_b_proj weights: exactly these tensors' bytes may be fetched
        info = ckpt.info(name)
        needed[(info.file, info.begin, info.end)] = info.nbytes
    tensor_reads = []
    for file, rng in shard_reads(hub):
        assert rng is not None, f"whole-file GET of {file}"
        begin, end = parse_range(rng)
        if end > header_end(src / file):
            tensor_reads.append((file, begin, end))
    assert sorted(tensor_reads) == sorted(needed)
    headers = sum(header_end(p) for p in src.glob("*.safetensors"))
    assert report.hub_bytes == headers + small_files(src) + sum(needed.values())

    hub.reset_requests()
    checked = verify(out_hub)  # the source is re-read through the Hub at the recorded commit
    assert checked.ok, checked.problems
    assert any("re-derived" in line for line in checked.checked)
    assert all(hub.sha in r.path for r in hub.requests if r.kind)  # pinned to the recorded commit
    rereads = [(f, *parse_range(rng)) for f, rng in shard_reads(hub) if parse_range(rng)[1] > header_end(src / f)]
    assert sorted(rereads) == sorted(needed)  # hashed, then re-derived: each tensor fetched once (recent ranges)


def test_convert_from_the_hub_says_how_much_it_read(hub, src, tmp_path):
    """The summary of a Hub conversion ends with the bytes read from the Hub: at least the kv_b_proj tensors."""
    result = run_cli("convert", REPO, tmp_path / "out", "--workers", "1")
    assert result.exit_code == 0, result.output
    ckpt = open_checkpoint(src)
    kv_b = sum(ckpt.info(ckpt.card.kv_b_proj(i)).nbytes for i in ckpt.mla_layers())
    line = result.stdout.splitlines()[-1]
    m = re.fullmatch(r"read ([\d,]+) bytes \(([\d.]+) MiB\) from the Hub", line)
    assert m and int(m[1].replace(",", "")) >= kv_b and m[2] == f"{int(m[1].replace(',', '')) / 2**20:.1f}", line


def test_files_copy_counts_the_downloads_until_they_are_cached(hub, src, tmp_path, monkeypatch):
    """--files copy from the Hub downloads the originals into the HF cache, then hard-links them into OUT: the space
    check counts the downloads (the cache is on OUT's filesystem here, so no copies into OUT), none once cached."""
    originals = sum(p.stat().st_size for p in src.iterdir())
    monkeypatch.setattr(space, "free_bytes", lambda folder: originals)  # room for the downloads, not the overlay too
    with pytest.raises(GlmPackError, match="downloads into the Hugging Face cache") as err:
        convert(REPO, tmp_path / "first", ConvertOptions(files="copy", workers=1))
    assert "copies of the original files" not in str(err.value)
    assert [f for f, rng in shard_reads(hub) if rng is None] == []  # refused before any download
    monkeypatch.setattr(space, "free_bytes", lambda folder: 1 << 60)
    convert(REPO, tmp_path / "first", ConvertOptions(files="copy", workers=1))
    monkeypatch.setattr(space, "free_bytes", lambda folder: originals)
    convert(REPO, tmp_path / "second", ConvertOptions(files="copy", workers=1))  # the overlay alone is written
    assert verify(tmp_path / "second").ok


def test_files_copy_downloads_originals_then_offline_works_from_cache(hub, src, tmp_path, monkeypatch):
    out = tmp_path / "copy"
    report = convert(f"{REPO}@main", out, ConvertOptions(files="copy", workers=1))
    for path in src.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    whole = sorted(f for f, rng in shard_reads(hub) if rng is None)
    assert whole == shards  # each downloaded whole once; tensors then read from the local copies
    assert all(parse_range(rng)[1] <= header_end(src / f) for f, rng in shard_reads(hub) if rng)  # headers
    headers = sum(header_end(src / f) for f in shards)
    assert report.hub_bytes == headers + sum(p.stat().st_size for p in src.iterdir())
    manifest = json.loads((out / "glm-pack" / "manifest.json").read_text())
    assert manifest["source"]["revision"] == hub.sha and manifest["options"]["files"] == "copy"
    assert verify(out).ok

    set_offline(monkeypatch, True)
    hub.reset_requests()
    result = run_cli("inspect", REPO, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["hub"] == {"repo_id": REPO, "revision": hub.sha, "bytes_transferred": 0}
    result = run_cli("convert", REPO, tmp_path / "offline", "--quiet", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert overlay_bytes(tmp_path / "offline") == overlay_bytes(out)
    assert [r for r in hub.requests if r.kind] == []  # nothing reached the Hub


def test_files_copy_refused_offline(hub, src, tmp_path, monkeypatch):
    """Offline the HF cache knows the downloaded files, not the repo's listing: a copy could miss some."""
    from huggingface_hub import hf_hub_download

    files = {p.name: p.read_bytes() for p in src.iterdir()}
    hub.seed("org/with-tokenizer", {**files, "tokenizer.json": b'{"version": "1.0"}'})
    for name in files:  # config, index and every shard cached; the tokenizer never downloaded
        hf_hub_download("org/with-tokenizer", name, endpoint=hub.endpoint)
    set_offline(monkeypatch, True)
    hub.reset_requests()
    for command in (["convert", "org/with-tokenizer", tmp_path / "out"], ["inspect", "org/with-tokenizer"]):
        result = run_cli(*command, "--files", "copy")
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("glm-pack: error: --files copy"), lines
        assert "org/with-tokenizer" in lines[0] and "HF_HUB_OFFLINE" in lines[0] and "--files none" in lines[0]
    assert not (tmp_path / "out").exists()
    assert [r for r in hub.requests if r.kind] == []


def test_offline_a_folder_of_the_cached_snapshot_that_cannot_be_listed_is_refused(hub, src, monkeypatch, refuse):
    """Offline the file list comes from the cached snapshot: a folder of it that cannot be listed (a permission, an
    I/O error) is one line naming it; the walk skipped it, so its files were silently missing from that list."""
    from huggingface_hub import hf_hub_download

    for path in src.iterdir():
        hf_hub_download(REPO, path.name, endpoint=hub.endpoint)
    snapshot = Path(hf_hub_download(REPO, "config.json", endpoint=hub.endpoint)).parent
    (snapshot / "extra").mkdir()
    (snapshot / "extra" / "notes.md").write_text("downloaded too")
    set_offline(monkeypatch, True)
    refuse(os, "scandir", snapshot / "extra")
    result = run_cli("inspect", REPO)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    (line,) = result.stderr.strip().splitlines()
    assert f"cannot list this folder of the cached snapshot of {REPO}: Permission denied" in line, line
    assert f"(file {snapshot / 'extra'})" in line, line


def test_out_in_the_hf_cache_of_the_source_is_refused(hub, src, tmp_path):
    """--files copy caches the repo's files (blobs/ behind snapshots/); an OUT there, or around the cache, would have
    --overwrite delete them, and a later run or engine reading the cache would find them gone."""
    convert(REPO, tmp_path / "first", ConvertOptions(files="copy", workers=1))
    repo_cache = Path(constants.HF_HUB_CACHE) / "models--org--glm-5-small"
    cached = {p: p.read_bytes() for p in (repo_cache / "blobs").iterdir()}
    assert len(cached) == len(list(src.iterdir()))
    for out in (repo_cache / "blobs", repo_cache, Path(constants.HF_HUB_CACHE), repo_cache / "snapshots" / "new"):
        result = run_cli("convert", REPO, out, "--overwrite", "--files", "copy", "--workers", "1")
        assert result.exit_code == 1, (out, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"output {out} must be outside the Hugging Face cache of {REPO}" in lines[0], lines
    assert {p: p.read_bytes() for p in (repo_cache / "blobs").iterdir()} == cached
    assert not list(Path(constants.HF_HUB_CACHE).rglob("manifest.json"))


def test_link_refused_for_hub_source_before_any_request(hub, tmp_path):
    """A Hub repo has no local files to link: refused from the arguments alone, so without a reachable Hub too."""
    hub.reset_requests()
    for command in (["convert", REPO, tmp_path / "out"], ["inspect", REPO], ["convert", f"hf://{REPO}@main", "x"]):
        result = run_cli(*command, "--files", "link")
        assert result.exit_code == 1, result.output
        how = "taken for a Hub repo (and no local directory of that name)"
        if command[1].startswith("hf://"):  # hf:// forces the Hub: no local folder was looked for
            how = "a Hub repo"
        assert result.stderr.strip().splitlines() == [
            f"glm-pack: error: --files link needs a local source: {command[1]} is {how}, which has no local files to "
            "link; use --files copy (downloads the originals into the Hugging Face cache and links them into OUT) or "
            "--files none (overlay only)"
        ]
    with pytest.raises(PlanError):
        convert(REPO, tmp_path / "api", ConvertOptions(files="link"))
    assert hub.requests == []
    assert not (tmp_path / "out").exists() and not (tmp_path / "api").exists()


def test_recent_ranges_evict_the_least_recently_used(hub, src, monkeypatch):
    """Re-reads of kept ranges cost nothing; past RECENT_BYTES the range used longest ago goes first."""
    monkeypatch.setattr(hub_source, "RECENT_BYTES", 100)
    store = hub_source.HubStore(REPO)
    shard = store.safetensors_files()[0]
    f = store.open(shard)
    assert isinstance(f, hub_source.RangeFile)  # not in the HF cache: read by ranges
    data = (src / shard).read_bytes()

    def fetched(offset):  # bytes fetched from the Hub by one read of 40 bytes at offset
        before = store.transferred
        assert bytes(f.read(offset, 40)) == data[offset : offset + 40]
        return store.transferred - before

    assert [fetched(0), fetched(40), fetched(0)] == [40, 40, 0]  # A, B, A again: kept (and now newest)
    assert fetched(80) == 40  # C: 120 bytes > 100, B (least recently used) goes
    assert [fetched(0), fetched(80), fetched(40)] == [0, 0, 40]


def test_reads_stay_on_the_resolved_commit_when_the_branch_moves(hub, src):
    """A store reads the commit main named when it was opened, by byte ranges and whole files alike: a push to main
    meanwhile (a shard and the index changed) is not mixed into the conversion."""
    from huggingface_hub import CommitOperationAdd, HfApi

    store = hub_source.HubStore(REPO)
    shard, index = store.safetensors_files()[0], "model.safetensors.index.json"
    f = store.open(shard)
    assert isinstance(f, hub_source.RangeFile)
    old_shard, old_index = (src / shard).read_bytes(), (src / index).read_text()
    changed = [CommitOperationAdd(shard, bytes(len(old_shard))), CommitOperationAdd(index, (old_index + " ").encode())]
    HfApi(endpoint=hub.endpoint, token=hub.token).create_commit(REPO, changed, commit_message="later")
    assert hub.repos[REPO].heads["main"] != store.sha
    assert bytes(f.read(0, 64)) == old_shard[:64]
    assert store.read_text(index) == old_index


def test_revision_that_moves_while_being_resolved_is_refused(hub, monkeypatch):
    """main is resolved to a commit, then moves before config.json is fetched by name: refused, not mixed."""
    resolve = hub_source.HubStore._from_hub
    moved = "f" * 40

    def resolve_then_move(store):
        found = resolve(store)
        hub.repos[REPO].heads["main"] = moved  # a push lands between the two requests
        return found

    monkeypatch.setattr(hub_source.HubStore, "_from_hub", resolve_then_move)
    with pytest.raises(HubError, match=f"revision 'main' of {REPO} moved from {hub.sha} to {moved} while being read"):
        hub_source.HubStore(REPO)


@pytest.mark.parametrize("status, code, expected", [(403, "GatedRepo", "is gated"), (503, None, "answered 503")])
def test_files_refused_with_an_older_commit_cached_name_the_refusal(hub, tmp_path, status, code, expected):
    """huggingface_hub answers a request for config.json by branch name from an older cached snapshot when the Hub
    refuses the file (file_download._hf_hub_download_to_cache_dir: any HEAD error but a missing revision or
    entry); the store read that as the branch having moved and said "run again", every time. It now reports
    the Hub's refusal."""
    from huggingface_hub import CommitOperationAdd, HfApi

    assert run_cli("inspect", REPO).exit_code == 0  # caches config.json of this commit, refs/main -> it
    HfApi(endpoint=hub.endpoint, token=hub.token).create_commit(
        REPO, [CommitOperationAdd("notes.md", b"a later commit")], commit_message="later"
    )
    hub.fail("resolve", status, error_code=code)  # model_info still answers (repo metadata stays public)
    result = run_cli("inspect", REPO)
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert expected in line and "moved" not in line, line


def test_range_read_of_a_repo_gone_since_it_was_resolved_names_the_repo(hub):
    """HfFileSystem turns a repo it cannot find into FileNotFoundError (hf_file_system._raise_file_not_found,
    raised from the RepositoryNotFoundError): the line said "no such file" of a file the commit has."""
    store = hub_source.HubStore(REPO)
    f = store.open(store.safetensors_files()[0])
    hub.repos.pop(REPO)  # deleted, or made private, after the commit was resolved
    with pytest.raises(HubError, match=f"repository {REPO} not found at {hub.endpoint}"):
        f.read(0, 8)


def test_short_or_long_range_read_is_refused(hub, monkeypatch):
    """A range answered with fewer or more bytes than asked is an error, never wrong data."""
    store = hub_source.HubStore(REPO)
    f = store.open(store.safetensors_files()[0])
    monkeypatch.setattr(store, "filesystem", lambda: types.SimpleNamespace(open=lambda *a, **k: io.BytesIO(bytes(50))))
    assert len(f.read(0, 50)) == 50
    with pytest.raises(HubError, match="short read from the Hub: wanted 40 bytes at offset 30, got 20"):
        f.read(30, 40)

    class WholeFile(io.BytesIO):  # a server ignoring the range: every read returns the whole file
        def read(self, size=-1):
            return self.getvalue()

    monkeypatch.setattr(store, "filesystem", lambda: types.SimpleNamespace(open=lambda *a, **k: WholeFile(bytes(50))))
    with pytest.raises(HubError, match="long read from the Hub: wanted 8 bytes at offset 0, got 50"):
        f.read(0, 8)


def test_endpoint_that_ignores_ranges_is_refused_before_any_shard_is_downloaded(hub):
    """Some mirrors answer a Range request with 200 and the whole file: each header or tensor read downloaded a
    whole shard into memory, then failed saying 'short read ... wanted 8 bytes, got 49832400'."""
    hub.serves_ranges = False
    hub.reset_requests()
    result = run_cli("inspect", REPO)
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert f"{hub.endpoint} answered a byte-range request with status 200" in line, line
    assert f"hf download {REPO} --revision" in line and "model-00001-of-00003.safetensors" in line, line
    shard_reads = [r for r in hub.requests if r.path.endswith(".safetensors")]
    assert [r.range for r in shard_reads] == [RANGE_CHECK], shard_reads  # the check's request only
    hub.serves_ranges = True
    hub.reset_requests()
    assert run_cli("inspect", REPO).exit_code == 0
    assert [r.range for r in hub.requests].count(RANGE_CHECK) == 1  # once per run, not per file or read


def test_store_lists_files_without_hidden_or_overlay(hub, src):
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    extra = {".gitattributes": b"a", "sub/.hidden": b"bb", "sub/x.safetensors": b"ccc", "glm-pack/manifest.json": b"{}"}
    hub.seed("org/extra", {**files, **extra})
    store = hub_source.HubStore("org/extra")
    expected = [(name, len(body)) for name, body in files.items()] + [("sub/x.safetensors", 3)]
    assert store.list_files() == sorted(expected)
    assert store.safetensors_files() == sorted(p.name for p in src.glob("*.safetensors"))  # top level only


def test_transient_drop_mid_read_is_retried(hub, src, tmp_path):
    convert(src, tmp_path / "local", ConvertOptions(files="none", workers=1))
    assert run_cli("inspect", REPO).exit_code == 0  # config and index now cached: the next resolves are ranges
    hub.reset_requests()
    hub.fail("resolve", cut=True, times=4)  # the revision check (HEAD), the range check, then two range reads
    convert(REPO, tmp_path / "hub", ConvertOptions(workers=1))
    assert overlay_bytes(tmp_path / "hub") == overlay_bytes(tmp_path / "local")
    cut = [(r.path, r.range) for r in hub.requests if r.status == -2 and r.method == "GET" and r.range != RANGE_CHECK]
    assert len(cut) == 2 and len(set(cut)) == 1 and cut[0][1] is not None  # one range read, retried twice


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "case, expected",
    [
        ("bad-token", "authentication failed (401)"),
        ("no-repo", "repository org/nope not found"),
        ("no-repo-forced", "repository org/nope not found at http://127.0.0.1:"),
        ("refused-forced", "cannot connect to http://127.0.0.1:"),
        ("no-revision", "revision 'nope' not found in org/glm-5-small"),
        ("gated", "org/glm-5-small is gated"),
        ("rate-limited", "rate limited (429) by http://127.0.0.1:"),
        ("unavailable", f"the Hub answered 503 for {REPO} at http://127.0.0.1:"),
        ("refused", "cannot connect to http://127.0.0.1:"),
        ("cut", "connection to http://127.0.0.1:"),
        ("range-denied", f"permission denied (403) reading {REPO} at http://127.0.0.1:"),  # from the range check
        ("offline-empty-cache", "HF_HUB_OFFLINE is set and the local Hugging Face cache has no org/glm-5-small"),
        ("offline-shards-not-cached", "not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
        ("offline-by-transformers", "TRANSFORMERS_OFFLINE is set and the local Hugging Face cache has no org/glm"),
    ],
)
def test_failures_give_one_clear_line(hub, tmp_path, monkeypatch, case, expected):
    src, command = REPO, "inspect"
    if case == "bad-token":
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    elif case == "no-repo":
        src = "org/nope"
    elif case == "no-repo-forced":  # a local folder of that name exists, and hf:// names the Hub all the same
        (tmp_path / "org" / "nope").mkdir(parents=True)
        monkeypatch.chdir(tmp_path)
        src = "hf://org/nope"
    elif case == "refused-forced":
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
        src = f"hf://{REPO}"
    elif case == "no-revision":
        src = f"{REPO}@nope"
    elif case == "gated":
        hub.fail("repo_info", 403, error_code="GatedRepo")
    elif case == "rate-limited":  # the Hub's reason (when to retry) ends the line
        hub.fail("repo_info", 429, headers={"X-Error-Message": "Too many requests: retry in 5 minutes"})
    elif case == "unavailable":  # the line ends with the Hub's reason (X-Error-Message), not the client's text
        hub.fail("repo_info", 503, headers={"X-Error-Message": "Hub under maintenance, back at 18:00 UTC"})
    elif case == "refused":
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    elif case == "cut":  # config and index cached by a first run; then every range read is cut short
        assert run_cli("inspect", REPO).exit_code == 0
        hub.fail("resolve", cut=True)
    elif case == "range-denied":  # config and index cached by a first run; then the shards are refused
        assert run_cli("inspect", REPO).exit_code == 0
        hub.fail("resolve", 403, headers={"X-Error-Message": "Access to this file is restricted"})
        hub.reset_requests()
    elif case == "offline-shards-not-cached":  # config and index cached by a first run, the shards never
        assert run_cli("inspect", REPO).exit_code == 0
        set_offline(monkeypatch, True)
        hub.reset_requests()
    elif case == "offline-by-transformers":  # huggingface_hub goes offline on either variable (constants.py)
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        set_offline(monkeypatch, True)
    args = [command, src, "--json"]
    result = run_cli(*args)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("glm-pack: error: ") and expected in lines[0], lines
    assert hub.token not in result.output
    if case == "offline-by-transformers":  # the variable the user set is the one named, and only it
        assert "HF_HUB_OFFLINE" not in lines[0] and lines[0].endswith("or unset TRANSFORMERS_OFFLINE"), lines
    if case in ("no-repo", "refused", "offline-empty-cache", "offline-by-transformers"):  # SRC: maybe a mistyped folder
        assert "(and no local directory of that name)" in lines[0], lines
    if case.endswith("-forced"):  # hf:// forced the Hub: no local folder was looked for, none is said to be missing
        assert "local directory" not in lines[0], lines
    if case == "rate-limited":
        assert lines[0].endswith("; the Hub says: Too many requests: retry in 5 minutes"), lines
    if case == "unavailable":
        assert lines[0].endswith(": Hub under maintenance, back at 18:00 UTC"), lines
    if case == "range-denied":  # the check's answer, read as any other: the Hub's reason and the shard named
        assert "Access to this file is restricted" in lines[0] and "model-00001-of-00003.safetensors" in lines[0], lines
        assert [(r.range, r.status) for r in hub.requests if r.range] == [(RANGE_CHECK, 403)]  # not retried
    if case == "cut":
        cut = [r for r in hub.requests if r.status == -2 and r.method == "GET" and r.range != RANGE_CHECK]
        assert len(cut) == 6 and len({(r.path, r.range) for r in cut}) == 1  # 1 try + 5 retries of one read
    if case == "offline-shards-not-cached":
        assert lines[0].endswith(f"{REPO}@{hub.sha}/model-00001-of-00003.safetensors)")
        assert [r for r in hub.requests if r.kind] == []  # nothing reached the Hub


def test_index_entry_outside_the_repo_is_refused(hub, src, tmp_path):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    index["weight_map"][name] = f"../other/{index['weight_map'][name]}"
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    hub.seed("org/escape", {**files, "model.safetensors.index.json": json.dumps(index).encode()})
    result = run_cli("convert", "org/escape", tmp_path / "out")
    assert result.exit_code == 1 and "not a file name inside the checkpoint" in result.output
    assert "model.safetensors.index.json, tensor " + name in result.output
    assert not (tmp_path / "out").exists()
