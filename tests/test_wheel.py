"""The wheel that ``pip install glm-pack`` installs. Every other test imports the source tree (an editable install
or ``sys.path``), so a package folder that pyproject.toml's hand-written ``packages`` list lacks, or a data file no
``package-data`` pattern names, would be missing from the wheel with every other test still passing. Here the
wheel is built from a copy of the source tree, as pip builds it, and its files are compared with the tree's."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PACKAGES = ("packing", "convert", "runtime", "cards")  # folder X is glm_pack.X
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE")  # what the build reads besides the package folders


def source_files() -> set[str]:
    """Every file under the package folders, bytecode caches aside, as its path in the wheel."""
    return {
        f"glm_pack/{path.relative_to(REPO).as_posix()}"
        for top in PACKAGES
        for path in (REPO / top).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[zipfile.ZipFile]:
    """The wheel setuptools builds from a copy of the tree (a build inside the repo leaves ``build/`` there, whose
    stale files a later build would pack)."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        shutil.copy(REPO / name, src / name)
    for top in PACKAGES:
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    run = subprocess.run([sys.executable, "-c", build, str(dist)], cwd=src, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    with zipfile.ZipFile(dist / run.stdout.strip().splitlines()[-1]) as whl:
        yield whl


def test_wheel_holds_every_module_and_data_file_of_the_source_tree(wheel):
    packed = {name for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    expected = source_files()
    assert {"glm_pack/cards/glm-5.toml", "glm_pack/cards/model_card.md"} <= expected  # the walk sees data files
    assert not expected - packed, f"missing from the wheel: {sorted(expected - packed)}"
    assert not packed - expected, f"in the wheel but not in the source tree: {sorted(packed - expected)}"


def test_wheel_ships_the_license_text(wheel):
    """pyproject declares Apache-2.0; the wheel carries the text itself (PEP 639 ``license-files``)."""
    (licence,) = [name for name in wheel.namelist() if name.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(licence) == (REPO / "LICENSE").read_bytes()
    assert b"Apache License" in wheel.read(licence)[:200]


def test_wheel_entry_points_name_modules_it_holds(wheel):
    """The ``glm-pack`` command and the vLLM plugin (README) are declared, each naming a module of the wheel."""
    (meta,) = {name.split("/")[0] for name in wheel.namelist() if name.split("/")[0].endswith(".dist-info")}
    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel.read(f"{meta}/entry_points.txt").decode())
    declared = {
        (group, name): target for group in entry_points.sections() for name, target in entry_points[group].items()
    }
    assert {("console_scripts", "glm-pack"), ("vllm.general_plugins", "glm_pack_overlay")} <= set(declared)
    for target in declared.values():
        module = target.split(":")[0].replace(".", "/")
        assert {f"{module}.py", f"{module}/__init__.py"} & set(wheel.namelist()), target
