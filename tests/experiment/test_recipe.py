"""results.json: every curves entry folds its series, the checks are computed from the log, arms share
everything but the mask, `sao recipe` runs end to end, and it is exactly the one-cell `sao sweep`."""

from __future__ import annotations

import json
import math

import pytest

from helpers import run_log
from sao.cli import main
from sao.core.timeline import TIMING_FIELDS
from sao.experiment.results import checks, curves, fold, mean_over_seeds, numeric_keys


def test_fold_ignores_missing_values_and_keeps_order():
    assert fold([None, 2.0, float("nan"), -1.0, 5.0, None]) == {
        "first": 2.0,
        "last": 5.0,
        "mean": 2.0,
        "max": 5.0,
        "min": -1.0,
        "n": 3,
    }
    assert fold([None, None])["mean"] is None
    assert fold([True, 1.0])["n"] == 1, "booleans are flags, not numbers"


def _record(step, phase, **values):
    base = {"arm": "dis", "seed": 17, "step": step, "phase": phase, "staleness": 0, "skipped": False}
    return {**base, **values}


def test_curves_fold_every_numeric_series_of_the_policy_steps():
    records = [_record(0, "critic-warmup", reward_mean=0.9, ratio_max=1.0, grad_norm=None)]
    records += [
        _record(1 + i, "policy", reward_mean=r, ratio_max=m, grad_norm=g)
        for i, (r, m, g) in enumerate([(0.1, 2.0, 0.5), (0.3, None, 0.25), (0.2, 4.0, float("nan"))])
    ]
    folded = curves(records)
    assert set(folded) == {"staleness", "reward_mean", "ratio_max", "grad_norm"}
    assert folded["reward_mean"] == fold([0.1, 0.3, 0.2])
    assert folded["reward_mean"]["first"] == 0.1 and folded["reward_mean"]["last"] == 0.2
    assert folded["ratio_max"] == {"first": 2.0, "last": 4.0, "mean": 3.0, "max": 4.0, "min": 2.0, "n": 2}
    assert folded["grad_norm"]["n"] == 2


def test_mean_over_seeds_averages_step_by_step():
    a = [_record(i, "policy", reward_mean=v) for i, v in enumerate([0.0, 0.2, 0.4])]
    b = [_record(i, "policy", reward_mean=v, seed=18) for i, v in enumerate([0.2, 0.4, None])]
    merged = mean_over_seeds([a, b])
    assert [r["reward_mean"] for r in merged] == pytest.approx([0.1, 0.3, 0.4])
    assert "reward_mean" in numeric_keys(merged)


def test_checks_group_the_mask_by_staleness_and_count_faults():
    rows = [
        _record(
            0,
            "critic-warmup",
            explained_variance=0.05,
            critic_loss=0.3,
            masked_share=0.0,
            would_be_masked_share=0.0,
            ratio_max=1.0,
            grad_norm=None,
            nonfinite=0,
            abs_log_ratio_mean=1e-7,
            abs_log_ratio_max=2e-6,
            reward_mean=0.3,
            response_length=10,
            truncation_share=0.0,
        )
    ]
    for i, (s, m, w, g) in enumerate([(1, 0.01, 0.01, 0.5), (2, 0.03, 0.03, 1.5), (1, 0.02, 0.02, float("nan"))]):
        rows.append(
            _record(
                1 + i,
                "policy",
                staleness=s,
                masked_share=m,
                would_be_masked_share=w,
                ratio_max=2.0 + i,
                grad_norm=g,
                skipped=not math.isfinite(g),
                nonfinite=3 * (i == 2),
                explained_variance=0.1,
                critic_loss=0.2,
                abs_log_ratio_mean=0.1,
                abs_log_ratio_max=0.5,
                reward_mean=0.4,
                response_length=12,
                truncation_share=0.0,
            )
        )
    c = checks(rows, grad_clip=1.0)
    assert c["masked_share_by_staleness"]["1"]["masked_share"] == pytest.approx(0.015)
    assert c["masked_share_by_staleness"]["1"]["ratio_max_median"] == pytest.approx(3.0)
    assert c["masked_share_by_staleness"]["2"]["steps"] == 1
    assert c["clip_bound_steps"] == 1 and c["clip_ever_bound"] is True
    assert c["skipped_steps"] == 1 and c["nonfinite_tokens"] == 3
    assert c["critic_ev_warmup_end"] == 0.05 and c["lag0_abs_log_ratio_max"] == 2e-6
    assert c["grad_norm_mean"] == pytest.approx(1.0)
    for r in rows:  # beside a fixed baseline the log carries the critic's own EV: that one is the critic's
        r["critic_explained_variance"] = -0.2
    assert checks(rows, grad_clip=1.0)["critic_ev_last10"] == pytest.approx(-0.2)


