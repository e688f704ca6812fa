"""`sao confirm PLAN`: a tiny plan (one cell, arms dis / none / random, 2 fresh seeds, 4 policy steps) runs end to
end through the one runner — plan first in the report, Holm across the family, the random control at the dis arm's
share, pass@1 over steps, provenance — and the checks a plan must pass before anything trains: its power for its
smallest effect, gatekeeping, and the committed plan read and re-aggregated as it was."""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import run_log
from sao.algorithm.corrections import row_keys
from sao.algorithm.update import SAO
from sao.cli import main
from sao.core import stats
from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.core.io import clean
from sao.core.timeline import TIMING_FIELDS
from sao.experiment import confirm
from sao.experiment.runner import Experiment, Grid, dis_shares_by_staleness
from sao.tiny import arithmetic as tiny

CELL = "lag2-lr0.003-band0.7-6"
SETTINGS = {
    "batch_size": 16,
    "steps": 4,
    "critic_warmup": 1,
    "train_prompts": 64,
    "test_prompts": 16,
    "eval_samples": 2,
    "base_evals": 2,
    "eval_every": 2,
    "micro_batch": 16,
}
OTHER_WEIGHTS = "ab" * 32


def write_plan(folder, **changes) -> str:
    """A tiny plan in ``folder`` citing an exploratory run (seeds 17 and 18, other model weights) beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    explored = folder / "explored" / "results.json"
    explored.parent.mkdir(exist_ok=True)
    explored.write_text(
        json.dumps(
            {
                "seeds": [17, 18],
                "provenance": {"model": {"weights_sha256": OTHER_WEIGHTS}},
                "base": {"noise_floor": 0.1},
            }
        )
    )
    plan = {
        "question": "Does dis beat none in this tiny cell?",
        "written": "by the test, before the run",
        "preset": "tiny",
        "settings": SETTINGS,
        "arms": ["dis", "none", "random"],
        "primary": {"lag": 2, "lr": 3.0e-3, "comparison": "dis_vs_none", "expect": "improved"},
        "secondary": ["dis_vs_random", "random_vs_none"],
        "seeds": [201, 202],
        "exploratory": ["explored/results.json"],
        "correction": "holm",
        "alpha": 0.05,
        "expected_sd": 0.05,
        **changes,
    }
    path = folder / "plan.json"
    path.write_text(json.dumps({k: v for k, v in plan.items() if v is not None}, indent=1))
    return str(path)


@pytest.fixture(scope="module")
def confirmed(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("confirm")
    plan = write_plan(root / "plan")
    out = root / "out"
    assert main(["confirm", plan, "--out", str(out), "--quiet", "--accept-low-power"]) == 0  # a tiny plan: 2 seeds
    return plan, out, json.loads((out / "results.json").read_text())


def test_the_plan_runs_end_to_end_and_the_report_states_it_first(confirmed):
    plan, out, results = confirmed
    assert results["seeds"] == [201, 202] and results["config"]["training"]["seed"] == 201
    assert (out / "plan.json").read_text() == Path(plan).read_text(), "the plan is kept as given"
    assert set(results["cells"][0]["arms"]) == {"dis", "none", "random"}
    block = results["confirmation"]
    assert block["family_size"] == 3 and [r["comparison"] for r in block["family"]] == [
        "dis_vs_none",
        "dis_vs_random",
        "random_vs_none",
    ]
    assert [r["p_holm"] for r in block["family"]] == pytest.approx(stats.holm([r["p_value"] for r in block["family"]]))
    assert all(r["p_holm"] >= r["p_value"] and r["unit"] == "seed" and r["n"] == 2 for r in block["family"])
    assert results["primary"] == {"cell": CELL, "comparison": "dis_vs_none"}
    assert results["verdict"] == block["primary"]["verdict"] and block["outcome"] in {
        "confirmed",
        "not confirmed",
        "contradicted",
    }
    assert "dis_vs_random" in results["cells"][0]["compare"], "a planned comparison against another arm is made"
    text = (out / "report.md").read_text()
    assert text.index("## Plan (fixed before the run)") < text.index("## What came out") < text.index("## Verdict")
    assert "seeds 201, 202" in text and "explored/results.json used seeds 17, 18" in text
    assert "Holm-adjusted p" in text
    assert "`random` (a random token mask at the share dis masked at each staleness level" in text


def test_the_random_arm_masks_the_share_the_dis_arm_masked_at_each_staleness_level(confirmed):
    _, out, _ = confirmed
    for seed in (201, 202):
        runs = out / "cells" / CELL / "runs"
        dis = run_log(runs / f"dis-s{seed}")
        share = dis_shares_by_staleness(dis)
        assert len(share) == 3, "one share per staleness level 0, 1, 2 at lag 2"
        random_run = json.loads((runs / f"random-s{seed}" / "config.json").read_text())
        algorithm = random_run["config"]["algorithm"]
        assert algorithm["correction"] == "random" and algorithm["random_mask_share"] == list(share)
        log = run_log(runs / f"random-s{seed}")
        none = run_log(runs / f"none-s{seed}")
        assert log[0]["reward_mean"] == none[0]["reward_mean"], "the arms share prompts and sampler seeds"


def test_pass_at_1_over_steps_exists_per_arm_and_seed(confirmed):
    _, out, results = confirmed
    for name, arm in results["cells"][0]["arms"].items():
        curve = arm["eval_curve"]
        assert curve["policy_steps"] == [0, 2, 4] and set(curve["per_seed"]) == {"201", "202"}
        for i, seed in enumerate((201, 202)):
            assert curve["per_seed"][str(seed)][-1] == arm["pass_at_1"][i], f"{name}: the last point is the final eval"
        starts = [curve["per_seed"][s][0] for s in ("201", "202")]
        assert starts == [json.loads((out / "evals" / f"start-s{s}.json").read_text())["pass_at_1"] for s in (201, 202)]
    assert (out / "plots" / "eval_curve.png").stat().st_size > 1000 and "plots/eval_curve.png" in (
        out / "report.md"
    ).read_text()


def test_results_carry_provenance_and_warn_about_the_exploratory_model(confirmed):
    _, out, results = confirmed
    p = results["provenance"]
    assert p["model"]["weights_sha256"] == tiny.SHIPPED_SHA256 and p["model"]["tokenizer_sha256"]
    assert p["data"]["test"] == 16 and p["machine"]["torch_threads"] >= 1 and p["code"]["versions"]["torch"]
    assert p["pieces_without_provenance"] == []
    assert any("explored/results.json ran on other model weights" in w for w in p["warnings"])
    run = json.loads((out / "cells" / CELL / "runs" / "dis-s201" / "provenance.json").read_text())
    assert run[-1]["model"]["weights_sha256"] == tiny.SHIPPED_SHA256
    assert "## Model, data and machine" in (out / "report.md").read_text()


def test_aggregating_a_run_made_on_other_weights_warns(confirmed, tmp_path, capsys):
    plan, out, _ = confirmed
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    stamp = copy / "cells" / CELL / "runs" / "none-s202" / "provenance.json"
    blocks = json.loads(stamp.read_text())
    blocks[-1]["model"]["weights_sha256"] = OTHER_WEIGHTS
    stamp.write_text(json.dumps(blocks))
    assert main(["confirm", plan, "--out", str(copy), "--resume", "--quiet"]) == 0
    warnings = json.loads((copy / "results.json").read_text())["provenance"]["warnings"]
    assert any("model weights differ" in w and f"{CELL} none-s202" in w for w in warnings)
    assert "model weights differ" in capsys.readouterr().err


def test_intermediate_evals_leave_training_unchanged(confirmed, tmp_path):
    """The dis run of seed 201 again, without --eval-every: the same log step for step (timings aside)."""
    from sao.training import build

    _, out, _ = confirmed
    config = Config.load("tiny", **{**SETTINGS, "eval_every": 0}, lag=2, lr=3e-3, arm="dis", seed=201)
    plain = build.trainer(config, tmp_path / "run", progress=False).run()
    evaluated = run_log(out / "cells" / CELL / "runs" / "dis-s201")
    volatile = {*TIMING_FIELDS, "rollouts_per_s"}
    assert [{k: v for k, v in r.items() if k not in volatile} for r in clean(plain)] == [
        {k: v for k, v in r.items() if k not in volatile} for r in evaluated
    ]


def test_a_changed_plan_cannot_resume(confirmed, tmp_path):
    _, out, _ = confirmed
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    changed = write_plan(tmp_path / "changed", alpha=0.01)
    with pytest.raises(ConfigError, match="differs from the plan"):
        confirm.run(changed, copy, resume=True, progress=False)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"seeds": [18, 301]}, "not fresh: explored/results.json used \\[18\\]"),
        ({"seeds": {"first": 16, "count": 2}}, "not fresh"),
        (
            {"grid": {"lags": [2, 8]}, "primary": {"lag": 4, "lr": 3e-3, "comparison": "dis_vs_none"}},
            "primary cell .* is not a cell",
        ),
        ({"secondary": ["tis_vs_none"]}, "arm\\(s\\) \\['tis'\\]"),
        ({"settings": {"lag": 4}}, "set by the plan"),
        ({"correction": "bonferroni"}, "correction must be one of"),
        ({"exploratory": ["nowhere/results.json"]}, "no such file"),
        ({"hypothesis": "x"}, "unknown field"),
        ({"seeds": []}, "lacks 'seeds'"),
        ({"expected_sd": None}, "states no expected_sd, .* add expected_sd"),
        ({"smallest_effect": -0.1}, "smallest_effect must be a number > 0"),
        ({"expected_sd": 0}, "expected_sd must be a number > 0"),
        ({"gatekeeping": "yes"}, "gatekeeping must be true or false"),
        ({"arms": ["dis", "none", "dis+median"]}, "unknown arm 'dis\\+median': an arm is a correction rule"),
        ({"secondary": ["dis_vs_dis+batch-mean"]}, "arm\\(s\\) \\['dis\\+batch-mean'\\]"),
    ],
)
def test_a_plan_is_checked_before_anything_trains(tmp_path, capsys, changes, needle):
    plan = write_plan(tmp_path / "plan", **changes)
    with pytest.raises(ConfigError, match=needle):
        confirm.read_plan(plan)
    assert main(["confirm", plan, "--out", str(tmp_path / "out")]) == 2
    assert "error: plan" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_seeds_of_reads_every_kind_of_exploratory_file():
    assert confirm.seeds_of({"seeds": [17, 18, 19, 20]}) == {17, 18, 19, 20}  # results.json, old sweep.json
    assert confirm.seeds_of({"config": {"seed": 5, "train_runs": 3}}) == {5, 6, 7}  # experiment.json
    assert confirm.seeds_of({"config": {"seed": 9}}) == {9}  # a sao train run's config.json
    assert confirm.seeds_of({"cells": [{"arms": {"dis": {"runs": {"dis-s4": {"seed": 4}}}}}]}) == {4}
    # the committed sweeps' format: "seeds" counts the seeds, which start at the config's seed
    assert confirm.seeds_of({"seeds": 4, "config": {"seed": 17}}) == {17, 18, 19, 20}
    committed = Path(__file__).resolve().parents[2] / "docs" / "sweep-tiny-lr2e-3" / "sweep.json"
    assert confirm.seeds_of(json.loads(committed.read_text())) == {17, 18, 19, 20}


def _plan(tmp_path, cells: int = 3, gatekeeping: bool = False) -> confirm.Plan:
    grid = Grid(lags=tuple(range(1, cells + 1)), lrs=(1e-3,), arms=("dis", "none"))
    return confirm.Plan(
        path=tmp_path / "p.yaml",
        sha256="0",
        question="q",
        written=None,
        config=Config(),
        grid=grid,
        primary={
            "cell": grid.cells()[0]["name"],
            "comparison": "dis_vs_none",
            "after": "dis",
            "before": "none",
            "expect": "improved",
        },
        secondary=["dis_vs_none"],
        seeds=[1, 2],
        correction="holm",
        alpha=0.05,
        gatekeeping=gatekeeping,
    )


def _rows(plan: confirm.Plan, p_values: list[float], verdicts: list[str] | None = None) -> list[dict]:
    """Made-up family rows, as ``family_rows`` writes them, with these p-values (primary first)."""
    verdicts = verdicts or ["improved"] * len(p_values)
    return [
        {
            "cell": cell,
            "comparison": key,
            "after": "dis",
            "before": "none",
            "delta": 0.2,
            "ci_low": 0.01,
            "ci_high": 0.39,
            "p_value": p,
            "unit": "seed",
            "n": 8,
            "noise_floor": 0.1,
            "verdict_unadjusted": v,
            "reason_unadjusted": f"{v}: made up.",
        }
        for (cell, key), p, v in zip(plan.family, p_values, verdicts, strict=True)
    ]


def test_holm_turns_a_lone_improvement_unresolved_when_the_family_is_large(tmp_path):
    plan = _plan(tmp_path)
    block = confirm.decide(_rows(plan, [0.03, 0.001, 0.5]), plan)
    assert [r["p_holm"] for r in block["family"]] == pytest.approx([0.06, 0.003, 0.5])
    assert [r["verdict"] for r in block["family"]] == ["unresolved", "improved", "unresolved"]
    assert "alone it would be improved" in block["family"][0]["reason"] and block["outcome"] == "not confirmed"
    assert block["family"][2]["verdict_unadjusted"] == "improved" and block["gate"] is None


def test_gatekeeping_tests_the_primary_at_full_alpha_then_holm_over_the_rest(tmp_path):
    """The same family as above under gatekeeping: the primary's p 0.03 stands at alpha 0.05 (Holm over 3 made it
    0.06), and the two secondary comparisons are Holm-adjusted between themselves."""
    plan = _plan(tmp_path, gatekeeping=True)
    block = confirm.decide(_rows(plan, [0.03, 0.001, 0.5]), plan)
    assert block["gatekeeping"] and block["gate"] == "open" and block["outcome"] == "confirmed"
    assert [r["p_holm"] for r in block["family"]] == pytest.approx([0.03, 0.002, 0.5])
    assert [r["verdict"] for r in block["family"]] == ["improved", "improved", "unresolved"]
    assert [r["stage"] for r in block["family"]] == ["primary", "secondary", "secondary"]
    assert "alone at the full alpha (gatekeeping)" in block["family"][0]["reason"]


def test_gatekeeping_reports_but_does_not_claim_the_family_when_the_primary_fails(tmp_path):
    plan = _plan(tmp_path, gatekeeping=True)
    block = confirm.decide(_rows(plan, [0.2, 0.001, 0.002], ["unresolved", "improved", "flat"]), plan)
    assert block["gate"] == "closed" and block["outcome"] == "not confirmed"
    assert [r["verdict"] for r in block["family"]] == ["unresolved"] * 3
    assert [r["claimed"] for r in block["family"]] == [True, False, False]
    second = block["family"][1]
    assert second["verdict_unadjusted"] == "improved" and second["p_holm"] == pytest.approx(0.002)
    assert "not claimed: under gatekeeping" in second["reason"] and "alone this would be improved" in second["reason"]


def test_the_plan_states_its_power_for_its_smallest_effect_before_the_run(tmp_path):
    plan = confirm.read_plan(
        write_plan(tmp_path / "plan", smallest_effect=0.04, expected_sd=0.05, seeds=list(range(201, 209)))
    )
    power = plan.power
    assert plan.gatekeeping, "a plan stating smallest_effect gatekeeps unless it says otherwise"
    assert power["alpha_primary"] == 0.05 and power["seeds"] == 8
    assert power["power"] == pytest.approx(stats.power(0.04, 0.05, 8, 0.05))
    assert power["seeds_for_power"] == stats.seeds_for_power(0.04, 0.05, 0.05)
    assert power["sd_source"] == "the plan's expected_sd"
    assert power["smallest_effect_source"] == "the plan's smallest_effect"
    assert power["power"] < 0.8 and "below 0.8" in power["warning"] and plan.to_dict()["power"] == power
    holm_all = confirm.read_plan(
        write_plan(tmp_path / "holm", smallest_effect=0.04, gatekeeping=False, seeds=list(range(201, 209)))
    )
    assert not holm_all.gatekeeping and holm_all.power["alpha_primary"] == pytest.approx(0.05 / 3)
    assert holm_all.power["power"] < power["power"] == pytest.approx(holm_all.power["power_at_alpha"])
    few = confirm.read_plan(write_plan(tmp_path / "few", smallest_effect=0.5, expected_sd=0.01)).power
    assert few["power"] == 0.0 and "exact sign-flip p cannot go below 0.5" in few["warning"], "2 seeds: nothing"
    big = confirm.read_plan(
        write_plan(tmp_path / "big", smallest_effect=0.05, expected_sd=0.02, seeds=list(range(201, 241)))
    ).power
    assert big["power"] > 0.99 and big["warning"] is None


def test_without_expected_sd_the_power_takes_the_cited_runs_per_seed_deltas(tmp_path):
    plan_path = write_plan(tmp_path / "plan", expected_sd=None)
    explored = Path(plan_path).parent / "explored" / "results.json"
    dis, none = [0.40, 0.45, 0.38, 0.50], [0.30, 0.31, 0.33, 0.35]
    data = json.loads(explored.read_text())
    data["cells"] = [{"name": CELL, "arms": {"dis": {"pass_at_1": dis}, "none": {"pass_at_1": none}}}]
    explored.write_text(json.dumps(data))
    power = confirm.read_plan(plan_path).power
    sd = statistics.stdev([a - b for a, b in zip(dis, none, strict=True)])
    assert power["sd"] == pytest.approx(sd) and "4 per-seed dis − none deltas" in power["sd_source"]
    assert (
        power["smallest_effect"] == 0.1
        and "no smallest_effect: the noise floor of explored" in (power["smallest_effect_source"])
    )


def test_confirm_prints_the_power_before_it_trains(tmp_path, monkeypatch, capsys):
    plan = write_plan(tmp_path / "plan", smallest_effect=0.04)
    done = {
        "confirmation": {"family": [], "outcome": "not confirmed"},
        "reason": "made up",
        "warnings": [],
        "provenance": {"warnings": []},
    }
    monkeypatch.setattr(confirm, "run", lambda *args, **kwargs: done)
    assert main(["confirm", plan, "--out", str(tmp_path / "out"), "--quiet", "--accept-low-power"]) == 0
    out, err = capsys.readouterr()
    assert "the primary alone, then holm" in out and "power 0.00 to detect δ 0.04" in out
    assert "warning: the plan's power is 0.00, below 0.8" in err


COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "confirm-tiny"


def test_the_committed_plan_still_parses_and_keeps_holm_over_everything():
    plan = confirm.read_plan(COMMITTED / "plan.yaml")
    assert not plan.gatekeeping and plan.smallest_effect is None and len(plan.family) == 18
    power = plan.power
    assert "4 per-seed dis − none deltas in lag16-lr0.002-band0.7-6 of ../sweep-tiny-lr2e-3" in power["sd_source"]
    assert power["alpha_primary"] == pytest.approx(0.05 / 18) and power["power"] < 0.8 < power["power_at_alpha"]
    assert "below 0.8" in power["warning"]


def test_the_committed_run_re_aggregates_identically():
    plan = confirm.read_plan(COMMITTED / "plan.yaml")
    summary = json.loads((COMMITTED / "run" / "results.json").read_text())
    before = summary["confirmation"]
    block = confirm.confirmation(summary, plan)
    assert block["outcome"] == before["outcome"] and block["family_size"] == before["family_size"] == 18
    for new, old in zip(block["family"], before["family"], strict=True):
        assert (new["cell"], new["comparison"], new["verdict"]) == (old["cell"], old["comparison"], old["verdict"])
        for key in ("delta", "ci_low", "ci_high", "p_value", "p_holm"):
            assert new[key] == pytest.approx(old[key], rel=1e-12), (new["cell"], new["comparison"], key)


def _batch(B: int = 6, T: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 30:] = False
    sampler = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return {
        "logprobs": sampler + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
        "sampler_logprobs": sampler,
        "values": torch.zeros(B, T, dtype=torch.float64),
        "rewards": torch.tensor([1.0, 0, 1, 0, 1, 1], dtype=torch.float64),
        "action_mask": mask,
        "random_key": row_keys(17, 5, B),
    }


def test_the_random_rule_drops_its_share_whatever_the_ratio_and_however_the_batch_is_split():
    batch = _batch()
    rule = SAO(correction="random", random_mask_share=0.25)
    whole = rule.update(batch)
    assert 0.15 < whole.stats["masked_share"] < 0.35
    dropped = batch["action_mask"] & ~whole.mask
    in_band = (whole.ratio > 0.7) & (whole.ratio < 6.0)
    assert (dropped & in_band).any(), "it drops tokens dis would keep"
    shifted = rule.update({**batch, "logprobs": batch["logprobs"] + 1.0})
    assert torch.equal(batch["action_mask"] & ~shifted.mask, dropped), "the mask does not depend on the ratio"
    n = float(batch["action_mask"].sum())
    halves = [rule.update({k: v[rows] for k, v in batch.items()}, normalizer=n) for rows in (slice(0, 3), slice(3, 6))]
    assert torch.equal(torch.cat([h.mask for h in halves]), whole.mask), "micro-batches draw the same mask"
    assert torch.equal(torch.cat([h.coefficients for h in halves]), whole.coefficients)
    none = SAO(correction="none").update(batch)
    kept = whole.mask
    assert torch.equal(whole.coefficients[kept], none.coefficients[kept]), "elsewhere it is the plain ratio"
    assert torch.equal(SAO(correction="random").update(batch).coefficients, none.coefficients), "share 0 is none"


def test_the_random_arm_needs_a_share_or_a_dis_arm_before_it(tmp_path):
    from sao.experiment.runner import Experiment

    with pytest.raises(ConfigError, match="random-mask-share"):
        Config(arm="random")
    with pytest.raises(ConfigError, match="list dis before random"):
        Experiment(Config.load("tiny"), Grid(lags=(1,), lrs=(1e-3,), arms=("random", "dis", "none")), tmp_path / "x")
    with pytest.raises(ConfigError, match="share in"):
        SAO(correction="random", random_mask_share=1.0)


def test_an_arm_can_set_the_baseline_and_its_comparison_parses_one_way_only(tiny_model_dir, tmp_path):
    tiny_run = {
        "batch_size": 8,
        "micro_batch": 8,
        "steps": 2,
        "critic_warmup": 1,
        "train_prompts": 16,
        "test_prompts": 8,
        "eval_samples": 1,
        "base_evals": 2,
    }
    arms = ["dis", "none", "dis+batch-mean"]
    plan_path = write_plan(
        tmp_path / "plan",
        settings=tiny_run,
        arms=arms,
        seeds=[211],
        secondary=["dis_vs_dis+batch-mean", "dis+batch-mean_vs_none"],
    )
    plan = confirm.read_plan(plan_path)
    assert plan.grid.arms == tuple(arms) and ("dis", "dis+batch-mean") in [
        confirm._comparison(plan.path, k, plan.grid.arms, "secondary") for k in plan.secondary
    ]
    out = confirm.run(plan_path, tmp_path / "out", progress=False, accept_low_power=True)
    cell = out["cells"][0]
    assert list(cell["arms"]) == arms
    assert {a: (b["correction"], b["baseline"]) for a, b in cell["arms"].items()} == {
        "dis": ("dis", "critic"),
        "none": ("none", "critic"),
        "dis+batch-mean": ("dis", "batch-mean"),
    }
    assert list(cell["arms"]["dis+batch-mean"]["runs"]) == ["dis+batch-mean-s211"]
    assert {"dis_vs_dis+batch-mean", "dis+batch-mean_vs_none"} <= set(cell["compare"])
    saved = json.loads((tmp_path / "out" / "cells" / CELL / "runs" / "dis+batch-mean-s211" / "config.json").read_text())
    assert (
        saved["config"]["algorithm"]["baseline"] == "batch-mean" and saved["config"]["algorithm"]["correction"] == "dis"
    )
    assert {r["arm"] for r in run_log(tmp_path / "out")} == set(arms)  # the experiment's log names arms as given
    assert "dis+batch-mean" in (tmp_path / "out" / "report.md").read_text()


def test_a_bad_arm_name_is_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match="unknown arm 'dis\\+nope'") as error:
        Grid(arms=("dis", "none", "dis+nope"))
    assert "\n" not in str(error.value)
    code = main(["sweep", "--preset", "tiny", "--arms", "dis", "none", "dis+nope", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "unknown arm 'dis+nope'" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("name", ["tiny", "tiny-calc", "mismatch"])
def test_the_second_confirmations_plans_parse_with_power_for_their_smallest_effect(name):
    """docs/confirm-v2: each plan states its smallest effect and sd, tests its primary alone at full alpha, and has
    at least 80% power for that effect before a seed trains."""
    plan = confirm.read_plan(COMMITTED.parent / "confirm-v2" / f"{name}.yaml")
    assert plan.gatekeeping and plan.smallest_effect is not None and len(plan.seeds) >= 20
    assert plan.power["alpha_primary"] == plan.alpha == 0.05 and plan.power["power"] >= 0.8
    assert plan.power["warning"] is None


@pytest.mark.parametrize("name", ["tiny", "tiny-calc", "mismatch"])
def test_the_second_confirmations_plans_read_and_re_aggregate_exactly_as_they_did(name):
    """A plan written before decision rules, rank estimands and collapse rates existed reads to the block its run
    stored, and re-aggregating its run gives every row of the family field for field as stored; the only addition is
    the power the runs realised."""
    plan = confirm.read_plan(COMMITTED.parent / "confirm-v2" / f"{name}.yaml")
    stored = json.loads((COMMITTED.parent / "confirm-v2" / name / "results.json").read_text())
    assert plan.decision_rule == "observed-above-delta" and json.loads(json.dumps(plan.to_dict())) == stored["plan"]
    block = confirm.confirmation(stored, plan)
    assert block["family"] == stored["confirmation"]["family"]
    assert {k: v for k, v in block.items() if k != "realised_power"} == stored["confirmation"]
    realised = block["realised_power"]
    assert realised["seeds"] == len(plan.seeds) and realised["alpha"] == plan.power["alpha_primary"]


def _sized(plan: confirm.Plan, rows: list[tuple[str, str, float, float | None]]) -> list[dict]:
    """Made-up rows under the direction rule: (verdict, magnitude, p, minimum-effect p) each, primary first."""
    out = _rows(plan, [p for _, _, p, _ in rows], [v for v, _, _, _ in rows])
    for row, (_, magnitude, _, beyond) in zip(out, rows, strict=True):
        row.update(verdict_rule="direction", magnitude_unadjusted=magnitude, p_beyond=beyond)
    return out


def test_a_significant_reversal_of_the_primary_is_a_contradiction_not_unresolved(tmp_path):
    plan = replace(_plan(tmp_path, cells=2, gatekeeping=True), decision_rule="direction", smallest_effect=0.1)
    block = confirm.decide(
        _sized(plan, [("regressed", "undetermined", 0.007, 1.0), ("improved", "beyond δ", 0.001, 0.01)]), plan
    )
    first = block["primary"]
    assert first["verdict"] == "regressed" and first["finding"] == "regressed, size against δ undetermined"
    assert block["outcome"] == "contradicted" and block["gate"] == "closed" and block["decision_rule"] == "direction"
    assert "it is regressed, size against δ undetermined" in block["family"][1]["reason"]


def test_under_the_minimum_effect_rule_the_primary_needs_its_interval_beyond_delta(tmp_path):
    plan = replace(
        _plan(tmp_path, gatekeeping=True), decision_rule="minimum-effect", smallest_effect=0.1, expected_effect=0.2
    )
    short = confirm.decide(
        _sized(
            plan,
            [
                ("improved", "undetermined", 0.001, 0.2),
                ("improved", "beyond δ", 0.001, 0.001),
                ("unresolved", "undetermined", 0.3, 1.0),
            ],
        ),
        plan,
    )
    assert short["primary"]["verdict"] == "improved" and short["outcome"] == "not confirmed"
    assert short["gate"] == "closed", "the direction alone does not open the gate under this rule"
    far = confirm.decide(
        _sized(
            plan,
            [
                ("improved", "beyond δ", 0.001, 0.01),
                ("improved", "beyond δ", 0.001, 0.03),
                ("improved", "beyond δ", 0.001, 0.04),
            ],
        ),
        plan,
    )
    assert far["outcome"] == "confirmed" and far["gate"] == "open"
    # the secondaries' minimum-effect p, Holm-adjusted between them: 0.06 and 0.06 are not below 0.05
    assert [r["p_beyond_holm"] for r in far["family"]] == pytest.approx([0.01, 0.06, 0.06])
    assert [r["magnitude"] for r in far["family"]] == ["beyond δ", "undetermined", "undetermined"]
    assert [r["finding"] for r in far["family"]][1] == "improved, size against δ undetermined"
    assert "its size is undetermined" in far["family"][1]["reason"]


def test_a_direction_that_holm_withdraws_is_flat_when_it_was_shown_within_delta(tmp_path):
    plan = replace(_plan(tmp_path), decision_rule="direction", smallest_effect=0.1)
    block = confirm.decide(
        _sized(
            plan,
            [
                ("improved", "within δ", 0.03, 1.0),
                ("improved", "beyond δ", 0.001, 0.001),
                ("unresolved", "undetermined", 0.5, 1.0),
            ],
        ),
        plan,
    )
    first = block["family"][0]
    assert first["p_holm"] == pytest.approx(0.06) and first["verdict"] == "flat" and first["magnitude"] == "within δ"
    assert first["reason"].startswith("flat after Holm's correction: alone it would be improved")
    assert block["family"][1]["finding"] == "improved, by more than δ"


def _explored(plan_path: str, dis: list[float], none: list[float]) -> None:
    explored = Path(plan_path).parent / "explored" / "results.json"
    data = json.loads(explored.read_text())
    data["cells"] = [{"name": CELL, "arms": {"dis": {"pass_at_1": dis}, "none": {"pass_at_1": none}}}]
    explored.write_text(json.dumps(data))


SEEDS_30 = list(range(201, 231))


def test_a_plan_pre_registers_the_minimum_effect_rule_the_rank_estimand_and_collapse_rates(tmp_path):
    path = write_plan(
        tmp_path / "plan",
        decision_rule="minimum-effect",
        smallest_effect=0.05,
        expected_effect=0.12,
        rank_estimand=True,
        collapse_floor=0.05,
        secondary=["dis_vs_random", "collapse:dis_vs_none"],
        seeds=SEEDS_30,
    )
    plan = confirm.read_plan(path)
    assert plan.decision_rule == "minimum-effect" and plan.verdict_rule == "direction"
    assert (CELL, "collapse:dis_vs_none") in plan.family and len(plan.family) == 3
    power = plan.power
    assert power["power"] == pytest.approx(stats.power_beyond(0.12, 0.05, 0.05, 30, 0.05))
    assert power["effect"] == 0.12 and "beyond δ 0.05" in power["summary"] and "true delta is 0.12" in power["summary"]
    model = stats.Mixture(collapse_after=0.0, collapse_before=0.0, sd=0.05, healthy=0.5)
    assert power["power_rank"] == pytest.approx(stats.mixture_power(model, 0.05, 30, 0.05)["rank"])
    stated = plan.to_dict()
    assert stated["decision_rule"] == "minimum-effect" and stated["rank_estimand"] and stated["collapse_floor"] == 0.05
    assert "decision_rule" not in confirm.read_plan(write_plan(tmp_path / "old")).to_dict(), "an older plan: as it was"


def test_a_mixture_power_model_is_fitted_to_the_cited_runs_and_simulated(tmp_path):
    plan_path = write_plan(
        tmp_path / "plan",
        expected_sd=None,
        smallest_effect=0.05,
        decision_rule="direction",
        collapse_floor=0.05,
        power_model={},
        seeds=SEEDS_30,
    )
    dis = [0.60, 0.0, 0.64, 0.58, 0.0, 0.62, 0.61, 0.63]
    none = [0.55, 0.57, 0.0, 0.56, 0.54, 0.58, 0.57, 0.55]
    _explored(plan_path, dis, none)
    power = confirm.read_plan(plan_path).power
    fitted = stats.fit_mixture(none, dis, 0.05)
    assert power["model"] == "mixture" and power["mixture"] == fitted.to_dict()
    assert power["power"] == stats.mixture_power(fitted, 0.05, 30, 0.05, ranks=False)["t"]
    assert "explored/results.json" in power["mixture_source"] and "collapses with probability 0.25" in power["summary"]
    normal = confirm.read_plan(
        write_plan(
            tmp_path / "normal", expected_sd=fitted.sd, smallest_effect=0.05, decision_rule="direction", seeds=SEEDS_30
        )
    ).power
    assert power["power"] < normal["power"], "the collapses cost power the healthy sd alone does not show"
    given = confirm.read_plan(
        write_plan(
            tmp_path / "given",
            expected_sd=None,
            smallest_effect=0.05,
            seeds=SEEDS_30,
            collapse_floor=0.05,
            power_model={"collapse": [0.2, 0.0], "sd": 0.06, "healthy": 0.6},
        )
    )
    assert given.power["mixture"] == stats.Mixture(0.2, 0.0, 0.06, 0.6).to_dict()
    assert given.power["mixture_source"] == "the plan's power_model"


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"decision_rule": "magnitude"}, "decision_rule must be one of"),
        ({"decision_rule": "minimum-effect", "smallest_effect": 0.05}, "needs smallest_effect .* and expected_effect"),
        ({"decision_rule": "minimum-effect", "smallest_effect": 0.05, "expected_effect": 0.05}, "above δ"),
        ({"rank_estimand": "yes"}, "rank_estimand must be true or false"),
        ({"secondary": ["collapse:dis_vs_none"]}, "a collapse: comparison needs collapse_floor"),
        ({"collapse_floor": 1.5}, "collapse_floor must be a pass@1 in"),
        ({"power_model": {"sd": 0.1}}, "power_model needs collapse_floor"),
        ({"power_model": {"sd": 0.1}, "collapse_floor": 0.05}, "expected_sd and power_model both"),
        ({"power_model": {"spread": 0.1}, "collapse_floor": 0.05, "expected_sd": None}, "power_model must be"),
        ({"power_model": {"sd": 0.1}, "collapse_floor": 0.05, "expected_sd": None}, "leaves .* to be fitted"),
        (
            {"power_model": {"collapse": 1.0, "sd": 0.1, "healthy": 0.5}, "collapse_floor": 0.05, "expected_sd": None},
            "probability",
        ),
    ],
)
def test_the_new_plan_fields_are_checked_before_anything_trains(tmp_path, capsys, changes, needle):
    plan = write_plan(tmp_path / "plan", **changes)
    with pytest.raises(ConfigError, match=needle):
        confirm.read_plan(plan)
    assert main(["confirm", plan, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "error: plan" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def _summary(passes: dict[str, list[float]]) -> dict:
    """A results.json content with one cell whose arms scored these per-seed pass@1 (each over 5 tasks alike)."""
    arms = {
        arm: {
            "pass_at_1": p,
            "evals": [{"per_task": [x] * 5} for x in p],
            "runs": {f"{arm}-s{i}": {"checks": {"reward_last10": 0.5}} for i in range(len(p))},
        }
        for arm, p in passes.items()
    }
    return {"cells": [{"name": CELL, "arms": arms, "compare": {}}], "base": {"run_std": 0.02, "runs": 3}}


def test_the_family_carries_the_rank_estimand_and_the_collapse_rates_beside_the_mean(tmp_path):
    plan = confirm.read_plan(
        write_plan(
            tmp_path / "plan",
            smallest_effect=0.05,
            decision_rule="direction",
            rank_estimand=True,
            collapse_floor=0.05,
            seeds=list(range(201, 213)),
            secondary=["collapse:dis_vs_none"],
        )
    )
    dis = [0.6, 0.62, 0.0, 0.61, 0.63, 0.6, 0.0, 0.64, 0.62, 0.0, 0.61, 0.6]
    none = [0.55, 0.56, 0.54, 0.0, 0.57, 0.55, 0.56, 0.54, 0.55, 0.0, 0.56, 0.57]
    summary = _summary({"dis": dis, "none": none, "random": none})
    block = confirm.confirmation(summary, plan)
    primary, collapse = block["family"]
    deltas = [a - b for a, b in zip(dis, none, strict=True)]
    assert primary["rank"] == stats.rank_estimate(deltas).to_dict() and primary["rank"]["hodges_lehmann"] > 0
    assert primary["collapse"]["after_collapsed"] == 3 and primary["collapse"]["before_collapsed"] == 2
    assert primary["magnitude"] is not None and primary["finding"].startswith(primary["verdict"])
    assert collapse["kind"] == "collapse" and collapse["p_value"] == stats.collapse_compare(none, dis, 0.05).p_value
    assert collapse["verdict"] == "unresolved" and "dis collapsed in 3 of 12 seeds" in collapse["reason_unadjusted"]
    assert block["realised_power"]["sd"] == pytest.approx(statistics.stdev(deltas))
    assert block["realised_power"]["mixture"]["collapse_after"] == pytest.approx(3 / 12)


def test_a_plan_defines_arms_by_name_and_each_trains_with_its_settings(tiny_model_dir, tmp_path):
    define = {
        "dis-lambda1": {"correction": "dis", "gae_lambda": 1.0},
        "none-bf16": {"correction": "none", "sampler_dtype": "bfloat16"},
    }
    path = write_plan(
        tmp_path / "plan",
        arms=["dis", "none", "dis-lambda1", "none-bf16"],
        define=define,
        primary={"lag": 2, "lr": 3.0e-3, "comparison": "dis-lambda1_vs_dis"},
        secondary=["none-bf16_vs_none"],
    )
    plan = confirm.read_plan(path)
    assert plan.grid.define == define and plan.to_dict()["grid"]["define"] == define
    assert plan.grid.rule_of("none-bf16") == "none" and plan.grid.settings_of("dis+batch-mean") == {
        "correction": "dis",
        "baseline": "batch-mean",
    }
    experiment = Experiment(plan.config, plan.grid, tmp_path / "out", seeds=plan.seeds)  # settings checked, no run
    cell = plan.grid.cells()[0]
    assert experiment._run_config(cell, "dis-lambda1", 201).algorithm.gae_lambda == 1.0
    assert experiment._run_config(cell, "none-bf16", 201).source.sampler_dtype == "bfloat16"
    assert experiment._run_config(cell, "dis", 201).algorithm.gae_lambda is None
    assert experiment._arm_record(cell, "dis-lambda1")["settings"] == define["dis-lambda1"]
    assert "define" not in Grid().to_dict(), "a grid without defined arms is recorded as before"


@pytest.mark.parametrize(
    ("define", "arms", "needle"),
    [
        ({"dis+x": {"correction": "dis"}}, ["dis", "none", "dis+x"], "must be letters"),
        ({"tis": {"correction": "dis"}}, ["dis", "none", "tis"], "already an arm's name"),
        ({"a": {"gae_lambda": 1}}, ["dis", "none", "a"], "needs its settings with a correction rule"),
        ({"a": {"correction": "dis", "lag": 3}}, ["dis", "none", "a"], "which the grid's cells and the seeds set"),
        ({"a": {"correction": "dis"}}, ["dis", "none"], "defined but not among the arms"),
        ({"a": {"correction": "dis", "gae_lamda": 1}}, ["dis", "none", "a"], "did you mean 'gae_lambda'"),
    ],
)
def test_a_defined_arm_is_checked_before_anything_trains(tmp_path, capsys, define, arms, needle):
    plan = write_plan(tmp_path / "plan", arms=arms, define=define, secondary=[])
    with pytest.raises(ConfigError, match=needle):
        confirm.read_plan(plan)
    assert main(["confirm", plan, "--out", str(tmp_path / "out")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_the_power_model_is_fitted_to_the_comparison_power_fit_names(tmp_path):
    """A primary whose arms no cited run trained: the mixture's sd and healthy pass@1 come from the comparison the
    plan names instead, its collapse probabilities from the plan."""
    define = {"dis-lambda1": {"correction": "dis", "gae_lambda": 1.0}}
    fit = {"cell": CELL, "comparison": "dis_vs_none"}
    path = write_plan(
        tmp_path / "plan",
        arms=["dis", "none", "dis-lambda1"],
        define=define,
        secondary=[],
        primary={"lag": 2, "lr": 3.0e-3, "comparison": "dis-lambda1_vs_dis"},
        expected_sd=None,
        smallest_effect=0.05,
        decision_rule="direction",
        collapse_floor=0.05,
        seeds=SEEDS_30,
        power_model={"collapse": 0.05},
        power_fit=fit,
    )
    dis = [0.60, 0.0, 0.64, 0.58, 0.66, 0.62, 0.61, 0.63]
    none = [0.55, 0.57, 0.50, 0.56, 0.54, 0.58, 0.57, 0.55]
    _explored(path, dis, none)
    plan = confirm.read_plan(path)
    fitted = stats.fit_mixture(none, dis, 0.05)
    assert plan.power["mixture"] == stats.Mixture(0.05, 0.05, fitted.sd, fitted.healthy, fitted.collapsed).to_dict()
    assert f"(dis − none in {CELL})" in plan.power["mixture_source"] and plan.to_dict()["power_fit"] == fit
    for bad, needle in [({"cell": CELL}, "power_fit must be"), ({**fit, "comparison": "dis_vs_tis"}, "lack")]:
        bad_path = write_plan(
            tmp_path / "bad",
            arms=["dis", "none", "dis-lambda1"],
            define=define,
            secondary=[],
            expected_sd=None,
            smallest_effect=0.05,
            collapse_floor=0.05,
            power_model={"collapse": 0.05},
            power_fit=bad,
        )
        _explored(bad_path, dis, none)
        with pytest.raises(ConfigError, match=needle):
            confirm.read_plan(bad_path)


def test_the_lag_interaction_compares_a_comparisons_per_seed_delta_across_cells(tmp_path):
    path = write_plan(
        tmp_path / "plan",
        grid={"lags": [2, 4], "lrs": [3.0e-3]},
        smallest_effect=0.05,
        decision_rule="direction",
        rank_estimand=True,
        seeds=list(range(201, 209)),
        secondary=["dis_vs_none", "interaction:dis_vs_none"],
    )
    plan = confirm.read_plan(path)
    other = "lag4-lr0.003-band0.7-6"
    assert plan.family == [(CELL, "dis_vs_none"), (other, "dis_vs_none"), (other, "interaction:dis_vs_none")]
    here = {"dis": [0.70, 0.72, 0.69, 0.71, 0.73, 0.70, 0.68, 0.72], "none": [0.50] * 8, "random": [0.5] * 8}
    there = {"dis": [0.52, 0.55, 0.50, 0.51, 0.53, 0.54, 0.50, 0.52], "none": [0.50] * 8, "random": [0.5] * 8}
    summary = _summary(here)
    summary["cells"].append({**_summary(there)["cells"][0], "name": other})
    row = confirm.confirmation(summary, plan)["family"][2]
    gap = [(a - 0.5) - (b - 0.5) for a, b in zip(here["dis"], there["dis"], strict=True)]
    assert row["kind"] == "interaction" and row["delta"] == pytest.approx(statistics.fmean(gap))
    assert row["verdict"] == "improved" and row["rank"] == stats.rank_estimate(gap).to_dict()
    assert row["after"] == f"dis − none in {CELL}" and row["before"] == f"dis − none in {other}"
    with pytest.raises(ConfigError, match="the grid has one cell"):
        confirm.read_plan(write_plan(tmp_path / "one", secondary=["interaction:dis_vs_none"]))


def test_a_plan_below_its_power_target_is_refused_unless_accepted(tmp_path, capsys, monkeypatch, faults):
    """Power 0.00 (2 seeds: the exact sign-flip p cannot go below 0.5): refused in one line saying how many seeds
    would do, before a line is printed or a file written; --accept-low-power runs it as planned."""
    from helpers import refused_in_one_line

    plan = write_plan(tmp_path / "plan", smallest_effect=0.04)
    out = tmp_path / "out"
    line = refused_in_one_line(
        capsys,
        ["confirm", plan, "--out", str(out)],
        out,
        "the plan's power is 0.00, below 0.8",
        "--accept-low-power",
        "add fresh seeds",
    )
    assert f"{confirm.read_plan(plan).power['seeds_for_power']} seeds would give 0.8" in line
    with pytest.raises(ConfigError, match="--accept-low-power"):
        confirm.run(plan, out, progress=False)
    assert not out.exists()
    done = {
        "confirmation": {"family": [], "outcome": "not confirmed"},
        "reason": "made up",
        "warnings": [],
        "provenance": {"warnings": []},
    }
    monkeypatch.setattr(confirm, "run", lambda *args, **kwargs: done)
    assert main(["confirm", plan, "--out", str(out), "--quiet", "--accept-low-power"]) == 0
    faults.record("first-hour edges", "sao confirm with power 0.00 for its smallest effect")


def test_the_one_seed_verdict_advises_the_seeds_a_verdict_needs(faults):
    before, after = [0.0, 1.0, 0.0, 1.0] * 5, [1.0, 1.0, 0.0, 1.0] * 5
    verdict = stats.compare(before, after)  # one row each: one training seed per arm
    assert verdict.verdict == "unresolved" and "pass --train-runs 6 or more" in verdict.reason
    assert "--train-runs 2" not in verdict.reason
    assert stats.seeds_for_a_verdict(0.05) == 6 and stats.least_exact_p(6) < 0.05 <= stats.least_exact_p(5)
    assert stats.seeds_for_a_verdict(0.5) == 3  # 2 seeds: p >= 0.5 whatever they show
    faults.record("first-hour edges", "the advice of a one-seed verdict")
