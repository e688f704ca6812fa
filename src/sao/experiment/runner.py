"""The controlled experiment, for `sao recipe` and `sao sweep` alike: a grid of cells (lag × lr × band), in
every cell each correction rule and the baseline ``none`` trained with the same seeds, every trained policy
evaluated, the untrained base evaluated R times for the noise floor, and every rule compared with ``none``.
A recipe is the one-cell grid; a planned confirmation names its own fresh seeds.

Training comes first, so the reachability warning fires before the evals are paid for. Each finished piece is a
file, with its provenance; ``--resume`` skips finished pieces and continues a run from its last completed step, so
a killed experiment finishes with the same numbers. A damaged file is a one-line error and is never overwritten.
The ``random`` arm drops the share of tokens the ``dis`` arm of the same cell and seed masked.

An arm is named by its correction rule (``dis``: the config's baseline) or by ``RULE+BASELINE`` (``dis+batch-mean``:
correction ``dis`` with the ``batch-mean`` baseline), so arms can differ in the baseline too; ``+`` is in no rule,
baseline or comparison separator (``_vs_``), so ``dis_vs_dis+batch-mean`` reads one way only. A grid may also
``define`` arms of its own by name, each a set of settings over the config (``dis-lambda1: {correction: dis,
gae_lambda: 1}``, ``dis-bf16: {correction: dis, sampler_dtype: bfloat16}``): ablations and doses as arms, trained
with the same seeds as the rest of their cell.

Deliberately left out: choosing hyperparameters, and statistics beyond ``sao.core.stats.compare``.
Design notes: docs/design/experiment-runner.md (with the folder layout).
"""

from __future__ import annotations

import gc
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sao.core import run_folder, timeline
from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.core.io import DamagedFileError, check_output_path, clean, read_saved_json, write_json
from sao.core.names import POLICY
from sao.core.registry import BASELINES, CORRECTIONS
from sao.experiment import provenance as prov
from sao.experiment import report, results
from sao.experiment.evaluate import EvalResult, pass_at_1
from sao.model.policy import context_length, eos_ids, load_base, model_path, pick_device
from sao.rollout.sampler import derived_seed
from sao.tasks import setup
from sao.tasks.base import TaskSet
from sao.training import build, checkpoint
from sao.training.trainer import Hook, Trainer

MARKER = "experiment.json"
EXPERIMENT_LOG = "train_log.json"  # every run's records, with its cell: what the report reads
PROVENANCE = "provenance.json"  # in each run folder: the provenance of every invocation that made or continued it
BASE_PROVENANCE = "base-evals.provenance.json"  # the same for the untrained model's evals (evals/)
BASE_REDO = "delete it and rerun with --resume to make that eval again"


ARM_JOIN = "+"  # RULE+BASELINE: an arm that sets the baseline as well as the correction rule


def arm_settings(arm: str) -> dict[str, str]:
    """The settings an arm's name sets: ``RULE`` → correction RULE (the baseline stays the config's);
    ``RULE+BASELINE`` → correction RULE and baseline BASELINE. Any other name is a one-line ConfigError."""
    rule, join, baseline = arm.partition(ARM_JOIN) if isinstance(arm, str) else ("", "", "")
    if rule not in CORRECTIONS or (join and baseline not in BASELINES):
        raise ConfigError(
            f"unknown arm {arm!r}: an arm is a correction rule ({', '.join(CORRECTIONS.names())}) or "
            f"RULE{ARM_JOIN}BASELINE with a baseline of {', '.join(BASELINES.names())} "
            f"(e.g. dis{ARM_JOIN}batch-mean)"
        )
    return {"correction": rule, **({"baseline": baseline} if join else {})}


DEFINE_SET = ("lag", "lr", "ratio", "seed", "train_runs")  # a cell and the seeds set these, never an arm
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,63}")  # a defined arm's name: a folder name, no "+" or "_vs_"


