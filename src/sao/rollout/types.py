"""What flows between the layers: a drawn batch of trajectories (``Rollout``, with the ``Turns`` block an
environment adds), one optimizer step's ``Batch``, and the ``Sampling`` settings every decoder call shares.

Shapes: B rows; prompts left-padded to P columns, responses right-padded to R. Every source of trajectories
— the plain loop, the engine, episodes, Ray workers, logged traces, vLLM — returns these and nothing else.

Deliberately left out: how trajectories are drawn (``sampler``, ``engine``, ``episodes``) and graded (the task's
reward, ``sao.tasks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Turns:
    """What an environment added to multi-turn trajectories (absent for one reply per prompt)."""

    rewards: torch.Tensor  # [B, R] float32: each turn's reward on its last action token, 0 elsewhere
    count: torch.Tensor  # [B] long: actions taken
    tool_calls: torch.Tensor  # [B] long
    tool_errors: torch.Tensor  # [B] long
    unfinished: torch.Tensor  # [B] bool: ended by a limit (turns, tokens, context) or a fault before the environment
    # said done. Drawn episodes only (None from a source that has no environment here, e.g. a trace log):
    # [B] long: environment faults that ended the trajectory (0 or 1): a call that raised, exited, ran past
    # --env-timeout or answered what sao cannot use (not a dict, a reward against the reward rule, an observation
    # too long for the room left)
    faults: torch.Tensor | None = None
    timeouts: torch.Tensor | None = None  # [B] bool: of those, ended because a call outlived --env-timeout
    context_cuts: torch.Tensor | None = None  # [B] bool: ended because the model's context was full

    @property
    def total(self) -> torch.Tensor:
        """[B] each trajectory's reward, the sum of its turns'."""
        return self.rewards.sum(dim=1)


PER_TOKEN = ("response_ids", "response_mask", "action_mask", "sampler_logprobs", "versions")  # [B, R]


@dataclass
class Rollout:
    """A batch of trajectories as drawn, with each action token's sampler log-probability."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] bool
    response_ids: torch.Tensor  # [B, R] long, pad after the end
    response_mask: torch.Tensor  # [B, R] bool: every real response token (actions and observations)
    action_mask: torch.Tensor  # [B, R] bool: the tokens the model wrote (= response_mask for one reply)
    sampler_logprobs: torch.Tensor  # [B, R] float32: log-prob under the distribution drawn from, 0 off actions
    cut: torch.Tensor  # [B] bool: the last action hit a token limit before it finished
    texts: list[str] = field(default_factory=list)  # decoded responses, special tokens dropped
    turns: Turns | None = None  # multi-turn trajectories only
    # [B, R] long: the adapter version that sampled each action token, where one trajectory spans versions (a
    # multi-turn episode whose later actions a newer adapter drew); None: each row's tokens share one version
    versions: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """[B] real response tokens per row."""
        return self.response_mask.sum(dim=1)

    @property
    def truncated(self) -> torch.Tensor:
        """[B] bool: the trajectory ended at a limit, not by finishing (a cut reply, or an episode out of room)."""
        return self.cut if self.turns is None else self.cut | self.turns.unfinished

    def spanning(self) -> torch.Tensor:
        """[B] bool: the rows whose action tokens more than one adapter version drew."""
        if self.versions is None:
            return torch.zeros(self.action_mask.shape[0], dtype=torch.bool, device=self.action_mask.device)
        versions = self.versions.to(torch.long)  # [B, R]
        return (self.action_mask & (versions != oldest_action_version(versions, self.action_mask))).any(dim=1)

    def _map(self, tensor_fn, texts: list[str]) -> Rollout:
        """The same fields with ``tensor_fn`` applied to every tensor (the turns block's too)."""
        values = {
            f.name: tensor_fn(f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        turns = None
        if self.turns is not None:
            present = [f.name for f in dataclasses.fields(Turns) if getattr(self.turns, f.name) is not None]
            turns = Turns(**{name: tensor_fn("turns." + name, getattr(self.turns, name)) for name in present})
        return Rollout(**values, texts=texts, turns=turns)

    def to(self, device: torch.device | str) -> Rollout:
        """The same trajectories on ``device``."""
        return self._map(lambda _, t: t.to(device), list(self.texts))

    def rows(self, part: slice) -> Rollout:
        """Rows ``part``, every per-row field cut the same way; widths (P, R) kept."""
        return self._map(lambda _, t: t[part], list(self.texts[part]))

    def row(self, i: int) -> Rollout:
        """Row i alone, trimmed to its own prompt and response lengths."""
        p, r, P = int(self.prompt_mask[i].sum()), max(int(self.response_mask[i].sum()), 1), self.prompt_ids.shape[1]

        def cut(name: str, t: torch.Tensor) -> torch.Tensor:
            if name.startswith("prompt_"):
                return t[i : i + 1, P - p :].clone()
            if name in PER_TOKEN or name == "turns.rewards":
                return t[i : i + 1, :r].clone()
            return t[i : i + 1].clone()

        return self._map(cut, self.texts[i : i + 1])

    @staticmethod
    def concat(rollouts: Sequence[Rollout], pad_token_id: int) -> Rollout:
        """Stack rollouts drawn separately (different prompt and response widths) into one batch.

        Prompts are re-padded on the left to the widest P, responses on the right to the widest R (``pad_token_id``,
        masks False, log-probabilities and rewards 0 in the new padding); per-row fields and texts are concatenated
        in order. Every rollout carries a turns block or none does. The result lives on the first one's device."""
        if not rollouts:
            raise ValueError("Rollout.concat needs at least one rollout")
        if any(r.texts for r in rollouts) and any(len(r.texts) != r.prompt_ids.shape[0] for r in rollouts):
            raise ValueError("Rollout.concat: either every rollout carries one text per row, or none does")
        if len({r.turns is None for r in rollouts}) > 1:
            raise ValueError("Rollout.concat: mixing multi-turn trajectories with single replies")
        device = rollouts[0].prompt_ids.device
        P = max(r.prompt_ids.shape[1] for r in rollouts)
        R = max(r.response_ids.shape[1] for r in rollouts)

        def pad(t: torch.Tensor, width: int, value: Any, left: bool) -> torch.Tensor:
            t = t.to(device)
            extra = width - t.shape[1]
            if extra == 0:
                return t
            filler = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=device)
            return torch.cat([filler, t] if left else [t, filler], dim=1)

        def stack(name: str, get) -> torch.Tensor:
            parts = [get(r) for r in rollouts]
            if name.startswith("prompt_"):
                return torch.cat([pad(t, P, pad_token_id if name == "prompt_ids" else False, True) for t in parts])
            if name in PER_TOKEN or name == "turns.rewards":
                filler = pad_token_id if name == "response_ids" else 0
                return torch.cat([pad(t, R, False if t.dtype == torch.bool else filler, False) for t in parts])
            return torch.cat([t.to(device) for t in parts])

        if len({r.versions is None for r in rollouts}) > 1:  # rows of one version each: that version per token
            raise ValueError("Rollout.concat: mixing rollouts with and without per-token versions")
        values = {
            f.name: stack(f.name, lambda r, n=f.name: getattr(r, n))
            for f in dataclasses.fields(Rollout)
            if f.name not in ("texts", "turns") and getattr(rollouts[0], f.name) is not None
        }
        turns = None
        if rollouts[0].turns is not None:
            turns = Turns(
                **{
                    f.name: stack("turns." + f.name, lambda r, n=f.name: getattr(r.turns, n))
                    for f in dataclasses.fields(Turns)
                    if all(getattr(r.turns, f.name) is not None for r in rollouts)
                }
            )
        return Rollout(**values, texts=[text for r in rollouts for text in r.texts], turns=turns)


@dataclass
class Batch:
    """One optimizer step's trajectories: which prompts, what was drawn, and how stale each row is (policy
    updates between the adapter that wrote it and the policy that trains on it)."""

    task_ids: list[str]
    rollout: Rollout
    staleness: list[int]  # [B] each row's staleness: that of its oldest action token
    info: dict[str, Any] = field(default_factory=dict)  # the source's counters, logged with the step
    # Rows that carry their own task (logged traces): row i's task fields, to be graded by the task's reward, or
    # None where the row's reward is already in ``rollout.turns``. None: every task id names a training task.
    tasks: list[dict[str, Any] | None] | None = None
    # The "oracle" baseline's extra draws: K fresh rollouts of every prompt of the batch by the sampler that drew it
    # (rows ordered prompt-major: row i·K + j is prompt i's j-th), graded by the trainer and never trained on.
    oracle: Rollout | None = None

    def token_staleness(self) -> torch.Tensor:
        """[B, R] long: the staleness of each response token, from ``rollout.versions`` where a row spans versions
        (token staleness = the row's − (the token's version − the row's oldest action version)), else the row's
        own for every token. Off the action tokens it is the row's."""
        r = self.rollout
        row = torch.tensor(self.staleness, dtype=torch.long, device=r.action_mask.device)[:, None]  # [B, 1]
        if r.versions is None:
            return row.expand_as(r.action_mask).clone()
        versions = r.versions.to(torch.long)  # [B, R]
        return torch.where(r.action_mask, row - (versions - oldest_action_version(versions, r.action_mask)), row)


def oldest_action_version(versions: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """[B, 1] long: each row's oldest version among its action tokens (versions, action_mask [B, R]); a row with
    no action token: its first column's."""
    top = torch.iinfo(torch.long).max
    oldest = versions.masked_fill(~action_mask, top).min(dim=1, keepdim=True).values  # [B, 1]
    return torch.where(oldest == top, versions[:, :1], oldest)


@dataclass(frozen=True)
class Sampling:
    """How rollouts are drawn: the settings every decoder call of a run shares."""

    max_new_tokens: int
    temperature: float
    eos_token_ids: list[int]
    pad_token_id: int

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "eos_token_ids": self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
        }


class Ranks(Protocol):
    """The training processes that draw one batch together (``sao.training.distributed.World``): rank r of ``size``."""

    size: int
    rank: int

    def shard(self, rows: int) -> slice:
        """This process's rows of a batch of ``rows``."""
        ...

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (picklable), in rank order, on every process."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process."""
        ...


class Stepper(Protocol):
    """The network as the episode loop drives it: columns in, hidden states out, the cache kept inside."""

    def feed(self, ids: torch.Tensor, real: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append columns ids [B, L] (``real`` [B, L] bool: False is a hole no later query attends to) at RoPE
        positions [B, L]; return the final-normed hidden states [B, L, H]."""
        ...

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        """[B, H] → [B, V] float32 logits / τ, as ``forward.logits_fp32`` computes them."""
        ...


class Decoder(Protocol):
    """Anything that samples replies the way ``sao.rollout.sampler.draw`` does, on ``device``: one reply per prompt
    (``generate``), or a multi-turn session that the episode loop drives (``stepper``)."""

    device: torch.device

    def generate(
        self,
        prompt_ids: torch.Tensor,  # [B, P] left-padded
        prompt_mask: torch.Tensor,  # [B, P] bool
        *,
        max_new_tokens: int,
        temperature: float,
        eos_token_ids: list[int],
        pad_token_id: int,
        generator: torch.Generator,
        share: tuple[slice, int] | None = None,  # these rows' part of a batch of share[1] (``sampler.draw``)
    ) -> Rollout: ...

    def stepper(self, rows: int, capacity: int) -> AbstractContextManager[Stepper]:
        """A session over ``rows`` rows and about ``capacity`` columns, with this decoder's adapter active."""
        ...
