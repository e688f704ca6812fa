"""Other systems' trace records read by ``--traces`` (``sao.rollout.openenv_traces``, ``sao.rollout.tinker_traces``).

The fixtures are written here from the public record shapes, field by field: TRL's OpenEnv proxy ``TraceEntry``
(``request``, ``response``, ``completion_token_ids`` or ``completion_tokens``, ``per_token_logps``) and
tinker-cookbook's capture ``kind: "sample"`` record (``scope``, ``prompt_tokens``, ``sampling_params``,
``samples`` of ``tokens``/``logprobs``/``stop_reason``, ``sampling_session_id``, ``seq_id``, ``model_path``). Checked
on the tiny tokenizer alone: each maps to the trajectory it stands for, what cannot be trained on honestly is one
line naming file:line and the field (or a counted drop with --skip-bad-traces), and the formats mix with sao's own
lines in one log. Training 2 steps on each format is in test_traces.py, beside the sampler's own traces.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sao.core.errors import DataError
from sao.rollout.registry import TRACE_FORMATS
from sao.rollout.sources import SourceExhausted
from sao.rollout.traces import TraceSource


@pytest.fixture(scope="module")
def tokenizer():
    from sao.tiny import arithmetic as tiny

    return tiny.build_tokenizer()


MESSAGES = [{"role": "user", "content": "What is 3+4?"}]


def openenv_entry(i: int, **changes) -> dict:
    """One OpenEnv proxy trace entry: the chat body the agent sent, the upstream reply, the generated ids and their
    log-probs (``changes`` replaces top-level fields; ``request`` is merged)."""
    request = {
        "model": "tiny",
        "messages": MESSAGES,
        "temperature": 1.0,
        "max_tokens": 8,
        "metadata": {"question": "What is 3+4?", "answer": "7"},
        **changes.pop("request", {}),
    }
    entry = {
        "request": {k: v for k, v in request.items() if v is not DROP},
        "response": {
            "id": f"chatcmpl-{i}",
            "object": "chat.completion",
            "model": "tiny",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop"}],
        },
        "completion_token_ids": [72, 73, 2],
        "per_token_logps": [-0.1, -0.2, -0.3],
    }
    entry.update(changes)
    return {k: v for k, v in entry.items() if v is not DROP}


def tinker_sample(seq: int, **changes) -> dict:
    """One capture record of a ``SamplingClient.sample`` call with two samples (``changes`` replaces fields;
    ``sampling_params`` and ``scope`` are merged)."""
    params = {
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "seed": None,
        **changes.pop("sampling_params", {}),
    }
    record = {
        "kind": "sample",
        "scope": {"run_id": "run-1", "iteration": 0, **changes.pop("scope", {})},
        "created_at": 1.7e9,
        "num_samples": 2,
        "sampling_session_id": "sess",
        "seq_id": seq,
        "base_model": "tiny",
        "prompt_tokens": [1, 70, 71],
        "prompt_length": 3,
        "sampling_params": {k: v for k, v in params.items() if v is not DROP},
        "samples": [
            {"tokens": [72, 2], "logprobs": [-0.5, -0.1], "stop_reason": "stop"},
            {"tokens": [73, 74], "logprobs": [-0.2, -0.4], "stop_reason": "length"},
        ],
        "status": "ok",
        "latency_sec": 0.2,
    }
    record.update(changes)
    return {k: v for k, v in record.items() if v is not DROP}


DROP = object()  # a field to leave out


def feedback(trace_id: str, reward: float) -> dict:
    return {"type": "feedback", "id": trace_id, "reward": reward}


def write_log(path: Path, lines) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def make_source(path, tokenizer, **settings) -> TraceSource:
    defaults = {
        "batch_size": 2,
        "max_staleness": 4,
        "temperature": 1.0,
        "vocab_size": len(tokenizer),
        "eos_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
    }
    return TraceSource(path, tokenizer, **{**defaults, **settings})


def test_each_format_is_one_registry_entry_found_by_its_fields():
    openenv, tinker = TRACE_FORMATS.get("openenv"), TRACE_FORMATS.get("tinker")
    assert TRACE_FORMATS.names() == ["openenv", "tinker"]
    assert openenv.detect(openenv_entry(0)) and not tinker.detect(openenv_entry(0))
    assert tinker.detect(tinker_sample(0)) and not openenv.detect(tinker_sample(0))


def test_an_openenv_entry_is_one_trajectory_its_request_rendered_by_the_chat_template(tmp_path, tokenizer):
    from sao.rollout.traces import Tokens

    log = write_log(
        tmp_path / "proxy.jsonl",
        [
            openenv_entry(0),
            openenv_entry(
                1,
                completion_token_ids=DROP,
                completion_tokens=["token_id:74", "token_id:2"],
                per_token_logps=[-0.7, -0.05],
                request={"metadata": DROP},
                response={"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]},
            ),
            feedback("proxy.jsonl:2", 0.5),  # the second entry's reply has no id: it is named by file and line
        ],
    )
    source = make_source(log, tokenizer)
    batch = source.next_batch(0, "policy", 0)
    prompt = Tokens(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).prompt(MESSAGES)
    assert batch.task_ids == ["chatcmpl-0", "proxy.jsonl:2"]
    r = batch.rollout
    for i in range(2):  # left-padded prompts: the rendered request, as the proxy's server saw it
        assert r.prompt_ids[i][r.prompt_mask[i]].tolist() == prompt
    assert r.response_ids[0].tolist() == [72, 73, 2] and r.response_ids[1][:2].tolist() == [74, 2]
    assert r.sampler_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert r.sampler_logprobs[1][:2].tolist() == pytest.approx([-0.7, -0.05])
    assert r.cut.tolist() == [False, True]  # finish_reason "length": cut at the token limit
    assert batch.tasks == [{"question": "What is 3+4?", "answer": "7"}, None]  # metadata: graded by --reward
    assert float(r.turns.rewards[1].sum()) == 0.5  # the feedback's reward
    assert batch.staleness == [0, 0] and source.summary()["traces_read_as"] == {"openenv": 2}


def test_a_tinker_sample_call_is_one_trajectory_per_sample_rewarded_by_feedback(tmp_path, tokenizer):
    log = write_log(
        tmp_path / "sample.jsonl",
        [
            {"kind": "train_op", "op": "optim_step", "scope": {"run_id": "run-1"}, "created_at": 1.7e9, "status": "ok"},
            tinker_sample(7),
            tinker_sample(8, status="error", samples=DROP, error="RuntimeError('x')"),
            feedback("sess:7:1", 1.0),
            feedback("sess:7:0", 0.0),
        ],
    )
    source = make_source(log, tokenizer)
    batch = source.next_batch(0, "policy", 0)
    assert batch.task_ids == ["sess:7:1", "sess:7:0"]  # usable where their feedback came, in log order
    r = batch.rollout
    assert r.prompt_ids[0].tolist() == [1, 70, 71] and r.response_ids.tolist() == [[73, 74], [72, 2]]
    assert r.sampler_logprobs.flatten().tolist() == pytest.approx([-0.2, -0.4, -0.5, -0.1])
    assert r.cut.tolist() == [True, False] and r.turns.rewards.sum(dim=1).tolist() == [1.0, 0.0]
    summary = source.summary()
    assert summary["traces_not_trajectories"] == 2  # the train_op and the failed call
    assert summary["traces_read_as"] == {"tinker": 3}


def test_a_tinker_sample_keeps_the_sao_version_its_scope_names(tmp_path, tokenizer):
    log = write_log(
        tmp_path / "sample.jsonl",
        [tinker_sample(1, scope={"policy_version": 2}), feedback("sess:1:0", 1.0), feedback("sess:1:1", 0.0)],
    )
    batch = make_source(log, tokenizer).next_batch(0, "policy", 3)
    assert batch.staleness == [1, 1]


REFUSED = [
    ("openenv", {"per_token_logps": DROP}, "per_token_logps", "no sampler log-probs"),
    ("openenv", {"per_token_logps": []}, "per_token_logps", "no sampler log-probs"),
    ("openenv", {"per_token_logps": [-0.1, -0.2]}, "per_token_logps", "has 2 entries for 3 tokens"),
    ("openenv", {"request": {"temperature": DROP}}, "request.temperature", "not recorded"),
    ("openenv", {"request": {"temperature": 0.0}}, "temperature", "greedy"),
    ("openenv", {"request": {"top_p": 0.9}}, "request.top_p", "reshaped"),
    ("openenv", {"request": {"presence_penalty": 0.5}}, "request.presence_penalty", "reshaped"),
    (
        "openenv",
        {"completion_token_ids": DROP, "completion_tokens": ["7", "<eos>"]},
        "completion_tokens",
        "token ids written as",
    ),
    ("openenv", {"completion_token_ids": DROP}, "completion_token_ids", "no generated token ids"),
    ("openenv", {"request": {"messages": []}}, "request.messages", "non-empty list"),
    (
        "tinker",
        {"samples": [{"tokens": [72], "logprobs": None, "stop_reason": "stop"}]},
        "samples[0].logprobs",
        "no sampler log-probs",
    ),
    ("tinker", {"sampling_params": {"temperature": None}}, "sampling_params.temperature", "not recorded"),
    ("tinker", {"sampling_params": {"top_k": 50}}, "sampling_params.top_k", "reshaped"),
    ("tinker", {"model_path": "tinker://abc/sampler_weights/000061"}, "model_path", "Tinker checkpoint"),
    ("tinker", {"scope": {"policy_version": "v3"}}, "scope.policy_version", "whole number"),
    ("tinker", {"prompt_tokens": DROP}, "prompt_tokens", "missing"),
    ("tinker", {"samples": [{"tokens": [99999], "logprobs": [-0.1]}]}, "completion_token_ids", "vocabulary"),
]


@pytest.mark.parametrize("fmt,changes,field,words", REFUSED, ids=[f"{i}-{r[0]}-{r[2]}" for i, r in enumerate(REFUSED)])
def test_what_cannot_be_trained_on_honestly_is_one_line_naming_file_line_and_field_or_a_counted_drop(
    tmp_path, tokenizer, fmt, changes, field, words
):
    bad = openenv_entry(9, **changes) if fmt == "openenv" else tinker_sample(9, **changes)
    log = write_log(tmp_path / "log.jsonl", [openenv_entry(0), openenv_entry(1), bad])
    with pytest.raises(DataError) as error:
        make_source(log, tokenizer, batch_size=3).next_batch(0, "policy", 0)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{log}:3: field '{field}'"), message
    assert words in message and f"a {fmt} record" in message
    source = make_source(log, tokenizer, skip_bad=True)  # --skip-bad-traces: counted, the rest is used
    assert source.next_batch(0, "policy", 0).task_ids == ["chatcmpl-0", "chatcmpl-1"]
    assert source.summary()["traces_dropped_bad_record"] == 0  # the bad line is beyond the first batch
    with pytest.raises(SourceExhausted):  # nothing left but the bad line
        source.next_batch(1, "policy", 0)
    assert source.summary()["traces_dropped_bad_record"] == 1


def test_a_folder_mixes_sao_lines_foreign_lines_and_feedback_and_resumes_exactly(tmp_path, tokenizer):
    folder = tmp_path / "logs"
    folder.mkdir()
    sao_line = {
        "id": "own-0",
        "policy_version": 0,
        "temperature": 1.0,
        "prompt_token_ids": [1, 70],
        "completion_token_ids": [72],
        "logprobs": [-0.3],
        "reward": 1.0,
    }
    write_log(folder / "a-sao.jsonl", [sao_line])
    write_log(folder / "b-proxy.jsonl", [openenv_entry(0), openenv_entry(1)])
    write_log(folder / "c-capture.jsonl", [tinker_sample(3)])
    write_log(folder / "d-rewards.jsonl", [feedback("sess:3:0", 1.0), feedback("sess:3:1", 0.0)])
    source = make_source(folder, tokenizer, batch_size=3)
    first = source.next_batch(0, "policy", 0)
    assert first.task_ids == ["own-0", "chatcmpl-0", "chatcmpl-1"]
    resumed = make_source(folder, tokenizer, batch_size=2)
    resumed.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert resumed.next_batch(1, "policy", 0).task_ids == ["sess:3:0", "sess:3:1"]
    assert resumed.summary()["traces_read_as"] == {"openenv": 2, "tinker": 1}
    assert resumed.summary()["traces_used"] == 5
