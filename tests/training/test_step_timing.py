"""Where a step's time goes: its phase timers cover its wall time on the tiny preset and match its spans in
timeline.json; OpenTelemetry gets each step as an rl.* tree (the SDK's in-memory exporter), an unreachable collector
costs one warning and never blocks a step, and --otel-endpoint without the SDK is refused in one line."""

from __future__ import annotations

import json
import socket
import time

import pytest

from helpers import refused_in_one_line, trace_errors
from sao.core import timeline
from sao.training import build, otel
from sao.training.hooks import Timeline

NAMED = [f"time_{p}" for p in timeline.PHASES]


def test_phase_timers_add_up_to_the_step_time_on_the_tiny_preset(tiny_config, tmp_path):
    records = build.trainer(tiny_config, tmp_path / "run", progress=False).run()
    for r in records:
        assert sum(r[k] for k in NAMED) + r["time_other"] == pytest.approx(r["time"], rel=1e-9)
        assert sum(r[k] for k in NAMED) >= 0.95 * r["time"], {k: r[k] for k in (*NAMED, "time_other", "time")}
        assert r["time_draw"] > 0 and r["time_pass"] > 0 and r["time_critic"] > 0 and r["time_score"] > 0
        assert (r["time_update"] > 0) == (r["phase"] == "policy")
        assert r["time_sample"] == pytest.approx(r["time_wait"] + r["time_draw"] + r["time_score"], abs=1e-3)
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert not trace_errors(trace)
    steps = {e["args"]["step"]: e for e in trace["traceEvents"] if e.get("cat") == "step"}
    assert sorted(steps) == [r["step"] for r in records]
    for r in records:  # the file's step span is the record's step, its phases the record's timers
        assert steps[r["step"]]["dur"] / 1e6 == pytest.approx(r["time"], abs=1e-3)
        phases = [e for e in trace["traceEvents"] if e.get("cat") == "phase" and e["args"]["step"] == r["step"]]
        assert sum(e["dur"] for e in phases if e["name"] == "pass") / 1e6 == pytest.approx(r["time_pass"], abs=1e-3)
        rows = [e for e in trace["traceEvents"] if e["name"] == "trajectory" and e["args"]["step"] == r["step"]]
        assert len(rows) == tiny_config.training.batch_size
        assert {e["args"]["staleness"] for e in rows} == {r["staleness"]}


def _otel_sdk():
    pytest.importorskip("opentelemetry.sdk.trace", reason="the OpenTelemetry SDK: pip install 'sao[otel]'")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter


def test_each_step_reaches_opentelemetry_as_an_rl_tree(tiny_config, tmp_path):
    memory = _otel_sdk()()
    config = tiny_config.replace(steps=2, critic_warmup=1, lag=1, timeline_steps=0)  # no file: OpenTelemetry alone
    trainer = build.trainer(
        config, tmp_path / "run", progress=False, hooks=[Timeline(0, otel.Telemetry(exporter=memory))]
    )
    records = trainer.run()
    assert not (tmp_path / "run" / "timeline.json").exists()
    spans = memory.get_finished_spans()
    roots = [s for s in spans if s.name == "rl.loop"]
    assert [s.attributes["rl.step"] for s in roots] == [r["step"] for r in records] and all(
        s.parent is None for s in roots
    )
    for root, record in zip(roots, records, strict=True):
        mine = [s for s in spans if s.context.trace_id == root.context.trace_id]
        children = [s for s in mine if s.parent is not None and s.parent.span_id == root.context.span_id]
        names = {s.name for s in children}
        assert {"rl.sample", "rl.reward", "rl.train"} <= names
        assert ("rl.sync" in names) == (record["phase"] == "policy" and not record["skipped"])
        assert {s.attributes["rl.phase"] for s in children if s.name == "rl.train"} >= {"pass", "checks", "critic"}
        sample = next(s for s in children if s.name == "rl.sample")
        rows = [s for s in mine if s.name == "rl.trajectory"]
        assert len(rows) == config.training.batch_size and all(s.parent.span_id == sample.context.span_id for s in rows)
        assert {s.attributes["rl.staleness"] for s in rows} == {record["staleness"]}
        for s in mine:  # the run, the step, the version and the staleness on every span of the step
            assert s.attributes["rl.run"] == trainer.label and s.attributes["rl.step"] == record["step"]
            assert "rl.version" in s.attributes and "rl.staleness" in s.attributes
            assert (root.start_time <= s.start_time and s.end_time <= root.end_time) or s.name == "rl.trajectory"
        assert (root.end_time - root.start_time) / 1e9 == pytest.approx(record["time"], abs=1e-3)
    assert [s.attributes["rl.version"] for s in roots] == [0, 0, 1]  # the version each step trained from


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once it is closed


def test_an_unreachable_collector_costs_one_warning_and_never_blocks_a_step(monkeypatch):
    _otel_sdk()
    monkeypatch.setattr(otel, "EXPORT_TIMEOUT_S", 1.0)
    warnings: list[str] = []
    url = f"http://127.0.0.1:{_closed_port()}/v1/traces"
    telemetry = otel.Telemetry(url, warn=warnings.append)
    slowest = 0.0
    for step in range(40):  # spans of 40 steps, made while the exporter fails in the background
        start = 1_000.0 + step
        events = [
            timeline._span("pass", "phase", "trainer rank 0", "step", start, start + 0.5, {"step": step}),
            timeline._span(
                "step",
                "step",
                "trainer rank 0",
                "step",
                start,
                start + 1.0,
                {"step": step, "version": step, "staleness": 0},
            ),
        ]
        began = time.perf_counter()
        telemetry.steps("run", events)
        slowest = max(slowest, time.perf_counter() - began)
        time.sleep(0.05)
    began = time.perf_counter()
    line = telemetry.close()
    closing = time.perf_counter() - began
    assert slowest < 0.1, f"a step waited {slowest:.2f} s on the collector"
    assert closing < otel.EXPORT_TIMEOUT_S + 2, f"closing took {closing:.1f} s"
    assert len(warnings) == 1 and url in warnings[0] and "dropped and counted" in warnings[0]
    assert line == f"OpenTelemetry: 0 of 80 spans sent to {url}, 80 dropped"


def test_otel_endpoint_without_the_sdk_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(otel, "sdk_missing", lambda: "the OpenTelemetry SDK is not installed: pip install 'sao[otel]'")
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--out", str(out), "--otel-endpoint", "http://127.0.0.1:4318"]
    refused_in_one_line(capsys, argv, out, "--otel-endpoint", "pip install 'sao[otel]'")


def test_the_endpoint_comes_from_the_flag_or_the_standard_variables():
    from sao.core.config import Config

    off = Config.load("tiny")
    assert otel.endpoint(off, {}) == (None, "")
    flag = off.replace(otel_endpoint="http://collector:4318/")
    assert otel.endpoint(flag, {}) == ("http://collector:4318/v1/traces", "--otel-endpoint")
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert otel.endpoint(off, base) == ("http://c:4318/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT")
    traces = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/x"}
    assert otel.endpoint(off, traces)[0] == "http://t:9/x"  # the signal's own variable, as given
    assert otel.endpoint(off, {**traces, "OTEL_SDK_DISABLED": "true"}) == (None, "")
    assert otel.endpoint(off, {**traces, "OTEL_TRACES_EXPORTER": "none"}) == (None, "")