def _defined(define: Any) -> dict[str, dict[str, Any]]:
    """``define`` checked: name → settings (flat names), each with a correction rule; a ConfigError otherwise."""
    if define is None:
        return {}
    if not isinstance(define, dict):
        raise ConfigError(f"define must map arm names to their settings, got {type(define).__name__}")
    out = {}
    for name, settings in define.items():
        if not (isinstance(name, str) and ARM_NAME.fullmatch(name)) or "_vs_" in name:
            raise ConfigError(f"define: arm name {name!r} must be letters, digits, '.' and '-' (a folder name)")
        if name in CORRECTIONS or ARM_JOIN in name:
            raise ConfigError(f"define: {name!r} is already an arm's name (a rule, or RULE{ARM_JOIN}BASELINE)")
        if not isinstance(settings, dict) or settings.get("correction") not in CORRECTIONS:
            rules = ", ".join(CORRECTIONS.names())
            raise ConfigError(
                f"define: arm {name!r} needs its settings with a correction rule ({rules}), e.g. "
                "{correction: dis, gae_lambda: 1}"
            )
        clash = sorted(set(settings) & set(DEFINE_SET))
        if clash:
            raise ConfigError(f"define: arm {name!r} sets {clash}, which the grid's cells and the seeds set")
        out[name] = dict(settings)
    return out


@dataclass(frozen=True)
class Grid:
    """The cells of an experiment and the rules trained in each; ``none`` is the baseline every rule meets.
    ``define``: arms of the grid's own, by name → settings (the correction rule among them)."""

    lags: tuple[int, ...] = (1, 4, 8, 16)
    lrs: tuple[float, ...] = (1e-3, 3e-3)
    bands: tuple[tuple[float, float], ...] = ((0.7, 6.0),)
    arms: tuple[str, ...] = ("dis", "none")
    define: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "define", _defined(self.define))
        unused = sorted(set(self.define) - set(self.arms))
        if unused:
            raise ConfigError(f"define: {unused} defined but not among the arms {list(self.arms)}")
        for arm in self.arms:
            self.settings_of(arm)
        if "none" not in self.arms:
            raise ConfigError("--arms must include 'none': every arm is compared against the plain ratio")
        if len(set(self.arms)) != len(self.arms) or len(self.arms) < 2:
            raise ConfigError(f"--arms needs 'none' and at least one other distinct rule, got {list(self.arms)}")
        if not (self.lags and self.lrs and self.bands):
            raise ConfigError("--lags, --lrs and --bands each need at least one value")
        object.__setattr__(self, "bands", tuple(tuple(float(x) for x in band) for band in self.bands))

    def settings_of(self, arm: str) -> dict[str, Any]:
        """The settings an arm sets: its definition, else what its name says (``arm_settings``)."""
        return dict(self.define[arm]) if arm in self.define else arm_settings(arm)

    def rule_of(self, arm: str) -> str:
        """The correction rule an arm trains with."""
        return self.settings_of(arm)["correction"]

    def to_dict(self) -> dict[str, Any]:
        """As results.json and experiment.json record it (``define`` only where the grid has some)."""
        out = asdict(self)
        if not self.define:
            out.pop("define")
        return out

    @classmethod
    def recipe(cls, config: Config) -> Grid:
        """The recipe's one cell: the config's lag, lr and band; the recipe arm and the baseline."""
        return cls(
            lags=(config.source.lag,), lrs=(config.training.lr,), bands=(config.algorithm.ratio,), arms=("dis", "none")
        )

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


def read_eval(path: Path, fix: str) -> EvalResult:
    """An eval file written by ``pass_at_1``'s caller, read back and checked; a damaged one is a DamagedFileError
    ending in ``fix``."""
    data = read_saved_json(path, fix, expect=dict)
    try:
        result = EvalResult.from_dict(data)
    except TypeError as error:  # a field missing or unknown
        raise DamagedFileError(f"{path} is damaged (not an eval sao wrote: {error}); {fix}") from None
    scores = [result.pass_at_1, *result.per_task] if isinstance(result.per_task, list) else [None]
    aligned = isinstance(result.task_ids, list) and len(result.task_ids) == len(scores) - 1
    if not (aligned and all(isinstance(x, int | float) and not isinstance(x, bool) for x in scores)):
        why = "its pass_at_1, per_task or task_ids are not what sao writes"
        raise DamagedFileError(f"{path} is damaged ({why}); {fix}")
    return result


