"""`sao recipe`: the controlled experiment. Both arms, S training seeds each, the base model evaluated R
times for the noise floor, a paired comparison with an honest verdict, and every number written by code.

    for seed s in seed .. seed + S − 1:          the arms share prompts, order, sampler and eval seeds
        for arm in (dis, none):
            train (critic warmup + policy steps)  → runs/<arm>-s<seed>/        (resumable per step)
            eval the trained policy               → evals/<arm>-s<seed>.json
    eval the untrained base R times              → evals/base-<i>.json         (the noise floor)
    compare(none, dis) over tasks (S = 1) or seeds (S ≥ 2), and each arm against the base
    → results.json, train_log.json, report.md, plots/

Training comes first so that the reachability warning (a band that masks almost nothing) fires in the
first minutes, before the evals are paid for. Each finished piece is a file; ``--resume`` skips finished
pieces and continues a training run from its last completed step, so a killed run finishes with the
same numbers as one that never stopped.

Deliberately left out: choosing hyperparameters (``sao sweep`` varies them), and any statistics beyond
``sao.stats.compare``.
"""

from __future__ import annotations

import gc
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sao import stats
from sao.config import Config
from sao.errors import ConfigError
from sao.evaluate import EvalResult, evaluate
from sao.io import as_json, read_json, write_json
from sao.models import POLICY_ADAPTER, load_base, pick_device
from sao.sampler import derived_seed, eos_ids
from sao.trainer import POLICY, Trainer, instruction_for, load_split, model_path

ARMS = ("dis", "none")  # the recipe arm, then the baseline: delta = dis − none
FOLDED_SKIP = {"seed", "step", "policy_step", "policy_version"}


