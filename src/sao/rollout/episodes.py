"""Multi-turn trajectories: the model acts, the environment answers, the model continues from its KV cache.

Rows act token by token until EOS, a stop string or ``max_new_tokens``; the finished action goes to ``env.step`` on
``EnvCalls`` (a bounded thread pool; ``async def`` environments on an event loop), its reward lands on the turn's
last action token, and the observation is appended to the cache in one chunk (no re-encoding). A turn's steps run
at once; with ``rejoin="row"`` the batch does not wait either: rows whose observation is back join the next decode
call while slow tools run on. Every environment call (init, step, close) is contained: one that raises, exits, runs
past ``env_timeout``, answers what sao cannot use, or returns an observation too long for the room left ends that
trajectory only, as truncated, counted in ``Turns.faults`` (``Turns.timeouts`` too), one line naming the
environment and the task logged. ``max_turns``, ``max_total_tokens`` and the decoder's ``context_length`` truncate
too (``Turns.context_cuts``). ``rejoin="turn"`` (the default) draws exactly as the batch-synchronous loop of
earlier versions whatever order the tools finish in; ``rejoin="row"`` keys each row's later noise on (row, turn,
token), so the tokens do not depend on that order, but the batch layout does (log-probs in their last bits).
Two ``Stepper``s: ``HFStepper`` and ``sao.rollout.engine.EngineStepper``. Deliberately left out: per-row cache
slots and CUDA-graph replay for multi-turn decoding. Notes: docs/design/episodes.md.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sao.algorithm.corrections import mix64
from sao.core.plugins import PluginError, describe
from sao.model.forward import position_ids_from
from sao.rollout.environment import (
    EnvCalls,
    EnvFault,
    Message,
    TextEnv,
    check_env,
    checked_init,
    checked_step,
    encode_bounded,
    every_row_failed,
    reaches_stop,
    render_observation,
    tool_count,
)
from sao.rollout.sampler import derived_seed, encode_prompts, gumbel_sample_
from sao.rollout.types import Decoder, Rollout, Stepper, Turns

ACT, WAIT, DONE = 0, 1, 2  # acting; its step in flight (or, synchronous, not yet called); over
DEFAULT_CONCURRENCY = 16  # environment steps in flight at once per draw call (the rollout setting's default)
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's increment, as the int64 with its bits
log = logging.getLogger("sao.rollout")


@dataclass
class _Row:
    """One trajectory's bookkeeping while it is drawn."""

    env: TextEnv
    stops: tuple[str, ...]
    budget: int  # response tokens it may hold: max_total_tokens, or less where the model's context ends first
    task: str  # what its one-line faults call it
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
    faults: int = 0  # calls that raised, ran past the timeout, or answered what sao cannot use (0 or 1)
    fault: str | None = None  # what happened: one line naming the environment and the task
    timed_out: bool = False  # the fault was a call past the timeout
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
    versions: list[torch.Tensor] = field(default_factory=list)  # [B] long: the adapter version the column was fed at
    version: int = 0  # the adapter version the decoder holds now

    def add(self, ids, real, action, logprobs) -> None:
        self.ids.append(ids)
        self.real.append(real)
        self.action.append(action)
        self.logprobs.append(logprobs)
        self.rewards.append(torch.zeros_like(logprobs))
        self.versions.append(torch.full_like(ids, self.version))


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
    env_concurrency: int = DEFAULT_CONCURRENCY,
    env_timeout: float = 0.0,
    rejoin: str = "turn",
    close: bool = False,
    name: str = "the environment",
    tasks: Sequence[str] | None = None,
    refresh: Callable[[], int] | None = None,
) -> Rollout:
    """One episode per environment (see docs/design/episodes.md), on the decoder's own stepper: the plain loop's
    model with its adapter, or the engine's static cache. ``env_concurrency``: steps in flight at once (0: one
    after another); ``rejoin``: "turn" (the batch decodes on when every step of the turn is back: the layout never
    depends on timing) or "row" (a row decodes on as soon as its own observation is back); ``env_timeout``:
    seconds one environment call may run (0: no limit); ``close``: close every environment afterwards (an async
    ``close`` on the loop its steps ran on);
    ``name`` and ``tasks`` (each row's task id): what the one-line faults call the environment and the row. An
    ``EnvFault`` in place of an environment (building it failed) ends that row before it acts, counted. A row's
    prompt and response never pass the decoder's ``context_length``. ``refresh`` (asynchronous sources): called
    before the first action and between turns, it loads a newer adapter into the decoder if there is one and
    returns the version the decoder now holds; on a change the cache is computed again under the new weights and
    the episodes go on under it, every token recording its version (``Rollout.versions`` where a row spans
    versions). Only the turn loop calls it (``rejoin="row"`` has no moment when no row is acting)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    tasks = list(tasks) if tasks is not None else [f"row {i}" for i in range(len(envs))]
    calls = EnvCalls(max(env_concurrency, 1), env_timeout, name)
    try:
        for env in {type(e): e for e in envs if not isinstance(e, EnvFault)}.values():  # a wrong mix: one line
            check_env(env)
        device = generator.device
        starts: list[EnvFault | None] = []
        texts = []
        for env, messages, task in zip(envs, prompts, tasks, strict=True):
            start, info, fault = messages, None, env if isinstance(env, EnvFault) else None
            if fault is None:
                try:
                    start, info = checked_init(calls.call(env.init, messages, task=task, what="init"), name, task)
                except (EnvFault, PluginError) as error:  # the row ends before it acts, on the prompt as given
                    start, fault = messages, error
            starts.append(fault)
            tools = (info or {}).get("tools") or None  # a tool-calling template lists the tools in the prompt
            texts.append(tokenizer.apply_chat_template(start, tools=tools, tokenize=False, add_generation_prompt=True))
        prompt_ids, prompt_mask = encode_prompts(tokenizer, texts, device)  # [B, P]
        context = getattr(decoder, "context_length", None)
        rows = []
        for i, (env, task) in enumerate(zip(envs, tasks, strict=True)):
            room = max_total_tokens if context is None else min(max_total_tokens, context - int(prompt_mask[i].sum()))
            row = _Row(env, tuple(getattr(env, "stop_strings", ()) or ()), budget=max(room, 1), task=task)
            row.context_cut = room < max_total_tokens  # marked as such only if the row runs out of room
            if starts[i] is not None:
                _fault(row, starts[i])
            rows.append(row)
        limits = _Limits(max_new_tokens, max_turns, temperature, set(eos_token_ids), pad_token_id)
        session = _Session(decoder, len(rows), prompt_ids.shape[1] + max_total_tokens)
        try:
            if rejoin == "row":
                rollout = _run_concurrent(
                    session.open(), rows, tokenizer, prompt_ids, prompt_mask, limits, calls, generator
                )
            else:
                rollout = _run(session, rows, tokenizer, prompt_ids, prompt_mask, limits, calls, generator, refresh)
        finally:
            session.close()
        if not bool(rollout.action_mask.any()):  # every row failed before it acted: nothing to train on or score
            raise every_row_failed(name, len(rows), next((r.fault for r in rows if r.fault), None))
        _tell_faults(rows, name)
        return rollout
    finally:
        try:
            if close:
                for env, task in zip(envs, tasks, strict=True):
                    if not isinstance(env, EnvFault):
                        try:  # closing cannot undo the episode
                            calls.call(env.close, task=task, what="close")
                        except EnvFault as error:
                            log.warning("%s", error)
        finally:
            calls.close()


def _fault(r: _Row, error: BaseException | str) -> None:
    """Row r's trajectory ends here, truncated, counted as a fault (``error``: its one line)."""
    r.faults, r.fault = 1, str(error)
    r.timed_out = bool(getattr(error, "timed_out", False))
    r.state, r.truncated = DONE, True


