"""Run folders from the command line: two ``sao train`` on one --out at once (the second refused in one line, the
first's run whole); a disk that fills while a checkpoint's safetensors are written (one line, exit 2, no staging
folder, --resume finishing the run, every file with the umask's mode); ``sao export`` and ``sao eval`` of a truncated
adapter (one line naming the file, exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import sao
from helpers import refused_in_one_line, run_log
from sao.cli import main
from sao.core.io import file_mode, folder_mode

SRC = Path(sao.__file__).resolve().parents[1]  # the sao under test, for the processes a test starts
SMALL = ["--preset", "tiny", "--batch-size", "8", "--critic-warmup", "1", "--quiet"]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def test_a_second_sao_train_on_the_same_out_is_refused_while_the_first_runs(tmp_path, capsys, faults, tiny_model_dir):
    out = tmp_path / "run"
    argv = ["train", *SMALL, "--steps", "6", "--out", str(out)]
    first = subprocess.Popen(
        [sys.executable, "-m", "sao.cli", *argv], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        give_up = time.monotonic() + 300
        while not out.is_dir() and first.poll() is None and time.monotonic() < give_up:
            time.sleep(0.05)  # the first run claims (and locks) the folder before it loads anything
        assert out.is_dir() and first.poll() is None, "the first run did not start"
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert f"output folder {out} is in use by another sao run" in err[0], err[0]
        running = first.poll() is None
        _, stderr = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    assert running, "the second was refused while the first ran"
    assert first.returncode == 0, stderr[-2000:]
    records = run_log(out)
    assert [r["step"] for r in records] == list(range(7)), "the first run's log whole: nothing of a second in it"
    assert json.loads((out / "config.json").read_text())["config"]["training"]["steps"] == 6
    faults.record("run folders", "two sao train on one --out at once")


FILLS_AT_THE_SECOND_CHECKPOINT = """
    import resource, signal, sys
    from sao.cli import main
    from sao.training import checkpoint

    save = checkpoint.save

    def fills(out, state, records, keep=1):
        if state["next_step"] == 2:  # the first checkpoint is on disk: now the disk is full
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        return save(out, state, records, keep)

    checkpoint.save = fills
    sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_while_safetensors_are_written_is_one_line_and_resume_finishes(
    tmp_path, capsys, faults, tiny_model_dir
):
    out = tmp_path / "run"
    argv = ["train", *SMALL, "--steps", "3", "--checkpoint-every", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FILLS_AT_THE_SECOND_CHECKPOINT), *argv],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "step-000002" in lines[0] and "free space, then rerun with --resume" in lines[0], lines[0]
    hidden = [p.name for p in out.rglob(".*")]
    assert hidden == [], f"left behind: {hidden}"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    faults.record("run folders", "a full disk while sao train writes a checkpoint's safetensors")
    assert main(["train", *SMALL, "--steps", "3", "--checkpoint-every", "1", "--out", str(out), "--resume"]) == 0
    capsys.readouterr()
    assert [r["step"] for r in run_log(out)] == [0, 1, 2, 3]
    faults.record("run folders", "--resume after a full disk")
    wrong = {
        str(p.relative_to(out)): oct(p.stat().st_mode & 0o777)
        for p in out.rglob("*")
        if p.stat().st_mode & 0o777 != (folder_mode() if p.is_dir() else file_mode())
    }
    assert wrong == {}, f"umask {0o777 & ~folder_mode():03o}"
    faults.record("run folders", "a sao train run folder under the umask (adapter and checkpoints included)")


@pytest.fixture(scope="module")
def truncated_adapter(tmp_path_factory):
    """A run folder whose adapter_model.safetensors lost its last bytes (a copy cut short, a disk that filled)."""
    import torch

    from helpers import save_small_model
    from sao.model.artifacts import save_adapter
    from sao.model.policy import ValueHead, add_lora, load_base

    root = tmp_path_factory.mktemp("truncated")
    base_dir = save_small_model(root / "base")
    base, tokenizer = load_base(base_dir, torch.device("cpu"))
    adapter = save_adapter(
        add_lora(base, rank=4, alpha=8),
        tokenizer,
        ValueHead(base.config.hidden_size),
        root / "run" / "adapter",
        base_model=str(base_dir),
    )
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    return root / "run", base_dir, weights


def test_sao_export_of_a_truncated_adapter_is_one_line(truncated_adapter, tmp_path, capsys, faults):
    run, _, weights = truncated_adapter
    merged = tmp_path / "merged"
    refused_in_one_line(capsys, ["export", str(run), "--merge", str(merged)], merged, str(weights), "truncated")
    faults.record("run folders", "sao export of a run whose adapter_model.safetensors is truncated")


def test_sao_eval_of_a_truncated_adapter_is_one_line(truncated_adapter, tmp_path, capsys, faults):
    run, base_dir, weights = truncated_adapter
    out = tmp_path / "eval.json"
    argv = [
        "eval",
        "--model",
        str(base_dir),
        "--data",
        "tiny",
        "--train-prompts",
        "8",
        "--test-prompts",
        "4",
        "--adapter",
        str(run / "adapter"),
        "--quiet",
        "--out",
        str(out),
    ]
    refused_in_one_line(capsys, argv, tmp_path, str(weights), "truncated")
    faults.record("run folders", "sao eval --adapter of a truncated adapter_model.safetensors")