def run_label(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def claim_out_dir(out: Path, marker: str, record: dict[str, Any], resume: bool) -> None:
    """Refuse to mix experiments: a folder with ``marker`` needs --resume and the same settings; a folder
    holding anything else is not ours to write into. Writes nothing."""
    path = out / marker
    if path.exists():
        if not resume:
            raise ConfigError(f"output folder {out} already holds an experiment; pass --resume or choose another --out")
        if read_json(path) != as_json(record):
            raise ConfigError(f"--resume: the experiment in {out} was started with other settings")
    elif out.exists() and any(out.iterdir()):
        raise ConfigError(f"output folder {out} is not empty and holds no sao experiment; choose another --out")


def pass_at_1(config: Config, model, tokenizer, tasks, instruction: str, seed: int, label: str, progress: bool):
    """The protocol's eval of ``model`` on ``tasks`` with the config's eval settings (through ``sao.engine``
    when the config's decoder says so for this device)."""
    eos = eos_ids(tokenizer, model)
    device = next(model.parameters()).device
    if config.uses_engine(device.type):
        from sao.engine import Engine

        adapter = POLICY_ADAPTER if hasattr(model, "peft_config") else None
        model = Engine(model, adapter=adapter)
    return evaluate(
        model,
        tokenizer,
        tasks,
        instruction=instruction,
        samples=config.eval_samples,
        temperature=config.eval_temperature,
        max_new_tokens=config.eval_max_new_tokens,
        batch=config.eval_batch,
        seed=seed,
        eos_token_ids=eos,
        label=label,
        progress=progress,
    )


def train_and_eval(
    config: Config, run_dir: Path, eval_file: Path, split: Any, instruction: str, label: str, progress: bool
) -> EvalResult:
    """Train one arm/seed into ``run_dir`` (resuming if it exists) and eval it into ``eval_file``; a finished
    eval file is read back instead."""
    if eval_file.exists():
        return EvalResult.from_dict(read_json(eval_file))
    trainer = Trainer(config, run_dir, split=split, resume=run_dir.exists(), progress=progress, label=label)
    trainer.run()
    models = trainer.models
    seed = derived_seed(config.seed, "eval")
    result = pass_at_1(config, models.policy, models.tokenizer, split.test, instruction, seed, label, progress)
    write_json(eval_file, result.to_dict())
    del trainer, models
    gc.collect()
    return result


def base_evals(config: Config, split: Any, instruction: str, evals_dir: Path, progress: bool) -> list[EvalResult]:
    """The untrained base evaluated ``base_evals`` times with different sampling seeds (the noise floor)."""
    results, todo = [], []
    for i in range(config.base_evals):
        path = evals_dir / f"base-{i}.json"
        if path.exists():
            results.append(EvalResult.from_dict(read_json(path)))
        else:
            todo.append(i)
    if todo:
        base, tokenizer = load_base(model_path(config), pick_device(config.device))
        for i in todo:
            seed = derived_seed(config.seed, "base-eval", i)
            result = pass_at_1(config, base, tokenizer, split.test, instruction, seed, f"base-{i}", progress)
            write_json(evals_dir / f"base-{i}.json", result.to_dict())
            results.append(result)
        del base
        gc.collect()
    return sorted(results, key=lambda r: r.label)


class Recipe:
    """One experiment in ``out_dir``. ``run()`` returns the results dict it also writes."""

    def __init__(self, config: Config, out_dir: str | Path, *, resume: bool = False, progress: bool = True):
        self.config = config
        self.out = Path(out_dir)
        self.progress = progress
        self.record = {"config": config.to_dict()}
        claim_out_dir(self.out, "recipe.json", self.record, resume)
        self.split = load_split(config)
        self.instruction = instruction_for(config)
        self.seeds = [config.seed + s for s in range(config.train_runs)]

    def _train_and_eval(self, arm: str, seed: int) -> EvalResult:
        label = run_label(arm, seed)
        config = self.config.replace(arm=arm, seed=seed)
        run_dir, eval_file = self.out / "runs" / label, self.out / "evals" / f"{label}.json"
        return train_and_eval(config, run_dir, eval_file, self.split, self.instruction, label, self.progress)

    # -- the whole experiment --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        write_json(self.out / "recipe.json", self.record)
        arm_evals: dict[str, list[EvalResult]] = {arm: [] for arm in ARMS}
        for seed in self.seeds:
            for arm in ARMS:
                arm_evals[arm].append(self._train_and_eval(arm, seed))
        base = base_evals(self.config, self.split, self.instruction, self.out / "evals", self.progress)
        records = []
        for seed in self.seeds:
            for arm in ARMS:
                records.extend(read_json(self.out / "runs" / run_label(arm, seed) / "train_log.json"))
        write_json(self.out / "train_log.json", records)
        results = build_results(self.config, self.split, base, arm_evals, records, self.out)
        results["wall_time"]["this_invocation"] = time.perf_counter() - start
        write_json(self.out / "results.json", results)
        from sao import report

        report.write_report(self.out)
        return results


# ---------------------------------------------------------------------------------------------------------
# Folding the logs into results.json.


def fold(series: list[Any]) -> dict[str, float | None]:
    """first / last / mean / max / min of a series, ignoring missing (None/NaN) entries."""
    values = [float(v) for v in series if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if not values:
        return {"first": None, "last": None, "mean": None, "max": None, "min": None, "n": 0}
    return {
        "first": values[0],
        "last": values[-1],
        "mean": statistics.fmean(values),
        "max": max(values),
        "min": min(values),
        "n": len(values),
    }


def numeric_keys(records: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for r in records:
        for k, v in r.items():
            if k in FOLDED_SKIP or k in keys:
                continue
            if (isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None:
                keys.append(k)
    return [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records)]


def curves(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Every numeric series of the policy steps, folded. (Warmup steps take no policy step.)"""
    policy = [r for r in records if r["phase"] == POLICY]
    return {k: fold([r.get(k) for r in policy]) for k in numeric_keys(policy)}


def mean_over_seeds(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Step-wise mean of several seeds' policy records (one seed: the records themselves)."""
    if len(runs) == 1:
        return [r for r in runs[0] if r["phase"] == POLICY]
    policy = [[r for r in run if r["phase"] == POLICY] for run in runs]
    out = []
    for rows in zip(*policy, strict=False):
        merged: dict[str, Any] = {"phase": POLICY}
        for k in numeric_keys(list(rows)):
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            merged[k] = statistics.fmean(vals) if vals else None
        out.append(merged)
    return out


def checks(records: list[dict[str, Any]], config: Config) -> dict[str, Any]:
    """The page's checks, computed: critic, gradient, non-finite, the mask by staleness, lag-0 numerics."""
    warm = [r for r in records if r["phase"] != POLICY]
    policy = [r for r in records if r["phase"] == POLICY]
    last10 = policy[-10:]
    grad = [r["grad_norm"] for r in policy if r["grad_norm"] is not None and math.isfinite(r["grad_norm"])]
    by_staleness: dict[str, dict[str, float]] = {}
    for s in sorted({r["staleness"] for r in policy}):
        rows = [r for r in policy if r["staleness"] == s]
        by_staleness[str(s)] = {
            "steps": len(rows),
            "masked_share": statistics.fmean(r["masked_share"] for r in rows),
            "would_be_masked_share": statistics.fmean(r["would_be_masked_share"] for r in rows),
            "ratio_max_median": statistics.median(r["ratio_max"] for r in rows),
        }
    fresh = [r for r in records if r["staleness"] == 0]

    def mean(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])]
        return statistics.fmean(vals) if vals else None

    return {
        "critic_ev_warmup_end": warm[-1]["explained_variance"] if warm else None,
        "critic_ev_last10": mean(last10, "explained_variance"),
        "critic_loss_warmup_end": warm[-1]["critic_loss"] if warm else None,
        "critic_loss_last10": mean(last10, "critic_loss"),
        "grad_norm_mean": statistics.fmean(grad) if grad else None,
        "grad_norm_max": max(grad) if grad else None,
        "clip_bound_steps": sum(g > config.grad_clip for g in grad),
        "clip_ever_bound": any(g > config.grad_clip for g in grad),
        "nonfinite_tokens": sum(r["nonfinite"] for r in records),
        "skipped_steps": sum(bool(r["skipped"]) for r in records),
        "masked_share_by_staleness": by_staleness,
        "masked_share_max": max((r["masked_share"] for r in policy), default=None),
        "lag0_abs_log_ratio_mean": mean(fresh, "abs_log_ratio_mean"),
        "lag0_abs_log_ratio_max": max((r["abs_log_ratio_max"] for r in fresh), default=None),
        "reward_first10": mean(policy[:10], "reward_mean"),
        "reward_last10": mean(last10, "reward_mean"),
        "response_length_last10": mean(last10, "response_length"),
        "truncation_share_last10": mean(last10, "truncation_share"),
    }


def versions() -> dict[str, str]:
    import numpy
    import peft
    import scipy
    import transformers

    import sao

    out = {
        "sao": sao.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
    }
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})"
    return out