def _tell_faults(rows: list[_Row], name: str) -> None:
    """One log line per draw call for the faults it counted: how many, and the first one's own line."""
    faulted = [r for r in rows if r.faults]
    if faulted:
        more = f" (and {len(faulted) - 1} more)" if len(faulted) > 1 else ""
        log.warning(
            "%d of %d trajectories ended by a fault of %s: %s%s", len(faulted), len(rows), name, faulted[0].fault, more
        )


@dataclass(frozen=True)
class _Limits:
    max_new_tokens: int
    max_turns: int
    temperature: float
    eos: set[int]
    pad: int


class _Session:
    """The decoder's stepper, opened again when the adapter changes under it (a fresh cache for new weights)."""

    def __init__(self, decoder: Decoder, rows: int, capacity: int):
        self.decoder, self.rows, self.capacity, self._open = decoder, rows, capacity, None

    def open(self) -> Stepper:
        self.close()
        self._open = self.decoder.stepper(self.rows, self.capacity)
        return self._open.__enter__()

    def close(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)


def _refeed(net: Stepper, prompt_ids, prompt_mask, cols: _Columns) -> tuple[torch.Tensor, torch.Tensor]:
    """Every column so far, prompt and response, fed to a fresh cache in one chunk: each row's last hidden state
    [B, H] and its next position [B]."""
    ids = torch.cat([prompt_ids, torch.stack(cols.ids, 1)], dim=1)  # [B, P + C]
    real = torch.cat([prompt_mask.bool(), torch.stack(cols.real, 1)], dim=1)  # [B, P + C]
    positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, P + C] as fed column by column
    out = net.feed(ids, real, positions)  # [B, P + C, H]
    last = (real.long() * torch.arange(ids.shape[1], device=ids.device)).argmax(dim=1)  # [B]
    return out[torch.arange(ids.shape[0], device=ids.device), last], real.sum(dim=1)


