"""Multi-turn trajectories: the model acts, the environment answers, the model continues from its KV cache.

Rows act token by token (drawn exactly as ``sampler.draw`` draws) until EOS, a stop string or ``max_new_tokens``;
then each finished row calls ``env.step``, its reward lands on the turn's last action token, and the rendered
observation is appended to the cache in one chunk (no re-encoding). ``max_turns`` and ``max_total_tokens`` end a
trajectory as truncated. The returned ``Rollout`` is compacted row by row, so the teacher-forced pass sees exactly
what the sampler attended to; with one turn per row the tokens are ``sampler.draw``'s. One loop, two ``Stepper``s:
``HFStepper`` (the plain loop) and ``sao.rollout.engine.EngineStepper``.

Deliberately left out: asynchronous environments, and CUDA-graph replay for multi-turn decoding.
Design notes: docs/design/episodes.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sao.core import plugins
from sao.core.plugins import PluginError, PluginTimeout
from sao.core.reading import preview, reward_problem
from sao.model.forward import position_ids_from
from sao.rollout.environment import Message, TextEnv, render_observation
from sao.rollout.sampler import encode_prompts, gumbel_sample_
from sao.rollout.types import Decoder, Rollout, Stepper, Turns

ACT, WAIT, DONE = 0, 1, 2


@dataclass
class _Row:
    """One trajectory's bookkeeping while it is drawn."""

    env: TextEnv | None  # None: building it timed out (the row is DONE from the start)
    stops: tuple[str, ...]
    budget: int  # response tokens this row may hold: max_total_tokens, or less where the context is full first
    task: str = "a row"  # what errors name
    state: int = ACT
    turns: int = 0  # actions taken (finished)
    turn_tokens: list[int] = field(default_factory=list)  # the current action's tokens
    ended_with: int | None = None  # the EOS token that ended the last action (None: a stop string or a limit)
    cut: bool = False  # the current action hit max_new_tokens or the total budget
    truncated: bool = False
    response_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    timed_out: bool = False  # an environment call outlived its timeout: the trajectory ends as cut
    context_cut: bool = False  # the budget is the context's (smaller than max_total_tokens)
    out_of_room: bool = False  # the budget ended the trajectory


@dataclass
class _Columns:
    """The response as fed to the cache, column by column: [B] tensors per step (holes included)."""

    ids: list[torch.Tensor] = field(default_factory=list)  # [B] long
    real: list[torch.Tensor] = field(default_factory=list)  # [B] bool: a token the cache attends to
    action: list[torch.Tensor] = field(default_factory=list)  # [B] bool: written by the model
    logprobs: list[torch.Tensor] = field(default_factory=list)  # [B] float32
    rewards: list[torch.Tensor] = field(default_factory=list)  # [B] float32: a turn's reward on its last token

    def add(self, ids, real, action, logprobs) -> None:
        self.ids.append(ids)
        self.real.append(real)
        self.action.append(action)
        self.logprobs.append(logprobs)
        self.rewards.append(torch.zeros_like(logprobs))


