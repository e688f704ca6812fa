"""An environment that fails on every row before the model can act (its constructor, its factory or its init raising,
hanging past --env-timeout or answering the wrong shape; a factory that builds None or a number) leaves a batch with
nothing to train on: ``sao train`` says so in one line naming the environment and the first row's fault, exit code
2, --out as it was found, never an internal error. From Python, a factory that is an environment or cannot be called
is a TypeError before anything loads."""

from __future__ import annotations

import pytest

from helpers import refused_in_one_line

ENVIRONMENTS = """
    import time

    class Fine:
        def __init__(self, task_id, fields):
            pass

        def init(self, prompt):
            return prompt, {}

        def step(self, action):
            return {"observations": [], "reward": 1.0, "done": True}

        def close(self):
            pass

    class BrokenConstructor(Fine):
        def __init__(self, task_id, fields):
            raise ValueError("no sandbox for " + task_id)

    class BrokenInit(Fine):
        def init(self, prompt):
            raise RuntimeError("tool server down")

    class WrongShape(Fine):
        def init(self, prompt):
            return "the prompt"

    class HangingInit(Fine):
        def init(self, prompt):
            time.sleep(30)

    def raising_factory(task_id, fields):
        raise KeyError("answer")

    def none_factory(task_id, fields):
        return None

    def int_factory(task_id, fields):
        return 0
"""

CASES = {  # --env attribute: what the one line says of the first row's fault
    "BrokenConstructor": "(building it) raised ValueError: no sandbox for",
    "BrokenInit": "(init) raised RuntimeError: tool server down",
    "WrongShape": "(init) returned 'the prompt'",
    "HangingInit": "(init) did not return within 0.5 s",
    "raising_factory": "(building it) raised KeyError: 'answer'",
    "none_factory": "(building it) returned None",
    "int_factory": "(building it) returned 0",
}


@pytest.mark.parametrize("attribute", list(CASES))
def test_an_environment_that_fails_on_every_row_is_one_line_naming_it(
    tmp_path, capsys, user_module, attribute, faults, tiny_model_dir
):
    module = user_module(ENVIRONMENTS)
    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny",
        "--batch-size",
        "4",
        "--steps",
        "1",
        "--critic-warmup",
        "1",
        "--max-new-tokens",
        "8",
        "--env",
        f"{module}:{attribute}",
        "--env-timeout",
        "0.5",
        "--quiet",
        "--out",
        str(out),
    ]
    refused_in_one_line(
        capsys,
        argv,
        out,
        f"environment {module}:{attribute}",
        "failed on all 4 trajectories",
        "before the model could act",
        CASES[attribute],
    )
    faults.record("failing environments", f"--env whose {attribute} fails on every row")


class _Env:
    def __init__(self, task_id=None, fields=None):
        pass

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        return {"observations": [], "reward": 0.0, "done": True}

    def close(self):
        pass


@pytest.mark.parametrize(
    ("what", "factory", "needle"),
    [
        ("an environment instance", _Env(), "is an environment (a _Env), not a factory"),
        ("an int", 5, "is 5 (int), not callable"),
        ("a function of one argument", lambda task_id: _Env(), "cannot be called as (task_id, fields)"),
    ],
)
def test_a_factory_that_cannot_build_environments_is_a_type_error_before_anything(
    tmp_path, what, factory, needle, faults
):
    import sao

    out = tmp_path / "run"
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(8)]
    with pytest.raises(TypeError) as caught:
        sao.train({"preset": "tiny", "batch_size": 4, "steps": 1}, out, dataset=rows, env_factory=factory)
    assert "env_factory" in str(caught.value) and needle in str(caught.value), caught.value
    assert not out.exists()
    faults.record("failing environments", f"env_factory given {what}")
