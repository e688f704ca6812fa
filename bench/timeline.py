"""What the phase timers and the timeline cost: the tiny preset's step with and without them, side by side in one run.

    python bench/timeline.py                          # prints the table (a few minutes on 2 cores)
    python bench/timeline.py --record BENCHMARKS.md   # and appends it, with date, machine and command

Three runs of the tiny preset (batch 64, the local sampler, one torch thread) per round, in a rotating order, from
the same seed: no timers at all (a stopwatch that times nothing but the step: the baseline), the phase timers alone
(--timeline-steps 0), and the phase timers with timeline.json (the default). A step is the loop's whole iteration,
from one step's checkpoint to the next's, so the timeline's write after the checkpoint is in it; the first two
steps of each run are left out (the first draw and pass warm up). Rows: the median and mean step of each condition
over every round, and its difference from the baseline; then the costs measured in the process itself, which the
machine's noise cannot hide: the timers' own work per step (a step's 12 phases and its fields, timed 10,000 times)
and the timeline's, timed around the code that does it: recording the step's spans (its 64 trajectories and its
phases) and, after the step, draining, serialising and writing them.

The machine's load average is recorded with the figures: on a shared 2-core machine it moves them more than 2%.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sao.core import timeline  # noqa: E402
from sao.core.config import Config, apply_threads  # noqa: E402
from sao.rollout import sources  # noqa: E402
from sao.training import build, hooks  # noqa: E402
from sao.training.trainer import Hook  # noqa: E402

CONDITIONS = {
    "none": "no timers, no timeline (baseline)",
    "timers": "phase timers (--timeline-steps 0)",
    "timeline": "phase timers + timeline.json (default)",
}
SKIP = 2  # steps of each run left out


class NoTimers(timeline.Phases):
    """The baseline's stopwatch: the step's wall time and nothing else."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def fields(self) -> dict:
        self.last = time.perf_counter()
        return {"time": self.last - self.origin}


class Laps(Hook):
    """perf_counter at each step's durable end (the last hook, after the timeline's write)."""

    name = "laps"

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_run_start(self, trainer) -> None:
        self.marks.append(time.perf_counter())

    def on_checkpoint(self, trainer, step: int) -> None:
        self.marks.append(time.perf_counter())


def run(condition: str, steps: int, folder: Path, flushes: list[float], spans: list[float]) -> list[float]:
    """One run of the tiny preset under ``condition``: each step's seconds, from checkpoint to checkpoint.
    ``flushes`` gets each step's write of the timeline, ``spans`` each step's recording of its spans."""
    config = Config.preset("tiny", steps=steps, critic_warmup=1, timeline_steps=0 if condition != "timeline" else 100)
    apply_threads(config)
    laps = Laps()
    real_phases, real_flush = timeline.Phases, hooks.Timeline._flush
    real_rows, real_emit = sources.trajectories, timeline.Phases.emit

    def timed_flush(self, trainer, gather):  # the timeline's own work after each step
        began = time.perf_counter()
        real_flush(self, trainer, gather)
        flushes.append(time.perf_counter() - began)

    def timed_rows(*args):  # the step's trajectory spans (the sampler's, once per batch)
        began = time.perf_counter()
        real_rows(*args)
        spans.append(time.perf_counter() - began)

    def timed_emit(self, *args):  # the step's phase spans (once per step, after the rows): added to its rows'
        began = time.perf_counter()
        real_emit(self, *args)
        if spans:
            spans[-1] += time.perf_counter() - began

    try:
        if condition == "none":
            timeline.Phases = NoTimers
        hooks.Timeline._flush, sources.trajectories, real_phases.emit = timed_flush, timed_rows, timed_emit
        build.trainer(config, folder, hooks=[laps], progress=False).run()
    finally:
        timeline.Phases, hooks.Timeline._flush, sources.trajectories = real_phases, real_flush, real_rows
        real_phases.emit = real_emit
    return [b - a for a, b in zip(laps.marks, laps.marks[1:], strict=False)][SKIP:]


