"""Assertions and helpers shared by several test files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any


def assert_png_linked(folder: Path, text: str, stem: str, min_bytes: int) -> None:
    """plots/<stem>.png is a real, drawn PNG of a readable size, and the markdown links to it."""
    data = (folder / "plots" / f"{stem}.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width >= 600 and height >= 300
    assert len(data) > min_bytes  # drawn, not an empty canvas
    assert f"](plots/{stem}.png)" in text


def without_keys(obj: Any, keys: set[str]) -> Any:
    """``obj`` (nested dicts and lists) with every dict entry whose key is in ``keys`` left out, at any depth:
    what two runs should share once their timings and other volatile fields are set aside."""
    if isinstance(obj, dict):
        return {k: without_keys(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [without_keys(v, keys) for v in obj]
    return obj


def run_log(folder: Path) -> list[dict[str, Any]]:
    """The step records of a run folder (train_log.jsonl, appended as it goes) or of an experiment folder
    (train_log.json: every run's records with their cell, written once at the end)."""
    import json

    folder = Path(folder)
    if (folder / "train_log.jsonl").exists() or not (folder / "train_log.json").exists():
        return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((folder / "train_log.json").read_text())
