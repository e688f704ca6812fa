"""Multi-turn trajectories on the tiny model: the same draws as the single-turn loop when there is one turn,
observations appended from the KV cache, and at lag 0 a teacher-forced pass that reproduces the sampler's
log-probabilities at every action position."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time

import pytest
import torch

from sao.model.forward import teacher_forced
from sao.model.policy import load_base
from sao.rollout.episodes import draw_episodes
from sao.rollout.sampler import PlainDecoder, draw, encode_prompts
from sao.tasks.gsm8k import build_messages, grading
from sao.tiny import arithmetic as tiny

QUESTIONS = ["What is 3+4?", "Compute 9-2.", "7+8=?", "What is 1+1?", "Compute 5-9.", "2+6=?"]


class OneReply:
    """Graded once, like today's single-turn task."""

    def __init__(self, answer: str):
        self.answer = answer

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        return {"observations": [], "reward": grading.reward(action, self.answer), "done": True, "metadata": {}}

    def close(self):
        pass


class Nudge:
    """Answers every action with a short tool message, ``turns`` times, rewarding each turn 0.1·turn."""

    def __init__(self, turns: int, stop: str | None = None):
        self.turns, self.seen = turns, 0
        self.stop_strings = [stop] if stop else []

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.seen += 1
        done = self.seen >= self.turns
        observations = [] if done else [{"role": "tool", "content": f"try again {self.seen}"}]
        return {
            "observations": observations,
            "reward": 0.1 * self.seen,
            "done": done,
            "metadata": {"tool_calls": 1, "tool_errors": int(self.seen == 2)},
        }

    def close(self):
        pass


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.set_num_threads(1)
    return load_base(tiny_model_dir, torch.device("cpu"))


def _settings(tokenizer, **changes):
    settings = {
        "max_new_tokens": 20,
        "temperature": 1.0,
        "eos_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
    }
    return {**settings, **changes}


def _prompts():
    return [build_messages(q, tiny.TINY_INSTRUCTION) for q in QUESTIONS]


def test_one_turn_draws_exactly_what_the_single_turn_loop_draws(model):
    lm, tokenizer = model
    answers = ["7", "7", "15", "2", "-4", "8"]
    got = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        [OneReply(a) for a in answers],
        _prompts(),
        max_turns=4,
        max_total_tokens=64,
        generator=torch.Generator().manual_seed(3),
        **_settings(tokenizer),
    )
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in _prompts()]
    ids, mask = encode_prompts(tokenizer, texts, torch.device("cpu"))
    want = draw(lm, ids, mask, generator=torch.Generator().manual_seed(3), **_settings(tokenizer))
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
    assert torch.equal(got.sampler_logprobs, want.sampler_logprobs) and torch.equal(got.truncated, want.truncated)
    assert torch.equal(got.action_mask, got.response_mask) and got.turns.count.tolist() == [1] * 6
    pairs = zip(want.response_ids, want.response_mask, strict=True)
    replies = tokenizer.batch_decode([r[m].tolist() for r, m in pairs], skip_special_tokens=True)
    assert got.turns.total.tolist() == [grading.reward(t, a) for t, a in zip(replies, answers, strict=True)]
    last = got.response_mask.sum(dim=1) - 1
    assert torch.equal(got.turns.rewards[torch.arange(6), last], got.turns.total)


