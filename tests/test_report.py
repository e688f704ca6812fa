"""report.write_report on a small hand-made experiment: every plot is a real PNG and linked, the page states
the verdict and the numbers as results.json holds them, missing values read "—", bad input is a DataError,
and the page is the same on a rebuild."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_png_linked
from sao import report
from sao.errors import DataError

PLOTS = ("reward", "masked_share", "ratio_max", "explained_variance", "response_length", "kl", "evals")
SEEDS = (17, 18)
WARMUP, POLICY_STEPS = 2, 6


def _records() -> list[dict]:
    records = []
    for arm in ("dis", "none"):
        for seed in SEEDS:
            for g in range(WARMUP + POLICY_STEPS):
                policy = g >= WARMUP
                stale = (g - WARMUP) % 3 if policy else 0
                wobble = 0.01 * ((g * 7 + seed) % 5)
                masked = 0.002 * stale + wobble / 10 if policy else 0.0
                records.append(
                    {
                        "arm": arm,
                        "seed": seed,
                        "step": g,
                        "phase": "policy" if policy else "critic-warmup",
                        "policy_step": g - WARMUP if policy else None,
                        "staleness": stale,
                        "reward_mean": 0.3 + 0.02 * g + wobble + (0.03 * policy if arm == "dis" else 0.0),
                        "masked_share": masked if arm == "dis" else 0.0,
                        "would_be_masked_share": masked * 1.3,
                        "ratio_max": 1.0 + stale * 1.7 + wobble,
                        "explained_variance": None if g == 3 else -0.05 + 0.01 * g,  # a NaN stored as null
                        "response_length": 14.0 - 0.1 * g + wobble,
                        "kl_sampler_policy": 0.001 * stale + wobble / 100,
                        "grad_norm": 0.1 + wobble if policy else None,
                        "nonfinite": 0.0,
                        "skipped": False,
                        "time": 0.5,
                    }
                )
    return records


def _checks(arm: str, seed: int) -> dict:
    by_staleness = {
        str(s): {
            "steps": 2,
            "masked_share": (0.002 * s + 0.001 * (seed % 3)) if arm == "dis" else 0.0,
            "would_be_masked_share": 0.0026 * s + 0.0001 * (seed - 16),
            "ratio_max_median": 1.0 + 1.7 * s,
        }
        for s in range(3)
    }
    return {
        # a value the recipe could not compute (a run without warmup) must read "—", not "None"
        "critic_ev_warmup_end": None if (arm, seed) == ("none", 18) else -0.0421,
        "critic_ev_last10": -0.0312,
        "critic_loss_warmup_end": 0.2355,
        "critic_loss_last10": 0.2593,
        "grad_norm_mean": 0.1148,
        "grad_norm_max": 0.3404,
        "clip_bound_steps": 0,
        "clip_ever_bound": False,
        "nonfinite_tokens": 0.0,
        "skipped_steps": 0,
        "masked_share_by_staleness": by_staleness,
        "masked_share_max": 0.0292 if arm == "dis" else 0.0,
        "lag0_abs_log_ratio_mean": 3.2e-07,
        "lag0_abs_log_ratio_max": 6.2e-06,
        "reward_first10": 0.303,
        "reward_last10": 0.468,
        "response_length_last10": 13.84,
        "truncation_share_last10": 0.0,
    }


def _fold(first: float, last: float) -> dict:
    return {"first": first, "last": last, "mean": (first + last) / 2, "max": last, "min": first, "n": POLICY_STEPS}


def _eval(label: str, pass_at_1: float, reply: str = "2+2=4\n#### 4") -> dict:
    return {
        "label": label,
        "pass_at_1": pass_at_1,
        "samples": 4,
        "mean_reply_tokens": 14.02,
        "truncation_share": 0.0,
        "seconds": 0.9,
        "examples": [
            {"question": "What is 2+2?", "reply": reply, "gold": "4", "correct": True},
            {"question": "What is 3-5?", "reply": "3-5=2\n#### 2", "gold": "-2", "correct": False},
        ],
    }


def _results() -> dict:
    compare = {
        "before": "none",
        "after": "dis",
        "delta": 0.012345,
        "ci_low": -0.0211,
        "ci_high": 0.04578,
        "noise_floor": 0.13219,
        "verdict": "unresolved",
        "reason": "unresolved: delta +0.012, 95% interval [-0.021, +0.046] over 2 seeds covers 0.",
        "unit": "seed",
        "n": 2,
        "before_mean": 0.49,
        "after_mean": 0.5023,
        "proxy_delta": -0.004,
        "proxy_diverges": False,
    }
    vs_base = {
        arm: {**compare, "delta": d, "ci_low": d - 0.05, "ci_high": d + 0.05, "before_mean": 0.41, "after_mean": a}
        for arm, d, a in (("dis", 0.0923, 0.5023), ("none", 0.08, 0.49))
    }
    keys = ("reward_mean", "masked_share", "would_be_masked_share", "ratio_max", "explained_variance")
    curves = {arm: {k: _fold(0.1, 0.2) for k in keys} for arm in ("dis", "none")}
    curves["dis"]["kl_sampler_policy"] = _fold(0.0, 0.004)
    curves["none"]["response_length"] = {"first": None, "last": None, "mean": None, "max": None, "min": None, "n": 0}
    return {
        "question": "Does masking tokens outside the IS band (dis) beat the plain ratio (none) on held-out pass@1?",
        "versions": {"sao": "0.1.0", "python": "3.11.7", "torch": "2.4.0"},
        "config": {"model": "tiny", "data": "tiny", "band": [0.7, 6.0], "lag": 4, "lr": 1e-3, "grad_clip": 1.0},
        "data": {"source": "generated", "train": 480, "test": 120},
        "evals": {
            "base": [_eval("base-0", 0.40), _eval("base-1", 0.42)],
            "dis": [_eval("dis-s17", 0.51, reply="a|b\nc"), _eval("dis-s18", 0.4946)],
            "none": [_eval("none-s17", 0.48), _eval("none-s18", 0.50)],
        },
        "pass_at_1": {"base": [0.40, 0.42], "dis": [0.51, 0.4946], "none": [0.48, 0.50]},
        "noise_floor": {"base_pass_at_1": [0.40, 0.42], "run_std": 0.01414, "runs": 2, "floor": 0.13219},
        "compare": compare,
        "verdict": compare["verdict"],
        "reason": compare["reason"],
        "vs_base": vs_base,
        "curves": curves,
        "checks": {f"{arm}-s{seed}": _checks(arm, seed) for arm in ("dis", "none") for seed in SEEDS},
        "warnings": ["[dis-s17] the band (0.7, 6.0) is dead at these settings"],
        "wall_time": {"train": {"dis-s17": 35.8}, "eval": {"base-0": 0.9}, "train_total": 35.8, "eval_total": 0.9},
    }


def _write_experiment(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(_results(), indent=1))
    (folder / "train_log.json").write_text(json.dumps(_records(), indent=1))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    folder = _write_experiment(tmp_path_factory.mktemp("experiment"))
    path = report.write_report(folder)
    assert path == folder / "report.md"
    return folder, path.read_text(encoding="utf-8")


def _row(text: str, first_cell: str) -> list[str]:
    """The cells of the markdown table row whose first cell is ``first_cell``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r}")


