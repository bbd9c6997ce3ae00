"""A small in-memory Hugging Face Hub on 127.0.0.1 for tests: the real ``huggingface_hub`` client talks to it.

Start it with ``with FakeHub() as hub:`` and point the client at ``hub.endpoint``. It answers the
endpoints the client calls for model repos (Xet disabled, i.e. ``HF_HUB_DISABLE_XET=1``)::

    POST /api/repos/create                          create (409 when it exists); without "visibility" in the
                                                    request, the namespace's default (``private_by_default``)
    GET  /api/models/{repo}[/revision/{rev}]        repo info (sha, siblings; size/blobId/lfs with ?blobs=true)
    GET  /api/models/{repo}/tree/{rev}[/{path}]     one folder's entries (type, oid, size, path, lfs); all
                                                    below it with ?recursive=true
    POST /api/models/{repo}/branch/{branch}         create a branch (409 when it exists; 400 for refs/..., e.g.
                                                    a pull request's refs/pr/N)
    POST /api/models/{repo}/paths-info/{rev}        size, git blob id, lfs {oid=sha256, size}
    POST /api/models/{repo}/preupload/{rev}         uploadMode "lfs" when size >= lfs_threshold else "regular";
                                                    shouldIgnore when the branch's .gitignore matches the path
    POST /{repo}.git/info/lfs/objects/batch         basic transfer; no "actions" for objects already stored
    PUT  /_lfs/{oid}                                the bytes of one LFS object (sha256 checked)
    POST /api/models/{repo}/commit/{rev}            NDJSON header / file / lfsFile / deletedFile lines; 412 when
                                                    the header's parentCommit is not the branch's head
    POST /api/validate-yaml                         README front matter must be a YAML mapping with sane types
    GET|HEAD /{repo}/resolve/{rev}/{path}           bytes, ETag / X-Repo-Commit / X-Linked-*; Range: 206
                                                    (200, the whole file, when serves_ranges is False)

A revision is a branch name or the sha of a commit the repo had (its files as that commit left them). A
commit's header may name ``parentCommit`` (where huggingface_hub puts ``create_commit(parent_commit=)``:
_commit_api._prepare_commit_payload); unless the branch's head is that commit (or starts with that shorthand) the
commit is refused with 412 and the Hub's message, as huggingface_hub's own test of the real Hub expects
(tests/test_hf_api.py::test_create_commit_conflict), and nothing changes. :meth:`FakeHub.seed` puts files
into a repo directly (one commit). Every request needs ``Authorization: Bearer <token>`` (else 401).
Every request is recorded in ``hub.requests`` (method, kind, path, body size, Range header; never other
headers, so tokens are not kept). Errors are injected with :meth:`FakeHub.fail`: an HTTP status
(optionally with ``X-Error-Code``), a dropped connection, or a response cut off after half its body
(``cut=True``), on one kind of request, once ``after_files`` files have been committed in total.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import socket
import sys
import threading
from dataclasses import dataclass, field
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

KINDS = (
    "create",
    "repo_info",
    "branch",
    "paths_info",
    "preupload",
    "lfs_batch",
    "lfs_put",
    "commit",
    "validate_yaml",
    "resolve",
    "tree",
)

_ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create"),
    ("GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$"), "repo_info"),
    ("GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$"), "tree"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>[^/]+)$"), "branch"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/paths-info/(?P<rev>[^/]+)$"), "paths_info"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("PUT", re.compile(r"^/_lfs/(?P<oid>[0-9a-f]{64})$"), "lfs_put"),
    ("POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("HEAD", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


def git_blob_id(data: bytes) -> str:
    """The git blob sha1 the Hub reports as ``oid`` for a file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Blob:
    data: bytes
    lfs: bool

    @cached_property  # hashed once: the data never changes
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def blob_id(self) -> str:
        return git_blob_id(self.data)

    def info(self, path: str) -> dict:
        entry = {"type": "file", "path": path, "size": len(self.data), "oid": self.blob_id}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": 134}
        return entry