def _run(
    session: _Session,
    rows: list[_Row],
    tokenizer,
    prompt_ids,
    prompt_mask,
    lim: _Limits,
    calls: EnvCalls,
    generator,
    refresh: Callable[[], int] | None = None,
) -> Rollout:
    """The turn loop: every turn waits until no row is acting, then steps every finished row's environment (at
    once, on the pool) and applies the outcomes in row order; one [B, V] draw of the batch generator per decode
    step. Between turns ``refresh`` may change the adapter: then the cache is fed again from the start."""
    B, device = len(rows), generator.device
    cols = _Columns()
    if refresh is not None:
        cols.version = refresh()
    net = session.open()
    positions = position_ids_from(prompt_mask.long())
    hidden = net.feed(prompt_ids, prompt_mask.bool(), positions)[:, -1]  # [B, H] each acting row samples from
    next_pos = positions[:, -1] + 1  # [B]
    pending = None  # the last sampled column, not yet fed to the cache

    while True:
        acting = torch.tensor([r.state == ACT for r in rows], device=device)  # [B]
        if bool(acting.any()):
            logits = net.logits(hidden, lim.temperature)  # [B, V]
            noise = torch.rand(logits.shape, generator=generator, device=device, dtype=torch.float32)
            token, token_logp = gumbel_sample_(logits, noise)  # [B], [B]
            ids = torch.where(acting, token, torch.full_like(token, lim.pad))
            cols.add(ids, acting, acting, torch.where(acting, token_logp, torch.zeros_like(token_logp)))
            pending = (ids, acting)
            for i, r in enumerate(rows):
                if r.state == ACT:
                    _extend_action(r, int(token[i]), tokenizer, lim)
            if any(r.state == ACT for r in rows):
                fed = net.feed(ids[:, None], acting[:, None], next_pos[:, None])[:, -1]  # [B, H]
                hidden = torch.where(acting[:, None], fed, hidden)
                next_pos = next_pos + acting.long()
                pending = None
                continue
        # No row is acting: every finished action meets its environment, the steps in flight together (on the
        # pool's workers), their outcomes applied in row order once the last is back.
        waiting = [i for i, r in enumerate(rows) if r.state == WAIT]
        for i in waiting:
            calls.submit(
                i, rows[i].env.step, tokenizer.decode(rows[i].turn_tokens, skip_special_tokens=True), task=rows[i].task
            )
        outcomes: dict[int, Any] = {}
        while len(outcomes) < len(waiting):
            outcomes.update(calls.collect(block=True))
        observations = [
            _apply(r, i, outcomes[i], cols, tokenizer, lim, calls.name) if i in outcomes else []
            for i, r in enumerate(rows)
        ]
        if not any(observations):
            break
        chunk, chunk_mask = _chunk(pending, observations, B, lim.pad, device)  # [B, L]
        for j in range(1 if pending is not None else 0, chunk.shape[1]):  # the observation columns
            real = chunk_mask[:, j].bool()
            cols.add(chunk[:, j], real, torch.zeros_like(real), torch.zeros(B, device=device))
        if refresh is not None and (version := refresh()) != cols.version:  # a newer adapter: the rest under it
            cols.version = version
            net = session.open()
            hidden, next_pos = _refeed(net, prompt_ids, prompt_mask, cols)
            pending = None
            continue
        chunk_pos = next_pos[:, None] + chunk_mask.cumsum(dim=1) - 1  # [B, L]
        out = net.feed(chunk, chunk_mask.bool(), chunk_pos.clamp(min=0))  # [B, L, H]
        columns = torch.arange(chunk.shape[1], device=device)
        last = (chunk_mask * columns).argmax(dim=1)  # [B] each row's last real column (column 0 may be a hole)
        fed = chunk_mask.any(dim=1)
        hidden = torch.where(fed[:, None], out[torch.arange(B), last], hidden)
        next_pos = next_pos + chunk_mask.sum(dim=1)
        pending = None

    return _compact(prompt_ids, prompt_mask, cols, rows, tokenizer, lim.pad)


