"""`sao sweep`: where does the unmasked ratio break? A grid over lag × learning rate × band × arm.

The recipe page ended "unresolved" twice because at its step sizes the unmasked baseline applied ratios
of 20 to 38 and did not blow up, so the mask could not matter. A sweep looks for the regime where it
does: every cell of the grid trains every arm with ``--train-runs`` seeds (arms share prompts, order,
sampler and eval seeds within a seed, exactly as in the recipe), evaluates each run, and compares each
arm against the baseline arm ``none`` with ``stats.compare`` — the base model's repeated evals, shared by
all cells, give the noise floor.

A run has *diverged* (``divergence``) when any step was skipped for a non-finite loss or gradient, any
token was non-finite, or its training reward collapsed: the mean of its last 10 policy steps below half the
mean of its first 10.

Outputs in ``--out``: ``sweep.json`` (grid, base evals, every cell's per-arm pass@1 with intervals, the
comparisons and verdicts, max ratio, masked share, KL per step, divergence), ``sweep.md`` and ``plots/``.
Finished runs are files, so ``--resume`` continues a killed sweep.

Deliberately left out: adaptive search (the grid is explicit and reproducible), and multiple-comparison
correction across cells — each cell's interval is its own 95% interval, and the report says so.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sao import stats
from sao.config import Config
from sao.errors import ConfigError
from sao.io import read_json, write_json
from sao.recipe import base_evals, checks, claim_out_dir, run_label, train_and_eval, versions
from sao.trainer import POLICY, instruction_for, load_split


@dataclass(frozen=True)
class Grid:
    """The axes of the sweep; the cells are their product (arms and seeds inside each cell)."""

    lags: tuple[int, ...] = (1, 4, 8, 16)
    lrs: tuple[float, ...] = (1e-3, 3e-3)
    bands: tuple[tuple[float, float], ...] = ((0.7, 6.0),)
    arms: tuple[str, ...] = ("dis", "none")

    def __post_init__(self) -> None:
        if "none" not in self.arms:
            raise ConfigError("--arms must include 'none': every arm is compared against the plain ratio")
        if len(set(self.arms)) != len(self.arms) or len(self.arms) < 2:
            raise ConfigError(f"--arms needs 'none' and at least one other distinct rule, got {list(self.arms)}")
        if not (self.lags and self.lrs and self.bands):
            raise ConfigError("--lags, --lrs and --bands each need at least one value")

    def cells(self) -> list[dict[str, Any]]:
        return [
            {"lag": lag, "lr": lr, "band": band, "name": cell_name(lag, lr, band)}
            for band in self.bands
            for lr in self.lrs
            for lag in self.lags
        ]


def cell_name(lag: int, lr: float, band: tuple[float, float]) -> str:
    return f"lag{lag}-lr{lr:g}-band{band[0]:g}-{band[1]:g}"


def divergence(records: list[dict[str, Any]]) -> list[str]:
    """Why a run counts as diverged (empty: it did not). See the module docstring for the rule."""
    policy = [r for r in records if r["phase"] == POLICY]
    reasons = []
    skipped = sum(bool(r["skipped"]) for r in policy)
    if skipped:
        reasons.append(f"{skipped} step(s) skipped for a non-finite loss or gradient")
    nonfinite = sum(r["nonfinite"] or 0 for r in records)
    if nonfinite:
        reasons.append(f"{int(nonfinite)} non-finite token(s)")
    if len(policy) >= 20:
        first = statistics.fmean(r["reward_mean"] for r in policy[:10])
        last = statistics.fmean(r["reward_mean"] for r in policy[-10:])
        if last < 0.5 * first:
            reasons.append(f"training reward collapsed {first:.3f} -> {last:.3f}")
    return reasons


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t interval of a mean (a single value has a zero-width interval)."""
    from scipy import stats as sps

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = sps.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


