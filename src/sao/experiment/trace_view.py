"""A timeline.json drawn to a PNG, track by track, as a trace viewer lays it out (where none can be opened).

    python -m sao.experiment.trace_view RUN/timeline.json OUT.png [--steps 2 5]

One row per track, grouped by process (trainer ranks, Ray workers, vLLM requests, environment calls, the local
sampler) in the file's own order; each span a bar at its time, spans nested in another (a draw inside the wait, an
evaluation inside a publish) drawn in a lane below their parent, instants as ticks. Colours by span name; the
names of the step's phases are written on bars wide enough to hold them. ``--steps A B`` keeps the time from step
A's start to step B's end. Deliberately left out: zooming, flow arrows and counters (Perfetto does all of them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sao.core import timeline
from sao.core.io import atomic_write

COLOURS = {
    "wait": "#c7c7c7",
    "draw": "#1f77b4",
    "env": "#ff7f0e",
    "score": "#2ca02c",
    "pass": "#d62728",
    "checks": "#9467bd",
    "update": "#8c564b",
    "publish": "#e377c2",
    "eval": "#bcbd22",
    "critic": "#17becf",
    "stats": "#7f7f7f",
    "trajectory": "#6baed6",
    "draw call": "#3182bd",
    "request": "#9ecae1",
    "env.step": "#fd8d3c",
    "env.init": "#fdd0a2",
    "env.build": "#fdae6b",
    "env.close": "#fee6ce",
    "adapter publish": "#e7298a",
    "adapter load": "#c994c7",
    "checkpoint": "#636363",
}


def _lanes(spans: list[dict[str, Any]]) -> list[int]:
    """Each span's nesting depth on its track (a span inside an open one goes a lane down)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i]["ts"], -spans[i]["dur"]))
    depth, open_ends = [0] * len(spans), []
    for i in order:
        while open_ends and spans[i]["ts"] >= open_ends[-1] - 1e-3:
            open_ends.pop()
        depth[i] = len(open_ends)
        open_ends.append(spans[i]["ts"] + spans[i]["dur"])
    return depth


def draw(trace: dict[str, Any], path: str | Path, steps: tuple[int, int] | None = None, title: str = "") -> Path:
    """``trace`` (a timeline.json's object) as a PNG at ``path``."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = trace["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    order = {(e["pid"], e["tid"]): e["args"]["sort_index"] for e in events if e.get("name") == "thread_sort_index"}
    timed = [e for e in events if e.get("ph") in ("X", "i")]
    if steps is not None:
        marks = {e["args"]["step"]: e for e in timed if e.get("cat") == "step"}
        start, end = marks[steps[0]]["ts"], marks[steps[1]]["ts"] + marks[steps[1]]["dur"]
        timed = [e for e in timed if e["ts"] + e.get("dur", 0) >= start and e["ts"] <= end]
    else:
        start = min(e["ts"] for e in timed)
        end = max(e["ts"] + e.get("dur", 0) for e in timed)
    tracks = sorted(
        {(e["pid"], e["tid"]) for e in timed}, key=lambda t: (list(processes).index(t[0]), order.get(t, t[1]), t[1])
    )
    rows: list[tuple[tuple[int, int], int]] = []  # (track, lane)
    lane_of: dict[int, int] = {}
    for track in tracks:
        spans = [e for e in timed if (e["pid"], e["tid"]) == track and e["ph"] == "X"]
        lanes = _lanes(spans)
        lane_of.update({id(s): d for s, d in zip(spans, lanes, strict=True)})
        rows += [(track, lane) for lane in range(max(lanes, default=0) + 1)]
    y = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    fig = Figure(figsize=(16, max(4.0, 0.28 * len(rows) + 1.6)), layout="constrained")
    ax = fig.subplots()
    scale = 1e6  # µs → s
    for e in timed:
        track = (e["pid"], e["tid"])
        if e["ph"] == "i":
            ax.plot([(e["ts"] - start) / scale] * 2, [y[(track, 0)] - 0.45, y[(track, 0)] + 0.45], color="black", lw=1)
            continue
        row = y[(track, lane_of[id(e)])]
        colour = COLOURS.get(e["name"], "#fb9a99" if e.get("cat") == "step" else "#cccccc")
        left, width = (e["ts"] - start) / scale, max(e["dur"], (end - start) / 600) / scale  # a short call still shows
        ax.barh(row, width, left=left, height=0.8, color=colour, edgecolor="white", linewidth=0.3)
        if e.get("cat") in ("phase", "step") and width > (end - start) / scale / 40:
            ax.text(left + width / 2, row, e["name"], ha="center", va="center", fontsize=7, clip_on=True)
    labels = []
    for track, lane in rows:
        name = f"{processes.get(track[0], track[0])} · {threads.get(track, track[1])}"
        labels.append(name if lane == 0 else "")
    ax.set_yticks([y[row] for row in rows], labels, fontsize=7)
    ax.set_xlim(0, (end - start) / scale)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    for i, (track, lane) in enumerate(rows[1:], 1):  # a line between processes
        if track[0] != rows[i - 1][0][0]:
            ax.axhline(y[(track, lane)] + 0.5, color="0.3", lw=0.8)
    shown = [name for name in COLOURS if any(e["name"] == name for e in timed)]
    fig.legend([Patch(color=COLOURS[n]) for n in shown], shown, loc="outside lower center", ncol=11, fontsize=7)
    fig.suptitle(title or "timeline.json", fontsize=10)
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write(path, buffer.getvalue())
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a run's timeline.json")
    parser.add_argument("png", help="the PNG to write")
    parser.add_argument("--steps", nargs=2, type=int, metavar=("FIRST", "LAST"), help="only these steps' time")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args(argv)
    draw(timeline.read(args.trace), args.png, tuple(args.steps) if args.steps else None, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
