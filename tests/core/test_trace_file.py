"""The step's stopwatch and timeline.json, without a model: phases charge each second once, the file is a complete
trace after every write, a file a crash cut is repaired on resume, and the rolling window bounds it."""

from __future__ import annotations

import json
import threading

import pytest

from helpers import trace_errors
from sao.core import timeline


class FakeClock:
    """perf_counter and time that move only when told (``sao.core.timeline`` reads both through ``time``)."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t

    def time(self) -> float:
        return 1_000.0 + self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_nested_phases_charge_each_second_once_and_add_up_to_the_step(monkeypatch):
    clock_time = FakeClock()
    monkeypatch.setattr(timeline, "time", clock_time)
    waited = timeline.env_waited()
    clock = timeline.Phases()
    with clock:
        with clock.phase("wait"):
            clock_time.sleep(2)
            with timeline.phase("draw"):  # what a source calls: it reaches the step running on this thread
                clock_time.sleep(3)
                with timeline.waiting_on_env():
                    clock_time.sleep(5)
        with clock.phase("eval"), timeline.waiting_on_env():  # an evaluation's episodes stay the evaluation's
            clock_time.sleep(7)
        clock_time.sleep(11)
    fields = clock.fields()
    assert fields["time"] == 28 and sum(fields[f"time_{p}"] for p in (*timeline.PHASES, "other")) == 28
    assert (fields["time_wait"], fields["time_draw"], fields["time_env"], fields["time_eval"]) == (2, 3, 5, 7)
    assert fields["time_other"] == 11 and fields["time_pass"] == 0
    assert fields["time_env_share"] == 5 / 8
    assert [(name, end - start) for name, start, end in clock.intervals] == [
        ("env", 5),
        ("draw", 8),
        ("wait", 10),
        ("eval", 7),
    ]
    assert timeline.env_waited() - waited == 12  # both waits, for a trajectory's own share


def test_phase_marks_nothing_on_a_thread_without_a_step():
    clock = timeline.Phases()
    with clock:
        worker = threading.Thread(target=lambda: timeline.phase("draw").__enter__())
        worker.start()
        worker.join()
    assert clock.fields()["time_draw"] == 0.0 and clock.intervals == []


def test_a_source_drawing_elsewhere_gives_the_environment_share_of_its_trajectories():
    clock = timeline.Phases()
    with clock:
        timeline.env_share([(0.0, 2.0, 1.0), (0.0, 1.0, 0.0)])
    assert clock.fields()["time_env_share"] == pytest.approx(0.25)
    assert timeline.Phases().fields()["time_env_share"] is None  # nothing drawn anywhere


def _step_events(step: int, rows: int = 3) -> list[dict]:
    start = 1_000.0 + step
    events = [timeline._span("pass", "phase", "trainer rank 0", "step", start, start + 0.5, {"step": step})]
    events += [
        timeline._span(
            "trajectory",
            "trajectory",
            "local sampler",
            f"row {r}",
            start,
            start + 0.2,
            {"step": step, "version": step, "staleness": 0},
        )
        for r in range(rows)
    ]
    events.append(timeline._span(f"step {step}", "step", "trainer rank 0", "step", start, start + 1.0, {"step": step}))
    return events


def test_the_file_is_a_valid_trace_after_every_write(tmp_path):
    path = tmp_path / "timeline.json"
    trace = timeline.TraceFile(path, steps=10, about={"run": "test"}).open(resume=False)
    assert json.loads(path.read_text())["traceEvents"] == []
    for step in range(3):
        trace.write(_step_events(step))
        read = json.loads(path.read_text())  # the plain JSON reader, as Perfetto's importer needs it
        assert not trace_errors(read)
        assert sum(e.get("cat") == "step" for e in read["traceEvents"]) == step + 1
    names = {e["args"]["name"] for e in read["traceEvents"] if e["name"] == "process_name"}
    assert names == {"trainer rank 0", "local sampler"}
    spans = [e for e in read["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == pytest.approx(1e9 - read["otherData"]["origin_unix_us"], abs=1)


def test_a_file_cut_by_a_crash_is_repaired_on_resume_and_goes_on(tmp_path):
    path = tmp_path / "timeline.json"
    trace = timeline.TraceFile(path, steps=10, about={}).open(resume=False)
    for step in range(3):
        trace.write(_step_events(step))
    whole = path.read_bytes()
    path.write_bytes(whole[: -len(timeline.TAIL) - 25])  # the last event cut mid-line, no closing brackets
    with pytest.raises(ValueError):
        json.loads(path.read_bytes())
    again = timeline.TraceFile(path, steps=10, about={}).open(resume=True)
    assert again.repaired and "cut short" in again.repaired
    repaired = json.loads(path.read_text())
    assert not trace_errors(repaired)
    assert len([e for e in repaired["traceEvents"] if e["ph"] != "M"]) == 3 * 5 - 1  # all but the cut event
    again.write(_step_events(3))
    resumed = json.loads(path.read_text())
    assert sum(e.get("cat") == "step" for e in resumed["traceEvents"]) == 3  # steps 0, 1 and 3: 2's span was cut
    assert resumed["otherData"]["origin_unix_us"] == repaired["otherData"]["origin_unix_us"]
    assert timeline.read(path)["traceEvents"] == resumed["traceEvents"]


def test_the_rolling_window_keeps_between_n_and_2n_steps(tmp_path):
    path = tmp_path / "timeline.json"
    trace = timeline.TraceFile(path, steps=4, about={}).open(resume=False)
    held = []
    for step in range(23):
        trace.write(_step_events(step))
        steps = [e["args"]["step"] for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "step"]
        assert steps == list(range(step + 1 - len(steps), step + 1))  # the newest, in order
        held.append(len(steps))
    assert min(held[4:]) >= 4 and max(held) <= 8 and held[-1] < 23
    assert not trace_errors(json.loads(path.read_text()))
    resumed = timeline.TraceFile(path, steps=4, about={}).open(resume=True)  # a resume keeps its window
    resumed.write(_step_events(23))
    steps = [e["args"]["step"] for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "step"]
    assert steps[-1] == 23 and len(steps) >= 4


def test_the_recorder_counts_detail_events_past_its_limit_and_keeps_the_steps():
    recorder = timeline.Recorder(limit=2)
    for i in range(5):
        recorder.add({"name": f"call {i}"})
    recorder.add({"name": "step"}, keep=True)
    events, dropped = recorder.drain()
    assert [e["name"] for e in events] == ["call 0", "call 1", "step"] and dropped == 3
    assert recorder.drain() == ([], 0)


def test_spans_are_recorded_only_while_the_process_records(tmp_path):
    timeline.stop()
    with timeline.span("nothing", "test", "p") as args:
        args["x"] = 1
    recorder = timeline.start()
    try:
        with timeline.span("something", "test", "p", value=float("nan")) as args:
            args["x"] = 2
        timeline.instant("now", "test", "p", "t")
        events, _ = recorder.drain()
    finally:
        timeline.stop()
    assert [e["name"] for e in events] == ["something", "now"]
    assert events[0]["args"] == {"value": None, "x": 2} and events[0]["tid"] == "thread 1"
