"""``--shard fsdp`` on two processes (``torchrun --nproc-per-node 2``, gloo on the CPU) takes the single-process steps:
the same rewards (each process draws its rows of the batch), losses, gradient norms and critic losses within 1e-5,
with LoRA and the value head, and with every weight and a value model of its own. A sharded run killed mid-way
resumes on two processes to the uninterrupted run bit for bit, and on one process to it within 1e-5; `sao export`
turns it into a plain Hugging Face folder. A trace log trains under torchrun and its end stops every process."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from helpers import TORCHRUN_FLAGS, TORCHRUN_SETTINGS, ranks_said, run_log, torchrun

SETTINGS, FLAGS = TORCHRUN_SETTINGS, [*TORCHRUN_FLAGS, "--shard", "fsdp"]
COMPARED = ("loss", "grad_norm", "critic_loss", "masked_share", "ratio_max", "advantage_mean", "explained_variance")


def _single(config, out: Path, resume: bool = False) -> list[dict]:
    from sao.training import build

    torch.set_num_threads(1)
    build.trainer(config, out, progress=False, resume=resume).run()
    return run_log(out)


def _close(a: float | None, b: float | None, tol: float = 1e-5) -> bool:
    """Equal within ``tol``, absolute or relative; None is how the log writes NaN (a critic-only step's loss)."""
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


def _same_steps(mine: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in mine] == [r["step"] for r in ref]
    for m, r in zip(mine, ref, strict=True):
        assert m["reward_mean"] == r["reward_mean"] and m["response_length"] == r["response_length"], m["step"]
        for key in COMPARED:
            assert _close(m[key], r[key]), (m["step"], key, m[key], r[key])
    assert any(r["phase"] == "policy" and r["grad_norm"] > 0 for r in mine), "policy steps took a gradient"


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in records]  # the timers: volatile


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _all_close(ours: dict, theirs: dict) -> bool:
    return ours.keys() == theirs.keys() and all(torch.allclose(ours[k], theirs[k], atol=1e-5, rtol=1e-5) for k in ours)


def test_fsdp_on_two_processes_takes_the_single_process_steps_and_resumes_on_one_and_on_two(tiny_model_dir, tmp_path):
    from sao import cli
    from sao.core.config import Config

    single = _single(Config.load("tiny", **SETTINGS), tmp_path / "single")  # --shard none, one process
    whole = tmp_path / "fsdp"
    done = torchrun(tmp_path, ["train", *FLAGS, "--out", str(whole)])
    assert done.returncode == 0, ranks_said(done)
    assert done.stderr.count("process group still joined: False") == 2, "each process ended its group"
    sharded = run_log(whole)
    _same_steps(sharded, single)
    assert all(r["world_size"] == 2 for r in sharded)
    files = sorted(p.name for p in (whole / "checkpoints" / "step-000003").rglob("*") if p.is_file())
    shards = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert files == [*shards, "state.json", "tensors.safetensors"], "each rank its shards, as safetensors; no pickle"
    adapter = _tensors(whole / "adapter" / "adapter_model.safetensors")
    assert _all_close(adapter, _tensors(tmp_path / "single" / "adapter" / "adapter_model.safetensors"))

    killed = tmp_path / "killed"
    stopped = torchrun(tmp_path, ["train", *FLAGS, "--out", str(killed)], kill_at=2)  # rank 1 dies entering step 2
    assert stopped.returncode != 0 and len(run_log(killed)) == 2, ranks_said(stopped)
    on_one = tmp_path / "on-one"
    shutil.copytree(killed, on_one)
    resumed = torchrun(tmp_path, ["train", *FLAGS, "--out", str(killed), "--resume"])
    assert resumed.returncode == 0, ranks_said(resumed)
    assert _strip(run_log(killed)) == _strip(sharded), "the same two processes: bit for bit"
    again = _tensors(killed / "adapter" / "adapter_model.safetensors")
    assert again.keys() == adapter.keys() and all(torch.equal(again[k], adapter[k]) for k in adapter)

    config = Config.load("tiny", **SETTINGS, shard="fsdp")
    _same_steps(_single(config, on_one, resume=True), sharded)  # one process reads the two ranks' shards
    assert [r["world_size"] for r in run_log(on_one)] == [2, 2, 1]
    assert _all_close(_tensors(on_one / "adapter" / "adapter_model.safetensors"), adapter)

    exported = tmp_path / "exported"
    assert cli.main(["export", str(whole), "--merge", str(exported)]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported).config.vocab_size > 0


