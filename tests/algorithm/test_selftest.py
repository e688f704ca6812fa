"""`sao selftest` passes on the real algorithm and would fail if the arms differed anywhere but the mask."""

from __future__ import annotations

import pytest

from sao.algorithm import selftest
from sao.algorithm.update import SAO
from sao.cli import main
from sao.core.registry import CORRECTIONS


def test_selftest_passes_and_exits_zero(capsys):
    assert main(["selftest"]) == 0
    assert "selftest passed" in capsys.readouterr().out


def test_selftest_fails_when_the_baseline_arm_also_masks(monkeypatch):
    monkeypatch.setitem(CORRECTIONS._entries, "none", CORRECTIONS.get("dis"))
    assert selftest.run(verbose=False) is False


@pytest.mark.parametrize("band", [(0.7, 100.0), (0.01, 6.0)])
def test_selftest_fails_when_the_recipe_band_admits_everything(monkeypatch, band):
    monkeypatch.setattr(SAO, "__post_init__", lambda self: object.__setattr__(self, "ratio", band))
    assert selftest.run(verbose=False) is False
