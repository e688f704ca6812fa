"""``--engine ray`` on a local Ray cluster the test starts and stops: the staleness bound, a ledger in which
every prompt draw is used at most once, a worker killed mid-run, no Ray process left behind; and
``Rollout.concat`` (which needs no Ray). The Ray tests are skipped where Ray is not installed."""

from __future__ import annotations

import sys

import pytest
import torch

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.rollout.sampler import Rollout

RAY_DAEMONS = ("raylet", "gcs_server")


# ---------------------------------------------------------------------------------------------------------
# Rollout.concat


def _rollout(prompts: list[list[int]], responses: list[list[int]], P: int, R: int, pad: int = 0) -> Rollout:
    """Left-padded prompts to width P, right-padded responses to width R, logprob −(t+1)/10 per token."""
    B = len(prompts)
    out = Rollout(
        prompt_ids=torch.full((B, P), pad),
        prompt_mask=torch.zeros(B, P, dtype=torch.bool),
        response_ids=torch.full((B, R), pad),
        response_mask=torch.zeros(B, R, dtype=torch.bool),
        sampler_logprobs=torch.zeros(B, R),
        truncated=torch.tensor([len(r) == R for r in responses]),
        texts=[f"reply {i}" for i in range(B)],
    )
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        out.prompt_ids[i, P - len(p) :] = torch.tensor(p)
        out.prompt_mask[i, P - len(p) :] = True
        out.response_ids[i, : len(r)] = torch.tensor(r)
        out.response_mask[i, : len(r)] = True
        out.sampler_logprobs[i, : len(r)] = -torch.arange(1, len(r) + 1) / 10
    return out


def test_concat_repads_ragged_rollouts():
    a = _rollout([[5, 6], [7]], [[1, 2, 3], [4]], P=2, R=3)
    b = _rollout([[8, 9, 10, 11]], [[12]], P=5, R=1)  # wider prompt (with its own padding), narrower response
    c = Rollout.concat([a, b], pad_token_id=0)
    assert c.prompt_ids.tolist() == [[0, 0, 0, 5, 6], [0, 0, 0, 0, 7], [0, 8, 9, 10, 11]]
    assert c.prompt_mask.tolist() == [[False] * 3 + [True] * 2, [False] * 4 + [True], [False] + [True] * 4]
    assert c.response_ids.tolist() == [[1, 2, 3], [4, 0, 0], [12, 0, 0]]
    assert c.response_mask.tolist() == [[True] * 3, [True, False, False], [True, False, False]]
    assert torch.allclose(c.sampler_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.1, 0, 0], [-0.1, 0, 0]]))
    assert c.truncated.tolist() == [True, False, True]
    assert c.texts == ["reply 0", "reply 1", "reply 0"]
    assert c.lengths.tolist() == [3, 1, 1]
    assert c.prompt_mask.dtype == c.response_mask.dtype == torch.bool
    # one rollout: unchanged; none: an error; texts on some rollouts only: an error
    assert torch.equal(Rollout.concat([a], 0).response_ids, a.response_ids)
    with pytest.raises(ValueError):
        Rollout.concat([], 0)
    b.texts = []
    with pytest.raises(ValueError):
        Rollout.concat([a, b], 0)