def test_full_weights_and_a_value_model_on_two_processes_take_the_single_process_steps(tiny_model_dir, tmp_path):
    from sao.core.config import Config

    regime = {"finetune": "full", "critic": "model"}
    single = _single(Config.load("tiny", **SETTINGS, **regime), tmp_path / "single")
    out = tmp_path / "fsdp"
    done = torchrun(tmp_path, ["train", *FLAGS, "--finetune", "full", "--critic", "model", "--out", str(out)])
    assert done.returncode == 0, ranks_said(done)
    _same_steps(run_log(out), single)
    for folder in ("model", "critic"):  # gathered from the shards, tensor by tensor
        ours, theirs = (_tensors(d / folder / "model.safetensors") for d in (out, tmp_path / "single"))
        assert _all_close(ours, theirs), folder
    assert _all_close(
        _tensors(out / "critic" / "value_head.safetensors"),
        _tensors(tmp_path / "single" / "critic" / "value_head.safetensors"),
    )


def _trace_log(tiny_model_dir: Path, path: Path, rows: int, temperature: float) -> Path:
    """``rows`` replies the tiny model drew, logged as a server logs them (version 0, each with its task)."""
    from sao.model.policy import eos_ids, load_base
    from sao.rollout.sampler import PlainDecoder
    from sao.rollout.sources import draw_batch
    from sao.rollout.types import Sampling
    from sao.tasks.environments import prompt_text
    from sao.tiny import arithmetic as tiny

    model, tokenizer = load_base(str(tiny_model_dir), torch.device("cpu"))
    tasks = tiny.make_split(rows, 8, 0).train
    prompts = [prompt_text(tokenizer, t, tiny.TINY_INSTRUCTION) for t in tasks]
    sampling = Sampling(20, temperature, eos_ids(tokenizer, model), tokenizer.pad_token_id)
    r = draw_batch(PlainDecoder(model), tokenizer, prompts, sampling, torch.Generator().manual_seed(0))
    with path.open("w") as handle:
        for i, task in enumerate(tasks):
            m = r.response_mask[i]
            line = {
                "id": f"t{i}",
                "policy_version": 0,
                "temperature": temperature,
                "prompt_token_ids": r.prompt_ids[i][r.prompt_mask[i]].tolist(),
                "completion_token_ids": r.response_ids[i][m].tolist(),
                "logprobs": r.sampler_logprobs[i][m].tolist(),
                "finish_reason": "length" if bool(r.truncated[i]) else "stop",
                "task": {"question": task.question, "answer": task.answer},
            }
            handle.write(json.dumps(line) + "\n")
    return path


def test_a_trace_log_trains_under_torchrun_and_its_end_stops_every_process(tiny_model_dir, tmp_path):
    from sao import cli

    log = _trace_log(tiny_model_dir, tmp_path / "traces.jsonl", rows=24, temperature=0.7)
    args = [
        "train",
        "--preset",
        "tiny",
        "--traces",
        str(log),
        "--temperature",
        "0.7",
        "--batch-size",
        "8",
        "--critic-warmup",
        "1",
        "--steps",
        "10",
        "--quiet",
        "--threads",
        "1",
        "--shard",
        "fsdp",
    ]
    torch.set_num_threads(1)
    assert cli.main([*args, "--out", str(tmp_path / "single")]) == 0
    single = run_log(tmp_path / "single")
    out = tmp_path / "fsdp"
    done = torchrun(tmp_path, [*args, "--out", str(out)])
    assert done.returncode == 0, ranks_said(done)
    records = run_log(out)
    assert len(records) == len(single) == 3, "the log holds 3 batches: both processes stop after them"
    _same_steps(records, single)
    assert "stopped after 3 of 11 steps" in done.stdout
    latest = json.loads((out / "published" / "LATEST.json").read_text())
    assert latest == {"version": 2, "path": "v2"} and (out / "published" / "v2" / "adapter_model.safetensors").is_file()
