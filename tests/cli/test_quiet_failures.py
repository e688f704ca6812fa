"""Commands that used to exit 0 having done the wrong thing or nothing: a replay that trained on other data, a model
that can never end a reply, runs that trained on nothing (every trace dropped, every reply cut, an environment
failing on every trajectory), a server that served the untrained base, a trace log sampled with other numerics.

Each case ends in one line on stderr and exit code 2 (the run's checkpoint kept for --resume, or its folder as it was
found), or does what it was asked; each passing case records a row of the fault table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import files_in, refused_in_one_line, run_log
from sao.cli import main
from sao.core.config import Config

SMALL = [
    "--preset",
    "tiny",
    "--batch-size",
    "4",
    "--train-prompts",
    "16",
    "--test-prompts",
    "4",
    "--quiet",
    "--threads",
    "1",
]


def _failed_run(capsys, argv: list[str], *needles: str) -> str:
    """Exit code 2 and no traceback; the last stderr line is the error holding every needle (a warning the run
    gave on its way may come before it). Returns that line."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and lines and "Traceback" not in err, err
    assert lines[-1].startswith("sao train: error: "), err
    for needle in needles:
        assert needle in lines[-1], lines[-1]
    return lines[-1]


# --- 1. replay is exact or refused -----------------------------------------------------------------------------

REWARD = """
    def score(completion, row):
        return float(row["answer"] in completion)
"""

HOOK = """
    from sao.training.trainer import Hook

    class Counter(Hook):
        name = "counter"
"""


def _written(folder: Path, config: Config, **parts) -> Path:
    """config.json as sao.train writes it for ``config`` and the objects passed (``checkpoint.run_record``)."""
    from sao.tasks import setup
    from sao.training import checkpoint

    tasks = setup.task_set(config, parts.get("dataset"))
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint.write_config(folder, checkpoint.run_record(config, tasks, **parts))
    return folder / "config.json"


def test_a_run_that_cannot_be_replayed_is_refused_by_config_with_its_reasons(tmp_path, capsys, faults):
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(8)]
    written = _written(
        tmp_path / "python-run",
        Config.load("tiny", train_prompts=8),
        dataset=rows,
        reward_fn=lambda completion, row: 1.0,
    )
    record = json.loads(written.read_text())
    assert record["replayable"] is False
    out = tmp_path / "again"
    line = refused_in_one_line(
        capsys,
        ["train", "--config", str(written), "--out", str(out)],
        out,
        "cannot be replayed",
        "the dataset was passed as rows",
        "reward_fn",
    )
    assert "--config" in line
    faults.record("successes that are not", "--config on a run passed rows and a script's reward")


def test_a_replayable_run_replays_the_dataset_reward_environment_and_hooks_it_was_passed(
    tmp_path, user_module, monkeypatch, faults
):
    import importlib

    reward_module, hook_module = user_module(REWARD), user_module(HOOK)
    score = importlib.import_module(reward_module).score
    counter = importlib.import_module(hook_module).Counter
    data = tmp_path / "tasks.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i}+2?", "answer": str(i + 2)}) + "\n" for i in range(40))
    )
    monkeypatch.chdir(tmp_path)
    config = Config.load("tiny", train_prompts=16, test_prompts=4)
    written = _written(
        tmp_path / "run",
        config,
        dataset="tasks.jsonl",
        reward_fn=score,
        hooks=[counter()],
        env_factory=importlib.import_module("sao.tasks.calc").Gsm8kEnv,
    )
    record = json.loads(written.read_text())
    assert record["replayable"] is True and record["passed"]["dataset"] == str(data)  # absolute: read anywhere
    monkeypatch.chdir(tmp_path.parent)
    replayed = Config.load(file=written)
    assert replayed.data.dataset == str(data) and replayed.data.reward == f"{reward_module}:score"
    assert replayed.data.env == "sao.tasks.calc:Gsm8kEnv" and replayed.training.hooks == f"{hook_module}:Counter"
    assert replayed == Config.load(
        "tiny",
        train_prompts=16,
        test_prompts=4,
        data=str(data),
        reward=f"{reward_module}:score",
        env="sao.tasks.calc:Gsm8kEnv",
        hooks=f"{hook_module}:Counter",
    )
    faults.record("successes that are not", "--config on a run passed a dataset path, a reward, an env and a hook")


