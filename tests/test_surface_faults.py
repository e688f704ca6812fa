"""Issue 26, the surfaces added last: a command that fails early leaves nothing behind, the trace log keeps its
integrity (locked by identity, torn tails cut, a replaced file read from its start, empty or odd logs refused,
unmatched feedback counted), and the server's edges (hosts and ports, overload, 5xx shapes, reloads, hang-ups).

Every refusal is asserted as the CLI's exit code 2 and one line on stderr with no traceback, or the server's
one-line OpenAI-shaped error, and nothing written or lost; each passing case records a row of the fault table.
"""

from __future__ import annotations

import socket
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from sao.cli import main

SMALL = ["--preset", "tiny", "--batch-size", "8", "--steps", "2", "--critic-warmup", "1", "--train-prompts", "32",
         "--test-prompts", "8", "--quiet"]  # fmt: skip


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else {}


def _refused(capsys, argv: list[str], *needles: str) -> str:
    """Runs the CLI: exit code 2, one line on stderr holding every needle, no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module into tmp_path under a fresh name, puts tmp_path on sys.path, returns the name."""
    names = []

    def write(source: str) -> str:
        name = f"sao_user_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        monkeypatch.syspath_prepend(str(tmp_path))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


# --- failing early writes nothing ------------------------------------------------------------------------------

WORDS_REWARD = """
    def says_yes(completion, row):
        return "yes"
"""


@pytest.mark.parametrize("state", ["absent", "empty"])
def test_a_reward_that_fails_in_the_first_step_leaves_out_as_it_was(tmp_path, capsys, user_module, state, faults,
                                                                    tiny_model_dir):  # fmt: skip
    module = user_module(WORDS_REWARD)
    out = tmp_path / "run"
    if state == "empty":
        out.mkdir()
    _refused(capsys, ["train", *SMALL, "--reward", f"{module}:says_yes", "--out", str(out)], "it must return a number")
    assert out.exists() == (state == "empty") and not any(out.glob("*") if out.exists() else [])
    faults.record("failing early", f"a --reward returning a string in the first step, --out {state}")


def test_a_missing_tracker_leaves_no_config_behind(tmp_path, capsys, faults, tiny_model_dir):
    pytest.importorskip("sao.training.tracking")
    if any(__import__("importlib").util.find_spec(name) for name in ("wandb",)):
        pytest.skip("wandb is installed here")
    out = tmp_path / "run"
    _refused(capsys, ["train", *SMALL, "--track", "wandb", "--out", str(out)], "--track wandb needs wandb")
    assert not out.exists()
    faults.record("failing early", "--track wandb without the extra")


def test_the_corrected_command_runs_after_an_early_failure(tmp_path, capsys, user_module, faults, tiny_model_dir):
    module = user_module(WORDS_REWARD)
    out = tmp_path / "run"
    _refused(capsys, ["train", *SMALL, "--reward", f"{module}:says_yes", "--out", str(out)])
    assert main(["train", *SMALL, "--steps", "1", "--out", str(out)]) == 0  # not "already holds a run"
    assert (out / "config.json").exists() and (out / "adapter").is_dir()
    faults.record("failing early", "the corrected sao train after a first-step failure (not refused)")


def test_a_recipe_whose_first_run_fails_leaves_out_as_it_was(tmp_path, capsys, user_module, faults, tiny_model_dir):
    module = user_module(WORDS_REWARD)
    out = tmp_path / "exp"
    argv = ["recipe", *SMALL, "--eval-samples", "1", "--base-evals", "2", "--reward", f"{module}:says_yes"]
    _refused(capsys, [*argv, "--out", str(out)], "it must return a number")
    assert not out.exists()
    faults.record("failing early", "sao recipe whose first run fails in its first step")


def test_a_failure_after_the_first_checkpoint_keeps_the_run(tmp_path):
    from sao.training import checkpoint

    out = tmp_path / "run"
    claim = checkpoint.claim(out, {}, resume=False)
    (out / "checkpoints" / "step-1").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    assert not claim.undo() and (out / "config.json").exists()  # --resume continues it
    assert not checkpoint.claim(tmp_path / "x", {}, resume=False).undo()  # nothing there: nothing to undo


def _free_port_in_use():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


SERVE_STARTS = {
    "a port in use": (lambda port: ["--port", str(port)], "cannot listen on 127.0.0.1"),
    "--port 99999": (lambda port: ["--port", "99999"], "--port"),
    "--port -1": (lambda port: ["--port", "-1"], "--port"),
    "--host 999.1.1.1": (lambda port: ["--host", "999.1.1.1", "--port", "0"], "--host 999.1.1.1"),
    "--host not this machine's": (lambda port: ["--host", "10.255.255.1", "--port", "0"], "cannot listen on"),
    "a missing model": (lambda port: ["--model", "/nonexistent/model", "--port", "0"], "/nonexistent/model"),
    "a bad --reward": (lambda port: ["--reward", "sao_no_such_module_26:score", "--port", "0"], "--reward"),
}


@pytest.mark.parametrize("case", sorted(SERVE_STARTS))
def test_a_server_that_cannot_start_creates_no_trace_log_or_lock(tmp_path, capsys, case, faults):
    pytest.importorskip("fastapi")
    flags, needle = SERVE_STARTS[case]
    busy = _free_port_in_use()
    try:
        log = tmp_path / "logs" / "traces.jsonl"
        _refused(capsys, ["serve", "--preset", "tiny", "--traces", str(log), *flags(busy.getsockname()[1])], needle)
    finally:
        busy.close()
    assert not any(tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))
    faults.record("failing early", f"sao serve start-up: {case}")
