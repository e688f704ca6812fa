"""report.write on hand-made experiment folders: one cell × 2 arms × 2 seeds (a `sao recipe`) and 4 cells (2 lags ×
2 lrs) × 3 arms × 2 seeds (a `sao sweep`). Every plot is a real PNG linked from report.md, the verdict and every
number read as results.json holds them, a missing value reads "—", malformed input is a one-line DataError naming
the file, and a rebuild gives the same page. The committed confirmations' reports are what `sao report` writes
from their results.json, which read as they did before verdicts gained a magnitude; the realised power stands
beside the planned one, and the off-policy diagnostics show where a run logged them."""

from __future__ import annotations

import ast
import copy
import json
import statistics
import sys
from pathlib import Path

import pytest

from helpers import assert_png_linked
from sao.core.errors import DataError
from sao.experiment import report
from sao.experiment.report import fmt, fmt_interval, fmt_share, fmt_signed

PLOTS = ("reward", "masked_share", "ratio_max", "evals")
SEEDS = [17, 18]
WARMUP, POLICY_STEPS = 2, 6
BAND = [0.7, 6.0]
GRID_DIVERGED = ("lag4-lr0.003-band0.7-6", "none", 18)  # the baseline collapses in one run of one cell
GRID_IMPROVED = "lag4-lr0.003-band0.7-6"  # and there the recipe arm separates
DEAD_BAND_WARNING = "[dis-s17] the band (0.7, 6.0) is dead at these settings: <0.1% masked"  # one cell only


def _name(lag: int, lr: float) -> str:
    return f"lag{lag}-lr{lr:g}-band{BAND[0]:g}-{BAND[1]:g}"


def _records(cell: str, arm: str, seed: int, k: int) -> list[dict]:
    out = []
    for g in range(WARMUP + POLICY_STEPS):
        policy = g >= WARMUP
        stale = (g - WARMUP) % 3 if policy else 0
        wobble = 0.01 * ((g * 7 + seed + k) % 5)
        masked = 0.002 * stale + wobble / 10 if policy else 0.0
        out.append(
            {
                "cell": cell,
                "arm": arm,
                "seed": seed,
                "step": g,
                "phase": "policy" if policy else "critic-warmup",
                "policy_step": g - WARMUP if policy else None,
                "staleness": stale,
                "reward_mean": 0.3 + 0.02 * g + wobble + (0.03 * policy if arm == "dis" else 0.0),
                "masked_share": 0.0 if arm == "none" else masked,
                "would_be_masked_share": masked * 1.3,
                "ratio_min": 0.5,
                "ratio_mean": 1.0,
                "ratio_max": 1.0 + stale * 1.7 + wobble + k,
                "ratio_p99": 1.5,
                "kl_sampler_policy": 0.001 * stale + wobble / 100,
                "explained_variance": None if g == 3 else -0.05 + 0.01 * g,  # a NaN stored as null
                "critic_loss": 0.25,
                "response_length": 14.0 - 0.1 * g + wobble,
                "truncation_share": 0.0,
                "grad_norm": 0.1 + wobble if policy else None,
                "skipped": False,
                "time": 0.5,
            }
        )
    return out


def _checks(arm: str, seed: int, k: int) -> dict:
    by_staleness = {
        str(s): {
            "steps": 2,
            "masked_share": 0.0 if arm == "none" else 0.002 * s + 0.001 * (seed % 3) + 0.0001 * k,
            "would_be_masked_share": 0.0026 * s + 0.0001 * (seed - 16),
            "ratio_max_median": 1.0 + 1.7 * s + k,
        }
        for s in range(3)
    }
    return {
        # a value the runner could not compute (a run without warmup) must read "—", not "None"
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
        "masked_share_max": 0.0 if arm == "none" else 0.0292,
        "lag0_abs_log_ratio_mean": 3.2e-07,
        "lag0_abs_log_ratio_max": 6.2e-06,
        "reward_first10": 0.303 + 0.01 * k,
        "reward_last10": 0.468,
        "response_length_last10": 13.84,
        "truncation_share_last10": 0.0,
    }


def _fold(first: float | None, last: float | None) -> dict:
    mean = None if first is None else (first + last) / 2
    return {"first": first, "last": last, "mean": mean, "max": last, "min": first, "n": POLICY_STEPS}


def _eval(label: str, pass_at_1: float, reply: str = "2+2=4\n#### 4") -> dict:
    return {
        "label": label,
        "pass_at_1": pass_at_1,
        "per_task": [1.0, 0.0],
        "task_ids": [0, 1],
        "samples": 4,
        "temperature": 0.7,
        "seed": 123,
        "mean_reply_chars": 30.1,
        "mean_reply_tokens": 14.02 + pass_at_1,
        "truncation_share": 0.0,
        "seconds": 0.9,
        "batch": 480,
        "oom_retries": 0,
        "examples": [
            {"question": "What is 2+2?", "reply": reply, "gold": "4", "correct": True},
            {"question": "What is 3-5?", "reply": "3-5=2\n#### 2", "gold": "-2", "correct": False},
            {"question": "What is 1+1?", "reply": "#### 2", "gold": "2", "correct": True},
            {"question": "What is 9-1?", "reply": "#### 8", "gold": "8", "correct": True},  # the fourth is not shown
        ],
    }


