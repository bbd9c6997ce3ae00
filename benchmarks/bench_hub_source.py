"""Bytes moved and time: inspect / overlay from a Hub repo read by byte ranges vs downloading the shards whole.

Usage: python benchmarks/bench_hub_source.py [--layers 8] [--experts 16] [--rtt-ms 50] [--mb-per-s 100]

Serves a ``--profile small`` synthetic GLM-5 checkpoint (BF16) from the loopback fake Hub of the tests
(tests/convert/fake_hub.py; the real huggingface_hub client talks to it, Xet off) and measures, each with a
fresh HF cache:

* ``inspect`` of the repo id (config + index + shard headers by range requests);
* ``convert`` of the repo id, overlay only (headers + the kv_b_proj tensors by range requests);
* ``snapshot_download`` of the whole repo, then ``convert`` of the local snapshot (the download-first route).

Bytes are payload bytes (HubStore's count, cross-checked against the server's Range log for the range
routes); requests are those the server saw. Loopback hides the network, so the last column is *computed*,
not measured: requests x RTT + bytes / bandwidth for the given link (sequential requests, as the reader
issues them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "convert"))

os.environ["HF_HUB_DISABLE_XET"] = "1"

from fake_hub import FakeHub  # noqa: E402
from huggingface_hub import constants, snapshot_download  # noqa: E402

from glm_pack.convert.convert import ConvertOptions, convert  # noqa: E402
from glm_pack.convert.hub_source import RANGE_CHECK  # noqa: E402
from glm_pack.convert.inspect import inspect_checkpoint  # noqa: E402
from glm_pack.convert.synth import synthesize  # noqa: E402

REPO = "bench/glm-5-small"


def fresh_cache(root: Path, name: str) -> None:
    cache = root / f"cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["HF_HUB_CACHE"] = str(cache)
    constants.HF_HUB_CACHE = str(cache)


def range_bytes(hub: FakeHub) -> int:
    """Bytes of the range reads the server saw (not the one-byte check that the endpoint serves ranges, whose body
    the reader leaves unread and does not count)."""
    total = 0
    for r in hub.kinds("resolve"):
        if r.method == "GET" and r.range and r.range != RANGE_CHECK:
            first, last = r.range.removeprefix("bytes=").split("-")
            total += int(last) - int(first) + 1
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rtt-ms", type=float, default=50.0)
    ap.add_argument("--mb-per-s", type=float, default=100.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="glm-pack-bench-hub-"))
    try:
        src = synthesize(root / "src", card="glm-5", layers=args.layers, experts=args.experts, fmt="bf16")
        files = {p.name: p.read_bytes() for p in src.iterdir()}
        total = sum(map(len, files.values()))
        shards = sum(name.endswith(".safetensors") for name in files)
        print(
            f"source: glm-5 small, {args.layers} layers + MTP, {args.experts} experts, bf16: "
            f"{total / 2**20:.1f} MiB in {shards} shards"
        )

        def link(requests: int, nbytes: int) -> float:
            return requests * args.rtt_ms / 1000 + nbytes / (args.mb_per_s * 1e6)

        with FakeHub(lfs_threshold=64 * 1024) as hub:
            os.environ["HF_TOKEN"], os.environ["HF_ENDPOINT"] = hub.token, hub.endpoint
            hub.seed(REPO, files)
            rows = []

            fresh_cache(root, "inspect")
            hub.reset_requests()
            t = time.perf_counter()
            report = inspect_checkpoint(REPO)
            moved = report["hub"]["bytes_transferred"]
            rows.append(("inspect, range reads", time.perf_counter() - t, moved, len(hub.requests), range_bytes(hub)))

            fresh_cache(root, "convert")
            hub.reset_requests()
            t = time.perf_counter()
            rep = convert(REPO, root / "out-hub", ConvertOptions(workers=1))
            rows.append(
                ("overlay, range reads", time.perf_counter() - t, rep.hub_bytes, len(hub.requests), range_bytes(hub))
            )

            fresh_cache(root, "download")
            hub.reset_requests()
            t = time.perf_counter()
            snapshot = snapshot_download(REPO, endpoint=hub.endpoint)
            took = time.perf_counter() - t
            rows.append(("download whole shards", took, total, len(hub.requests), None))
            t = time.perf_counter()
            convert(snapshot, root / "out-local", ConvertOptions(files="none", workers=1))
            rows.append(("  + overlay from the download", time.perf_counter() - t, 0, 0, None))

        same = all(
            (root / "out-hub" / "glm-pack" / p.name).read_bytes() == p.read_bytes()
            for p in (root / "out-local" / "glm-pack").glob("*.safetensors")
        )
        print(f"overlay from range reads == overlay from the downloaded copy: {same}")
        print(
            f"{'route':32s} {'time (s)':>9s} {'bytes moved':>15s} {'requests':>9s}  computed @ "
            f"{args.rtt_ms:g} ms RTT, {args.mb_per_s:g} MB/s"
        )
        for name, secs, nbytes, requests, ranged in rows:
            if ranged is not None:
                assert ranged + sum(len(files[n]) for n in ("config.json", "model.safetensors.index.json")) == nbytes
            print(f"{name:32s} {secs:9.2f} {nbytes:15,d} {requests:9d}  {link(requests, nbytes):8.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
