"""The run folder's files: checkpoints follow the umask (safetensors included), a disk that fills while the tensors are
written is one line with the previous checkpoint intact and no staging folder left, and a folder a run holds is
locked (a second run is refused; a killed run leaves no stale lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sao
from sao.core import run_folder
from sao.core.errors import ConfigError
from sao.core.io import file_mode, folder_mode
from sao.training import checkpoint

SRC = Path(sao.__file__).resolve().parents[1]  # the sao under test, for the processes a test starts


def _state(step: int, size: int = 4) -> dict:
    return {"next_step": step, "policy": {"w": torch.arange(size, dtype=torch.float32)}, "warnings": []}


def _modes(root: Path) -> dict[str, int]:
    """The mode of everything below ``root`` (not ``root`` itself: the test made it)."""
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in root.rglob("*")}


def _run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_a_checkpoints_files_follow_the_umask(tmp_path, faults):
    """safetensors writes its files 0o600; a checkpoint's tensors get what a plain open() gives, as state.json does."""
    folder = checkpoint.save(tmp_path, _state(1), records=[{"step": 0}])
    modes = _modes(tmp_path)
    files = {name: mode for name, mode in modes.items() if (tmp_path / name).is_file()}
    assert files == {
        f"checkpoints/{folder.name}/{checkpoint.TENSORS_FILE}": file_mode(),
        f"checkpoints/{folder.name}/{checkpoint.STATE_FILE}": file_mode(),
    }, modes
    assert all(mode == folder_mode() for name, mode in modes.items() if (tmp_path / name).is_dir()), modes
    faults.record("run folders", "a checkpoint's safetensors under the umask")


FULL_DISK = """
    import resource, signal, sys, torch
    from pathlib import Path
    from sao.training import checkpoint
    out = Path(sys.argv[1])
    checkpoint.save(out, {"next_step": 1, "policy": {"w": torch.zeros(4)}, "warnings": []}, records=[])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))
    try:
        checkpoint.save(out, {"next_step": 2, "policy": {"w": torch.zeros(100_000)}, "warnings": []}, records=[])
    except Exception as error:
        print(type(error).__name__, error, sep="|")
"""


def test_a_full_disk_while_the_tensors_are_written_is_one_line_and_leaves_the_last_checkpoint(tmp_path, faults):
    done = _run(FULL_DISK, str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    kind, message = done.stdout.strip().split("|", 1)
    assert kind == "OutputError" and "\n" not in message, done.stdout
    assert "step-000002" in message and "free space, then rerun with --resume" in message, message
    names = sorted(p.name for p in (tmp_path / checkpoint.CHECKPOINTS_DIR).iterdir())
    assert names == ["step-000001"], f"a staging folder was left: {names}"
    assert checkpoint._load_folder(tmp_path / "checkpoints" / "step-000001", "fix")["next_step"] == 1
    faults.record("run folders", "a full disk while a checkpoint's safetensors are written")


def test_a_folder_a_run_holds_is_refused_to_a_second_and_free_once_released(tmp_path, faults):
    out = tmp_path / "run"
    first = run_folder.claim(out, {}, resume=False, lock=True)
    assert out.is_dir() and list(out.iterdir()) == [], "locked, nothing written"
    with pytest.raises(ConfigError, match="in use by another sao run"):
        run_folder.claim(out, {}, resume=False, lock=True)
    with pytest.raises(ConfigError, match="in use by another sao run"):
        run_folder.claim(out, {}, resume=True, lock=True)
    first.release()
    second = run_folder.claim(out, {}, resume=False, lock=True)  # free again
    second.release()
    assert first.undo() and not out.exists(), "the folder a new run made is removed again when it fails"
    faults.record("run folders", "a second claim on a folder a run holds")


HOLD = """
    import sys, time
    from pathlib import Path
    from sao.core import run_folder
    held = run_folder.claim(Path(sys.argv[1]), {}, resume=False, lock=True)
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD), str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="in use by another sao run"):
            run_folder.claim(out, {}, resume=False, lock=True)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    claimed = run_folder.claim(out, {}, resume=False, lock=True)  # the lock ended with the process
    claimed.undo()