# The concurrent loop feeds [kept token | observation] chunks at other columns than the synchronous one: its lag-0
# gap is float32 rounding too (mean 2e-7 either way), with a max measured at 1.8e-5 against 7.6e-6.
@pytest.mark.parametrize(
    "concurrency, rejoin, bound",
    [(0, "turn", 1e-5), (16, "turn", 1e-5), (16, "row", 5e-5)],
    ids=["synchronous", "turn", "row"],
)
def test_observations_continue_from_the_cache_and_lag_zero_matches_at_every_action(model, concurrency, rejoin, bound):
    lm, tokenizer = model
    envs = [Nudge(turns=3) for _ in QUESTIONS]
    settings = _settings(tokenizer, max_new_tokens=32)
    rollout = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        envs,
        _prompts(),
        max_turns=5,
        max_total_tokens=300,
        env_concurrency=concurrency,
        rejoin=rejoin,
        generator=torch.Generator().manual_seed(0),
        **settings,
    )
    actions, real = rollout.action_mask, rollout.response_mask
    assert rollout.turns.count.tolist() == [3] * 6 and rollout.turns.tool_calls.tolist() == [3] * 6
    assert rollout.turns.tool_errors.tolist() == [1] * 6 and not rollout.truncated.any()
    assert (real & ~actions).any(), "observation tokens are in the response"
    assert (rollout.sampler_logprobs[~actions] == 0).all()
    for row, text in zip(range(6), rollout.texts, strict=True):
        assert text.count("try again 1") == 1 and text.count("try again 2") == 1
        rewarded = rollout.turns.rewards[row].nonzero().flatten().tolist()
        assert len(rewarded) == 3 and all(bool(actions[row, j]) for j in rewarded)
        assert all(not bool(actions[row, j + 1]) for j in rewarded[:-1]), "each reward on a turn's last action"
        assert rollout.turns.rewards[row, rewarded].tolist() == pytest.approx([0.1, 0.2, 0.3])
    with torch.no_grad():
        tf = teacher_forced(lm, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, real)
    gap = (tf.logprobs - rollout.sampler_logprobs)[actions].abs()
    assert gap.max() < bound, f"lag-0 |log ratio| max {gap.max():.2e} over {int(actions.sum())} action tokens"


def test_an_adapter_published_between_turns_draws_the_rest_and_every_token_records_its_version(model):
    lm, tokenizer = model
    lm = copy.deepcopy(lm)
    weight = next(p for n, p in lm.named_parameters() if "mlp" in n and p.dim() == 2)
    old, changed = weight.detach().clone(), []
    envs = [Nudge(turns=3) for _ in QUESTIONS]

    def refresh() -> int:  # v0 for the first action, v1 (other weights, set in place) from the second on
        if envs[0].seen >= 1 and not changed:
            with torch.no_grad():
                weight.add_(0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
            changed.append(1)
        return len(changed)

    rollout = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        envs,
        _prompts(),
        max_turns=5,
        max_total_tokens=300,
        generator=torch.Generator().manual_seed(0),
        refresh=refresh,
        **_settings(tokenizer, max_new_tokens=32),
    )
    actions, real = rollout.action_mask, rollout.response_mask
    assert rollout.turns.count.tolist() == [3] * 6 and rollout.versions is not None
    first = actions & ((real & ~actions).long().cumsum(dim=1) == 0)  # [B, R] each row's first action's tokens
    assert (rollout.versions[first] == 0).all() and (rollout.versions[actions & ~first] == 1).all()
    new = weight.detach().clone()
    with torch.no_grad():
        tf_new = teacher_forced(lm, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, real).logprobs
        weight.copy_(old)
        tf_old = teacher_forced(lm, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, real).logprobs
    assert not torch.equal(old, new)
    # each token is its own version's: the later actions were drawn from a cache fed again under the new weights
    # (in one chunk, so float32 rounds differently from column-by-column feeding: max 1.6e-5 measured, mean 4.9e-7)
    assert (tf_old - rollout.sampler_logprobs)[first].abs().max() < 1e-5
    assert (tf_new - rollout.sampler_logprobs)[actions & ~first].abs().max() < 5e-5
    assert (tf_old - rollout.sampler_logprobs)[actions & ~first].abs().max() > 1e-3, "the change moved them"


def test_stop_strings_end_an_action_and_limits_truncate(model):
    lm, tokenizer = model
    stop = Nudge(turns=2, stop="=")  # the tiny model writes "3+4=7": an action ends right after "="
    rollout = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        [stop],
        _prompts()[:1],
        max_turns=4,
        max_total_tokens=200,
        generator=torch.Generator().manual_seed(1),
        **_settings(tokenizer),
    )
    first_turn = tokenizer.decode(rollout.response_ids[0][rollout.action_mask[0]].tolist()[:12])
    assert "=" in first_turn and rollout.turns.count.item() == 2
    turns = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        [Nudge(turns=9)],
        _prompts()[:1],
        max_turns=2,
        max_total_tokens=200,
        generator=torch.Generator().manual_seed(1),
        **_settings(tokenizer),
    )
    assert turns.turns.count.item() == 2 and turns.truncated.item(), "the turn limit ends it as truncated"
    budget = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        [Nudge(turns=9)],
        _prompts()[:1],
        max_turns=9,
        max_total_tokens=30,
        generator=torch.Generator().manual_seed(1),
        **_settings(tokenizer),
    )
    assert budget.truncated.item() and int(budget.response_mask.sum()) <= 30


