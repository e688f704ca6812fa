"""`sao probe RUN` on snapshots whose hidden states do and do not carry the prompts' difficulty: one line, a JSON
file, a run's folder or an experiment's, and one line with exit code 2 for a folder without snapshots."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors.torch import save_file

from sao.cli import main
from sao.experiment.probe import signal_share


def write_snapshot(run, step: int, carries: bool, seed: int, prompts: int = 96, samples: int = 16, width: int = 12):
    """A snapshot as ``--ceiling-every`` keeps it: each prompt's K returns, the hidden state at its last token, and
    its reply tokens' states (the prompt's state plus noise). ``carries``: the success rate is a function of the
    state; else it is drawn apart from it."""
    rng = np.random.default_rng(seed)
    state = rng.normal(size=(prompts, width))
    rate = (
        1 / (1 + np.exp(-2 * state @ rng.normal(size=width) / np.sqrt(width))) if carries else rng.uniform(size=prompts)
    )
    returns = (rng.random((prompts, samples)) < rate[:, None]).astype(np.float32)
    token_prompt = np.repeat(np.arange(prompts), 5)
    tokens = state[token_prompt] + 0.1 * rng.normal(size=(len(token_prompt), width))
    tensors = {
        "returns": torch.tensor(returns),
        "lengths": torch.full((prompts, samples), 5.0),
        "prompt_hidden": torch.tensor(state, dtype=torch.float32),
        "token_hidden": torch.tensor(tokens, dtype=torch.float32),
        "token_prompt": torch.tensor(token_prompt),
    }
    (run / "oracle").mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(run / "oracle" / f"step-{step:06d}.safetensors"), metadata={"step": str(step)})


def test_the_probe_tells_a_representation_that_carries_the_difficulty_from_one_that_does_not(tmp_path, capsys):
    run = tmp_path / "run"
    write_snapshot(run, 9, carries=False, seed=1)
    write_snapshot(run, 49, carries=True, seed=2)
    (run / "train_log.jsonl").write_text(json.dumps({"step": 9, "ceiling_snapshot": "warmup-end"}) + "\n")
    assert main(["probe", str(run)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("sao probe:") and "warmup-end" in out[0]
    found = json.loads((run / "probe.json").read_text())
    apart, carried = found["snapshots"]
    assert apart["snapshot"] == "warmup-end" and carried["snapshot"] == "49"  # a step the log does not name
    assert apart["prompt_token"]["r2"] < 0.1 and apart["per_token"]["r2"] < 0.1
    assert carried["prompt_token"]["r2"] > 0.4 and carried["per_token"]["r2"] > 0.4
    assert carried["prompt_token"]["r2"] <= carried["signal_share"] + 0.1  # no probe predicts the samples' noise
    assert found["summary"][1]["prompt_token_r2"] == carried["prompt_token"]["r2"]


def test_the_probe_reads_every_run_of_an_experiment_and_refuses_a_folder_without_snapshots(tmp_path, capsys):
    for seed in (1, 2, 3):
        write_snapshot(tmp_path / "exp" / "cells" / "lag4" / "runs" / f"dis-s{seed}", 9, carries=True, seed=seed)
    (tmp_path / "exp" / "cells" / "lag4" / "runs" / "none-s1").mkdir()  # trained without snapshots: left out
    assert main(["probe", str(tmp_path / "exp")]) == 0
    assert "medians over 3 runs" in capsys.readouterr().out
    found = json.loads((tmp_path / "exp" / "probe.json").read_text())
    assert found["kind"] == "experiment" and [r["run"] for r in found["runs"]] == ["dis-s1", "dis-s2", "dis-s3"]
    assert all(r["cell"] == "lag4" for r in found["runs"]) and found["summary"][0]["runs"] == 3
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        assert main(["probe", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("sao probe: error:")


def test_the_signal_share_is_the_rates_variance_less_their_sampling_noise():
    rng = np.random.default_rng(4)
    p = np.repeat([0.2, 0.8], 3000)
    returns = (rng.random((len(p), 8)) < p[:, None]).astype(float)
    # Var(p̂) = Var(p) + E[p(1 − p)] / K = 0.09 + 0.02: signal 0.09 / 0.11
    assert abs(signal_share(returns) - 0.09 / 0.11) < 0.03
    assert np.isnan(signal_share(np.ones((4, 8))))