def build_results(
    config: Config,
    split: Any,
    base_evals: list[EvalResult],
    arm_evals: dict[str, list[EvalResult]],
    records: list[dict[str, Any]],
    out_dir: Path,
) -> dict[str, Any]:
    seeds = sorted({r["seed"] for r in records})
    by_run = {
        run_label(arm, s): [r for r in records if r["arm"] == arm and r["seed"] == s] for arm in ARMS for s in seeds
    }
    base_pass = [e.pass_at_1 for e in base_evals]
    floor = None
    run_std = runs = None
    if len(base_pass) >= 2:
        run_std, runs = stats.run_std_of(base_pass)
        floor = stats.noise_floor(run_std, runs)

    def scores(arm: str) -> list[list[float]]:
        return [e.per_task for e in arm_evals[arm]]

    def last10_reward(arm: str) -> list[float]:
        return [checks(by_run[run_label(arm, s)], config)["reward_last10"] for s in seeds]

    main = stats.compare(
        scores("none"),
        scores("dis"),
        run_std=run_std,
        run_std_runs=runs,
        proxy=(last10_reward("none"), last10_reward("dis")),
    )
    vs_base = {}
    if base_evals:
        base_per_task = [statistics.fmean(col) for col in zip(*(e.per_task for e in base_evals), strict=True)]
        for arm in ARMS:
            vs_base[arm] = stats.compare(base_per_task, scores(arm), run_std=run_std, run_std_runs=runs).to_dict()
    train_seconds = {label: sum(r["time"] for r in rows) for label, rows in by_run.items()}
    eval_seconds = {e.label: e.seconds for e in base_evals} | {
        e.label: e.seconds for v in arm_evals.values() for e in v
    }
    warnings = []
    for label in by_run:
        path = out_dir / "runs" / label / "checkpoint.pt"
        if path.exists():
            warnings.extend(torch.load(path, map_location="cpu", weights_only=False).get("warnings", []))
    return {
        "question": "Does masking tokens outside the IS band (dis) beat the plain ratio (none) on held-out pass@1?",
        "versions": versions(),
        "config": config.to_dict(),
        "data": {"source": split.source, **split.counts},
        "evals": {
            "base": [e.to_dict() for e in base_evals],
            **{arm: [e.to_dict() for e in arm_evals[arm]] for arm in ARMS},
        },
        "pass_at_1": {
            "base": base_pass,
            **{arm: [e.pass_at_1 for e in arm_evals[arm]] for arm in ARMS},
        },
        "noise_floor": {"base_pass_at_1": base_pass, "run_std": run_std, "runs": runs, "floor": floor},
        "compare": {"before": "none", "after": "dis", **main.to_dict()},
        "verdict": main.verdict,
        "reason": main.reason,
        "vs_base": vs_base,
        "curves": {arm: curves(mean_over_seeds([by_run[run_label(arm, s)] for s in seeds])) for arm in ARMS},
        "curves_by_run": {label: curves(rows) for label, rows in by_run.items()},
        "checks": {label: checks(rows, config) for label, rows in by_run.items()},
        "warnings": warnings,
        "wall_time": {
            "train": train_seconds,
            "eval": eval_seconds,
            "train_total": sum(train_seconds.values()),
            "eval_total": sum(eval_seconds.values()),
        },
    }
