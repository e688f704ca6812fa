"""Data-parallel training (``sao.training.distributed``): ``torchrun --nproc-per-node 2`` with the gloo backend on the
CPU takes the same steps as one process on the whole batch — the same rewards, loss, gradient norm and final
adapter within float tolerance — writes one train_log.jsonl, one checkpoints folder and one adapter, records
world_size in config.json and the log, and resumes after one of its processes is SIGKILLed mid-run. The
helpers (shards, gathers, the identity world of one process) are checked without a process group."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import TORCHRUN_FLAGS, TORCHRUN_SETTINGS, TORCHRUN_TIMEOUT_S, ranks_said, run_log, torchrun
from sao.core.errors import ConfigError
from sao.rollout.types import Rollout, Turns
from sao.training.distributed import World

SETTINGS, FLAGS = TORCHRUN_SETTINGS, TORCHRUN_FLAGS


# ---------------------------------------------------------------------------------------------------------
# Without a process group


def _rollout(B: int = 4, P: int = 3, R: int = 5, turns: bool = False) -> Rollout:
    g = torch.Generator().manual_seed(0)
    block = None
    if turns:
        block = Turns(
            rewards=torch.rand(B, R, generator=g),
            count=torch.arange(B),
            tool_calls=torch.arange(B),
            tool_errors=torch.zeros(B, dtype=torch.long),
            unfinished=torch.zeros(B, dtype=torch.bool),
        )
    return Rollout(
        prompt_ids=torch.randint(0, 50, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.bool),
        response_ids=torch.randint(0, 50, (B, R), generator=g),
        response_mask=torch.ones(B, R, dtype=torch.bool),
        action_mask=torch.rand(B, R, generator=g) > 0.3 if turns else torch.ones(B, R, dtype=torch.bool),
        sampler_logprobs=-torch.rand(B, R, generator=g),
        cut=torch.tensor([True, False] * (B // 2)),
        texts=[f"reply {i}" for i in range(B)],
        turns=block,
    )


def test_one_process_is_the_identity_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world = World.from_env()  # no torchrun environment: one process
    assert (world.size, world.rank, world.is_main, world.backend) == (1, 0, True, None)
    x = torch.randn(3, 4)
    assert world.gather_rows(x) is x and world.total(2.5) == 2.5 and world.all(False) is False
    assert world.broadcast({"a": 1}) == {"a": 1} and world.shard(8) == slice(0, 8)
    grads = [torch.ones(2)]
    world.sum_(grads)
    assert grads[0].tolist() == [1.0, 1.0]
    assert world.device("auto") == "auto" and world.training_gpus() is None


def test_each_rank_takes_an_equal_block_of_rows_and_an_uneven_batch_is_refused():
    blocks = [World(size=3, rank=r).shard(9) for r in range(3)]
    assert blocks == [slice(0, 3), slice(3, 6), slice(6, 9)]
    with pytest.raises(ConfigError, match="multiple of the 2 training processes"):
        World(size=2, rank=0).shard(7)
    assert World(size=4, rank=2, local_rank=2, local_size=4, backend="nccl").training_gpus() == [0, 1, 2, 3]
    assert World(size=4, rank=2, local_rank=2, local_size=4, backend="nccl").device("auto") == "cuda:2"


def test_rollout_rows_cut_every_per_row_field_and_keep_the_widths():
    for turns in (False, True):
        rollout = _rollout(turns=turns)
        part = rollout.rows(slice(1, 3))
        assert part.texts == ["reply 1", "reply 2"]
        for name, value in vars(rollout).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(part, name), value[1:3]), name
        if turns:
            assert torch.equal(part.turns.rewards, rollout.turns.rewards[1:3])
            assert torch.equal(part.turns.count, rollout.turns.count[1:3])
        assert part.response_ids.shape == (2, 5) and part.prompt_ids.shape == (2, 3)
        assert (part.turns is None) == (not turns)
        moved = part.to("cpu")
        assert torch.equal(moved.sampler_logprobs, part.sampler_logprobs) and moved.texts == part.texts


# ---------------------------------------------------------------------------------------------------------
# torchrun, two processes, gloo


def _close(a: float | None, b: float | None, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    """Equal within float tolerance; None is how the log writes NaN (a critic-only step's loss)."""
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def test_torchrun_two_processes_take_the_single_process_steps_and_resume(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from sao.core.config import Config
    from sao.training import build

    torch.set_num_threads(1)
    build.trainer(Config.load("tiny", **SETTINGS), tmp_path / "single", progress=False).run()
    single = run_log(tmp_path / "single")

    out = tmp_path / "ddp"
    killed = torchrun(tmp_path, ["train", *FLAGS, "--out", str(out)], kill_at=2)  # rank 1 dies entering the last step
    assert killed.returncode != 0, ranks_said(killed)
    interrupted = run_log(out)
    assert 1 <= len(interrupted) < len(single), "killed mid-run, after a checkpoint"
    resumed = torchrun(tmp_path, ["train", *FLAGS, "--out", str(out), "--resume"])
    assert resumed.returncode == 0, ranks_said(resumed)
    assert resumed.stderr.count("process group still joined: False") == 2, "each process ended its group"

    records = run_log(out)
    assert [r["step"] for r in records] == [r["step"] for r in single]
    for mine, ref in zip(records, single, strict=True):
        assert mine["world_size"] == 2 and ref["world_size"] == 1
        assert mine["reward_mean"] == ref["reward_mean"] and mine["staleness_hist"] == ref["staleness_hist"]
        assert mine["response_length"] == ref["response_length"], "the same trajectories were drawn"
        for key in (
            "loss",
            "grad_norm",
            "critic_loss",
            "masked_share",
            "ratio_max",
            "advantage_mean",
            "explained_variance",
            "abs_log_ratio_max",
        ):
            assert _close(mine[key], ref[key]), (mine["step"], key, mine[key], ref[key])
    assert any(r["phase"] == "policy" and r["grad_norm"] > 0 for r in records), "policy steps took a gradient"

    assert json.loads((out / "config.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter",
        "checkpoints",
        "config.json",
        "timeline.json",
        "train_log.jsonl",
    ]
    trace = json.loads((out / "timeline.json").read_text())  # rank 0 writes every rank's phases, in both runs
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert set(processes.values()) >= {"trainer rank 0", "trainer rank 1"}
    for rank in (0, 1):
        steps = [
            e["args"]["step"]
            for e in trace["traceEvents"]
            if e.get("cat") == "step" and processes[e["pid"]] == f"trainer rank {rank}"
        ]
        assert set(steps) == {r["step"] for r in records}, (rank, steps)
    ours, theirs = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (out, tmp_path / "single"))
    assert ours.keys() == theirs.keys()
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-6, rtol=1e-4) for k in ours), "the same final adapter"
    assert not any(torch.equal(ours[k], torch.zeros_like(ours[k])) for k in ours if "lora_B" in k), "it trained"
    assert "Traceback" not in resumed.stderr