def test_concat_equals_one_batch_through_the_model(tiny_model_dir):
    """Re-padding changes no log-probability: the teacher-forced pass over a concatenation of separately
    padded rollouts matches the pass over each one alone."""
    from sao.model.forward import teacher_forced
    from sao.model.policy import load_base

    model, tok = load_base(tiny_model_dir, torch.device("cpu"))
    a = _rollout([[40, 41, 42], [43]], [[50, 51], [52, 53, 54]], P=3, R=3, pad=tok.pad_token_id)
    b = _rollout([[44, 45, 46, 47, 48, 49]], [[55]], P=6, R=1, pad=tok.pad_token_id)
    c = Rollout.concat([a, b], tok.pad_token_id)

    def logprobs(r: Rollout) -> torch.Tensor:
        return teacher_forced(model, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask).logprobs

    with torch.no_grad():
        whole, pa, pb = logprobs(c), logprobs(a), logprobs(b)
    assert torch.allclose(whole[:2], pa, atol=1e-5)
    assert torch.allclose(whole[2:, :1], pb, atol=1e-5) and (whole[2:, 1:] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# Configuration (no cluster)


def test_settings_are_validated_and_reach_the_command_line():
    for bad in ({"max_staleness": -1}, {"rollout_workers": 0}, {"worker_cpus": -1.0}, {"rollout_batch": 0}):
        with pytest.raises(ConfigError):
            Config(**bad)
    from sao.cli import build_parser, config_from_args

    args = build_parser().parse_args(
        ["train", "--preset", "tiny", "--engine", "ray", "--ray-address", "auto", "--rollout-workers", "7",
         "--worker-gpus", "1", "--worker-cpus", "0.5", "--max-staleness", "3", "--out", "x"]
    )  # fmt: skip
    config = config_from_args(args)
    assert (config.engine, config.ray_address, config.rollout_workers) == ("ray", "auto", 7)
    assert (config.worker_gpus, config.worker_cpus, config.max_staleness) == (1.0, 0.5, 3)
    assert Config().max_staleness == Config().lag  # both engines see the same staleness range by default


def test_missing_ray_is_a_one_line_config_error(monkeypatch):
    from sao.rollout.ray_workers import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install 'sao\[ray\]'"):
        import_ray()


# ---------------------------------------------------------------------------------------------------------
# On a local cluster


@pytest.fixture
def ray_module():
    return pytest.importorskip("ray")


def _ray_children() -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.name() in RAY_DAEMONS]


def _assert_ray_gone(daemons: list) -> None:
    import psutil

    assert daemons, "the hook saw the cluster's raylet and gcs_server while it ran"
    _, alive = psutil.wait_procs(daemons, timeout=15)
    assert not alive, f"Ray processes left behind: {[p.pid for p in alive]}"
    assert not _ray_children()


def _check_ledger(source, records, batch_size: int) -> tuple[list[int], set[int]]:
    """Every admitted draw is in exactly one batch, no dropped draw is in any, and every sequence number
    issued is accounted for: admitted, dropped, or still pending when the run stopped."""
    used = [seq for batch in source.batches for seq in batch]
    assert len(source.batches) == len(records) and all(len(b) == batch_size for b in source.batches)
    assert len(used) == len(set(used)), "a trajectory was used twice"
    dropped = set(source.dropped)
    assert len(dropped) == len(source.dropped) and not dropped & set(used)
    pending = set(source.state_dict()["pending"])
    assert set(used) | dropped | pending == set(range(source.next_seq))
    assert not pending & (set(used) | dropped)
    last = records[-1]
    assert last["admitted_total"] == len(used) and last["dropped_stale_total"] == len(dropped)
    assert sum(r["dropped_stale"] for r in records) == len(dropped)
    return used, dropped


