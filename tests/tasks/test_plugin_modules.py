"""A plug-in module that calls ``sys.exit`` while it is imported (``--reward``, ``--env``, ``--env skyrl:``) is one line
naming the flag and the module, never a silent exit 0; ``--env skyrl:<module>:<id>`` finds a module in the working
folder as ``--env module:Class`` does."""

from __future__ import annotations

import sys
import textwrap

import pytest

from sao.core.errors import ConfigError
from sao.tasks.custom import load_env_class, load_reward
from sao.tasks.environments import env_factory

EXITS = """
    import sys
    sys.exit({code})

    def reward(completion, row):
        return 1.0

    class Env:
        def init(self, prompt):
            return prompt, {{}}

        def step(self, action):
            return {{"observations": [], "reward": 0.0, "done": True}}

        def close(self):
            pass
"""


def _one_line(error: BaseException, *needles: str) -> None:
    text = str(error)
    assert "\n" not in text, text
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize("code", [0, 3])
@pytest.mark.parametrize("flag", ["--reward", "--env", "--env skyrl:"])
def test_a_module_that_exits_while_imported_is_one_line(user_module, flag, code, faults):
    name = user_module(EXITS.format(code=code))
    load = {
        "--reward": lambda: load_reward(f"{name}:reward"),
        "--env": lambda: load_env_class(f"{name}:Env"),
        "--env skyrl:": lambda: env_factory(f"skyrl:{name}:some-id", None, max_turns=2),
    }[flag]
    if flag == "--env skyrl:":
        pytest.importorskip("skyrl_gym")
    with pytest.raises(ConfigError) as caught:
        load()
    _one_line(caught.value, flag.split()[0], repr(name), f"called sys.exit({code})")
    faults.record("plug-in modules", f"{flag} module calling sys.exit({code}) at import")


SKYRL_MODULE = """
    from skyrl_gym.envs.base_text_env import BaseTextEnv
    from skyrl_gym.envs.registration import register

    class Echo(BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()
            self.answer = extras["reward_spec"]["ground_truth"]

        def init(self, prompt):
            return prompt, {}

        def step(self, action):
            return {"observations": [], "reward": float(action.strip() == self.answer), "done": True, "metadata": {}}

    register(id="working-folder-echo", entry_point=Echo)
"""


def test_skyrl_finds_a_module_in_the_working_folder_as_module_class_does(tmp_path, monkeypatch, faults):
    pytest.importorskip("skyrl_gym")
    name = "sao_skyrl_here_mod"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(SKYRL_MODULE), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        factory = env_factory(f"skyrl:{name}:working-folder-echo", None, max_turns=2)
        env = factory("task/1", {"question": "q", "answer": "7"})
        assert env.step("7")["reward"] == 1.0
    finally:
        sys.modules.pop(name, None)
    faults.record("plug-in modules", "--env skyrl:module:id with the module in the working folder")


def test_sao_train_with_a_reward_module_that_exits_is_exit_2_not_0(
    tmp_path, user_module, capsys, faults, tiny_model_dir
):
    from helpers import refused_in_one_line

    name = user_module(EXITS.format(code=0))
    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny",
        "--batch-size",
        "8",
        "--steps",
        "1",
        "--quiet",
        "--reward",
        f"{name}:reward",
        "--out",
        str(out),
    ]
    refused_in_one_line(capsys, argv, out, f"--reward '{name}:reward'", "called sys.exit(0)")
    faults.record("plug-in modules", "sao train --reward on a module that exits 0 at import (exit code 2)")