def _comparison(after: str, before: str, k: int, *, verdict: str = "unresolved", floor: float | None = 0.13219) -> dict:
    delta = 0.012345 + 0.01 * k if verdict != "improved" else 0.1234
    half = 0.0334 if verdict != "improved" else 0.05
    return {
        "before": before,
        "after": after,
        "delta": delta,
        "ci_low": delta - half,
        "ci_high": delta + half,
        "noise_floor": floor,
        "verdict": verdict,
        "reason": f"{verdict}: delta {delta:+.3f} over 2 seeds (made up).",
        "unit": "seed",
        "n": 2,
        "before_mean": 0.49,
        "after_mean": 0.49 + delta,
        "proxy_delta": -0.004 + 0.001 * k,
        "proxy_diverges": False,
    }


def _experiment(lags: list[int], lrs: list[float], arms: list[str], *, base_evals: int) -> tuple[dict, list[dict]]:
    """results.json and train_log.json of a finished run, every value derived from (cell, arm, seed)."""
    cells, log, wall = [], [], {"train": {}, "eval": {}}
    base = [_eval(f"base-{i}", 0.40 + 0.01 * i) for i in range(base_evals)]
    floor = 0.13219 if base_evals >= 2 else None
    for lr in lrs:
        for lag in lags:
            name = _name(lag, lr)
            cell = {"name": name, "lag": lag, "lr": lr, "band": BAND, "arms": {}, "compare": {}, "vs_base": {}}
            for a, arm in enumerate(arms):
                k = len(cells) * 10 + a
                passes = [round(0.48 + 0.003 * k + 0.02 * i, 4) for i in range(len(SEEDS))]
                runs = {}
                for seed in SEEDS:
                    label = f"{arm}-s{seed}"
                    collapsed = (name, arm, seed) == GRID_DIVERGED
                    diverged = ["training reward collapsed 0.300 -> 0.100"] if collapsed else []
                    runs[label] = {"seed": seed, "checks": _checks(arm, seed, k), "curves": {}, "diverged": diverged}
                    log += _records(name, arm, seed, k)
                    wall["train"][f"{name} {label}"] = 35.8 + k
                    wall["eval"][f"{name} {label}"] = 0.9
                curves = {key: _fold(0.1, 0.2 + 0.001 * k) for key in report.KEY_SERIES}
                if arm == "none":
                    curves["response_length"] = _fold(None, None)
                mean = sum(passes) / len(passes)
                cell["arms"][arm] = {
                    "pass_at_1": passes,
                    "pass_at_1_mean": mean,
                    "pass_at_1_ci": [mean - 0.2123, mean + 0.2123],
                    "evals": [
                        _eval(f"{arm}-s{s}", p, reply="a|b\nc" if arm == "dis" else "2+2=4\n#### 4")
                        for s, p in zip(SEEDS, passes, strict=True)
                    ],
                    "curves": curves,
                    "runs": runs,
                }
                if arm != "none":
                    verdict = "improved" if (name == GRID_IMPROVED and arm == "dis") else "unresolved"
                    cell["compare"][f"{arm}_vs_none"] = _comparison(arm, "none", k, verdict=verdict, floor=floor)
                if base:
                    cell["vs_base"][arm] = {**_comparison(arm, "base", k), "before_mean": 0.405}
            cells.append(cell)
    primary = {"cell": cells[-1]["name"], "comparison": "dis_vs_none"}
    main = cells[-1]["compare"]["dis_vs_none"]
    config = {
        "model": "tiny",
        "data": "tiny",
        "band": BAND,
        "lag": lags[0],
        "lr": lrs[0],
        "grad_clip": 1.0,
        "base_evals": base_evals,
        "dead_band_share": 0.001,
        "train_runs": len(SEEDS),
    }
    results = {
        "question": "Does masking tokens outside the IS band (dis) beat the plain ratio (none) on held-out pass@1?",
        "command": "sao recipe --preset tiny --out runs/demo" if len(cells) == 1 else None,
        "versions": {"sao": "0.1.0", "python": "3.11.7", "torch": "2.4.0"},
        "config": config,
        "grid": {"lags": lags, "lrs": lrs, "bands": [BAND], "arms": arms},
        "seeds": SEEDS,
        "data": {"source": "generated:tiny-arithmetic", "train": 480, "test": 120, "train_contaminated": 0},
        "base": {
            "evals": base,
            "pass_at_1": [e["pass_at_1"] for e in base],
            "run_std": 0.0217 if floor else None,
            "runs": base_evals if floor else None,
            "noise_floor": floor,
        },
        "cells": cells,
        "primary": primary,
        "verdict": main["verdict"],
        "reason": main["reason"],
        "warnings": [DEAD_BAND_WARNING] if len(cells) == 1 else [],
        "wall_time": {**wall, "train_total": 321.0, "eval_total": 9.5, "compute_total": 330.5, "this_invocation": 12.0},
    }
    return results, log


def _one_cell() -> tuple[dict, list[dict]]:
    return _experiment([4], [1e-3], ["dis", "none"], base_evals=3)


