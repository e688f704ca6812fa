"""One policy, one seed: critic warmup, then policy steps on whatever batches a source hands it.

    prompts ──► source ──► trajectories + sampler_logprobs ──► scorer (rewards)
            ──► teacher-forced pass, micro-batch by micro-batch (logprobs with grad, hidden detached)
            ──► value head ──► SAO.update ──► loss = −Σ c·logprobs (+ optional KL, entropy) ──► backward
            ──► clip ──► AdamW on LoRA (scheduled lr) ──► fit_critic: critic_steps × squared error ──► one log record

Global step g runs 0 .. W + steps − 1; the first W steps train only the critic, each on a fresh batch: W is
``critic_warmup``, or with ``critic_warmup="auto"`` the first step count at which the critic, scored on each warmup
batch before it trains on it, explains ``critic_warmup_target`` of the returns' variance on two batches in a row
(at most ``critic_warmup_limit``). The trainer takes its parts (models, source, scorer, hooks) and knows no source
by name: where a batch comes from is the source's business, and everything beside the step (publishing, tracking,
warnings, evaluation) is a hook's. A killed run resumes from its last checkpoint; with the local source it ends with the
same numbers as one that never stopped. Assembling the parts from a config is ``sao.training.build``.

Full fine-tuning leaves OUT/model/ (a Hugging Face folder) instead of OUT/adapter/, a value model OUT/critic/ beside
it. Sharded (``--shard fsdp``, ``sao.model.sharding``) every process saves its shards in each checkpoint and takes
part in gathering what is published and exported, tensor by tensor.

Deliberately left out: evaluation and the two-arm experiment (``sao.experiment``).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sao.algorithm.corrections import row_keys
from sao.algorithm.oracle import ceiling, shrunk_rates
from sao.algorithm.update import SAO, explained_variance
from sao.core import timeline
from sao.core.config import Config
from sao.core.errors import ConfigError, NothingTrained
from sao.core.names import POLICY, WARMUP
from sao.core.plugins import describe as describe_error
from sao.core.reading import preview
from sao.model import artifacts
from sao.model.forward import TeacherForced
from sao.model.memory import auto_micro_batch, with_oom_retry
from sao.model.policy import Models, causal_lm, describe
from sao.rollout.sources import Source, SourceExhausted
from sao.rollout.types import Batch, Rollout
from sao.tasks.base import Scorer
from sao.training import checkpoint
from sao.training.distributed import SINGLE, BroadcastSource, World
from sao.training.learn import (
    PassResult,
    apply_policy_step,
    critic_optimizer,
    fit_critic,
    lr_factor,
    policy_gradient_pass,
)
from sao.training.records import step_record

log = logging.getLogger("sao.training")


class Hook:
    """A trainer callback: override the events you need; every one gets the trainer (``sao.training.hooks`` lists the
    events and holds the built-in hooks)."""

    name = "hook"
    recorded = True  # config.json names the hook's class, for a replay (False: a part of whatever built the run)

    def on_run_start(self, trainer: Trainer) -> None: ...

    def on_pass(self, trainer: Trainer, batch: Batch, forward: TeacherForced) -> dict[str, Any]:
        return {}

    def on_update(self, trainer: Trainer, version: int) -> None: ...

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None: ...

    def on_checkpoint(self, trainer: Trainer, step: int) -> None: ...

    def on_eval(self, trainer: Trainer, label: str, metrics: dict[str, Any]) -> None: ...

    def on_run_end(self, trainer: Trainer) -> None: ...

    def on_close(self, trainer: Trainer) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


HOOK_METHODS = (
    "on_run_start",
    "on_pass",
    "on_update",
    "on_step_end",
    "on_checkpoint",
    "on_eval",
    "on_run_end",
    "on_close",
    "state_dict",
    "load_state_dict",
)
SOURCE_METHODS = ("next_batch", "after_update", "state_dict", "load_state_dict", "close")


def _what(obj: Any) -> str:
    """How an error names an object a caller passed: its kind and its name."""
    if isinstance(obj, type):
        return f"the class {obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"the function {obj.__qualname__}"
    return f"a {type(obj).__qualname__}"


def check_hooks(hooks: Any) -> list[Hook]:
    """``hooks`` as a list, each an object with the ``Hook`` events (a subclass's instance); anything else is a
    TypeError naming the entry, before any folder is claimed or model loaded."""
    if isinstance(hooks, Hook | type | str | bytes | dict) or callable(hooks):
        raise TypeError(f"hooks must be a list of hooks, got {_what(hooks)}; pass hooks=[MyHook()]")
    try:
        hooks = list(hooks)
    except TypeError:
        raise TypeError(f"hooks must be a list of hooks, got {_what(hooks)}") from None
    for i, hook in enumerate(hooks):
        if isinstance(hook, type):
            fix = f"pass an instance, {hook.__qualname__}()"
            fix += "" if issubclass(hook, Hook) else ", of a subclass of sao.training.trainer.Hook"
            raise TypeError(f"hooks[{i}] is {_what(hook)}, not a hook; {fix}")
        missing = [m for m in HOOK_METHODS if not callable(getattr(hook, m, None))]
        if missing:
            raise TypeError(
                f"hooks[{i}] is {_what(hook)}, not a hook (it has no {', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}); subclass sao.training.trainer.Hook and "
                "pass an instance"
            )
        if not isinstance(getattr(hook, "name", None), str) or not hook.name:
            raise TypeError(
                f"hooks[{i}] ({type(hook).__qualname__}): its name must be a non-empty string, got "
                f"{getattr(hook, 'name', None)!r}"
            )
    return hooks


def check_source(source: Any) -> None:
    """A source passed in is an object with the ``Source`` methods and attributes; anything else (a class, a
    function, another object) is a TypeError naming it, before any folder is claimed or model loaded."""
    if source is None:
        return
    if isinstance(source, type):
        raise TypeError(f"source is {_what(source)}, not a source; pass an instance, {source.__qualname__}(...)")
    missing = [m for m in SOURCE_METHODS if not callable(getattr(source, m, None))]
    missing += [a for a in ("max_staleness", "tasks") if not hasattr(source, a)]
    if missing:
        raise TypeError(
            f"source is {_what(source)}, not a source (it has no {', '.join(missing)}); a source has the "
            "methods and attributes of sao.rollout.sources.Source"
        )


def hook_label(hook: Any) -> str:
    """How an error names a hook: its class and, when it is not the default, its name."""
    kind = type(hook).__qualname__
    return kind if getattr(hook, "name", "hook") in ("hook", kind) else f"{kind} ({hook.name!r})"


def state_keys(hooks: Sequence[Any]) -> list[str]:
    """Each hook's key for its state in a checkpoint, so that no two hooks can take each other's: a built-in's (sao's
    own) is its name; a hook of yours is keyed by its class and name (``user:module.Class:name``), numbered when two
    are alike (``#2``), so a hook named like a built-in never takes the built-in's state."""
    keys: list[str] = []
    for hook in hooks:
        kind = type(hook)
        base = hook.name if _builtin(hook) else f"user:{kind.__module__}.{kind.__qualname__}:{hook.name}"
        key, n = base, 1
        while key in keys:
            n += 1
            key = f"{base}#{n}"
        keys.append(key)
    return keys


def _builtin(hook: Any) -> bool:
    return type(hook).__module__.split(".")[0] == "sao"


def _plain(value: Any, where: str) -> Any:
    """A hook's record extra as JSON holds it (tensors and numpy values become numbers, tuples lists); anything else
    a log line cannot hold is a TypeError naming ``where``."""
    if hasattr(value, "tolist") and callable(value.tolist) and not isinstance(value, str | bytes):
        value = value.tolist()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(
                f"{where} holds a dict with a key that is not a string; the step log (JSON) has string keys"
            )
        return {k: _plain(v, where) for k, v in value.items()}
    raise TypeError(
        f"{where} is {preview(value)} ({type(value).__name__}), which the step log (JSON) cannot hold; "
        "return numbers, strings, booleans, None, or lists and dicts of them"
    )


def pass_extras(hook: Any, got: Any) -> dict[str, Any]:
    """What ``hook.on_pass`` returned, checked: a dict of string keys and values the step log can hold."""
    label = f"hook {hook_label(hook)}: on_pass"
    if not isinstance(got, Mapping):
        raise TypeError(
            f"{label} returned {preview(got)}; it returns a dict of fields for the step's record ({{}} for none)"
        )
    for key in got:
        if not isinstance(key, str):
            raise TypeError(f"{label} returned the key {preview(key)}; the step's record has string keys")
    return {key: _plain(value, f"{label} returned {key!r}, which") for key, value in got.items()}


class Trainer:
    """Trains ``models`` on ``source``'s batches, graded by ``scorer``, into the run folder ``run``; ``run()``
    returns the log records. ``config`` supplies the algorithm and training settings (and the rollout temperature
    the teacher-forced pass takes). ``run`` is a ``checkpoint.RunDir`` the builder opened (claimed, its checkpoint
    read on --resume; ``sao.training.build.trainer``), or a path, claimed here for a new run. The constructor
    restores from the checkpoint in memory and writes nothing: config.json is written when ``run()`` starts."""

    def __init__(
        self,
        models: Models,
        source: Source | None,
        scorer: Scorer,
        config: Config,
        run: checkpoint.RunDir | str | Path,
        *,
        hooks: Sequence[Hook] = (),
        world: World = SINGLE,
        progress: bool = True,
        label: str | None = None,
    ):
        hooks = check_hooks(hooks)
        check_source(source)
        if world.size > 1 and not getattr(source, "every_rank", False):  # rank 0's source, broadcast
            source = BroadcastSource(world, source, models.device, models.roots.get("policy"))
        self.models, self.source, self.scorer, self.config = models, source, scorer, config
        self.settings, self.sao = config.training, SAO.of(config.algorithm)
        world.shard(config.training.batch_size)  # a batch that does not split evenly over the ranks is refused here
        if not isinstance(run, checkpoint.RunDir):
            run = checkpoint.RunDir.open(run, {"config": config.to_dict()}, lock=world.is_main)
        self.run_dir, self.out, self.hooks, self.world = run, run.out, hooks, world
        self.progress = progress and world.is_main
        self.label = label or f"{config.algorithm.correction} seed {config.training.seed}"
        resumed = run.state  # the checkpoint the builder read on --resume (None: a new run)
        self.sharded = config.training.shard == "fsdp"  # sharded checkpoints, whatever the number of processes
        if self.sharded and resumed is not None and not resumed.get("sharded"):
            raise ConfigError(
                f"--resume: the checkpoint in {self.out} was written without --shard fsdp; resume it "
                "with the settings it was started with"
            )
        # What trains, by name: the LoRA adapter or every weight, and the value head or the value model's trained
        # part. Taken now, before any pass: sharded, these are the shards the optimizers step (a pass may leave a
        # root's whole tensors registered in the modules for a while).
        self.policy_named = models.trainable()
        self.policy_params = list(self.policy_named.values())
        self.policy_opt = torch.optim.AdamW(
            self.policy_params, lr=self.settings.lr, weight_decay=self.settings.weight_decay
        )
        self.critic_params = models.critic_trainable()  # the value head, or the value model's trained part
        self.critic_opt = critic_optimizer(self.critic_params, self.settings.critic_lr, self.settings.critic_bias_lr)
        auto = self.sao.critic_warmup == "auto"
        self.warmup_length: int | None = None if auto else int(self.sao.critic_warmup)  # W; None: not yet decided
        self.policy_version = 0  # policy updates applied so far
        self.micro_batch = self.settings.micro_batch  # halves on out-of-memory and stays halved
        self.next_step, self.records, self.warnings = 0, [], []
        self.ended_early: str | None = None  # why the source had no further batch (a trace log read to its end)
        self._saved_at = 0  # the step count of the newest checkpoint
        self._restore(run.state)

    @property
    def total_steps(self) -> int:
        """W + steps; while an automatic warmup is undecided, its bound stands in for W."""
        warmup = self.sao.critic_warmup_limit if self.warmup_length is None else self.warmup_length
        return warmup + self.settings.steps

    def _decide_warmup(self, record: dict[str, Any]) -> None:
        """``critic_warmup="auto"``: end the warmup after this step when the critic explained at least the target on
        this batch and the one before (each scored before the critic trained on it), or at the limit."""
        g, target, limit = record["step"], self.sao.critic_warmup_target, self.sao.critic_warmup_limit
        scores = [
            r.get("critic_explained_variance", r["explained_variance"])
            for r in (*self.records, record)
            if r["phase"] == WARMUP
        ][-2:]
        reached = len(scores) == 2 and all(v >= target for v in scores)
        if reached or g + 1 >= limit:
            self.warmup_length = record["critic_warmup_steps"] = g + 1
            how = (
                f"explained variance {scores[-2]:.3f}, {scores[-1]:.3f} >= {target:g}"
                if reached
                else (f"the limit; explained variance {scores[-1]:.3f} had not reached {target:g} twice in a row")
            )
            line = f"[{self.label}] critic warmup: {g + 1} steps ({how})"
            if reached:
                self.say(line)
            else:
                self.warn(line.removeprefix(f"[{self.label}] "))

    # -- one step, in the order of the data path ---------------------------------------------------------------

    def step(self, g: int) -> dict[str, Any]:
        """Global step ``g``: its log record, with its phase timers (the loop's clock when the loop runs it, which
        times the hooks after the step too; else a clock of its own)."""
        clock = timeline.running() or timeline.Phases()
        with clock:  # the sources' and environments' phases reach it
            return self._step(g, clock)

    def _step(self, g: int, clock: timeline.Phases) -> dict[str, Any]:
        phase = WARMUP if self.warmup_length is None or g < self.warmup_length else POLICY
        started = time.perf_counter()
        with clock.phase("wait"):  # (a source that draws here marks "draw" and "env" inside)
            batch = self.source.next_batch(g, phase, self.policy_version)  # prompts → source → trajectories
        if not isinstance(batch, Batch):
            raise TypeError(
                f"source {type(self.source).__qualname__}: next_batch returned {preview(batch)} on step "
                f"{g}; it returns a sao.rollout.types.Batch (or raises SourceExhausted when it has no "
                "more)"
            )
        rollout = batch.rollout
        with clock.phase("score"):
            rewards, truncation = self.scorer.rewards(rollout, self.rows(batch))  # [B], or [B, R] per turn
        sampled = time.perf_counter()
        policy_step = phase == POLICY
        row_info = {  # [B] each: the random control's integer key (seed, step, row) and each row's staleness
            "random_key": row_keys(self.settings.seed, g, len(rewards)),
            "staleness": torch.tensor(batch.staleness, dtype=torch.int64),
        }
        oracle: dict[str, Any] = {}
        if batch.oracle is not None:  # the oracle baseline: each prompt's rate from its K fresh rollouts
            with clock.phase("score"):
                row_info["oracle_rates"], oracle = self._oracle_rates(batch)
        with clock.phase("pass"):
            result, rows, retries = self._pass(rollout, rewards, row_info, policy_step)
        with clock.phase("checks"):  # before any update: a hook may refuse what the batch holds
            extras = self._on_pass(batch, result.forward)  # field → (the hook that returned it, its value)
        loss, finite = self.world.total(result.loss), self.world.all(result.finite)  # over ranks (as is on one)
        grad_norm, skipped, lr = float("nan"), False, float("nan")
        if policy_step:
            grad_norm, skipped, lr = self._update_policy(g, finite, clock)
        with clock.phase("critic"):  # the value head on the pass's hidden states, or the value model's own passes
            critic_loss = fit_critic(
                self.models,
                self.critic_opt,
                rollout,
                result.update.value_targets,
                result.forward.hidden,
                self.sao.critic_steps,
                rows=rows,
                world=self.world,
            )
        with clock.phase("stats"):
            record = step_record(
                step=g,
                phase=phase,
                policy_step=g - self.warmup_length if policy_step else None,
                policy_version=self.policy_version,
                staleness=batch.staleness,
                token_staleness=batch.token_staleness(),
                rollout=rollout,
                rewards=rewards,
                update=result.update,
                critic_loss=critic_loss,
                grad_norm=grad_norm,
                skipped=skipped,
                band=self.sao.ratio,
                token_text=self._token_text,
            )
            if self.sao.baseline != "critic":  # the update's EV is the fixed baseline's: the critic's, beside it
                record["critic_explained_variance"] = explained_variance(
                    result.critic_values, result.update.value_targets, rollout.action_mask
                )
        head = {"arm": self.sao.correction, "seed": self.settings.seed, **record, **batch.info}
        tail = {
            "loss": loss,
            **result.extra_stats,
            "lr": lr,
            "micro_batch": self.micro_batch,
            "oom_retries": retries,
            "world_size": self.world.size,
            **truncation,
            **oracle,
            **clock.fields(),
            "time_sample": sampled - started,
        }
        taken = [key for key in extras if key in head or key in tail]
        if taken:  # the log's own fields are never overwritten (a reader would trust a hook's number as sao's)
            hook = extras[taken[0]][0]
            raise ValueError(
                f"hook {hook_label(hook)}: on_pass returned {', '.join(map(repr, taken))}, a field the "
                f"step's record holds itself; name it otherwise (e.g. {hook.name}_{taken[0]})"
            )
        return {**head, **{key: value for key, (_, value) in extras.items()}, **tail}

    def _pass(
        self, rollout: Rollout, rewards: torch.Tensor, row_info: dict[str, torch.Tensor], policy_step: bool
    ) -> tuple[PassResult, int, int]:
        """Teacher-forced pass → ``SAO.update`` → loss → backward over this rank's rows, in micro-batches: the
        result, the micro-batch it ran with and how many times an out-of-memory error halved it (a halving holds
        for the rest of the run)."""

        def attempt(rows: int) -> PassResult:
            self.policy_opt.zero_grad(set_to_none=True)
            return policy_gradient_pass(
                self.models,
                self.sao,
                rollout,
                rewards,
                rows=rows,
                with_policy_gradient=policy_step,
                temperature=self.config.rollout.temperature,
                logprob_chunk=self.config.model.logprob_chunk,
                world=self.world,
                kl_coef=self.settings.kl_coef,
                entropy_coef=self.settings.entropy_coef,
                row_info=row_info,
            )

        own = self.world.shard(len(rewards))  # this rank's rows (every row on one process)
        width = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
        rows = self.micro_batch or auto_micro_batch(self.models.policy, width, own.stop - own.start)
        if self.models.sharded:  # every rank runs as many passes (each one a collective)
            rows = self.world.smallest(rows)
            return attempt(rows), rows, 0
        result, rows, retries = with_oom_retry(attempt, rows, self._say_oom)
        self.micro_batch = rows if retries else self.micro_batch
        return result, rows, retries

    def _update_policy(self, g: int, finite: bool, clock: timeline.Phases) -> tuple[float, bool, float]:
        """(Sum over ranks) → clip → AdamW, unless something was not finite; after a step taken, the new policy
        version goes to the source and the hooks. Returns the gradient norm, whether the step was skipped, and
        the learning rate."""
        with clock.phase("update"):
            if finite and not self.models.sharded:  # sharded, FSDP has summed them in the backward
                self.world.sum_gradients(self.policy_params)
            lr = self._set_lr(g - self.warmup_length)
            grad_norm, skipped = apply_policy_step(self.policy_opt, self.policy_params, self.settings.grad_clip, finite)
        if not skipped:
            self.policy_version += 1
            with clock.phase("publish"):  # (a hook that evaluates marks "eval" inside)
                self.source.after_update(self.policy_version)
                for hook in self.hooks:
                    hook.on_update(self, self.policy_version)
        return grad_norm, skipped, lr

    def _on_pass(self, batch: Batch, forward: TeacherForced) -> dict[str, tuple[Hook, Any]]:
        """Every hook's ``on_pass`` fields, each with the hook that returned it; two hooks returning one field is a
        ValueError."""
        fields: dict[str, tuple[Hook, Any]] = {}
        for hook in self.hooks:
            for key, value in pass_extras(hook, hook.on_pass(self, batch, forward)).items():
                if key in fields:
                    raise ValueError(
                        f"hooks {hook_label(fields[key][0])} and {hook_label(hook)} both return {key!r} "
                        "from on_pass; name one of them otherwise"
                    )
                fields[key] = (hook, value)
        return fields

    def rewards_of(self, task_ids: Sequence[str], rollout: Any) -> torch.Tensor:
        """The rewards ([n], or [n, R] per turn) of rollouts of training prompts ``task_ids`` (extra draws: the
        oracle's), graded as a batch is: by the task's reward, or by the environment where the rollout has turns."""
        rows = [None] * len(task_ids) if rollout.turns is not None else [self.source.tasks[i].row() for i in task_ids]
        return self.scorer.rewards(rollout, rows)[0]

    def returns_of(self, task_ids: Sequence[str], rollout: Any) -> torch.Tensor:
        """Each row's total return [n] (float64) for rollouts of training prompts ``task_ids``."""
        rewards = self.rewards_of(task_ids, rollout)
        return (rewards.sum(dim=1) if rewards.dim() == 2 else rewards).double()

    def _oracle_rates(self, batch: Batch) -> tuple[torch.Tensor, dict[str, Any]]:
        """The oracle baseline's rates [B] from the batch's K fresh rollouts per prompt (shrunk toward their mean),
        and what the step record says of them: the shrinkage weight, their mean and the ceiling they imply."""
        n, rows = len(batch.task_ids), batch.oracle.response_ids.shape[0]
        k = rows // n
        returns = self.returns_of([i for i in batch.task_ids for _ in range(k)], batch.oracle).view(n, k)  # [B, K]
        rates, weight = shrunk_rates(returns.cpu().numpy())
        bound = ceiling(returns.cpu().numpy())
        stats = {
            "oracle_samples": k,
            "oracle_shrinkage": weight,
            "oracle_rate_mean": bound.mean,
            "oracle_batch_ceiling": bound.prompt_level,
        }
        return torch.from_numpy(rates), stats

    def _token_text(self, ids: Sequence[int]) -> list[str]:
        """Each token id as the text it decodes to alone (for the log's tokens outside the band)."""
        return [self.models.tokenizer.decode([i]) for i in ids]

    def rows(self, batch: Batch) -> list[dict[str, Any] | None]:
        """Each row's task as plain data for the scorer, or None where the row's reward is already in the
        trajectories (an environment's, a logged trace's): the fields a row carries (a logged trace's task), else
        the source's training task of that id."""
        if batch.rollout.turns is not None and batch.tasks is None:
            return [None] * len(batch.task_ids)
        if batch.tasks is not None:
            return [
                None if fields is None else {"id": i, **fields}
                for i, fields in zip(batch.task_ids, batch.tasks, strict=True)
            ]
        return [self.source.tasks[i].row() for i in batch.task_ids]

    def _set_lr(self, k: int) -> float:
        """The policy learning rate of policy step k (``lr_schedule`` after ``warmup_steps``)."""
        s = self.settings
        lr = s.lr * lr_factor(k, s.steps, s.warmup_steps, s.lr_schedule)
        for group in self.policy_opt.param_groups:
            group["lr"] = lr
        return lr

    def _say_oom(self, rows: int) -> None:
        self.say(f"[{self.label}] out of memory in the training pass: micro-batch -> {rows}, retrying")

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Every remaining step, a checkpoint every ``checkpoint_every`` steps (and after the last), then the
        adapter. A run killed between checkpoints repeats the steps since the last one."""
        progress = _Progress(self, self.total_steps, self.next_step)
        failed: BaseException | None = None
        try:
            self.world.barrier()  # every rank has claimed the folder before rank 0 writes into it
            if self.world.is_main:
                checkpoint.write_config(self.out, self.run_dir.record)
                if self.run_dir.state is not None and checkpoint.ensure_log(self.out, self.records):
                    self.say(
                        f"[{self.label}] {self.out / checkpoint.LOG_FILE} was missing, damaged, behind or ahead "
                        "of its checkpoint: rewrote it from the checkpoint's records",
                        always=True,
                    )
            for hook in self.hooks:
                hook.on_run_start(self)
            while self.next_step < self.total_steps:
                g, version, clock = self.next_step, self.policy_version, timeline.Phases()
                with clock:  # the step and the hooks after it (an evaluation marks "eval") are in its time
                    try:
                        record = self.step(g)
                    except SourceExhausted as end:  # e.g. a trace log with no further batch: the run ends here
                        self.ended_early = str(end)
                        self.say(f"[{self.label}] stopped after {g} of {self.total_steps} steps: {end}")
                        break
                    except RuntimeError as error:  # another process died mid-step: one line, not the collective's
                        raise self.world.lost(error, self._saved_at) from None
                    if self.warmup_length is None:
                        self._decide_warmup(record)
                    self.records.append(record)
                    self.next_step = g + 1
                    for hook in self.hooks:
                        hook.on_step_end(self, record)
                record.update(clock.fields())
                clock.emit(
                    timeline.TRAINER.format(rank=self.world.rank),
                    {
                        "step": g,
                        "phase": record["phase"],
                        "version": version,
                        "staleness": record["staleness"],
                        "staleness_mean": record["staleness_mean"],
                        "time": record["time"],
                    },
                )
                if self.world.is_main:
                    checkpoint.append_log(self.out, record)
                if self.next_step % self.settings.checkpoint_every == 0 or self.next_step == self.total_steps:
                    self.save_checkpoint()
                for hook in self.hooks:
                    hook.on_checkpoint(self, g)
                progress.update(record)
                self._check_fault_budget()
            if self._saved_at != self.next_step:  # a run that ended early: its last steps made durable
                self.save_checkpoint()
            self._check_trained()
            if self.world.is_main and self.records and checkpoint.ensure_log(self.out, self.records):
                self.say(
                    f"[{self.label}] {self.out / checkpoint.LOG_FILE} was missing, damaged or behind its "
                    "checkpoint: rewrote it from the checkpoint's records",
                    always=True,
                )
            self.save_adapter()  # every process: sharded, each one's shards are gathered
            for hook in self.hooks:
                hook.on_run_end(self)
        except BaseException as error:
            failed = error
            raise
        finally:
            self._close(progress, failed)
        self.world.barrier()  # no rank returns before rank 0 has written the adapter
        return self.records

    def _close(self, progress: _Progress, failed: BaseException | None) -> None:
        """The run's end, whatever happened: the progress bar, the source (rollout workers stop even when a step
        fails) and every hook's ``on_close``, each whatever the others do. After a failure the run's own error goes
        on, what a close raised noted on it (never in its place); a new run that failed before its first checkpoint
        leaves its folder as found; the folder's lock ends."""
        closing = [
            ("the progress bar", progress.close),
            (f"source {type(self.source).__qualname__}: close", self.source.close),
        ]
        closing += [(f"hook {hook_label(h)}: on_close", lambda h=h: h.on_close(self)) for h in self.hooks]
        errors: list[tuple[str, Exception]] = []
        try:
            for what, close in closing:
                try:
                    close()
                except Exception as error:  # each part closes whatever the others raise
                    errors.append((what, error))
        finally:
            try:
                if failed is not None and self.world.is_main:
                    self.run_dir.undo()  # a new run that failed before its first checkpoint: its folder as found
            finally:
                self.run_dir.release()
        if not errors:
            return
        if failed is None:
            raise errors[0][1]
        for what, error in errors:
            failed.add_note(f"while closing after it: {what} raised {describe_error(error)}")
            log.info("while closing after an error: %s raised %s", what, describe_error(error))

    # -- a run that trained on nothing fails --------------------------------------------------------------------

    def _check_fault_budget(self) -> None:
        """Stop (``NothingTrained``) once the environment ended more than ``fault_budget`` of the trajectories of the
        last ``fault_window`` steps by a fault: their rewards say nothing about the replies. The checkpoint is made
        first, so that --resume continues once the environment is fixed."""
        budget, window = self.settings.fault_budget, self.settings.fault_window
        shares = [r["env_fault_share"] for r in self.records[-window:] if r.get("env_fault_share") is not None]
        if budget >= 1 or len(shares) < window or sum(shares) / window <= budget:
            return
        if self._saved_at != self.next_step:
            self.save_checkpoint()
        raise NothingTrained(
            f"[{self.label}] the environment ended {sum(shares) / window:.0%} of the trajectories of the last {window} "
            f"steps by a fault (--fault-budget {budget:g} over --fault-window {window}; each fault's line was "
            f"logged): their rewards say nothing about the replies; fix the environment, then --resume continues "
            f"from step {self.next_step}"
        )

    def _check_trained(self) -> None:
        """A run that ends having trained on nothing fails (``NothingTrained``) rather than succeeding: no policy
        update although policy steps were asked for, or every trajectory of every step cut at a limit. Its
        checkpoint stays, so --resume continues it; a run with no step at all leaves its folder as it was found."""
        if not self.records:
            if self.total_steps > 0:
                raise NothingTrained(
                    f"[{self.label}] nothing was trained: {self._why_no_batch()}; the run folder is "
                    "left as it was found"
                )
            return
        n = len(self.records)
        if self.settings.steps > 0 and self.policy_version == 0:
            policy = [r for r in self.records if r["phase"] == POLICY]
            why = (
                f"all {len(policy)} policy steps were skipped (a non-finite loss or gradient)"
                if policy
                else f"the run ended after {n} critic warmup steps: {self._why_no_batch()}"
            )
            raise NothingTrained(
                f"[{self.label}] no policy update was made: {why}; the run folder keeps its "
                "checkpoint (--resume continues it)"
            )
        if all(r.get("truncation_share") == 1.0 for r in self.records):
            r = self.config.rollout
            raise NothingTrained(
                f"[{self.label}] every trajectory of all {n} steps was cut at a limit (--max-new-tokens "
                f"{r.max_new_tokens}{'' if self.config.data.env is None else ', --max-turns, --max-total-tokens'}): "
                "no reply ended, so every reward is the cut-off one and nothing was learned about the task; raise "
                "the limit or check that the model ends its replies (its EOS token)"
            )

    def _why_no_batch(self) -> str:
        """Why the source gave no (further) batch, with what it dropped, in words."""
        why = self.ended_early or "the source gave no batch"
        summary = self.source.summary() if hasattr(self.source, "summary") else {}
        dropped = ", ".join(
            f"{k.removeprefix('traces_dropped_')} {v}"
            for k, v in (summary or {}).items()
            if k.startswith("traces_dropped_") and v
        )
        return why + (f" (traces dropped: {dropped})" if dropped else "")

    def warn(self, message: str) -> None:
        """A warning for the run's summary and results, shown now (by rank 0 alone)."""
        self.warnings.append(message)
        if not self.world.is_main:
            return
        if self.progress:
            tqdm.write("warning: " + message, file=sys.stderr)
        else:
            log.warning(message)

    def say(self, line: str, *, always: bool = False) -> None:
        """A line of progress, by rank 0 alone; ``always`` shows it even on a quiet run (a repair the user should
        know of)."""
        if not self.world.is_main:
            return
        if self.progress:
            tqdm.write(line, file=sys.stderr)
        else:
            (log.warning if always else log.info)(line)

    def eval_done(self, label: str, metrics: dict[str, Any]) -> None:
        """Tell the hooks about an evaluation of this policy (a tracker mirrors it)."""
        for hook in self.hooks:
            hook.on_eval(self, label, metrics)

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        keep = self.settings.keep_checkpoints
        track = timeline.TRAINER.format(rank=self.world.rank)
        if self.sharded:  # every process writes its shards; rank 0 the rest
            shards = self._shards()
            state = self._state() if self.world.is_main else {"next_step": self.next_step}
            with timeline.span("checkpoint", "checkpoint", track, "step", step=self.next_step):
                checkpoint.save_sharded(self.out, state, self.records, shards, self.world, keep=keep)
        elif self.world.is_main:
            with timeline.span("checkpoint", "checkpoint", track, "step", step=self.next_step):
                checkpoint.save(self.out, self._state(), self.records, keep=keep)
        self._saved_at = self.next_step

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds beside the log's records. Sharded, the models' and optimizers' tensors are in
        ``_shards`` instead, and the optimizers' hyperparameters here."""
        m = self.models
        state = {
            "next_step": self.next_step,
            "policy_version": self.policy_version,
            "critic_warmup_steps": self.warmup_length,
            "micro_batch": self.micro_batch,
            "policy": {} if self.sharded else {n: p.detach().cpu().clone() for n, p in self.policy_named.items()},
            "source": self.source.state_dict(),
            "value_head": m.value_head.state_dict() if m.value_head is not None else {},
            "policy_opt": _layout(self.policy_named, self.policy_opt) if self.sharded else self.policy_opt.state_dict(),
            "critic_opt": self.critic_opt.state_dict(),
            "records": self.records,
            "warnings": self.warnings,
            "hooks": dict(zip(state_keys(self.hooks), (hook.state_dict() for hook in self.hooks), strict=True)),
        }
        if m.critic is not None:  # a value model: its trained tensors, and their optimizer
            state["critic_opt"] = (
                _layout(self.critic_params, self.critic_opt) if self.sharded else self.critic_opt.state_dict()
            )
            if not self.sharded:
                state["critic_model"] = {n: p.detach().cpu().clone() for n, p in self.critic_params.items()}
        if self.sharded:
            state["sharded"] = True
        return state

    def _shards(self) -> dict[str, torch.Tensor]:
        """Sharded runs: every tensor of the models and optimizers by name, this process's shards of each (whole
        tensors on one process), as references: a checkpoint saves them and a resume loads them in place. The
        optimizers' moments are keyed by their parameter's name, so any number of processes reads them back."""
        m = self.models
        shards = {f"policy.{n}": p.detach() for n, p in self.policy_named.items()}
        shards.update(_moments("policy_opt", self.policy_named, self.policy_opt))
        shards.update(getattr(self.source, "tensors", dict)())
        if m.critic is not None:
            shards.update({f"critic.{n}": p.detach() for n, p in self.critic_params.items()})
            shards.update(_moments("critic_opt", self.critic_params, self.critic_opt))
        return shards

    def _restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        m = self.models
        if self.sharded:  # the optimizers' moments made room for, then every tensor read in place, resharded
            _make_moments(self.policy_named, self.policy_opt, state["policy_opt"])
            if m.critic is not None:
                _make_moments(self.critic_params, self.critic_opt, state["critic_opt"])
            checkpoint.load_sharded(self.out, self._shards())
        else:
            with torch.no_grad():
                for name, p in self.policy_named.items():
                    p.copy_(state["policy"][name].to(p.device))
                for name, p in self.critic_params.items() if m.critic is not None else ():
                    p.copy_(state["critic_model"][name].to(p.device))
            self.policy_opt.load_state_dict(state["policy_opt"])
        if m.critic is None or not self.sharded:
            self.critic_opt.load_state_dict(state["critic_opt"])
        self.source.load_state_dict(state["source"])
        if m.value_head is not None:
            m.value_head.load_state_dict(state["value_head"])
        self.policy_version = state["policy_version"]
        if self.warmup_length is None:  # an automatic warmup the checkpoint may have decided
            self.warmup_length = state.get("critic_warmup_steps")
        self.micro_batch = state.get("micro_batch", self.micro_batch)
        self.next_step, self.records, self.warnings = state["next_step"], state["records"], state["warnings"]
        self._saved_at = self.next_step
        saved = state.get("hooks") or {}
        if "footing" in state and "footing" not in saved:  # a checkpoint from before hooks: the audit's state
            saved["footing"] = {"footing": state["footing"]}
        names = [hook.name for hook in self.hooks]
        builtin_names = {hook.name for hook in self.hooks if _builtin(hook)}
        for hook, key in zip(self.hooks, state_keys(self.hooks), strict=True):
            alone = names.count(hook.name) == 1 and hook.name not in builtin_names
            if key not in saved and not _builtin(hook) and alone:
                key = hook.name  # a checkpoint from before hooks of yours were keyed by class: its name alone
            hook.load_state_dict(saved.get(key, {}))

    # -- the adapter -------------------------------------------------------------------------------------------

    def save_adapter(self) -> Path:
        """OUT/adapter/: the policy adapter (PEFT), the tokenizer and the value head (safetensors + its size),
        loadable with plain ``PeftModel.from_pretrained`` and ``AutoTokenizer``; ``sao export`` merges it. Under full
        fine-tuning OUT/model/ (a Hugging Face folder, ``artifacts.save_full_weights``); with a value model of its own
        OUT/critic/ beside it. Every process calls it (sharded, each one's shards are gathered); rank 0 writes."""
        path = self.write_adapter(self.out / policy_folder(self.models))
        m = self.models
        if m.critic is not None and (m.sharded or self.world.is_main):
            artifacts.save_value_model(
                m.critic,
                m.tokenizer,
                self.out / CRITIC_DIR,
                base_model=m.critic_name,
                finetune=m.finetune,
                write=self.world.is_main,
            )
        return path

    def write_adapter(self, path: Path) -> Path:
        """The policy as a sampler loads it, at ``path``: the adapter folder, or the full model folder. Unsharded,
        the calling process writes (the publishers call it on rank 0); sharded, every process must call it (each
        tensor is gathered in turn) and rank 0 writes."""
        m, write = self.models, self.world.is_main
        if not m.sharded and not write:
            return path
        if m.finetune == "full":  # every tensor gathered in turn; the writing process keeps them and writes
            lm = causal_lm(m.policy)
            state = artifacts.whole_state(lm, keep=write)
            if write:
                also = functools.partial(
                    artifacts.describe_weights,
                    base_model=m.name,
                    value_head=m.value_head,
                    policy_version=self.policy_version,
                )
                artifacts.save_full_weights(lm, path, tokenizer=m.tokenizer, state=state, also=also)
            return path
        weights = artifacts.sharded_lora(m.policy)  # the whole adapter, when each process holds a part
        if write:
            artifacts.save_adapter(
                m.policy,
                m.tokenizer,
                m.value_head,
                path,
                base_model=m.name,
                weights=weights,
                policy_version=self.policy_version,
            )
        return path

    def describe(self) -> str:
        return describe(self.models.policy)


