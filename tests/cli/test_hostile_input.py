"""Issue 26, items 1-4, as a careless or hostile user would meet them: documents built to exhaust a reader,
numbers that are not numbers, more tokens than the model's context, and plug-ins that raise, exit or hang.

Every refusal is one line (on stderr with exit code 2, or a 4xx/5xx in OpenAI's error shape) naming the file,
line and field or the plug-in and the row, with no traceback and nothing written; what can go on (a damaged
trace line under --skip-bad-traces, a trajectory past its timeout or its context) is cut and counted.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import refused_in_one_line, save_small_model
from sao.cli import main
from sao.core.errors import ConfigError, DataError
from sao.core.plugins import PluginError, PluginTimeout
from sao.core.reading import REWARD_LIMIT, reward_problem
from sao.rollout.environment import checked_step
from sao.rollout.episodes import draw_episodes
from sao.rollout.sampler import PlainDecoder
from sao.rollout.sources import SourceExhausted
from sao.rollout.traces import TraceSource
from sao.tasks.base import Scorer

DEEP = "[" * 100_000
LONG_INT = "7" * 5000


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def refused(capsys, argv: list[str], folder: Path, *needles: str) -> str:
    return refused_in_one_line(capsys, argv, folder, *needles)


def one_line(message: str, *needles: str) -> None:
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, message


# --- 1. hostile documents -------------------------------------------------------------------------------------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)
CONFIGS = {
    "deep yaml": ("c.yaml", "lr: " + DEEP, "nested deeper than 64"),
    "deep json": ("c.json", '{"lr": ' + DEEP, "nested deeper than 64"),
    "long integer yaml": ("c.yaml", "seed: " + LONG_INT, "an integer of 5000 digits"),
    "long integer json": ("c.json", '{"seed": ' + LONG_INT + "}", "field 'seed': an integer of 5000 digits"),
    "NaN json": ("c.json", '{"lr": NaN}', "NaN is not a number"),
    "1e400 json": ("c.json", '{"lr": 1e400}', "beyond the range of a float"),
    "alias bomb": ("c.yaml", ALIAS_BOMB, "once its aliases are expanded"),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_a_hostile_config_file_is_one_line_naming_the_file_and_writes_nothing(tmp_path, capsys, case, faults):
    name, text, needle = CONFIGS[case]
    (tmp_path / name).write_text(text)
    out = tmp_path / "run"
    refused(capsys, ["train", "--config", str(tmp_path / name), "--out", str(out)], out, name, needle)
    faults.record("hostile documents", f"--config: {case}")


DATA = {
    "deep line": ('{"question": ' + DEEP, "line 2: nested deeper than 64"),
    "long integer": ('{"question": "q", "answer": ' + LONG_INT + "}", "line 2: field 'answer': an integer of 5000"),
    "1e400": ('{"question": "q", "answer": 1e400}', "line 2: field 'answer': '1e400' is beyond the range of a float"),
}


@pytest.mark.parametrize("case", DATA)
def test_a_hostile_data_record_is_one_line_naming_file_line_and_field(tmp_path, capsys, case, faults, tiny_model_dir):
    line, needle = DATA[case]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n" + line + "\n")
    out = tmp_path / "run"
    refused(capsys, ["train", "--preset", "tiny", "--data", str(data), "--out", str(out)], out, "rows.jsonl", needle)
    faults.record("hostile documents", f"--data: {case}")


@pytest.mark.parametrize("case", ["deep", "long integer"])
def test_report_on_a_hostile_results_json_is_one_line(tmp_path, capsys, case, faults):
    folder = tmp_path / "exp"
    folder.mkdir()
    body = '{"cells": ' + DEEP if case == "deep" else '{"cells": [], "seed": ' + LONG_INT + "}"
    (folder / "results.json").write_text(body)
    (folder / "train_log.json").write_text("[]")
    refused(capsys, ["report", str(folder)], folder, "results.json is not readable JSON")
    faults.record("hostile documents", f"report: results.json {case}")


def test_a_plan_citing_a_hostile_run_is_one_line(tmp_path, capsys, faults):
    plan = (Path(__file__).resolve().parents[2] / "docs" / "confirm-tiny" / "plan.yaml").read_text()
    plan = plan.replace(
        "exploratory: [../sweep-tiny/sweep.json, ../sweep-tiny-lr2e-3/sweep.json]", "exploratory: [cited.json]"
    )
    (tmp_path / "plan.yaml").write_text(plan)
    (tmp_path / "cited.json").write_text('{"seeds": ' + DEEP)
    out = tmp_path / "out"
    refused(
        capsys,
        ["confirm", str(tmp_path / "plan.yaml"), "--out", str(out)],
        out,
        "exploratory cited.json",
        "nested deeper than 64",
    )
    faults.record("hostile documents", "confirm: a cited run nested deep")


def test_a_saved_file_nested_deep_is_damaged_in_one_line(tmp_path, faults):
    from sao.core.io import DamagedFileError, read_saved_json

    for body, needle in ((DEEP, "nested deeper"), ('{"a": ' + LONG_INT + "}", "field 'a': an integer of 5000")):
        (tmp_path / "config.json").write_text(body)
        with pytest.raises(DamagedFileError) as error:
            read_saved_json(tmp_path / "config.json", "restore it", expect=dict)
        one_line(str(error.value), "config.json is damaged", needle, "restore it")
    faults.record("hostile documents", "a saved config.json nested deep or holding a long integer")


@pytest.fixture(scope="module")
def tokenizer():
    from sao.tiny import arithmetic as tiny

    return tiny.build_tokenizer()


def trace(i: int, **changes) -> dict:
    record = {
        "id": f"r{i}",
        "policy_version": 0,
        "temperature": 1.0,
        "prompt_token_ids": [1, 70, 71],
        "completion_token_ids": [72, 73, 2],
        "logprobs": [-0.1, -0.2, -0.3],
        "reward": 1.0,
    }
    return {**record, **changes}


def trace_source(path: Path, tokenizer, **settings) -> TraceSource:
    defaults = {
        "batch_size": 2,
        "max_staleness": 4,
        "temperature": 1.0,
        "vocab_size": len(tokenizer),
        "eos_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
    }
    return TraceSource(path, tokenizer, **{**defaults, **settings})


def write_log(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def drain(source: TraceSource) -> list:
    batches = []
    with pytest.raises(SourceExhausted):
        while True:
            batches.append(source.next_batch(len(batches), "policy", 0))
    return batches


BAD_TRACES = {
    "nested deep": ('{"id": ' + DEEP, "field 'record': nested deeper than 16"),
    "long integer": (
        json.dumps(trace(1))[:-1] + ', "created": ' + LONG_INT + "}",
        "field 'created': an integer of 5000 digits",
    ),
    "NaN reward": (json.dumps(trace(1))[:-1] + ', "reward": NaN}', "field 'reward': NaN is not a number"),
    "reward past the rule": (trace(1, reward=1e300), "field 'reward': a reward must be a finite number"),
    "feedback past the rule": ({"type": "feedback", "id": "r0", "reward": -1e7}, "field 'reward'"),
    "temperature 1e-300": (trace(1, temperature=1e-300), "field 'temperature': is 1e-300"),
}


@pytest.mark.parametrize("case", BAD_TRACES)
def test_a_hostile_trace_line_stops_in_one_line_or_is_skipped_and_resumed_past(tmp_path, tokenizer, case, faults):
    line, needle = BAD_TRACES[case]
    lines = [trace(0), line, *(trace(i) for i in range(2, 6))]
    path = write_log(tmp_path / "log.jsonl", lines)
    before = path.read_bytes()
    with pytest.raises(DataError) as error:
        drain(trace_source(path, tokenizer))
    one_line(str(error.value), f"{path}:2: {needle}", "--skip-bad-traces")
    # The run stopped there resumes past the line with --skip-bad-traces (--resume reloads the source's state from
    # the checkpoint before the failing step: here the state before the first batch), using nothing twice.
    resumed = trace_source(path, tokenizer, skip_bad=True)
    resumed.load_state_dict(trace_source(path, tokenizer).state_dict())
    used = [i for b in drain(resumed) for i in b.task_ids]
    assert resumed.counts["dropped_bad_record"] == 1
    assert used + [t.id for t in resumed.ready] == ["r0", "r2", "r3", "r4", "r5"]
    assert path.read_bytes() == before, "the log is only read"
    faults.record("hostile documents", f"trace line: {case}")
    if case in ("reward past the rule", "feedback past the rule", "NaN reward"):
        faults.record("numbers from outside", f"trace: {case}")


def test_a_plan_asking_for_a_trillion_seeds_is_one_line(tmp_path, capsys, faults):
    plan = (Path(__file__).resolve().parents[2] / "docs" / "confirm-tiny" / "plan.yaml").read_text()
    for seeds, needle in (
        ("{first: 1001, count: 1000000000000}", "1 <= count <= 10000"),
        ("[1, 99999999999999999999]", "from 0 to 2**63 - 1"),
    ):
        text = plan.replace("seeds: {first: 1001, count: 16}", f"seeds: {seeds}")
        (tmp_path / "plan.yaml").write_text(text.replace("exploratory: [", "exploratory: [] #"))
        out = tmp_path / "out"
        refused(capsys, ["confirm", str(tmp_path / "plan.yaml"), "--out", str(out)], out, "plan", needle)
        faults.record("numbers from outside", f"plan seeds {seeds}")


# --- 2. numbers from outside: one rule for every reward -------------------------------------------------------

NOT_REWARDS = {
    "the string '1'": "1",
    "None": None,
    "NaN": float("nan"),
    "inf": float("inf"),
    "1e300": 1e300,
    "10**400": 10**400,
    "true": True,
    "a list": [1.0],
}


@pytest.mark.parametrize("case", NOT_REWARDS)
def test_a_reward_function_and_an_environment_refuse_the_same_values(case, faults):
    value = NOT_REWARDS[case]
    assert reward_problem(value) is not None
    scorer = Scorer(lambda completion, row: value, name="mine:reward")
    with pytest.raises(ConfigError) as error:
        scorer.score(["x"], [{"id": "t/1"}])
    one_line(str(error.value), "reward mine:reward", "for t/1")
    with pytest.raises(PluginError) as error:
        checked_step({"observations": [], "reward": value, "done": True}, "environment mine:Env", "t/1")
    one_line(str(error.value), "environment mine:Env (step) on t/1: a reward must be")
    faults.record("numbers from outside", f"reward {case} from a --reward function and an environment")


def test_the_reward_rule_takes_real_numbers_up_to_its_limit():
    for value in (0, 1, -1.5, REWARD_LIMIT, -REWARD_LIMIT, 3):
        assert reward_problem(value) is None
    assert reward_problem(REWARD_LIMIT * 1.01) is not None


# --- 3 and 4: the server ---------------------------------------------------------------------------------------


def _serve_fixtures():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A random one-layer model with 256 positions behind sao serve, its reward a plug-in that misbehaves on
    request (metadata.mode), with a 0.5 s reward timeout."""
    _serve_fixtures()

    from sao.core.config import Config
    from sao.serve.server import Server

    root = tmp_path_factory.mktemp("hostile-serve")
    save_small_model(root / "model")
    (root / "plugin_rewards.py").write_text(
        "import sys, time\n"
        "def reward(completion, row):\n"
        "    mode = row.get('mode')\n"
        "    if mode == 'raise': raise RuntimeError('the judge is down')\n"
        "    if mode == 'exit': sys.exit(0)\n"
        "    if mode == 'hang': time.sleep(5)\n"
        "    if mode == 'garbage': return 'yes'\n"
        "    return 1.0\n"
    )
    sys.path.insert(0, str(root))
    try:
        settings = Config(
            model=str(root / "model"),
            data="tiny",
            lora_rank=4,
            lora_alpha=8,
            max_new_tokens=12,
            seed=5,
            reward="plugin_rewards:reward",
            reward_timeout=0.5,
        )
        server = Server(settings, root / "traces.jsonl", say=lambda line: None).start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("plugin_rewards", None)


