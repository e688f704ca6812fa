"""What a user meets in the first hour: ``sao eval`` spells the samples flag as train, recipe and the settings page do
(``--eval-samples``; ``--samples`` still works, said in one line), and ``sao.evaluate`` takes the arguments
``sao.train`` took (the run's folder: its adapter is evaluated), the adapter folder itself a keyword."""

from __future__ import annotations

import inspect

import pytest
import torch

import sao
from sao.cli import main

EVAL = ["eval", "--preset", "tiny", "--train-prompts", "8", "--test-prompts", "2", "--quiet"]


def test_sao_eval_takes_eval_samples_and_the_old_spelling_with_a_notice(capsys, faults, tiny_model_dir):
    assert main([*EVAL, "--eval-samples", "1"]) == 0
    captured = capsys.readouterr()
    assert "x 1 samples" in captured.out and captured.err == "", captured
    assert main([*EVAL, "--samples", "1"]) == 0
    captured = capsys.readouterr()
    assert "x 1 samples" in captured.out
    assert captured.err.strip().splitlines() == [
        "notice: --samples is now --eval-samples (same values); --samples still works"
    ]
    assert main([*EVAL, "--samples", "1", "--eval-samples", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "sao eval: error: --samples and --eval-samples set the same setting; give one (--eval-samples)"
    ]
    faults.record("first hour", "sao eval --eval-samples, and --samples as before with a notice")


def test_sao_evaluate_takes_the_arguments_sao_train_took(faults):
    train, evaluate = inspect.signature(sao.train).parameters, inspect.signature(sao.evaluate).parameters
    assert list(evaluate)[:2] == list(train)[:2] == ["config", "out_dir"]
    for name in ("dataset", "reward_fn", "env_factory", "progress"):
        assert evaluate[name].kind == train[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    assert evaluate["adapter"].kind == inspect.Parameter.KEYWORD_ONLY
    faults.record("first hour", "sao.evaluate's signature against sao.train's")


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory):
    """A folder as sao.train leaves it, as far as evaluation reads it: adapter/ with a non-trivial adapter."""
    from sao.model.artifacts import save_adapter
    from sao.model.policy import ValueHead, add_lora, load_base, lora_state

    base, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    policy = add_lora(base)
    with torch.no_grad():
        for name, param in lora_state(policy).items():
            if "lora_B" in name:
                param.fill_(0.05)
    run = tmp_path_factory.mktemp("evaluate") / "run"
    save_adapter(policy, tokenizer, ValueHead(base.config.hidden_size), run / "adapter", base_model=str(tiny_model_dir))
    return run


def test_sao_evaluate_of_a_run_folder_evaluates_its_adapter(run_dir, faults):
    settings = {"preset": "tiny", "train_prompts": 8, "test_prompts": 3, "eval_samples": 2}
    rows = {
        "train": [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(8)],
        "test": [{"prompt": f"What is {i}+2?", "answer": str(i + 2)} for i in range(3)],
    }
    by_run = sao.evaluate(settings, run_dir, dataset=rows, progress=False)
    by_adapter = sao.evaluate(settings, adapter=run_dir / "adapter", dataset=rows, progress=False)
    base = sao.evaluate(settings, dataset=rows, progress=False)
    assert by_run.label == by_adapter.label == "adapter" and base.label == "base"
    assert by_run.per_task == by_adapter.per_task and by_run.examples == by_adapter.examples
    with pytest.raises(TypeError, match=r"give out_dir .* or adapter .*, not both"):
        sao.evaluate(settings, run_dir, adapter=run_dir / "adapter", dataset=rows)
    faults.record("first hour", "sao.evaluate(config, out_dir) with the run sao.train wrote")