class Sweep:
    """Every cell × arm × seed of ``grid`` on top of ``config``; ``run()`` returns and writes sweep.json."""

    def __init__(
        self,
        config: Config,
        grid: Grid,
        out_dir: str | Path,
        *,
        resume: bool = False,
        progress: bool = True,
        command: str | None = None,
    ):
        self.config, self.grid, self.command = config, grid, command
        self.out = Path(out_dir)
        self.progress = progress
        self.record = {"config": config.to_dict(), "grid": asdict(grid)}
        claim_out_dir(self.out, "sweep-config.json", self.record, resume)
        for cell in grid.cells():  # validate every cell's settings before anything runs
            for arm in grid.arms:
                config.replace(lag=cell["lag"], lr=cell["lr"], band=cell["band"], arm=arm)
        self.split = load_split(config)
        self.instruction = instruction_for(config)
        self.seeds = [config.seed + s for s in range(config.train_runs)]

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        write_json(self.out / "sweep-config.json", self.record)
        cells = self.grid.cells()
        total = len(cells) * len(self.seeds) * len(self.grid.arms)
        done = 0
        results: dict[str, dict[str, list]] = {}
        for cell in cells:
            runs: dict[str, list] = {arm: [] for arm in self.grid.arms}
            for seed in self.seeds:
                for arm in self.grid.arms:
                    done += 1
                    label = run_label(arm, seed)
                    if self.progress:
                        print(f"[sweep {done}/{total}] {cell['name']} {label}", file=sys.stderr, flush=True)
                    config = self.config.replace(lag=cell["lag"], lr=cell["lr"], band=cell["band"], arm=arm, seed=seed)
                    folder = self.out / "cells" / cell["name"]
                    result = train_and_eval(
                        config,
                        folder / "runs" / label,
                        folder / "evals" / f"{label}.json",
                        self.split,
                        self.instruction,
                        f"{cell['name']} {label}",
                        self.progress,
                    )
                    runs[arm].append((seed, result, read_json(folder / "runs" / label / "train_log.json")))
            results[cell["name"]] = runs
        base = base_evals(self.config, self.split, self.instruction, self.out / "evals", self.progress)
        summary = summarize(self.config, self.grid, cells, base, results)
        summary["command"] = self.command
        summary["wall_time_s"] = compute_seconds(base, results)  # summed from the files: a resume does not reset it
        summary["this_invocation_s"] = time.perf_counter() - start
        write_json(self.out / "sweep.json", summary)
        from sao import sweep_report

        sweep_report.write(self.out)
        return summary


def compute_seconds(base: list, results: dict) -> float:
    """Seconds spent training and evaluating, summed over every run and eval of the sweep (from their files,
    so a resumed sweep reports the whole sweep, not its last invocation)."""
    total = sum(e.seconds for e in base)
    for arms in results.values():
        for rows in arms.values():
            total += sum(result.seconds + sum(r["time"] for r in log) for _, result, log in rows)
    return total


def summarize(config: Config, grid: Grid, cells: list[dict], base: list, results: dict) -> dict[str, Any]:
    base_pass = [e.pass_at_1 for e in base]
    run_std = runs = floor = None
    if len(base_pass) >= 2:
        run_std, runs = stats.run_std_of(base_pass)
        floor = stats.noise_floor(run_std, runs)
    out_cells = []
    for cell in cells:
        arms = results[cell["name"]]
        per_arm = {}
        for arm, rows in arms.items():
            passes = [r.pass_at_1 for _, r, _ in rows]
            mean, lo, hi = interval(passes)
            diverged = {run_label(arm, seed): divergence(log) for seed, _, log in rows}
            chk = [checks(log, config.replace(lag=cell["lag"], lr=cell["lr"], band=cell["band"])) for _, _, log in rows]
            policy = [[r for r in log if r["phase"] == POLICY] for _, _, log in rows]
            per_arm[arm] = {
                "pass_at_1": passes,
                "pass_at_1_mean": mean,
                "pass_at_1_ci": [lo, hi],
                "reward_first10": [c["reward_first10"] for c in chk],
                "reward_last10": [c["reward_last10"] for c in chk],
                "ratio_max": max(r["ratio_max"] for p in policy for r in p),
                "ratio_max_median": statistics.median(r["ratio_max"] for p in policy for r in p),
                "masked_share_mean": statistics.fmean(r["masked_share"] for p in policy for r in p),
                "would_be_masked_share_mean": statistics.fmean(r["would_be_masked_share"] for p in policy for r in p),
                "kl_mean": statistics.fmean(r["kl_sampler_policy"] for p in policy for r in p),
                "kl_max": max(r["kl_sampler_policy"] for p in policy for r in p),
                "kl_per_step": [[r["kl_sampler_policy"] for r in p] for p in policy],
                "reward_per_step": [[r["reward_mean"] for r in p] for p in policy],
                "diverged": {label: reasons for label, reasons in diverged.items() if reasons},
            }
        baseline = [r.per_task for _, r, _ in arms["none"]]
        comparisons = {}
        for arm in grid.arms:
            if arm == "none":
                continue
            c = stats.compare(
                baseline,
                [r.per_task for _, r, _ in arms[arm]],
                run_std=run_std,
                run_std_runs=runs,
                proxy=(per_arm["none"]["reward_last10"], per_arm[arm]["reward_last10"]),
            )
            comparisons[f"{arm}_vs_none"] = c.to_dict()
        out_cells.append({**cell, "arms": per_arm, "compare": comparisons})
    return {
        "question": "Over lag x lr x band, where does the unmasked ratio break, and does the mask help there?",
        "versions": versions(),
        "config": config.to_dict(),
        "grid": asdict(grid),
        "seeds": config.train_runs,
        "divergence_rule": "skipped step, non-finite token, or last-10 training reward < 0.5 x first-10",
        "base": {"pass_at_1": base_pass, "run_std": run_std, "runs": runs, "noise_floor": floor},
        "cells": out_cells,
    }