def test_async_run_bounds_staleness_survives_a_killed_worker_and_cleans_up(ray_module, tiny_model_dir, tmp_path):
    from sao.train.trainer import Trainer

    K = 2
    config = Config.preset(
        "tiny", engine="ray", batch_size=16, steps=8, critic_warmup=1, rollout_workers=2, max_staleness=K
    )
    trainer = Trainer(config, tmp_path / "run", progress=False)
    source = trainer.source
    seen: dict[str, list] = {"killed": [], "daemons": _ray_children()}
    publish = source.after_update

    def after_update_then_kill(version: int) -> None:
        publish(version)
        if version == 2:  # after the second policy step: kill a worker, whatever it is doing
            seen["killed"].append(source.workers[0])
            ray_module.kill(source.workers[0], no_restart=True)

    source.after_update = after_update_then_kill
    records = trainer.run()  # run() closes the source

    assert len(records) == config.critic_warmup + config.steps, "the run finished"
    policy = [r for r in records if r["phase"] == "policy"]
    for r in records:
        assert max(int(s) for s in r["staleness_hist"]) == r["staleness_max"] == r["staleness"] <= K
        assert sum(r["staleness_hist"].values()) == config.batch_size == r["admitted"]
        assert r["waited_s"] >= 0 and r["waited_for"] >= 0
    assert all(r["staleness"] == 0 for r in records if r["phase"] == "critic-warmup")
    fresh = [r for r in records if r["staleness_max"] == 0]
    assert fresh and all(r["abs_log_ratio_max"] < 1e-4 for r in fresh), "workers draw with the published weights"
    assert any(r["abs_log_ratio_max"] > 1e-3 for r in records if r["staleness_max"] > 0)
    assert len({s for r in policy for s in r["staleness_hist"]}) >= 2, "staleness varies across the run"
    _check_ledger(source, records, config.batch_size)

    assert seen["killed"] and seen["killed"][0] not in source.workers, "the dead worker was replaced"
    assert records[-1]["worker_restarts_total"] >= 1 and sum(r["worker_restarts"] for r in records) >= 1
    assert records[-1]["workers_alive"] >= 1
    assert not ray_module.is_initialized()
    _assert_ray_gone(seen["daemons"])


def test_too_stale_trajectories_are_dropped_and_a_resumed_run_uses_no_draw_twice(ray_module, tiny_model_dir, tmp_path):
    """max_staleness 0 (on-policy): whatever a worker drew while the trainer was stepping is one update
    old when its turn comes, so it is dropped. The run then dies after two steps and is resumed in a second
    local cluster (started in the same process): the draws pending at the checkpoint are drawn again, and
    no draw is used twice across the two halves."""
    import time

    from sao.train.trainer import Trainer

    config = Config.preset(
        "tiny", engine="ray", batch_size=16, steps=3, critic_warmup=1, rollout_workers=2, max_staleness=0
    )
    first = Trainer(config, tmp_path / "run", progress=False)
    source, publish, next_batch = first.source, first.source.after_update, first.source.next_batch
    daemons = _ray_children()

    def slow_publish(version: int) -> None:
        time.sleep(0.5)  # a slow trainer: the fleet keeps drawing with the old adapter meanwhile
        publish(version)

    def dies_at_step_3(g: int, phase: str, policy_version: int):
        if g == 3:
            raise KeyboardInterrupt
        return next_batch(g, phase, policy_version)

    source.after_update, source.next_batch = slow_publish, dies_at_step_3
    with pytest.raises(KeyboardInterrupt):
        first.run()
    source.close()
    _assert_ray_gone(daemons)
    assert len(first.records) == 3
    _, dropped = _check_ledger(source, first.records, config.batch_size)
    assert dropped, "drawn with a stale adapter, dropped, counted"
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["source"]  # after step 2

    second = Trainer(config, tmp_path / "run", resume=True, progress=False)
    records = second.run()
    assert len(records) == config.critic_warmup + config.steps and second.source.batches
    assert all(r["staleness_max"] == 0 and r["staleness_hist"] == {"0": config.batch_size} for r in records)
    # a fresh trajectory was written by the trainer's own weights (published, loaded by name): ratio 1
    assert all(r["abs_log_ratio_max"] < 1e-4 for r in records) and records[-1]["policy_version"] == config.steps
    before = {seq for batch in source.batches for seq in batch}
    after = [seq for batch in second.source.batches for seq in batch]
    assert len(after) == len(set(after)) and not before & set(after), "no draw used twice across the resume"
    assert not (before | set(after)) & (set(source.dropped) | set(second.source.dropped))
    assert records[-1]["admitted_total"] == len(records) * config.batch_size
    assert second.source.next_seq >= saved["next_seq"]
    assert set(saved["pending"]) <= set(after) | set(second.source.dropped) | set(second.source.state_dict()["pending"])
