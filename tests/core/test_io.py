"""Files are written whole or not at all: a failed write leaves the previous complete file."""

from __future__ import annotations

import errno
import json
import math
import os

import pytest
import torch

from sao.core import io
from sao.core.errors import SaoError


def test_json_writes_nan_and_inf_as_null_and_tuples_as_lists(tmp_path):
    path = tmp_path / "x.json"
    io.write_json(path, {"a": float("nan"), "b": (1, float("inf")), "c": torch.tensor([0.5]), "d": 2.0})
    assert json.loads(path.read_text()) == {"a": None, "b": [1, None], "c": [0.5], "d": 2.0}


@pytest.mark.parametrize("writer", ["json", "bytes"])
def test_disk_full_keeps_the_previous_file_and_says_so_in_one_line(tmp_path, monkeypatch, writer, faults):
    path = tmp_path / "results.bin"
    good = {"step": 1, "value": 0.25}
    write = io.write_json if writer == "json" else lambda path, obj: io.atomic_write(path, json.dumps(obj).encode())
    write(path, good)
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io.os, "fsync", full)
    with pytest.raises(SaoError) as caught:
        write(path, {"step": 2, "value": math.pi})
    message = str(caught.value)
    assert "No space left on device" in message and "--resume" in message and "\n" not in message
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.bin"], "no temporary file left behind"
    faults.record("full disk / unwritable output", f"ENOSPC in {writer} write")


def test_an_output_path_that_cannot_be_a_folder_is_an_output_error(tmp_path, faults):
    blocker = tmp_path / "results"
    blocker.write_text("a file where the output folder should be")
    with pytest.raises(io.OutputError, match="could not write"):
        io.write_json(blocker / "x.json", {"a": 1})
    assert blocker.read_text().startswith("a file")
    faults.record("full disk / unwritable output", "output path blocked by a file")


def test_files_and_folders_are_written_with_the_users_umask(tmp_path):
    """Written files get 0o666 less the umask, as a plain open() gives, not mkstemp's 0o600."""
    path = tmp_path / "results.json"
    io.write_json(path, {"a": 1})
    assert path.stat().st_mode & 0o777 == io.file_mode() == 0o666 & ~io._umask()
    assert io.folder_mode() == 0o777 & ~io._umask()
