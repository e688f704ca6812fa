"""`sao compare`'s reading and statistics (``sao.experiment.scores``, ``sao.experiment.compare``).

The lm-eval files are written here in the layout lm-evaluation-harness's ``--log_samples`` writes
(``samples_<task>_<date>.jsonl``: one line per document and filter with doc_id, doc, target, arguments, resps,
filtered_resps, filter, metrics, the hashes, and each metric's value). The comparison must be the recipe's:
``results.compare_cell`` (what ``sao recipe`` runs) on the same per-task scores gives the same verdict, interval,
equivalence test and reason, field for field. The faults are one-line ``DataError``s naming the side and file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import lm_eval_file
from sao.core.errors import DataError
from sao.experiment import compare, results
from sao.experiment.scores import lm_eval_task, read_side


def write_arm(folder: Path, runs) -> Path:
    """One folder per seed, as lm-eval writes one run's output each."""
    for i, scores in enumerate(runs):
        lm_eval_file(folder / f"seed{i}", scores)
    return folder


def draws(rng, p, seeds: int, k: int = 4) -> list[list[float]]:
    """[seeds, tasks]: each task's share of k samples correct at its chance p."""
    return (rng.binomial(k, np.clip(p, 0, 1), size=(seeds, len(p))) / k).tolist()


def recipe_comparison(before, after, base) -> dict:
    """What `sao recipe` writes for arm `after` against `none` on these per-task scores (compare_cell, with equal
    training rewards so the proxy says nothing)."""

    def arm(runs):
        return {
            "evals": [{"per_task": r} for r in runs],
            "runs": {f"s{i}": {"checks": {"reward_last10": 0.5}} for i in range(len(runs))},
        }

    floor = results.noise_block([float(np.mean(r)) for r in base])
    comparisons, _ = results.compare_cell({"none": arm(before), "dis": arm(after)}, None, floor)
    return comparisons["dis_vs_none"]


SCENARIOS = {  # name: (seeds a side, shift of AFTER's chances, seed of the draws)
    "one seed a side": (1, 0.1, 0),
    "six seeds, a clear gain": (6, 0.3, 1),
    "six seeds, a gain within the noise floor": (6, 0.2, 1),
    "eight seeds, a clear loss": (8, -0.3, 4),
    "three seeds, no change": (3, 0.0, 2),
    "five seeds, a small gain": (5, 0.05, 3),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_compare_on_lm_eval_files_gives_the_recipes_verdict_on_the_same_scores(tmp_path, scenario):
    seeds, shift, seed = SCENARIOS[scenario]
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.1, 0.7, size=40)
    before, after, base = draws(rng, p, seeds), draws(rng, p + shift, seeds), draws(rng, p, 3)
    expected = recipe_comparison(before, after, base)
    found = compare.run(
        write_arm(tmp_path / "none", before),
        write_arm(tmp_path / "dis", after),
        tmp_path / "out",
        noise=write_arm(tmp_path / "base", base),
    )
    got = found["compare"]["after_vs_before"]
    volatile = {"before", "after", "proxy_delta", "proxy_diverges"}
    assert {k: v for k, v in got.items() if k not in volatile} == {
        k: v for k, v in expected.items() if k not in volatile
    }
    assert found["verdict"] == expected["verdict"] and found["reason"] == expected["reason"]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["verdict"] == expected["verdict"]
    assert f"## Verdict: **{expected['verdict']}**" in (tmp_path / "out" / "report.md").read_text()


def test_the_scenarios_reach_several_verdicts(tmp_path):
    """The equality above is tested where it matters: the scenarios do not all end unresolved."""
    verdicts = set()
    for seeds, shift, seed in SCENARIOS.values():
        rng = np.random.default_rng(seed)
        p = rng.uniform(0.1, 0.7, size=40)
        before, after, base = draws(rng, p, seeds), draws(rng, p + shift, seeds), draws(rng, p, 3)
        verdicts.add(recipe_comparison(before, after, base)["verdict"])
    assert verdicts == {"improved", "regressed", "flat", "unresolved"}, verdicts


def test_a_table_of_run_seed_task_score_reads_as_the_same_runs_paired_by_seed(tmp_path):
    rng = np.random.default_rng(5)
    p = rng.uniform(0.2, 0.6, size=12)
    before, after = draws(rng, p, 3), draws(rng, p + 0.2, 3)
    rows = ["run,seed,task,score"]
    for name, runs in (("base", before), ("tuned", after)):
        for s in (2, 0, 1):  # seeds out of order: sorted by label on both sides
            rows += [f"{name},{s},doc-{j:02d},{runs[s][j]}" for j in range(12)]
    table = tmp_path / "scores.csv"
    table.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"holds the runs base, tuned: a side is one run .* --before-run"):
        read_side(table, "BEFORE")
    a = read_side(table, "BEFORE", run="base")
    b = read_side(table, "AFTER", run="tuned")
    assert [r.seed for r in a.runs] == ["0", "1", "2"] and a.tasks()[0] == "doc-00"
    found = compare.compare_sides(a, b)
    via_files = compare.compare_sides(
        read_side(write_arm(tmp_path / "b", before), "BEFORE"), read_side(write_arm(tmp_path / "a", after), "AFTER")
    )
    mine, theirs = found["compare"]["after_vs_before"], via_files["compare"]["after_vs_before"]
    assert mine["delta"] == pytest.approx(theirs["delta"]) and mine["reason"] == theirs["reason"]
    assert found["pairing"] == "3 seeds a side, paired by seed label"
    assert found["noise"]["noise_floor"] is None  # no --noise: none, and nothing can be called flat


