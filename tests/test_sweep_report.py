"""sweep_report.write on a small hand-made sweep.json: every plot is a real PNG and linked, the tables hold the
numbers as the page's formatters write them, the summary names a planted separation (or says none separated)
and the divergence contrasts, missing values read "—", bad input is a one-line DataError, and a rebuild gives
the same page and the same PNGs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from helpers import assert_png_linked
from sao import sweep_report
from sao.errors import DataError
from sao.report import fmt, fmt_interval, fmt_share, fmt_signed

PLOTS = ("sweep_pass_at_1", "sweep_ratio", "sweep_kl", "sweep_reward", "sweep_divergence")
ARMS = ("dis", "none", "tis")
LAGS = (1, 4)
LR, BAND = 0.003, [0.7, 6.0]
SEED0, SEEDS = 17, 2
STEPS = 12
# (lag, arm) → {run label: reasons}; none diverges at lag 1 where dis and tis do not, tis at lag 4 where none does not
DIVERGED = {
    (1, "none"): {"none-s18": ["training reward collapsed 0.300 -> 0.100"]},
    (4, "tis"): {"tis-s17": ["2 step(s) skipped for a non-finite loss or gradient", "3 non-finite token(s)"]},
}


def _name(lag: int) -> str:
    return f"lag{lag}-lr{LR:g}-band{BAND[0]:g}-{BAND[1]:g}"


def _arm(lag: int, arm: str) -> dict:
    k = LAGS.index(lag) * 10 + ARMS.index(arm)
    passes = [0.30 + 0.01 * k, 0.34 + 0.013 * k]
    mean = sum(passes) / 2
    kl = [[0.0] + [0.001 * (1 + lag) * (s + 1) * (1 + 0.1 * seed) for s in range(STEPS - 1)] for seed in range(SEEDS)]
    reward = [[0.35 - 0.01 * s * (arm == "none") + 0.002 * seed for s in range(STEPS)] for seed in range(SEEDS)]
    out = {
        "pass_at_1": passes,
        "pass_at_1_mean": mean,
        "pass_at_1_ci": [mean - 0.2123, mean + 0.2123],
        "reward_first10": [0.31 + 0.001 * k, 0.33],
        "reward_last10": [0.28 - 0.002 * k, 0.3],
        "ratio_max": 3.5 * lag + k,
        "ratio_max_median": 1.2 + 0.3 * lag,
        "masked_share_mean": 0.0 if arm != "dis" else 0.0123 * lag,
        "would_be_masked_share_mean": 0.0141 * lag + 0.0001 * k,
        "kl_mean": 0.00456 * lag + 0.0001 * k,
        "kl_max": 0.02 * lag,
        "kl_per_step": kl,
        "reward_per_step": reward,
        "diverged": DIVERGED.get((lag, arm), {}),
    }
    if (lag, arm) == (4, "dis"):  # values the sweep could not compute (NaN stored as null)
        out["ratio_max_median"] = None
        out["kl_mean"] = None
        out["kl_per_step"][0][3] = None
    return out


def _comparison(before: dict, after: dict, *, delta: float, half: float, verdict: str) -> dict:
    return {
        "delta": delta,
        "ci_low": delta - half,
        "ci_high": delta + half,
        "noise_floor": 0.0512,
        "verdict": verdict,
        "reason": f"{verdict}: made up for the test.",
        "unit": "seed",
        "n": 2,
        "before_mean": before["pass_at_1_mean"],
        "after_mean": after["pass_at_1_mean"],
        "proxy_delta": 0.01,
        "proxy_diverges": False,
    }


def _sweep(*, plant_improved: bool = False) -> dict:
    cells = []
    for lag in LAGS:
        arms = {arm: _arm(lag, arm) for arm in ARMS}
        compare = {
            "dis_vs_none": _comparison(arms["none"], arms["dis"], delta=0.0234, half=0.0811, verdict="unresolved"),
            "tis_vs_none": _comparison(arms["none"], arms["tis"], delta=-0.0105, half=0.02, verdict="flat"),
        }
        if plant_improved and lag == 4:
            compare["dis_vs_none"] = _comparison(arms["none"], arms["dis"], delta=0.1234, half=0.05, verdict="improved")
        cells.append({"lag": lag, "lr": LR, "band": BAND, "name": _name(lag), "arms": arms, "compare": compare})
    return {
        "question": "Over lag x lr x band, where does the unmasked ratio break, and does the mask help there?",
        "versions": {"sao": "0.1.0", "python": "3.11.7", "torch": "2.4.0"},
        "config": {"model": "tiny", "data": "tiny", "seed": SEED0, "train_runs": SEEDS, "steps": STEPS, "lr": 1e-3},
        "grid": {"lags": list(LAGS), "lrs": [LR], "bands": [BAND], "arms": list(ARMS)},
        "seeds": SEEDS,
        "divergence_rule": "skipped step, non-finite token, or last-10 training reward < 0.5 x first-10",
        "base": {"pass_at_1": [0.40, 0.42, 0.41], "run_std": 0.01, "runs": 3, "noise_floor": 0.0512},
        "cells": cells,
        "command": "sao sweep --preset tiny --lags 1 4 --lrs 3e-3 --arms dis none tis --train-runs 2 --out X",
        "wall_time_s": 42.0,
    }


def _write(folder: Path, sweep: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text(json.dumps(sweep, indent=1))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    folder = _write(tmp_path_factory.mktemp("sweep"), _sweep())
    path = sweep_report.write(folder)
    assert path == folder / "sweep.md"
    return folder, path.read_text(encoding="utf-8")


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines() if line[:1] == "|"]


def _row(text: str, *first: str) -> list[str]:
    """The cells of the one table row that starts with the cells ``first``."""
    found = [r for r in _rows(text) if r[: len(first)] == list(first)]
    assert len(found) == 1, f"{len(found)} table rows start with {first}"
    return found[0]


def _section(text: str, heading: str) -> str:
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _key(lag: int) -> tuple[str, str, str]:
    return fmt(lag), fmt(LR), fmt(tuple(BAND))


@pytest.mark.parametrize("stem", PLOTS)
def test_every_plot_is_a_real_png_and_is_linked(built, stem):
    folder, text = built
    assert_png_linked(folder, text, stem, min_bytes=5_000)


def test_header_states_question_command_rule_and_base(built):
    _, text = built
    sweep = _sweep()
    assert sweep["question"] in text
    assert f"```\n{sweep['command']}\n```" in text
    assert f"**Divergence rule.** A run has diverged on: {sweep['divergence_rule']}." in text
    base = _section(text, "Base model and noise floor")
    assert "0.4000, 0.4200, 0.4100" in base
    assert f"mean {fmt_share(0.41)}" in base
    assert f"±{fmt_share(0.0512)}" in base


def test_every_cell_and_arm_row_holds_the_json_values(built):
    _, text = built
    sweep = _sweep()
    for cell in sweep["cells"]:
        for arm, a in cell["arms"].items():
            row = _row(text, *_key(cell["lag"]), arm)
            lo, hi = a["pass_at_1_ci"]
            assert row[4] == f"{fmt_share(a['pass_at_1_mean'])} [{fmt_share(lo)}, {fmt_share(hi)}]"
            flags = [f"{arm}-s{SEED0 + i}" in a["diverged"] for i in range(SEEDS)]
            assert row[5] == ", ".join(
                fmt_share(v) + ("†" if f else "") for v, f in zip(a["pass_at_1"], flags, strict=True)
            )
            first, last = (sum(a[k]) / len(a[k]) for k in ("reward_first10", "reward_last10"))
            assert row[6] == f"{fmt_share(first)} → {fmt_share(last)}"
            assert row[7:12] == [
                fmt(a["ratio_max"]),
                fmt(a["ratio_max_median"]),
                fmt_share(a["masked_share_mean"]),
                fmt_share(a["would_be_masked_share_mean"]),
                fmt(a["kl_mean"]),
            ]


def test_missing_values_render_as_a_dash(built):
    _, text = built
    row = _row(text, *_key(4), "dis")
    assert row[8] == "—" and row[11] == "—"
    assert "None" not in text and "nan" not in text.lower()


def test_diverged_counts_and_reasons(built):
    _, text = built
    counts = {(lag, arm): _row(text, *_key(lag), arm)[12].split(" ")[0] for lag in LAGS for arm in ARMS}
    expected = {(lag, arm): f"{len(DIVERGED.get((lag, arm), {}))}/{SEEDS}" for lag in LAGS for arm in ARMS}
    assert counts == expected
    first, second = _arm(1, "none")["pass_at_1"]
    assert _row(text, *_key(1), "none")[5] == f"{fmt_share(first)}, {fmt_share(second)}†"  # seed 18 diverged
    notes = [line for line in text.splitlines() if line.startswith("- [d")]
    assert len(notes) == len(DIVERGED)
    assert "none-s18: training reward collapsed 0.300 -&gt; 0.100" not in text  # list items are not HTML-escaped
    assert any("none-s18: training reward collapsed 0.300 -> 0.100" in n for n in notes)
    assert any(
        "tis-s17: 2 step(s) skipped for a non-finite loss or gradient, 3 non-finite token(s)" in n for n in notes
    )
    matrix = sweep_report._divergence_matrix(sweep_report.load(built[0]), list(ARMS))
    assert matrix == [[(len(DIVERGED.get((lag, arm), {})), SEEDS) for lag in LAGS] for arm in ARMS]


def test_comparison_table_holds_the_json_values(built):
    _, text = built
    for cell in _sweep()["cells"]:
        for key, c in cell["compare"].items():
            arm = key.removesuffix("_vs_none")
            row = _row(text, *_key(cell["lag"]), f"{arm} − none")
            assert row[4:] == [
                fmt_share(c["before_mean"]),
                fmt_share(c["after_mean"]),
                fmt_signed(c["delta"]),
                fmt_interval(c["ci_low"], c["ci_high"]),
                f"±{fmt_share(c['noise_floor'])}",
                "seed (2)",
                c["verdict"],
            ]
    assert "its own 95% interval, with no correction for multiple comparisons across the 4 comparisons" in text


def test_summary_says_none_separated_and_names_the_widest_positive_delta(built):
    _, text = built
    summary = _section(text, "Summary")
    assert "No arm separated from `none`" in summary and "(verdicts: flat 2, unresolved 2)" in summary
    assert f"widest positive delta was {fmt_signed(0.0234)} {fmt_interval(0.0234 - 0.0811, 0.0234 + 0.0811)}" in summary
    assert "improved at" not in summary


def test_summary_names_the_divergence_contrasts(built):
    _, text = built
    summary = _section(text, "Summary")
    lag1, lag4 = "lag 1, lr 0.003, band (0.7, 6.0)", "lag 4, lr 0.003, band (0.7, 6.0)"
    assert f"`none` diverged in at least one seed in 1 of 2 cells: {lag1} (1/2)." in summary
    assert f"`none` diverged but the arm did not: dis at {lag1} (none 1/2, dis 0/2); and tis at {lag1}" in summary
    assert f"The arm diverged but `none` did not: tis at {lag4} (none 0/2, tis 1/2)." in summary


def test_summary_names_a_planted_improvement(tmp_path):
    folder = _write(tmp_path / "x", _sweep(plant_improved=True))
    text = sweep_report.write(folder).read_text(encoding="utf-8")
    summary = _section(text, "Summary")
    assert "1 of 4 comparisons against `none` separated" in summary
    assert f"dis improved at lag 4, lr 0.003, band (0.7, 6.0) (delta {fmt_signed(0.1234)}," in summary
    assert "No arm separated" not in summary
    assert _row(text, *_key(4), "dis − none")[-1] == "**improved**"


def test_no_command_is_noted(tmp_path):
    sweep = _sweep()
    del sweep["command"]
    text = sweep_report.write(_write(tmp_path / "x", sweep)).read_text(encoding="utf-8")
    assert "records no command" in text and "```" not in text


def test_rebuilding_gives_the_same_page_and_plots(built):
    folder, text = built
    pngs = {stem: (folder / "plots" / f"{stem}.png").read_bytes() for stem in PLOTS}
    assert sweep_report.write(folder).read_text(encoding="utf-8") == text
    assert {stem: (folder / "plots" / f"{stem}.png").read_bytes() for stem in PLOTS} == pngs


def test_a_missing_sweep_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"sweep\.json is missing") as error:
        sweep_report.write(tmp_path)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "sweep.md").exists()


def _broken_cell(sweep: dict) -> dict:
    sweep = copy.deepcopy(sweep)
    del sweep["cells"][1]["arms"]
    return sweep


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not readable JSON"),
        ("[1, 2]", "JSON dict"),
        ('{"question": "?"}', "lacks 'cells'"),
        ('{"cells": []}', "lacks 'cells'"),
        (json.dumps(_broken_cell(_sweep())), "cell 1 lacks lag/lr/band/arms"),
        (json.dumps({**_sweep(), "cells": [{"lag": 1, "lr": 0.1, "band": [1], "arms": {}}]}), "two-number band"),
        (json.dumps({**_sweep(), "cells": [{"lag": 1, "lr": 0.1, "band": [1, 2], "arms": {"dis": 3}}]}), "arm to"),
    ],
)
def test_malformed_input_is_a_one_line_data_error(tmp_path, content, match):
    (tmp_path / "sweep.json").write_text(content)
    with pytest.raises(DataError, match=match) as error:
        sweep_report.write(tmp_path)
    assert "\n" not in str(error.value)
