"""A checkpoint on the Hugging Face Hub, read by byte ranges: the store behind ``SRC = org/name[@revision]``.

:class:`HubStore` has the same surface as :class:`~.checkpoint.LocalStore` (``where``, ``exists``,
``read_text``, ``open`` -> :class:`~.safetensors_io.ByteSource`, ``safetensors_files``, ``list_files``).
It pins the revision to its commit sha once (``HfApi.model_info``: sha + file sizes), so everything read
afterwards comes from one immutable commit. Small files (config.json, the index) are downloaded whole into
the HF cache with ``hf_hub_download``; safetensors files are read by HTTP range requests through
``HfFileSystem`` (one request per header part or tensor, retried with backoff by huggingface_hub), except
files already in the HF cache, which are read locally. Before the first range read, one request for a single byte
checks that the endpoint serves ranges (some mirrors answer a range with the whole file: every header or tensor
read would then download a whole shard into memory). The last ranges read (at most :data:`RECENT_BYTES`)
are kept, so a tensor that is decoded and then fingerprinted crosses the network once. With
``HF_HUB_OFFLINE=1`` the commit is resolved from the cache and only cached files can be read; the
repo's full file list is then unknown (the cache keeps only downloaded files), so ``--files copy`` is refused.
``transferred`` counts payload bytes fetched from the Hub (ranges + whole files downloaded; a resumed
download counts its full size). Every client failure becomes one :class:`~glm_pack.packing.errors.HubError`
line.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from glm_pack.packing.errors import CheckpointError, GlmPackError, HubError

from .checkpoint import INDEX_NAME, is_original, walk_files
from .hub_common import (
    HUB_PREFIX,
    NO_LOCAL_DIRECTORY,
    answered,
    auth_failed,
    exception_chain,
    first_line,
    hub_says,
    is_kind,
    offline_variable,
    resolve_endpoint,
    unreachable,
)
from .safetensors_io import LocalFile

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+")
RANGE_CHECK = "bytes=0-0"  # the Range of the one request checking that the endpoint serves ranges
RECENT_BYTES = 256 << 20  # ranges kept for re-reads (a GLM-5 kv_b_proj in BF16 is 29 MB)


def parse_repo_spec(src: str | os.PathLike) -> tuple[str, str | None] | None:
    """``(repo_id, revision or None)`` when ``src`` names a Hub repo, None when it is a local path.

    ``hf://org/name[@rev]`` always names the Hub; ``org/name[@rev]`` does when no such local path exists.
    """
    text = os.fspath(src)
    explicit = text.startswith(HUB_PREFIX)
    if explicit:
        text = text[len(HUB_PREFIX) :]
    elif os.path.exists(text):
        return None
    repo_id, at, revision = text.partition("@")
    if _REPO_ID.fullmatch(repo_id) and ".." not in repo_id and (revision or not at):
        return repo_id, revision or None
    if explicit:
        raise HubError(f"not a Hub repo id: {src!r} (expected hf://org/name or hf://org/name@revision)")
    return None


class HubStore:
    """One commit of a Hub model repo; names are paths in the repo. See the module docstring."""

    kind = "hub"

    def __init__(self, repo_id: str, revision: str | None = None, *, explicit: bool = False):
        """``explicit``: named with ``hf://``, so no local folder of that name was looked for (errors say so)."""
        from huggingface_hub import constants

        self.repo_id = repo_id
        self.no_folder = "" if explicit else f" {NO_LOCAL_DIRECTORY}"  # where a mistyped folder may be meant
        self.requested = revision or "main"
        self.endpoint = resolve_endpoint(None)
        self.offline = constants.is_offline_mode()
        self.transferred = 0
        self._fs = None
        self._serves_ranges = False  # checked before the first range read
        self._recent: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self.sha, self._sizes = self._from_cache() if self.offline else self._from_hub()
        self._known = set(self._sizes) | (self._index_files() if self.offline else set())
        self.root = PurePosixPath(f"{repo_id}@{self.sha}")  # also the spec a worker process reopens
        if not self.offline and self.requested != self.sha:
            self._record_ref()

    # ---- resolving the commit ------------------------------------------------------------------
    def _from_hub(self) -> tuple[str, dict[str, int]]:
        from huggingface_hub import HfApi

        with self._errors():
            info = HfApi(endpoint=self.endpoint).model_info(self.repo_id, revision=self.requested, files_metadata=True)
        sizes = {s.rfilename: s.size for s in info.siblings or []}
        if not info.sha or any(size is None for size in sizes.values()):
            raise HubError(f"{self.endpoint} did not report the commit sha and file sizes of {self.repo_id}")
        return info.sha, sizes

    def _from_cache(self) -> tuple[str, dict[str, int]]:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo_id, "config.json", revision=self.requested)
        if not isinstance(found, str):
            raise HubError(
                f"{offline_variable()} is set and the local Hugging Face cache has no {self.repo_id}@{self.requested} "
                f"(config.json){self.no_folder}: run once online, or unset {offline_variable()}"
            )
        snapshot = Path(found).parent
        sizes = {}
        for path in walk_files(snapshot, lambda parts: True, CheckpointError, f"the cached snapshot of {self.repo_id}"):
            if path.is_file():
                sizes[path.relative_to(snapshot).as_posix()] = path.stat().st_size
        return snapshot.name, sizes

    def _record_ref(self) -> None:
        """Fetch config.json by the requested revision: huggingface_hub then records revision -> sha in the
        HF cache (``refs/``), which an offline run resolves. A revision that moved meanwhile is refused."""
        if self._fetch("config.json", self.requested).parent.name == self.sha:
            return
        # another commit's file: the revision moved, or the Hub refused the file (gated, 5xx) and huggingface_hub
        # answered from an older cached snapshot; ask the Hub without that fallback, so a refusal is what is reported
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(self.repo_id, "config.json", revision=self.requested, endpoint=self.endpoint)
        with self._errors("config.json"):
            now = get_hf_file_metadata(url, endpoint=self.endpoint).commit_hash
        if now != self.sha:
            raise HubError(
                f"revision {self.requested!r} of {self.repo_id} moved from {self.sha} to {now} while being read; "
                "run again"
            )

    def _index_files(self) -> set[str]:
        """Offline: the shards the cached index names, cached or not (so a missing one is named clearly)."""
        if INDEX_NAME not in self._sizes:
            return set()
        try:
            weight_map = json.loads(self.read_text(INDEX_NAME)).get("weight_map")
            return set(weight_map.values()) if isinstance(weight_map, dict) else set()
        except (ValueError, AttributeError, TypeError):
            return set()  # the checkpoint reader reports a bad index itself

    # ---- the store surface ---------------------------------------------------------------------
    def where(self, rel: str) -> str:
        return f"{HUB_PREFIX}{self.root}/{rel}"

    def exists(self, rel: str) -> bool:
        return rel in self._known

    def read_text(self, rel: str) -> str:
        path = self.download(rel)
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"cannot read: {err}", file=self.where(rel)) from err

    def open(self, rel: str):
        cached = self._cached_or_fetchable(rel)
        return RangeFile(self, rel) if cached is None else LocalFile(cached, name=self.where(rel))

    def safetensors_files(self) -> list[str]:
        return sorted(name for name in self._sizes if "/" not in name and name.endswith(".safetensors"))

    def list_files(self) -> list[tuple[str, int]]:
        """Every file of the commit (hidden ones and ``glm-pack/`` skipped), with sizes."""
        return [(name, size) for name, size in sorted(self._sizes.items()) if is_original(name.split("/"))]

    def cache_folder(self) -> Path:
        """This repo's folder in the local HF cache (``models--ORG--NAME``: ``blobs/``, ``snapshots/``, ``refs/``)."""
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name

        return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=self.repo_id, repo_type="model")

    # ---- whole files ---------------------------------------------------------------------------
    def _cached(self, rel: str) -> str | None:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo_id, rel, revision=self.sha)
        return found if isinstance(found, str) else None

    def in_cache(self, rel: str) -> bool:
        """Whether the commit's file ``rel`` is in the local HF cache already (a download would fetch nothing)."""
        return self._cached(rel) is not None

    def _cached_or_fetchable(self, rel: str) -> str | None:
        """The file's path in the HF cache, else None where it can be fetched: CheckpointError when the commit
        lacks it, HubError when HF_HUB_OFFLINE is set."""
        cached = self._cached(rel)
        if cached is None and rel not in self._known:
            raise CheckpointError("file is missing", file=self.where(rel))
        if cached is None and self.offline:
            raise self._not_cached(rel)
        return cached

    def _not_cached(self, rel: str) -> HubError:
        return HubError(
            f"not in the local Hugging Face cache and {offline_variable()} is set: run once online "
            f"(e.g. convert --files copy, or `hf download`), or unset {offline_variable()}",
            file=self.where(rel),
        )

    def download(self, rel: str) -> Path:
        """The file in the HF cache, downloaded (resumably, by huggingface_hub) if it is not there yet."""
        cached = self._cached_or_fetchable(rel)
        return self._fetch(rel, self.sha) if cached is None else Path(cached)

    def _fetch(self, rel: str, revision: str) -> Path:
        from huggingface_hub import hf_hub_download

        cached = self._cached(rel)
        with self._errors(rel):
            path = Path(hf_hub_download(self.repo_id, rel, revision=revision, endpoint=self.endpoint))
        self.transferred += 0 if cached else self._sizes[rel]
        return path

    # ---- ranges --------------------------------------------------------------------------------
    def filesystem(self):
        if self._fs is None:
            from huggingface_hub import HfFileSystem

            self._fs = HfFileSystem(endpoint=self.endpoint)
        return self._fs

    def check_ranges(self, rel: str) -> None:
        """Once per store, before the first range read: ask for the first byte of ``rel`` and look at the status
        alone. An endpoint that answers with the whole file is refused here, before a range read downloads a whole
        shard for each header or tensor."""
        if self._serves_ranges:
            return
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

        url = hf_hub_url(self.repo_id, rel, revision=self.sha, endpoint=self.endpoint)
        with self._errors(rel):
            headers = {**build_hf_headers(), "range": RANGE_CHECK}
            with http_stream_backoff("GET", url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as answer:
                hf_raise_for_status(answer)
                status = answer.status_code  # the body is left unread: a whole file's must not be downloaded
        if status != 206:
            raise HubError(
                f"{self.endpoint} answered a byte-range request with status {status} (the whole file, not the range): "
                f"glm-pack reads a Hub checkpoint by byte ranges and this endpoint does not serve them; use one that "
                f"does (HF_ENDPOINT unset: huggingface.co), or download the checkpoint first (`hf download "
                f"{self.repo_id} --revision {self.sha} --local-dir DIR`) and convert DIR",
                file=self.where(rel),
            )
        self._serves_ranges = True

    @contextmanager
    def _errors(self, rel: str | None = None):
        try:
            yield
        except GlmPackError:
            raise
        except Exception as err:
            raise hub_read_error(err, self, rel) from err


class RangeFile:
    """One repo file read by HTTP range requests (exactly the bytes asked for); a ByteSource."""

    def __init__(self, store: HubStore, rel: str):
        self.store, self.rel = store, rel
        self.name = store.where(rel)

    def size(self) -> int:
        return self.store._sizes[self.rel]

    def read(self, offset: int, length: int) -> bytearray:
        if length == 0:
            return bytearray()
        recent, key = self.store._recent, (self.rel, offset, length)
        if key in recent:
            recent.move_to_end(key)
            return bytearray(recent[key])
        self.store.check_ranges(self.rel)
        with self.store._errors(self.rel):
            fs = self.store.filesystem()
            with fs.open(f"{self.store.root}/{self.rel}", "rb", cache_type="none", size=self.size()) as f:
                f.seek(offset)
                data = f.read(length)
        if len(data) != length:
            raise HubError(
                f"{'short' if len(data) < length else 'long'} read from the Hub: wanted {length} bytes at offset "
                f"{offset}, got {len(data)}",
                file=self.name,
            )
        self.store.transferred += length
        if length <= RECENT_BYTES:
            recent[key] = data
            while sum(map(len, recent.values())) > RECENT_BYTES:
                recent.popitem(last=False)
        return bytearray(data)


def hub_read_error(err: BaseException, store: HubStore, rel: str | None) -> HubError:
    """One clear line for a failed Hub read (never containing the token)."""
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, endpoint = store.repo_id, store.endpoint
    file = store.where(rel) if rel and getattr(store, "sha", None) else None
    for e in exception_chain(err):
        if isinstance(e, GatedRepoError):
            return HubError(
                f"{repo} is gated: accept its conditions on the Hub, then log in (HF_TOKEN or `hf auth login`)"
            )
        if isinstance(e, RepositoryNotFoundError):
            return HubError(
                f"repository {repo} not found at {endpoint}{store.no_folder}, "
                "or it is private/gated and the token cannot see it"
            )
        if isinstance(e, RevisionNotFoundError):
            return HubError(f"revision {store.requested!r} not found in {repo} at {endpoint}")
        if isinstance(e, LocalEntryNotFoundError):
            if store.offline:
                return store._not_cached(rel or "config.json")
            continue  # a network failure hides behind it: report that
        if isinstance(e, EntryNotFoundError | FileNotFoundError):
            if isinstance(e.__cause__, HfHubHTTPError):
                continue  # HfFileSystem's FileNotFoundError for a repo or revision it cannot find: report that
            return HubError(f"no such file in {repo} at this revision", file=file)
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            status = e.response.status_code
            if status == 401:
                return HubError(auth_failed(endpoint, e))
            if status == 403:
                return HubError(f"permission denied (403) reading {repo} at {endpoint}{hub_says(e)}", file=file)
            if status == 429:
                return HubError(
                    f"rate limited (429) by {endpoint}; wait and run the same command again{hub_says(e)}", file=file
                )
            return HubError(answered(status, repo, endpoint, e), file=file)
        if is_kind(e, "ConnectError", "ConnectionRefusedError"):  # at the first request: maybe a mistyped folder
            return HubError(unreachable(endpoint, "" if file else f" for {repo}{store.no_folder}"), file=file)
        if is_kind(e, "TimeoutException", "TimeoutError"):
            return HubError(f"timed out reading from {endpoint} (after retries)", file=file)
        if is_kind(e, "TransportError", "ConnectionError"):
            return HubError(f"connection to {endpoint} lost while reading (after retries)", file=file)
    return HubError(f"reading {repo} from {endpoint} failed: {type(err).__name__}: {first_line(err)}", file=file)


def refuse_copy_offline(repo_id: str, revision: str | None) -> None:
    """Refuse ``--files copy`` offline: the HF cache records the files downloaded so far, never the commit's full
    file list, so a copy could silently miss some (a tokenizer) and still look complete."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise HubError(
            f"--files copy needs the full file list of {repo_id}@{revision or 'main'}, and {offline_variable()} is "
            "set: the local Hugging Face cache holds only the files downloaded so far, not the repo's listing; run "
            f"online (unset {offline_variable()}), or use --files none (overlay only)"
        )