def _run_concurrent(
    net: Stepper, rows: list[_Row], tokenizer, prompt_ids, prompt_mask, lim: _Limits, calls: EnvCalls, generator
) -> Rollout:
    """The loop that does not wait: each decode call takes the rows that are acting; a row whose action ends hands
    it to ``calls`` and keeps its last token back; when its observation is back, [that token | the observation] is
    fed with the next decode call's column and the row acts again."""
    B, device = len(rows), generator.device
    positions = position_ids_from(prompt_mask.long())
    hidden = net.feed(prompt_ids, prompt_mask.bool(), positions)[:, -1]  # [B, H] each acting row samples from
    next_pos = positions[:, -1] + 1  # [B]
    cols, noise = _Columns(), _Noise(generator, B)
    kept: dict[int, int] = {}  # row -> the last token of its finished action, not yet fed

    while True:
        acting_now = [r.state == ACT for r in rows]
        joining: dict[int, list[int]] = {}  # row -> observation tokens to feed now
        for i, outcome in calls.collect(block=not any(acting_now)):
            ids = _apply(rows[i], i, outcome, cols, tokenizer, lim, calls.name)
            if ids:
                joining[i] = ids
        if not any(acting_now) and not joining:
            if not calls.in_flight:
                break
            continue
        lead = torch.zeros(B, dtype=torch.long, device=device)  # [B] the column fed first (a hole: pad)
        lead_real = torch.zeros(B, dtype=torch.bool, device=device)  # [B]
        if any(acting_now):
            acting = torch.tensor(acting_now, device=device)  # [B]
            logits = net.logits(hidden, lim.temperature)  # [B, V]
            token, token_logp = gumbel_sample_(logits, noise.draw(logits.shape, rows, acting_now))  # [B], [B]
            ids = torch.where(acting, token, torch.full_like(token, lim.pad))
            cols.add(ids, acting, acting, torch.where(acting, token_logp, torch.zeros_like(token_logp)))
            for i, r in enumerate(rows):
                if not acting_now[i]:
                    continue
                _extend_action(r, int(token[i]), tokenizer, lim)
                if r.state == ACT:  # still acting: its token is fed now
                    lead[i], lead_real[i] = token[i], True
                else:  # the action ended: to its environment, the token kept until the observation is back
                    kept[i] = int(token[i])
                    calls.submit(i, r.env.step, tokenizer.decode(r.turn_tokens, skip_special_tokens=True), task=r.task)
        for i in list(kept):
            if rows[i].state == DONE:
                del kept[i]
        if not bool(lead_real.any()) and not joining:
            continue
        width = max([1] + [1 + len(o) for o in joining.values()])
        chunk = torch.full((B, width), lim.pad, dtype=torch.long, device=device)  # [B, L]
        chunk_mask = torch.zeros(B, width, dtype=torch.long, device=device)  # [B, L]
        chunk[:, 0], chunk_mask[:, 0] = torch.where(lead_real, lead, chunk[:, 0]), lead_real.long()
        for i, obs in joining.items():
            chunk[i, : 1 + len(obs)] = torch.tensor([kept.pop(i), *obs], device=device)
            chunk_mask[i, : 1 + len(obs)] = 1
        for j in range(1, width):  # the observation columns (column 0 of a joining row was recorded when drawn)
            real = torch.zeros(B, dtype=torch.bool, device=device)
            for i, obs in joining.items():
                real[i] = j <= len(obs)
            cols.add(
                torch.where(real, chunk[:, j], torch.full_like(chunk[:, j], lim.pad)),
                real,
                torch.zeros_like(real),
                torch.zeros(B, device=device),
            )
        chunk_pos = next_pos[:, None] + chunk_mask.cumsum(dim=1) - 1  # [B, L]
        out = net.feed(chunk, chunk_mask.bool(), chunk_pos.clamp(min=0))  # [B, L, H]
        last = (chunk_mask * torch.arange(width, device=device)).argmax(dim=1)  # [B] each row's last real column
        fed = chunk_mask.any(dim=1)  # [B]
        hidden = torch.where(fed[:, None], out[torch.arange(B, device=device), last], hidden)
        next_pos = next_pos + chunk_mask.sum(dim=1)
        for i in joining:
            rows[i].state = ACT

    return _compact(prompt_ids, prompt_mask, cols, rows, tokenizer, lim.pad)


