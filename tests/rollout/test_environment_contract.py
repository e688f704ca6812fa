"""What an environment's step answers is held to the contract: ``done`` is true or false, never a string read by its
truthiness (``"false"`` would end every episode after its first turn, silently)."""

from __future__ import annotations

import logging

import pytest
import torch

from sao.core.plugins import PluginError
from sao.rollout.environment import checked_step
from sao.rollout.episodes import draw_episodes
from sao.rollout.sampler import PlainDecoder


class TwoTurns:
    """Asks for a second action after the first (its ``done`` as given), ends after the second."""

    def __init__(self, done):
        self.done, self.turns = done, 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return {"observations": [{"role": "user", "content": "again"}], "reward": 0.0, "done": self.done}
        return {"observations": [], "reward": 1.0, "done": True}

    def close(self):
        pass


@pytest.mark.parametrize("done", ["false", "False", "", 0, None, "true"])
def test_done_must_be_true_or_false(done, faults):
    with pytest.raises(PluginError) as caught:
        checked_step({"observations": [], "reward": 0.0, "done": done}, "environment mine:Env", "task/3")
    message = str(caught.value)
    assert message.startswith("environment mine:Env (step) on task/3: done must be true or false, got ")
    if done in ("false", "False", ""):  # strings read as done (or not) by their truthiness before
        faults.record("failing environments", f"done given as the string {done!r}")


def test_a_done_of_the_string_false_is_that_trajectorys_fault(tiny_model_dir, caplog):
    from sao.model.policy import load_base

    lm, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    prompts = [[{"role": "user", "content": "What is 1+1?"}]] * 2
    with caplog.at_level(logging.WARNING, logger="sao.rollout"):
        rollout = draw_episodes(
            PlainDecoder(lm),
            tokenizer,
            [TwoTurns(False), TwoTurns("false")],
            prompts,
            max_new_tokens=6,
            max_turns=4,
            max_total_tokens=200,
            temperature=1.0,
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(0),
            name="environment mine:TwoTurns",
            tasks=["task/0", "task/1"],
        )
    assert rollout.turns.faults.tolist() == [0, 1], "'false' is not read as done: that trajectory's fault"
    assert bool(rollout.truncated[1]) and int(rollout.turns.count[1]) == 1
    told = [r.getMessage() for r in caplog.records if r.name == "sao.rollout"]
    assert len(told) == 1 and "task/1: done must be true or false, got 'false'" in told[0], told