SMALL = [
    "--preset",
    "tiny",
    "--batch-size",
    "16",
    "--steps",
    "6",
    "--critic-warmup",
    "2",
    "--lr",
    "3e-3",
    "--train-prompts",
    "64",
    "--test-prompts",
    "24",
    "--eval-samples",
    "2",
    "--base-evals",
    "2",
    "--quiet",
]


@pytest.fixture(scope="module")
def recipe_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "exp"
    assert main(["recipe", *SMALL, "--lag", "2", "--out", str(out)]) == 0
    return out


def test_recipe_end_to_end_arms_share_all_but_the_mask(recipe_run):
    out = recipe_run
    results = json.loads((out / "results.json").read_text())
    log = run_log(out)
    dis = [r for r in log if r["arm"] == "dis"]
    none = [r for r in log if r["arm"] == "none"]
    assert len(dis) == len(none) == 8
    # Same prompts, same sampler seeds, same critic: identical until the first masked token changes a gradient.
    assert dis[0]["reward_mean"] == none[0]["reward_mean"] and dis[0]["critic_loss"] == none[0]["critic_loss"]
    assert [r["staleness"] for r in dis] == [r["staleness"] for r in none]
    (cell,) = results["cells"]
    assert cell["name"] == "lag2-lr0.003-band0.7-6" and results["grid"]["arms"] == ["dis", "none"]
    for arm in ("dis", "none"):
        series = [r["reward_mean"] for r in log if r["arm"] == arm and r["phase"] == "policy"]
        assert cell["arms"][arm]["curves"]["reward_mean"] == pytest.approx(fold(series))
    assert results["verdict"] in {"improved", "regressed", "flat", "unresolved"} and results["reason"]
    main_comparison = cell["compare"]["dis_vs_none"]
    assert main_comparison["before"] == "none" and main_comparison["after"] == "dis"
    assert results["verdict"] == main_comparison["verdict"] and results["primary"]["comparison"] == "dis_vs_none"
    assert len(results["base"]["evals"]) == 2 and results["base"]["noise_floor"] is not None
    assert results["data"]["test"] == 24 and len(cell["arms"]["dis"]["evals"][0]["per_task"]) == 24
    assert set(cell["arms"]["dis"]["runs"]) == {"dis-s17"} and set(cell["arms"]["none"]["runs"]) == {"none-s17"}
    assert (out / "report.md").exists() and (out / "plots").is_dir()


@pytest.mark.slow
def test_recipe_is_the_one_cell_sweep(recipe_run, tmp_path, capsys):
    """`sao sweep` over the recipe's one cell and arms runs the same code path: the same results.json (the
    command that wrote it and the timings aside) and the same train_log.json."""
    out = tmp_path / "sweep"
    small = [a for i, a in enumerate(SMALL) if a != "--lr" and (i == 0 or SMALL[i - 1] != "--lr")]  # the grid's lrs
    argv = ["sweep", *small, "--lags", "2", "--lrs", "3e-3", "--arms", "dis", "none", "--out", str(out)]
    assert main(argv) == 0
    assert "dis_vs_none verdict:" in capsys.readouterr().out

    def strip(obj):
        volatile = {*TIMING_FIELDS, "seconds", "this_invocation", "wall_time", "command", "rollouts_per_s"}
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in volatile}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj

    for name in ("results.json", "train_log.json", "experiment.json"):
        sweep, recipe = (json.loads((d / name).read_text()) for d in (out, recipe_run))
        assert strip(sweep) == strip(recipe), name


def test_sao_compare_on_the_recipes_scores_as_lm_eval_files_gives_the_recipes_comparison(recipe_run, tmp_path):
    """The recipe's own per-task scores (each arm's evals, the base evals as the noise runs), written as lm-eval
    samples files: `sao compare` gives the verdict, reason, interval and equivalence test results.json holds."""
    from helpers import lm_eval_file
    from sao.experiment import compare

    results = json.loads((recipe_run / "results.json").read_text())
    (cell,) = results["cells"]
    folders = {}
    for name, evals in (
        ("none", cell["arms"]["none"]["evals"]),
        ("dis", cell["arms"]["dis"]["evals"]),
        ("base", results["base"]["evals"]),
    ):
        for i, e in enumerate(evals):
            lm_eval_file(tmp_path / name / f"run{i}", e["per_task"])
        folders[name] = tmp_path / name
    found = compare.run(folders["none"], folders["dis"], tmp_path / "out", noise=folders["base"])
    got, expected = found["compare"]["after_vs_before"], cell["compare"]["dis_vs_none"]
    reason = expected["reason"].split(" Warning: the proxy rose")[0]  # the one sentence the training log adds
    assert got["verdict"] == expected["verdict"] and got["reason"] == reason
    for key, value in expected.items():
        if key in ("before", "after", "proxy_delta", "proxy_diverges", "reason"):
            continue
        assert got[key] == (pytest.approx(value, rel=1e-12, abs=1e-15) if isinstance(value, float) else value), key
