"""Issue 16, as a careless or hostile user would meet it: damaged run folders, odd flags, a malformed results.json,
output paths that cannot be outputs, a shared busy machine and big inputs.

Every refusal is one line on stderr naming the file (or flag) and what to do, exit code 2, no traceback, and
no file in the folder changed; the one repair, a damaged ``train_log.json``, is rebuilt exactly from the
checkpoint's copy of the same records, so ``--resume`` never reports a log as written that it did not write.
A finished run and a finished recipe are built once per module and copied into each test's folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from helpers import SMALL_RUN as SMALL
from helpers import files_in as _files
from helpers import refused_in_one_line, without_keys
from sao.cli import main
from sao.core.errors import DataError
from sao.core.timeline import TIMING_FIELDS

EXPERIMENT = [*SMALL, "--eval-samples", "1", "--base-evals", "2"]
VOLATILE = {*TIMING_FIELDS, "seconds", "this_invocation", "wall_time", "versions", "provenance", "command"}


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The CLI sets torch's thread count for its process; give the rest of the session back what it had."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("train") / "run"
    assert main(["train", *SMALL, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def finished_recipe(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("recipe") / "exp"
    assert main(["recipe", *EXPERIMENT, "--out", str(out)]) == 0
    return out


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _refused(capsys, argv: list[str], folder: Path, *needles: str) -> str:
    return refused_in_one_line(capsys, argv, folder, *needles)


def _truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _strip(obj):
    return without_keys(obj, VOLATILE)


# --- damaged run folders: `sao train --resume` -------------------------------------------------------------

LOG_DAMAGE = {
    "truncated": lambda log: _truncate(log),
    "missing": lambda log: log.unlink(),
    "behind its checkpoint": lambda log: log.write_text("".join(log.read_text().splitlines(keepends=True)[:-1])),
}


@pytest.mark.parametrize("damage", sorted(LOG_DAMAGE))
def test_resume_of_a_finished_run_rebuilds_a_damaged_log_from_its_checkpoint(
    finished_run, tmp_path, capsys, damage, faults
):
    out = _copy(finished_run, tmp_path)
    log, checkpoints = out / "train_log.jsonl", out / "checkpoints"
    want, state = log.read_bytes(), _files(checkpoints)
    LOG_DAMAGE[damage](log)
    assert main(["train", *SMALL, "--resume", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert log.read_bytes() == want, "the log is the one the run wrote, record for record"
    assert _files(checkpoints) == state
    assert "rewrote it from the checkpoint's records" in captured.out + captured.err
    assert f"wrote {log}" in captured.out
    faults.record("damaged run folders", f"train_log.jsonl {damage} in a finished run (rebuilt from the checkpoint)")


def _checkpoint(out: Path) -> Path:
    (folder,) = (out / "checkpoints").iterdir()
    return folder


TRAIN_DAMAGE = {  # what is done to the finished run → what the one line must name
    "truncated checkpoint tensors": (
        lambda out: _truncate(_checkpoint(out) / "tensors.safetensors", 1000),
        ("is damaged", "remove"),
    ),
    "a checkpoint that is not sao's": (
        lambda out: (_checkpoint(out) / "state.json").write_text('{"step": 3}'),
        ("is not a sao checkpoint", "remove"),
    ),
    "checkpoints missing beside the log": (
        lambda out: shutil.rmtree(out / "checkpoints"),
        ("holds no checkpoint", "remove"),
    ),
    "truncated config.json": (lambda out: _truncate(out / "config.json"), ("config.json is damaged", "restore")),
    "config.json holding a list": (
        lambda out: (out / "config.json").write_text("[]"),
        ("config.json is damaged", "restore"),
    ),
    "config.json missing beside the run": (
        lambda out: (out / "config.json").unlink(),
        ("config.json is missing", "restore"),
    ),
}


@pytest.mark.parametrize("case", sorted(TRAIN_DAMAGE))
def test_resume_of_a_damaged_train_folder_is_one_line_and_overwrites_nothing(
    finished_run, tmp_path, capsys, case, faults
):
    damage, needles = TRAIN_DAMAGE[case]
    out = _copy(finished_run, tmp_path)
    damage(out)
    line = _refused(capsys, ["train", *SMALL, "--resume", "--out", str(out)], out, str(out), *needles)
    assert "rerun with --resume" not in line  # nothing that --resume could continue
    faults.record("damaged run folders", f"{case} (sao train --resume)")


@pytest.mark.parametrize("command", ["train", "recipe"])
@pytest.mark.parametrize("state", ["missing", "empty"])
def test_resume_of_a_missing_or_empty_folder_is_refused(tmp_path, capsys, command, state, faults):
    out = tmp_path / "typo"
    if state == "empty":
        out.mkdir()
    words = "does not exist" if state == "missing" else "is empty"
    _refused(
        capsys,
        [command, *EXPERIMENT, "--resume", "--out", str(out)],
        out,
        f"--resume: {out} {words}",
        "leave out --resume",
    )
    faults.record(
        "damaged run folders", f"sao {command} --resume of {'a missing' if state == 'missing' else 'an empty'} folder"
    )


# --- damaged recipe folders ----------------------------------------------------------------------------------


def _one(folder: Path, pattern: str) -> Path:
    (found,) = folder.glob(pattern)
    return found


def test_recipe_resume_rebuilds_a_runs_damaged_log_from_its_checkpoint(finished_recipe, tmp_path, capsys, faults):
    out = _copy(finished_recipe, tmp_path)
    log = _one(out, "cells/*/runs/dis-s17/train_log.jsonl")
    want = log.read_bytes()
    _truncate(log)
    assert main(["recipe", *EXPERIMENT, "--resume", "--out", str(out)]) == 0
    capsys.readouterr()
    assert log.read_bytes() == want
    for name in ("results.json", "train_log.json"):
        got, was = json.loads((out / name).read_text()), json.loads((finished_recipe / name).read_text())
        assert _strip(got) == _strip(was), name
    faults.record("damaged run folders", "a run's train_log.jsonl truncated in a recipe folder (rebuilt)")


RECIPE_DAMAGE = {  # file (a glob under the folder) → what is done to it, what the one line must say
    "truncated experiment.json": ("experiment.json", _truncate, "restore"),
    "truncated checkpoint of a finished run": (
        "cells/*/runs/none-s17/checkpoints/step-*/tensors.safetensors",
        lambda p: _truncate(p, 1000),
        "delete",
    ),
    "truncated eval of a trained run": ("cells/*/evals/dis-s17.json", _truncate, "delete it and rerun with --resume"),
    "eval of a trained run with other fields": (
        "cells/*/evals/none-s17.json",
        lambda p: p.write_text('{"label": 1}'),
        "delete it",
    ),
    "truncated base eval": ("evals/base-1.json", _truncate, "delete it and rerun with --resume"),
    "run log and checkpoint both damaged": (
        "cells/*/runs/dis-s17/train_log.jsonl",
        lambda p: (_truncate(p), _truncate(_checkpoint(p.parent) / "tensors.safetensors", 500)),
        "delete",
    ),
}


@pytest.mark.parametrize("case", sorted(RECIPE_DAMAGE))
def test_resume_of_a_damaged_recipe_folder_is_one_line_and_overwrites_nothing(
    finished_recipe, tmp_path, capsys, case, faults
):
    pattern, damage, fix = RECIPE_DAMAGE[case]
    out = _copy(finished_recipe, tmp_path)
    target = _one(out, pattern)
    damage(target)
    named = _checkpoint(target.parent) if case.startswith("run log and") else target
    named = named.parent if named.name == "tensors.safetensors" else named  # a checkpoint is named by its folder
    _refused(capsys, ["recipe", *EXPERIMENT, "--resume", "--out", str(out)], out, str(named), fix)
    faults.record("damaged run folders", f"{case} (sao recipe --resume)")


# --- a malformed results.json: `sao report` -------------------------------------------------------------------

CURVES = {  # what replaces a curves entry of the first cell's dis arm
    "curves that are a list": lambda arm: arm.__setitem__("curves", [1, 2]),
    "curves that are a string": lambda arm: arm.__setitem__("curves", "reward"),
    "a series that is a list": lambda arm: arm["curves"].__setitem__("reward_mean", [0.1, 0.2]),
    "a series that is a number": lambda arm: arm["curves"].__setitem__("masked_share", 0.5),
    "a run's series that is a string": lambda arm: next(iter(arm["runs"].values()))["curves"].__setitem__(
        "ratio_max", "big"
    ),
}


@pytest.mark.parametrize("case", sorted(CURVES))
def test_report_on_curves_of_the_wrong_shape_is_one_line(finished_recipe, tmp_path, capsys, case, faults):
    out = _copy(finished_recipe, tmp_path)
    results = json.loads((out / "results.json").read_text())
    CURVES[case](results["cells"][0]["arms"]["dis"])
    (out / "results.json").write_text(json.dumps(results))
    _refused(capsys, ["report", str(out)], out, str(out / "results.json"), "curves", "not a sao file")
    faults.record("malformed results.json", case)


# --- odd flags ----------------------------------------------------------------------------------------------

ODD_FLAGS = {
    f"--device cuda:{torch.cuda.device_count()}": (["--device", f"cuda:{torch.cuda.device_count()}"], "--device"),
    "--device tpu": (["--device", "tpu"], "--device must be"),
    "a 20-digit --seed": (["--seed", "99999999999999999999"], "--seed must be a whole number from 0 to 2**63 - 1"),
    "--seed -1": (["--seed", "-1"], "--seed must be"),
    "--data-seed 2**64": (["--data-seed", str(2**64)], "--data-seed must be"),
    "--lora-alpha 0": (["--lora-alpha", "0"], "--lora-alpha must be >= 1"),
    "--lora-alpha -32": (["--lora-alpha", "-32"], "--lora-alpha must be >= 1"),
    "a 21-digit --lora-rank": (["--lora-rank", str(10**20)], "--lora-rank must be 1 to 1024"),
    "--dead-band-share nan": (["--dead-band-share", "nan"], "--dead-band-share must be a share in [0, 1)"),
    "--dead-band-share -1": (["--dead-band-share", "-1"], "--dead-band-share must be a share in [0, 1)"),
    "--lr 1e308": (["--lr", "1e308"], "--lr must be at most 1"),
    "--critic-lr 5": (["--critic-lr", "5"], "--critic-lr must be at most 1"),
    "--threads -1": (["--threads", "-1"], "--threads must be 0 to 1024 (0 = automatic)"),
    "--device cuda without a GPU": (["--device", "cuda"], "sees no CUDA GPU"),  # a GPU hidden on a GPU machine
}


@pytest.mark.parametrize("case", sorted(ODD_FLAGS))
def test_odd_flags_are_one_line_errors_and_write_nothing(tmp_path, capsys, monkeypatch, case, faults):
    flags, needle = ODD_FLAGS[case]
    if case == "--device cuda without a GPU":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    _refused(capsys, ["train", *SMALL, *flags, "--out", str(out)], out, needle)
    faults.record("odd flags", case)


def test_an_odd_device_is_refused_by_eval_too(tmp_path, capsys):
    _refused(capsys, ["eval", "--preset", "tiny", "--device", "cuda:99", "--quiet"], tmp_path, "--device cuda:99")


# --- output paths that cannot be outputs ----------------------------------------------------------------------


def _no_resume_advice(line: str) -> None:
    assert "--resume" not in line and "free space" not in line, line


def test_an_out_that_is_a_file_or_a_device_is_refused_before_anything_runs(tmp_path, capsys, faults):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("precious")
    for command in ("train", "recipe"):
        line = _refused(capsys, [command, *EXPERIMENT, "--out", str(blocker)], tmp_path, str(blocker), "not a folder")
        _no_resume_advice(line)
    line = _refused(capsys, ["train", *SMALL, "--out", str(blocker / "run")], tmp_path, f"{blocker} is a file")
    _no_resume_advice(line)
    assert blocker.read_text() == "precious"
    faults.record("wrong output paths", "--out that is a file (train, recipe) or under a file")
    line = _refused(capsys, ["train", *SMALL, "--out", "/dev/null"], tmp_path, "/dev/null", "a device, not a folder")
    _no_resume_advice(line)
    faults.record("wrong output paths", "--out /dev/null")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a /proc file system")
def test_an_out_under_proc_says_to_choose_another_path(tmp_path, capsys, faults, tiny_model_dir):
    out = Path("/proc") / f"sao-hardening-{os.getpid()}" / "run"
    line = _refused(
        capsys, ["train", *SMALL, "--out", str(out)], out, "/proc cannot hold sao's files", "choose an output path"
    )
    _no_resume_advice(line)
    faults.record("wrong output paths", "--out under /proc")


def test_eval_out_on_a_folder_or_a_pipe_is_refused_before_the_eval(tmp_path, capsys, faults):
    folder = tmp_path / "evals"
    folder.mkdir()
    line = _refused(
        capsys,
        ["eval", "--preset", "tiny", "--quiet", "--out", str(folder)],
        tmp_path,
        str(folder),
        "it is a folder, not a file",
    )
    _no_resume_advice(line)
    faults.record("wrong output paths", "sao eval --out on a folder")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    line = _refused(
        capsys, ["eval", "--preset", "tiny", "--quiet", "--out", str(pipe)], tmp_path, str(pipe), "not a file"
    )
    _no_resume_advice(line)
    faults.record("wrong output paths", "sao eval --out on a pipe")


def test_eval_on_a_full_disk_says_to_run_again_not_to_resume(tmp_path, capsys, monkeypatch, faults, tiny_model_dir):
    import errno

    from sao.core import io

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io.os, "fsync", full)
    out = tmp_path / "eval.json"
    argv = ["eval", "--preset", "tiny", "--test-prompts", "8", "--eval-samples", "1", "--quiet", "--out", str(out)]
    line = _refused(capsys, argv, tmp_path, str(out), "free space, then run the same command again")
    assert "--resume" not in line
    assert list(tmp_path.iterdir()) == [], "no temporary file left"
    faults.record("wrong output paths", "sao eval on a full disk (no --resume to offer)")


# --- shared machines ----------------------------------------------------------------------------------------


def _threads_after_start(flags: list[str]) -> int:
    from sao.cli import build_parser, config_from_args

    config_from_args(build_parser().parse_args(["train", "--out", "x", *flags]))
    return torch.get_num_threads()


def test_the_tiny_preset_runs_on_one_thread_unless_told_otherwise(monkeypatch, faults):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    assert _threads_after_start(["--preset", "tiny"]) == 1
    assert _threads_after_start(["--preset", "tiny", "--threads", "2"]) == 2
    faults.record("shared machines", "the tiny preset with no --threads: one torch thread")
    # OMP_NUM_THREADS is read when torch starts: a fresh process, where torch's default (it follows the variable,
    # up to the cores there are) is left as it is instead of the automatic one thread
    probe = (
        "import torch; from sao.cli import build_parser as b, config_from_args as c; before = torch.get_num_threads(); "
        "c(b().parse_args(['train', '--out', 'x', '--preset', 'tiny'])); print(before, torch.get_num_threads())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = proc.stdout.split()
    assert after == before == str(min(2, os.cpu_count() or 1)), proc.stdout
    faults.record("shared machines", "OMP_NUM_THREADS or --threads set: that count")


def test_automatic_threads_leave_other_models_to_torch():
    from sao.core.config import Config
    from sao.core.machine import torch_threads

    assert torch_threads(Config.load("tiny"), environ={}) == 1
    assert torch_threads(Config.load("tiny"), environ={"OMP_NUM_THREADS": "4"}) is None
    assert torch_threads(Config.load("tiny", threads=3), environ={"OMP_NUM_THREADS": "4"}) == 3
    assert torch_threads(Config(), environ={}) is None  # the protocol's 1.5B model: torch's default


def test_starting_the_cli_imports_neither_torch_nor_scipy(faults):
    probe = "import sys, sao.cli; print(sorted(m for m in ('torch', 'scipy', 'transformers') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    faults.record("shared machines", "start-up: sao.cli imported without torch or scipy")


def test_a_step_fsyncs_the_checkpoint_but_not_the_log_it_can_be_rebuilt_from(tmp_path, monkeypatch):
    from sao.core import io
    from sao.training import checkpoint

    synced = []
    real = os.fsync
    monkeypatch.setattr(io.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    records = [{"step": 0, "reward_mean": 0.5, "explained_variance": math.nan}]
    checkpoint.save(tmp_path, {"next_step": 1, "records": records}, records)
    assert len(synced) == 3, "the checkpoint's tensors, its state and its folder"
    checkpoint.append_log(tmp_path, records[0])
    assert len(synced) == 3, "the log is appended without an fsync"
    assert json.loads((tmp_path / "train_log.jsonl").read_text()) == {**records[0], "explained_variance": None}


# --- big inputs ----------------------------------------------------------------------------------------------

GOOD = '{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\\n#### 7"}\n'


def _gsm8k_dir(tmp_path: Path, test: str) -> Path:
    """A data folder with ``test`` as test.jsonl; the test writes train.jsonl."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "test.jsonl").write_text(test)
    return folder


