"""``sao serve``: the OpenAI-shaped endpoint, its refusals, the exactness of its log-probabilities against the
teacher-forced pass (version 0 and a published adapter), the trace log, feedback, a client that hangs up,
and a restart.

Most tests run on a random one-layer model with the tiny tokenizer (built in a second, so they stay in the fast
suite); the loop with the trainer (tests marked slow) uses the tiny model. Every server listens on an
ephemeral 127.0.0.1 port and is stopped in a fixture's teardown; every request has a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from helpers import save_small_model
from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.serve.tracelog import OPEN, REWARDED, UNKNOWN, TraceLog

TIMEOUT = 30
PROMPT = [{"role": "user", "content": "What is 3+4?\n\nEnd with #### N."}]
TRAJECTORY_FIELDS = {
    "id",
    "policy_version",
    "temperature",
    "messages",
    "prompt_token_ids",
    "completion_token_ids",
    "logprobs",
    "finish_reason",
    "adapter",
    "created",
    "model",
}


# -- helpers ----------------------------------------------------------------------------------------------------


def request(url: str, path: str, body=None, *, raw: bytes | None = None, method: str | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(url: str, **fields):
    return request(url, "/v1/chat/completions", {"model": "m", "messages": PROMPT, "logprobs": True, **fields})


def read_log(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "every line is written whole"
    return [json.loads(line) for line in data.splitlines()]


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    """A random one-layer Qwen2 with the tiny task's tokenizer (byte-level, ChatML): a model in a second."""

    return save_small_model(tmp_path_factory.mktemp("small-model"))


def small_config(model_dir: Path) -> Config:
    return Config(model=str(model_dir), data="tiny", lora_rank=4, lora_alpha=8, max_new_tokens=12, seed=5)


@pytest.fixture(scope="module")
def served(small_model_dir, tmp_path_factory):
    """One server for the module, watching an empty run folder; stopped at the end whatever happened."""
    from sao.serve.server import Server

    root = tmp_path_factory.mktemp("serve")
    server = Server(
        small_config(small_model_dir),
        root / "traces.jsonl",
        watch=root / "run",
        poll_interval=0.1,
        say=lambda line: None,
    ).start()
    try:
        yield server
    finally:
        server.stop()


def reference_models(model_dir: Path):
    """The trainer's own construction of the policy (``Models.load`` with the config's settings)."""
    from sao.model.policy import Models

    c = small_config(model_dir)
    return Models.load(
        str(model_dir), device="cpu", lora_rank=c.model.lora_rank, lora_alpha=c.model.lora_alpha, seed=c.training.seed
    )


def teacher_forced_logprobs(policy, prompt_ids: list[int], completion_ids: list[int], temperature: float):
    from sao.model.forward import teacher_forced

    prompt = torch.tensor([prompt_ids])
    response = torch.tensor([completion_ids])
    with torch.no_grad():
        out = teacher_forced(
            policy,
            prompt,
            torch.ones_like(prompt, dtype=torch.bool),
            response,
            torch.ones_like(response, dtype=torch.bool),
            temperature=temperature,
        )
    return out.logprobs[0]


