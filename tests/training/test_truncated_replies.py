"""A reply cut off at the token limit scores 0 by default (``truncated_reward`` "zero"), in the trainer's reward and
in the eval, and is counted on its own; "grade" scores it as the grader does (the old behaviour)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.experiment.evaluate import EvalResult, evaluate
from sao.model.policy import eos_ids, load_base
from sao.rollout.sources import make_decoder
from sao.tasks import gsm8k
from sao.tasks.base import Scorer, Task
from sao.tiny import arithmetic as tiny

TASKS = {"a": Task("a", "What is 3+4?", "7"), "b": Task("b", "What is 2+2?", "4")}


def _rewards(rule: str) -> tuple[torch.Tensor, dict[str, int]]:
    """The scorer's training rewards on four replies, two cut off (one of them holding the right number)."""
    rollout = SimpleNamespace(
        turns=None,
        texts=["3+4=7\n#### 7", "3+4=7", "3+4=8\n#### 8", "2+2=5"],
        cut=torch.tensor([False, True, False, True]),
        action_mask=torch.ones(4, 3, dtype=torch.bool),
    )
    scorer = Scorer(lambda text, row: float(text.rstrip().endswith(row["answer"])), truncated_reward=rule)
    return scorer.rewards(rollout, [TASKS[i].row() for i in ["a", "a", "a", "b"]])


def test_the_trainer_scores_a_cut_off_reply_zero_by_default_and_counts_it():
    zero, counted = _rewards("zero")
    assert zero.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert counted == {"truncated_replies": 2, "truncated_with_credit": 1, "reward_timeouts": 0}
    graded, counted_too = _rewards("grade")
    assert graded.tolist() == [1.0, 1.0, 0.0, 0.0], "grade: the cut-off '3+4=7' is credited as before"
    assert counted_too == counted
    assert Config().data.truncated_reward == "zero" and "not the page's" in Config.help("truncated_reward")
    with pytest.raises(ConfigError, match="truncated-reward"):
        Config(truncated_reward="half")


def test_old_eval_files_read_back_as_graded():
    old = {
        "label": "x",
        "pass_at_1": 0.5,
        "per_task": [0.5],
        "task_ids": ["t"],
        "samples": 2,
        "temperature": 0.7,
        "seed": 0,
        "mean_reply_chars": 3.0,
        "mean_reply_tokens": 3.0,
        "truncation_share": 0.0,
        "seconds": 1.0,
        "examples": [],
    }
    result = EvalResult.from_dict(old)
    assert result.truncated_reward == "grade" and result.truncated_replies == 0


def test_the_eval_scores_cut_off_replies_zero_and_counts_those_the_grader_would_credit(tiny_model_dir):
    model, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    tasks = tiny.make_split(8, 12).test
    decoder = make_decoder(model, None, "plain")

    def run(rule: str, max_new_tokens: int) -> EvalResult:
        return evaluate(
            decoder,
            tokenizer,
            tasks,
            instruction=tiny.TINY_INSTRUCTION,
            samples=2,
            temperature=0.7,
            max_new_tokens=max_new_tokens,
            seed=5,
            eos_token_ids=eos_ids(tokenizer, model),
            scorer=Scorer(gsm8k.reward, truncated_reward=rule),
        )

    # 6 tokens cut "7+5=12\n#### 12" after "7+5=12": every reply is cut off, some right after the answer
    zero, graded = run("zero", 6), run("grade", 6)
    n = len(tasks) * 2
    assert zero.truncated_replies == graded.truncated_replies == n and zero.truncation_share == 1.0
    assert zero.pass_at_1 == 0.0 and zero.truncated_reward == "zero"
    assert graded.truncated_with_credit == zero.truncated_with_credit == round(graded.pass_at_1 * n) > 0
    full = run("zero", 20)  # the preset's limit: these replies all finish, and the rule changes nothing
    assert full.truncated_replies == round(full.truncation_share * n) == 0
    assert full.pass_at_1 == run("grade", 20).pass_at_1
