"""The conventions a new user brings: a hub id that is not here fails in seconds, not after the hub client's
retries; under torchrun only rank 0 prints."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _sao(args: list[str], cwd: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m sao.cli ARGS`` in ``cwd`` with an empty hub cache there, and the seconds it took."""
    environ = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "HF_HOME": str(cwd / "hf"), **env}
    environ.pop("HF_HUB_CACHE", None)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sao.cli", *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=60
    )
    return done, time.monotonic() - start


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"HF_HUB_OFFLINE": "1"}, "is not in the local hub cache and HF_HUB_OFFLINE is set"),
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "is not in the local hub cache and the hub (127.0.0.1:9) cannot be"),
    ],
    ids=["offline", "unreachable"],
)
def test_a_hub_id_not_cached_here_fails_in_one_line_within_seconds(tmp_path, faults, env, needle):
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.setdefault(key, "")
    done, seconds = _sao(
        ["train", "--model", "nobody/no-such-model-7f3a", "--preset", "tiny", "--out", "run"], tmp_path, **env
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "'nobody/no-such-model-7f3a'" in lines[0] and needle in lines[0] and "--model" in lines[0]
    assert seconds < 10, f"took {seconds:.1f} s"
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    faults.record("conventions", f"a hub id not in the cache, hub {'off' if 'HF_HUB_OFFLINE' in env else 'down'}")


def test_a_cached_hub_id_is_not_probed(tmp_path, monkeypatch):
    from sao.model import policy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name: str(tmp_path / name))
    policy.check_hub_reachable("someone/cached-model")  # no error: the loader reads the cache


def _fake_trainer(rank: int) -> object:
    """What ``sao train``'s start and summary lines read from a trainer, on one rank of two."""
    from types import SimpleNamespace

    from sao.training.distributed import World

    source = SimpleNamespace(max_staleness=2, summary=lambda: {})
    return SimpleNamespace(
        world=World(size=2, rank=rank),
        describe=lambda: "4 steps",
        source=source,
        run_dir=SimpleNamespace(record={"source": "tiny", "data": {"train": 4}}),
        ended_early="",
        total_steps=4,
        warnings=["the reward never varied"],
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_prints_the_train_summary(capsys, tmp_path, faults, rank):
    from sao.cli import print_start, print_summary
    from sao.core.config import Config

    trainer, config = _fake_trainer(rank), Config.load("tiny")
    print_start(trainer, config)
    print_summary(trainer, config, tmp_path, [])
    out = capsys.readouterr()
    if rank == 0:
        assert "sao train:" in out.out and "warning: the reward never varied" in out.out
    else:
        assert out.out == "" and out.err == ""
        faults.record("conventions", "the train summary on rank 1 of 2")


def test_only_rank_0_says_and_warns(capsys, caplog):
    from sao.training.distributed import World
    from sao.training.trainer import Trainer

    for progress in (True, False):
        trainer = object.__new__(Trainer)
        trainer.world, trainer.progress, trainer.warnings = World(size=2, rank=1), progress, []
        trainer.say("step 1", always=True)
        trainer.warn("a warning")
        assert trainer.warnings == ["a warning"]  # kept for results.json, shown by rank 0 alone
    out = capsys.readouterr()
    assert out.out == "" and out.err == "" and caplog.records == []


def test_a_skyrl_style_environment_class_plugs_in_unchanged(user_module):
    """A class written for SkyRL-Gym, ``Class(env_config, extras)``, reads the task's answer from reward_spec."""
    from sao.tasks.environments import env_factory

    name = user_module(
        "class MathEnv:\n"
        "    def __init__(self, env_config, extras={}):\n"
        "        self.truth = extras['reward_spec']['ground_truth']\n"
        "        self.max_turns = extras['max_turns']\n"
        "    def init(self, prompt):\n"
        "        return prompt, {}\n"
        "    def step(self, action):\n"
        "        return {'observations': [], 'reward': float(action == self.truth), 'done': True, 'metadata': {}}\n"
        "    def close(self):\n"
        "        pass\n"
    )
    factory = env_factory(f"{name}:MathEnv", tokenizer=None, max_turns=3)
    env = factory("task-1", {"question": "1+1?", "answer": "2"})
    assert env.max_turns == 3 and env.step("2")["reward"] == 1.0 and env.step("3")["reward"] == 0.0