@dataclass
class Repo:
    private: bool
    branches: dict[str, dict[str, Blob]] = field(default_factory=lambda: {"main": {}})
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})
    commits: list[dict] = field(default_factory=list)  # {"branch", "summary", "files": [paths]}
    trees: dict[str, dict[str, Blob]] = field(default_factory=dict)  # each commit's files by sha, past ones too

    def __post_init__(self) -> None:
        for branch, sha in self.heads.items():
            self.trees.setdefault(sha, self.branches[branch])


@dataclass
class Request:
    method: str
    kind: str | None
    path: str
    body_bytes: int
    status: int = 0
    range: str | None = None  # the Range header, if any


@dataclass
class Fault:
    kind: str
    status: int | None  # HTTP status to answer; None with drop=True
    drop: bool
    after_files: int
    times: int | None  # None: every matching request
    error_code: str | None
    headers: dict
    cut: bool = False  # send the headers and half the body, then close


BRANCH_MOVED = "The branch was updated since you opened this page. Please refresh and try again."


class HubHTTPError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code = status, message, error_code


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that hung up mid-answer (reading only a response's status, as the range check of a server that
        ignores ranges does) is no server error; anything else is printed as socketserver does."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeHub:
    """In-memory Hub; see the module docstring for the endpoints. Thread-safe under one lock."""

    def __init__(
        self, token: str = "hf_fake_token_for_tests", lfs_threshold: int = 1024, user: str = "tester"
    ):
        self.token = token
        self.lfs_threshold = lfs_threshold
        self.user = user
        self.private_by_default = False  # a namespace (an organization) can make its new repos private by default
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.committed_files = 0
        self.serves_ranges = True  # False: answer a Range request with 200 and the whole file, as some mirrors do
        self.lock = threading.RLock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        serve = {"poll_interval": 0.05}  # quick shutdown
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs=serve, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- test helpers ----------------------------------------------------------------------------
    def fail(
        self,
        kind: str,
        status: int | None = None,
        *,
        drop: bool = False,
        after_files: int = 0,
        times: int | None = None,
        error_code: str | None = None,
        headers: dict | None = None,
        cut: bool = False,
    ) -> None:
        """Answer ``kind`` requests with ``status`` (or drop the connection, or cut the body short) after
        ``after_files`` commits."""
        if kind not in KINDS:
            raise ValueError(f"unknown request kind {kind!r}; one of {KINDS}")
        if (status is not None) + drop + cut != 1:
            raise ValueError("give exactly one of status=, drop=True or cut=True")
        with self.lock:
            self.faults.append(
                Fault(kind, status, drop, after_files, times, error_code, dict(headers or {}), cut)
            )

    def seed(self, repo_id: str, files: dict[str, bytes], *, private: bool = False) -> str:
        """Create ``repo_id`` holding ``files`` in one commit on main (LFS at ``lfs_threshold``); its sha."""
        with self.lock:
            blobs = {p: Blob(data, lfs=len(data) >= self.lfs_threshold) for p, data in files.items()}
            sha = hashlib.sha1(f"{repo_id}:seed".encode()).hexdigest()
            self.repos[repo_id] = Repo(private=private, branches={"main": blobs}, heads={"main": sha})
            return sha

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        """The current content of a branch: {path: bytes}."""
        with self.lock:
            return {p: b.data for p, b in self.repos[repo_id].branches[branch].items()}

    def lfs_paths(self, repo_id: str, branch: str = "main") -> set[str]:
        with self.lock:
            return {p for p, b in self.repos[repo_id].branches[branch].items() if b.lfs}

    def kinds(self, kind: str) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.kind == kind]

    def reset_requests(self) -> None:
        with self.lock:
            self.requests.clear()

    # -- request handling (called from the handler under the lock) --------------------------------
    def _fault_for(self, kind: str) -> Fault | None:
        for fault in self.faults:
            if fault.kind == kind and self.committed_files >= fault.after_files and fault.times != 0:
                if fault.times is not None:
                    fault.times -= 1
                return fault
        return None

    def _repo(self, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubHTTPError(404, "Repository not found", "RepoNotFound")
        return repo

    @staticmethod
    def _branch_name(repo: Repo, rev: str) -> str:
        """The branch a revision (branch name or head commit sha) names."""
        rev = unquote(rev)
        if rev in repo.branches:
            return rev
        for branch, head in repo.heads.items():
            if head == rev:
                return branch
        raise HubHTTPError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _revision(self, repo: Repo, rev: str) -> tuple[str, dict[str, Blob]]:
        """(commit sha, files) of a revision: a branch (its head), or any commit the repo had, by sha."""
        rev = unquote(rev)
        if rev not in repo.branches and rev in repo.trees:
            return rev, repo.trees[rev]
        branch = self._branch_name(repo, rev)
        return repo.heads[branch], repo.branches[branch]

    def _files(self, repo: Repo, rev: str) -> dict[str, Blob]:
        return self._revision(repo, rev)[1]

    def handle(self, kind: str, m: dict, query: dict, body: bytes, base: str):
        """Return (status, headers, body bytes) for a routed request."""
        if kind == "create":
            req = json.loads(body)
            repo_id = f"{req.get('organization') or self.user}/{req['name']}"
            if repo_id in self.repos:  # the real Hub names the existing repo's url in its 409 answer
                return _json(
                    409, {"error": "You already created this model repo", "url": f"{base}/{repo_id}"}
                )
            visibility = req.get("visibility")  # sent only when the client is given private= or visibility=
            self.repos[repo_id] = Repo(private=visibility == "private" if visibility else self.private_by_default)
            return _json(200, {"url": f"{base}/{repo_id}", "name": repo_id})
        repo_id = m.get("repo")
        if kind == "repo_info":
            repo = self._repo(repo_id)
            sha, files = self._revision(repo, m.get("rev") or "main")
            siblings = [{"rfilename": p} for p in sorted(files)]
            if query.get("blobs", "").lower() in ("true", "1"):
                for entry in siblings:
                    info = files[entry["rfilename"]].info(entry["rfilename"])
                    entry.update(size=info["size"], blobId=info["oid"])
                    if "lfs" in info:  # siblings name the LFS sha256 "sha256" (paths-info and tree: "oid")
                        entry["lfs"] = {"sha256": info["lfs"]["oid"], "size": info["size"], "pointerSize": 134}
            return _json(
                200, {"id": repo_id, "sha": sha, "private": repo.private, "siblings": siblings}
            )
        if kind == "tree":
            files = self._files(self._repo(repo_id), m["rev"])
            folder = unquote(m.get("path") or "").strip("/")
            prefix = f"{folder}/" if folder else ""
            entries, dirs = [], set()
            recursive = query.get("recursive", "").lower() in ("true", "1")
            for path in sorted(files):
                if not path.startswith(prefix):
                    continue
                parts = path[len(prefix) :].split("/")
                for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                    dirs.add(prefix + "/".join(parts[:depth]))
                if recursive or len(parts) == 1:
                    entries.append(files[path].info(path))
            if folder and not entries and not dirs:
                raise HubHTTPError(404, f"{folder} does not exist", "EntryNotFound")
            tree_ids = [{"type": "directory", "path": d, "oid": git_blob_id(d.encode())} for d in sorted(dirs)]
            return _json(200, tree_ids + entries)
        if kind == "branch":
            repo = self._repo(repo_id)
            name = unquote(m["rev"])
            if name.startswith("refs/"):  # huggingface_hub's create_branch documents a BadRequestError for these
                raise HubHTTPError(400, f"Invalid reference for a branch: {name}")
            if name in repo.branches:
                raise HubHTTPError(409, f"Reference already exists: refs/heads/{name}")
            start = (json.loads(body) if body else {}).get("startingPoint", "main")
            repo.heads[name], files = self._revision(repo, start)
            repo.branches[name] = dict(files)
            return _json(200, {})
        if kind == "paths_info":
            files = self._files(self._repo(repo_id), m["rev"])
            form = parse_qs(body.decode())
            return _json(200, [files[p].info(p) for p in form.get("paths", []) if p in files])
        if kind == "preupload":
            files = self._files(self._repo(repo_id), m["rev"])
            req = json.loads(body)
            gitignore = files[".gitignore"].data.decode() if ".gitignore" in files else ""
            ignored = _gitignore(req.get("gitIgnore", gitignore))
            answer = []
            for f in req["files"]:
                mode = "lfs" if f["size"] >= self.lfs_threshold else "regular"
                old = files.get(f["path"])
                answer.append(
                    {
                        "path": f["path"],
                        "uploadMode": mode,
                        "shouldIgnore": ignored(f["path"]),
                        "oid": None if old is None else (old.sha256 if old.lfs else old.blob_id),
                    }
                )
            return _json(200, {"files": answer, "commitOid": "0" * 40})
        if kind == "lfs_batch":
            self._repo(repo_id)
            req = json.loads(body)
            objects = []
            for obj in req["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                if obj["oid"] not in self.lfs_objects:
                    entry["actions"] = {"upload": {"href": f"{base}/_lfs/{obj['oid']}", "expires_in": 3600}}
                objects.append(entry)
            return _json(200, {"transfer": "basic", "objects": objects}, "application/vnd.git-lfs+json")
        if kind == "lfs_put":
            if hashlib.sha256(body).hexdigest() != m["oid"]:
                raise HubHTTPError(400, "sha256 of the uploaded bytes does not match the object id")
            self.lfs_objects[m["oid"]] = body
            return 200, {}, b""
        if kind == "commit":
            return self._commit(repo_id, m["rev"], body, base)
        if kind == "validate_yaml":
            return self._validate_yaml(json.loads(body)["content"])
        if kind == "resolve":
            return self._resolve(repo_id, m["rev"], unquote(m["path"]), query)
        raise HubHTTPError(404, "no such endpoint")

    def _commit(self, repo_id: str, rev: str, body: bytes, base: str):
        repo = self._repo(repo_id)
        branch = self._branch_name(repo, rev)
        files = repo.branches[branch]
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubHTTPError(400, "commit payload must start with a header line")
        parent = lines[0]["value"].get("parentCommit")
        if parent is not None and not repo.heads[branch].startswith(parent.lower()):
            raise HubHTTPError(412, BRANCH_MOVED)
        staged = dict(files)
        touched = []
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                staged[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                data = self.lfs_objects.get(value["oid"])
                if data is None:
                    raise HubHTTPError(
                        400, f"LFS object {value['oid']} for {value['path']} was never uploaded"
                    )
                staged[value["path"]] = Blob(data, lfs=True)
            elif key == "deletedFile":
                if staged.pop(value["path"], None) is None:
                    raise HubHTTPError(404, "A file with this name doesn't exist", "EntryNotFound")
            else:
                raise HubHTTPError(400, f"unsupported commit line {key!r}")
            touched.append(value["path"])
        repo.branches[branch] = staged
        oid = hashlib.sha1(f"{repo_id}:{len(repo.commits)}".encode()).hexdigest()
        repo.heads[branch], repo.trees[oid] = oid, staged
        repo.commits.append({"branch": branch, "summary": lines[0]["value"]["summary"], "files": touched})
        self.committed_files += len(touched)
        return _json(
            200, {"commitUrl": f"{base}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
        )

    @staticmethod
    def _validate_yaml(content: str):
        errors = []
        match = re.match(r"^---\s*\n(.*?)\n---\s*\n", content, re.S)
        meta = None
        if match:
            try:
                meta = yaml.safe_load(match.group(1))
            except yaml.YAMLError as err:
                errors.append(f"YAML front matter does not parse: {err}")
        if match and not errors:
            if not isinstance(meta, dict):
                errors.append("YAML front matter must be a mapping")
            else:
                for key in ("license", "library_name", "pipeline_tag", "base_model_relation"):
                    if key in meta and not isinstance(meta[key], str):
                        errors.append(f'"{key}" must be a string')
                for key in ("tags", "base_model"):
                    v = meta.get(key)
                    if v is not None and not (isinstance(v, str) or all(isinstance(t, str) for t in v)):
                        errors.append(f'"{key}" must be a string or a list of strings')
        if errors:
            return _json(400, {"errors": [{"message": e} for e in errors], "warnings": []})
        warnings = [] if match else [{"message": "empty or missing yaml metadata in repo card"}]
        return _json(200, {"errors": [], "warnings": warnings})

    def _resolve(self, repo_id: str, rev: str, path: str, query: dict):
        repo = self._repo(repo_id)
        sha, files = self._revision(repo, rev)
        blob = files.get(path)
        if blob is None:
            raise HubHTTPError(404, "Entry not found", "EntryNotFound")
        etag = blob.sha256 if blob.lfs else blob.blob_id
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": sha}
        headers["Accept-Ranges"] = "bytes"
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(blob.data))})
        rng = query.get("range")
        if rng is None or not self.serves_ranges:
            return 200, headers, blob.data
        size = len(blob.data)
        got = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
        if not got or got.groups() == ("", ""):
            raise HubHTTPError(416, "bad Range header")
        start, end = got.groups()
        if start == "":  # suffix range: last N bytes
            first, last = max(size - int(end), 0), size - 1
        else:
            first, last = int(start), min(int(end) if end else size - 1, size - 1)
        if first >= size or first > last:
            return 416, {"Content-Range": f"bytes */{size}"}, b""
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        return 206, headers, blob.data[first : last + 1]


def _gitignore(text: str):
    """Whether a path matches ``.gitignore`` text, with git's rules simplified: each pattern is a glob matched
    against the path and its base name; a trailing ``/`` names a folder at any depth."""
    patterns = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        for pattern in patterns:
            if pattern.endswith("/"):
                if f"/{pattern}" in f"/{path}":
                    return True
            elif fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern):
                return True
        return False

    return ignored


