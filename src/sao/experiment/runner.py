"""The controlled experiment, for `sao recipe` and `sao sweep` alike: a grid of cells (lag × lr × band), in
every cell each correction rule and the baseline ``none`` trained with the same seeds, every trained policy
evaluated, the untrained base evaluated R times for the noise floor, and every rule compared with ``none``.
A recipe is the one-cell grid (its lag, lr and band; rules dis and none): the same code path, the same files.

    for cell in grid, for seed s in seed .. seed + S − 1, for arm in arms:   arms share prompts, order,
        train (critic warmup + policy steps)  → cells/<cell>/runs/<arm>-s<seed>/     sampler and eval seeds
        eval the trained policy               → cells/<cell>/evals/<arm>-s<seed>.json
    eval the untrained base R times           → evals/base-<i>.json                  (the noise floor)
    compare every rule with none per cell     → results.json, train_log.json, report.md, plots/

Training comes first so that the reachability warning (a band that masks almost nothing) fires in the
first minutes, before the evals are paid for. Each finished piece is a file; ``--resume`` skips finished
pieces and continues a training run from its last completed step, so a killed experiment finishes with the
same numbers as one that never stopped. The config's lag, lr, band and arm are set to the grid's first
cell, so an experiment folder records one config that replays it (``experiment.json``).

Deliberately left out: choosing hyperparameters, and statistics beyond ``sao.core.stats.compare``.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.core.io import read_json, write_json
from sao.experiment import report, results
from sao.experiment.evaluate import EvalResult, evaluate
from sao.model.policy import POLICY_ADAPTER, eos_ids, load_base, pick_device
from sao.rollout.sampler import derived_seed
from sao.rollout.source import make_decoder
from sao.tasks import DataSplit, instruction_for, load_reward, load_split, model_path
from sao.tasks.envs import episodes_for
from sao.train import checkpoint
from sao.train.trainer import Trainer

MARKER = "experiment.json"


@dataclass(frozen=True)
class Grid:
    """The cells of an experiment and the rules trained in each; ``none`` is the baseline every rule meets."""

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
        object.__setattr__(self, "bands", tuple(tuple(float(x) for x in band) for band in self.bands))

    @classmethod
    def recipe(cls, config: Config) -> Grid:
        """The recipe's one cell: the config's lag, lr and band; the recipe arm and the baseline."""
        return cls(lags=(config.lag,), lrs=(config.lr,), bands=(config.band,), arms=("dis", "none"))

    def cells(self) -> list[dict[str, Any]]:
        return [
            {"lag": lag, "lr": lr, "band": band, "name": cell_name(lag, lr, band)}
            for band in self.bands
            for lr in self.lrs
            for lag in self.lags
        ]


def cell_name(lag: int, lr: float, band: tuple[float, float]) -> str:
    return f"lag{lag}-lr{lr:g}-band{band[0]:g}-{band[1]:g}"


def run_label(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def pass_at_1(
    config: Config, model, tokenizer, tasks: list, instruction: str, seed: int, label: str, progress: bool
) -> EvalResult:
    """The protocol's eval of ``model`` (its policy adapter, if it has one) with the config's eval settings:
    the task's reward on one reply per sample, or the environment's total reward on one episode per sample."""
    adapter = POLICY_ADAPTER if hasattr(model, "peft_config") else None
    episodes = episodes_for(config, tokenizer, tasks, instruction)
    decoder = make_decoder(model, adapter, "plain" if episodes else config.decoder)  # episodes: the plain loop
    score = load_reward(config.reward) if config.reward else None
    return evaluate(
        decoder, tokenizer, tasks, instruction=instruction, samples=config.eval_samples,
        temperature=config.eval_temperature, max_new_tokens=config.eval_max_new_tokens, batch=config.eval_batch,
        seed=seed, eos_token_ids=eos_ids(tokenizer, model), label=label, progress=progress, episodes=episodes,
        score=score,
    )  # fmt: skip


class Experiment:
    """Every cell × arm × seed of ``grid`` on top of ``config`` in ``out_dir``; ``run()`` writes and returns
    results.json's content."""

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
        first = grid.cells()[0]
        self.config = config.replace(lag=first["lag"], lr=first["lr"], band=first["band"], arm=grid.arms[0])
        self.grid, self.command, self.progress = grid, command, progress
        self.out = Path(out_dir)
        self.settings = {"config": self.config.to_dict(), "grid": asdict(grid)}
        for cell in grid.cells():  # every cell's settings are valid before anything runs
            for arm in grid.arms:
                self._run_config(cell, arm, self.config.seed)
        self._claim(resume)
        self.split: DataSplit = load_split(self.config)
        self.instruction = instruction_for(self.config)
        self.seeds = [self.config.seed + s for s in range(self.config.train_runs)]

    def _claim(self, resume: bool) -> None:
        """A folder with an experiment needs --resume and the same settings; one with other files is not ours."""
        marker = self.out / MARKER
        if marker.exists():
            if not resume:
                raise ConfigError(f"output folder {self.out} already holds an experiment; pass --resume or a new --out")
            if not checkpoint.same_settings(read_json(marker), self.settings):
                raise ConfigError(f"--resume: the experiment in {self.out} was started with other settings")
        elif self.out.exists() and any(self.out.iterdir()):
            raise ConfigError(f"output folder {self.out} is not empty and holds no sao experiment; choose a new --out")

    def _run_config(self, cell: dict[str, Any], arm: str, seed: int) -> Config:
        return self.config.replace(lag=cell["lag"], lr=cell["lr"], band=cell["band"], arm=arm, seed=seed)

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        write_json(self.out / MARKER, self.settings)
        cells = self.grid.cells()
        total, done = len(cells) * len(self.seeds) * len(self.grid.arms), 0
        trained: dict[str, dict[str, list]] = {}  # cell → arm → [(seed, eval, log)]
        for cell in cells:
            trained[cell["name"]] = {arm: [] for arm in self.grid.arms}
            for seed in self.seeds:
                for arm in self.grid.arms:
                    done += 1
                    if self.progress and total > 1:
                        print(f"[{done}/{total}] {cell['name']} {run_label(arm, seed)}", file=sys.stderr, flush=True)
                    trained[cell["name"]][arm].append(self._train_and_eval(cell, arm, seed))
        base = self._base_evals()
        summary = self._summarize(cells, base, trained)
        summary["wall_time"]["this_invocation"] = time.perf_counter() - started
        write_json(self.out / "results.json", summary)
        report.write(self.out)
        return summary

    def _train_and_eval(self, cell: dict[str, Any], arm: str, seed: int) -> tuple[int, EvalResult, list[dict]]:
        """Train one run (resuming a partial one) and eval it; a finished eval file is read back instead."""
        label = run_label(arm, seed)
        folder = self.out / "cells" / cell["name"]
        run_dir, eval_file = folder / "runs" / label, folder / "evals" / f"{label}.json"
        if not eval_file.exists():
            config = self._run_config(cell, arm, seed)
            trainer = Trainer(config, run_dir, split=self.split, resume=run_dir.exists(), progress=self.progress,
                              label=f"{cell['name']} {label}" if len(self.grid.cells()) > 1 else label)  # fmt: skip
            try:
                trainer.run(close_tracker=False)
                m = trainer.models
                result = pass_at_1(config, m.policy, m.tokenizer, self.split.test, self.instruction,
                                   derived_seed(seed, "eval"), label, self.progress)  # fmt: skip
                trainer.tracker.log_eval("held-out", result.to_dict(), trainer.total_steps)
            finally:
                trainer.tracker.close()
            write_json(eval_file, result.to_dict())
            del trainer, m
            gc.collect()
        return seed, EvalResult.from_dict(read_json(eval_file)), read_json(run_dir / checkpoint.LOG_FILE)

    def _base_evals(self) -> list[EvalResult]:
        """The untrained base evaluated ``base_evals`` times with different sampling seeds (the noise floor)."""
        paths = [self.out / "evals" / f"base-{i}.json" for i in range(self.config.base_evals)]
        todo = [i for i, path in enumerate(paths) if not path.exists()]
        if todo:
            base, tokenizer = load_base(model_path(self.config), pick_device(self.config.device))
            for i in todo:
                seed = derived_seed(self.config.seed, "base-eval", i)
                result = pass_at_1(self.config, base, tokenizer, self.split.test, self.instruction, seed, f"base-{i}",
                                   self.progress)  # fmt: skip
                write_json(paths[i], result.to_dict())
            del base
            gc.collect()
        return [EvalResult.from_dict(read_json(path)) for path in paths]

    def _summarize(self, cells: list[dict], base: list[EvalResult], trained: dict) -> dict[str, Any]:
        floor = results.base_block(base)
        base_scores = results.base_per_task(base)
        out_cells, warnings, train_s, eval_s = [], [], {}, {e.label: e.seconds for e in base}
        for cell in cells:
            arms = {arm: results.summarize_arm(runs, arm, self.config.grad_clip)
                    for arm, runs in trained[cell["name"]].items()}  # fmt: skip
            compare, vs_base = results.compare_cell(arms, base_scores, floor)
            out_cells.append({**cell, "band": list(cell["band"]), "arms": arms, "compare": compare, "vs_base": vs_base})
            for arm, runs in trained[cell["name"]].items():
                for seed, result, log in runs:
                    key = f"{cell['name']} {run_label(arm, seed)}"
                    train_s[key], eval_s[key] = sum(r["time"] for r in log), result.seconds
                    state = checkpoint.load(self.out / "cells" / cell["name"] / "runs" / run_label(arm, seed))
                    warnings += (state or {}).get("warnings", [])
        records = [{"cell": name, **r} for name, arms in trained.items() for runs in arms.values()
                   for _, _, log in runs for r in log]  # fmt: skip
        write_json(self.out / checkpoint.LOG_FILE, records)
        cell_name_, comparison = results.primary(out_cells)
        main = out_cells[0]["compare"][comparison]
        return {
            "question": results.question(list(self.grid.arms), len(cells)),
            "command": self.command,
            "versions": results.versions(),
            "config": self.config.to_dict(),
            "grid": asdict(self.grid),
            "seeds": self.seeds,
            "data": {"source": self.split.source, **self.split.counts},
            "base": floor,
            "cells": out_cells,
            "primary": {"cell": cell_name_, "comparison": comparison},
            "verdict": main["verdict"],
            "reason": main["reason"],
            "warnings": warnings,
            "wall_time": {
                "train": train_s,
                "eval": eval_s,
                "train_total": sum(train_s.values()),
                "eval_total": sum(eval_s.values()),
                "compute_total": sum(train_s.values()) + sum(eval_s.values()),
            },
        }
