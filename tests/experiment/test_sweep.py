"""`sao sweep`: the divergence rule, the grid, and one small end-to-end sweep through the CLI."""

from __future__ import annotations

import json

import pytest

from helpers import run_log
from sao.cli import main
from sao.core.errors import ConfigError
from sao.experiment.results import divergence, interval
from sao.experiment.runner import Grid, cell_name


def _policy(rewards, skipped=(), nonfinite=0):
    warm = [{"phase": "critic-warmup", "reward_mean": 0.3, "skipped": False, "nonfinite": 0}]
    return warm + [
        {"phase": "policy", "reward_mean": r, "skipped": i in skipped, "nonfinite": nonfinite if i == 0 else 0}
        for i, r in enumerate(rewards)
    ]


def test_divergence_names_collapse_skips_and_nonfinite_tokens():
    steady = _policy([0.3] * 10 + [0.35] * 10)
    assert divergence(steady) == []
    collapsed = _policy([0.3] * 10 + [0.1] * 10)
    assert divergence(collapsed) == ["training reward collapsed 0.300 -> 0.100"]
    just_above = _policy([0.3] * 10 + [0.151] * 10)
    assert divergence(just_above) == []
    faulty = _policy([0.3] * 20, skipped={3, 4}, nonfinite=7)
    assert divergence(faulty) == ["2 step(s) skipped for a non-finite loss or gradient", "7 non-finite token(s)"]
    assert divergence(_policy([0.3] * 5 + [0.0] * 5)) == [], "too short to call a collapse"


def test_interval_is_a_t_interval_over_seeds():
    mean, lo, hi = interval([0.2, 0.4])
    assert mean == pytest.approx(0.3) and mean - lo == pytest.approx(hi - mean)
    assert hi - mean == pytest.approx(12.7062 * 0.141421 / 2**0.5, rel=1e-4)
    assert interval([0.5]) == (0.5, 0.5, 0.5)


def test_grid_needs_the_baseline_and_names_cells():
    with pytest.raises(ConfigError, match="include 'none'"):
        Grid(arms=("dis", "tis"))
    with pytest.raises(ConfigError, match="distinct"):
        Grid(arms=("none", "none"))
    grid = Grid(lags=(1, 8), lrs=(1e-3,), bands=((0.7, 6.0), (0.2, 4.0)))
    assert [c["name"] for c in grid.cells()] == [
        "lag1-lr0.001-band0.7-6",
        "lag8-lr0.001-band0.7-6",
        "lag1-lr0.001-band0.2-4",
        "lag8-lr0.001-band0.2-4",
    ]
    assert cell_name(16, 3e-3, (0.7, 6.0)) == "lag16-lr0.003-band0.7-6"


def test_bad_band_spec_is_one_line(tmp_path, capsys):
    assert main(["sweep", "--preset", "tiny", "--bands", "0.7-6", "--out", str(tmp_path / "s")]) == 2
    assert "LO,HI" in capsys.readouterr().err


@pytest.mark.slow
def test_small_sweep_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = [
        "sweep",
        "--preset",
        "tiny",
        "--lags",
        "1",
        "4",
        "--lrs",
        "3e-3",
        "--arms",
        "dis",
        "none",
        "tis",
        "--train-runs",
        "2",
        "--steps",
        "4",
        "--critic-warmup",
        "1",
        "--batch-size",
        "16",
        "--train-prompts",
        "64",
        "--test-prompts",
        "16",
        "--eval-samples",
        "2",
        "--base-evals",
        "2",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "dis_vs_none" in printed and "tis_vs_none" in printed
    summary = json.loads((out / "results.json").read_text())
    assert [c["name"] for c in summary["cells"]] == ["lag1-lr0.003-band0.7-6", "lag4-lr0.003-band0.7-6"]
    assert summary["command"].startswith("sao sweep --preset tiny --lags 1 4")
    for cell in summary["cells"]:
        assert set(cell["arms"]) == {"dis", "none", "tis"}
        assert set(cell["compare"]) == {"dis_vs_none", "tis_vs_none"}
        for arm in cell["arms"].values():
            assert len(arm["pass_at_1"]) == 2 and len(arm["runs"]) == 2 and arm["curves"]["reward_mean"]["n"] == 4
            lo, hi = arm["pass_at_1_ci"]
            assert lo <= arm["pass_at_1_mean"] <= hi
    # every run of a cell trained with that cell's lag: its log shows the staleness cycle of that lag
    log = run_log(out / "cells" / "lag4-lr0.003-band0.7-6" / "runs" / "dis-s17")
    assert [r["staleness"] for r in log if r["phase"] == "policy"] == [0, 1, 2, 3]
    assert (out / "report.md").exists()
    # resuming a finished sweep recomputes the summary from the files and trains nothing
    before = (out / "cells" / "lag1-lr0.003-band0.7-6" / "evals" / "none-s18.json").read_bytes()
    assert main([*argv, "--resume"]) == 0
    assert (out / "cells" / "lag1-lr0.003-band0.7-6" / "evals" / "none-s18.json").read_bytes() == before