@pytest.mark.parametrize("stem", PLOTS)
def test_every_plot_is_a_real_png_and_is_linked(built, stem):
    folder, text = built
    assert_png_linked(folder, text, stem, min_bytes=10_000)


def test_report_states_the_verdict_reason_and_the_numbers(built):
    _, text = built
    c = _results()["compare"]
    assert "**unresolved**" in text
    assert c["reason"] in text
    assert f"{c['delta']:+.4f}" == "+0.0123"  # the format the page promises, spelled out once
    assert _row(text, "delta")[1] == f"{c['delta']:+.4f}"
    assert _row(text, "95% interval")[1] == f"[{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]"
    assert _row(text, "noise floor")[1] == f"±{c['noise_floor']:.4f}"
    assert _row(text, "unit, n")[1] == "seed, 2"
    assert _row(text, "proxy delta (training reward, last 10 steps)")[1] == "-0.0040"
    assert _row(text, "dis-s18")[1] == "0.4946"
    assert _row(text, "**base mean**")[1] == "**0.4100**"


def test_masked_share_by_staleness_is_the_mean_over_seeds(built):
    _, text = built
    results = _results()
    row = _row(text, "2")  # staleness 2
    dis = [results["checks"][f"dis-s{s}"]["masked_share_by_staleness"]["2"]["masked_share"] for s in SEEDS]
    none = [results["checks"][f"none-s{s}"]["masked_share_by_staleness"]["2"]["would_be_masked_share"] for s in SEEDS]
    assert row[2] == f"{sum(dis) / 2:.4f}"
    assert row[4] == f"{sum(none) / 2:.4f}"
    assert results["warnings"][0] in text


def test_missing_values_render_as_a_dash(built):
    _, text = built
    row = _row(text, "critic EV at warmup end")
    labels = _row(text, "check")[1:]
    assert row[1 + labels.index("none-s18")] == "—"
    assert row[1 + labels.index("dis-s17")] == "-0.0421"
    assert _row(text, "response_length")[2:7] == ["—"] * 5
    assert "None" not in text and "nan" not in text.lower()


def test_example_replies_are_escaped_for_a_table(built):
    _, text = built
    assert "a\\|b<br>c" in text
    assert "2+2=4<br>#### 4" in text


def test_rebuilding_gives_the_same_page(built):
    folder, text = built
    assert report.write_report(folder).read_text(encoding="utf-8") == text


def test_a_missing_results_file_is_a_data_error(tmp_path):
    folder = _write_experiment(tmp_path / "x")
    (folder / "results.json").unlink()
    with pytest.raises(DataError, match=r"results\.json is missing"):
        report.write_report(folder)
    assert not (folder / "report.md").exists()


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("train_log.json", None, "missing"),
        ("results.json", "{not json", "not readable JSON"),
        ("results.json", "[1, 2]", "JSON dict"),
        ("results.json", '{"verdict": "flat"}', "lacks 'compare'"),
        ("train_log.json", '[{"arm": "dis"}]', "record 0 lacks"),
    ],
)
def test_malformed_input_is_a_one_line_data_error(tmp_path, name, content, match):
    folder = _write_experiment(tmp_path / "x")
    if content is None:
        (folder / name).unlink()
    else:
        (folder / name).write_text(content)
    with pytest.raises(DataError, match=match) as error:
        report.write_report(folder)
    assert "\n" not in str(error.value)


def test_formatting_helpers():
    assert report.fmt(None) == report.fmt(float("nan")) == "—"
    assert report.fmt(6.0) == "6.0" and report.fmt(0.123456) == "0.1235" and report.fmt(3) == "3"
    assert report.fmt(True) == "yes" and report.fmt([0.7, 6.0]) == "(0.7, 6.0)"
    assert report.fmt_share(0.0123) == "0.0123" and report.fmt_share(3e-6) == "3.0e-06"
    assert report.fmt_signed(-0.00404) == "-0.0040"