@dataclass
class Parts:
    """What an experiment passes to every run and eval beside the config: the task set, and the objects a caller
    gave instead of names (``sao.recipe(..., dataset=, reward_fn=, env_factory=)``)."""

    tasks: TaskSet
    dataset: Any = None
    reward_fn: Any = None
    env_factory: Any = None

    def for_model(self, config: Config, model: Any, tokenizer: Any) -> setup.TaskParts:
        """The run's parts for ``model``'s tokenizer (``setup.parts``): its scorer, environment and sampling."""
        return setup.parts(
            config,
            tokenizer,
            self.tasks,
            reward_fn=self.reward_fn,
            env_factory=self.env_factory,
            eos_token_ids=eos_ids(tokenizer, model),
            context_length=context_length(model),
        )


class EvalEvery(Hook):
    """``--eval-every K``: the policy evaluated after every K-th policy step (the last one is the final eval), with
    the final eval's sampling seed, so the points of a curve differ by the training between them, not by the
    draw. Each eval is a file: a run killed inside one repeats it on --resume."""

    name = "eval-every"
    recorded = False  # the experiment's own: it adds it to every run it makes

    def __init__(self, experiment: Experiment, config: Config, cell: dict[str, Any], label: str, seed: int):
        self.experiment, self.config, self.cell, self.label, self.seed = experiment, config, cell, label, seed

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if record["policy_step"] is None:  # a critic warmup step
            return
        k = record["policy_step"] + 1  # policy steps taken
        every, steps = self.config.eval.eval_every, self.config.training.steps
        path = self.experiment.step_eval_path(self.cell, self.label, k)
        if 0 < k < steps and k % every == 0 and not path.exists():
            m = trainer.models
            parts = self.experiment.parts.for_model(self.config, m.policy, m.tokenizer)
            with timeline.phase("eval"):  # in the step's time_eval
                result = pass_at_1(
                    m.policy,
                    m.tokenizer,
                    parts.tasks.test,
                    f"{self.label} step {k}",
                    seed=derived_seed(self.seed, "eval"),
                    parts=parts,
                    progress=self.experiment.progress,
                )
            write_json(path, result.to_dict())


