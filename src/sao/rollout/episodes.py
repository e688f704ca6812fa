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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sao.model.forward import position_ids_from
from sao.rollout.environment import Message, TextEnv, render_observation
from sao.rollout.sampler import encode_prompts, gumbel_sample_
from sao.rollout.types import Decoder, Rollout, Stepper, Turns

ACT, WAIT, DONE = 0, 1, 2


@dataclass
class _Row:
    """One trajectory's bookkeeping while it is drawn."""

    env: TextEnv
    stops: tuple[str, ...]
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
) -> Rollout:
    """One episode per environment (see docs/design/episodes.md), on the decoder's own stepper: the plain loop's
    model with its adapter, or the engine's static cache."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    device = generator.device
    rows = [_Row(env, tuple(getattr(env, "stop_strings", ()) or ())) for env in envs]
    texts = []
    for env, messages in zip(envs, prompts, strict=True):
        start, info = env.init(messages)
        tools = (info or {}).get("tools") or None  # a tool-calling template lists the tools in the prompt
        texts.append(tokenizer.apply_chat_template(start, tools=tools, tokenize=False, add_generation_prompt=True))
    prompt_ids, prompt_mask = encode_prompts(tokenizer, texts, device)  # [B, P]
    B = len(rows)
    with decoder.stepper(B, prompt_ids.shape[1] + max_total_tokens) as net:
        return _run(net, rows, tokenizer, prompt_ids, prompt_mask, max_new_tokens, max_turns, max_total_tokens,
                    temperature, set(eos_token_ids), pad_token_id, generator)  # fmt: skip


def _run(net: Stepper, rows: list[_Row], tokenizer, prompt_ids, prompt_mask, max_new_tokens: int, max_turns: int,
         max_total_tokens: int, temperature: float, eos: set[int], pad_token_id: int,
         generator) -> Rollout:  # fmt: skip
    """The episode loop itself, on one stepper."""
    B, device = len(rows), generator.device

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
                    _extend_action(r, int(token[i]), tokenizer, eos, max_new_tokens, max_total_tokens)
            if any(r.state == ACT for r in rows):
                fed = net.feed(ids[:, None], acting[:, None], next_pos[:, None])[:, -1]  # [B, H]
                hidden = torch.where(acting[:, None], fed, hidden)
                next_pos = next_pos + acting.long()
                pending = None
                continue
        # No row is acting: every finished action meets its environment.
        observations = _observe(rows, cols, tokenizer, max_turns, max_total_tokens)
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

    return _compact(prompt_ids, prompt_mask, cols, rows, tokenizer, pad_token_id)


def _extend_action(r: _Row, token: int, tokenizer, eos: set[int], max_new_tokens: int, budget: int) -> None:
    """Add a drawn token to row r's action; end the action at EOS, a stop string, or a limit."""
    r.turn_tokens.append(token)
    r.response_tokens += 1
    if token in eos:
        r.state, r.ended_with = WAIT, token
    elif r.stops and any(_tail(tokenizer, r.turn_tokens).endswith(s) for s in r.stops):
        r.state, r.ended_with = WAIT, None
    elif len(r.turn_tokens) >= max_new_tokens or r.response_tokens >= budget:
        r.state, r.ended_with, r.cut = WAIT, None, True


def _tail(tokenizer, tokens: list[int], n: int = 16) -> str:
    return tokenizer.decode(tokens[-n:], skip_special_tokens=False)


def _observe(rows, cols: _Columns, tokenizer, max_turns: int, budget: int) -> list[list[int]]:
    """``env.step`` for every row whose action ended; the observation tokens to append (empty: none)."""
    out: list[list[int]] = []
    for i, r in enumerate(rows):
        if r.state != WAIT:
            out.append([])
            continue
        result = r.env.step(tokenizer.decode(r.turn_tokens, skip_special_tokens=True))
        reward = float(result.get("reward", 0.0) or 0.0)
        _put_reward(cols, i, reward)
        meta = result.get("metadata") or {}
        r.tool_calls += int(meta.get("tool_calls", 0) or 0)
        r.tool_errors += int(meta.get("tool_errors", 0) or 0)
        r.turns += 1
        r.turn_tokens = []
        if r.cut or r.turns >= max_turns or r.response_tokens >= budget:
            r.truncated = r.cut or not result.get("done", False)
            r.state = DONE
        if result.get("done", False) or r.state == DONE:
            r.state = DONE
            out.append([])
            continue
        eos_text = tokenizer.decode([r.ended_with]) if r.ended_with is not None else None
        text = render_observation(tokenizer, list(result.get("observations") or []), eos_text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if r.response_tokens + len(ids) >= budget:  # no room for the observation and another action
            r.state, r.truncated = DONE, True
            out.append([])
            continue
        r.response_tokens += len(ids)
        r.observation_tokens += len(ids)
        r.state = ACT
        out.append(ids)
    return out


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
