"""Where a training batch comes from: the ``Source`` seam, its registry entries, and the local stale sampler.

    Source         hands the trainer one ``Batch`` per step and hears about each policy update. Built by name
                   from ``SOURCES`` (``sao.rollout.registry``) with a ``SourceContext``: "local" (here: the stale
                   sampler in this process, reproducible), "ray" (``ray_workers``: asynchronous workers), "traces"
                   (``traces``: a serving system's log; ``SourceExhausted`` ends the run when it has no further
                   batch). Each says how stale its batches can be (``max_staleness``) and which training tasks its
                   task ids name (``tasks``).
    PromptOrder    the seeded order every source reads the training prompts in.
    Episodes       what multi-turn drawing needs beyond the prompts (an environment per task, limits).
    SamplerCopy    ``--sampler-dtype``, ``--sampler-logit-noise``: the local sampler as a copy in another dtype (the
                   engine-mismatch regime) or with noise of a set size on its logits (mismatch by dose).
    draw_more      K more rollouts of given prompts by the sampler as it stands (``sao.training.oracle``'s draws).

Step g's local batch is a pure function of (seed, g) and the adapters, so a run resumed from a checkpoint
continues exactly as if it had never stopped. Under torchrun the local source runs on every process (``every_rank``)
and each draws its rows of the batch from the whole batch's noise, so the batch is the one a single process draws
(a multi-turn batch is drawn by rank 0: its noise follows the whole batch's turns); every other source runs on rank
0 and its batches are broadcast (``sao.training.distributed``). Deliberately left out: rewards (the task's scorer
grades what a source returns) and the update itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from sao.core import timeline
from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.core.names import POLICY
from sao.model.policy import Models, causal_lm, lora_state
from sao.model.sharding import gathered
from sao.rollout.engine import Engine
from sao.rollout.environment import EnvCalls, EnvFactory, EnvFault, Message, checked_env
from sao.rollout.episodes import DEFAULT_CONCURRENCY, draw_episodes
from sao.rollout.sampler import SAMPLER_ADAPTER, PlainDecoder, StaleSampler, decode, derived_seed, encode_prompts
from sao.rollout.types import Batch, Decoder, Ranks, Rollout, Sampling


class SourceExhausted(Exception):
    """Raised by ``next_batch`` when a source has no further batch (a trace log read to its end): the run stops
    cleanly after its last completed step. ``str(error)`` says why, in words."""


class Source(Protocol):
    """Where the trainer's batches come from. A source whose class sets ``every_rank = True`` is built on every
    torchrun process and hands every process the whole batch itself; any other is built on rank 0 alone."""

    max_staleness: int  # the largest staleness a batch can have (the reachability checks read it)
    tasks: dict[str, Any]  # the training tasks (``sao.tasks.base.Task``) its task ids name, for the scorer

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        """Global step ``step``'s batch; ``phase`` is WARMUP or POLICY; ``policy_version`` counts updates."""
        ...

    def after_update(self, policy_version: int) -> None:
        """The publish hook: the policy has just taken its ``policy_version``-th update."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class PromptOrder:
    """Training prompts read in order through epoch e's seeded permutation: position p is prompt
    ``ids[perm_e[p mod n]]`` with e = p div n. A pure function of (ids, seed, p)."""

    def __init__(self, ids: list[str], seed: int):
        self.ids, self.seed = list(ids), seed
        self._perms: dict[int, list[int]] = {}

    def id_at(self, position: int) -> str:
        epoch, i = divmod(position, len(self.ids))
        if epoch not in self._perms:
            rng = torch.Generator().manual_seed(derived_seed(self.seed, epoch, "order"))
            self._perms[epoch] = torch.randperm(len(self.ids), generator=rng).tolist()
        return self.ids[self._perms[epoch][i]]

    def batch(self, step: int, size: int) -> list[str]:
        """Step ``step``'s prompt ids: positions step·size .. (step+1)·size − 1."""
        return [self.id_at(p) for p in range(step * size, (step + 1) * size)]


