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


def test_the_critics_explained_variance_is_summarised_per_cell_and_arm_over_its_seeds():
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
    assert ev["a", "dis"]["runs"] == 3 and ev["a", "dis"]["above_0"] == 2 and ev["b", "dis"]["above_0"] == 2
    assert ev["b", "dis"]["last10_min"] == -0.04 and ev["b", "dis"]["last10_median"] == pytest.approx(0.01)
    assert ev["a", "none"]["above_0"] == 2 and ev["b", "none"]["warmup_median"] == pytest.approx(0.0)


def test_what_the_held_out_split_shares_with_training_is_counted_from_the_split():
    from sao.tiny.arithmetic import make_split, problem

    line = " ".join(evidence.split_facts())
    split = make_split(480, 120, 0)
    trained = {problem(int(t.id.split("/")[1])) for t in split.train}
    held = {problem(int(t.id.split("/")[1])) for t in split.test}
    assert not held & trained and "120 held-out questions ask 40 problems" in line
    twins = sum(
        1 for t in split.test if (p := problem(int(t.id.split("/")[1])))[1] == "+" and (p[2], "+", p[0]) in trained
    )
    assert f"{twins} of those have their commuted twin" in line and "120 of the 120 held-out ones among them" in line


def test_a_third_confirmation_plan_is_quoted_only_once_every_seed_has_trained(tmp_path):
    root = tmp_path / "confirm-v3"
    root.mkdir()
    (root / "plan-a.yaml").write_text("question: q\n")
    assert evidence.third_confirmation(tmp_path)[-1] == (
        "- `plan-a`: still training; nothing of it is quoted before every seed has trained."
    )


def test_each_arm_is_summarised_with_its_collapsed_runs_below_the_plans_floor():
    results = {
        "plan": {"collapse_floor": 0.3},
        "cells": [
            {
                "name": "lag32",
                "arms": {
                    "dis": {"pass_at_1": [0.9, 0.1, 0.8, 0.29], "pass_at_1_mean": 0.5225},
                    "none": {"pass_at_1": [0.5, 0.3], "pass_at_1_mean": 0.4},
                },
            }
        ],
    }
    assert evidence.arm_lines(results)[-2:] == [
        "| lag32 | `dis` | 0.522 | 0.545 | 2 of 4 |",
        "| lag32 | `none` | 0.400 | 0.400 | 0 of 2 |",
    ]
    assert evidence.arm_lines({"plan": {}, "cells": results["cells"]}) == []


def test_a_gated_comparison_shows_its_verdict_alone_beside_its_finding():
    gated = {"finding": "unresolved", "verdict": "unresolved", "verdict_unadjusted": "regressed"}
    assert evidence._finding(gated) == "unresolved (alone: regressed)"
    assert evidence._finding({"finding": "flat", "verdict": "flat", "verdict_unadjusted": "flat"}) == "flat"
    assert evidence._finding({"verdict": "improved"}) == "improved"  # results written before the field existed
