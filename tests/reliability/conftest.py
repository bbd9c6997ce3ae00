"""Fixtures of the reliability suite: the convert suite's synthetic checkpoints, plus one converted output.

``synth_ckpt`` and ``ckpt_copy`` are tests/convert/conftest.py's fixtures, loaded from that file (pytest
allows ``pytest_plugins`` only in the top-level conftest). ``converted`` is a finished conversion of a small
MXFP4 (Quark) checkpoint with repacked experts, so its manifest has every section; treat it as read-only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from glm_pack.convert.convert import ConvertOptions, convert

_spec = importlib.util.spec_from_file_location(
    "_convert_fixtures", Path(__file__).resolve().parents[1] / "convert" / "conftest.py"
)
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
synth_ckpt = _fixtures.synth_ckpt
ckpt_copy = _fixtures.ckpt_copy


@pytest.fixture(scope="session")
def converted(synth_ckpt, tmp_path_factory):
    """(SRC, OUT) of a finished conversion with MLA layers and repacked experts."""
    src = synth_ckpt("glm-5", "mxfp4-quark", layers=4, experts=2)
    out = tmp_path_factory.mktemp("reliability") / "out"
    convert(src, out, ConvertOptions(files="copy", repack_experts="aiter-a4w4"))
    return src, out