@pytest.mark.parametrize("capacity", [None, 1], ids=["static-cache", "cache-grows"])
def test_the_engine_draws_the_plain_loops_multi_turn_episodes(tiny_model_dir, monkeypatch, capacity):
    """The graph engine's CPU path runs the same episodes: same tokens, turns, rewards and action spans as the
    plain loop, log-probs within float32 rounding, and lag 0 against teacher forcing at every action token.
    ``cache-grows`` starts the static cache at one column, so every growth copy is exercised."""
    from sao.model.policy import add_lora, lora_state
    from sao.rollout.engine import Engine, EngineStepper

    torch.set_num_threads(1)
    base, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    policy = add_lora(base)
    with torch.no_grad():
        for name, tensor in lora_state(policy).items():
            if "lora_B" in name:  # a trained-looking adapter, so the LoRA path is exercised
                tensor.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    if capacity is not None:
        monkeypatch.setattr(
            Engine, "stepper", lambda self, rows, _: contextlib.nullcontext(EngineStepper(self, rows, capacity))
        )
    limits = {"max_turns": 4, "max_total_tokens": 120, **_settings(tokenizer, max_new_tokens=24)}

    def envs():  # rows end their actions at "=" or EOS, take 2-3 turns, one hits the turn limit
        return [Nudge(turns=2 + i % 2, stop="=" if i % 3 else None) for i in range(len(QUESTIONS) - 1)] + [Nudge(9)]

    plain = draw_episodes(
        PlainDecoder(policy), tokenizer, envs(), _prompts(), generator=torch.Generator().manual_seed(5), **limits
    )
    engine = Engine(policy, adapter="default")
    fast = draw_episodes(engine, tokenizer, envs(), _prompts(), generator=torch.Generator().manual_seed(5), **limits)
    for name in ("response_ids", "response_mask", "action_mask", "truncated", "cut"):
        assert torch.equal(getattr(fast, name), getattr(plain, name)), name
    for name in ("rewards", "count", "tool_calls", "tool_errors", "unfinished"):
        assert torch.equal(getattr(fast.turns, name), getattr(plain.turns, name)), name
    assert fast.texts == plain.texts and fast.turns.count.max() > 2 and fast.truncated.any()
    torch.testing.assert_close(fast.sampler_logprobs, plain.sampler_logprobs, atol=1e-5, rtol=0)
    with torch.no_grad():
        tf = teacher_forced(policy, fast.prompt_ids, fast.prompt_mask, fast.response_ids, fast.response_mask)
    gap = (tf.logprobs - fast.sampler_logprobs)[fast.action_mask].abs()
    assert gap.max() < 1e-5, f"lag-0 |log ratio| max {gap.max():.2e}"


def test_a_trajectory_splits_into_its_action_and_observation_spans(model):
    from sao.rollout.episodes import render_segments, segments

    lm, tokenizer = model
    rollout = draw_episodes(
        PlainDecoder(lm),
        tokenizer,
        [Nudge(turns=2)],
        _prompts()[:1],
        max_turns=3,
        max_total_tokens=200,
        generator=torch.Generator().manual_seed(0),
        **_settings(tokenizer),
    )
    spans = segments(tokenizer, rollout, 0)
    assert [s["kind"] for s in spans] == ["action", "observation", "action"]
    assert "try again 1" in spans[1]["text"] and "<|im_start|>tool" in spans[1]["text"]
    real = rollout.response_ids[0][rollout.response_mask[0]].tolist()
    assert "".join(s["text"] for s in spans) == tokenizer.decode(real, skip_special_tokens=False)
    marked = render_segments(spans)
    assert marked.startswith("[action]") and marked.count("[observation]") == 1 and marked.endswith("[/action]")


# --- environments that do not hold the batch -------------------------------------------------------------------