def test_a_hook_that_cannot_be_rebuilt_by_name_makes_the_run_unreplayable(tmp_path, user_module):
    import importlib

    module = user_module(
        HOOK + "\n    class Tuned(Hook):\n        def __init__(self, every=3):\n            self.every = every\n"
    )
    tuned = importlib.import_module(module).Tuned
    record = json.loads(_written(tmp_path / "run", Config.load("tiny"), hooks=[tuned(every=5)]).read_text())
    assert record["replayable"] is False and "hook Tuned cannot be rebuilt by name" in record["not_replayable"][0]


# --- 2. a model that can never end a reply ----------------------------------------------------------------------


def _model_without_eos(folder: Path) -> Path:
    """A one-layer Qwen2 whose tokenizer names no EOS token and whose configs name no EOS id."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sao.tiny import arithmetic as tiny

    tokenizer = tiny.build_tokenizer()
    pad = tokenizer.pad_token_id
    tokenizer.eos_token = None
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=pad,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_model_without_an_eos_token_is_refused_before_training(tmp_path, capsys, faults):
    model = _model_without_eos(tmp_path / "no-eos")
    capsys.readouterr()  # the model's own saving
    out = tmp_path / "run"
    refused_in_one_line(
        capsys,
        ["train", *SMALL, "--model", str(model), "--out", str(out)],
        out,
        "has no EOS token",
        "no reply could end",
    )
    faults.record("successes that are not", "a tokenizer and generation config without EOS")


# --- 3 and 4. a run that trained on nothing fails ----------------------------------------------------------------


def _traces(path: Path, n: int, **changes) -> Path:
    lines = [
        {
            "id": f"r{i}",
            "policy_version": 0,
            "temperature": 1.0,
            "prompt_token_ids": [1, 70, 71],
            "completion_token_ids": [72, 73, 2],
            "logprobs": [-0.1, -0.2, -0.3],
            "reward": 1.0,
            **changes,
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("case", "flags", "changes", "needle"),
    [
        ("traces served at another temperature", ["--temperature", "0.7"], {}, "footing_mismatch 8"),
        ("traces from a later policy version", [], {"policy_version": 5}, "future_version 8"),
    ],
)
def test_a_trace_run_whose_traces_are_all_dropped_fails_and_leaves_out_as_found(
    tmp_path, capsys, faults, tiny_model_dir, case, flags, changes, needle
):
    log = _traces(tmp_path / "traces.jsonl", 8, **changes)
    out = tmp_path / "run"
    _failed_run(
        capsys,
        ["train", *SMALL, "--traces", str(log), "--steps", "2", "--critic-warmup", "1", *flags, "--out", str(out)],
        "nothing was trained",
        needle,
    )
    assert not out.exists()  # nothing was done: the corrected command starts afresh
    faults.record("successes that are not", case)


def test_a_run_whose_every_reply_is_cut_fails_and_keeps_its_checkpoint(tmp_path, capsys, faults, tiny_model_dir):
    out = tmp_path / "run"
    argv = ["train", *SMALL, "--max-new-tokens", "1", "--steps", "1", "--critic-warmup", "1", "--out", str(out)]
    _failed_run(capsys, argv, "every trajectory of all 2 steps was cut", "--max-new-tokens 1")
    assert [r["truncation_share"] for r in run_log(out)] == [1.0, 1.0]
    assert any((out / "checkpoints").iterdir()) and not (out / "adapter").exists()
    faults.record("successes that are not", "every reply cut at the token limit for the whole run")


ENVIRONMENTS = """
    import math

    class Broken:
        def __init__(self, task_id, fields):
            pass

        def init(self, prompt):
            return prompt, {{}}

        def step(self, action):
            {step}

        def close(self):
            pass