def _post(url: str, path: str, raw: bytes):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _chat(server, **fields) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "What is 3+4?"}], **fields}
    return _post(server.url, "/v1/chat/completions", json.dumps(body).encode())


def _openai_error(reply: dict, *needles: str) -> None:
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "code"}, reply
    one_line(reply["error"]["message"], *needles)


PROMPT_JSON = '{"messages": [{"role": "user", "content": "hi"}]'
BODIES = {
    "nested deep": (PROMPT_JSON + ', "metadata": ' + DEEP + "}", "the body: nested deeper than 32"),
    "long integer answer": (
        PROMPT_JSON + ', "metadata": {"answer": ' + "9" * 401 + "}}",
        "field 'metadata.answer': an integer of 401 digits",
    ),
    "NaN answer": (PROMPT_JSON + ', "metadata": {"answer": NaN}}', "NaN is not a number"),
    "1e400 answer": (PROMPT_JSON + ', "metadata": {"answer": 1e400}}', "beyond the range of a float"),
    "temperature 1e-300": (PROMPT_JSON + ', "temperature": 1e-300}', "temperature must be from 0.001 to 1000"),
}


@pytest.mark.parametrize("case", BODIES)
def test_a_hostile_request_is_a_400_in_openai_shape_and_logs_nothing(small_server, case, faults):
    raw, needle = BODIES[case]
    before = small_server.log.path.read_bytes()
    status, reply = _post(small_server.url, "/v1/chat/completions", raw.encode())
    assert status == 400
    _openai_error(reply, needle)
    assert small_server.log.path.read_bytes() == before
    faults.record(
        "numbers from outside" if "answer" in case or "temperature" in case else "hostile documents", f"request: {case}"
    )


