"""What a user meets in the first hour: a refused --resume says which settings differ, an unknown flag gets the
command's usage and the flag it most likely meant, and sao --version says what a bug report needs. Each passing
case records a row of the fault table."""

from __future__ import annotations

import pytest

from helpers import refused_in_one_line
from sao.cli import main
from sao.core.config import Config


def test_a_resume_with_other_settings_names_them(tmp_path, capsys, faults):
    """A run folder started at --lr 0.001 and --batch-size 8; resumed at --lr 0.1: refused before any model loads,
    naming --lr with both values, and only what differs."""
    from sao.tasks import setup
    from sao.training import checkpoint

    config = Config.load("tiny", lr=1e-3, batch_size=8, train_prompts=16, test_prompts=4)
    out = tmp_path / "run"
    out.mkdir()
    checkpoint.write_config(out, checkpoint.run_record(config, setup.task_set(config)))
    argv = [
        "train",
        "--preset",
        "tiny",
        "--lr",
        "0.1",
        "--batch-size",
        "8",
        "--train-prompts",
        "16",
        "--test-prompts",
        "4",
        "--resume",
        "--out",
        str(out),
    ]
    line = refused_in_one_line(capsys, argv, out, "started with other settings", "--lr 0.001 then, 0.1 now")
    assert "--batch-size" not in line
    faults.record("first-hour edges", "--resume with another --lr")


def test_what_differs_counts_past_its_limit():
    from sao.core.run_folder import settings_differ

    before = {"config": Config.load("tiny").to_dict()}
    after = {
        "config": Config.load(
            "tiny", lr=0.5, seed=3, steps=7, batch_size=5, gate_margin=0.2, critic_lr=0.3, weight_decay=0.1
        ).to_dict(),
        "passed": {"reward_fn": "m:f"},
    }
    text = settings_differ(before, after)
    assert text.count(" then, ") == 6 and text.endswith("and 2 more")
    assert settings_differ(before, before) is None


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["train", "--lrr", "0.1", "--out", "x"], "usage: sao train", "--lrr: did you mean --lr?"),
        (["eval", "--sample", "2"], "usage: sao eval", "--sample: did you mean --samples?"),
        (["report", "x", "--plots"], "usage: sao report", "sao report --help lists its flags"),
    ],
)
def test_an_unknown_flag_gets_the_commands_usage_and_a_did_you_mean(
    tmp_path, capsys, monkeypatch, faults, argv, usage, hint
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert err.startswith(usage) and "usage: sao [-h]" not in err
    assert f"sao {argv[0]}: error: unrecognized arguments: " in err and hint in err.strip().splitlines()[-1]
    assert not any(tmp_path.iterdir())
    faults.record("first-hour edges", f"an unknown flag to sao {argv[0]}")


def test_version_says_the_commit_torch_transformers_and_the_device(capsys, faults):
    import torch
    import transformers

    from sao.experiment.provenance import sao_commit

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    out = capsys.readouterr().out.strip()
    assert stop.value.code == 0 and len(out.splitlines()) == 1
    commit = sao_commit()["commit"]
    assert out.startswith("sao ") and (commit[:12] if commit != "unknown" else "commit unknown") in out
    assert f"torch {torch.__version__}" in out and f"transformers {transformers.__version__}" in out
    assert "device cpu" in out or f"device {torch.cuda.get_device_name(0)}" in out
    faults.record("first-hour edges", "sao --version")
