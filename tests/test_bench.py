"""The bench's table renders every row for a GPU run and for a CPU run (the GPU path cannot run in CI, so
its formatting is checked here on figures shaped like the ones it produces); the GPU first-run script names only
what exists; bench/memory_plan.py counts a model's parameters as transformers builds it (on the meta device) and
docs/scale-out.md's memory table is its output as printed."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sao_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures(gpu: bool) -> dict:
    decode = []
    for batch, plain, sao in ((64, 20.0, 1.0), (480, 60.0, 3.0)):
        row = {"batch": batch, "plain_s": plain, "sao_s": sao, "floor_ms_per_step": 0.9 if gpu else None}
        row |= {"plain_tok_s": batch * 256 / plain, "sao_tok_s": batch * 256 / sao}
        row |= {"plain_ms_per_step": 1e3 * plain / 256, "sao_ms_per_step": 1e3 * sao / 256}
        if batch == 64:
            row |= {"hf_generate_tok_s": 900.0, "hf_generate_ms_per_step": 70.0}
        decode.append(row)
    gap = {"mean": 0.01, "p99": 0.05, "max": 0.08}
    return {
        "device": "NVIDIA H200" if gpu else "cpu",
        "tiny": not gpu,
        "parameters": 1.54e9,
        "decode": decode,
        "lag0": {"plain": gap, "sao": gap, "hf_generate": gap},
        "train": {
            "plain": {"seconds": 1.0, "peak_gib": 41.0 if gpu else None, "micro_batch": 16},
            "sao": {"seconds": 0.5, "peak_gib": 25.0 if gpu else None, "micro_batch": 32},
            "floor_s": 0.29 if gpu else None,
        },
        "protocol": {
            "plain": {"total_s": 2400.0, "rollouts_s": 2000.0, "evals_s": 300.0, "train_s": 100.0},
            "sao": {"total_s": 300.0, "rollouts_s": 100.0, "evals_s": 15.0, "train_s": 185.0},
        },
        "bench_seconds": 300.0,
    }


@pytest.mark.parametrize("gpu", [True, False])
def test_table_has_every_row_side_by_side(bench, gpu):
    text = bench.table(_figures(gpu))
    assert "| decode batch 64, tokens/s | 819 | 900 | 16384 | 20.0x | — |" in text
    assert "| decode batch 480, ms/step | 234.38 |" in text
    assert "| train step, s | 1.000 (micro-batch 16) | | 0.500 (micro-batch 32) | 2.00x |" in text
    assert "| full protocol projected, min | 40.0 | | 5.0 | 8.0x | |" in text
    assert ("share of floor" in text) == gpu and ("peak memory" in text) == gpu
    if gpu:
        assert "| decode batch 64, share of floor | | | 23.0% | | |" in text


def test_the_gpu_first_run_script_names_only_tests_files_and_flags_that_exist():
    """bench/gpu_first_run.sh runs once, on a lent GPU, with no second chance: it is valid bash, the files it names
    exist, bench.py takes the flags it passes, and its `sao train` line parses with sao's own parser."""
    import re
    import shlex
    import subprocess

    from sao.cli import build_parser

    script = BENCH.parent / "gpu_first_run.sh"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr
    text = script.read_text()
    root = BENCH.parents[1]
    named = set(re.findall(r"\b((?:tests|bench|src)/[\w/.-]+\.(?:py|sh))\b", text)) | {"BENCHMARKS.md"}
    assert {"bench/bench.py", "tests/rollout/test_engine.py"} <= named
    assert [n for n in sorted(named) if not (root / n).exists()] == []
    bench_flags = set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', BENCH.read_text()))
    for flags in re.findall(r"bench/bench\.py ([^\n|]*)", text):
        assert {f for f in re.findall(r"--[\w-]+", flags)} <= bench_flags, flags
    (train,) = re.findall(r'train (--preset tiny[^\n]*?) "\$@"', text.replace("\\\n", " "))
    argv = ["train", *shlex.split(train.replace('"$device"', "cpu").replace('"$folder"', "/tmp/x"))]
    build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------
# bench/memory_plan.py

DOC = BENCH.parents[1] / "docs" / "scale-out.md"
START, END = "<!-- memory-plan:start -->\n", "<!-- memory-plan:end -->"


@pytest.fixture(scope="module")
def memory_plan():
    spec = importlib.util.spec_from_file_location("sao_memory_plan", BENCH.parent / "memory_plan.py")
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
        "tied-qwen2": {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 259,
            "tie_word_embeddings": True,
        },
        "llama-with-head-dim": {
            "model_type": "llama",
            "hidden_size": 96,
            "intermediate_size": 160,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "vocab_size": 300,
            "tie_word_embeddings": False,
        },
    }[shape]
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
