"""sao inside TRL (``sao.integrations.trl``), run in the main venv (TRL 1.16 fits it): ``SAOTrainer`` trains 2 steps
on the tiny preset's model at one rollout per prompt with no vLLM; its loss and gradient equal ``SAO.update`` on a
batch whose sampler log-probs are injected so that the band binds; the canary fails loudly when TRL moves the hooks
the trainer overrides; bad arguments are refused by name. Skipped where TRL is absent."""

from __future__ import annotations

import inspect
import logging
import math

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from sao.algorithm.update import SAO
from sao.core.errors import ConfigError
from sao.integrations import shared
from sao.integrations import trl as adapter
from sao.integrations.trl import SAOConfig, SAOTrainer


def reward(completions, answer, **kwargs):
    """1 when the gold answer appears in the completion (the tiny task's answers are short numbers)."""
    return [float(a in c) for c, a in zip(completions, answer, strict=True)]


def dataset(n: int = 16) -> Dataset:
    from sao.tiny import arithmetic as tiny

    split = tiny.make_split(n, 4, 0)
    return Dataset.from_list([{"prompt": task.question, "answer": task.answer} for task in split.train])


def config(tmp_path, **changes) -> SAOConfig:
    settings = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "max_completion_length": 12,
        "max_steps": 2,
        "critic_warmup": 1,
        "logging_steps": 1,
        "report_to": [],
        "bf16": False,
        "use_cpu": True,
        "gradient_checkpointing": False,
        "seed": 0,
        "save_strategy": "no",
        **changes,
    }
    return SAOConfig(**settings)


def test_sao_trainer_trains_two_steps_on_the_tiny_preset_at_one_rollout_per_prompt(tiny_model_dir, tmp_path):
    """With the user's reward function, dataset and LoRA config as TRL takes them, and TRL's default gradient
    checkpointing."""
    from peft import LoraConfig

    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    args = config(tmp_path, gradient_checkpointing=True)
    trainer = SAOTrainer(
        model=str(tiny_model_dir), reward_funcs=reward, args=args, train_dataset=dataset(), peft_config=lora
    )
    assert trainer.num_generations == 1 and trainer.args.generation_batch_size == 8
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    head_before = trainer.value_head.linear.bias.detach().clone()
    result = trainer.train()
    assert result.global_step == 2
    logs = [r for r in trainer.state.log_history if "sao/tokens" in r]
    assert [r["sao/critic_warmup"] for r in logs] == [1.0, 0.0]  # step 1 trains the critic alone
    assert all(r["sao/trajectories"] == 8 and r["sao/ratio_mean"] == pytest.approx(1.0, abs=1e-5) for r in logs)
    assert all(math.isfinite(r["sao/critic_loss"]) and math.isfinite(r["sao/explained_variance"]) for r in logs)
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved, "the policy step changed no parameter"
    assert not torch.equal(trainer.value_head.linear.bias, head_before), "the critic never trained"
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / adapter.VALUE_HEAD_FILE).is_file()