class Sleepy(Nudge):
    """Nudge whose step sleeps ``sleeps[turn]`` seconds first (deterministic answers, variable timing)."""

    def __init__(self, turns: int, sleeps: list[float]):
        super().__init__(turns)
        self.sleeps = sleeps

    def step(self, action):
        time.sleep(self.sleeps[min(self.seen, len(self.sleeps) - 1)])
        return super().step(action)


class AsyncNudge:
    """Nudge with ``async def`` methods, awaiting a sleep before it answers."""

    def __init__(self, turns: int, sleep: float = 0.0):
        self.inner, self.sleep = Nudge(turns), sleep

    async def init(self, prompt):
        await asyncio.sleep(0)
        return prompt, {}

    async def step(self, action):
        await asyncio.sleep(self.sleep)
        return self.inner.step(action)

    async def close(self):
        await asyncio.sleep(0)


def _episodes(lm, tokenizer, envs, **changes):
    limits = {"max_turns": 4, "max_total_tokens": 200, **_settings(tokenizer, max_new_tokens=24), **changes}
    n = len(envs)
    return draw_episodes(
        PlainDecoder(lm), tokenizer, envs, _prompts()[:n], generator=torch.Generator().manual_seed(2), **limits
    )


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def test_concurrent_steps_take_about_the_slowest_rows_time_not_the_sum_of_each_turns_slowest(model):
    """Row i sleeps 0.3 s on turn i mod 3 only: each row's own tool time is 0.3 s, each turn's slowest call 0.3 s
    (0.9 s summed over 3 turns), and called one after another 0.6 s a turn. The concurrent loop must finish within
    a no-sleep draw + 0.3 s + a generous margin with ``rejoin="row"``, and about the 0.9 s of each turn's slowest
    call with ``rejoin="turn"``; the synchronous one takes at least the serial 1.8 s."""
    lm, tokenizer = model

    def envs(nap: float):
        return [Sleepy(3, [nap if t == i % 3 else 0.0 for t in range(3)]) for i in range(6)]

    _, t_instant = _timed(lambda: _episodes(lm, tokenizer, envs(0.0)))
    concurrent, t_concurrent = _timed(lambda: _episodes(lm, tokenizer, envs(0.3), rejoin="row"))
    by_turn, t_turn = _timed(lambda: _episodes(lm, tokenizer, envs(0.3)))
    synchronous, t_sync = _timed(lambda: _episodes(lm, tokenizer, envs(0.3), env_concurrency=0))
    assert 0.9 <= t_turn < t_sync - 0.6, (t_turn, t_sync)  # each turn waits for its slowest call: 3 × 0.3 s at least
    assert torch.equal(by_turn.response_ids, synchronous.response_ids), "turn: the synchronous loop's draws"
    assert torch.equal(by_turn.sampler_logprobs, synchronous.sampler_logprobs), "bit for bit"
    assert concurrent.turns.count.tolist() == [3] * 6 and synchronous.turns.count.tolist() == [3] * 6
    assert t_sync >= 1.8, f"the synchronous loop calls the steps one after another: {t_sync:.2f} s"
    assert t_concurrent < t_instant + 0.3 + 0.45, f"{t_concurrent:.2f} s against {t_instant:.2f} s without sleeps"
    assert t_concurrent < t_sync - 0.9


def test_the_same_seed_draws_the_same_trajectories_whichever_tool_finishes_first(model):
    """Deterministic tools, three schedules: rows finishing in order, in reverse order, and one call at a time;
    the tokens, masks, rewards and turns are the same (log-probs to float32 rounding of the batch's layout)."""
    lm, tokenizer = model
    runs = [
        _episodes(lm, tokenizer, [Sleepy(3, [0.03 * i]) for i in range(6)], rejoin="row"),
        _episodes(lm, tokenizer, [Sleepy(3, [0.03 * (5 - i)]) for i in range(6)], rejoin="row"),
        _episodes(lm, tokenizer, [Sleepy(3, [0.01]) for _ in range(6)], env_concurrency=1, rejoin="row"),
    ]
    by_turn = [
        _episodes(lm, tokenizer, [Sleepy(3, [0.03 * i]) for i in range(6)]),
        _episodes(lm, tokenizer, [Sleepy(3, [0.03 * (5 - i)]) for i in range(6)]),
    ]
    assert torch.equal(by_turn[0].response_ids, by_turn[1].response_ids)
    assert torch.equal(by_turn[0].sampler_logprobs, by_turn[1].sampler_logprobs), "turn: bit for bit, any order"
    first = runs[0]
    assert first.turns.count.max() > 1
    for other in runs[1:]:
        for name in ("response_ids", "response_mask", "action_mask", "truncated"):
            assert torch.equal(getattr(other, name), getattr(first, name)), name
        assert torch.equal(other.turns.rewards, first.turns.rewards) and other.texts == first.texts
        torch.testing.assert_close(other.sampler_logprobs, first.sampler_logprobs, atol=1e-4, rtol=0)


