"""The critic against what was reachable (``--ceiling-every K``): snapshots of the oracle ceiling during a run.

At the critic warmup's end, after every K-th policy step and after the last, the same ``--ceiling-prompts`` training
prompts are each rolled out ``--oracle-samples`` times by the sampler as it stands (the rollout temperature, the
source's own draw), graded like a batch, and passed once through the policy (no gradient). The record of that step
gets (``ceiling_*``):

    prompt_level     the explained variance a baseline that knows each prompt's success rate could reach, per
                     trajectory: Var(p)/p̄(1 − p̄) for 0/1 returns, without the K-sample bias
    token_level      the same with each rollout weighted by its action tokens: the units of the critic's EV
    critic_ev        the critic's explained variance on those same rollouts (its values against the return-to-go)
    critic_share     critic_ev / token_level: how much of what a prompt-level baseline could win the critic won

and OUT/oracle/step-NNNNNN.safetensors keeps the rates' inputs and the trunk's hidden states (at each prompt's last
token, and at a seeded sample of the rollouts' action tokens) for ``sao probe``. Every draw is seeded by (seed,
step), so a resumed run measures the same. Deliberately left out: the math (``sao.algorithm.oracle``) and the probe
(``sao.experiment.probe``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from sao.algorithm.oracle import ceiling, share_of
from sao.algorithm.update import explained_variance, monte_carlo_returns
from sao.core.errors import ConfigError
from sao.core.io import atomic_write
from sao.core.names import WARMUP
from sao.model.forward import teacher_forced
from sao.rollout.sampler import derived_seed
from sao.rollout.sources import PromptOrder
from sao.training.trainer import Hook, Trainer

FOLDER = "oracle"
TOKENS_KEPT = 4096  # action tokens whose hidden states a snapshot keeps for the per-token probe (a seeded sample)
ROWS_PER_PASS = 64  # rows per teacher-forced pass over a snapshot's rollouts


def snapshot_path(out: Path, step: int) -> Path:
    return Path(out) / FOLDER / f"step-{step:06d}.safetensors"


class OracleCeiling(Hook):
    """``--ceiling-every``: the oracle ceiling at the warmup's end, every ``every`` policy steps and after the last
    (of ``steps``), on ``prompts`` training prompts rolled out ``samples`` times each."""

    name = "oracle-ceiling"

    def __init__(self, every: int, prompts: int, samples: int, steps: int, temperature: float, logprob_chunk: int):
        self.every, self.prompts, self.samples, self.steps = every, prompts, samples, steps
        self.temperature, self.chunk = temperature, logprob_chunk

    def on_run_start(self, trainer: Trainer) -> None:
        if trainer.world.size > 1:
            raise ConfigError("--ceiling-every runs in one process; leave it out under torchrun")
        if not hasattr(trainer.source, "draw_more"):
            raise ConfigError("--ceiling-every needs a source that draws rollouts on demand (--rollout local)")
        if len(trainer.source.tasks) < self.prompts:
            raise ConfigError(
                f"--ceiling-prompts {self.prompts} is more than the {len(trainer.source.tasks)} training prompts"
            )

    def due(self, trainer: Trainer, record: dict[str, Any]) -> str | None:
        """The snapshot this record ends ("warmup-end", or the policy steps taken), or None."""
        if record["phase"] == WARMUP:
            last = trainer.warmup_length is not None and record["step"] + 1 == trainer.warmup_length
            return "warmup-end" if last else None
        taken = record["policy_step"] + 1
        return str(taken) if taken % self.every == 0 or taken == self.steps else None

    def on_step_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """A snapshot's numbers join the step's record (before it is logged and checkpointed)."""
        label = self.due(trainer, record)
        if label is not None:
            record.update(self.measure(trainer, record["step"], label))

    @torch.no_grad()
    def measure(self, trainer: Trainer, step: int, label: str) -> dict[str, Any]:
        started = time.perf_counter()
        seed = trainer.settings.seed
        ids = PromptOrder(sorted(trainer.source.tasks), derived_seed(seed, "oracle-prompts")).batch(0, self.prompts)
        k = self.samples
        rows = [i for i in ids for _ in range(k)]  # prompt-major: row p·K + j is prompt p's j-th rollout
        rollout = trainer.source.draw_more(rows, derived_seed(seed, step, "ceiling"))
        rewards = trainer.rewards_of(rows, rollout)  # [P·K], or [P·K, R] per turn
        returns = (rewards.sum(dim=1) if rewards.dim() == 2 else rewards).double()  # [P·K] each rollout's return
        actions = rollout.action_mask
        lengths = actions.sum(dim=1).double()  # [P·K]
        bound = ceiling(returns.view(-1, k).cpu().numpy(), lengths.view(-1, k).cpu().numpy())
        hidden, values = self._pass(trainer, rollout)  # [P·K, R, H], [P·K, R]
        targets = monte_carlo_returns(rewards.to(values), actions)  # [P·K, R] the return-to-go, as the critic's
        critic_ev = explained_variance(values, targets, actions)
        self._keep(trainer, step, ids, returns.view(-1, k), lengths.view(-1, k), hidden, actions, seed)
        out = {f"ceiling_{key}": value for key, value in bound.to_dict().items()}
        out.update(
            ceiling_snapshot=label,
            ceiling_critic_ev=critic_ev,
            ceiling_critic_share=share_of(critic_ev, bound.token_level),
            ceiling_sampler_version=getattr(getattr(trainer.source, "sampler", None), "version", None),
            ceiling_seconds=time.perf_counter() - started,
        )
        return out

    def _pass(self, trainer: Trainer, rollout: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's hidden states and the critic's values over the snapshot's rollouts, a slice at a time."""
        models, hidden, values = trainer.models, [], []
        for start in range(0, rollout.response_ids.shape[0], ROWS_PER_PASS):
            part = slice(start, start + ROWS_PER_PASS)
            forward = teacher_forced(
                models.policy,
                rollout.prompt_ids[part],
                rollout.prompt_mask[part],
                rollout.response_ids[part],
                rollout.response_mask[part],
                temperature=self.temperature,
                logprob_chunk=self.chunk,
            )
            hidden.append(forward.hidden)
            values.append(models.value_head(forward.hidden))
        return torch.cat(hidden), torch.cat(values)

    def _keep(
        self,
        trainer: Trainer,
        step: int,
        ids: list[str],
        returns: torch.Tensor,
        lengths: torch.Tensor,
        hidden: torch.Tensor,
        actions: torch.Tensor,
        seed: int,
    ) -> None:
        """OUT/oracle/step-NNNNNN.safetensors: per prompt its K returns and lengths and the hidden state at its last
        prompt token; per kept action token its hidden state and its prompt's index."""
        if not trainer.world.is_main:
            return
        from safetensors.torch import save

        k = returns.shape[1]
        prompt_hidden = hidden[::k, 0].float().cpu()  # [P, H] the state that predicts each prompt's first reply token
        token_prompt = (torch.arange(hidden.shape[0], device=actions.device) // k)[:, None].expand_as(actions)
        flat_hidden, flat_prompt = hidden[actions].float().cpu(), token_prompt[actions].cpu()  # [N, H], [N]
        if flat_hidden.shape[0] > TOKENS_KEPT:
            pick = (
                torch.randperm(
                    flat_hidden.shape[0],
                    generator=torch.Generator().manual_seed(derived_seed(seed, step, "ceiling-tokens")),
                )[:TOKENS_KEPT]
                .sort()
                .values
            )
            flat_hidden, flat_prompt = flat_hidden[pick], flat_prompt[pick]
        tensors = {
            "returns": returns.float().cpu().contiguous(),
            "lengths": lengths.float().cpu().contiguous(),
            "prompt_hidden": prompt_hidden.contiguous(),
            "token_hidden": flat_hidden.contiguous(),
            "token_prompt": flat_prompt.long().contiguous(),
        }
        path = snapshot_path(trainer.out, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, save(tensors, metadata={"task_ids": "\n".join(ids), "step": str(step)}))
