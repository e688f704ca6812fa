"""`sao compare BEFORE AFTER --out DIR`: prints and writes the verdict on lm-eval files or a table of scores,
`sao report DIR` rebuilds the same report.md, and every mistake is one line on stderr, exit code 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import files_in, lm_eval_file, refused_in_one_line
from sao.cli import main


def arm(folder: Path, rng, p, seeds: int) -> Path:
    for s in range(seeds):
        lm_eval_file(folder / f"seed{s}", (rng.binomial(4, np.clip(p, 0, 1)) / 4).tolist())
    return folder


def test_compare_prints_and_writes_the_verdict_and_report_rebuilds_it(tmp_path, capsys):
    rng = np.random.default_rng(1)
    p = rng.uniform(0.1, 0.7, size=40)
    before, after = arm(tmp_path / "base-sft", rng, p, 6), arm(tmp_path / "sao", rng, p + 0.3, 6)
    noise = arm(tmp_path / "repeats", rng, p, 3)
    out = tmp_path / "verdict"
    assert main(["compare", str(before), str(after), "--noise", str(noise), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    found = json.loads((out / "results.json").read_text())
    c = found["compare"]["after_vs_before"]
    assert f"after_vs_before verdict: {c['reason']}" in printed and c["verdict"] == found["verdict"] == "improved"
    assert f"noise floor {found['noise']['noise_floor']:.4f} from 3 repeated evals" in printed
    assert found["sides"]["before"]["benchmark"] == "gsm8k" and found["tasks"] == 40 and c["unit"] == "seed"
    report = (out / "report.md").read_bytes()
    assert b"## Verdict: **improved**" in report and found["command"].startswith("sao compare ")
    assert main(["report", str(out)]) == 0 and (out / "report.md").read_bytes() == report
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]
    capsys.readouterr()
    assert main(["compare", str(before), str(after), "--out", str(out)]) == 0  # a comparison's folder: replaced
    assert json.loads((out / "results.json").read_text())["noise"]["noise_floor"] is None


def test_a_table_holding_both_arms_is_compared_run_against_run(tmp_path, capsys):
    rows = ["run,seed,task,score"] + [
        f"{run},{s},q{j},{(j + s + (run == 'b')) % 2}" for run in "ab" for s in (1, 2) for j in range(10)
    ]
    table = tmp_path / "scores.csv"
    table.write_text("\n".join(rows) + "\n")
    argv = [
        "compare",
        str(table),
        str(table),
        "--before-run",
        "a",
        "--after-run",
        "b",
        "--smallest-effect",
        "0.3",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(argv) == 0
    found = json.loads((tmp_path / "out" / "results.json").read_text())
    assert found["sides"]["before"]["name"] == "a" and found["pairing"] == "2 seeds a side, paired by seed label"
    assert found["compare"]["after_vs_before"]["smallest_effect"] == 0.3
    assert "after_vs_before verdict: unresolved" in capsys.readouterr().out  # two seeds: the exact floor is 0.5


def _refusals(t: Path) -> dict[str, tuple[list[str], str]]:
    """name → (argv after `compare`, the words the one line must hold), the files written under ``t``."""
    b, a = lm_eval_file(t / "b", [1, 0, 1]), lm_eval_file(t / "a", [1, 1, 0])
    other = lm_eval_file(t / "o", [1, 1, 1], task="arc_easy")
    short = lm_eval_file(t / "s", [1, 1])
    nan = lm_eval_file(t / "n", [1, float("nan"), 1])
    two = lm_eval_file(t / "f", [1, 0, 1], filters=("strict-match", "flexible-extract"))
    for i in range(2):
        lm_eval_file(t / "seeds" / f"s{i}", [1, i, 1])
    seeds = t / "seeds"
    dup = t / "dup.csv"
    dup.write_text("run,seed,task,score\nx,1,0,1\nx,1,1,0\nx,1,0,0\n")
    return {
        "an lm-eval file of another task": ([str(b), str(other)], "is of the lm-eval task 'arc_easy'"),
        "mismatched task ids": ([str(b), str(short)], "BEFORE and AFTER score different tasks"),
        "a duplicated seed": ([str(dup), str(a)], "a duplicated seed"),
        "a non-finite score": ([str(nan), str(a)], "NaN is not a number"),
        "several filters, none chosen": ([str(two), str(a)], "choose one with --filter"),
        "no such file": ([str(t / "missing.jsonl"), str(a)], "no such file or folder"),
        "a smallest effect below 0": ([str(b), str(a), "--smallest-effect", "-0.1"], "smallest_effect must be"),
        "an alpha of 0.7": ([str(b), str(a), "--alpha", "0.7"], "alpha must be a number in (0, 0.5)"),
        "--before-fixed with two runs": ([str(seeds), str(a), "--before-fixed"], "BEFORE must be one run"),
    }


CASES = [
    "an lm-eval file of another task",
    "mismatched task ids",
    "a duplicated seed",
    "a non-finite score",
    "several filters, none chosen",
    "no such file",
    "a smallest effect below 0",
    "an alpha of 0.7",
    "--before-fixed with two runs",
]


@pytest.mark.parametrize("case", CASES)
def test_each_mistake_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, case):
    argv, words = _refusals(tmp_path)[case]
    refused_in_one_line(capsys, ["compare", *argv, "--out", str(tmp_path / "out")], tmp_path, words)


def test_an_output_folder_holding_another_runs_results_is_refused_and_left_intact(tmp_path, capsys):
    b, a = lm_eval_file(tmp_path / "b", [1, 0, 1]), lm_eval_file(tmp_path / "a", [1, 1, 0])
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "results.json").write_text('{"verdict": "improved", "cells": []}')
    refused_in_one_line(capsys, ["compare", str(b), str(a), "--out", str(recipe)], tmp_path, "holds other files")


def test_an_output_path_that_is_a_file_is_refused_before_reading(tmp_path, capsys):
    b, a = lm_eval_file(tmp_path / "b", [1, 0, 1]), lm_eval_file(tmp_path / "a", [1, 1, 0])
    (tmp_path / "taken").write_text("x")
    before = files_in(tmp_path)
    refused_in_one_line(capsys, ["compare", str(b), str(a), "--out", str(tmp_path / "taken")], tmp_path, "not a folder")
    assert files_in(tmp_path) == before