FEEDBACK = {
    "401 digits": '{"id": "x", "reward": ' + "9" * 401 + "}",
    "1e300": '{"id": "x", "reward": 1e300}',
    "the string 1": '{"id": "x", "reward": "1"}',
    "NaN": '{"id": "x", "reward": NaN}',
}


@pytest.mark.parametrize("case", FEEDBACK)
def test_a_feedback_reward_outside_the_rule_is_a_400(small_server, case, faults):
    before = small_server.log.path.read_bytes()
    status, reply = _post(small_server.url, "/v1/feedback", FEEDBACK[case].encode())
    assert status == 400
    _openai_error(reply)
    assert small_server.log.path.read_bytes() == before
    faults.record("numbers from outside", f"feedback reward {case}")


def test_a_request_past_the_context_is_a_400_saying_the_limit(small_server, faults):
    before = small_server.log.path.read_bytes()
    status, reply = _chat(small_server, messages=[{"role": "user", "content": "1+2 " * 200}])
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    _openai_error(reply, "more than the model's context of 256 tokens")
    assert small_server.log.path.read_bytes() == before
    assert _chat(small_server)[0] == 200
    faults.record("context limit", "a request past the model's 256 positions")


@pytest.mark.parametrize("mode", ["raise", "exit", "hang", "garbage"])
def test_a_reward_plug_in_that_fails_is_an_openai_5xx_and_the_server_stays_up(small_server, mode, faults):
    before = small_server.log.path.read_bytes()
    status, reply = _chat(small_server, metadata={"mode": mode})
    assert status == (504 if mode == "hang" else 500)
    needle = {
        "raise": "raised RuntimeError: the judge is down",
        "exit": "called sys.exit(0)",
        "hang": "did not return within 0.5 s",
        "garbage": "it must return a number",
    }[mode]
    _openai_error(reply, "reward plugin_rewards:reward", needle)
    assert reply["error"]["type"] == "server_error"
    assert small_server.log.path.read_bytes() == before, "nothing logged for a reply never given"
    status, reply = _chat(small_server, metadata={"mode": "fine"})
    assert status == 200 and reply["sao"]["reward"] == 1.0
    faults.record("plug-ins", f"sao serve: a reward that {mode}s")


