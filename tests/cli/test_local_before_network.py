"""Local before network: every local path and plug-in spec is checked before the hub is asked, the hub is asked once
(offline, or unreachable, is one line at once instead of the hub client's retries), no line is printed twice, and an
adapter names its base so that it can be merged from any folder.

The hub is made unreachable by pointing HF_ENDPOINT at a closed local port, with an empty cache; each case is a
subprocess, as a user runs it. Each passing case records a row of the fault table."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import refused_in_one_line, save_small_model
from sao.cli import main

SRC = Path(__file__).resolve().parents[2] / "src"
UNREACHABLE = {"HF_ENDPOINT": "http://127.0.0.1:9"}


def _sao(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -m sao.cli ARGS`` in ``cwd`` with an empty hub cache there and no proxy."""
    environ = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "HF_HOME": str(cwd / "hf"), **env}
    for key in (
        "HF_HUB_CACHE",
        "HF_DATASETS_CACHE",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ):
        if key not in env:
            environ.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "sao.cli", *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=120
    )


def _one_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "Retrying" not in done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("env", "needle"),
    [({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"), (UNREACHABLE, "the hub (127.0.0.1:9) cannot be reached")],
    ids=["offline", "unreachable"],
)
def test_gsm8k_from_a_hub_that_is_not_there_is_one_line_at_once(tmp_path, faults, env, needle):
    done = _sao(["train", "--out", "run"], tmp_path, **env)
    _one_line(done, "dataset 'openai/gsm8k' is not in the local hub cache", needle, "--data DIR")
    assert not (tmp_path / "run").exists()
    if env is UNREACHABLE:  # offline, the hub client itself was already quick and said so in one line
        faults.record("waiting on a network", "sao train with no --preset and the hub unreachable")


def test_a_missing_model_folder_is_reported_before_the_hub_is_asked_for_data(tmp_path, faults):
    done = _sao(["train", "--model", "/no/such/dir", "--out", "run"], tmp_path, **UNREACHABLE)
    _one_line(done, "model path '/no/such/dir' is not a directory")
    faults.record("waiting on a network", "--model /no/such/dir with GSM8K from an unreachable hub")


def test_a_reward_typo_is_reported_before_the_data_and_the_model(tmp_path, faults):
    done = _sao(["train", "--reward", "sao_no_such_rewards_35:score", "--out", "run"], tmp_path, **UNREACHABLE)
    _one_line(done, "--reward 'sao_no_such_rewards_35:score'", "no module named")
    faults.record("waiting on a network", "a --reward module typo with GSM8K from an unreachable hub")


def test_plug_ins_are_checked_before_any_data_or_model_loads(tmp_path, capsys, monkeypatch):
    """In process: with the data and the model loaders replaced by failures, a bad --env still says its own line."""
    from sao.model import policy
    from sao.tasks import setup

    def never(*args, **kwargs):
        raise AssertionError("loaded before the plug-ins were checked")

    monkeypatch.setattr(setup, "task_set", never)
    monkeypatch.setattr(policy.Models, "load", never)
    out = tmp_path / "run"
    refused_in_one_line(
        capsys,
        ["train", "--preset", "tiny", "--env", "sao_no_such_envs_35:Env", "--out", str(out)],
        out,
        "--env 'sao_no_such_envs_35:Env'",
    )
    refused_in_one_line(
        capsys,
        ["train", "--preset", "tiny", "--hooks", "sao_no_such_hooks_35:Hook", "--out", str(out)],
        out,
        "--hooks 'sao_no_such_hooks_35:Hook'",
    )


def test_a_line_a_library_logs_with_its_own_handler_is_printed_once(capsys, faults):
    assert main(["selftest"]) == 0
    capsys.readouterr()
    library = logging.getLogger("sao_test_library_35")
    handler = logging.StreamHandler(sys.stderr)
    library.addHandler(handler)
    try:
        library.warning("Retrying in 1s [Retry 1/5].")
        logging.getLogger("sao.training").warning("a line of sao's own")
    finally:
        library.removeHandler(handler)
    assert capsys.readouterr().err.splitlines() == ["Retrying in 1s [Retry 1/5].", "sao: a line of sao's own"]
    faults.record("waiting on a network", "a hub client's retry line, printed once")


# --- 8. an adapter names its base so that it merges from anywhere ----------------------------------------------


def _adapter_on_a_relative_base(root: Path, monkeypatch) -> Path:
    """A run trained with ``--model models/base`` typed in ``root``: its adapter/ folder."""
    import torch

    from sao.model.artifacts import save_adapter
    from sao.model.policy import ValueHead, add_lora, load_base

    save_small_model(root / "models" / "base")
    monkeypatch.chdir(root)
    lm, tokenizer = load_base("models/base", torch.device("cpu"))
    policy = add_lora(lm, rank=4, alpha=8)
    save_adapter(
        policy, tokenizer, ValueHead(lm.config.hidden_size), root / "run" / "adapter", base_model="models/base"
    )
    return root / "run"


def test_sao_export_from_another_folder_finds_the_base_the_run_was_trained_on(tmp_path, capsys, monkeypatch, faults):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were it taken for a hub id, this fails at once rather than retrying
    run = _adapter_on_a_relative_base(tmp_path / "where-it-trained", monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["export", str(run), "--merge", "merged"]) == 0
    assert (elsewhere / "merged" / "config.json").exists()
    assert str(tmp_path / "where-it-trained" / "models" / "base") in capsys.readouterr().out
    faults.record("waiting on a network", "sao export RUN --merge OUT from another folder")


def test_an_adapter_that_names_its_base_relatively_is_one_line_with_the_hub_unreachable(tmp_path, capsys, monkeypatch):
    """An adapter written before bases were recorded absolutely: its relative base is not here, and is not a hub id
    that can be fetched; one line at once, saying to pass --base-model."""
    import json

    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE["HF_ENDPOINT"])
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    run = _adapter_on_a_relative_base(tmp_path / "where-it-trained", monkeypatch)
    config_file = run / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = "models/base"
    config_file.write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    refused_in_one_line(
        capsys,
        ["export", str(run), "--merge", str(tmp_path / "merged")],
        tmp_path / "merged",
        "model 'models/base'",
        "cannot be reached",
        "pass --base-model PATH",
    )
