"""The gate's live reader reads a trace log as the trace reader does: a line nested too deep, longer than any record or
holding NaN is skipped without an exception, and a reward the trace reader refuses (not a finite number of magnitude
at most 1e6) does not count in the live comparison that decides a rollback."""

from __future__ import annotations

import json

import pytest

from sao.training.gate import LiveRewards


def _lines(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def test_a_deeply_nested_or_huge_line_is_skipped_as_the_trace_reader_skips_it(tmp_path, faults):
    from sao.rollout.traces import MAX_LINE_BYTES

    log = tmp_path / "traces.jsonl"
    deep = b"[" * 100_000 + b"]" * 100_000
    nested = json.dumps({"id": "n", "policy_version": 1, "reward": 1.0, "task": {}}).encode()
    nested = nested.replace(b'"task": {}', b'"task": ' + b'{"a": ' * 50_000 + b"0" + b"}" * 50_000)
    huge = b'{"id": "h", "policy_version": 1, "reward": 1.0, "pad": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}'
    log.write_bytes(_lines(deep, nested, huge, {"id": "ok", "policy_version": 1, "reward": 0.5}))
    live = LiveRewards(log)
    assert live.read() == 1
    assert live.of(1) == (0.5, 1)
    assert live.offsets[str(log)] == log.stat().st_size, "read to the end, nothing left to read again"
    faults.record("the gate's live reader", "a trace line nested 100,000 deep")
    faults.record("the gate's live reader", "a trace line longer than any record")


PAST_THE_RULE = [
    {"reward": 2e6},
    {"reward": -1e7},
    {"turn_rewards": [0.5, 1e7]},
    b'{"id": "x", "policy_version": 1, "reward": 1e400}',
]
NOT_NUMBERS = [
    {"reward": "1"},
    {"reward": True},
    {"turn_rewards": [0.5, "1"]},
    b'{"id": "x", "policy_version": 1, "reward": NaN}',
]


@pytest.mark.parametrize("bad", PAST_THE_RULE + NOT_NUMBERS)
def test_a_reward_the_trace_reader_refuses_does_not_count(tmp_path, bad, faults):
    log = tmp_path / "traces.jsonl"
    record = bad if isinstance(bad, bytes) else {"id": "x", "policy_version": 1, **bad}
    log.write_bytes(_lines(record, {"id": "y", "policy_version": 1, "reward": 1.0}))
    live = LiveRewards(log)
    live.read()
    assert live.of(1) == (1.0, 1), "only the reward the trace reader takes"
    if bad in PAST_THE_RULE:  # the others were refused before the live reader took the trace reader's rule
        faults.record("the gate's live reader", f"a reward of {bad.decode() if isinstance(bad, bytes) else bad}")


def test_a_refused_feedback_reward_does_not_count_either(tmp_path, faults):
    log = tmp_path / "traces.jsonl"
    log.write_bytes(
        _lines(
            {"id": "a", "policy_version": 2},
            {"type": "feedback", "id": "a", "reward": 5e6},
            {"id": "b", "policy_version": 2},
            {"type": "feedback", "id": "b", "reward": 0.25},
        )
    )
    live = LiveRewards(log)
    live.read()
    assert live.of(2) == (0.25, 1)
    faults.record("the gate's live reader", "a feedback reward of 5e6")