# --- 3 and 4: traces, environments and rewards in training -------------------------------------------------------


def test_a_trace_longer_than_the_context_is_a_counted_drop(tmp_path, tokenizer, faults):
    long = trace(1, prompt_token_ids=[70] * 300)
    path = write_log(tmp_path / "log.jsonl", [trace(0), long, trace(2), trace(3)])
    source = trace_source(path, tokenizer, context_length=256)
    used = [i for b in drain(source) for i in b.task_ids]
    assert "r1" not in used and source.counts["dropped_too_long"] == 1
    assert source.info()["traces_dropped"] == 1
    faults.record("context limit", "a trace of 303 tokens for 256 positions")


class Env:
    """An environment that misbehaves as told: raise, exit, hang (0.5 s), return garbage, or answer forever."""

    stop_strings = ()

    def __init__(self, mode: str = "fine"):
        self.mode = mode

    def init(self, prompt):
        if self.mode == "init-hang":
            time.sleep(0.5)
        return prompt, {}

    def step(self, action):
        if self.mode == "raise":
            raise ValueError("no such tool")
        if self.mode == "exit":
            sys.exit(0)
        if self.mode == "hang":
            time.sleep(0.5)
        if self.mode == "garbage":
            return "done"
        return {"observations": [{"role": "tool", "content": "again"}], "reward": 0.5, "done": False}

    def close(self):
        pass


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from sao.model.policy import load_base

    torch.set_num_threads(1)
    return load_base(tiny_model_dir, torch.device("cpu"))


def _episodes(tiny_lm, modes: list[str], *, context: int | None = None, timeout: float = 0.0, total: int = 64):
    lm, tokenizer = tiny_lm
    decoder = PlainDecoder(lm)
    if context is not None:
        decoder.context_length = context
    prompts = [[{"role": "user", "content": f"What is {i}+1?"}] for i in range(len(modes))]
    return draw_episodes(
        decoder,
        tokenizer,
        [Env(m) for m in modes],
        prompts,
        max_new_tokens=8,
        max_turns=6,
        max_total_tokens=total,
        temperature=1.0,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
        name="environment tests:Env",
        tasks=[f"task/{i}" for i in range(len(modes))],
        env_timeout=timeout,
    )