def timers_per_step(repeat: int = 10_000) -> float:
    """Seconds the phase timers themselves take a step: a Phases with the step's 12 phases, its fields twice."""
    began = time.perf_counter()
    for _ in range(repeat):
        clock = timeline.Phases()
        with clock:
            for name in (*timeline.PHASES, "eval"):
                with clock.phase(name):
                    pass
            clock.fields()
        clock.fields()
    return (time.perf_counter() - began) / repeat


def table(f: dict) -> str:
    base = f["steps"]["none"]["median"]
    load = " / ".join(f"{x:.1f}" for x in f["load"])
    lines = [
        f"machine: {f['cores']} CPU cores, load average {load} (1/5/15 min) at the start; tiny preset (batch 64), "
        f"{f['rounds']} rounds × {f['per_run']} steps per condition; bench took {f['seconds']:.0f}s",
        "",
        "| condition | step, s (median) | step, s (mean) | steps | vs baseline (median) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in CONDITIONS.items():
        s = f["steps"][key]
        versus = "—" if key == "none" else f"{(s['median'] - base) / base:+.1%}"
        lines.append(f"| {label} | {s['median']:.3f} | {s['mean']:.3f} | {s['n']} | {versus} |")
    timers, flush, spans = f["timers_s"], f["flush_s"], f["spans_s"]
    lines += [
        "",
        "| measured in the process | per step | share of the baseline's median step |",
        "| --- | ---: | ---: |",
        f"| phase timers (12 phases and the fields) | {timers * 1e6:.1f} µs | {timers / base:.4%} |",
        f"| timeline.json: the step's spans recorded (its trajectories and phases) | {spans * 1e3:.2f} ms | "
        f"{spans / base:.2%} |",
        f"| timeline.json: drain, serialise, write ({f['events']:.0f} events a step) | {flush * 1e3:.2f} ms | "
        f"{flush / base:.2%} |",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three runs (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="policy steps per run (default 8; +1 warmup step)")
    parser.add_argument("--record", help="append the table, with date, machine and command, to this file")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()
    steps: dict[str, list[float]] = {k: [] for k in CONDITIONS}
    flushes: list[float] = []
    spans: list[float] = []
    events: list[int] = []
    order = list(CONDITIONS)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for condition in order[r % 3 :] + order[: r % 3]:  # rotated, so drift spreads over every condition
                folder = Path(tmp) / f"{condition}-{r}"
                timed = (flushes, spans) if condition == "timeline" else ([], [])
                steps[condition] += run(condition, args.steps, folder, *timed)
                if condition == "timeline":
                    trace = timeline.read(folder / "timeline.json")["traceEvents"]
                    events.append(sum(e["ph"] != "M" for e in trace) / (args.steps + 1))
                print(f"round {r + 1} {condition}: median step {statistics.median(steps[condition]):.3f}s", flush=True)
    summary = {k: {"median": statistics.median(v), "mean": statistics.fmean(v), "n": len(v)} for k, v in steps.items()}
    figures = {
        "steps": summary,
        "timers_s": timers_per_step(),
        "flush_s": statistics.median(flushes),
        "spans_s": statistics.median(spans),
        "events": statistics.fmean(events),
        "rounds": args.rounds,
        "per_run": args.steps + 1 - SKIP,
        "cores": os.cpu_count(),
        "load": load,
        "seconds": time.perf_counter() - started,
    }
    text = table(figures)
    print("\n" + text + "\n")
    if args.record:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        command = "python bench/timeline.py " + " ".join(a if "/" not in a else Path(a).name for a in sys.argv[1:])
        with open(args.record, "a", encoding="utf-8") as handle:
            title = f"## {stamp} — what the phase timers and the timeline cost, cpu"
            handle.write(f"\n{title}\n\n`{command.strip()}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
