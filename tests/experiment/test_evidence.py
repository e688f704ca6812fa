"""The results page's generated block is what the committed JSON says: it is current (``python -m
sao.experiment.evidence`` rewrites it; the suite only compares), and its counts and post-hoc estimand are
computed as stated, on a small made-up grid."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from sao.experiment import evidence

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_results_page_block_is_the_one_the_committed_json_gives():
    page = (DOCS / "README.md").read_text()
    assert evidence.rewrite(page, evidence.block(DOCS)) == page, "run `python -m sao.experiment.evidence` and commit"


def _results() -> dict:
    def arm(p, diverged):
        return {
            "pass_at_1": p,
            "runs": {f"s{i}": {"diverged": ["reward fell"] if d else []} for i, d in enumerate(diverged)},
        }

    cells = [
        {"name": "a", "arms": {"dis": arm([0.5, 0.6, 0.4], [0, 0, 1]), "none": arm([0.3, 0.5, 0.4], [1, 1, 0])}},
        {"name": "b", "arms": {"dis": arm([0.2, 0.3, 0.3], [0, 0, 0]), "none": arm([0.2, 0.1, 0.1], [1, 0, 1])}},
    ]
    return {"seeds": [1, 2, 3], "cells": cells}


def test_divergence_counts_every_arm_in_every_cell():
    per_cell, total, seeds = evidence.divergence(_results())
    assert per_cell == {"a": {"dis": 1, "none": 2}, "b": {"dis": 0, "none": 2}} and total == {"dis": 1, "none": 4}
    assert seeds == 3


def test_the_whole_grid_estimand_takes_one_value_per_seed_over_the_cells():
    grid = evidence.whole_grid(_results())
    per_seed = [((0.5 - 0.3) + (0.2 - 0.2)) / 2, ((0.6 - 0.5) + (0.3 - 0.1)) / 2, ((0.4 - 0.4) + (0.3 - 0.1)) / 2]
    half = 4.302652729911275 * statistics.stdev(per_seed) / 3**0.5  # t(0.975, 2)
    assert grid["delta"] == pytest.approx(statistics.fmean(per_seed)) and grid["n"] == 3 and grid["cells"] == 2
    assert (grid["ci_low"], grid["ci_high"]) == pytest.approx((grid["delta"] - half, grid["delta"] + half))


def test_the_critics_explained_variance_is_summarised_per_arm_over_every_cell_and_seed():
    results = _results()
    given = {  # (cell, arm): each seed's (EV at the warmup's end, EV over the last 10 steps)
        ("a", "dis"): [(-0.1, 0.02), (0.0, -0.01), (0.1, 0.03)],
        ("b", "dis"): [(0.2, 0.05), (0.0, 0.01), (-0.2, -0.04)],
        ("a", "none"): [(0.0, 0.0), (0.0, 0.1), (0.3, 0.2)],
        ("b", "none"): [(0.1, 0.1), (-0.1, 0.1), (0.0, 0.1)],
    }
    for cell in results["cells"]:
        for name, block in cell["arms"].items():
            for run, (warmup, last) in zip(block["runs"].values(), given[cell["name"], name], strict=True):
                run["checks"] = {"critic_ev_warmup_end": warmup, "critic_ev_last10": last}
    ev = evidence.critic_ev(results)
    assert ev["dis"]["runs"] == 6 and ev["dis"]["above_0"] == 4
    assert ev["dis"]["last10_min"] == -0.04 and ev["dis"]["last10_median"] == pytest.approx(0.015)
    assert ev["none"]["above_0"] == 5 and ev["none"]["warmup_median"] == pytest.approx(0.0)
