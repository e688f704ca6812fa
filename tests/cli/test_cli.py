"""The CLI end to end: one short tiny run per command, and one-line errors for user mistakes."""

from __future__ import annotations

import json

import pytest

from helpers import run_log
from sao.cli import main


def test_train_writes_a_complete_log_and_prints_a_summary(tiny_model_dir, tmp_path, capsys):
    """One `sao train` end to end, watched through TensorBoard: the events hold every step's reward."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--preset",
            "tiny",
            "--steps",
            "3",
            "--critic-warmup",
            "2",
            "--batch-size",
            "16",
            "--lag",
            "1",
            "--ratio",
            "0.5",
            "3.0",
            "--quiet",
            "--track",
            "tensorboard",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "reward:" in text and "lag-0 batches" in text
    records = run_log(out)
    assert [r["phase"] for r in records] == ["critic-warmup"] * 2 + ["policy"] * 3
    saved = json.loads((out / "config.json").read_text())["config"]  # in sections, one name per knob
    assert saved["algorithm"]["ratio"] == [0.5, 3.0] and saved["rollout"]["local"]["lag"] == 1
    assert saved["model"]["name"] == "tiny"
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/reward_mean")]
    assert logged == [(r["step"], pytest.approx(r["reward_mean"], rel=1e-6)) for r in records]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--correction", "ppo"], "--correction must be a correction rule"),
        (["--ratio", "1.5", "6"], "bracket 1"),
        (["--lag", "-1"], "--lag must be >= 0"),
        (["--model", "./no/such/model"], "not a directory"),
        (["--data", "./no/such/dir"], "not a directory"),
    ],
)
def test_bad_settings_are_one_line_errors(tmp_path, capsys, argv, needle):
    code = main(["train", "--preset", "tiny", "--quiet", "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_failed_start_leaves_the_output_folder_empty(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--quiet", "--model", "./no/such/model", "--out", str(out)]) == 2
    assert not out.exists() or not any(out.iterdir())


def test_serve_help_lists_the_settings_serving_reads_and_no_training_one(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    flags = {word for word in capsys.readouterr().out.split() if word.startswith("--")}
    read = {"--model", "--lora-rank", "--reward", "--reward-timeout", "--temperature", "--traces", "--upstream"}
    assert read <= flags
    assert not flags & {"--grad-checkpoint", "--logprob-chunk", "--lr", "--lag", "--steps", "--critic-warmup"}
