"""A command whose stderr is a file (a log, a pipe, CI) writes no progress bar there: no ``\\r`` redraws from
transformers' weight loading or from sao's eval, only the lines a reader can use; on a terminal the bars stay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sao

SRC = Path(sao.__file__).resolve().parents[1]  # the sao under test, for the processes a test starts


def _logged(args: list[str], log: Path) -> tuple[int, str]:
    """``sao ARGS`` with stderr sent to ``log`` (a file, not a terminal), without --quiet; (exit code, the log)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    with open(log, "w", encoding="utf-8") as handle:
        done = subprocess.run(
            [sys.executable, "-m", "sao.cli", *args], stdout=subprocess.DEVNULL, stderr=handle, env=env, timeout=900
        )
    return done.returncode, log.read_text(encoding="utf-8", errors="replace")


def test_sao_eval_into_a_log_file_writes_no_progress_bar(tmp_path, faults, tiny_model_dir):
    code, text = _logged(
        [
            "eval",
            "--preset",
            "tiny",
            "--train-prompts",
            "8",
            "--test-prompts",
            "2",
            "--out",
            str(tmp_path / "eval.json"),
        ],
        tmp_path / "eval.log",
    )
    assert code == 0, text[-2000:]
    assert "\r" not in text and "Loading weights" not in text and "eval base" not in text, repr(text[:500])
    faults.record("log files", "sao eval with stderr to a file")


def test_sao_export_into_a_log_file_writes_no_progress_bar(tmp_path, faults):
    import torch

    from helpers import save_small_model
    from sao.model.artifacts import save_adapter
    from sao.model.policy import ValueHead, add_lora, load_base

    base_dir = save_small_model(tmp_path / "base")
    base, tokenizer = load_base(base_dir, torch.device("cpu"))
    save_adapter(
        add_lora(base, rank=4, alpha=8),
        tokenizer,
        ValueHead(base.config.hidden_size),
        tmp_path / "run" / "adapter",
        base_model=str(base_dir),
    )
    code, text = _logged(
        ["export", str(tmp_path / "run"), "--merge", str(tmp_path / "merged")], tmp_path / "export.log"
    )
    assert code == 0, text[-2000:]
    assert "\r" not in text and "Loading weights" not in text, repr(text[:500])
    faults.record("log files", "sao export with stderr to a file")
