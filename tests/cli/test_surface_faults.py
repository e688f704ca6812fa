"""Issue 26, the surfaces added last: a command that fails early leaves nothing behind, the trace log keeps its
integrity (locked by identity, torn tails cut, a replaced file read from its start, empty or odd logs refused,
unmatched feedback counted), and the server's edges (hosts and ports, overload, 5xx shapes, reloads, hang-ups).

Every refusal is asserted as the CLI's exit code 2 and one line on stderr with no traceback, or the server's
one-line OpenAI-shaped error, and nothing written or lost; each passing case records a row of the fault table.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from helpers import SMALL_RUN as SMALL
from helpers import refused_in_one_line, save_small_model
from sao.cli import main


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else {}


def _refused(capsys, argv: list[str], *needles: str) -> str:
    return refused_in_one_line(capsys, argv, None, *needles)


# --- failing early writes nothing ------------------------------------------------------------------------------

WORDS_REWARD = """
    def says_yes(completion, row):
        return "yes"
"""


@pytest.mark.parametrize("state", ["absent", "empty"])
def test_a_reward_that_fails_in_the_first_step_leaves_out_as_it_was(
    tmp_path, capsys, user_module, state, faults, tiny_model_dir
):
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
    from sao.core import run_folder

    out = tmp_path / "run"
    claim = run_folder.claim(out, {}, resume=False)
    (out / "checkpoints" / "step-1").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    assert not claim.undo() and (out / "config.json").exists()  # --resume continues it
    assert not run_folder.claim(tmp_path / "x", {}, resume=False).undo()  # nothing there: nothing to undo


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


# --- the trace log's integrity ---------------------------------------------------------------------------------


def _trajectory(i: int, **changes) -> dict:
    return {
        "id": f"r{i}",
        "policy_version": 0,
        "temperature": 1.0,
        "prompt_token_ids": [1, 70, 71],
        "completion_token_ids": [72, 73, 2],
        "logprobs": [-0.1, -0.2, -0.3],
        "reward": 1.0,
        **changes,
    }


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("link", ["symlink", "hard link", "same name"])
def test_a_second_writer_by_another_name_is_refused(tmp_path, link, faults):
    from sao.core.errors import ConfigError
    from sao.serve.tracelog import TraceLog, check_free

    path = tmp_path / "traces.jsonl"
    first = TraceLog(path)
    try:
        other = {"symlink": tmp_path / "alias.jsonl", "hard link": tmp_path / "twin.jsonl", "same name": path}[link]
        if link == "symlink":
            other.symlink_to(path)
        elif link == "hard link":
            os.link(path, other)
        for attempt in (lambda: check_free(other), lambda: TraceLog(other)):
            with pytest.raises(ConfigError, match="another sao serve is writing the trace log") as error:
                attempt()
            assert "\n" not in str(error.value)
        first.append_trajectory({"id": "c0"})
    finally:
        first.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["c0"]
    assert not list(tmp_path.glob("*.lock"))
    faults.record("trace log integrity", f"a second server on the same log by a {link}")


def test_a_short_write_is_cut_before_the_next_record(tmp_path, monkeypatch, faults):
    from sao.serve import tracelog

    log = tracelog.TraceLog(tmp_path / "traces.jsonl")
    real = os.write
    try:
        log.append_trajectory({"id": "c0"})
        monkeypatch.setattr(tracelog.os, "write", lambda fd, data: real(fd, data[: len(data) // 2]))  # a full disk
        with pytest.raises(OSError, match="short write"):
            log.append_trajectory({"id": "c1"})
        monkeypatch.setattr(tracelog.os, "write", real)
        log.append_trajectory({"id": "c2"})
        with open(log.path, "ab") as file:  # a torn tail left by a writer that crashed mid-line
            file.write(b'{"id": "c3", "poli')
        log.append_feedback("c2", 1.0)
    finally:
        log.close()
    lines = log.path.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines)
    assert [json.loads(line)["id"] for line in lines] == ["c0", "c2", "c2"]
    faults.record("trace log integrity", "a short write (full disk), then the next record")
    faults.record("trace log integrity", "a torn tail found before an append")


ODD_LOGS = {
    "an empty log": lambda tmp: (tmp / "empty.jsonl").touch() or tmp / "empty.jsonl",
    "/dev/null": lambda tmp: Path("/dev/null"),
    "a FIFO": lambda tmp: os.mkfifo(tmp / "fifo.jsonl") or tmp / "fifo.jsonl",
}


@pytest.mark.parametrize("case", sorted(ODD_LOGS))
def test_training_on_an_empty_or_odd_log_is_refused_in_one_line(tmp_path, capsys, case, faults, tiny_model_dir):
    log = ODD_LOGS[case](tmp_path)
    out = tmp_path / "run"
    needle = "is empty" if case == "an empty log" else "not a regular file"
    _refused(capsys, ["train", *SMALL, "--traces", str(log), "--out", str(out)], needle)
    assert not out.exists()
    faults.record("trace log integrity", f"sao train --traces on {case}")


@pytest.mark.parametrize("case", ["/dev/null", "a FIFO", "a folder"])
def test_serving_into_an_odd_log_is_refused(tmp_path, capsys, case, faults):
    pytest.importorskip("fastapi")
    log = {
        "/dev/null": lambda: Path("/dev/null"),
        "a FIFO": lambda: ODD_LOGS["a FIFO"](tmp_path),
        "a folder": lambda: tmp_path,
    }[case]()
    before = sorted(tmp_path.iterdir())
    _refused(capsys, ["serve", "--preset", "tiny", "--traces", str(log), "--port", "0"], "not a regular file")
    assert sorted(tmp_path.iterdir()) == before
    faults.record("trace log integrity", f"sao serve --traces {case}")


@pytest.fixture(scope="module")
def tokenizer():
    from sao.tiny import arithmetic as tiny

    return tiny.build_tokenizer()


def _source(path: Path, tokenizer, **settings):
    from sao.rollout.traces import TraceSource

    defaults = {
        "batch_size": 2,
        "max_staleness": 4,
        "temperature": 1.0,
        "vocab_size": len(tokenizer),
        "eos_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
        "poll_seconds": 0.01,
        "warn": lambda line: None,
    }
    return TraceSource(path, tokenizer, **{**defaults, **settings})


@pytest.mark.parametrize("size", ["shorter", "longer"])
def test_a_log_replaced_under_follow_is_read_from_its_start(tmp_path, tokenizer, size, faults):
    path = _write(tmp_path / "traces.jsonl", [_trajectory(0), _trajectory(1)])
    warnings: list[str] = []
    source = _source(path, tokenizer, follow=True, follow_timeout=5, warn=warnings.append)
    assert source.next_batch(0, "policy", 0).task_ids == ["r0", "r1"]
    fresh = [_trajectory(i) for i in range(10, 12 if size == "shorter" else 15)]
    _write(tmp_path / "new.jsonl", fresh).replace(path)  # rotated: another file at the same path
    assert source.next_batch(1, "policy", 0).task_ids == ["r10", "r11"]  # none skipped, no "not JSON"
    assert any("was replaced" in w for w in warnings)
    state = source.state_dict()
    again = _source(path, tokenizer, follow=True, follow_timeout=5)
    again.load_state_dict(json.loads(json.dumps(state)))  # what a checkpoint keeps, as JSON
    if size == "longer":
        assert again.next_batch(2, "policy", 0).task_ids == ["r12", "r13"]  # resumed where it was, not from 0
    faults.record("trace log integrity", f"--follow on a log replaced by a {size} file")


def test_feedback_for_ids_never_logged_is_counted(tmp_path, tokenizer, faults):
    records = [
        _trajectory(0),
        _trajectory(1, reward=None),
        {"type": "feedback", "id": "r1", "reward": 0.5},
        {"type": "feedback", "id": "ghost", "reward": 1.0},
        {"type": "feedback", "id": "other", "reward": 0.0},
    ]
    records[1].pop("reward")
    source = _source(_write(tmp_path / "traces.jsonl", records), tokenizer)
    from sao.rollout.sources import SourceExhausted

    source.next_batch(0, "policy", 0)
    with pytest.raises(SourceExhausted):
        source.next_batch(1, "policy", 0)  # the log read to its end
    summary = source.summary()
    assert summary["traces_feedback_unmatched"] == 2 and summary["traces_feedback_used"] == 1
    from sao.cli import summarize_traces

    assert "feedback for unknown ids 2" in summarize_traces(summary)
    faults.record("trace log integrity", "feedback for ids the log never held (counted in traces.json)")


# --- the server's edges ----------------------------------------------------------------------------------------

PROMPT = [{"role": "user", "content": "What is 3+4?"}]


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A server on a random one-layer model with the tiny tokenizer (built in a second), stopped at the end."""
    pytest.importorskip("fastapi")

    from sao.core.config import Config
    from sao.serve.server import Server

    folder = save_small_model(tmp_path_factory.mktemp("small-model"))
    root = tmp_path_factory.mktemp("serve")
    settings = Config(model=str(folder), data="tiny", lora_rank=4, lora_alpha=8, max_new_tokens=4, seed=5)
    server = Server(settings, root / "traces.jsonl", say=lambda line: None).start()
    try:
        yield server
    finally:
        server.stop()