class _Noise:
    """Each acting row's [V] uniforms for its next token, independent of when it is drawn: a row's first action takes
    its row of one [B, V] draw of the batch generator per decode step (the first actions run in lockstep from the
    prompt, so that is ``sampler.draw``'s noise), a later action's token t of turn k a hash of (row key, k, t)."""

    def __init__(self, generator: torch.Generator, B: int):
        self.generator, self.device = generator, generator.device
        state = hashlib.sha256(generator.get_state().cpu().numpy().tobytes()).hexdigest()  # not a draw: no shift
        base = torch.tensor(derived_seed("episode-noise", state) - 2**62, dtype=torch.int64)
        self.keys = mix64(base + torch.arange(B, dtype=torch.int64) + _GOLDEN).to(self.device)  # [B] int64

    def draw(self, shape: torch.Size, rows: list[_Row], acting: list[bool]) -> torch.Tensor:
        """[B, V] float32 in [0, 1); rows not acting get anything."""
        first = [i for i, r in enumerate(rows) if acting[i] and r.turns == 0]
        later = [i for i, r in enumerate(rows) if acting[i] and r.turns > 0]
        if first:
            noise = torch.rand(shape, generator=self.generator, device=self.device, dtype=torch.float32)
        else:
            noise = torch.zeros(shape, device=self.device, dtype=torch.float32)
        if later:
            index = torch.tensor(later, device=self.device)
            counters = torch.tensor(
                [(rows[i].turns << 32) + len(rows[i].turn_tokens) for i in later], dtype=torch.int64, device=self.device
            )
            state = mix64(self.keys[index] + counters + _GOLDEN)  # [b]
            bits = mix64(state[:, None] + torch.arange(shape[1], device=self.device, dtype=torch.int64) + _GOLDEN)
            noise[index] = ((bits >> 40) & 0xFFFFFF).to(torch.float32) / float(1 << 24)  # [b, V] top 24 bits
        return noise


