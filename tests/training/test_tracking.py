"""--track: the numbers that reach TensorBoard / trackio / W&B are the records' numbers, at the records' steps.

TensorBoard is read back from its event files; trackio from its SQLite store (in a child process, since trackio
fixes its folder on first import); W&B from its offline transaction log. trackio and W&B are optional extras and
their round trips are skipped where they are not installed; a missing backend is simulated for all three.
None of these tests need the tiny model.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sao.core.errors import ConfigError
from sao.training.tracking import make_tracker, scalars

# Three step records shaped like train_log.json's: numbers, None, NaN, bools, strings, a dict.
RECORDS = [
    {
        "arm": "dis",
        "step": step,
        "phase": "critic-warmup" if step == 0 else "policy",
        "policy_step": None if step == 0 else step - 1,
        "staleness": step % 2,
        "reward_mean": 0.125 + 0.3 * step,
        "masked_share": 0.0123 * step,
        "ratio_max": 1.7 + step,
        "explained_variance": float("nan") if step == 1 else 0.4,
        "grad_norm": float("nan") if step == 0 else 0.83 / step,
        "skipped": step == 2,
        "staleness_hist": {"0": 3, "1": 5},
    }
    for step in range(3)
]
EVAL = {"label": "dis seed 0", "pass_at_1": 0.4375, "per_task": [1.0, 0.0], "samples": 4, "seconds": 2.5}
EVAL_STEP = 3
CONFIG = {"arm": "dis", "lr": 1e-3, "band": (0.7, 6.0), "out": Path("runs") / "x"}


def expected_series(prefix: str = "train") -> dict[str, list[tuple[int, float]]]:
    """tag → [(step, value)] the tracker should have written for RECORDS."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in RECORDS:
        for key, value in record.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            series.setdefault(f"{prefix}/{key}", []).append((record["step"], float(value)))
    return series


def log_all(tracker) -> None:
    for record in RECORDS:
        tracker.log_step(record, record["step"])
    tracker.log_eval(EVAL["label"], EVAL, EVAL_STEP)
    tracker.close()


def test_scalars_keeps_finite_real_numbers_only():
    values = {
        "a": 1,
        "b": 0.5,
        "c": np.float32(0.25),
        "d": np.int64(7),
        "none": None,
        "nan": float("nan"),
        "inf": float("inf"),
        "flag": True,
        "np_flag": np.bool_(True),
        "text": "policy",
        "hist": {"0": 1},
        "list": [1.0],
    }
    assert scalars(values, "train") == {"train/a": 1.0, "train/b": 0.5, "train/c": 0.25, "train/d": 7.0}


