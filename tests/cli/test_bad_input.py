"""Bad data and bad configuration through the CLI: one line that says what is wrong and how to fix it,
exit code 2, no traceback, and no partial or overwritten results."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sao.cli import main

DATA = Path(__file__).resolve().parents[2] / "data" / "gsm8k"
GOOD = '{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\\n#### 7"}\n'


def _gsm8k_dir(tmp_path: Path, train: str | None, test: str | None) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    for name, text in (("train.jsonl", train), ("test.jsonl", test)):
        if text is not None:
            (folder / name).write_text(text)
    return folder


def _fails_in_one_line(capsys, argv: list[str], out: Path, needle: str) -> str:
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    after = sorted(p.name for p in out.iterdir()) if out.exists() else None
    assert after == before or (before is None and after == []), "the output folder changed"
    return lines[0]


BAD_DATA = {
    "missing train file": (None, GOOD * 130, "train.jsonl"),
    "empty test file": (GOOD * 600, "", "test.jsonl"),
    "truncated last line": (GOOD * 600, GOOD * 129 + GOOD[:40], "line 130"),
    "malformed line": (GOOD * 600, GOOD * 5 + "not json at all\n" + GOOD * 124, "line 6"),
    "record without gold answer": (GOOD * 600, GOOD * 7 + '{"question": "q?", "answer": "no marker"}\n', "####"),
    "fewer prompts than asked": (GOOD * 20, GOOD * 130, "512"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_gsm8k_data_is_one_line_and_writes_nothing(tmp_path, capsys, case, faults, tiny_model_dir):
    train, test, needle = BAD_DATA[case]
    data = _gsm8k_dir(tmp_path, train, test)
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--data", str(data), "--train-prompts", "512", "--quiet", "--out", str(out)]
    _fails_in_one_line(capsys, argv, out, needle)
    faults.record("bad data", case)


def _model_without_chat_template(tiny_model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


BAD_CONFIG = {
    "unknown arm": (["--correction", "ppo"], "--correction must be a correction rule"),
    "band not bracketing 1": (["--ratio", "1.2", "6"], "must bracket 1"),
    "lag below 0": (["--lag", "-2"], "--lag must be >= 0"),
    "model path that does not exist": (["--model", "./models/none-here"], "is not a directory"),
    "batch larger than the prompts": (["--batch-size", "100", "--train-prompts", "64"], "larger than"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIG))
def test_bad_configuration_is_one_line_and_writes_nothing(tmp_path, capsys, case, faults, tiny_model_dir):
    extra, needle = BAD_CONFIG[case]
    out = tmp_path / "run"
    _fails_in_one_line(capsys, ["train", "--preset", "tiny", "--quiet", "--out", str(out), *extra], out, needle)
    faults.record("bad configuration", case)


def test_missing_chat_template_is_one_line(tmp_path, capsys, faults, tiny_model_dir):
    model = _model_without_chat_template(tiny_model_dir, tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--model", str(model), "--quiet", "--out", str(out)]
    _fails_in_one_line(capsys, argv, out, "chat template")
    faults.record("bad configuration", "tokenizer without a chat template")


def test_output_folder_holding_another_run_is_refused_and_left_intact(tmp_path, capsys, faults, tiny_model_dir):
    out = tmp_path / "exp"
    small = ["--preset", "tiny", "--batch-size", "8", "--steps", "1", "--critic-warmup", "1", "--quiet"]
    assert main(["train", *small, "--out", str(out)]) == 0
    capsys.readouterr()
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    _fails_in_one_line(capsys, ["train", *small, "--out", str(out)], out, "already holds a run")
    _fails_in_one_line(capsys, ["train", *small, "--lr", "0.1", "--resume", "--out", str(out)], out, "other settings")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot
    faults.record("bad configuration", "output folder holding another run")
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "thesis.tex").write_text("precious")
    _fails_in_one_line(capsys, ["recipe", *small, "--out", str(stranger)], stranger, "not empty")
    assert (stranger / "thesis.tex").read_text() == "precious"
    faults.record("bad configuration", "output folder holding other files")


def test_a_real_process_exits_2_with_one_line_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sao.cli",
            "train",
            "--preset",
            "tiny",
            "--ratio",
            "2",
            "3",
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sao train: error: --ratio must bracket 1: need 0 <= lo < 1 < hi, got (2.0, 3.0)"
    ]
    assert not (tmp_path / "x").exists()
