"""Experiment tracking: the per-step training records and the eval results, mirrored to TensorBoard, trackio or
W&B, so a run can be watched in the dashboard its user already knows (``--track tensorboard|trackio|wandb``).

``make_tracker(kind, out_dir, run_name, config)`` returns an object with ``log_step`` / ``log_eval`` / ``close``;
``None`` writes nothing (the default). Every finite number is logged (``train/<key>``, ``eval/<label>/<key>``);
anything else is skipped, not flattened. Each backend is imported only when asked for; a missing one is a one-line
``ConfigError`` naming the pip extra.

Deliberately left out: online W&B, trackio Spaces and servers, media and histograms, and any retry or buffering of
our own: a tracker mirrors the JSON files, it is never the only copy. Design notes: docs/design/tracking.md.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Protocol

from sao.core.errors import ConfigError
from sao.core.io import clean

KINDS = ("tensorboard", "trackio", "wandb")
PROJECT = "sao"  # the trackio / W&B project every run is filed under
TENSORBOARD_DIR = "tensorboard"


class Tracker(Protocol):
    """Where the run's numbers are mirrored; every method is cheap next to a training step."""

    def log_step(self, record: dict[str, Any], step: int) -> None: ...

    def log_eval(self, label: str, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(values: dict[str, Any], prefix: str) -> dict[str, float]:
    """The finite real numbers of ``values`` (bools excluded), keyed ``prefix/key``; everything else dropped."""
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue  # None, str, bool, dict, list (numpy bools are not numbers.Real either)
        number = float(value)
        if math.isfinite(number):
            out[f"{prefix}/{key}"] = number
    return out


def plain_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as JSON would store it (tuples → lists, NaN → null, anything else unknown → its str)."""
    return json.loads(json.dumps(clean(config), default=str, allow_nan=False))


def eval_prefix(label: str) -> str:
    """``eval/<label>`` with the label made tag-safe (``dis seed 0`` → ``eval/dis_seed_0``)."""
    safe = re.sub(r"[^A-Za-z0-9_.@-]+", "_", label.strip()).strip("_")
    return f"eval/{safe or 'eval'}"


def make_tracker(kind: str | None, out_dir: Path, run_name: str, config: dict[str, Any]) -> Tracker:
    """The tracker for ``kind`` (None or "none": one that does nothing). ``config`` is the run's settings,
    stored once with the run; ``run_name`` is how the dashboard lists it."""
    if kind is None or kind == "none":
        return NullTracker()
    if kind == "tensorboard":
        return TensorBoardTracker(Path(out_dir), run_name, config)
    if kind == "trackio":
        return trackio_run(run_name, config)
    if kind == "wandb":
        return wandb_run(Path(out_dir), run_name, config)
    raise ConfigError(f"--track {kind!r} is not a tracker; choose one of {', '.join(KINDS)} (or leave it out)")


def _missing(backend: str, extra: str, error: ImportError) -> ConfigError:
    return ConfigError(
        f"--track {backend} needs {backend}, which is not installed ({error}); pip install 'sao[{extra}]'"
    )


class NullTracker:
    """``--track`` not given: every call does nothing."""

    def log_step(self, record: dict[str, Any], step: int) -> None:
        pass

    def log_eval(self, label: str, metrics: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` into OUT/tensorboard (``tensorboard --logdir
    OUT``); the config as a JSON text summary under the tag ``config``. A resumed run adds a new event file
    beside the old ones and TensorBoard reads them as one run."""

    def __init__(self, out_dir: Path, run_name: str, config: dict[str, Any]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise _missing("tensorboard", "track", error) from None
        self.log_dir = out_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        settings = json.dumps({"run": run_name, "config": plain_config(config)}, indent=2, sort_keys=True)
        self.writer.add_text("config", f"```\n{settings}\n```", global_step=0)  # fenced: Markdown keeps the layout

    def _write(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def log_step(self, record: dict[str, Any], step: int) -> None:
        self._write(scalars(record, "train"), step)

    def log_eval(self, label: str, metrics: dict[str, Any], step: int) -> None:
        self._write(scalars(metrics, eval_prefix(label)), step)
        self.writer.flush()  # evals are rare and worth seeing at once

    def close(self) -> None:
        self.writer.close()  # flushes; a second close is harmless


class RunTracker:
    """A tracker over a run object with ``log(values, step=...)`` and ``finish()``: trackio's and W&B's, each
    started by its own function (``trackio_run``, ``wandb_run``)."""

    def __init__(self, run: Any):
        self.run, self.closed = run, False

    def log_step(self, record: dict[str, Any], step: int) -> None:
        self.run.log(scalars(record, "train"), step=step)

    def log_eval(self, label: str, metrics: dict[str, Any], step: int) -> None:
        self.run.log(scalars(metrics, eval_prefix(label)), step=step)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.run.finish()


def trackio_run(run_name: str, config: dict[str, Any]) -> RunTracker:
    """trackio, local only: its SQLite store under ``$TRACKIO_DIR`` (trackio's cache folder when unset), project
    ``sao``; ``trackio show --project sao`` opens the dashboard. trackio reads ``$TRACKIO_DIR`` once, when it is
    first imported, so the folder is the process's, not the run's. trackio keeps one current run per process:
    opening a second tracker finishes the first, so open them one after another. A Space or server set in
    trackio's own environment variables is refused rather than uploaded to."""
    for variable in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        if os.environ.get(variable):
            raise ConfigError(f"--track trackio logs locally only; unset {variable} (or log with trackio itself)")
    try:
        import trackio
    except ImportError as error:
        raise _missing("trackio", "trackio", error) from None
    return RunTracker(trackio.init(project=PROJECT, name=run_name, config=plain_config(config)))


def wandb_run(out_dir: Path, run_name: str, config: dict[str, Any]) -> RunTracker:
    """W&B with ``mode="offline"`` (whatever ``WANDB_MODE`` says): files under OUT/wandb, nothing sent;
    ``wandb sync OUT/wandb/offline-run-*`` uploads a run later. Console capture is off (the progress bar stays
    ours); each tracker is its own W&B run, so the two arms of a recipe never share one. W&B drops a point whose
    step is below one it has already seen: log an eval at the last training step or later."""
    try:
        import wandb
    except ImportError as error:
        raise _missing("wandb", "wandb", error) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=PROJECT,
        name=run_name,
        dir=str(out_dir),
        config=plain_config(config),
        mode="offline",
        reinit="create_new",
        settings=wandb.Settings(console="off"),
    )
    if run.settings.mode != "offline":  # never online, even if a future wandb lets the env win
        run.finish()
        raise ConfigError("--track wandb runs offline only, but wandb did not start offline; unset WANDB_MODE")
    return RunTracker(run)