@dataclass
class SourceContext:
    """Everything a registered source may be built from (``build_source(name, context)``); its own settings are
    ``config.source``."""

    config: Config
    models: Models
    tasks: dict[str, Any]  # the training tasks (``sao.tasks.base.Task``) by id
    prompts: dict[str, str]  # task id → the chat-formatted prompt a single reply continues
    episodes: Episodes | None  # multi-turn drawing, with an environment
    out_dir: Path  # the run's folder (a source may keep files there)
    sampling: Sampling  # how training replies are drawn (length, temperature, the tokens that end a reply)
    reserved_gpus: list[int] | None = None  # GPUs the training processes use (kept from rollout workers)
    label: str = "run"
    progress: bool = True
    world_size: int = 1  # training processes (torchrun)
    warn: Callable[[str], None] = print
    world: Ranks | None = None  # those processes, for a source built on every one of them (``every_rank``)

    def check_batch(self) -> None:
        """A source that draws the training prompts needs a batch's worth of them."""
        batch = self.config.training.batch_size
        if len(self.tasks) < batch:
            raise ConfigError(f"--batch-size {batch} is larger than the {len(self.tasks)} training prompts")

    @property
    def order(self) -> PromptOrder:
        return PromptOrder(list(self.tasks), self.config.training.seed)


@dataclass(frozen=True)
class Episodes:
    """What multi-turn drawing needs beyond the prompts: an environment per task, the prompt messages it
    starts from, the task fields it is built from, and the limits."""

    env_factory: EnvFactory
    messages: dict[str, list[Message]]  # task id → prompt messages
    fields: dict[str, dict[str, Any]]  # task id → what its environment is built from
    max_turns: int
    max_total_tokens: int
    env_concurrency: int = DEFAULT_CONCURRENCY  # steps in flight at once (0: batch-synchronous, as before)
    env_rejoin: str = "turn"  # when a row decodes on: once its turn is all back ("turn") or at once ("row")
    env_timeout: float = 0.0  # seconds one call of an environment may take (--env-timeout; 0: no limit)
    name: str = "the environment"  # what its one-line faults call it (--env as given)


def draw_episode_batch(
    decoder: Decoder,
    tokenizer: Any,
    task_ids: list[str],
    episodes: Episodes,
    sampling: Sampling,
    generator,
    refresh: Callable[[], int] | None = None,
) -> Rollout:
    """One multi-turn episode per task id, an environment each (closed afterwards), on the decoder's path: the
    plain loop over its model, or the engine's static cache. ``refresh``: as ``draw_episodes`` takes it."""
    builder = EnvCalls(1, episodes.env_timeout, episodes.name)
    envs: list[Any] = []
    try:
        for i in task_ids:  # built under the same containment and timeout as every later call
            try:
                env = builder.call(episodes.env_factory, i, episodes.fields[i], task=i, what="building it")
                envs.append(checked_env(env, episodes.name, i))
            except EnvFault as fault:
                envs.append(fault)  # the row ends before it acts, counted
    finally:
        builder.close()
    messages = [episodes.messages[i] for i in task_ids]
    limits = {
        "max_turns": episodes.max_turns,
        "max_total_tokens": episodes.max_total_tokens,
        "env_concurrency": episodes.env_concurrency,
        "env_timeout": episodes.env_timeout,
        "rejoin": episodes.env_rejoin,
    }
    return draw_episodes(
        decoder,
        tokenizer,
        envs,
        messages,
        generator=generator,
        close=True,
        name=episodes.name,
        tasks=task_ids,
        refresh=refresh,
        **limits,
        **sampling.as_kwargs(),
    )


def trajectories(task_ids: list[str], start: float, end: float, version: int, staleness: int, step: int) -> None:
    """A batch drawn together here: each trajectory's span on the timeline (one track per row), if one is kept."""
    if timeline.recording() is None:
        return
    for row, task in enumerate(task_ids):
        timeline.complete(
            "trajectory",
            "trajectory",
            timeline.LOCAL_SAMPLER,
            f"row {row}",
            start,
            end,
            task=task,
            version=version,
            staleness=staleness,
            step=step,
        )