def test_an_async_environment_class_is_accepted_as_it_is(model):
    """``async def init/step/close`` run on sao's event loop: the same trajectories as the plain class."""
    lm, tokenizer = model
    plain = _episodes(lm, tokenizer, [Nudge(3) for _ in range(4)])
    awaited = _episodes(lm, tokenizer, [AsyncNudge(3, sleep=0.05) for _ in range(4)], close=True)
    assert torch.equal(awaited.response_ids, plain.response_ids) and awaited.texts == plain.texts
    assert awaited.turns.count.tolist() == plain.turns.count.tolist() and not awaited.turns.faults.any()


def test_an_environment_mixing_plain_and_async_methods_wrongly_is_refused_in_one_line(model):
    from sao.core.errors import ConfigError
    from sao.rollout.environment import check_env

    class Mixed(Nudge):
        async def init(self, prompt):
            return prompt, {}

    class Yields(Nudge):
        async def step(self, action):
            yield {}

    lm, tokenizer = model
    for kind, words in ((Mixed, "init is async def but step is not"), (Yields, "step is an async generator")):
        with pytest.raises(ConfigError, match=words) as caught:
            _episodes(lm, tokenizer, [kind(2)])
        assert "\n" not in str(caught.value) and kind.__qualname__ in str(caught.value)
    assert check_env(AsyncNudge) is True and check_env(Nudge(1)) is False


class Raises(Nudge):
    def step(self, action):
        raise ConnectionError("the tool's server went away\nwith a traceback")


class Hangs(Nudge):
    def step(self, action):
        time.sleep(30)


class Floods(Nudge):
    def step(self, action):
        return {"observations": [{"role": "tool", "content": "9" * 2_000_000}], "reward": 0.0, "done": False}


class NotADict(Nudge):
    def step(self, action):
        return "ok"


@pytest.mark.parametrize(
    "concurrency, rejoin", [(0, "turn"), (16, "turn"), (16, "row")], ids=["synchronous", "turn", "row"]
)
def test_a_tool_that_raises_hangs_or_floods_ends_its_trajectory_counted_and_the_batch_goes_on(
    model, concurrency, rejoin
):
    lm, tokenizer = model
    envs = [Raises(3), Hangs(3), Floods(3), NotADict(3), Nudge(2), Nudge(2)]
    rollout, seconds = _timed(
        lambda: _episodes(lm, tokenizer, envs, env_timeout=0.5, env_concurrency=concurrency, rejoin=rejoin)
    )
    assert rollout.turns.faults.tolist() == [1, 1, 1, 1, 0, 0]
    assert rollout.truncated.tolist() == [True] * 4 + [False] * 2
    assert rollout.turns.count.tolist() == [1, 1, 1, 1, 2, 2], "the batch went on past the faults"
    assert rollout.turns.total[:4].tolist() == [0.0] * 4 and int(rollout.response_mask[2].sum()) <= 200
    assert seconds < 15, f"a hung tool held the draw for {seconds:.1f} s"


def test_a_hung_plain_step_is_let_go_and_its_worker_replaced():
    """No model: ``EnvCalls`` with one worker; a call past the deadline is an ``EnvFault`` and the next call still
    runs (on a fresh thread), so hung tools cannot starve the pool."""
    from sao.rollout.environment import EnvCalls, EnvFault

    calls = EnvCalls(workers=1, timeout=0.2)
    calls.submit(0, time.sleep, 30)
    ((key, outcome),) = calls.collect(block=True)
    assert key == 0 and isinstance(outcome, EnvFault) and "did not return within 0.2 s" in str(outcome)
    assert calls.call(lambda: "answered") == "answered"
    calls.close()
