"""What the phase timers and the timeline cost: the tiny preset's step with and without them, side by side in one run.

    python bench/timeline.py                          # prints the table (a few minutes on 2 cores)
    python bench/timeline.py --record BENCHMARKS.md   # and appends it, with date, machine and command

One run of the tiny preset (batch 64, the local sampler, one torch thread) whose steps take the three conditions in
turn, so a change in the machine's load falls on all three alike: no timers at all (a stopwatch that times nothing
but the step: the baseline), the phase timers alone (timeline.json's recorder off), and the phase timers with
timeline.json (the default). A step is the loop's whole iteration up to the end of its checkpoint hooks, so the
timeline's write is in it; the first cycle is left out (warm-up), and the order within a cycle rotates. Rows: each
condition's median and mean step, and the median over cycles of its step against the baseline's step of the same
cycle; then the costs measured in the process itself, which the machine's noise cannot hide: the timers' own work
per step (a step's 12 phases and its fields, timed 10,000 times) and the timeline's, timed around the code that
does it: recording the step's spans (its 64 trajectories and its phases) and, after the step, draining,
serialising and writing them.

The machine's load average is recorded with the figures: on a shared 2-core machine it moves a step by more than 2%.
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

CONDITIONS = {
    "none": "no timers, no timeline (baseline)",
    "timers": "phase timers, no timeline",
    "timeline": "phase timers + timeline.json (default)",
}
SKIP = 1  # cycles left out at the start (the first draw and pass warm up)


class NoTimers(timeline.Phases):
    """The baseline's stopwatch: the step's wall time and nothing else."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def fields(self) -> dict:
        self.last = time.perf_counter()
        return {"time": self.last - self.origin}


def measure(steps: int, folder: Path) -> tuple[dict[str, list[float]], dict]:
    """One run of the tiny preset whose steps cycle through the three conditions (the cycle's order rotating): each
    condition's step seconds, in cycle order, and the timeline's own costs on its steps."""
    from sao.core.config import Config
    from sao.core.machine import apply_threads
    from sao.rollout import sources
    from sao.training import build, hooks
    from sao.training.trainer import Hook

    real_phases = timeline.Phases
    flushes: list[float] = []
    spans: list[float] = []
    laps: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    order = list(CONDITIONS)

    class Turns(Hook):
        """Sets each step's condition and times it, from the end of the last step's hooks to the end of its own (the
        last hook of the loop, so the timeline's write is in the step)."""

        name = "turns"

        def on_run_start(self, trainer) -> None:
            self.timeline = next(h for h in trainer.hooks if isinstance(h, hooks.Timeline))
            self.k = 0
            self.set()

        def set(self) -> None:
            cycle, place = divmod(self.k, 3)
            self.condition = order[(place + cycle) % 3]  # the order rotates with the cycle
            timeline.Phases = NoTimers if self.condition == "none" else real_phases
            timeline._recorder = self.timeline.recorder if self.condition == "timeline" else None
            self.began = time.perf_counter()

        def on_checkpoint(self, trainer, step: int) -> None:
            laps[self.condition].append(time.perf_counter() - self.began)
            self.k += 1
            self.set()

    real_flush, real_rows, real_emit = hooks.Timeline._flush, sources.trajectories, real_phases.emit

    def timed_flush(self, trainer, gather):  # the timeline's own work after each step
        began = time.perf_counter()
        real_flush(self, trainer, gather)
        if timeline.recording() is not None:
            flushes.append(time.perf_counter() - began)

    def timed_rows(*args):  # the step's trajectory spans (the sampler's, once per batch)
        began = time.perf_counter()
        real_rows(*args)
        if timeline.recording() is not None:
            spans.append(time.perf_counter() - began)

    def timed_emit(self, *args):  # the step's phase spans (once per step, after its rows): added to its rows'
        began = time.perf_counter()
        real_emit(self, *args)
        if timeline.recording() is not None and spans:
            spans[-1] += time.perf_counter() - began

    config = Config.load("tiny", steps=steps, critic_warmup=1)  # the default timeline, switched off per step
    apply_threads(config)
    hooks.Timeline._flush, sources.trajectories, real_phases.emit = timed_flush, timed_rows, timed_emit
    try:
        build.trainer(config, folder, hooks=[Turns()], progress=False).run()
    finally:
        timeline.Phases, hooks.Timeline._flush, sources.trajectories = real_phases, real_flush, real_rows
        real_phases.emit = real_emit
    trace = timeline.read(folder / "timeline.json")["traceEvents"]
    events = sum(e["ph"] != "M" for e in trace) / max(len(laps["timeline"]), 1)
    cycles = min(len(v) for v in laps.values())
    laps = {c: v[:cycles][SKIP:] for c, v in laps.items()}
    return laps, {"flushes": flushes[SKIP:], "spans": spans[SKIP:], "events": events}


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
        f"{f['n']} steps per condition, taken in turn in one run; bench took {f['seconds']:.0f}s",
        "",
        "| condition | step, s (median) | step, s (mean) | against the baseline's step of the same cycle (median) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label in CONDITIONS.items():
        s = f["steps"][key]
        versus = "—" if key == "none" else f"{s['paired']:+.1%}"
        lines.append(f"| {label} | {s['median']:.3f} | {s['mean']:.3f} | {versus} |")
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
    parser.add_argument("--steps", type=int, default=90, help="policy steps (default 90: 30 of each condition)")
    parser.add_argument("--record", help="append the table, with date, machine and command, to this file")
    args = parser.parse_args()
    if args.steps < 6:
        parser.error("--steps must be at least 6: two cycles of the three conditions, the first left out")
    started, load = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        laps, costs = measure(args.steps, Path(tmp) / "run")
    base = laps["none"]
    summary = {
        c: {
            "median": statistics.median(v),
            "mean": statistics.fmean(v),
            "paired": statistics.median(x / b - 1 for x, b in zip(v, base, strict=True)),
        }
        for c, v in laps.items()
    }
    figures = {
        "steps": summary,
        "timers_s": timers_per_step(),
        "flush_s": statistics.median(costs["flushes"]),
        "spans_s": statistics.median(costs["spans"]),
        "events": costs["events"],
        "n": len(base),
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