def _grid() -> tuple[dict, list[dict]]:
    return _experiment([1, 4], [1e-3, 3e-3], ["dis", "none", "tis"], base_evals=0)


EXPERIMENTS = {"one_cell": _one_cell, "grid": _grid}


def _write_folder(folder: Path, experiment: tuple[dict, list[dict]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    results, log = experiment
    (folder / "results.json").write_text(json.dumps(results, indent=1))
    (folder / "train_log.json").write_text(json.dumps(log))
    return folder


@pytest.fixture(scope="module", params=sorted(EXPERIMENTS))
def built(request, tmp_path_factory) -> tuple[str, Path, str]:
    folder = _write_folder(tmp_path_factory.mktemp(request.param), EXPERIMENTS[request.param]())
    path = report.write(folder)
    assert path == folder / "report.md"
    return request.param, folder, path.read_text(encoding="utf-8")


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines() if line[:1] == "|"]


def _row(text: str, *first: str) -> list[str]:
    """The cells of the one table row that starts with the cells ``first``."""
    found = [r for r in _rows(text) if r[: len(first)] == list(first)]
    assert len(found) == 1, f"{len(found)} table rows start with {first}"
    return found[0]


def _section(text: str, heading: str) -> str:
    return text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("stem", PLOTS)
def test_every_plot_is_a_real_png_and_is_linked(built, stem):
    _, folder, text = built
    assert_png_linked(folder, text, stem, min_bytes=5_000)


def test_the_verdict_and_every_comparison_read_as_results_json_holds_them(built):
    kind, _, text = built
    results, _ = EXPERIMENTS[kind]()
    assert f"## Verdict: **{results['verdict']}**" in text
    assert results["reason"] in _section(text, "Verdict")
    for cell in results["cells"]:
        for key, c in cell["compare"].items():
            primary = results["primary"] == {"cell": cell["name"], "comparison": key}
            name = f"{c['after']} − none" + (" (primary)" if primary else "")
            verdict = f"**{c['verdict']}**" if c["verdict"] == "improved" else c["verdict"]
            floor = f"±{fmt_share(c['noise_floor'])}" if c["noise_floor"] is not None else "±—"
            assert _row(text, cell["name"], name, fmt_share(c["before_mean"]))[3:] == [
                fmt_share(c["after_mean"]),
                fmt_signed(c["delta"]),
                fmt_interval(c["ci_low"], c["ci_high"]),
                floor,
                "seed (2)",
                verdict,
            ]
            assert f"- {cell['name']}, {name}: {c['reason']}" in text
            assert _row(text, cell["name"], name, fmt_signed(c["proxy_delta"]))[3] == "no"
    assert fmt_signed(0.012345) == "+0.0123"  # the format the page promises, spelled out once


def test_pass_at_1_per_cell_and_arm_with_seeds_and_divergence(built):
    kind, _, text = built
    results, _ = EXPERIMENTS[kind]()
    for cell in results["cells"]:
        for arm, a in cell["arms"].items():
            flags = [(cell["name"], arm, s) == GRID_DIVERGED for s in SEEDS]
            per_seed = ", ".join(fmt_share(v) + ("†" if f else "") for v, f in zip(a["pass_at_1"], flags, strict=True))
            tokens = sum(e["mean_reply_tokens"] for e in a["evals"]) / len(a["evals"])
            row = _row(text, cell["name"], arm, fmt_share(a["pass_at_1_mean"]))
            lo, hi = a["pass_at_1_ci"]
            assert row[3:7] == [f"[{fmt_share(lo)}, {fmt_share(hi)}]", per_seed, fmt(tokens), "0.0000"]
            assert row[7] == f"{sum(flags)}/2" + (" [d1]" if any(flags) else "")
    if kind == "grid":
        assert "- [d1] lag4-lr0.003-band0.7-6, none: none-s18: training reward collapsed 0.300 -> 0.100" in text
        assert "results.json holds no base eval, so no noise floor." in text
    else:
        assert _row(text, "base-1")[1:] == ["0.4100", fmt(14.43), "0.0000"]
        assert _row(text, "**base mean**")[1] == "**0.4100**"
        assert "run_std 0.0217 over 3 runs gives the noise floor ±0.1322" in text
        assert "No run diverged." in text


def test_each_arm_against_the_base(built):
    kind, _, text = built
    results, _ = EXPERIMENTS[kind]()
    section = _section(text, "Each arm against the base")
    if kind == "grid":
        assert "holds no comparison with the base" in section
        return
    cell = results["cells"][0]
    for arm, c in cell["vs_base"].items():
        assert _row(section, cell["name"], arm)[2:] == [
            "0.4050",
            fmt_share(c["after_mean"]),
            fmt_signed(c["delta"]),
            fmt_interval(c["ci_low"], c["ci_high"]),
            f"±{fmt_share(c['noise_floor'])}",
            "seed (2)",
            c["verdict"],
        ]
        assert f"- {cell['name']}, {arm}: {c['reason']}" in section


def test_reachability_reads_the_curves_and_averages_staleness_over_seeds(built):
    kind, _, text = built
    results, _ = EXPERIMENTS[kind]()
    section = _section(text, "Reachability")
    for cell in results["cells"]:
        arms = list(cell["arms"])
        for arm in arms:
            curves = cell["arms"][arm]["curves"]
            row = _row(section, cell["name"], arm)
            assert row[3] == fmt_share(curves["masked_share"]["max"])
            assert row[7:9] == [fmt(curves["kl_sampler_policy"]["mean"]), fmt(curves["kl_sampler_policy"]["max"])]
        row = _row(section, cell["name"], "2")  # staleness 2
        for i, arm in enumerate(arms):
            key = "would_be_masked_share" if arm == "none" else "masked_share"
            runs = cell["arms"][arm]["runs"].values()
            values = [r["checks"]["masked_share_by_staleness"]["2"][key] for r in runs]
            assert row[3 + 2 * i] == fmt_share(sum(values) / len(values))
    if kind == "grid":
        assert "No reachability warning was raised during training." in section
    else:
        assert "> [dis-s17] the band (0.7, 6.0) is dead at these settings: &lt;0.1% masked" in section


def test_checks_curves_wall_time_and_configuration(built):
    kind, _, text = built
    results, _ = EXPERIMENTS[kind]()
    cell = results["cells"][-1]
    header = _row(text, "cell", "run")
    row = _row(text, cell["name"], "dis-s17")
    assert row[header.index("critic loss, warmup end → last 10")] == "0.2355 → 0.2593"
    assert row[header.index("clip at 1.0 ever bound")] == "no"
    assert row[header.index("non-finite tokens")] == "0"
    assert row[header.index("lag-0 \\|log ratio\\| max")] == "6.2e-06"
    fold = cell["arms"]["dis"]["curves"]["reward_mean"]
    expected = [fmt_share(fold[k]) for k in ("first", "last", "mean", "max", "min")]
    assert _row(text, "reward_mean", cell["name"], "dis")[3:] == [*expected, "6"]
    seconds = results["wall_time"]["train"][f"{cell['name']} dis-s17"]
    assert _row(text, f"train {cell['name']} dis-s17")[1] == f"{seconds:.1f} s"
    assert _row(text, "**compute, total**")[1] == "330 s (5.5 min)"
    assert _row(text, "train_runs")[1] == "2" and _row(text, "torch")[1] == "2.4.0"
    assert "Data: source generated:tiny-arithmetic, train 480, test 120, train_contaminated 0." in text
    assert (len(results["cells"]) > 1) == ("| lag |" not in _section(text, "Configuration"))


def test_missing_values_render_as_a_dash(built):
    _, _, text = built
    header = _row(text, "cell", "run")
    for line in (r for r in _rows(text) if len(r) == len(header) and r[1] == "none-s18"):
        assert line[header.index("critic EV at warmup end")] == "—"
    for row in (r for r in _rows(text) if r[0] == "response_length" and r[2] == "none"):
        assert row[3:8] == ["—"] * 5
    assert "None" not in text and "nan" not in text.lower()


def test_the_summary_is_written_from_the_verdicts_for_a_grid_only(built):
    kind, _, text = built
    if kind == "one_cell":
        assert "**Summary**" not in text
        return
    summary = next(line for line in text.splitlines() if line.startswith("**Summary**"))
    assert "1 of 8 comparisons separated: dis − none improved at lag 4, lr 0.003, band (0.7, 6.0) (+0.1234" in summary
    assert "`none` diverged in a seed of 1 of 4 cells: lag 4, lr 0.003, band (0.7, 6.0) (1/2)." in summary
    assert "no correction for multiple comparisons across the 8 comparisons" in text


def test_the_command_is_shown_only_when_recorded(built):
    kind, _, text = built
    results, _ = EXPERIMENTS[kind]()
    if results["command"]:
        assert f"```\n{results['command']}\n```" in text
    else:
        assert "```" not in text and "Regenerate" not in text


def test_example_replies_are_escaped_and_three_per_model(built):
    kind, _, text = built
    results, _ = EXPERIMENTS[kind]()
    section = _section(text, "Example eval replies")
    assert "a\\|b<br>c" in section and "2+2=4<br>#### 4" in section
    labels = [row[0] for row in _rows(section)[2:]]
    first = [e[0]["label"] for e in ([results["base"]["evals"]] if results["base"]["evals"] else [])]
    first += [arm["evals"][0]["label"] for arm in results["cells"][0]["arms"].values()]
    assert labels == [label for label in first for _ in range(3)]


def test_rebuilding_gives_the_same_page_and_plots(built):
    _, folder, text = built
    pngs = {stem: (folder / "plots" / f"{stem}.png").read_bytes() for stem in PLOTS}
    assert report.write(folder).read_text(encoding="utf-8") == text
    assert {stem: (folder / "plots" / f"{stem}.png").read_bytes() for stem in PLOTS} == pngs
    assert report.render(*report.load(folder)) == text


def _malformed(edit) -> tuple[dict, list[dict]]:
    results, log = copy.deepcopy(_one_cell())
    edit(results, log)
    return results, log


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("results.json", None, r"results\.json is missing"),
        ("results.json", "{not json", r"results\.json is not readable JSON"),
        ("train_log.json", "", r"train_log\.json is not readable JSON"),
        ("results.json", "[1, 2]", r"results\.json: the top level should be a JSON object \(found: list\)"),
        ("train_log.json", "{}", r"train_log\.json: the top level should be a JSON list \(found: object\)"),
        ("results.json", '{"verdict": "flat", "config": {}}', r"results\.json lacks 'cells'"),
        ("results.json", '{"verdict": "flat", "config": {}, "cells": []}', r"results\.json holds no cell"),
        (
            None,
            lambda r, _: r["cells"][0]["arms"]["dis"].update(curves=[1, 2]),
            r"results\.json: cells\[0\]\.arms\.dis\.curves should be a JSON object \(found: list\)",
        ),
        (None, lambda r, _: r["cells"][0].update(band=[0.7]), r"cells\[0\]\.band should be a two-number list"),
        (None, lambda r, _: r["cells"][0]["compare"].update(dis_vs_none="flat"), r"compare\.dis_vs_none should be"),
        (None, lambda r, _: r["base"].update(evals={}), r"base\.evals should be a JSON list"),
        (None, lambda _, log: log[3].pop("cell"), r"train_log\.json lacks '\[3\]\.cell'"),
        (None, lambda _, log: log[0].update(step="one"), r"train_log\.json: \[0\]\.step should be a number"),
    ],
)
def test_malformed_input_is_a_one_line_data_error_naming_the_file(tmp_path, name, content, match):
    if name is None:
        folder = _write_folder(tmp_path / "x", _malformed(content))
    else:
        folder = _write_folder(tmp_path / "x", _one_cell())
        (folder / name).unlink() if content is None else (folder / name).write_text(content)
    with pytest.raises(DataError, match=match) as error:
        report.write(folder)
    assert "\n" not in str(error.value) and str(folder) in str(error.value)
    assert not (folder / "report.md").exists() and not (folder / "plots").exists()