"""

FAILING_STEPS = {
    "returns None": "return None",
    "raises": "raise RuntimeError('the tool server is down')",
    "answers a NaN reward": "return {'observations': [], 'reward': math.nan, 'done': True}",
    "answers the string reward '1'": "return {'observations': [], 'reward': '1', 'done': True}",
}


@pytest.mark.parametrize("case", sorted(FAILING_STEPS))
def test_an_environment_failing_on_every_trajectory_stops_the_run_at_the_fault_budget(
    tmp_path, capsys, user_module, faults, tiny_model_dir, case
):
    module = user_module(ENVIRONMENTS.format(step=FAILING_STEPS[case]))
    out = tmp_path / "run"
    argv = [
        "train",
        *SMALL,
        "--env",
        f"{module}:Broken",
        "--steps",
        "3",
        "--critic-warmup",
        "1",
        "--fault-window",
        "1",
        "--out",
        str(out),
    ]
    _failed_run(
        capsys,
        argv,
        "ended 100% of the trajectories of the last 1 steps by a fault",
        "--fault-budget 0.5",
        "--resume continues from step 1",
    )
    assert [r["env_fault_share"] for r in run_log(out)] == [1.0]  # it stopped after the first step
    assert (out / "checkpoints").is_dir() and (out / "config.json").exists()  # resumable
    faults.record("successes that are not", f"an environment whose step {case} on every trajectory")


def test_the_fault_budget_and_its_window_are_settings_with_their_reasons():
    config = Config.load("tiny")
    assert (config.training.fault_budget, config.training.fault_window) == (0.5, 4)
    assert "a flaky tool" in Config.help("fault_budget") and "passing outage" in Config.help("fault_window")


# --- 5. sao serve --adapter and --watch ---------------------------------------------------------------------


def _trained_adapter(folder: Path, version: int):
    """A tiny run's adapter/ whose LoRA weights are not the initial ones, recorded as ``version``."""
    import torch

    from sao.model.artifacts import save_adapter
    from sao.model.policy import Models, lora_state

    models = Models.load("tiny", device="cpu", lora_rank=16, lora_alpha=32, seed=17)
    with torch.no_grad():
        for p in lora_state(models.policy).values():
            p.copy_(torch.randn_like(p) * 0.01)
    save_adapter(
        models.policy,
        models.tokenizer,
        models.value_head,
        folder / "adapter",
        base_model=models.name,
        policy_version=version,
    )
    return {n: p.detach().clone() for n, p in lora_state(models.policy).items()}


def test_sao_serve_adapter_serves_the_given_adapter(tmp_path, faults, tiny_model_dir):
    pytest.importorskip("fastapi")
    import torch

    from sao.serve.server import Server

    run = tmp_path / "run"
    weights = _trained_adapter(run, version=7)
    server = Server(Config.load("tiny"), tmp_path / "traces.jsonl", port=0, adapter=run, say=lambda line: None)
    try:
        assert server.policy.version == 7 and server.policy.adapter == str(run / "adapter")
        assert all(torch.equal(server.policy._lora[name], value) for name, value in weights.items())
        reply = server.policy.generate(
            server.policy.prompt_ids([{"role": "user", "content": "What is 2+2?"}]),
            max_tokens=4,
            temperature=1.0,
            seed=0,
        )
        assert reply.policy_version == 7
    finally:
        server.close()
    faults.record("successes that are not", "sao serve --adapter on a finished run")


def test_sao_serve_watch_on_a_run_that_never_publishes_is_refused(tmp_path, capsys, faults):
    pytest.importorskip("fastapi")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"config": Config.load("tiny").to_dict()}))
    log = tmp_path / "logs" / "traces.jsonl"
    refused_in_one_line(
        capsys,
        ["serve", "--preset", "tiny", "--traces", str(log), "--watch", str(run), "--port", "0"],
        tmp_path / "logs",
        "trained without --publish",
        f"--adapter {run}",
    )
    faults.record("successes that are not", "sao serve --watch on a run trained without --publish")


def test_sao_serve_says_when_the_watched_run_has_published_nothing_yet(tmp_path, tiny_model_dir):
    pytest.importorskip("fastapi")
    from sao.serve.server import Server

    said: list[str] = []
    server = Server(Config.load("tiny"), tmp_path / "traces.jsonl", port=0, watch=tmp_path / "later", say=said.append)
    server.close()
    assert said == [
        f"sao serve: {tmp_path / 'later'} has published nothing yet: serving the base model (v0) until it does"
    ]


def test_sao_serve_refuses_an_adapter_folder_that_holds_none(tmp_path, capsys):
    pytest.importorskip("fastapi")
    log = tmp_path / "logs" / "traces.jsonl"
    refused_in_one_line(
        capsys,
        ["serve", "--preset", "tiny", "--traces", str(log), "--adapter", str(tmp_path), "--port", "0"],
        tmp_path / "logs",
        "holds neither adapter/",
    )
    assert files_in(tmp_path / "logs") == {}


# --- 6. the traces path applies the sampler tolerance -----------------------------------------------------------


def test_the_traces_source_declares_the_sampler_tolerance_the_trainer_applies():
    from sao.training.build import default_hooks
    from sao.training.hooks import Mismatch

    config = Config.load("tiny", traces="log.jsonl")
    assert config.source.needs()["sampler_tolerance"] == 1e-3
    (mismatch,) = [h for h in default_hooks(config) if isinstance(h, Mismatch)]
    assert mismatch.tolerance == 1e-3
    assert Config.load("tiny", traces="log.jsonl", sampler_tolerance=3e-2).source.needs()["sampler_tolerance"] == 3e-2
