"""Settings you can replay, and help text from the fields' own docs.

Checks that each Config field's doc lives in its metadata (and reaches --help without reading source),
that --config FILE (YAML or JSON, flat or a file sao wrote) sits between the preset and the flags, that a
run's own config.json replays it bit for bit, that values are type-checked, and that every bad file is a
one-line error with exit code 2. Deliberately left out: the sweep grid's meaning (the sweep checks it).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import sao.cli
from helpers import run_log
from sao.cli import build_parser, config_from_args, main
from sao.core.config import Config, read_config_file
from sao.core.errors import ConfigError
from sao.core.settings import convert, option
from sao.core.timeline import TIMING_FIELDS

TIMING_KEYS = {*TIMING_FIELDS, "waited_s", "rollouts_per_s"}
SMALL_RUN = [
    "--preset",
    "tiny",
    "--steps",
    "2",
    "--critic-warmup",
    "1",
    "--batch-size",
    "8",
    "--train-prompts",
    "32",
    "--test-prompts",
    "8",
    "--quiet",
]


def _args(*argv: str):
    return build_parser().parse_args(["train", "--out", "unused", *argv])


def _help_text(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines; compare word sequences


# --- help from metadata ---------------------------------------------------------------------------------


def test_every_field_has_its_doc_in_metadata():
    from sao.core.config import SECTIONS
    from sao.core.settings import flag_of

    for section in SECTIONS.values():
        for f in dataclasses.fields(section):
            assert f.metadata["help"].strip(), f.name
            assert Config.help(flag_of(f)) == " ".join(f.metadata["help"].split())
    assert Config.help("lr") == "AdamW on the LoRA adapter. The page's round 1 (round 2 is 1e-4)."
    with pytest.raises(ConfigError, match="unknown setting 'no_such'"):
        Config.help("no_such")


def test_train_help_shows_each_fields_doc_including_percent_signs(capsys):
    text = _help_text("train", capsys)
    assert f"--lr LR {Config.help('lr')}" in text
    assert Config.help("dead_band_share") in text  # holds "(0.1%)": escaped for argparse, shown as written
    assert "--config FILE" in text


def test_cli_reads_no_source_to_build_help():
    source = Path(sao.cli.__file__).read_text()
    assert "import ast" not in source and "getsource" not in source and "import inspect" not in source


@pytest.mark.slow  # a fresh interpreter importing torch with no -OO bytecode cached: ~10-20 s on 2 cores
def test_help_texts_survive_python_OO():
    # -OO strips docstrings; metadata is ordinary data and stays.
    code = "from sao.core.config import Config; print(Config.help('lr'))"
    result = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == Config.help("lr")


def test_option_gives_each_instance_its_own_mutable_default():
    field = option([1, 2], "a list")
    first, second = field.default_factory(), field.default_factory()
    assert first == [1, 2] and first is not second and field.metadata["help"] == "a list"


# --- precedence and formats ------------------------------------------------------------------------------


def test_preset_then_file_then_flags(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text("lr: 0.002\nsteps: 5\nband: [0.5, 3.0]\n")
    config = config_from_args(_args("--preset", "tiny", "--config", str(path), "--steps", "7"))
    assert config.training.lr == 0.002  # the file beats the preset's 1e-3
    assert config.training.steps == 7  # the flag beats the file's 5
    assert config.algorithm.ratio == (0.5, 3.0)
    assert config.model.name == "tiny" and config.training.critic_lr == 1e-3  # preset values the file does not name
    assert config.training.batch_size == Config().training.batch_size  # neither preset nor file: protocol default


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_yaml_and_json_read_the_same_settings(tmp_path, suffix):
    values = {"lr": 0.0005, "data": None, "grad_checkpoint": True, "band": [0.6, 5.0], "arm": "tis", "lag": 2}
    path = tmp_path / f"settings{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(values))
    else:
        path.write_text("lr: 5.0e-4\ndata: null\ngrad_checkpoint: true\nband: [0.6, 5]\narm: tis\nlag: 2\n")
    read, grid = read_config_file(path)
    assert grid is None
    assert read == {**values, "band": (0.6, 5.0)}
    assert isinstance(read["band"][1], float)


def test_yaml_reads_exponent_numbers_without_a_dot_as_floats(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text("lr: 1e-5\ncritic_lr: 3E-4\n")
    assert read_config_file(path)[0] == {"lr": 1e-5, "critic_lr": 3e-4}


def test_a_file_sao_wrote_is_read_as_it_is_with_its_grid(tmp_path):
    settings = Config.load("tiny").to_dict()
    settings["training"]["lr"] = 0.003
    record = {
        "config": settings,
        "grid": {"lags": [1, 4], "lrs": [0.001], "bands": [[0.7, 6.0]], "arms": ["dis", "none"]},
        "data": {"train": 480},
        "source": "tiny",
    }
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(record))
    values, grid = read_config_file(path)
    assert grid == record["grid"]
    assert Config.load("protocol", **values) == Config.load("tiny", lr=0.003)


# --- replaying a real run --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_runs_config_json_replays_it_bit_for_bit(tiny_model_dir, tmp_path):
    import torch

    torch.set_num_threads(1)  # the two runs must take the same floating-point path; one thread is also the fastest
    first, second = tmp_path / "run", tmp_path / "replay"
    assert main(["train", *SMALL_RUN, "--out", str(first)]) == 0
    assert main(["train", "--quiet", "--config", str(first / "config.json"), "--out", str(second)]) == 0

    assert json.loads((second / "config.json").read_text()) == json.loads((first / "config.json").read_text())
    original = run_log(first)
    replayed = run_log(second)
    assert len(original) == len(replayed) == 3
    for a, b in zip(original, replayed, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k not in TIMING_KEYS
        }

    # A flag on top of the file changes that setting and nothing else.
    base = config_from_args(_args("--config", str(first / "config.json"))).flat()
    changed = config_from_args(_args("--config", str(first / "config.json"), "--lr", "0.002")).flat()
    assert {k for k in base if base[k] != changed[k]} == {"lr"} and changed["lr"] == 0.002


# --- types -----------------------------------------------------------------------------------------------


def test_values_are_type_checked_and_ints_widen_to_floats():
    assert Config(lr=1).training.lr == 1.0 and isinstance(Config(lr=1).training.lr, float)
    assert Config(band=[0.5, 3]).algorithm.ratio == (0.5, 3.0)
    assert Config(rollout="ray", ray_address=None).source.ray_address is None
    assert Config(data="tiny").data.dataset == "tiny"
    from sao.core.config import TrainingSettings

    assert convert(TrainingSettings, "steps", 3) == 3
    bad = [
        ("lr", "fast", "'lr' must be a number"),
        ("steps", 2.5, "'steps' must be an integer"),
        ("steps", True, "'steps' must be an integer"),
        ("band", [1.0], "'band' must be a pair of numbers"),
        ("band", "0.7,6.0", "'band' must be a pair of numbers"),
        ("grad_checkpoint", 1, "'grad_checkpoint' must be true or false"),
        ("data", 3, "'data' must be a string or null"),
        ("arm", ["dis"], "'arm' must be a string"),
    ]
    for name, value, message in bad:
        with pytest.raises(ConfigError, match=message):
            Config(**{name: value})


# --- one-line errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "needles"),
    [
        ("unknown.yaml", "lrr: 0.1\n", ["unknown setting 'lrr'", "did you mean 'lr'"]),
        ("unknown.json", '{"config": {"lr": 0.1, "warp": 9}}', ["unknown setting 'warp'"]),
        ("list.yaml", "- lr\n- 0.1\n", ["expected a mapping", "a list"]),
        ("empty.yaml", "", ["expected a mapping", "nothing"]),
        ("nested.json", '{"config": [1, 2]}', ["'config' must be a mapping"]),
        ("bad.yaml", "lr: [0.1\n", ["not valid YAML", "line"]),
        ("bad.json", '{"lr": 0.1,}', ["not valid JSON", "line 1"]),
        ("type.json", '{"lr": "fast"}', ["'lr' must be a number", "'fast'"]),
        ("band.yaml", "band: [0.7]\n", ["'band' must be a pair of numbers"]),
        ("settings.toml", "lr = 0.1\n", ["expected a .yaml, .yml or .json file"]),
    ],
)
def test_bad_files_are_one_line_errors_naming_the_file(tmp_path, capsys, name, text, needles):
    path = tmp_path / name
    path.write_text(text)
    out = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--config", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(path) in err
    for needle in needles:
        assert needle in err
    assert not out.exists()


def test_a_missing_file_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "nowhere.yaml"
    code = main(["eval", "--preset", "tiny", "--config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--config {path}: no such file" in err


@pytest.mark.parametrize("command", ["train", "eval", "recipe", "sweep"])
def test_every_command_with_settings_takes_a_config_file(command, tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"seed": 5, "base_evals": 1}))
    argv = [command, "--config", str(path)] + ([] if command == "eval" else ["--out", str(tmp_path / "x")])
    config = config_from_args(build_parser().parse_args(argv))
    assert config.training.seed == 5 and config.eval.base_evals == 1


def test_critic_warmup_takes_a_count_or_auto_from_flags_and_files(tmp_path):
    args = build_parser().parse_args(["train", "--out", "x", "--critic-warmup", "auto", "--baseline", "batch-mean"])
    config = config_from_args(args)
    assert config.algorithm.critic_warmup == "auto" and config.algorithm.baseline == "batch-mean"
    assert (
        config_from_args(
            build_parser().parse_args(["train", "--out", "x", "--critic-warmup", "3"])
        ).algorithm.critic_warmup
        == 3
    )
    (tmp_path / "auto.yaml").write_text("critic_warmup: auto\ncritic_warmup_limit: 20\n")
    assert Config(**read_config_file(tmp_path / "auto.yaml")[0]).algorithm.critic_warmup == "auto"
    bad = [
        ("soon", 'critic-warmup must be a whole number >= 0 or "auto"'),
        (-1, "critic-warmup must be >= 0"),
        (2.5, "critic_warmup"),
    ]
    for value, message in bad:
        with pytest.raises(ConfigError, match=message):
            Config(critic_warmup=value)
    with pytest.raises(ConfigError, match="baseline"):
        Config(baseline="group")
    with pytest.raises(ConfigError, match="critic-warmup-limit must be >= 2"):
        Config(critic_warmup_limit=1)


# --- a config.json written before the settings had sections ------------------------------------------------------

# tests/fixtures/config-before-sections.json is the config.json that `sao train --preset tiny --steps 2
# --critic-warmup 1 --batch-size 8 --train-prompts 32 --test-prompts 8` wrote before settings had sections: one flat
# object, the correction rule called "arm", the band "band" and the rollout source "engine".
BEFORE_SECTIONS = Path(__file__).resolve().parents[1] / "fixtures" / "config-before-sections.json"
# tests/fixtures/config-rollout-one-section.json is the config.json the same command wrote while every source's settings
# still lived in one rollout section (29 fields) and the eval section's fields had no eval_ prefix.
ONE_ROLLOUT_SECTION = BEFORE_SECTIONS.with_name("config-rollout-one-section.json")
RENAMED = {"arm": "correction", "band": "ratio", "engine": "rollout"}


def _owner(name: str) -> str:
    from sao.core.config import source_fields, sources

    return next(k for k in sources() if name in source_fields(sources().get(k)))


@pytest.mark.parametrize("fixture", [BEFORE_SECTIONS, ONE_ROLLOUT_SECTION], ids=["flat", "one-rollout-section"])
def test_an_old_config_json_keeps_every_value_under_its_new_name(capsys, fixture):
    """Every value keeps its meaning; the settings of sources the run did not use (older versions wrote every
    source's in one section) are dropped: they had no part in the run, and are each at its default there."""
    from sao.core.config import flat_view, source_fields, sources

    old = flat_view(json.loads(fixture.read_text())["config"])
    config = config_from_args(_args("--config", str(fixture)))
    replayed = config.flat()
    others = {n for k in sources() if k != config.rollout.source for n in source_fields(sources().get(k))}
    for name, value in old.items():
        if RENAMED.get(name, name) not in replayed:
            assert name in others and value == getattr(sources().get(_owner(name))(), name), name
            continue
        got = replayed[RENAMED.get(name, name)]
        assert (list(got) if isinstance(got, tuple) else got) == value, name
    if fixture != BEFORE_SECTIONS:
        return
    # the settings added since take the defaults of a file that names no preset, i.e. what the old code did
    # (one learning rate for the whole critic, no schedule, no KL or entropy term, the critic as the baseline)
    assert replayed["critic_bias_lr"] is None and replayed["lr_schedule"] == "constant"
    assert replayed["kl_coef"] == replayed["entropy_coef"] == replayed["weight_decay"] == 0
    assert replayed["baseline"] == "critic"


@pytest.mark.slow
@pytest.mark.parametrize("fixture", [BEFORE_SECTIONS, ONE_ROLLOUT_SECTION], ids=["flat", "one-rollout-section"])
def test_an_old_config_json_replays_and_its_rewrite_replays_bit_for_bit(tiny_model_dir, tmp_path, fixture):
    """The old file runs as it is and is written back in today's sections; that file replays the run bit for bit.
    The one-section file's own run is committed beside it and is reproduced to float32 rounding (the committed log
    may come from another CPU: rounding that differs by an ulp in a log-prob moves a ratio's maximum by ~1e-5 of
    itself after three steps, and the lag-0 log ratios, which are rounding alone, by ~1e-6). The flat file's own
    log is not: the tiny model's weights and its held-out split changed since it was written."""
    import torch

    torch.set_num_threads(1)
    first, second = tmp_path / "old", tmp_path / "replay"
    assert main(["train", "--quiet", "--config", str(fixture), "--out", str(first)]) == 0
    written = json.loads((first / "config.json").read_text())["config"]
    assert {"model", "data", "algorithm", "rollout", "training"} <= set(written)
    assert written["algorithm"]["correction"] == "dis" and written["algorithm"]["ratio"] == [0.7, 6.0]
    assert written["rollout"]["local"] == {"lag": 4, "sampler_dtype": "auto", "sampler_logit_noise": 0.0}
    assert "max_staleness" not in written["rollout"]  # another source's setting: not part of this run
    assert main(["train", "--quiet", "--config", str(first / "config.json"), "--out", str(second)]) == 0
    original, replayed = run_log(first), run_log(second)
    assert len(original) == len(replayed) == 3
    for a, b in zip(original, replayed, strict=True):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == {
            k: v for k, v in b.items() if k not in TIMING_KEYS
        }
    committed = fixture.with_name(fixture.stem + ".train_log.jsonl")
    if committed.exists():
        before = [json.loads(line) for line in committed.read_text().splitlines()]
        assert len(before) == len(original)
        for a, b in zip(before, original, strict=True):
            for key, value in a.items():
                if key in TIMING_KEYS:
                    continue
                if isinstance(value, float) and value == value:
                    assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
                elif value == value:
                    assert b[key] == value, key