@torch.no_grad()
def draw_episodes(
    decoder: Decoder,
    tokenizer,
    envs: Sequence[TextEnv],
    prompts: Sequence[list[Message]],
    *,
    max_new_tokens: int,
    max_turns: int,
    max_total_tokens: int,
    temperature: float,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator,
    calls: EnvCalls | None = None,
) -> Rollout:
    """One episode per environment (see docs/design/episodes.md), on the decoder's own stepper: the plain loop's
    model with its adapter, or the engine's static cache. Every environment call goes through ``plugins.call``
    (``calls``: its name, the task ids and the timeout): what it raises is one line naming it and the task, a
    call past the timeout ends that trajectory as cut. A row's prompt and response never pass the decoder's
    ``context_length``: a trajectory that fills it ends there, cut and marked (``Turns.context_cuts``)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    calls = calls or EnvCalls()
    device = generator.device
    tasks = list(calls.tasks) if calls.tasks is not None else [f"row {i}" for i in range(len(envs))]
    starts, texts = [], []
    for env, messages, task in zip(envs, prompts, tasks, strict=True):
        start, info = None, None  # an environment that could not be built in time (None) starts nowhere
        if env is not None:
            with contextlib.suppress(PluginTimeout):  # the row ends before it acts, cut and counted
                start, info = _checked_init(calls.call(env.init, messages, task=task, what="init"), calls.name, task)
        starts.append(start is not None)
        start = start if start is not None else messages  # the prompt as given: the row ends before it acts
        tools = (info or {}).get("tools") or None  # a tool-calling template lists the tools in the prompt
        texts.append(tokenizer.apply_chat_template(start, tools=tools, tokenize=False, add_generation_prompt=True))
    prompt_ids, prompt_mask = encode_prompts(tokenizer, texts, device)  # [B, P]
    context = getattr(decoder, "context_length", None)
    rows = []
    for i, (env, task) in enumerate(zip(envs, tasks, strict=True)):
        room = max_total_tokens if context is None else min(max_total_tokens, context - int(prompt_mask[i].sum()))
        row = _Row(env, tuple(getattr(env, "stop_strings", ()) or ()), budget=max(room, 1), task=task)
        row.context_cut = room < max_total_tokens  # marked as such only if the row runs out of room
        if not starts[i]:
            row.timed_out = row.cut = row.truncated = True
        rows.append(row)
    B = len(rows)
    with decoder.stepper(B, prompt_ids.shape[1] + max_total_tokens) as net:
        return _run(net, rows, tokenizer, prompt_ids, prompt_mask, max_new_tokens, max_turns, calls,
                    temperature, set(eos_token_ids), pad_token_id, generator)  # fmt: skip


@dataclass(frozen=True)
class EnvCalls:
    """How the episode loop calls the environments: the name errors give them, the task id of each row, and
    the seconds one call may take (0: no limit)."""

    name: str = "the environment"
    tasks: Sequence[str] | None = None
    timeout: float = 0.0

    def call(self, fn, *args, task: str, what: str):
        return plugins.call(fn, *args, plugin=f"{self.name} ({what})", row=task, timeout=self.timeout)


def _checked_init(result, name: str, task: str):
    """``env.init``'s (messages, info), or a one-line error naming the environment and the task."""
    if not (isinstance(result, tuple | list) and len(result) == 2 and isinstance(result[0], list)
            and (result[1] is None or isinstance(result[1], dict))):  # fmt: skip
        raise PluginError(f"{name} (init) returned {preview(result)} on {task}; init returns (messages, info)")
    return result


def _run(net: Stepper, rows: list[_Row], tokenizer, prompt_ids, prompt_mask, max_new_tokens: int, max_turns: int,
         calls: EnvCalls, temperature: float, eos: set[int], pad_token_id: int, generator) -> Rollout:  # fmt: skip
    """The episode loop itself, on one stepper."""
    B, device = len(rows), generator.device
    for r in rows:
        if r.timed_out:
            r.state = DONE

    positions = position_ids_from(prompt_mask.long())
    hidden = net.feed(prompt_ids, prompt_mask.bool(), positions)[:, -1]  # [B, H] each acting row samples from
    next_pos = positions[:, -1] + 1  # [B]
    cols = _Columns()
    pending = None  # the last sampled column, not yet fed to the cache

    while True:
        acting = torch.tensor([r.state == ACT for r in rows], device=device)  # [B]
        if bool(acting.any()):
            logits = net.logits(hidden, temperature)  # [B, V]
            noise = torch.rand(logits.shape, generator=generator, device=device, dtype=torch.float32)
            token, token_logp = gumbel_sample_(logits, noise)  # [B], [B]
            ids = torch.where(acting, token, torch.full_like(token, pad_token_id))
            cols.add(ids, acting, acting, torch.where(acting, token_logp, torch.zeros_like(token_logp)))
            pending = (ids, acting)
            for i, r in enumerate(rows):
                if r.state == ACT:
                    _extend_action(r, int(token[i]), tokenizer, eos, max_new_tokens)
            if any(r.state == ACT for r in rows):
                fed = net.feed(ids[:, None], acting[:, None], next_pos[:, None])[:, -1]  # [B, H]
                hidden = torch.where(acting[:, None], fed, hidden)
                next_pos = next_pos + acting.long()
                pending = None
                continue
        # No row is acting: every finished action meets its environment.
        observations = _observe(rows, cols, tokenizer, max_turns, calls)
        if not any(observations):
            break
        chunk, chunk_mask = _chunk(pending, observations, B, pad_token_id, device)  # [B, L]
        for j in range(1 if pending is not None else 0, chunk.shape[1]):  # the observation columns
            real = chunk_mask[:, j].bool()
            cols.add(chunk[:, j], real, torch.zeros_like(real), torch.zeros(B, device=device))
        chunk_pos = next_pos[:, None] + chunk_mask.cumsum(dim=1) - 1  # [B, L]
        out = net.feed(chunk, chunk_mask.bool(), chunk_pos.clamp(min=0))  # [B, L, H]
        columns = torch.arange(chunk.shape[1], device=device)
        last = (chunk_mask * columns).argmax(dim=1)  # [B] each row's last real column (column 0 may be a hole)
        fed = chunk_mask.any(dim=1)
        hidden = torch.where(fed[:, None], out[torch.arange(B), last], hidden)
        next_pos = next_pos + chunk_mask.sum(dim=1)
        pending = None

    if not cols.ids:  # no row acted (every environment timed out before the first action): one empty column
        nothing = torch.zeros(B, dtype=torch.bool, device=device)
        cols.add(torch.full((B,), pad_token_id, device=device), nothing, nothing, torch.zeros(B, device=device))
    return _compact(prompt_ids, prompt_mask, cols, rows, tokenizer, pad_token_id)