def test_tensorboard_event_files_hold_every_number_at_its_step_and_nothing_else(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(make_tracker("tensorboard", tmp_path, "dis seed 0", CONFIG))

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    expected = expected_series()
    expected["eval/dis_seed_0/pass_at_1"] = [(EVAL_STEP, 0.4375)]
    expected["eval/dis_seed_0/samples"] = [(EVAL_STEP, 4.0)]
    expected["eval/dis_seed_0/seconds"] = [(EVAL_STEP, 2.5)]
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        logged = [(event.step, event.value) for event in events.Scalars(tag)]
        assert [step for step, _ in logged] == [step for step, _ in points], tag
        assert [value for _, value in logged] == pytest.approx([value for _, value in points], rel=1e-6), tag
    # NaN was skipped at its step, not written as NaN: explained_variance has no point at step 1
    assert [event.step for event in events.Scalars("train/explained_variance")] == [0, 2]
    assert [event.step for event in events.Scalars("train/grad_norm")] == [1, 2]
    assert not {"train/skipped", "train/arm", "train/phase", "train/staleness_hist"} & set(events.Tags()["scalars"])


def test_tensorboard_stores_the_run_config_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    make_tracker("tensorboard", tmp_path, "dis seed 0", CONFIG).close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    settings = json.loads(text.strip().removeprefix("```").removesuffix("```"))
    assert settings == {"run": "dis seed 0", "config": {"arm": "dis", "lr": 1e-3, "band": [0.7, 6.0], "out": "runs/x"}}


def test_no_tracker_writes_nothing(tmp_path):
    for kind in (None, "none"):
        log_all(make_tracker(kind, tmp_path, "dis seed 0", CONFIG))
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_tracker_is_a_config_error_naming_the_choices(tmp_path):
    with pytest.raises(ConfigError, match="tensorboard, trackio, wandb"):
        make_tracker("mlflow", tmp_path, "dis seed 0", CONFIG)


@pytest.mark.parametrize(
    ("kind", "module", "extra"),
    [
        ("tensorboard", "torch.utils.tensorboard", "track"),
        ("trackio", "trackio", "trackio"),
        ("wandb", "wandb", "wandb"),
    ],
)
def test_a_missing_backend_is_a_one_line_config_error_naming_the_extra(tmp_path, monkeypatch, kind, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    monkeypatch.delenv("TRACKIO_SPACE_ID", raising=False)
    monkeypatch.delenv("TRACKIO_SERVER_URL", raising=False)
    with pytest.raises(ConfigError) as caught:
        make_tracker(kind, tmp_path, "dis seed 0", CONFIG)
    message = str(caught.value)
    assert f"pip install 'sao[{extra}]'" in message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("variable", ["TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"])
def test_trackio_refuses_to_log_anywhere_but_locally(tmp_path, monkeypatch, variable):
    monkeypatch.setenv(variable, "https://example.invalid")
    with pytest.raises(ConfigError, match=variable):
        make_tracker("trackio", tmp_path, "dis seed 0", CONFIG)


TRACKIO_CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from sao.training.tracking import make_tracker

    records, evaluation, step = json.loads(sys.argv[1])
    tracker = make_tracker("trackio", Path(sys.argv[2]), "dis seed 0", {"arm": "dis", "lr": 1e-3})
    for record in records:
        tracker.log_step(record, record["step"])
    tracker.log_eval(evaluation["label"], evaluation, step)
    tracker.close()
    """
)


def test_trackio_store_holds_every_number_at_its_step(tmp_path):
    pytest.importorskip("trackio")
    store = tmp_path / "trackio"
    subprocess.run(
        [sys.executable, "-c", TRACKIO_CHILD, json.dumps([RECORDS, EVAL, EVAL_STEP]), str(tmp_path)],
        env={**_child_env(), "TRACKIO_DIR": str(store)},
        check=True,
        timeout=300,
        capture_output=True,
    )

    with sqlite3.connect(store / "sao.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
        (config,) = db.execute("SELECT config FROM configs").fetchone()
    assert {name for name, _, _ in rows} == {"dis seed 0"}
    logged: dict[str, list[tuple[int, float]]] = {}
    for _, step, metrics in rows:
        for tag, value in json.loads(metrics).items():
            logged.setdefault(tag, []).append((step, value))
    expected = expected_series()
    expected.update({"eval/dis_seed_0/pass_at_1": [(3, 0.4375)], "eval/dis_seed_0/samples": [(3, 4.0)]})
    expected["eval/dis_seed_0/seconds"] = [(3, 2.5)]
    assert logged == expected
    assert json.loads(config)["lr"] == 1e-3


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_")} | {"OMP_NUM_THREADS": "1"}


def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (``run-*.wandb``): a 7-byte header, then LevelDB-style
    records (4-byte checksum, 2-byte length, 1-byte type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, parts = 7, 32768, []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        parts.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def test_wandb_runs_offline_even_when_told_online_and_its_log_holds_every_number(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "online")  # must not win: --track wandb never talks to a server
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    run_dir = tmp_path / "run"

    tracker = make_tracker("wandb", run_dir, "dis seed 0", CONFIG)
    assert tracker.run.settings.mode == "offline"
    log_all(tracker)
    tracker.close()  # a second close is harmless

    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    logged: dict[str, list[tuple[int, float]]] = {}
    names = set()
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "run":
            names.add(record.run.display_name)
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                tag = item.key or "/".join(item.nested_key)
                if not tag.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                    logged.setdefault(tag, []).append((record.history.step.num, json.loads(item.value_json)))
    expected = expected_series()
    expected.update({"eval/dis_seed_0/pass_at_1": [(3, 0.4375)], "eval/dis_seed_0/samples": [(3, 4.0)]})
    expected["eval/dis_seed_0/seconds"] = [(3, 2.5)]
    assert names == {"dis seed 0"}
    assert logged == expected
