"""Multi-turn trajectories on the tiny model: the same draws as the single-turn loop when there is one turn,
observations appended from the KV cache, and at lag 0 a teacher-forced pass that reproduces the sampler's
log-probabilities at every action position."""

from __future__ import annotations

import contextlib

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
        return {"observations": observations, "reward": 0.1 * self.seen, "done": done,
                "metadata": {"tool_calls": 1, "tool_errors": int(self.seen == 2)}}  # fmt: skip

    def close(self):
        pass


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.set_num_threads(1)
    return load_base(tiny_model_dir, torch.device("cpu"))


def _settings(tokenizer, **changes):
    settings = {"max_new_tokens": 20, "temperature": 1.0, "eos_token_ids": [tokenizer.eos_token_id],
                "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    return {**settings, **changes}


def _prompts():
    return [build_messages(q, tiny.TINY_INSTRUCTION) for q in QUESTIONS]


def test_one_turn_draws_exactly_what_the_single_turn_loop_draws(model):
    lm, tokenizer = model
    answers = ["7", "7", "15", "2", "-4", "8"]
    got = draw_episodes(PlainDecoder(lm), tokenizer,
                  [OneReply(a) for a in answers], _prompts(), max_turns=4, max_total_tokens=64,
                        generator=torch.Generator().manual_seed(3), **_settings(tokenizer))  # fmt: skip
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
@pytest.mark.parametrize("concurrency, bound", [(0, 1e-5), (16, 5e-5)], ids=["synchronous", "concurrent"])
def test_observations_continue_from_the_cache_and_lag_zero_matches_at_every_action(model, concurrency, bound):
    lm, tokenizer = model
    envs = [Nudge(turns=3) for _ in QUESTIONS]
    settings = _settings(tokenizer, max_new_tokens=32)
    rollout = draw_episodes(PlainDecoder(lm), tokenizer,
                  envs, _prompts(), max_turns=5, max_total_tokens=300, env_concurrency=concurrency,
                            generator=torch.Generator().manual_seed(0), **settings)  # fmt: skip
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


def test_stop_strings_end_an_action_and_limits_truncate(model):
    lm, tokenizer = model
    stop = Nudge(turns=2, stop="=")  # the tiny model writes "3+4=7": an action ends right after "="
    rollout = draw_episodes(PlainDecoder(lm), tokenizer,
                  [stop], _prompts()[:1], max_turns=4, max_total_tokens=200,
                            generator=torch.Generator().manual_seed(1), **_settings(tokenizer))  # fmt: skip
    first_turn = tokenizer.decode(rollout.response_ids[0][rollout.action_mask[0]].tolist()[:12])
    assert "=" in first_turn and rollout.turns.count.item() == 2
    turns = draw_episodes(PlainDecoder(lm), tokenizer,
                  [Nudge(turns=9)], _prompts()[:1], max_turns=2, max_total_tokens=200,
                          generator=torch.Generator().manual_seed(1), **_settings(tokenizer))  # fmt: skip
    assert turns.turns.count.item() == 2 and turns.truncated.item(), "the turn limit ends it as truncated"
    budget = draw_episodes(PlainDecoder(lm), tokenizer,
                  [Nudge(turns=9)], _prompts()[:1], max_turns=9, max_total_tokens=30,
                           generator=torch.Generator().manual_seed(1), **_settings(tokenizer))  # fmt: skip
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
    rollout = draw_episodes(PlainDecoder(lm), tokenizer,
                  [Nudge(turns=2)], _prompts()[:1], max_turns=3, max_total_tokens=200,
                            generator=torch.Generator().manual_seed(0), **_settings(tokenizer))  # fmt: skip
    spans = segments(tokenizer, rollout, 0)
    assert [s["kind"] for s in spans] == ["action", "observation", "action"]
    assert "try again 1" in spans[1]["text"] and "<|im_start|>tool" in spans[1]["text"]
    real = rollout.response_ids[0][rollout.response_mask[0]].tolist()
    assert "".join(s["text"] for s in spans) == tokenizer.decode(real, skip_special_tokens=False)
    marked = render_segments(spans)
    assert marked.startswith("[action]") and marked.count("[observation]") == 1 and marked.endswith("[/action]")