def test_a_50_mb_single_line_is_refused_after_reading_1_mib(tmp_path, capsys, faults):
    from sao.tasks.gsm8k import MAX_LINE_BYTES, load_gsm8k

    folder = _gsm8k_dir(tmp_path, GOOD * 20)
    with (folder / "train.jsonl").open("w") as handle:  # one record, valid JSON, on one 50 MB line
        handle.write('{"question": "')
        for _ in range(50):
            handle.write("apples " * 150_000)
        handle.write('", "answer": "#### 1"}\n')
    assert (folder / "train.jsonl").stat().st_size > 50 * 10**6
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"train\.jsonl line 1: longer than 1 MiB"):
            load_gsm8k(folder, n_train=4, n_test=4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_LINE_BYTES, f"read {peak} bytes into memory for a line it refuses"
    out = tmp_path / "run"
    _refused(capsys, ["train", *SMALL, "--data", str(folder), "--out", str(out)], out, "line 1: longer than 1 MiB")
    faults.record("big inputs", "a 50 MB single-line train.jsonl")


def test_many_short_lines_keep_memory_to_the_tasks_drawn(tmp_path, faults):
    from sao.tasks.gsm8k import load_gsm8k

    rows = 20_000
    folder = _gsm8k_dir(tmp_path, GOOD * 50)
    with (folder / "train.jsonl").open("w") as handle:
        for i in range(rows):
            handle.write(json.dumps({"question": f"What is {i} plus one?", "answer": f"#### {i + 1}"}) + "\n")
    size = (folder / "train.jsonl").stat().st_size
    tracemalloc.start()
    try:
        split = load_gsm8k(folder, n_train=64, n_test=8, seed=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert split.counts["train_pool"] == rows and len(split.train) == 64
    assert all(t.question == f"What is {int(t.answer) - 1} plus one?" for t in split.train)  # read back by offset
    # two 8-byte offsets a row at most, plus the tasks drawn: a small share of the file, not a copy of it
    assert peak < 16 * rows + 200_000 < size / 2, (peak, size)
    faults.record("big inputs", "20,000 short records")
