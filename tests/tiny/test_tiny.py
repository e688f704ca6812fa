"""The embedded default: the tokenizer survives save/load, the task is graded right, the warm start lands
between 0 and 1."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sao.core.errors import DataError
from sao.model.policy import load_base
from sao.tasks.gsm8k import grading
from sao.tiny import arithmetic as tiny


def test_tokenizer_round_trips_through_save_and_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    built = tiny.build_tokenizer()
    built.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\nCompute 7-9.\n\nEnd with #### N.<|im_end|>\n<|im_start|>assistant\n7-9=-2\n#### -2 é"
    a = built(text, add_special_tokens=False)["input_ids"]
    b = loaded(text, add_special_tokens=False)["input_ids"]
    assert a == b and loaded.decode(b) == text
    assert loaded.convert_ids_to_tokens(b[0]) == "<|im_start|>"
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"


def test_task_answers_are_right_and_graded_by_sao_grading():
    tasks = tiny.all_questions()
    assert len(tasks) == 600 and len({t.question for t in tasks}) == 600
    for t in tasks[::37]:
        expr = t.question.removeprefix("What is ").removeprefix("Compute ").rstrip("?.").removesuffix("=")
        a, op, b = int(expr[0]), expr[1], int(expr[2])
        assert int(t.answer) == (a + b if op == "+" else a - b)
        assert grading.math_equal(f"{expr}={t.answer}\n#### {t.answer}", t.answer)


def _problem(question: str) -> tuple[int, str, int]:
    """(a, op, b) read back from a question's text, whatever its phrasing."""
    a, op, b = re.search(r"(\d+)([+-])(\d+)", question).groups()
    return int(a), op, int(b)


@pytest.mark.parametrize("seed", [0, 1, 17])
def test_held_out_problems_are_disjoint_from_training_problems_not_only_as_strings(seed):
    split = tiny.make_split(480, 120, seed=seed)
    train, test = {_problem(t.question) for t in split.train}, {_problem(t.question) for t in split.test}
    assert len(test) == 40 and not train & test, "no held-out (a, op, b) is trained on in another phrasing"
    small = tiny.make_split(8, 4, seed=seed)  # a held-out problem's other phrasings are counted, not trained
    assert not {_problem(t.question) for t in small.train} & {_problem(t.question) for t in small.test}
    c = small.counts
    assert c["train_contaminated"] == c["train_pool"] - c["train_kept"] > 0
    assert split.source == f"generated:tiny-arithmetic/split-v{tiny.SPLIT_VERSION}"
    with pytest.raises(DataError):
        tiny.make_split(481, 120)


def test_split_is_disjoint_seeded_and_counted():
    split = tiny.make_split(480, 120, seed=0)
    assert not {t.question for t in split.train} & {t.question for t in split.test}
    assert split.counts["train"] == 480 and split.counts["test"] == 120
    assert [t.id for t in tiny.make_split(480, 120, seed=0).test] == [t.id for t in split.test]
    assert [t.id for t in tiny.make_split(480, 120, seed=1).test] != [t.id for t in split.test]


def test_tutor_is_right_about_as_often_as_configured():
    import random

    rng = random.Random(0)
    tasks = tiny.all_questions()
    right = sum(grading.math_equal(tiny.tutor_reply(t, rng, 0.5), t.answer) for t in tasks * 5)
    assert 0.45 < right / (len(tasks) * 5) < 0.55


def test_warm_start_is_cached_and_lands_strictly_between_zero_and_one(tiny_model_dir):
    record = json.loads((tiny_model_dir / "warmstart.json").read_text())
    assert 0.15 < record["sampled_accuracy"] < 0.6
    assert tiny.ensure_model(progress=False) == tiny_model_dir  # a second call reuses the cache
    model, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    again = tiny.sampled_accuracy(model, tokenizer, tiny.all_questions(), seed=0)
    assert again == record["sampled_accuracy"], "the saved model is the one that was measured"