def _extend_action(r: _Row, token: int, tokenizer, lim: _Limits) -> None:
    """Add a drawn token to row r's action; end the action at EOS, a stop string, or a limit."""
    r.turn_tokens.append(token)
    r.response_tokens += 1
    if token in lim.eos:
        r.state, r.ended_with = WAIT, token
    elif reaches_stop(tokenizer, r.turn_tokens, r.stops):
        r.state, r.ended_with = WAIT, None
    elif len(r.turn_tokens) >= lim.max_new_tokens or r.response_tokens >= r.budget:
        r.state, r.ended_with, r.cut = WAIT, None, True
        r.out_of_room = r.response_tokens >= r.budget


def _apply(r: _Row, i: int, outcome: Any, cols: _Columns, tokenizer, lim: _Limits, name: str) -> list[int]:
    """Row i's step outcome (a ``StepOutput`` or an ``EnvFault``): the reward on the turn's last action token, the
    counters, and the observation tokens to append ([]: the trajectory is over; the row is DONE)."""
    r.turns += 1
    r.turn_tokens = []
    try:
        if isinstance(outcome, EnvFault):
            raise outcome
        result = checked_step(outcome, name, r.task)
        meta = result.get("metadata") or {}
        calls_made = tool_count(meta, "tool_calls", name, r.task)
        errors = tool_count(meta, "tool_errors", name, r.task)
        done = bool(result.get("done", False))
    except (EnvFault, PluginError) as error:  # a tool's failure is the trajectory's, not the run's
        _fault(r, error)
        return []
    _put_reward(cols, i, result["reward"])
    r.tool_calls += calls_made
    r.tool_errors += errors
    if r.cut or r.turns >= lim.max_turns or r.response_tokens >= r.budget:
        r.truncated = r.cut or not done
        r.state = DONE
        return []
    if done:
        r.state = DONE
        return []
    room = r.budget - r.response_tokens  # the observation and at least one more action token must fit
    eos_text = tokenizer.decode([r.ended_with]) if r.ended_with is not None else None
    try:
        text = render_observation(tokenizer, result["observations"], eos_text)
        ids = encode_bounded(tokenizer, text, room)
    except Exception as error:  # observations the template cannot render
        _fault(r, f"{name} (step) on {r.task}: its observations could not be rendered: {describe(error)}")
        return []
    if ids is None or len(ids) >= room:  # no room for the observation and another action
        r.out_of_room = True
        _fault(
            r,
            f"{name} (step) on {r.task}: an observation of {f'over {room}' if ids is None else len(ids)} "
            f"tokens, {room} left",
        )
        return []
    r.response_tokens += len(ids)
    r.observation_tokens += len(ids)
    r.state = ACT
    return ids


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
    if not cols.ids:  # no row acted (every environment failed before the first action): one empty column
        B, device = prompt_ids.shape[0], prompt_ids.device
        nothing = torch.zeros(B, dtype=torch.bool, device=device)
        cols.add(torch.full((B,), pad, device=device), nothing, nothing, torch.zeros(B, device=device))
    names = ("ids", "real", "action", "logprobs", "rewards", "versions")
    fed = {name: torch.stack(getattr(cols, name), 1) for name in names}
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
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.bool(),
        response_ids=out["ids"],
        response_mask=out["real"],
        action_mask=out["action"],
        sampler_logprobs=out["logprobs"],
        cut=torch.tensor([r.cut for r in rows], device=dev),
        texts=texts,
        versions=out["versions"],  # [B, R]: kept only where a row spans versions (below)
        turns=Turns(
            rewards=out["rewards"],
            count=torch.tensor([r.turns for r in rows], device=dev),
            tool_calls=torch.tensor([r.tool_calls for r in rows], device=dev),
            tool_errors=torch.tensor([r.tool_errors for r in rows], device=dev),
            unfinished=torch.tensor([r.truncated for r in rows], device=dev),
            faults=torch.tensor([r.faults for r in rows], device=dev),
            timeouts=torch.tensor([r.timed_out for r in rows], device=dev),
            context_cuts=torch.tensor([r.context_cut and r.out_of_room for r in rows], device=dev),
        ),
    )
    if not bool(rollout.spanning().any()):
        rollout.versions = None
    return rollout


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
