"""The wheel carries what ``pip install 'sao[verl]'``, ``'sao[trl]'`` and ``'sao[skyrl]'`` need: the three extras with
their tested ranges, the ``verl.plugins`` entry point, and the adapters' modules. Built from a copy of the tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a wheel build: outside make test-fast's edit loop


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    pytest.importorskip("setuptools")
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(tree)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    [built] = out.glob("sao-*.whl")
    return zipfile.ZipFile(built)


def _member(wheel: zipfile.ZipFile, suffix: str) -> str:
    [name] = [n for n in wheel.namelist() if n.endswith(suffix)]
    return wheel.read(name).decode()


def test_the_wheel_declares_the_three_extras_with_their_tested_ranges(wheel):
    metadata = _member(wheel, ".dist-info/METADATA")
    for extra in ("verl", "trl", "skyrl"):
        assert f"Provides-Extra: {extra}" in metadata
    assert 'Requires-Dist: trl<1.17,>=1.16; extra == "trl"' in metadata
    assert 'Requires-Dist: verl[verl-core]<0.10,>=0.9.1; extra == "verl"' in metadata
    assert 'Requires-Dist: skyrl<0.4,>=0.3.0; extra == "skyrl"' in metadata
    assert 'Requires-Dist: skyrl-gym<0.5,>=0.4.0; extra == "skyrl"' in metadata


def test_the_wheel_registers_the_verl_plugin_and_ships_the_adapters(wheel):
    entry_points = _member(wheel, ".dist-info/entry_points.txt")
    assert "[verl.plugins]\nsao = sao.integrations.verl" in entry_points
    names = set(wheel.namelist())
    for module in ("shared", "verl", "trl", "skyrl"):
        assert f"sao/integrations/{module}.py" in names