CRITIC_DIR = "critic"  # OUT/critic/: a value model of its own, beside the policy's folder


def policy_folder(models: Models) -> str:
    """The run folder's name for the trained policy: "adapter" (LoRA) or "model" (every weight)."""
    return "model" if models.finetune == "full" else "adapter"


class _Progress:
    """A progress bar on a terminal; elsewhere (a log file, CI) one plain line every ``log_every`` steps."""

    def __init__(self, trainer: Trainer, total: int, initial: int):
        self.trainer, self.every = trainer, trainer.settings.log_every
        self.tty = trainer.progress and sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=f"train {trainer.label}",
            dynamic_ncols=True,
            disable=not self.tty,
            file=sys.stderr,
        )

    def update(self, record: dict[str, Any]) -> None:
        summary = {
            "reward": f"{record['reward_mean']:.2f}",
            "masked": f"{record['masked_share']:.4f}",
            "ratio_max": f"{record['ratio_max']:.2f}",
            "stale": record["staleness"],
        }
        if self.tty:
            self.bar.total = self.trainer.total_steps  # an automatic warmup shortens the run once it ends
            self.bar.update(1)
            self.bar.set_postfix(summary)
        elif self.trainer.progress and (record["step"] + 1) % self.every == 0:
            fields = " ".join(f"{k} {v}" for k, v in summary.items())
            print(
                f"[{self.trainer.label}] step {record['step'] + 1}/{self.trainer.total_steps} {fields} "
                f"({record['time']:.1f}s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


# -- an optimizer's state in a sharded checkpoint: the moments with the shards, the rest in state.json ---------------


def _moments(prefix: str, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter tensors (AdamW: step, exp_avg, exp_avg_sq) as ``prefix.<param>.<key>``, by
    reference; parameters it holds no state for yet (before their first step) have none."""
    return {
        f"{prefix}.{name}.{key}": value
        for name, p in params.items()
        for key, value in optimizer.state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    }


def _layout(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What ``_make_moments`` needs to rebuild the optimizer's state before its tensors are read in place: each
    parameter's state keys (a 0-d tensor or one shaped like the parameter, and its dtype), and the hyperparameters
    of each group."""
    state = {
        name: {
            key: [value.dim() == 0, str(value.dtype).removeprefix("torch.")]
            for key, value in optimizer.state[p].items()
            if isinstance(value, torch.Tensor)
        }
        for name, p in params.items()
        if p in optimizer.state
    }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _make_moments(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, layout: dict[str, Any]) -> None:
    """Zeroed state tensors where ``_layout`` says the checkpoint has some (this process's shards of each), and the
    saved hyperparameters: a checkpoint's moments are then read into them in place."""
    for group, saved in zip(optimizer.param_groups, layout["param_groups"], strict=True):
        group.update(saved)
    for name, keys in layout["state"].items():
        p = params[name]
        optimizer.state[p] = {
            key: torch.zeros((), dtype=getattr(torch, dtype))
            if scalar
            else torch.zeros_like(p, dtype=getattr(torch, dtype))
            for key, (scalar, dtype) in keys.items()
        }
