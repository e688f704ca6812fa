"""bench/memory_plan.py counts a model's parameters from its config as transformers builds it (checked on the meta
device: no weights) and docs/scale-out.md's memory table is the program's output as printed."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scale-out.md"
START, END = "<!-- memory-plan:start -->\n", "<!-- memory-plan:end -->"


@pytest.fixture(scope="module")
def memory_plan():
    spec = importlib.util.spec_from_file_location("sao_memory_plan", ROOT / "bench" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built(config: dict) -> int:
    """sum(numel) of the model transformers builds from ``config``, on the meta device; tied weights once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", ["qwen2.5-7b", "tied-qwen2", "llama-with-head-dim"])
def test_the_parameter_count_is_the_built_models(memory_plan, shape):
    config = {
        "qwen2.5-7b": memory_plan.QWEN25_7B,
        "tied-qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 259,
                       "tie_word_embeddings": True},
        "llama-with-head-dim": {"model_type": "llama", "hidden_size": 96, "intermediate_size": 160,
                                "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 32, "vocab_size": 300, "tie_word_embeddings": False},
    }[shape]  # fmt: skip
    counted = memory_plan.parameters(config)
    assert counted["total"] == _built(config)
    if shape == "qwen2.5-7b":
        assert counted["total"] == 7_615_616_512  # the published count of Qwen2.5-7B


def test_the_scale_out_memory_table_is_the_programs_output(memory_plan, capsys):
    assert memory_plan.main([]) == 0
    printed = capsys.readouterr().out
    text = DOC.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    if os.environ.get("SAO_WRITE_DOCS") == "1":
        DOC.write_text(head + START + printed + END + tail)
    assert rest.split(END)[0] == printed, "docs/scale-out.md's table is not bench/memory_plan.py's: regenerate it"


def test_full_fine_tuning_sharded_over_16_ranks_fits_where_replicated_it_does_not(memory_plan):
    result = memory_plan.plan(memory_plan.QWEN25_7B, nodes=2, gpus_per_node=8, gpu_gib=80)
    rows = {(r["finetune"], r["shard"]): r for r in result["rows"]}
    P = result["parameters"]["total"]
    assert rows["full", "ddp"]["held"] == 16 * P and rows["full", "ddp"]["tokens"] == 0
    assert rows["full", "fsdp2"]["weights"] + rows["full", "fsdp2"]["gradients"] + rows["full", "fsdp2"]["adamw"] == (
        16 * P / 16
    )
    assert rows["full", "fsdp2"]["tokens"] > 0
