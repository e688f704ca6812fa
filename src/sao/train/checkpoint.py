"""A run folder: claiming it, and the checkpoint written after every step.

    OUT/config.json      the settings the run was started with (written once everything has loaded); a
                         folder holding one needs --resume and the same settings, so runs never mix
    OUT/checkpoint.pt    adapters, value head, both optimizers, counters, the source's state, the records
    OUT/train_log.json   the records, readable while the run goes on

Both per-step files are written atomically (beside, fsync, rename), the checkpoint first: a run killed
between the two resumes from the checkpoint and rewrites the log, so nothing is lost or counted twice.
Deliberately left out: the adapter export (``sao.model.artifacts``) and anything about the step itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sao.core.errors import ConfigError
from sao.core.io import as_json, read_json, save_torch, write_json

LOG_FILE, CHECKPOINT_FILE, CONFIG_FILE = "train_log.json", "checkpoint.pt", "config.json"


def claim(out: Path, record: dict[str, Any], resume: bool) -> None:
    """Refuse to mix runs: a folder with a config.json needs --resume and the same settings; a folder with
    other files is not ours to write into. Writes nothing."""
    config_file = out / CONFIG_FILE
    if config_file.exists():
        if not resume:
            raise ConfigError(
                f"output folder {out} already holds a run; pass --resume to continue it or choose another --out"
            )
        if same_settings(read_json(config_file), record):
            return
        raise ConfigError(f"--resume: the run in {out} was started with other settings; use a new --out")
    elif out.exists() and any(out.iterdir()):
        raise ConfigError(f"output folder {out} is not empty and holds no sao run; choose another --out")


# Settings that change how a run is watched, not what it computes: a resume may change them.
NOT_COMPARED_ON_RESUME = ("track",)


def same_settings(saved: Any, record: dict[str, Any]) -> bool:
    """Whether a saved settings record (config.json, experiment.json) is ``record``, watching aside."""

    def comparable(value: Any) -> Any:
        value = as_json(value)
        if isinstance(value, dict) and isinstance(value.get("config"), dict):
            value["config"] = {k: v for k, v in value["config"].items() if k not in NOT_COMPARED_ON_RESUME}
        return value

    return comparable(saved) == comparable(record)


def write_config(out: Path, record: dict[str, Any]) -> None:
    write_json(out / CONFIG_FILE, record)


def save(out: Path, state: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """The checkpoint, then the log."""
    save_torch(out / CHECKPOINT_FILE, state)
    write_json(out / LOG_FILE, records)


def load(out: Path) -> dict[str, Any] | None:
    """The last checkpoint's state, or None when the run has not completed a step."""
    path = out / CHECKPOINT_FILE
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
