"""The paper's regime as settings: --finetune, --critic, --critic-model and --shard take their documented values, the
paper preset is the paper's numbers, and every combination sao does not offer is refused in one line naming the
flags, before anything is loaded."""

from __future__ import annotations

import pytest

from sao.core.config import Config
from sao.core.errors import ConfigError


def test_the_recipe_stays_the_default_and_the_paper_preset_is_the_papers_regime():
    default = Config()
    assert (default.model.finetune, default.model.critic, default.model.critic_model, default.training.shard) == (
        "lora",
        "head",
        None,
        "none",
    )
    paper = Config.load("paper")
    assert (paper.model.finetune, paper.model.critic, paper.training.lr, paper.training.critic_lr) == (
        "full",
        "model",
        1e-6,
        5e-6,
    )
    assert Config.load("paper", lr=1e-5).training.lr == 1e-5  # a flag still wins over the preset


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"finetune": "partial"}, "finetune"),
        ({"critic": "ensemble"}, "critic"),
        ({"shard": "zero3"}, "shard"),
        ({"critic_model": "some/model"}, "--critic-model names the value model's base: it needs --critic model"),
        ({"finetune": "full", "kl_coef": 0.1}, "--kl-coef with --finetune full"),
        ({"finetune": "full", "rollout": "ray"}, "--finetune full with --rollout ray"),
        ({"finetune": "full", "rollout": "vllm-async"}, "--finetune full with --rollout vllm-async"),
        ({"finetune": "full", "sampler_dtype": "bfloat16"}, "--sampler-dtype with --finetune full"),
        ({"finetune": "full", "gate": "held-out", "gate_margin": 0.5, "gate_alpha": 0.4}, "--gate held-out compares"),
        ({"shard": "fsdp", "decoder": "graph"}, "--decoder graph with --shard fsdp"),
        ({"shard": "fsdp", "sampler_dtype": "bfloat16"}, "--sampler-dtype with --shard fsdp"),
        ({"shard": "fsdp", "gate": "held-out", "gate_margin": 0.5, "gate_alpha": 0.4}, "--gate held-out with --shard"),
    ],
)
def test_a_combination_not_offered_is_one_line_naming_the_flags(settings, words):
    with pytest.raises(ConfigError) as caught:
        Config(**settings)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_the_cli_refuses_them_in_one_line_and_writes_nothing(tmp_path, capsys):
    from sao import cli

    out = tmp_path / "run"
    code = cli.main(["train", "--preset", "tiny", "--finetune", "full", "--kl-coef", "0.1", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--kl-coef with --finetune full" in err
    assert not out.exists()