def make_decoder(model: nn.Module, adapter: str | None, kind: str) -> Decoder:
    """ "graph" → ``Engine`` over ``adapter``; "plain" → the reference loop; "auto" → graph on a GPU, plain on
    the CPU (the engine's eager CPU path draws the same tokens, only slower to set up)."""
    device = next(model.parameters()).device
    if kind == "graph" or (kind == "auto" and device.type == "cuda"):
        return Engine(model, adapter=adapter)
    return PlainDecoder(model, adapter)


SAMPLER_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class NoisyHead(nn.Module):
    """An lm_head whose logits get Gaussian noise of standard deviation ``scale`` (in float32), drawn from its own
    generator, which the source re-seeds before every draw: the perturbation is a function of (seed, step)."""

    def __init__(self, head: nn.Module, scale: float):
        super().__init__()
        self.head, self.scale = head, float(scale)
        self.generator = torch.Generator(device=next(head.parameters()).device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        noise = torch.randn(logits.shape, generator=self.generator, device=logits.device, dtype=torch.float32)
        return logits + self.scale * noise


class SamplerCopy:
    """``--sampler-dtype`` / ``--sampler-logit-noise``: the stale sampler drawing from its own copy of the policy
    (base and both adapters), cast to ``dtype`` (None: the policy's), its lm_head adding logit noise of ``noise``
    when above 0. Before each draw the sampler adapter's tensors are copied into it from the policy (cast), so it
    draws what the stale sampler holds, with its own numerics. The copy never trains: only its sampler adapter is
    ever written."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype | None, noise: float = 0.0):
        self.model = copy.deepcopy(policy) if dtype is None else copy.deepcopy(policy).to(dtype)
        for p in self.model.parameters():
            p.requires_grad_(False)
        src, dst = lora_state(policy, SAMPLER_ADAPTER), lora_state(self.model, SAMPLER_ADAPTER)
        self._pairs = [(p, dst[name]) for name, p in src.items()]
        self.head: NoisyHead | None = None
        if noise > 0:
            lm = causal_lm(self.model)
            self.head = NoisyHead(lm.get_output_embeddings(), noise)
            lm.set_output_embeddings(self.head)

    @torch.no_grad()
    def sync(self, seed: int = 0) -> None:
        """The sampler adapter as the policy holds it now, cast into the copy; the logit noise seeded by ``seed``."""
        for p, q in self._pairs:
            q.copy_(p)
        if self.head is not None:
            self.head.generator.manual_seed(seed)


def sampler_dtype(policy: nn.Module, name: str) -> torch.dtype | None:
    """The dtype ``--sampler-dtype name`` draws in, or None when it is the policy's own (no copy needed)."""
    dtype = SAMPLER_DTYPES.get(name)
    return None if dtype is None or dtype == next(policy.parameters()).dtype else dtype


def draw_batch(
    decoder: Decoder, tokenizer: Any, prompts: list[str], sampling: Sampling, generator, rows: slice | None = None
) -> Rollout:
    """Encode chat-formatted prompt strings, draw one reply each, and keep the decoded texts. ``rows``: draw only
    those rows of the batch, each as the whole batch's draw would give it (the decoder's ``share``; the prompts
    keep the whole batch's padding)."""
    device = generator.device
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)  # [B, P]
    share: dict[str, Any] = {}
    if rows is not None:
        share["share"] = (rows, len(prompts))
        prompt_ids, prompt_mask = prompt_ids[rows], prompt_mask[rows]  # [b, P]
    rollout = decoder.generate(prompt_ids, prompt_mask, generator=generator, **sampling.as_kwargs(), **share)
    rollout.texts = decode(tokenizer, rollout)
    return rollout