def test_the_loss_equals_sao_update_on_a_batch_with_injected_sampler_logprobs(tiny_model_dir, tmp_path):
    """The batch TRL's own generation hook makes, with sampler log-probs moved so that the band (0.7, 6.0) masks
    tokens on both sides: ``_compute_loss`` gives ``SAO.update``'s loss and gradient from sao's own pass."""
    from sao.model.forward import teacher_forced

    trainer = SAOTrainer(
        model=str(tiny_model_dir), reward_funcs=reward, args=config(tmp_path, critic_warmup=0), train_dataset=dataset()
    )
    trainer.model.train()
    rows = [dict(row) for row in dataset(8)]
    inputs = trainer._generate_and_score_completions(rows)
    mask = inputs["completion_mask"].bool()
    g = torch.Generator().manual_seed(0)
    shift = torch.randn(mask.shape, generator=g) * 0.6  # log-ratio noise: |shift| > 0.36 leaves the band below
    inputs["sampler_logprobs"] = torch.where(mask, inputs["sampler_logprobs"] + shift, inputs["sampler_logprobs"])
    inputs["sao_rewards"] = torch.arange(8, dtype=torch.float32) / 8  # rewards that differ, so advantages do

    forward = teacher_forced(
        trainer.model,
        inputs["prompt_ids"],
        inputs["prompt_mask"],
        inputs["completion_ids"],
        inputs["completion_mask"],
        temperature=trainer.temperature,
    )
    with torch.no_grad():
        values = trainer.value_head(forward.hidden)
    batch = {
        "logprobs": forward.logprobs.detach(),
        "sampler_logprobs": inputs["sampler_logprobs"],
        "values": values,
        "rewards": inputs["sao_rewards"],
        "action_mask": mask,
    }
    update = SAO(ratio=(0.7, 6.0)).update(batch, normalizer=float(inputs["num_items_in_batch"]))
    assert bool((mask & ~update.mask).any()), "the band must bind on this batch"
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    expected = update.policy_loss(forward.logprobs)
    expected_grads = torch.autograd.grad(expected, params)

    loss = trainer._compute_loss(trainer.model, inputs)
    grads = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    logged = trainer._metrics["train"]
    assert logged["sao/masked_share"][-1] == pytest.approx(update.stats["masked_share"])


# ---------------------------------------------------------------------------------------------------------
# The canary and the refusals.


def test_the_hooks_sao_trainer_overrides_are_where_it_expects_them():
    """Fails loudly when a TRL release renames or re-signs a hook (then pin TRL or port SAOTrainer)."""
    for name, expected in adapter.HOOKS.items():
        assert name in GRPOTrainer.__dict__, f"GRPOTrainer no longer defines {name}"
        assert tuple(inspect.signature(getattr(GRPOTrainer, name)).parameters) == expected, name
        assert name in SAOTrainer.__dict__
    adapter.check_hooks()

    class Moved(GRPOTrainer):
        def _compute_loss(self, model, inputs, extra):
            raise AssertionError

    with pytest.raises(ConfigError, match="_compute_loss takes") as refused:
        adapter.check_hooks(Moved)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_generations": 4}, "num_generations must be 1"),
        ({"top_p": 0.9}, "top_p=0.9"),
        ({"top_k": 20}, "top_k=20"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"generation_kwargs": {"top_p": 0.5}}, "top_p=0.5"),
        ({"ratio": (1.2, 3.0)}, "ratio"),
        ({"correction": "random"}, "random"),
        ({"correction": "nope"}, "correction"),
        ({"per_device_train_batch_size": 1}, "at least 2"),
    ],
)
def test_bad_settings_are_refused_naming_the_argument(tmp_path, changes, needle):
    with pytest.raises(ConfigError, match=needle) as refused:
        config(tmp_path, **changes)
    assert "\n" not in str(refused.value)


def test_a_grpo_config_and_an_infinite_reward_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="SAOConfig"):
        SAOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=reward,
            args=GRPOConfig(str(tmp_path / "g"), report_to=[], bf16=False, use_cpu=True),
        )

    def infinite(completions, **kwargs):
        return [math.inf] * len(completions)

    trainer = SAOTrainer(
        model=str(tiny_model_dir), reward_funcs=infinite, args=config(tmp_path), train_dataset=dataset()
    )
    with pytest.raises(ConfigError, match="infinite reward"):
        trainer._generate_and_score_completions([dict(row) for row in dataset(8)])


def test_a_trl_outside_the_tested_range_is_used_after_one_warning_naming_the_range(caplog):
    with caplog.at_level(logging.WARNING, logger="sao.integrations"):
        assert shared.check_version("trl", "1.16.0", adapter.TESTED)
        assert not shared.check_version("trl", "1.17.0", adapter.TESTED)
    [record] = caplog.records
    assert "trl >=1.16,<1.17" in record.getMessage()
