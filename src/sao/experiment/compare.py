"""``sao compare BEFORE AFTER``: sao's verdict on two arms' per-task scores that any tool wrote.

Each side is read by ``sao.experiment.scores`` (lm-eval samples files or a run/seed/task/score table), one run per
seed; ``--noise`` names repeated evals of one model, whose pass@1 values give the noise floor as the recipe's base
evals do (``results.noise_block``). The comparison is ``sao.core.stats.compare`` on the [seeds, tasks] matrices,
called exactly as ``sao recipe`` calls it for an arm against ``none`` (``results.compare_cell``), so the verdict,
the intervals, the equivalence test and their reason in words are the recipe's on the same scores. results.json
holds the inputs (paths, sha256, metric, filter), each side's runs with their means and interval, the noise block
and the comparison; report.md is rendered from it by ``sao.experiment.report`` (``sao report`` rebuilds it).

Deliberately left out: a proxy metric (no training log here), several comparisons at once (one pair a call), and
plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sao.core import stats
from sao.core.errors import ConfigError, DataError
from sao.core.io import check_output_path, write_json
from sao.experiment import report, results
from sao.experiment.scores import Side, check_pair, read_side

KEY = "after_vs_before"


def compare_sides(
    before: Side,
    after: Side,
    noise: Side | None = None,
    *,
    smallest_effect: float | None = None,
    alpha: float = stats.ALPHA,
    before_fixed: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """results.json's content: the sides, the noise floor, and ``stats.compare`` of AFTER against BEFORE."""
    check_pair(before, after)
    if noise is not None:
        check_pair(before, noise)
        if len(noise.runs) < 2:
            raise DataError(f"--noise {noise.path} holds one run: the noise floor needs repeated evals (2 or more)")
    if before_fixed and len(before.runs) != 1:
        raise ConfigError(
            f"--before-fixed: BEFORE must be one run of one fixed model, {before.path} holds {len(before.runs)}"
        )
    tasks = before.tasks()
    floor = results.noise_block([run.mean for run in noise.runs] if noise is not None else [])
    c = stats.compare(
        before.matrix(tasks),
        after.matrix(tasks),
        run_std=floor["run_std"],
        run_std_runs=floor["runs"],
        before_fixed=before_fixed,
        smallest_effect=smallest_effect,
        alpha=alpha,
    )
    what = f"{before.benchmark} " if before.benchmark else ""
    return {
        "kind": report.COMPARISON_KIND,  # what `sao report` tells a comparison by
        "question": f"Does {after.name} score higher than {before.name} on {what}{before.metric}, task by task?",
        "command": command,
        "versions": results.versions(),
        "tasks": len(tasks),
        "pairing": _pairing(before, after, before_fixed),
        "sides": {"before": _side_block(before), "after": _side_block(after)},
        "noise": {**floor, "source": noise.to_dict() if noise is not None else None},
        "compare": {KEY: {"before": before.name, "after": after.name, **c.to_dict()}},
        "verdict": c.verdict,
        "reason": c.reason,
    }


def _side_block(side: Side) -> dict[str, Any]:
    means = [run.mean for run in side.runs]
    mean, low, high = results.interval(means)
    return {**side.to_dict(), "means": means, "mean": mean, "mean_ci": [low, high]}


def _pairing(before: Side, after: Side, before_fixed: bool) -> str:
    """How the units were formed, in words (``stats.compare`` decides; this says which case it was)."""
    b, a = len(before.runs), len(after.runs)
    if before_fixed:
        return f"each of AFTER's {a} seeds against BEFORE, one fixed model"
    if a == b == 1:
        return "task by task: one run a side"
    if a == b:
        seeds = [r.seed for r in before.runs] == [r.seed for r in after.runs] and before.runs[0].seed is not None
        return f"{a} seeds a side, paired " + ("by seed label" if seeds else "in the order the runs were read")
    if min(a, b) == 1:
        return f"the seeds of one side against the other's single run ({b} and {a} runs)"
    return f"unpaired: {b} and {a} seeds (Welch's t over seeds)"


OUTPUTS = ("results.json", "report.md")


def _check_out(out: Path) -> None:
    """A new or empty folder, or one holding a comparison's two files (replaced): never another run's results."""
    check_output_path(out, folder=True)
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and (set(held) - set(OUTPUTS) or report.comparison_results(out) is None):
        raise ConfigError(
            f"--out {out} holds other files ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}): "
            "choose a new or empty folder, or one a comparison wrote"
        )


def run(
    before: str | Path,
    after: str | Path,
    out: str | Path,
    *,
    noise: str | Path | None = None,
    metric: str | None = None,
    filter: str | None = None,
    before_run: str | None = None,
    after_run: str | None = None,
    noise_run: str | None = None,
    smallest_effect: float | None = None,
    alpha: float = stats.ALPHA,
    before_fixed: bool = False,
    command: str | None = None,
) -> dict[str, Any]:
    """Read both sides (and the noise runs), compare, then write OUT/results.json and OUT/report.md; nothing is
    written when anything is refused."""
    _check_out(Path(out))
    sides = [
        read_side(before, "BEFORE", metric=metric, filter=filter, run=before_run),
        read_side(after, "AFTER", metric=metric, filter=filter, run=after_run),
    ]
    noisy = read_side(noise, "--noise", metric=metric, filter=filter, run=noise_run) if noise is not None else None
    found = compare_sides(
        *sides, noisy, smallest_effect=smallest_effect, alpha=alpha, before_fixed=before_fixed, command=command
    )
    text = report.render_comparison(found)  # before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", found)
    report.write_text(out, text)
    return found