def _post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_overload_is_an_openai_shaped_503_once_the_queue_bound_is_reached(small_server, monkeypatch, faults):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    service = small_server.service
    monkeypatch.setattr(service.settings, "max_waiting", 3)  # the bound, made small to reach
    release, real = threading.Event(), service.policy.generate

    def slow(*args, **kwargs):
        release.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(service.policy, "generate", slow)
    before = service.log.records
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_post, small_server.url, {"messages": PROMPT}) for _ in range(8)]
        deadline = time.monotonic() + 20
        while sum(f.done() for f in futures) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()
        results = [f.result() for f in futures]
    refused = [reply for code, reply in results if code == 503]
    assert len(refused) == 5 and sum(code == 200 for code, _ in results) == 3
    assert all(r["error"]["code"] == "overloaded" and r["error"]["type"] == "server_error" for r in refused)
    assert service.log.records == before + 3  # every answered reply logged, no refused one
    faults.record("server edges", "8 concurrent requests against a queue bound of 3 (5 refused)")


def test_a_failure_while_serving_is_an_openai_shaped_500_and_one_line(small_server, monkeypatch, capfd, faults):
    def full_disk(record, sync=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(small_server.service.log, "append_trajectory", full_disk)
    code, reply = _post(small_server.url, {"messages": PROMPT})
    assert code == 500 and reply["error"]["type"] == "server_error" and "No space left" in reply["error"]["message"]
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    monkeypatch.undo()
    assert _post(small_server.url, {"messages": PROMPT})[0] == 200  # and it stays up
    faults.record("server edges", "the trace log failing while serving (a full disk)")


def test_a_client_that_hangs_up_mid_body_is_one_line_on_stderr(small_server, capfd, faults):
    body = json.dumps({"messages": PROMPT}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    before = small_server.log.records
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", small_server.port), timeout=30) as sock:
            sock.sendall(head + body[:10])
    deadline = time.monotonic() + 10
    err = ""
    while err.count("hung up") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all("hung up after 10 bytes" in line for line in lines) and "Traceback" not in err
    assert _post(small_server.url, {"messages": PROMPT})[0] == 200 and small_server.log.records == before + 1
    faults.record("server edges", "3 clients hanging up mid-body")


def test_a_half_written_adapter_is_waited_for_then_served(small_server, tmp_path, faults):
    from sao.serve.served import ADAPTER_WEIGHTS, AdapterWatcher

    policy = small_server.policy
    said: list[str] = []
    watcher = AdapterWatcher(policy, tmp_path / "run", say=said.append)
    folder = tmp_path / "run" / "published" / "v5"
    folder.mkdir(parents=True)
    whole = tmp_path / "whole"
    policy.models.policy.save_pretrained(whole)  # the live adapter, as the trainer would publish it
    data = next(whole.rglob(ADAPTER_WEIGHTS)).read_bytes()
    config = next(whole.rglob("adapter_config.json"))
    (folder / config.name).write_bytes(config.read_bytes())
    (folder / ADAPTER_WEIGHTS).write_bytes(data[: len(data) // 2])  # still being written
    (folder.parent / "LATEST.json").write_text(json.dumps({"version": 5, "path": "v5"}))
    version = policy.version
    for _ in range(3):
        assert watcher.poll() is False  # no exception, nothing said within the grace period
    assert said == [] and policy.version == version
    (folder / ADAPTER_WEIGHTS).write_bytes(data)  # the write finished
    assert watcher.poll() is True and policy.version == 5
    assert len(said) == 1 and "serving adapter v5" in said[0]
    watcher.grace = 0.0
    (folder.parent / "LATEST.json").write_text(json.dumps({"version": 6, "path": "v5-broken"}))
    for _ in range(3):
        watcher.poll()
    assert sum("cannot load v6" in line for line in said) == 1  # a publication that stays broken: said once
    faults.record("server edges", "--watch on a half-written adapter (waited for, then served)")