@pytest.mark.parametrize("mode", ["raise", "exit", "garbage"])
def test_an_environment_that_fails_ends_its_trajectory_counted_in_one_line_naming_it_and_the_task(
    tiny_lm, mode, faults, caplog
):
    with caplog.at_level(logging.WARNING, logger="sao.rollout"):
        rollout = _episodes(tiny_lm, ["fine", mode])
    assert rollout.turns.faults.tolist() == [0, 1] and rollout.turns.timeouts.tolist() == [False, False]
    assert rollout.truncated.tolist() == [bool(rollout.truncated[0]), True]
    needle = {"raise": "raised ValueError: no such tool", "exit": "called sys.exit(0)", "garbage": "returned 'done'"}[
        mode
    ]
    (told,) = [r.getMessage() for r in caplog.records if r.name == "sao.rollout"]
    one_line(told, "1 of 2 trajectories", "environment tests:Env (step)", "task/1", needle)
    faults.record("plug-ins", f"an environment whose step {mode}s")


@pytest.mark.parametrize("mode", ["hang", "init-hang"])
def test_an_environment_past_its_timeout_ends_the_trajectory_cut_and_counted(tiny_lm, mode, faults):
    rollout = _episodes(tiny_lm, ["fine", mode], timeout=0.2)
    assert rollout.turns.timeouts.tolist() == [False, True] and rollout.turns.faults.tolist() == [0, 1]
    assert bool(rollout.truncated[1]) and not bool(rollout.turns.timeouts[0])
    faults.record("plug-ins", f"an environment that hangs in {mode.replace('-hang', '') if '-' in mode else 'step'}")


def test_an_episode_stops_at_the_models_context_and_is_counted(tiny_lm, faults):
    tokenizer = tiny_lm[1]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 0+1?"}], tokenize=False, add_generation_prompt=True
    )
    prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    rollout = _episodes(tiny_lm, ["fine"], context=prompt_tokens + 3, total=200)  # room for 3 of 200 tokens
    assert int(rollout.response_mask.sum()) <= 3
    assert rollout.turns.context_cuts.tolist() == [True] and bool(rollout.truncated[0])
    faults.record("context limit", "an episode with room for 3 tokens of its 200")


def test_a_reward_past_its_timeout_scores_0_as_a_cut_trajectory_and_is_counted(faults):
    def slow(completion, row):
        time.sleep(0.5 if row["id"] == "t/2" else 0)
        return 1.0

    values, late = Scorer(slow, timeout=0.2).score_within(["a", "b"], [{"id": "t/1"}, {"id": "t/2"}])
    assert values == [1.0, 0.0] and late == [False, True]
    with pytest.raises(PluginTimeout) as error:
        Scorer(slow, timeout=0.2).score(["b"], [{"id": "t/2"}])
    one_line(str(error.value), "did not return within 0.2 s on t/2")
    faults.record("plug-ins", "a reward that hangs")


REWARD_MODULE = """import sys
def raising(completion, row):
    raise KeyError("answer")
def exiting(completion, row):
    sys.exit(0)
"""


@pytest.mark.parametrize("name", ["raising", "exiting"])
def test_sao_train_with_a_reward_that_raises_or_exits_is_exit_2_not_0(
    tmp_path, capsys, monkeypatch, name, faults, tiny_model_dir
):
    module = f"hostile_reward_{name}"
    (tmp_path / f"{module}.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny",
        "--reward",
        f"{module}:{name}",
        "--batch-size",
        "4",
        "--steps",
        "1",
        "--critic-warmup",
        "0",
        "--train-prompts",
        "8",
        "--test-prompts",
        "4",
        "--quiet",
        "--out",
        str(out),
    ]
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    needle = "raised KeyError: 'answer'" if name == "raising" else "called sys.exit(0)"
    one_line(lines[0], f"reward {module}:{name}", needle, "on tiny/")
    assert not (out / "train_log.jsonl").exists() or not (out / "train_log.jsonl").read_text().strip()
    assert not (out / "checkpoints").exists() and not (out / "adapter").exists(), "no step, no adapter"
    sys.modules.pop(module, None)
    faults.record("plug-ins", f"sao train with a reward that {name.removesuffix('ing')}s")
