"""A recipe killed with SIGKILL at any point resumes to the same results as one that never stopped.

Each case runs `sao recipe` in a child process that SIGKILLs itself at a chosen moment (inside a training
step's save, between the checkpoint and the log, in the middle of an eval), then runs it again with
--resume and compares every number with an uninterrupted run of the same settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import run_log, trace_errors, without_keys
from sao.core.timeline import TIMING_FIELDS

SMALL = [
    "--preset",
    "tiny",
    "--batch-size",
    "16",
    "--steps",
    "5",
    "--critic-warmup",
    "2",
    "--lag",
    "2",
    "--train-prompts",
    "64",
    "--test-prompts",
    "24",
    "--eval-samples",
    "2",
    "--base-evals",
    "2",
    "--quiet",
]

# The child: patch one function to SIGKILL the process at the chosen moment, then run the CLI.
CHILD = r"""
import os, signal, sys
from sao import cli
from sao.experiment import evaluate
from sao.training import checkpoint, trainer
where, label, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
calls = {"n": 0}

def bang():
    os.kill(os.getpid(), signal.SIGKILL)

if where == "after-log":  # step `count` is in train_log.jsonl, its checkpoint is not written
    real_append = checkpoint.append_log
    def append_log(out, record):
        real_append(out, record)
        if record["step"] + 1 == count and label in str(out):
            bang()
    checkpoint.append_log = append_log
elif where == "train-step":  # in the middle of step `count` of run `label`
    real_step = trainer.Trainer.step
    def step(self, g):
        if self.label == label and g == count:
            bang()
        return real_step(self, g)
    trainer.Trainer.step = step
elif where == "eval":  # while drawing the eval of `label`, after its first decode call
    real_draw = evaluate.draw_batch
    def draw(*a, **k):
        out = real_draw(*a, **k)
        if calls.setdefault("label", None) == label:
            bang()
        return out
    real_eval = evaluate.evaluate
    def patched(*a, **k):
        calls["label"] = k.get("label")
        return real_eval(*a, **k)
    evaluate.draw_batch = draw
    evaluate.evaluate = patched  # pass_at_1 calls it there
sys.exit(cli.main(sys.argv[4:]))
"""


def _steps(trace: dict) -> list[int]:
    """The steps a timeline holds, in the order written."""
    return [e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"]


VOLATILE = {*TIMING_FIELDS, "seconds", "this_invocation", "wall_time", "versions", "command"}


def _strip(obj):
    return without_keys(obj, VOLATILE)


def _env():
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "sao.cli", *args], capture_output=True, text=True, env=_env(), timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("reference") / "exp"
    _run(["recipe", *SMALL, "--out", str(out)])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "label", "count"),
    [
        ("train-step", "dis-s17", 4),  # mid-training, first arm, first policy steps
        ("after-log", "none-s17", 3),  # between the log line and its checkpoint, second arm
        ("eval", "dis-s17", 0),  # in the trained arm's eval
        ("eval", "base-1", 0),  # in the second base eval
    ],
)
def test_killed_recipe_resumes_to_identical_results(reference, tmp_path, where, label, count, faults):
    out = tmp_path / "exp"
    killed = subprocess.run(
        [sys.executable, "-c", CHILD, where, label, str(count), "recipe", *SMALL, "--out", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (out / "results.json").exists()
    written = {p: p.read_bytes() for p in out.glob("**/evals/*.json")}

    refused = _run(["recipe", *SMALL, "--out", str(out)], check=False)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    _run(["recipe", *SMALL, "--out", str(out), "--resume"])
    for path, data in written.items():
        assert path.read_bytes() == data, f"{path.name} was rewritten"
    got = _strip(json.loads((out / "results.json").read_text()))
    want = _strip(json.loads((reference / "results.json").read_text()))
    assert got == want
    got_log = _strip(run_log(out))
    want_log = _strip(run_log(reference))
    assert got_log == want_log
    assert (out / "report.md").exists()
    faults.record("killed process", f"{where} {label} {count}")


def test_resume_of_a_finished_trainer_changes_nothing(tiny_config, tmp_path):
    from sao.core.io import as_json
    from sao.training import build

    out = tmp_path / "run"
    first = build.trainer(tiny_config, out, progress=False).run()
    log = (out / "train_log.jsonl").read_bytes()
    again = build.trainer(tiny_config, out, resume=True, progress=False).run()
    assert as_json(again) == as_json(first)  # NaN != NaN in Python; JSON compares them as null
    assert (out / "train_log.jsonl").read_bytes() == log


@pytest.mark.slow
def test_a_killed_multi_turn_run_resumes_to_identical_results(tiny_model_dir, tmp_path, faults):
    """`sao train` on SkyRL-Gym's multi-turn GSM8K environment, SIGKILLed in the middle of a policy step, then
    resumed: the log is the uninterrupted run's, episode for episode, and the timeline.json the kill left parses as
    it is and goes on through the resume."""
    pytest.importorskip("skyrl_gym")
    agent = [
        "--preset",
        "tiny",
        "--env",
        "skyrl:gsm8k_multi_turn",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "24",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--critic-warmup",
        "1",
        "--lag",
        "2",
        "--train-prompts",
        "32",
        "--test-prompts",
        "8",
        "--quiet",
    ]
    reference, out = tmp_path / "reference", tmp_path / "run"
    _run(["train", *agent, "--out", str(reference)])
    killed = subprocess.run(
        [sys.executable, "-c", CHILD, "train-step", "dis seed 17", "3", "train", *agent, "--out", str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    left = json.loads((out / "timeline.json").read_text())  # as the kill left it: no repair needed to read it
    assert not trace_errors(left) and _steps(left) == [0, 1, 2]
    _run(["train", *agent, "--out", str(out), "--resume"])
    got = _strip(run_log(out))
    want = _strip(run_log(reference))
    assert got == want and any(r["turns_mean"] > 1 for r in got)
    after = json.loads((out / "timeline.json").read_text())
    assert not trace_errors(after) and _steps(after) == [0, 1, 2, 3, 4]
    assert [e["name"] for e in after["traceEvents"] if e.get("cat") == "run"] == ["run start", "resumed at step 3"]
    assert {e["name"] for e in after["traceEvents"] if e.get("cat") == "env"} >= {"env.init", "env.step"}
    faults.record("killed process", "train-step of a multi-turn agent run")