def _json(status: int, obj, content_type: str = "application/json"):
    return status, {"Content-Type": content_type}, json.dumps(obj).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stall
    hub: FakeHub

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _dispatch(self) -> None:
        hub = self.hub
        url = urlsplit(self.path)
        body = self._body()
        kind, match = None, {}
        for method, pattern, name in _ROUTES:
            got = pattern.match(url.path)
            if got and method == self.command:
                kind, match = name, got.groupdict()
                break
        record = Request(self.command, kind, url.path, len(body), range=self.headers.get("Range"))
        with hub.lock:
            hub.requests.append(record)
            if self.headers.get("Authorization") != f"Bearer {hub.token}" and kind != "lfs_put":
                status, headers, payload = (
                    401,
                    {"X-Error-Message": "Invalid credentials in Authorization header"},
                    b"",
                )
                payload = json.dumps({"error": "Invalid credentials in Authorization header"}).encode()
            elif kind is None:
                status, headers, payload = 404, {}, b'{"error": "Not Found"}'
            else:
                fault = hub._fault_for(kind)
                if fault is not None and fault.drop:
                    record.status = -1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None and fault.cut:
                    record.status = -2
                    self._cut(hub, kind, match, body)
                    return
                if fault is not None:
                    headers = {"X-Error-Message": f"injected {fault.status}", **fault.headers}
                    if fault.error_code:
                        headers["X-Error-Code"] = fault.error_code
                    status, payload = fault.status, json.dumps({"error": f"injected {fault.status}"}).encode()
                else:
                    try:
                        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                        if self.headers.get("Range"):
                            query["range"] = self.headers["Range"]
                        status, headers, payload = hub.handle(kind, match, query, body, hub.endpoint)
                    except HubHTTPError as err:
                        headers = {"X-Error-Message": err.message}
                        if err.error_code:
                            headers["X-Error-Code"] = err.error_code
                        status, payload = err.status, json.dumps({"error": err.message}).encode()
            record.status = status
        self.send_response(status)
        headers.setdefault("Content-Type", "application/json")
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _cut(self, hub: FakeHub, kind: str, match: dict, body: bytes) -> None:
        """Answer normally but send only half the body, then close the connection."""
        query = {"range": self.headers["Range"]} if self.headers.get("Range") else {}
        status, headers, payload = hub.handle(kind, match, query, body, hub.endpoint)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    do_GET = do_POST = do_PUT = do_HEAD = _dispatch