def _extend_action(r: _Row, token: int, tokenizer, eos: set[int], max_new_tokens: int) -> None:
    """Add a drawn token to row r's action; end the action at EOS, a stop string, or a limit."""
    r.turn_tokens.append(token)
    r.response_tokens += 1
    if token in eos:
        r.state, r.ended_with = WAIT, token
    elif r.stops and any(_tail(tokenizer, r.turn_tokens).endswith(s) for s in r.stops):
        r.state, r.ended_with = WAIT, None
    elif len(r.turn_tokens) >= max_new_tokens or r.response_tokens >= r.budget:
        r.state, r.ended_with, r.cut = WAIT, None, True
        r.out_of_room = r.response_tokens >= r.budget


def _tail(tokenizer, tokens: list[int], n: int = 16) -> str:
    return tokenizer.decode(tokens[-n:], skip_special_tokens=False)


def _observe(rows, cols: _Columns, tokenizer, max_turns: int, calls: EnvCalls) -> list[list[int]]:
    """``env.step`` for every row whose action ended; the observation tokens to append (empty: none)."""
    out: list[list[int]] = []
    for i, r in enumerate(rows):
        if r.state != WAIT:
            out.append([])
            continue
        action = tokenizer.decode(r.turn_tokens, skip_special_tokens=True)
        try:
            result = _checked_step(calls.call(r.env.step, action, task=r.task, what="step"), calls.name, r.task)
        except PluginTimeout:  # the trajectory ends here, cut, its turn scoring 0
            r.turns += 1
            r.turn_tokens = []
            r.state, r.cut, r.truncated, r.timed_out = DONE, True, True, True
            out.append([])
            continue
        _put_reward(cols, i, result["reward"])
        meta = result.get("metadata") or {}
        r.tool_calls += _count(meta, "tool_calls", calls.name, r.task)
        r.tool_errors += _count(meta, "tool_errors", calls.name, r.task)
        r.turns += 1
        r.turn_tokens = []
        if r.cut or r.turns >= max_turns or r.response_tokens >= r.budget:
            r.truncated = r.cut or not result.get("done", False)
            r.state = DONE
        if result.get("done", False) or r.state == DONE:
            r.state = DONE
            out.append([])
            continue
        eos_text = tokenizer.decode([r.ended_with]) if r.ended_with is not None else None
        text = render_observation(tokenizer, list(result.get("observations") or []), eos_text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if r.response_tokens + len(ids) >= r.budget:  # no room for the observation and another action
            r.state, r.truncated, r.out_of_room = DONE, True, True
            out.append([])
            continue
        r.response_tokens += len(ids)
        r.observation_tokens += len(ids)
        r.state = ACT
        out.append(ids)
    return out


def _checked_step(result, name: str, task: str) -> dict:
    """``env.step``'s output with its reward checked by the one rule for rewards (absent: 0), or a
    one-line error naming the environment and the task."""
    if not isinstance(result, dict):
        raise PluginError(f"{name} (step) returned {preview(result)} on {task}; step returns a dict with "
                          "observations, reward, done")  # fmt: skip
    reward = result.get("reward", 0.0)  # absent: a turn without a reward; None is refused as --reward refuses it
    problem = reward_problem(reward)
    if problem is not None:
        raise PluginError(f"{name} (step) on {task}: {problem}")
    observations = result.get("observations") or []
    if not isinstance(observations, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in observations
    ):
        raise PluginError(f"{name} (step) on {task}: observations must be a list of {{role, content}} messages, "
                          f"got {preview(observations)}")  # fmt: skip
    if result.get("metadata") is not None and not isinstance(result["metadata"], dict):
        raise PluginError(f"{name} (step) on {task}: metadata must be a dict, got {preview(result['metadata'])}")
    return {**result, "reward": float(reward), "observations": observations}


def _count(meta: dict, key: str, name: str, task: str) -> int:
    value = meta.get(key, 0) or 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise PluginError(f"{name} (step) on {task}: metadata {key} must be a whole number >= 0, got {preview(value)}")
    return value


def _put_reward(cols: _Columns, row: int, reward: float) -> None:
    """The reward on row's last action token so far."""
    for j in range(len(cols.action) - 1, -1, -1):
        if bool(cols.action[j][row]):
            cols.rewards[j][row] = reward
            return


def _chunk(pending, observations: list[list[int]], B: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[pending column | observation tokens] right-padded into one [B, L] chunk and its mask."""
    lead = 1 if pending is not None else 0
    width = lead + max(len(o) for o in observations)
    chunk = torch.full((B, width), pad, dtype=torch.long, device=device)
    chunk_mask = torch.zeros(B, width, dtype=torch.long, device=device)
    if pending is not None:
        chunk[:, 0], chunk_mask[:, 0] = pending[0], pending[1].long()
    for i, ids in enumerate(observations):
        if ids:
            chunk[i, lead : lead + len(ids)] = torch.tensor(ids, device=device)
            chunk_mask[i, lead : lead + len(ids)] = 1
    return chunk, chunk_mask


def _compact(prompt_ids, prompt_mask, cols: _Columns, rows, tokenizer, pad: int) -> Rollout:
    """Drop each row's holes and right-pad: the trajectory as the trainer sees it."""
    fed = {name: torch.stack(getattr(cols, name), 1) for name in ("ids", "real", "action", "logprobs", "rewards")}
    real = fed["real"]  # [B, C]
    B, R = real.shape[0], max(int(real.sum(dim=1).max()), 1)
    out = {name: torch.zeros(B, R, dtype=t.dtype, device=t.device) for name, t in fed.items()}  # [B, R] each
    out["ids"].fill_(pad)
    for i in range(B):
        n = int(real[i].sum())
        for name, t in fed.items():
            out[name][i, :n] = t[i][real[i]]
    kept = [out["ids"][i][out["real"][i]].tolist() for i in range(B)]
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    dev = real.device
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.bool(),
        response_ids=out["ids"],
        response_mask=out["real"],
        action_mask=out["action"],
        sampler_logprobs=out["logprobs"],
        cut=torch.tensor([r.cut for r in rows], device=dev),
        texts=texts,
        turns=Turns(
            rewards=out["rewards"],
            count=torch.tensor([r.turns for r in rows], device=dev),
            tool_calls=torch.tensor([r.tool_calls for r in rows], device=dev),
            tool_errors=torch.tensor([r.tool_errors for r in rows], device=dev),
            unfinished=torch.tensor([r.truncated for r in rows], device=dev),
            timeouts=torch.tensor([r.timed_out for r in rows], device=dev),
            context_cuts=torch.tensor([r.context_cut and r.out_of_room for r in rows], device=dev),
        ),
    )


def segments(tokenizer, rollout: Rollout, row: int) -> list[dict[str, str]]:
    """Row ``row``'s response as the trainer sees it, split into its spans: ``{"kind": "action" | "observation",
    "text": ...}`` in order, special tokens kept (an observation carries the chat template's turn markers)."""
    real = rollout.response_mask[row]  # [R]
    ids = rollout.response_ids[row][real].tolist()
    acts = rollout.action_mask[row][real].tolist()
    out: list[dict[str, str]] = []
    start = 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or acts[j] != acts[start]:
            kind = "action" if acts[start] else "observation"
            out.append({"kind": kind, "text": tokenizer.decode(ids[start:j], skip_special_tokens=False)})
            start = j
    return out


def render_segments(spans: list[dict[str, str]]) -> str:
    """One line a person can read: each span wrapped in its kind, e.g. ``[action]<calc>1+2</calc>[/action]``."""
    return "".join(f"[{s['kind']}]{s['text']}[/{s['kind']}]" for s in spans)