class LocalStaleSource:
    """The default source: the stale sampler (a frozen second adapter, or a frozen copy of the whole policy under
    full fine-tuning, refreshed every ``lag`` policy steps) drawing the seeded prompt stream in this process.
    Staleness 0 at the first policy step, then 1..LAG. Under torchrun one runs on every process (``ranks``)."""

    every_rank = True  # built on every torchrun process, drawing with the trainer's own models (each its rows)

    def __init__(
        self,
        policy: nn.Module,
        tokenizer: Any,
        prompts: dict[str, str],
        order: PromptOrder,
        *,
        lag: int,
        batch_size: int,
        critic_warmup: int | str,
        sampling: Sampling,
        seed: int,
        decoder: str = "auto",
        episodes: Episodes | None = None,
        dtype: str = "auto",
        copy: nn.Module | None = None,
        root: nn.Module | None = None,
        ranks: Ranks | None = None,
        sharded: bool = False,
        logit_noise: float = 0.0,
        oracle_samples: int = 0,
    ):
        """``dtype``: ``--sampler-dtype`` ("auto": the policy's own; another dtype draws with a ``SamplerCopy``);
        ``logit_noise``: ``--sampler-logit-noise`` (a copy too); ``oracle_samples``: K > 0 draws K more rollouts of
        every prompt of each batch beside it (``Batch.oracle``: the oracle baseline's).
        ``copy``: full fine-tuning's frozen copy of the policy, which then draws. ``root``: the FSDP root of the
        model that draws, gathered around each draw. ``ranks``: the torchrun processes, each drawing its rows.
        ``sharded`` (``--shard fsdp``): the sampler's tensors go to the sharded checkpoint (``tensors``), not to
        ``state_dict``."""
        self.tokenizer, self.prompts, self.order, self.episodes = tokenizer, prompts, order, episodes
        self.batch_size, self.sampling, self.seed = batch_size, sampling, seed
        self.first_policy_step = critic_warmup if isinstance(critic_warmup, int) else None  # "auto": the trainer's
        self.sampler = StaleSampler(policy, lag, copy)
        cast = sampler_dtype(policy, dtype)
        self.cast = SamplerCopy(policy, cast, logit_noise) if cast is not None or logit_noise > 0 else None
        self.oracle_samples = oracle_samples
        drawer = copy if copy is not None else policy if self.cast is None else self.cast.model
        adapter = None if copy is not None else SAMPLER_ADAPTER  # reads the sampler's adapter, or is the copy
        self.decoder = make_decoder(drawer, adapter, decoder)
        self.root, self.ranks, self.sharded = root, ranks, sharded
        self.device = next(policy.parameters()).device
        self.max_staleness = lag
        self.tasks: dict[str, Any] = {}
        self.drawn_with: dict[int, dict[str, torch.Tensor]] = {}  # version → the adapter that drew the last batch

    @classmethod
    def build(cls, context: SourceContext) -> LocalStaleSource:
        """``--rollout local``: the stale sampler over the context's policy, prompts and environment."""
        context.check_batch()
        c, m = context.config, context.models
        m.add_stale_sampler()  # a no-op when the builder made room for it before sharding
        source = cls(
            m.policy,
            m.tokenizer,
            context.prompts,
            context.order,
            lag=c.source.lag,
            batch_size=c.training.batch_size,
            critic_warmup=c.algorithm.critic_warmup,
            sampling=context.sampling,
            seed=c.training.seed,
            decoder=c.rollout.decoder,
            episodes=context.episodes,
            dtype=c.source.sampler_dtype,
            copy=m.sampler,
            root=m.roots.get("sampler" if m.sampler is not None else "policy"),
            ranks=context.world,
            sharded=c.training.shard == "fsdp",
            logit_noise=c.source.sampler_logit_noise,
            oracle_samples=c.algorithm.oracle_samples if c.algorithm.baseline == "oracle" else 0,
        )
        source.tasks = context.tasks
        return source

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        if phase == POLICY and self.first_policy_step is None:  # an automatic critic warmup ends here
            self.first_policy_step = step
        k = step - (self.first_policy_step or 0)  # policy step (unused during the warmup)
        if phase == POLICY and self.sampler.refresh_before_draw(k):
            self.sampler.refresh(policy_version)
        staleness = policy_version - self.sampler.version
        task_ids = self.order.batch(step, self.batch_size)
        started = timeline.now()
        with timeline.phase("draw"):
            rollout = self.draw_more(
                task_ids,
                derived_seed(self.seed, step, "rollout"),
                noise_seed=derived_seed(self.seed, step, "logit-noise"),
            )
        trajectories(task_ids, started, timeline.now(), self.sampler.version, staleness, step)
        oracle = None
        if self.oracle_samples:  # the oracle baseline's rollouts, by the sampler that drew the batch
            rows = [i for i in task_ids for _ in range(self.oracle_samples)]
            with timeline.phase("draw"):
                oracle = self.draw_more(
                    rows,
                    derived_seed(self.seed, step, "oracle"),
                    noise_seed=derived_seed(self.seed, step, "oracle-logit-noise"),
                )
        if self.sampler.version not in self.drawn_with:  # kept for re-scoring this batch under its own version
            weights = self.sampler.weights()
            self.drawn_with = {self.sampler.version: weights} if weights is not None else {}
        if phase == POLICY and self.sampler.refresh_after_draw(k):
            self.sampler.refresh(policy_version)
        return Batch(task_ids=task_ids, rollout=rollout, staleness=[staleness] * len(task_ids), oracle=oracle)

    def draw_more(self, task_ids: list[str], seed: int, *, noise_seed: int | None = None) -> Rollout:
        """One rollout per entry of ``task_ids`` (a prompt may repeat) by the sampler as it stands now, from a
        generator seeded by ``seed`` (and the logit noise by ``noise_seed``, default ``seed``): the batch's draw,
        the oracle baseline's and the oracle ceiling's."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        if self.cast is not None:
            self.cast.sync(seed if noise_seed is None else noise_seed)
        return self._draw(task_ids, generator)

    def _draw(self, task_ids: list[str], generator: torch.Generator) -> Rollout:
        """The batch's trajectories, with the drawing model gathered when sharded. Over several processes each
        draws its rows of a single reply per prompt and they swap them; a multi-turn batch is drawn by rank 0."""
        ranks = self.ranks if self.ranks is not None and self.ranks.size > 1 else None
        with gathered(self.root):
            if self.episodes is not None:
                rollout = None
                if ranks is None or ranks.rank == 0:
                    rollout = draw_episode_batch(
                        self.decoder, self.tokenizer, task_ids, self.episodes, self.sampling, generator
                    )
            else:
                prompts = [self.prompts[i] for i in task_ids]
                own = ranks.shard(len(prompts)) if ranks is not None else None
                rollout = draw_batch(self.decoder, self.tokenizer, prompts, self.sampling, generator, rows=own)
        if ranks is None:
            return rollout
        if self.episodes is not None:
            return ranks.broadcast(rollout.to("cpu") if rollout is not None else None).to(self.device)
        parts = ranks.all_gather_objects(rollout.to("cpu"))  # every rank's rows, in rank order
        return Rollout.concat(parts, self.sampling.pad_token_id).to(self.device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """``sharded``: the sampler's tensors by name (references), for the sharded checkpoint; else nothing."""
        return {f"sampler.{name}": t for name, t in self.sampler.tensors().items()} if self.sharded else {}

    def adapter(self, version: int) -> dict[str, torch.Tensor] | None:
        """The LoRA tensors (PEFT's saved names) of the sampler version that drew the last batch, if it is
        ``version``."""
        return self.drawn_with.get(version)

    def after_update(self, policy_version: int) -> None:
        """Nothing to publish: the sampler copies the policy on its own schedule at draw time."""

    def state_dict(self) -> dict[str, Any]:
        state = {"version": self.sampler.version} if self.sharded else self.sampler.state_dict()
        if self.first_policy_step is not None:
            state["first_policy_step"] = self.first_policy_step
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.first_policy_step = state.pop("first_policy_step", self.first_policy_step)
        if "weights" in state:
            self.sampler.load_state_dict(state)
        else:  # sharded: the weights were loaded in place from the sharded checkpoint (``tensors``)
            self.sampler.version = int(state["version"])

    def close(self) -> None:
        pass
