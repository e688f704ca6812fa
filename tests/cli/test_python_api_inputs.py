"""The Python API's inputs, as a hostile or hurried user gives them: a preset's name for a config, None or a number,
an unhashable preset, one setting given twice, a run's own config.json as a mapping, a misspelled section, rows with
a NaN answer or a field named by a number, prompts longer than the model's context. Each is accepted as meant or is
a ConfigError, TypeError or DataError naming the argument, the setting or the row, with out_dir as it was found."""

from __future__ import annotations

import json
import math

import pytest

from helpers import files_in, refused_in_one_line
from sao import api
from sao.core.config import Config
from sao.core.errors import ConfigError, DataError


def test_a_presets_name_or_a_settings_file_is_a_config(tmp_path, faults):
    assert api.as_config("tiny") == Config.load("tiny")
    settings = tmp_path / "settings.yaml"
    settings.write_text("preset: tiny\ntraining:\n  lr: 0.002\n")
    assert api.as_config(settings) == api.as_config(str(settings)) == Config.load("tiny", lr=2e-3)
    with pytest.raises(ConfigError, match=r"config 'tiyn' is neither a preset \(.*tiny.*\) nor a settings file"):
        api.as_config("tiyn")
    faults.record("Python API inputs", "sao.train('tiny', ...)")


@pytest.mark.parametrize("config", [None, 5, 2.5, ["tiny"]], ids=["None", "5", "2.5", "a list"])
def test_a_config_of_another_type_is_a_type_error_naming_the_argument(tmp_path, config, faults):
    out = tmp_path / "run"
    with pytest.raises(TypeError, match=r"^config must be a sao\.Config, a mapping of settings, a preset's name or a "):
        api.train(config, out)
    assert not out.exists()
    faults.record("Python API inputs", f"config={config!r}")


@pytest.mark.parametrize(
    ("mapping", "needle"),
    [
        ({"preset": ["tiny"]}, "'preset' must be a preset's name, got a list"),
        ({"training": {"lr": 1e-3}, "lr": 2e-3}, "lr and training.lr set the same setting; give one"),
        ({"trainng": {"lr": 1e-3}}, "unknown section 'trainng' (did you mean the section 'training'?)"),
        ({1: 2}, "a setting's name must be a string, got a number"),
    ],
    ids=["unhashable preset", "lr twice", "trainng", "1"],
)
def test_odd_mappings_are_config_errors_naming_the_setting(tmp_path, mapping, needle, faults):
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        api.train(mapping, out)
    assert needle in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()
    faults.record("Python API inputs", f"a config mapping with {needle.split(' (')[0]}")


@pytest.mark.parametrize(
    ("mapping", "needle"),
    [
        ({"preset": {"name": "tiny"}}, "'preset' must be a preset's name"),
        ({"lr": [1e-3]}, "setting 'lr' must be a number, got [0.001]"),
        ({"algorithm": {"ratio": [0.5, 4.0]}, "band": [0.6, 5.0]}, "'band' and 'ratio' set the same setting"),
        ({"band": [0.6, 5.0], "ratio": [0.5, 4.0]}, "'ratio' and 'band' set the same setting"),
    ],
    ids=["a mapping as preset", "a list as lr", "band and ratio", "ratio after band"],
)
def test_mappings_refused_before_stay_refused(tmp_path, mapping, needle):
    with pytest.raises(ConfigError) as error:
        api.train(mapping, tmp_path / "run")
    assert needle in str(error.value) and not (tmp_path / "run").exists()


def test_a_setting_given_twice_in_a_config_file_is_refused(tmp_path, capsys, faults):
    settings = tmp_path / "settings.yaml"
    settings.write_text("preset: tiny\ntraining:\n  lr: 0.001\nlr: 0.002\n")
    out = tmp_path / "run"
    refused_in_one_line(
        capsys,
        ["train", "--config", str(settings), "--out", str(out)],
        out,
        f"--config {settings}",
        "lr and training.lr set the same setting",
    )
    faults.record("Python API inputs", "a setting given twice in a --config file")


def test_a_runs_own_config_json_is_a_config_mapping(tmp_path, faults):
    from sao.tasks import setup
    from sao.training import checkpoint

    config = Config.load("tiny", lr=2e-3, batch_size=8, train_prompts=16, test_prompts=4)
    checkpoint.write_config(tmp_path, checkpoint.run_record(config, setup.task_set(config)))
    record = json.loads((tmp_path / "config.json").read_text())
    assert api.as_config(record) == config
    faults.record("Python API inputs", "a run's own config.json as a config mapping")


ROWS = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(6)]


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": "What is 9+1?", "answer": math.nan}, "row train 3: field 'answer' (the gold answer) is nan"),
        ({"prompt": "What is 9+1?", "answer": "10", 7: "seven"}, "row train 3: a field is named 7 (int)"),
    ],
    ids=["a NaN answer", "a field named by a number"],
)
def test_rows_that_cannot_be_tasks_are_refused_naming_the_row(tmp_path, row, needle, faults):
    rows = [*ROWS[:3], row, *ROWS[3:]]
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(DataError) as error:
        api.train({"preset": "tiny", "batch_size": 2, "steps": 1}, out, dataset=rows)
    assert needle in str(error.value) and "\n" not in str(error.value)
    assert files_in(out) == {} and out.is_dir()  # the folder as it was found
    case = "a NaN answer" if "nan" in needle else "a field named by a number"
    faults.record("Python API inputs", f"rows with {case}")


def test_a_pandas_missing_answer_is_refused_too():
    pandas = pytest.importorskip("pandas")
    from sao.tasks import custom

    frame = pandas.DataFrame({"prompt": ["What is 1+1?", "What is 2+1?"], "answer": [2, None]})  # None: NaN
    with pytest.raises(DataError, match="row train 1: field 'answer' \\(the gold answer\\) is nan"):
        custom.from_rows(frame.to_dict("records"), n_train=2, n_test=0, seed=0)


def test_prompts_longer_than_the_models_context_are_refused_naming_the_task(tmp_path, faults, tiny_model_dir):
    long = {"prompt": "What is " + "1+" * 200 + "1?", "answer": "201"}  # past the tiny model's 256 positions
    rows = {"train": [*ROWS, long], "test": ROWS[:2]}
    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"task rows/train/6: its prompt is \d+ tokens and the model attends over 256"):
        api.train({"preset": "tiny", "batch_size": 2, "steps": 1, "critic_warmup": 0}, out, dataset=rows)
    assert not out.exists()
    with pytest.raises(DataError, match="task rows/test/"):
        api.evaluate({"preset": "tiny", "eval_samples": 1}, dataset={"train": ROWS, "test": [long]})
    faults.record("Python API inputs", "prompts longer than the model's context (train and evaluate)")