def test_the_lm_eval_task_is_the_file_names_middle_part():
    assert lm_eval_task(Path("samples_gsm8k_cot_2026-03-01T10-00-00.000000.jsonl")) == "gsm8k_cot"
    assert lm_eval_task(Path("scores.jsonl")) is None


def test_a_file_with_several_filters_or_metrics_needs_the_one_to_compare(tmp_path):
    path = lm_eval_file(tmp_path, [1.0, 0.0, 1.0], filters=("strict-match", "flexible-extract"))
    with pytest.raises(DataError, match="holds the filters flexible-extract, strict-match: choose one with --filter"):
        read_side(path, "BEFORE")
    side = read_side(path, "BEFORE", filter="flexible-extract")
    assert side.filter == "flexible-extract" and side.metric == "exact_match" and side.benchmark == "gsm8k"
    with pytest.raises(DataError, match="has no filter 'none'"):
        read_side(path, "BEFORE", filter="none")


FAULTS = {  # name: (write BEFORE and AFTER under tmp_path → (before, after, noise or None), words of the error)
    "an lm-eval file of another task": (
        lambda t: (lm_eval_file(t / "b", [1, 0, 1]), lm_eval_file(t / "a", [1, 1, 1], task="arc_easy"), None),
        "AFTER .* is of the lm-eval task 'arc_easy', BEFORE's of 'gsm8k'",
    ),
    "a side holding two lm-eval tasks": (
        lambda t: (write_arm(t / "b", [[1, 0], [0, 1]]), _two_tasks(t / "a"), None),
        "AFTER .* holds lm-eval files of several tasks \\(gsm8k, mmlu\\)",
    ),
    "mismatched task ids": (
        lambda t: (lm_eval_file(t / "b", [1, 0, 1, 1]), lm_eval_file(t / "a", [1, 0, 1]), None),
        "BEFORE and AFTER score different tasks: 1 only in BEFORE \\(e.g. 3\\), 0 only in AFTER",
    ),
    "runs of one side over different tasks": (
        lambda t: (write_arm(t / "b", [[1, 0, 1], [1, 0]]), lm_eval_file(t / "a", [1, 0, 1]), None),
        "BEFORE: .* scores 2 tasks and .* 3, 1 of them not in both",
    ),
    "the same lm-eval run twice": (
        lambda t: (write_arm(t / "b", [[1, 0, 1], [1, 0, 1]]), lm_eval_file(t / "a", [1, 0, 1]), None),
        "BEFORE: .* are the same run \\(identical files\\): a seed counted twice",
    ),
    "a duplicated seed in a table": (
        lambda t: (
            _table(t / "b.csv", ["x,1,t1,0.5", "x,1,t2,1", "x,1,t1,0"]),
            _table(t / "a.csv", ["y,1,t1,1", "y,1,t2,0"]),
            None,
        ),
        "BEFORE .*b.csv:4: seed 1 scores task t1 again \\(.*b.csv:2\\): a duplicated seed",
    ),
    "a NaN score in an lm-eval file": (
        lambda t: (lm_eval_file(t / "b", [1, float("nan"), 1]), lm_eval_file(t / "a", [1, 0, 1]), None),
        "BEFORE .*:2: field 'exact_match': NaN is not a number",
    ),
    "an infinite score in a table": (
        lambda t: (
            _table(t / "b.csv", ["x,1,t1,0.5", "x,1,t2,inf"]),
            _table(t / "a.csv", ["y,1,t1,1", "y,1,t2,0"]),
            None,
        ),
        "BEFORE .*b.csv:3: score is inf: a non-finite score cannot be compared",
    ),
    "another document under the same doc_id": (
        lambda t: (
            lm_eval_file(t / "b", [1, 0]),
            lm_eval_file(t / "a", [1, 0], docs={1: {"question": "Who?", "answer": "me"}}),
            None,
        ),
        "doc_id 1 is another document in .* \\(doc_hash differs\\)",
    ),
    "noise from one run": (
        lambda t: (lm_eval_file(t / "b", [1, 0]), lm_eval_file(t / "a", [1, 1]), lm_eval_file(t / "n", [0, 1])),
        "--noise .* holds one run: the noise floor needs repeated evals",
    ),
    "a corpus-level metric": (
        lambda t: (
            lm_eval_file(t / "b", [[0.1, 0.2], [0.3, 0.4]], metric="bleu"),
            lm_eval_file(t / "a", [[0.1, 0.2], [0.3, 0.4]], metric="bleu"),
            None,
        ),
        "BEFORE .*:1: bleu is .*not a per-task number",
    ),
}


def _two_tasks(folder: Path) -> Path:
    lm_eval_file(folder / "x", [1, 1])
    lm_eval_file(folder / "y", [0, 1], task="mmlu")
    return folder


def _table(path: Path, rows: list[str]) -> Path:
    path.write_text("run,seed,task,score\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_one_line_naming_the_side_and_nothing_is_written(tmp_path, fault):
    make, words = FAULTS[fault]
    before, after, noise = make(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=words) as error:
        compare.run(before, after, out, noise=noise)
    assert "\n" not in str(error.value) and not out.exists()


def test_a_folder_with_the_same_run_copied_under_another_name_is_one_run_twice(tmp_path):
    first = lm_eval_file(tmp_path / "b" / "s0", [1, 0, 1])
    (tmp_path / "b" / "s1").mkdir()
    shutil.copy(first, tmp_path / "b" / "s1" / first.name)
    with pytest.raises(DataError, match="the same run"):
        read_side(tmp_path / "b", "BEFORE")
