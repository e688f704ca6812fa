"""Assertions shared by the report tests."""

from __future__ import annotations

import struct
from pathlib import Path


def assert_png_linked(folder: Path, text: str, stem: str, min_bytes: int) -> None:
    """plots/<stem>.png is a real, drawn PNG of a readable size, and the markdown links to it."""
    data = (folder / "plots" / f"{stem}.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width >= 600 and height >= 300
    assert len(data) > min_bytes  # drawn, not an empty canvas
    assert f"](plots/{stem}.png)" in text