def test_render_checks_its_input_too():
    results, log = _malformed(lambda r, _: r["cells"][0]["arms"]["none"]["runs"]["none-s17"].update(checks=[]))
    with pytest.raises(DataError, match=r"results\.json: cells\[0\]\.arms\.none\.runs\.none-s17\.checks should be"):
        report.render(results, log)


def _nulled(value, key=None):
    """Every number set to null (NaN is stored as null), except the ones that place a cell or a step."""
    if key in ("lag", "lr", "band", "step", "seed"):
        return value
    if isinstance(value, dict):
        return {k: _nulled(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_nulled(v) for v in value]
    return None if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def test_a_run_whose_every_number_is_null_still_renders(tmp_path):
    results, log = _one_cell()
    text = report.write(_write_folder(tmp_path / "x", (_nulled(results), _nulled(log)))).read_text(encoding="utf-8")
    assert_png_linked(tmp_path / "x", text, "evals", min_bytes=5_000)
    row = _row(_section(text, "Verdict"), "lag4-lr0.001-band0.7-6", "dis − none (primary)", "—", "—")
    assert row[4:7] == ["—", "[—, —]", "±—"]
    grid = report.render(*map(_nulled, _grid()))
    assert "None" not in text + grid and "nan" not in (text + grid).lower()


def test_formatting_helpers():
    assert fmt(None) == fmt(float("nan")) == "—"
    assert fmt(6.0) == "6.0" and fmt(0.123456) == "0.1235" and fmt(3) == "3"
    assert fmt(True) == "yes" and fmt([0.7, 6.0]) == "(0.7, 6.0)"
    assert fmt_share(0.0123) == "0.0123" and fmt_share(3e-6) == "3.0e-06" and fmt_share("x") == "—"
    assert fmt_signed(-0.00404) == "-0.0040" and fmt_interval(None, 0.5) == "[—, +0.5000]"
    assert report.fmt_count(2.0) == "2" and report.fmt_seconds(150) == "150 s (2.5 min)"


def test_the_module_imports_only_the_standard_library_sao_core_and_matplotlib_lazily():
    """report.py loads no torch (sao.core has none at module level, so it shares core's one atomic write and reads
    recorded settings by core's flat names) and matplotlib only when it draws."""
    tree = ast.parse(Path(report.__file__).read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    anywhere = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]

    def roots(nodes):
        return {(n.module if isinstance(n, ast.ImportFrom) else a.name) for n in nodes for a in n.names}

    stdlib = sys.stdlib_module_names | {"__future__"}
    outside = {m for m in roots(top) if m.split(".")[0] not in stdlib}
    # sao.core: its stats, for the realised power of a results.json written before it was recorded
    core = ("config", "errors", "io", "names", "reading")
    assert outside == {"sao.core", *(f"sao.core.{name}" for name in core)}
    lazy = {m for m in roots(anywhere) - roots(top)}
    assert lazy and all(m.startswith("matplotlib") for m in lazy)


def test_the_ratio_split_by_cause_is_plotted_when_the_log_has_it(tmp_path):
    """A run whose steps logged the Mismatch hook's split (a vLLM sampler) gets the mismatch plot and its rows in the
    curves table; one that did not gets neither (the one-cell fixture has no such keys)."""
    results, log = _one_cell()
    for r in log:
        r.update(
            mismatch_fresh=1e-6 * (1 + r["step"]),
            staleness_drift=0.01 * r["staleness"],
            mismatch_rescored=2e-6 if r["staleness"] else None,
        )
    results["cells"][0]["arms"]["dis"]["curves"]["staleness_drift"] = {
        "first": 0.0,
        "last": 0.03,
        "mean": 0.015,
        "max": 0.03,
        "min": 0.0,
        "n": 3,
    }
    folder = _write_folder(tmp_path / "split", (results, log))
    text = report.write(folder).read_text(encoding="utf-8")
    assert_png_linked(folder, text, report.MISMATCH_PLOT[0], min_bytes=5_000)
    assert _row(text, "staleness_drift", _one_cell()[0]["cells"][0]["name"], "dis")[3:5] == ["0.0", "0.03"]
    plain = _write_folder(tmp_path / "plain", _one_cell())
    assert "mismatch.png" not in report.write(plain).read_text(encoding="utf-8")
    assert not (plain / "plots" / "mismatch.png").exists()


def _confirmed(gatekeeping: bool, gate: str | None) -> tuple[dict, list[dict]]:
    """The one-cell experiment with a plan and its outcome beside it, as `sao confirm` writes them (made up)."""
    results, log = _one_cell()
    cell = results["cells"][0]["name"]
    row = {
        "cell": cell,
        "comparison": "dis_vs_none",
        "delta": 0.05,
        "ci_low": -0.2,
        "ci_high": 0.3,
        "p_value": 0.5,
        "p_t": 0.21,
        "p_rule": "exact sign-flip",
        "p_holm": 0.5,
        "smallest_effect": 0.04,
        "verdict_unadjusted": "unresolved",
        "verdict": "unresolved",
        "reason": "unresolved: the exact sign-flip p over 2 seeds is 0.5 (made up).",
    }
    power = {
        "summary": "power 0.00 to detect δ 0.04 (the plan's smallest_effect) with sd 0.05 (the plan's "
        "expected_sd) over 2 paired seeds at the primary alone at alpha 0.05 (gatekeeping); 16 seeds would give "
        "0.8",
        "warning": "the plan's power is 0.00, below 0.8: with 2 seeds the exact sign-flip p cannot go "
        "below 0.5; 16 seeds would give 0.8",
    }
    results["plan"] = {
        "file": "plan.yaml",
        "sha256": "ab" * 32,
        "primary": {"cell": cell, "after": "dis", "before": "none", "expect": "improved"},
        "secondary": ["dis_vs_none"],
        "family": [row],
        "arms": ["dis", "none"],
        "seeds": SEEDS,
        "correction": "holm",
        "alpha": 0.05,
        "smallest_effect": 0.04,
        "gatekeeping": gatekeeping,
        "power": power,
    }
    results["confirmation"] = {
        "correction": "holm",
        "alpha": 0.05,
        "gatekeeping": gatekeeping,
        "gate": gate,
        "family": [row],
        "primary": row,
        "expect": "improved",
        "outcome": "not confirmed",
    }
    return results, log


def test_a_confirmation_states_its_delta_p_rule_power_and_gatekeeping():
    text = report.render(*_confirmed(gatekeeping=True, gate="closed"))
    plan = _section(text, "Plan (fixed before the run)")
    assert "**Smallest effect of interest:** δ = 0.0400" in plan and "90% interval inside ± δ" in plan
    assert "gatekeeping: the primary alone at alpha 0.05" in plan and "reported, not claimed" in plan
    assert "**Power (computed before the run):** power 0.00 to detect δ 0.04" in plan
    assert "> warning: the plan's power is 0.00, below 0.8" in plan
    came = _section(text, "What came out")
    assert "reported but not claimed" in came
    header = next(r for r in _rows(came) if r[0] == "cell")
    assert header[3:8] == ["95% interval", "p", "p rule", "adjusted p (primary alone, then Holm)", "δ"]
    primary = _rows(came)[2]  # after the header and the rule
    assert primary[1] == "dis_vs_none (primary)" and primary[5:8] == ["exact sign-flip", "0.5", "0.0400"]
    holm = report.render(*_confirmed(gatekeeping=False, gate=None))
    assert "holm across the whole family at alpha 0.05" in holm and "Holm-adjusted p" in holm
    assert "Gatekeeping:" not in _section(holm, "What came out")


def test_without_train_log_json_report_md_is_rebuilt_from_results_json_and_the_logs_plots_are_kept(tmp_path):
    """A committed folder keeps results.json and not the per-step log: report.md comes out the same, the plots drawn
    from the log are left as they were, and where they never existed they are not linked."""
    folder = _write_folder(tmp_path / "x", _one_cell())
    first = report.write(folder).read_text(encoding="utf-8")
    reward = (folder / "plots" / "reward.png").read_bytes()
    (folder / "train_log.json").unlink()
    (folder / "plots" / "reward.png").write_bytes(reward + b"kept")  # the log's plot: not redrawn
    assert report.write(folder).read_text(encoding="utf-8") == first
    assert (folder / "plots" / "reward.png").read_bytes() == reward + b"kept"
    bare = _write_folder(tmp_path / "bare", _one_cell())
    (bare / "train_log.json").unlink()
    text = report.write(bare).read_text(encoding="utf-8")
    assert "reward.png" not in text and "ratio_max.png" not in text
    for stem in ("masked_share", "evals"):
        assert_png_linked(bare, text, stem, min_bytes=5_000)


COMMITTED = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name", ["confirm-v2/tiny", "confirm-v2/tiny-calc", "confirm-v2/mismatch"])
def test_the_committed_confirmation_reports_are_what_sao_report_writes_from_their_results(name):
    """Their results.json were written before verdicts gained a magnitude and read as they did: the only line this
    version adds is the realised power beside the planned power."""
    folder = COMMITTED / name
    results = json.loads((folder / "results.json").read_text())
    kept = {p.stem for p in (folder / "plots").glob("*.png")}
    text = report.render(results, None, kept)
    assert text == (folder / "report.md").read_text(encoding="utf-8"), f"run `sao report docs/{name}` and commit"
    assert "Power, realised" in text and "Off-policy diagnostics" not in text


def test_the_committed_first_confirmation_reads_without_anything_this_version_adds():
    results = json.loads((COMMITTED / "confirm-tiny" / "run" / "results.json").read_text())
    text = report.render(results, None)
    assert "Power, realised" not in text and "by less than δ" not in text and "Off-policy" not in text


def test_the_realised_power_stands_beside_the_planned_power():
    results, log = _confirmed(gatekeeping=True, gate="closed")
    results["plan"]["power"].update(smallest_effect=0.04, alpha_primary=0.05, sd=0.05, power=0.0)
    text = report.render(results, log)
    dis, none = (results["cells"][0]["arms"][a]["pass_at_1"] for a in ("dis", "none"))
    sd = statistics.stdev([a - b for a, b in zip(dis, none, strict=True)])
    line = next(x for x in _section(text, "Plan (fixed before the run)").splitlines() if "Power, realised" in x)
    assert f"have sd {sd:.3g} (the plan assumed 0.05)" in line and "(planned 0.00)" in line
    assert "power 0.00 for δ 0.04" in line, "2 seeds: the exact floor leaves no power, realised or planned"
    results["confirmation"]["realised_power"] = {
        "seeds": 2,
        "sd": 0.3,
        "alpha": 0.05,
        "smallest_effect": 0.04,
        "effect": 0.04,
        "power": 0.123,
        "mixture": None,
        "mixture_power": None,
    }
    assert "has power 0.12 for δ 0.04" in report.render(results, log), "recorded: read, not recomputed"


def test_a_plan_with_a_decision_rule_and_estimands_states_them_and_each_verdicts_size():
    results, log = _confirmed(gatekeeping=True, gate="closed")
    results["plan"].update(decision_rule="minimum-effect", expected_effect=0.1, rank_estimand=True, collapse_floor=0.05)
    row = results["confirmation"]["primary"]
    row.update(
        verdict_unadjusted="regressed",
        verdict="regressed",
        magnitude="undetermined",
        finding="regressed, size against δ undetermined",
        rank={
            "hodges_lehmann": -0.06,
            "low": -0.11,
            "high": -0.01,
            "sign_p": 0.15,
            "positive": 8,
            "negative": 16,
            "ties": 0,
        },
        collapse={"n": 24, "after_collapsed": 3, "before_collapsed": 0, "p_value": 0.25},
    )
    results["confirmation"]["outcome"] = "contradicted"
    results["verdict"] = "regressed"
    text = report.render(results, log)
    assert "## Verdict: **regressed**, size against δ undetermined" in text
    plan = _section(text, "Plan (fixed before the run)")
    assert "**Decision rule:** minimum effect" in plan and "true delta of 0.1000" in plan
    assert "the Hodges–Lehmann shift" in plan and "runs below pass@1 0.05" in plan
    assert "the verdict says the direction" in plan
    came = _section(text, "What came out")
    assert "**Primary: contradicted** (expected improved; after holm: regressed, size against δ undetermined)" in came
    primary = _row(came, results["cells"][0]["name"], "dis_vs_none (primary)")
    assert primary[9:] == [
        "**regressed**, size against δ undetermined",
        "-0.0600 [-0.1100, -0.0100]",
        "0.15 (8 / 16 / 0)",
        "3, 0 of 24",
        "0.25",
    ]


def test_the_off_policy_diagnostics_show_the_ess_the_sides_of_the_band_and_the_tokens_outside_it(tmp_path):
    results, log = _one_cell()
    arm = results["cells"][0]["arms"]["dis"]
    arm["curves"].update(would_be_masked_share_low=_fold(0.01, 0.03), would_be_masked_share_high=_fold(0.0, 0.01))
    run = next(iter(arm["runs"].values()))
    run["checks"].update(
        outside_band_tokens=[[" =", 30, 2, 40], ["42", 0, 5, 10]],
        outside_band_by_position=[8, 0, 0, 0, 0, 0, 0, 0, 0, 29],
        tokens_by_position=[100] * 10,
    )
    for r in log:
        r["ratio_ess_share"] = 0.9 - 0.01 * r["step"]
    folder = _write_folder(tmp_path / "x", (results, log))
    text = report.write(folder).read_text(encoding="utf-8")
    section = _section(text, "Off-policy diagnostics")
    name = results["cells"][0]["name"]
    assert _row(section, name, "dis", "0.1500")[3:8] == ["0.1000", "0.1500", "0.1500", "0.0200", "0.0050"]
    assert _row(section, name, "dis", '" ="')[3:] == ["30", "2", "40", "0.8000"]
    assert _row(section, name, "dis", "0.0800")[-1] == "0.2900", "the shares per tenth of the reply"
    assert_png_linked(folder, text, report.ESS_PLOT[0], min_bytes=5_000)
    assert "Off-policy diagnostics" not in report.render(*_nulled_diagnostics())


def _nulled_diagnostics() -> tuple[dict, list[dict]]:
    """The one-cell experiment as a results.json written before the diagnostics existed."""
    results, log = _one_cell()
    for cell in results["cells"]:
        for arm in cell["arms"].values():
            for key in ("ratio_ess_share", "masked_share_low", "masked_share_high"):
                arm["curves"].pop(key)
    return results, log


def test_where_the_time_goes_is_plotted_tabled_and_linked_to_each_run_timeline(tmp_path):
    """A log with the step timers gets the stacked phases plot and a row per cell and arm of mean seconds per phase
    (with its share of the step); each run folder's timeline.json is linked. The one-cell fixture has neither."""
    results, log = _one_cell()
    for r in log:
        r.update(
            time=1.0,
            time_wait=0.0,
            time_draw=0.5,
            time_env=0.1,
            time_score=0.05,
            time_pass=0.25,
            time_update=0.05 if r["phase"] == "policy" else 0.0,
            time_critic=0.05,
            time_other=0.0,
        )
    cell = results["cells"][0]["name"]
    folder = _write_folder(tmp_path / "timed", (results, log))
    for run in ("dis-s17", "none-s18"):
        (folder / "cells" / cell / "runs" / run).mkdir(parents=True)
        (folder / "cells" / cell / "runs" / run / "timeline.json").write_text('{"traceEvents": []}')
    text = report.write(folder).read_text(encoding="utf-8")
    assert_png_linked(folder, text, report.PHASES_PLOT[0], min_bytes=5_000)
    section = _section(text, "Where the time goes")
    policy_share = POLICY_STEPS / (WARMUP + POLICY_STEPS)
    assert _row(section, cell, "dis")[2:] == [
        "1.0 s",
        f"draw 0.5 (50%), env 0.1 (10%), score 0.05 (5%), pass 0.25 (25%), update {fmt(0.05 * policy_share)} "
        f"({0.05 * policy_share:.0%}), critic 0.05 (5%)",
    ]
    for run in ("dis-s17", "none-s18"):
        link = f"cells/{cell}/runs/{run}/timeline.json"
        assert f"[{link}]({link})" in section and (folder / link).exists()
    plain = report.write(_write_folder(tmp_path / "plain", _one_cell())).read_text(encoding="utf-8")
    assert "Where the time goes" not in plain and "phases.png" not in plain


def test_the_critic_against_what_was_reachable_and_the_defined_arms_are_reported():
    results, log = _one_cell()
    dis = results["cells"][0]["arms"]["dis"]
    dis["settings"] = {"correction": "dis", "sampler_logit_noise": 1.0}
    for i, run in enumerate(dis["runs"].values()):
        run["checks"]["ceiling"] = [
            {
                "snapshot": "warmup-end",
                "step": 9,
                "mean": 0.3,
                "prompt_level": 0.05 + 0.02 * i,
                "token_level": 0.04,
                "critic_ev": 0.01,
                "critic_share": 0.25,
            },
            {
                "snapshot": "40",
                "step": 49,
                "mean": 0.5,
                "prompt_level": 0.4,
                "token_level": 0.38 + 0.02 * i,
                "critic_ev": 0.02,
                "critic_share": 0.05,
            },
        ]
        run["checks"]["oracle_baseline"] = {
            "samples": 4,
            "shrinkage_mean": 0.6,
            "batch_ceiling_mean": 0.3,
            "rate_mean": 0.4,
            "ev_last10": 0.2 + 0.1 * i,
        }
    probe = {
        "summary": [
            {"snapshot": "warmup-end", "runs": 2, "prompt_token_r2": -0.03, "per_token_r2": 0.01, "signal_share": 0.3}
        ]
    }
    text = report.render(results, log, probe=probe)
    section = _section(text, "The critic against what was reachable")
    assert _row(section, _name(4, 1e-3), "dis", "warmup-end")[3:] == ["2", "0.3", "0.06", "0.04", "0.01", "0.25"]
    assert _row(section, _name(4, 1e-3), "dis", "40")[6:8] == ["0.39", "0.02"]  # the median of two runs
    assert _row(section, _name(4, 1e-3), "dis", "4")[3:6] == ["0.6", "0.3", "0.25"]
    assert _row(section, "warmup-end", "2")[2:] == ["-0.03", "0.01", "0.3"]
    assert _row(_section(text, "Arms defined by the plan"), "dis") == ["dis", "dis", "—", "sampler_logit_noise 1.0"]
    assert "The critic against what was reachable" not in report.render(*_one_cell()), "only where runs measured it"