class FinalEval(Hook):
    """The trained policy's eval, at the end of its run (before the tracker closes, so it mirrors it)."""

    name = "final-eval"
    recorded = False  # the experiment's own: it adds it to every run it makes

    def __init__(self, experiment: Experiment, config: Config, label: str, seed: int):
        self.experiment, self.config, self.label, self.seed = experiment, config, label, seed
        self.result: EvalResult | None = None

    def on_run_end(self, trainer: Trainer) -> None:
        m = trainer.models
        parts = self.experiment.parts.for_model(self.config, m.policy, m.tokenizer)
        self.result = pass_at_1(
            m.policy,
            m.tokenizer,
            parts.tasks.test,
            self.label,
            seed=derived_seed(self.seed, "eval"),
            parts=parts,
            progress=self.experiment.progress,
        )
        trainer.eval_done("held-out", self.result.to_dict())


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
        seeds: list[int] | None = None,
        record: dict[str, Any] | None = None,
        dataset: Any = None,
        reward_fn: Any = None,
        env_factory: Any = None,
    ):
        """``seeds``: the training seeds (default seed, seed + 1, ... for train_runs); ``record``: further settings
        the experiment is started with (a confirmation's plan hash), kept in experiment.json and checked on
        --resume like the rest."""
        randoms = [i for i, arm in enumerate(grid.arms) if grid.rule_of(arm) == "random"]
        if randoms and config.algorithm.random_mask_share is None:
            arms = list(grid.arms)
            if "dis" not in arms or arms.index("dis") > randoms[0]:
                raise ConfigError(
                    "the random arm masks the share the dis arm masked: list dis before random in "
                    "--arms, or give --random-mask-share"
                )
        first = grid.cells()[0]
        self.config = config.replace(
            lag=first["lag"], lr=first["lr"], ratio=first["band"], correction=grid.rule_of(grid.arms[0])
        )
        self.grid, self.command, self.progress = grid, command, progress
        self.out = Path(out_dir)
        self.settings = {"config": self.config.to_dict(), "grid": grid.to_dict()}
        if seeds is not None:  # a planned confirmation names its fresh seeds; else seed, seed + 1, ...
            if not seeds or len(set(seeds)) != len(seeds):
                raise ConfigError(f"the training seeds must be distinct and at least one, got {seeds}")
            self.settings["seeds"] = [int(s) for s in seeds]
        self.settings.update(checkpoint.passed_parts(lambda: "rows passed in", dataset=dataset, reward_fn=reward_fn,
                                                     env_factory=env_factory))  # fmt: skip  # for a replay
        self.settings.update(record or {})
        for cell in grid.cells():  # every cell's settings are valid before anything runs
            for arm in grid.arms:
                self._run_config(cell, arm, self.config.training.seed)
        setup.preflight(self.config, reward_fn=reward_fn, env_factory=env_factory)  # before any data or model
        self._claim(resume)
        tasks = setup.task_set(self.config, dataset)
        self.parts = Parts(tasks, dataset, reward_fn, env_factory)
        self.split: TaskSet = tasks
        self.seeds = self.settings.get("seeds") or [
            self.config.training.seed + s for s in range(self.config.eval.train_runs)
        ]
        self._provenance: dict[str, Any] | None = None  # this invocation's, taken when first needed
        if resume:
            self._check_finished()

    def _check_finished(self) -> None:
        """--resume: every finished piece is read back before anything runs, so that a damaged one is reported
        now rather than after the training that comes before it."""
        for cell in self.grid.cells():
            for seed in self.seeds:
                for arm in self.grid.arms:
                    run_dir, eval_file, redo = self._paths(cell, arm, seed)
                    if eval_file.exists():
                        self._finished(cell, arm, seed)
                        self._finished_state(run_dir, redo)
        for path in self._base_paths():
            if path.exists():
                read_eval(path, BASE_REDO)

    @staticmethod
    def _finished_state(run_dir: Path, redo: str) -> dict[str, Any] | None:
        """A finished run's checkpoint state (for its warnings), or None when its checkpoints were pruned: a finished
        run needs only its eval and its log, which is what a partial experiment carried to another machine keeps."""
        kept = (run_dir / checkpoint.CHECKPOINTS_DIR, run_dir / checkpoint.LEGACY_CHECKPOINT)
        if not any(path.exists() for path in kept):
            return None
        return checkpoint.load(run_dir, redo)

    def _paths(self, cell: dict[str, Any], arm: str, seed: int) -> tuple[Path, Path, str]:
        """(run folder, eval file, what to do when either is damaged) of one run."""
        folder, label = self.out / "cells" / cell["name"], run_label(arm, seed)
        run_dir, eval_file = folder / "runs" / label, folder / "evals" / f"{label}.json"
        return run_dir, eval_file, f"delete {run_dir} and {eval_file}, then rerun with --resume to make them again"

    def _finished(self, cell: dict[str, Any], arm: str, seed: int) -> tuple[EvalResult, list[dict]]:
        """A finished run's eval and log, read back."""
        run_dir, eval_file, redo = self._paths(cell, arm, seed)
        fix = f"delete it and rerun with --resume to evaluate {run_label(arm, seed)} again"
        return read_eval(eval_file, fix), checkpoint.read_log(run_dir, redo)

    def _base_paths(self) -> list[Path]:
        return [self.out / "evals" / f"base-{i}.json" for i in range(self.config.eval.base_evals)]

    def _claim(self, resume: bool) -> None:
        """A folder with an experiment needs --resume and the same settings; one with other files is not ours."""
        marker = self.out / MARKER
        check_output_path(self.out, folder=True)
        if marker.exists():
            if not resume:
                raise ConfigError(f"output folder {self.out} already holds an experiment; pass --resume or a new --out")
            fix = "it records the settings the experiment was started with: restore it, or start again with a new --out"
            differ = run_folder.settings_differ(read_saved_json(marker, fix, expect=dict), self.settings)
            if differ is not None:
                raise ConfigError(
                    f"--resume: the experiment in {self.out} was started with other settings "
                    f"({differ}); give the same settings, or use a new --out"
                )
        elif resume:
            what = "does not exist"
            if self.out.exists():
                what = "holds no experiment" if any(self.out.iterdir()) else "is empty"
            raise ConfigError(f"--resume: {self.out} {what}; check --out, or leave out --resume to start a new one")
        elif self.out.exists() and any(self.out.iterdir()):
            raise ConfigError(f"output folder {self.out} is not empty and holds no sao experiment; choose a new --out")
        self._claimed = run_folder.Claim(self.out, fresh=not resume, created=not self.out.exists())

    def _nothing_done(self) -> bool:
        """Whether no checkpoint and no eval has been written yet: a new experiment that failed this early is undone."""
        return not any(self.out.rglob(f"{checkpoint.CHECKPOINTS_DIR}/step-*")) and not any(self.out.rglob("evals/*"))

    def _run_config(self, cell: dict[str, Any], arm: str, seed: int, share: tuple[float, ...] | None = None) -> Config:
        """One run's settings: the arm's rule (and baseline, for RULE+BASELINE). The random arm without a share of
        its own masks ``share``: the plain dis arm's at each staleness level, measured in the same cell and seed (0
        while settings are only being checked)."""
        changes: dict[str, Any] = {
            "lag": cell["lag"],
            "lr": cell["lr"],
            "ratio": cell["band"],
            **self.grid.settings_of(arm),
            "seed": seed,
        }
        if changes["correction"] == "random" and self.config.algorithm.random_mask_share is None:
            changes["random_mask_share"] = share or 0.0
        return self.config.replace(**changes)

    def _arm_record(self, cell: dict[str, Any], arm: str) -> dict[str, Any]:
        """What an arm trained with, for results.json: its correction rule and baseline (and a defined arm's
        settings)."""
        a = self._run_config(cell, arm, self.seeds[0]).algorithm
        return {
            "correction": a.correction,
            "baseline": a.baseline,
            **({"settings": self.grid.define[arm]} if arm in self.grid.define else {}),
        }

    def _dis_shares(self, cell: dict[str, Any], seed: int) -> tuple[float, ...]:
        """The dis run's masked share at each staleness level 0, 1, ..., its highest, in this cell and seed (trained
        before the random arm: the arms run in grid order, dis first): at each level the mean over the policy steps
        of the share among that level's rows; a level dis never saw takes its mean over every step."""
        run_dir, _, redo = self._paths(cell, "dis", seed)
        return dis_shares_by_staleness(checkpoint.read_log(run_dir, redo))

    @property
    def provenance(self) -> dict[str, Any]:
        """This invocation's provenance (model, tokenizer and data hashes, machine, code), taken once."""
        if self._provenance is None:
            self._provenance = prov.collect(
                model_path(self.config.model.name),
                self.split.train,
                self.split.test,
                self.split.source,
                name=self.config.model.name,
            )
        return self._provenance

    def _record_provenance(self, path: Path) -> None:
        """Add this invocation's provenance to the list in ``path`` (a piece made or continued by it)."""
        blocks = read_saved_json(path, "delete it", expect=list) if path.exists() else []
        if not blocks or blocks[-1] != json.loads(json.dumps(clean(self.provenance))):
            write_json(path, [*blocks, self.provenance])

    def run(self) -> dict[str, Any]:
        """Every run and eval not yet finished, then results.json and the report. A new experiment that fails
        before its first checkpoint or eval leaves its folder as it was found."""
        try:
            return self._run()
        except BaseException:
            if self._nothing_done():
                self._claimed.undo()
            raise

    def _run(self) -> dict[str, Any]:
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
        run_dir, eval_file, _ = self._paths(cell, arm, seed)
        if not eval_file.exists():
            share = (
                self._dis_shares(cell, seed)
                if self.grid.rule_of(arm) == "random" and self.config.algorithm.random_mask_share is None
                else None
            )
            config = self._run_config(cell, arm, seed, share)
            resume = (run_dir / checkpoint.CONFIG_FILE).exists()  # else a new run (a killed first write aside)
            final = FinalEval(self, config, label, seed)
            hooks = [EvalEvery(self, config, cell, label, seed)] if config.eval.eval_every else []
            p = self.parts
            name = f"{cell['name']} {label}" if len(self.grid.cells()) > 1 else label
            trainer = build.trainer(
                config,
                run_dir,
                tasks=p.tasks,
                dataset=p.dataset,
                reward_fn=p.reward_fn,
                env_factory=p.env_factory,
                hooks=[*hooks, final],
                resume=resume,
                progress=self.progress,
                label=name,
            )
            self._record_provenance(run_dir / PROVENANCE)
            trainer.run()
            assert final.result is not None
            write_json(eval_file, final.result.to_dict())
            del trainer
            gc.collect()
        return seed, *self._finished(cell, arm, seed)

    def step_eval_path(self, cell: dict[str, Any], label: str, k: int) -> Path:
        """Where run ``label`` of ``cell`` keeps its eval at policy step ``k`` (``--eval-every``)."""
        return self.out / "cells" / cell["name"] / "evals" / f"{label}-step{k}.json"

    def _start_path(self, seed: int) -> Path:
        return self.out / "evals" / f"start-s{seed}.json"

    def _base_evals(self) -> list[EvalResult]:
        """The untrained base evaluated ``base_evals`` times with different sampling seeds (the noise floor); with
        ``eval_every``, also once per training seed with that seed's eval seed: step 0 of every arm's curve (an
        adapter at its initialisation adds exactly 0, so the untrained policy is the base)."""
        paths = self._base_paths()
        todo = [
            (path, derived_seed(self.config.training.seed, "base-eval", i), f"base-{i}")
            for i, path in enumerate(paths)
            if not path.exists()
        ]
        if self.config.eval.eval_every:
            todo += [
                (self._start_path(s), derived_seed(s, "eval"), f"start-s{s}")
                for s in self.seeds
                if not self._start_path(s).exists()
            ]
        if todo:
            base, tokenizer = load_base(model_path(self.config.model.name), pick_device(self.config.model.device))
            for path, seed, label in todo:
                parts = self.parts.for_model(self.config, base, tokenizer)
                result = pass_at_1(
                    base, tokenizer, self.split.test, label, seed=seed, parts=parts, progress=self.progress
                )
                write_json(path, result.to_dict())
            self._record_provenance(self.out / BASE_PROVENANCE)
            del base
            gc.collect()
        return [read_eval(path, BASE_REDO) for path in paths]

    def _eval_curve(self, cell: dict[str, Any], arm: str, runs: list) -> dict[int, dict[int, float]] | None:
        """seed → policy step → pass@1 for one arm: step 0 (the untrained policy), every K-th step, the final."""
        if not self.config.eval.eval_every:
            return None
        curve: dict[int, dict[int, float]] = {}
        for seed, result, _ in runs:
            label, points = run_label(arm, seed), {}
            start = self._start_path(seed)
            if start.exists():
                points[0] = read_eval(start, BASE_REDO).pass_at_1
            for k in range(self.config.eval.eval_every, self.config.training.steps, self.config.eval.eval_every):
                path = self.step_eval_path(cell, label, k)
                if path.exists():
                    points[k] = read_eval(path, f"delete it and rerun {label} to evaluate step {k} again").pass_at_1
            points[self.config.training.steps] = result.pass_at_1
            curve[seed] = points
        return curve

    def _provenance_warnings(self) -> tuple[list[str], list[str]]:
        """(warnings for pieces whose provenance differs from this invocation's, pieces that record none)."""
        blocks: dict[str, Any] = {"this invocation": self.provenance}
        files = {"base evals": self.out / BASE_PROVENANCE} if self._base_paths() or self.config.eval.eval_every else {}
        for cell in self.grid.cells():
            for seed in self.seeds:
                for arm in self.grid.arms:
                    files[f"{cell['name']} {run_label(arm, seed)}"] = self._paths(cell, arm, seed)[0] / PROVENANCE
        unrecorded = []
        for label, path in files.items():
            if not path.exists():
                unrecorded.append(label)
                continue
            recorded = read_saved_json(path, "delete it to stop this check", expect=list)
            for i, block in enumerate(recorded):
                blocks[label if len(recorded) == 1 else f"{label} (part {i + 1})"] = block
        return prov.differences(blocks), unrecorded

    def _summarize(self, cells: list[dict], base: list[EvalResult], trained: dict) -> dict[str, Any]:
        floor = results.base_block(base)
        base_scores = results.base_per_task(base)
        out_cells, warnings, train_s, eval_s = [], [], {}, {e.label: e.seconds for e in base}
        for cell in cells:
            clip = self.config.training.grad_clip
            arms = {
                arm: {
                    **results.summarize_arm(runs, arm, clip, self._eval_curve(cell, arm, runs)),
                    **self._arm_record(cell, arm),
                }
                for arm, runs in trained[cell["name"]].items()
            }
            compare, vs_base = results.compare_cell(arms, base_scores, floor)
            out_cells.append({**cell, "band": list(cell["band"]), "arms": arms, "compare": compare, "vs_base": vs_base})
            for arm, runs in trained[cell["name"]].items():
                for seed, result, log in runs:
                    key = f"{cell['name']} {run_label(arm, seed)}"
                    during = sum(r.get("time_eval") or 0.0 for r in log)  # --eval-every's evals, in the steps' time
                    train_s[key], eval_s[key] = sum(r["time"] for r in log) - during, result.seconds + during
                    run_dir, _, redo = self._paths(cell, arm, seed)
                    state = self._finished_state(run_dir, redo)
                    warnings += (state or {}).get("warnings", [])
        # each record under the arm's name as the grid gives it (a run's own log says only its rule)
        records = [
            {"cell": name, **r, "arm": arm}
            for name, arms in trained.items()
            for arm, runs in arms.items()
            for _, _, log in runs
            for r in log
        ]
        write_json(self.out / EXPERIMENT_LOG, records)
        cell_name_, comparison = results.primary(out_cells)
        main = out_cells[0]["compare"][comparison]
        differ, unrecorded = self._provenance_warnings()
        for message in differ:
            print("warning: " + message, file=sys.stderr, flush=True)
        return {
            "question": results.question(list(self.grid.arms), len(cells)),
            "command": self.command,
            "versions": results.versions(),
            "provenance": {**self.provenance, "pieces_without_provenance": unrecorded, "warnings": differ},
            "config": self.config.to_dict(),
            "grid": self.grid.to_dict(),
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


def dis_shares_by_staleness(records: list[dict[str, Any]]) -> tuple[float, ...]:
    """Per staleness level 0 .. the highest seen, the mean over a run's policy steps of its masked share among that
    level's rows (a log without ``masked_share_by_staleness`` gives each step's share to its ``staleness``); a level
    with no step takes the mean over every step. (0.0,) for a log with no policy step."""
    by_level: dict[int, list[float]] = {}
    every: list[float] = []
    for r in records:
        if r.get("phase") != POLICY or r.get("masked_share") is None:
            continue
        every.append(float(r["masked_share"]))
        levels = r.get("masked_share_by_staleness") or {str(r.get("staleness", 0)): r["masked_share"]}
        for level, value in levels.items():
            by_level.setdefault(int(level), []).append(float(value))
    if not every:
        return (0.0,)
    overall = statistics.fmean(every)
    return tuple(statistics.fmean(by_level[s]) if s in by_level else overall for s in range(max(by_level) + 1))
