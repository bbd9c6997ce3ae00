"""Hostile input: fuzz the safetensors header reader and the manifest readers (hypothesis).

Contract (see fuzz_targets.py): every input parses into something consistent or raises a GlmPackError
subclass; never another exception, a read past the end of the input, or a hang (hypothesis deadline).
Accepted safetensors files must also be accepted by the reference library with the same entries.
The number of inputs tried is printed at the end of the module (``pytest -s``) and recorded in
RELIABILITY.md; ``benchmarks/fuzz_long.py`` runs the same targets for longer.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from fuzz_targets import (
    COUNTS,
    DEEP,
    dumps_with_deep,
    manifest_target,
    mutate_bytes,
    mutate_manifest,
    safetensors_file,
    safetensors_target,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save

from glm_pack import runtime
from glm_pack.convert.safetensors_io import DTYPES, MAX_HEADER_BYTES, byte_size
from glm_pack.convert.verify import verify
from glm_pack.packing import manifest as mf
from glm_pack.packing.errors import GlmPackError


@pytest.fixture(scope="module", autouse=True)
def print_counts():
    """After the module: how many inputs each target saw and accepted (recorded in RELIABILITY.md)."""
    yield
    print("\nfuzz inputs tried:", dict(sorted(COUNTS.items())))


def fuzz(examples: int) -> settings:
    """Fixed inputs in CI (derandomized, no example database); ``benchmarks/fuzz_long.py`` explores further."""
    return settings(
        max_examples=examples,
        deadline=2000,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --- JSON values of every kind, including the awkward ones -------------------------------------------------
HUGE_INTS = [-1, 0, 2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(2**63)]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-8, 300),
    st.sampled_from(HUGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# --- safetensors: structured headers ------------------------------------------------------------------------
dims = st.one_of(st.integers(0, 6), st.integers(-3, -1), st.sampled_from([2**31, 2**62, 2**63, 2**64, 10**30]))
dtype_names = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(["F8", "bf16", "Q4_K", "", "F4 "]))


@st.composite
def safetensors_files(draw) -> bytes:
    """A header that is valid or broken in one or a few of the ways a real file can be."""
    entries = draw(
        st.lists(
            st.tuples(st.text(min_size=1, max_size=6), dtype_names, st.lists(dims, max_size=4)),
            max_size=4,
            unique_by=lambda e: e[0],
        )
    )
    header: dict = {}
    offset = 0
    for name, dtype, shape in entries:
        try:
            n = byte_size(dtype, tuple(shape)) if all(d >= 0 for d in shape) else 3
        except (KeyError, ValueError):
            n = 1
        n = min(n, 64)  # a claim may be huge; the data written never is
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    names = list(header)
    for _ in range(draw(st.integers(0, 2))):  # break some fields
        if not names:
            break
        entry = header[draw(st.sampled_from(names))]
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "begin", "end", "extra", "drop"]))
        offsets = entry.get("data_offsets")
        if key in ("begin", "end") and isinstance(offsets, list) and len(offsets) == 2:
            shift = draw(st.sampled_from([-(2**64), -(2**63), -5, -1, 1, 7, 100, 2**63, 2**64]))
            i = int(key == "end")
            offsets[i] = offsets[i] + shift if isinstance(offsets[i], int) else shift
        elif key == "extra":
            entry["extra"] = draw(json_values)
        elif key == "drop":
            entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
        else:
            entry[key] = draw(json_values)
    if len(names) > 1 and draw(st.booleans()):  # overlap or reorder
        a, b = draw(st.permutations(names))[:2]
        header[a]["data_offsets"] = json.loads(json.dumps(header[b].get("data_offsets")))
    meta = draw(
        st.one_of(
            st.just(None),
            st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
            st.dictionaries(st.text(max_size=5), json_values, max_size=3),
            json_values,
        )
    )
    if meta is not None or draw(st.booleans()):
        header["__metadata__"] = meta
    top = draw(st.sampled_from(["object", "object", "object", "other", "deep"]))
    if top == "other":
        text = dumps_with_deep(draw(json_values), 0)
    elif top == "deep":
        text = dumps_with_deep({"x": DEEP}, draw(st.sampled_from([50, 5000, 200_000])))
    else:
        text = dumps_with_deep(header, 0) + b" " * draw(st.integers(0, 7))
    data = bytes(range(256)) * (offset // 256 + 1)
    data = data[: max(0, offset + draw(st.sampled_from([0, 0, 0, -1, 1, -offset])))]
    length = draw(st.sampled_from([None, None, None, 0, 1, 2**64 - 1, MAX_HEADER_BYTES + 1, len(text) + 1]))
    return safetensors_file(text, data, length=length)


def reference_entries(path) -> dict:
    with safe_open(path, framework="numpy") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}, f.metadata()


@fuzz(800)
@given(data=safetensors_files())
def test_fuzz_safetensors_headers(tmp_path_factory, data):
    header = safetensors_target(data)
    if header is None:
        return
    # Whatever we accept, the reference implementation accepts with the same entries and metadata.
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    path.write_bytes(data)
    entries, metadata = reference_entries(path)
    assert entries == {n: (e.dtype, e.shape) for n, e in header.tensors.items()}
    assert (metadata or {}) == header.metadata


def valid_file() -> bytes:
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(2, 5, dtype=torch.bfloat16),
        "c": torch.arange(7, dtype=torch.uint8),
        "empty": torch.empty(0, 4, dtype=torch.float16),
    }
    return save(tensors, metadata={"format": "pt"})


VALID = valid_file()


BYTE_MUTATIONS = 20_000
MANIFEST_MUTATIONS = 4_000
OPEN_MUTATIONS = 30


def test_fuzz_safetensors_bytes():
    """Byte-level mutations of a valid file written by the reference library (seeded, reproducible); enough of them
    are accepted (and then read back whole) that a reader refusing everything would fail here."""
    rng = random.Random(11)
    accepted = sum(safetensors_target(mutate_bytes(VALID, rng)) is not None for _ in range(BYTE_MUTATIONS))
    assert accepted >= 300, accepted  # measured: 441 of the 20,000


def test_valid_file_parses_and_extreme_cases_are_refused():
    assert safetensors_target(VALID) is not None  # the targets can accept: the fuzzing above is not vacuous
    refused = [
        b"",
        b"\x08\x00\x00",
        safetensors_file({}, length=2**64 - 1),
        safetensors_file({}, length=MAX_HEADER_BYTES + 1),
        safetensors_file("[" * 100_000 + "]" * 100_000),  # deeper than Python's JSON recursion limit
        safetensors_file({"__metadata__": []}),
        safetensors_file({"__metadata__": {"k": 1}}),
        safetensors_file({"t": {"dtype": "U8", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}),
        safetensors_file({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
        safetensors_file({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0\0"),
    ]
    assert [safetensors_target(d) for d in refused] == [None] * len(refused)


# --- manifest ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_manifest(converted):
    return json.loads((converted[1] / mf.OVERLAY_DIR / mf.MANIFEST_NAME).read_text())


def test_base_manifest_is_accepted(base_manifest):
    assert manifest_target(json.dumps(base_manifest).encode()) is not None
    assert mf.parse_experts(base_manifest)  # the base has every section the fuzzing below mutates


def test_fuzz_manifest_readers(base_manifest):
    text = json.dumps(base_manifest)
    rng = random.Random(11)
    accepted = sum(manifest_target(mutate_manifest(text, rng)) is not None for _ in range(MANIFEST_MUTATIONS))
    assert accepted >= 400, accepted  # measured: 570 of the 4,000 (readers refusing everything would pass without it)


@fuzz(300)
@given(text=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_fuzz_manifest_raw_text(text):
    manifest_target(text)


def test_manifest_size_and_depth_limits():
    assert manifest_target(b" " * (mf.MAX_MANIFEST_BYTES + 1)) is None
    assert manifest_target(b"[" * 100_000 + b"]" * 100_000) is None
    assert manifest_target(dumps_with_deep({"schema": DEEP}, mf.MAX_JSON_DEPTH + 1)) is None


@pytest.fixture(scope="module")
def writable_out(converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz-open") / "out"
    shutil.copytree(converted[1], out)
    return out


def test_fuzz_manifest_through_runtime_open_and_verify(base_manifest, writable_out):
    """The whole reading path: runtime.open(verify=True) + loading every layer, and `verify`."""
    text = json.dumps(base_manifest)
    rng = random.Random(11)
    for _ in range(OPEN_MUTATIONS):
        COUNTS["open+verify"] += 1
        (writable_out / mf.OVERLAY_DIR / mf.MANIFEST_NAME).write_bytes(mutate_manifest(text, rng))
        try:
            runtime.open(writable_out, backend="torch", verify=True).load_all()
            COUNTS["open+verify opened"] += 1
        except GlmPackError as err:
            assert err.message
        try:
            report = verify(writable_out)  # problems are reported, or one clear error raised
        except GlmPackError as err:
            assert err.message
        else:
            assert report.ok or report.problems