def wait_for_version(url: str, version: int, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if request(url, "/health")[1]["policy_version"] == version:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server did not pick up v{version} within {seconds} s")


# -- refusals ------------------------------------------------------------------------------------------------------


BAD = [
    ({"messages": PROMPT, "temperature": 0}, 400, "temperature must be > 0"),
    ({"messages": PROMPT, "temperature": -1.0}, 400, "temperature must be > 0"),
    ({"messages": PROMPT, "temperature": "hot"}, 400, "temperature must be a number"),
    ({"model": "m"}, 400, "messages is missing"),
    ({"messages": "hello"}, 400, "messages must be a non-empty list"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content must be a string"),
    ({"messages": PROMPT, "max_tokens": 10_000}, 400, "max_tokens must be between 1 and 12"),
    ({"messages": PROMPT, "max_completion_tokens": 0}, 400, "max_tokens must be between 1 and 12"),
    ({"messages": PROMPT, "max_tokens": 3.5}, 400, "max_tokens must be an integer"),
    ({"messages": PROMPT, "n": 2}, 400, "n must be 1"),
    ({"messages": PROMPT, "stream": True}, 400, "stream=true is not supported"),
    ({"messages": PROMPT, "top_logprobs": 3}, 400, "top_logprobs must be 0"),
    ({"messages": PROMPT, "top_p": 0.9}, 400, "top_p=0.9 is not supported"),
    ({"messages": PROMPT, "stop": ["\n"]}, 400, 'stop=["\\n"] is not supported'),
    ({"messages": PROMPT, "temprature": 0.5}, 400, "unknown field 'temprature'"),
    ({"messages": PROMPT, "logprobs": "yes"}, 400, "logprobs must be true or false"),
    ({"messages": PROMPT, "seed": -1}, 400, "seed must be between"),
    ({"messages": PROMPT, "metadata": {"question": "no answer"}}, 400, 'metadata needs an "answer"'),
    ({"messages": PROMPT, "metadata": []}, 400, "metadata must be a non-empty JSON object"),
    ([1, 2], 400, "the body must be a JSON object"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD, ids=[m[:30] for _, _, m in BAD])
def test_a_bad_request_is_a_4xx_in_openai_shape_with_one_line(served, body, status, message):
    code, reply = request(served.url, "/v1/chat/completions", body)
    assert code == status
    error = reply["error"]
    assert message in error["message"] and "\n" not in error["message"]
    assert set(error) == {"message", "type", "code"}


def test_malformed_bodies_routes_and_methods_are_4xx(served):
    code, reply = request(served.url, "/v1/chat/completions", raw=b'{"messages": [')
    assert code == 400 and "not valid JSON" in reply["error"]["message"]
    # Declared too large: the server answers 413 from the header without reading the body (a client still
    # sending a megabyte would see the connection close under it), so only the header goes out.
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {(1 << 20) + 10}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", served.port), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode())
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.split()[1] == b"413" and "over" in json.loads(body)["error"]["message"]
    code, reply = request(served.url, "/v1/nothing", {})
    assert code == 404 and reply["error"]["code"] == "not_found"
    code, reply = request(served.url, "/v1/chat/completions", method="GET")
    assert code == 405 and "GET" in reply["error"]["message"]
    assert request(served.url, "/health")[1]["status"] == "ok"
    assert request(served.url, "/v1/models")[1]["data"][0]["id"] == str(served.service.settings.model_name)


# -- exactness ------------------------------------------------------------------------------------------------------


def test_logprobs_equal_teacher_forced_at_v0_and_after_a_published_adapter(served, small_model_dir):
    from sao.model.artifacts import save_adapter
    from sao.model.policy import lora_state

    reference = reference_models(small_model_dir)  # the trainer's version 0, built independently of the server
    code, v0 = chat(served.url, temperature=0.7, seed=11, max_tokens=12)
    assert code == 200 and v0["sao"]["policy_version"] == 0
    recorded = torch.tensor([t["logprob"] for t in v0["choices"][0]["logprobs"]["content"]])
    v0_trace = read_log(served.log.path)[-1]["logprobs"]
    assert recorded.tolist() == v0_trace  # the response and the log carry the same numbers
    expected = teacher_forced_logprobs(
        reference.policy, v0["sao"]["prompt_token_ids"], v0["sao"]["completion_token_ids"], 0.7
    )
    assert (recorded - expected).abs().max().item() < 1e-5  # |log r| under 1e-5 in float32
    assert len(v0_trace) == len(v0["sao"]["completion_token_ids"]) == v0["usage"]["completion_tokens"]

    with torch.no_grad():  # a non-trivial adapter: B moved away from 0, A kept
        for name, tensor in lora_state(reference.policy).items():
            if "lora_B" in name:
                tensor.normal_(0, 0.5, generator=torch.Generator().manual_seed(hash(name) % 1000))
    published = Path(served.watcher.run) / "published"
    save_adapter(reference.policy, reference.tokenizer, reference.value_head, published / "v1", base_model="small")
    (published / "LATEST.tmp").write_text(json.dumps({"version": 1, "path": "v1"}))
    os.replace(published / "LATEST.tmp", published / "LATEST.json")
    wait_for_version(served.url, 1)

    code, v1 = chat(served.url, temperature=0.7, seed=11, max_tokens=12)
    assert code == 200 and v1["sao"]["policy_version"] == 1
    assert read_log(served.log.path)[-1]["policy_version"] == 1
    recorded = torch.tensor([t["logprob"] for t in v1["choices"][0]["logprobs"]["content"]])
    expected = teacher_forced_logprobs(
        reference.policy, v1["sao"]["prompt_token_ids"], v1["sao"]["completion_token_ids"], 0.7
    )
    assert (recorded - expected).abs().max().item() < 1e-5
    # the adapter really changed the distribution: the same seed draws differently or scores differently
    before = teacher_forced_logprobs(
        reference_models(small_model_dir).policy, v1["sao"]["prompt_token_ids"], v1["sao"]["completion_token_ids"], 0.7
    )
    assert (before - expected).abs().max().item() > 1e-2


def test_a_broken_publication_keeps_the_served_version(served, small_model_dir):
    published = Path(served.watcher.run) / "published"
    published.mkdir(parents=True, exist_ok=True)
    version = served.policy.version
    (published / "LATEST.json").write_text(json.dumps({"version": version + 7, "path": "missing"}))
    assert served.watcher.poll() is False
    assert request(served.url, "/health")[1]["policy_version"] == version
    assert chat(served.url)[0] == 200


# -- the trace log, feedback ----------------------------------------------------------------------------------------


def test_trace_lines_are_whole_and_follow_the_contract(served):
    eos = served.policy.models.eos_token_ids
    replies = [
        chat(served.url, seed=s, max_tokens=3 + s % 9, metadata={"answer": "7"} if s % 2 else None)[1] for s in range(8)
    ]
    assert len({r["id"] for r in replies}) == 8 and all(r["id"].startswith("cmpl-") for r in replies)
    by_id = {r["id"]: r for r in read_log(served.log.path)}
    for reply in replies:
        record = by_id[reply["id"]]
        assert set(record) >= TRAJECTORY_FIELDS and "type" not in record
        assert record["policy_version"] == reply["sao"]["policy_version"] >= 0
        assert record["temperature"] == 1.0 and record["messages"] == PROMPT
        assert record["completion_token_ids"] == reply["sao"]["completion_token_ids"]
        assert len(record["logprobs"]) == len(record["completion_token_ids"]) >= 1
        assert all(lp <= 0 for lp in record["logprobs"])
        stopped = record["finish_reason"] == "stop"
        assert stopped == (record["completion_token_ids"][-1] in eos)  # EOS is kept, with its log-probability
        assert reply["choices"][0]["finish_reason"] == record["finish_reason"]
        if "reward" in record:
            assert record["task"] == {"answer": "7"} and record["reward"] in (0.0, 1.0)
            assert reply["sao"]["reward"] == record["reward"]
        else:
            assert "task" not in record


def test_feedback_once_per_known_id(served):
    _, plain = chat(served.url)
    _, graded = chat(served.url, metadata={"answer": 7})
    assert request(served.url, "/v1/feedback", {"id": plain["id"], "reward": 0.5}) == (
        200,
        {"id": plain["id"], "reward": 0.5, "object": "feedback"},
    )
    assert read_log(served.log.path)[-1] == {"type": "feedback", "id": plain["id"], "reward": 0.5}
    code, reply = request(served.url, "/v1/feedback", {"id": plain["id"], "reward": 1})
    assert code == 409 and "already has a reward" in reply["error"]["message"]
    assert request(served.url, "/v1/feedback", {"id": graded["id"], "reward": 1})[0] == 409  # graded by its task
    assert request(served.url, "/v1/feedback", {"id": "cmpl-nope", "reward": 1})[0] == 404
    assert request(served.url, "/v1/feedback", {"id": plain["id"], "reward": "good"})[0] == 400
    assert request(served.url, "/v1/feedback", {"id": plain["id"], "reward": 1, "why": "x"})[0] == 400
    assert request(served.url, "/v1/feedback", raw=b"{nope")[0] == 400


def test_the_server_survives_clients_that_hang_up(served):
    before = served.log.records
    body = json.dumps({"messages": PROMPT, "max_tokens": 12}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    for payload in (head + body, head + body[:10], b"POST /v1/chat/comp"):  # whole, half a body, half a line
        with socket.create_connection(("127.0.0.1", served.port), timeout=TIMEOUT) as sock:
            sock.sendall(payload)
        # closed at once, before any reply
    code, reply = chat(served.url)
    assert code == 200 and reply["choices"][0]["message"]["role"] == "assistant"
    deadline = time.monotonic() + 10
    while served.log.records < before + 2 and time.monotonic() < deadline:  # the whole request was still served
        time.sleep(0.05)
    assert served.log.records == before + 2
    read_log(served.log.path)


def test_a_restart_keeps_the_log_and_the_feedback_index(small_model_dir, tmp_path):
    from sao.serve.server import Server

    log = tmp_path / "traces.jsonl"
    config = small_config(small_model_dir)
    first = Server(config, log, say=lambda line: None).start()
    try:
        ids = [chat(first.url, seed=s)[1]["id"] for s in range(3)]
        assert request(first.url, "/v1/feedback", {"id": ids[0], "reward": 1.0})[0] == 200
        with pytest.raises(ConfigError, match="another sao serve"):
            Server(config, log, say=lambda line: None)
    finally:
        first.stop()
    lines = log.read_bytes()
    with open(log, "ab") as file:
        file.write(b'{"id": "cmpl-torn", "policy_ver')  # a write cut by a crash
    second = Server(config, log, say=lambda line: None).start()
    try:
        assert second.log.torn_bytes > 0 and second.log.records == 3
        assert request(second.url, "/v1/feedback", {"id": ids[0], "reward": 0.0})[0] == 409
        assert request(second.url, "/v1/feedback", {"id": ids[1], "reward": 0.0})[0] == 200
        assert request(second.url, "/v1/feedback", {"id": "cmpl-torn", "reward": 0.0})[0] == 404
        assert chat(second.url)[0] == 200
    finally:
        second.stop()
    records = read_log(log)
    assert log.read_bytes().startswith(lines) and len(records) == 3 + 1 + 1 + 1


# -- pieces ---------------------------------------------------------------------------------------------------------


def test_trace_log_index_is_bounded_and_rebuilt(tmp_path):
    log = TraceLog(tmp_path / "t.jsonl", max_ids=2)
    try:
        for i in range(3):
            log.append_trajectory({"id": f"c{i}", "logprobs": []})
        assert log.status("c0") == UNKNOWN and log.status("c2") == OPEN
        log.append_feedback("c2", 1.0)
        assert log.status("c2") == REWARDED
        with pytest.raises(ValueError):
            log.append_trajectory({"id": "c2"})
    finally:
        log.close()
    (tmp_path / "t.jsonl").open("ab").write(b"not json\n")
    again = TraceLog(tmp_path / "t.jsonl", max_ids=10)
    try:
        assert again.records == 3 and again.bad_lines == 1
        assert [again.status(i) for i in ("c0", "c1", "c2")] == [OPEN, OPEN, REWARDED]
    finally:
        again.close()


def test_loopback_only_unless_asked(capsys):
    from sao.serve.server import is_loopback, serve

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")
    with pytest.raises(ConfigError, match="pass --host explicitly"):
        serve(Config.load("tiny"), "unused.jsonl", host="0.0.0.0", host_given=False, port=0)


def test_the_cli_lists_serve_and_its_options():
    from sao.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--preset", "tiny", "--traces", "t.jsonl", "--port", "0", "--threads", "2"])
    assert args.func.__name__ == "_serve" and args.traces == "t.jsonl" and args.threads == 2 and args.host is None


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    import importlib.util

    from sao.serve.server import ensure_serve_extra

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(ConfigError, match=r"sao serve needs uvicorn: pip install 'sao\[serve\]'"):
        ensure_serve_extra()


# -- the loop with the trainer (slow: the tiny model, three processes) ----------------------------------------------


def test_the_agent_loop_survives_kills_spans_versions_holds_back_a_broken_adapter_and_rolls_back_a_regression(
    tiny_model_dir, tmp_path, monkeypatch
):
    """bench/serve_loop.py --agent, as it will be used: the tiny-calc agent with a calculator that sleeps, served by
    sao serve (an action per request), each episode logged whole by the agent harness with each action's adapter
    version, sao train --follow learning from that log behind the gate, the server reloading what it publishes;
    the server and the trainer each SIGKILLed once. Candidates 5..14 are broken (LoRA B ×50) and must be held back;
    candidate 15 is a copy of the best adapter served, so the gate publishes it whatever training did meanwhile (the
    later ones are broken, so it stays served), and it is made to regress on live traffic (its episodes earn 0): it
    must be rolled back to the version before it. Episodes in flight across a reload span versions; every logged
    episode is accounted for once."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "serve_loop.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its client, bench/serve_client.py, beside it
    spec = importlib.util.spec_from_file_location("sao_serve_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    settings = (
        "--agent --requests 192 --batch-size 8 --critic-warmup 1 --follow-timeout 20 --max-seconds 300 "
        "--tool-seconds 1.0 --agent-concurrency 12 --gate-margin 0.2 --gate-alpha 0.2 --gate-tasks 24 "
        "--break-versions 5-14 --clone-served 15 --break-after 15 --regress-version 15 --max-staleness 300 "
        "--until-rollback 640"
    )
    result = module.Loop(module.parse(["--out", str(tmp_path / "loop"), *settings.split()])).main()
    assert result["nothing_lost"] and result["nothing_used_twice"], result
    assert result["accounted"] == result["trajectories_logged"] == result["replies_answered"] >= 192
    assert any("while it ran" in event for event in result["events"])  # the trainer was killed mid-run
    by_kind = {
        kind: [d for d in result["gate"] if d["decision"] == kind] for kind in ("published", "held_back", "rolled_back")
    }
    held = {d["version"] for d in by_kind["held_back"]}
    bound = [min(d["lower"], d.get("best_lower", d["lower"])) for d in by_kind["held_back"]]
    assert set(range(5, 15)) <= held and all(b <= -0.2 for b in bound), result["gate"]
    (rollback,) = by_kind["rolled_back"]
    assert rollback["version"] == 15 and rollback["upper"] < -0.2, rollback
    assert rollback["version"] in {d["version"] for d in by_kind["published"]}
    assert result["spanning_episodes"] >= 1 and len(result["token_staleness_hist"]) > 1, result
    records = read_log(tmp_path / "loop" / "traces.jsonl")  # the server's own log: one record a request
    stopped = [r for r in records if r["finish_reason"] == "stop"]
    assert stopped and all(r["completion_token_ids"][-1] == 2 for r in stopped)  # <|im_end|>, with its log-prob