def test_two_nodes_joined_by_a_c10d_rendezvous_take_the_single_process_steps(tiny_model_dir, tmp_path):
    """Two "nodes" on this machine, one process each, joined as a multi-node job joins (torchrun --nnodes 2, c10d
    rendezvous at 127.0.0.1): the same steps as one process on the whole batch. Node 0 hosts the rendezvous store;
    ranks come from the rendezvous (torchrun ignores --node-rank under c10d)."""
    from sao.core.config import Config
    from sao.rollout.vllm import free_port
    from sao.training import build

    torch.set_num_threads(1)
    build.trainer(Config.load("tiny", **SETTINGS), tmp_path / "single", progress=False).run()
    single = run_log(tmp_path / "single")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    endpoint, out = f"127.0.0.1:{free_port()}", tmp_path / "nodes"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "sao-test",
                "--rdzv-conf",
                f"is_host={int(rank == 0)}",
                "--local-addr",
                "127.0.0.1",
                "-m",
                "sao",
                "train",
                *FLAGS,
                "--out",
                str(out),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        finished = [node.communicate(timeout=TORCHRUN_TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    assert all(node.returncode == 0 for node in nodes), [err[-3000:] for _, err in finished]

    records = run_log(out)
    assert [r["step"] for r in records] == [r["step"] for r in single]
    for mine, ref in zip(records, single, strict=True):
        assert mine["world_size"] == 2 and mine["reward_mean"] == ref["reward_mean"]
        assert mine["response_length"] == ref["response_length"], "the same trajectories were drawn"
        for key in ("loss", "grad_norm", "critic_loss", "ratio_max", "explained_variance"):
            assert _close(mine[key], ref[key]), (mine["step"], key, mine[key], ref[key])
    assert any(r["phase"] == "policy" and r["grad_norm"] > 0 for r in records), "policy steps took a gradient"
