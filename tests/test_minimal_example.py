"""examples/sao_minimal.py, the whole method in one flat loop, logs exactly what ``Trainer`` logs on the tiny preset
(5 steps: 2 critic-warmup, 3 policy, staleness 0..2)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import sao

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sao_minimal.py"


def test_the_minimal_example_matches_the_trainer_step_for_step(tmp_path, tiny_model_dir):
    spec = importlib.util.spec_from_file_location("sao_minimal", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules["sao_minimal"] = example  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(example)
    finally:
        sys.modules.pop("sao_minimal", None)
    flat = example.main(example.Args(steps=3, critic_warmup=2, batch_size=16))
    trainer = sao.train({"preset": "tiny", "steps": 3, "critic_warmup": 2, "batch_size": 16}, tmp_path / "run",
                        progress=False)  # fmt: skip
    assert len(flat) == len(trainer.records) == 5
    assert [r["staleness"] for r in flat] == [0, 0, 0, 1, 2]
    for mine, theirs in zip(flat, trainer.records, strict=True):
        for key, value in mine.items():
            same = value == theirs[key] or (math.isnan(value) and math.isnan(theirs[key]))
            assert same, f"step {mine['step']} {key}: example {value} vs trainer {theirs[key]}"
    assert len(EXAMPLE.read_text().splitlines()) <= 300
