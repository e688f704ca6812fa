"""``--engine ray``: the version-tied admission rule on a simulated fleet (no Ray: random arrival orders,
deaths, skipped steps), and on a local Ray cluster the test starts and stops: the staleness bound with nothing
dropped (asynchronous and synchronous), a ledger in which every prompt draw is used at most once, a worker
SIGKILLed and another hung mid-run, both replaced in their placement bundles and the replacements delivering,
a resume, no Ray process left behind; and ``Rollout.concat``. The Ray tests are skipped where Ray is not
installed."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass

import pytest
import torch

from helpers import trace_errors
from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.rollout.types import Rollout, Turns
from sao.training import checkpoint

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
        action_mask=torch.zeros(B, R, dtype=torch.bool),
        sampler_logprobs=torch.zeros(B, R),
        cut=torch.tensor([len(r) == R for r in responses]),
        texts=[f"reply {i}" for i in range(B)],
    )
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        out.prompt_ids[i, P - len(p) :] = torch.tensor(p)
        out.prompt_mask[i, P - len(p) :] = True
        out.response_ids[i, : len(r)] = torch.tensor(r)
        out.response_mask[i, : len(r)] = True
        out.action_mask[i, : len(r)] = True
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


def test_multi_turn_rows_split_and_concat_back_with_their_action_spans_and_turn_rewards():
    """Workers split a drawn batch into rows and the source concatenates rows from many calls: the action
    masks, per-turn rewards and per-row counters of multi-turn trajectories survive both, and a batch never
    mixes episodes with single replies."""
    episodes = _rollout([[5, 6], [7]], [[1, 2, 3, 4], [8, 9]], P=2, R=4)
    episodes.action_mask = torch.tensor([[True, False, False, True], [True, True, False, False]])
    episodes.cut = torch.tensor([False, True])
    episodes.turns = Turns(
        rewards=torch.tensor([[0.5, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]]),
        count=torch.tensor([2, 1]),
        tool_calls=torch.tensor([1, 0]),
        tool_errors=torch.tensor([0, 0]),
        unfinished=torch.tensor([False, True]),
    )
    first, second = episodes.row(0), episodes.row(1)
    assert second.response_ids.tolist() == [[8, 9]] and second.action_mask.tolist() == [[True, True]]
    assert second.turns.rewards.tolist() == [[0.0, 2.0]] and second.turns.count.tolist() == [1]
    back = Rollout.concat([second, first], pad_token_id=0)
    assert back.action_mask.tolist() == [[True, True, False, False], [True, False, False, True]]
    assert back.turns.rewards.tolist() == [[0.0, 2.0, 0.0, 0.0], [0.5, 0.0, 0.0, 1.0]]
    assert back.turns.total.tolist() == [2.0, 1.5] and back.cut.tolist() == [True, False]
    assert back.to(torch.device("cpu")).turns.tool_calls.tolist() == [0, 1]
    with pytest.raises(ValueError, match="mixing"):
        Rollout.concat([first, _rollout([[1]], [[2]], P=1, R=1)], pad_token_id=0)


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
    bad_settings = (
        {"max_staleness": -1},
        {"rollout_workers": 0},
        {"worker_cpus": -1.0},
        {"rollout_batch": -1},
        {"worker_timeout": 0.0},
        {"worker_timeout": float("inf")},
    )
    for bad in bad_settings:
        with pytest.raises(ConfigError, match="--" + next(iter(bad)).replace("_", "-")):
            Config(rollout="ray", **bad)
    from sao.cli import build_parser, config_from_args

    args = build_parser().parse_args(
        [
            "train",
            "--preset",
            "tiny",
            "--engine",
            "ray",
            "--ray-address",
            "auto",
            "--rollout-workers",
            "7",
            "--worker-gpus",
            "1",
            "--worker-cpus",
            "0.5",
            "--max-staleness",
            "3",
            "--worker-timeout",
            "30",
            "--out",
            "x",
        ]
    )
    config = config_from_args(args)
    assert (config.rollout.source, config.source.ray_address, config.source.rollout_workers) == ("ray", "auto", 7)
    assert (config.source.worker_gpus, config.source.worker_cpus, config.source.max_staleness) == (1.0, 0.5, 3)
    assert config.source.worker_timeout == 30.0
    assert Config(rollout="ray").source.max_staleness == Config().source.lag  # both sources: the same staleness range


def test_rollout_batch_defaults_to_the_training_batch_on_gpu_workers():
    from sao.rollout.ray_workers import CPU_ROLLOUT_BATCH, rollout_batch_size

    ray = {"rollout": "ray", "batch_size": 64}
    assert rollout_batch_size(Config(**ray, worker_gpus=1.0)) == 64  # one engine call fills the GPU
    assert rollout_batch_size(Config(**ray)) == CPU_ROLLOUT_BATCH
    assert rollout_batch_size(Config(**ray, worker_gpus=1.0, rollout_batch=16)) == 16  # as asked


def test_a_local_cluster_never_hands_out_the_training_processes_gpus():
    from sao.rollout.ray_fleet import worker_gpu_ids

    assert worker_gpu_ids(None, 8, reserved=[0]) == ["1", "2", "3", "4", "5", "6", "7"]
    assert worker_gpu_ids("4,5,6", 3, reserved=[0]) == ["5", "6"]  # indices are in visible order
    assert worker_gpu_ids("GPU-a,GPU-b", 2, reserved=[1]) == ["GPU-a"]  # UUIDs pass through
    assert worker_gpu_ids(None, 4, reserved=[0, 1]) == ["2", "3"]  # torchrun with 2 training processes
    assert worker_gpu_ids(None, 2, reserved=[]) == ["0", "1"]  # a CPU trainer keeps no GPU
    assert worker_gpu_ids("", 0, reserved=[0]) == []


def test_missing_ray_is_a_one_line_config_error(monkeypatch):
    from sao.rollout.ray_fleet import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install 'sao\[ray\]'"):
        import_ray()


# ---------------------------------------------------------------------------------------------------------
# Admission on a simulated fleet (no Ray)


@dataclass
class _Item:
    seq: int
    version: int
    deadline: int


def _simulate(K: int, seed: int) -> dict[str, int]:
    """A fleet and a trainer under ``Admission``, with every event order left to chance: calls finish in any
    order, some die (their prompts are drawn again), the trainer steps while calls are out, some policy steps
    are skipped (the version stays). Checks at every batch that nothing in the buffer is older than K (so
    nothing would be dropped) and that the trainer never waits with nothing that could arrive."""
    from sao.rollout.admission import Admission

    rng = random.Random(seed)
    B = rng.choice([4, 8, 12])
    per_call = rng.choice([1, 3, B // 2, B])
    workers, warmup = rng.choice([1, 2, 3, 5]), rng.choice([0, 1, 3])
    total_steps = warmup + 10
    admission = Admission(B, K, warmup)
    version, step, training = 0, 0, False
    buffer: list[_Item] = []
    calls: list[tuple[list[int], int, int]] = []  # (sequence numbers, deadline, version that draws them)
    retry: deque[int] = deque()
    next_seq, drawn, staleness = 0, 0, []
    admission.begin(0, "critic-warmup" if warmup else "policy", 0)
    admission.published(0)
    while step < total_steps:
        while len(calls) < workers:  # the pump: a call to every idle worker while there is room, shared evenly
            room = admission.room(len(buffer) + sum(len(c[0]) for c in calls))
            if room <= 0:
                break
            seqs = []
            for _ in range(min(per_call, -(-room // (workers - len(calls))))):
                if retry:
                    seqs.append(retry.popleft())  # a dead call's prompts, drawn again first
                else:
                    seqs.append(next_seq)
                    next_seq += 1
            calls.append((seqs, admission.deadline, version))
        event = rng.random()
        if calls and event < 0.55:  # a call finishes, any of them
            seqs, deadline, drawn_at = calls.pop(rng.randrange(len(calls)))
            buffer += [_Item(seq, drawn_at, deadline) for seq in seqs]
            drawn += len(seqs)
        elif calls and event < 0.6:  # a worker dies mid-call
            retry.extendleft(reversed(calls.pop(rng.randrange(len(calls)))[0]))
        elif training:  # the trainer finishes its step: publish (unless skipped), then ask for the next batch
            phase = "policy" if step >= warmup else "critic-warmup"
            if phase == "policy" and rng.random() < 0.85:
                version += 1
                admission.published(version)
            step, training = step + 1, False
            admission.begin(step, "policy" if step >= warmup else "critic-warmup", version)
        else:
            chosen = admission.choose(buffer, [c[1] for c in calls])
            if chosen is None:
                assert calls, f"seed {seed}: the trainer waits and nothing is being drawn"
                continue
            assert all(version - t.version <= K for t in buffer), f"seed {seed}: a buffered row aged past K"
            staleness += [version - t.version for t in chosen]
            buffer = [t for t in buffer if t not in chosen]
            admission.formed_batch(step)
            training = True
    return {"batches": total_steps, "B": B, "drawn": drawn, "max_staleness": max(staleness)}


@pytest.mark.parametrize("K", [0, 1, 2, 4])
def test_admission_tied_to_versions_never_lets_a_trajectory_age_past_the_bound(K):
    runs = [_simulate(K, seed) for seed in range(40)]
    assert all(r["max_staleness"] <= K for r in runs)
    # never more than K+1 batches ahead of the trainer: whatever was drawn and not trained on is at most that
    assert all(r["drawn"] - r["batches"] * r["B"] <= (K + 1) * r["B"] for r in runs)
    if K > 0:  # the bound is reached: the fleet does draw ahead
        assert max(r["max_staleness"] for r in runs) == K
    else:  # synchronous: the fleet never draws past the batch the trainer will take next
        assert all(r["drawn"] - r["batches"] * r["B"] <= r["B"] for r in runs)


def test_earliest_deadline_first_waits_for_a_call_due_sooner():
    from sao.rollout.admission import Admission

    admission = Admission(batch_size=2, max_staleness=1, critic_warmup=0)
    buffer = [
        _Item(seq=5, version=1, deadline=3),
        _Item(seq=2, version=0, deadline=2),
        _Item(seq=6, version=1, deadline=3),
    ]
    # due first, then prompt order; a call out with the same deadline as the batch's last row need not be waited for
    assert [t.seq for t in admission.choose(buffer, pending_deadlines=[3])] == [2, 5]
    assert admission.choose(buffer, pending_deadlines=[2]) is None  # a call due before the last row goes first
    assert admission.choose(buffer[:1], pending_deadlines=[]) is None  # short
    admission.begin(step=0, phase="critic-warmup", version=0)  # no warmup steps: a policy step's anchor
    assert admission.deadline == 1 and admission.room(outstanding=0) == 4
    warm = Admission(batch_size=2, max_staleness=0, critic_warmup=3)
    warm.begin(step=0, phase="critic-warmup", version=0)  # batches 0..3 all train at version 0
    assert warm.deadline == 3 and warm.room(outstanding=0) == 8


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


def _wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        time.sleep(0.2)


def test_async_run_drops_nothing_and_replaced_workers_deliver(ray_module, tiny_model_dir, tmp_path):
    """K = 2 with two workers in one placement group. After the second policy step one worker is SIGKILLed
    and the other frozen with SIGSTOP (a hang: the process lives, its call never returns). The dead one is
    noticed at once, the hung one after --worker-timeout; both are replaced in their bundles, and the last
    batches can only come from the replacements: each of them delivers admitted trajectories."""
    import psutil

    from sao.training import build

    K = 2
    config = Config.load(
        "tiny",
        engine="ray",
        batch_size=16,
        steps=8,
        critic_warmup=1,
        rollout_workers=2,
        max_staleness=K,
        worker_timeout=20.0,
    )
    trainer = build.trainer(config, tmp_path / "run", progress=False)
    source = trainer.source
    seen: dict = {"daemons": _ray_children(), "stopped": None}
    publish, next_batch = source.after_update, source.next_batch

    def after_update_with_faults(version: int) -> None:
        publish(version)
        if version == 2:
            # one worker can draw the first batches alone while the other still starts: both must be up to be hit
            _wait_until(lambda: all(s.pid is not None and s.ready for s in source.slots), 300, "both workers start")
            killed, frozen = source.slots
            seen["originals"] = (killed.actor, frozen.actor)
            seen["stopped"] = psutil.Process(frozen.pid)
            os.kill(killed.pid, signal.SIGKILL)
            os.kill(frozen.pid, signal.SIGSTOP)

    def next_batch_once_replaced(g: int, phase: str, policy_version: int):
        if g == 5:  # the rest of the run needs 64 new trajectories: from the replacements, once they started
            _wait_until(lambda: all(s.generation >= 1 and s.ready for s in source.slots), 300, "replacements start")
        return next_batch(g, phase, policy_version)

    source.after_update, source.next_batch = after_update_with_faults, next_batch_once_replaced
    try:
        records = trainer.run()  # run() closes the source
    finally:
        stopped = seen["stopped"]
        if stopped is not None and stopped.is_running():  # Ray killed it; if not, the test cleans up its own fault
            stopped.send_signal(signal.SIGCONT)
            stopped.kill()

    assert len(records) == config.algorithm.critic_warmup + config.training.steps, "the run finished"
    for r in records:
        assert max(int(s) for s in r["staleness_hist"]) == r["staleness_max"] == r["staleness"] <= K
        assert sum(r["staleness_hist"].values()) == config.training.batch_size == r["admitted"]
        assert r["dropped_stale"] == 0 and r["waited_s"] >= 0 and r["waited_for"] >= 0
    assert all(r["staleness"] == 0 for r in records if r["phase"] == "critic-warmup")
    fresh = [r for r in records if r["staleness_max"] == 0]
    assert fresh and all(r["abs_log_ratio_max"] < 1e-4 for r in fresh), "workers draw with the published weights"
    assert any(r["abs_log_ratio_max"] > 1e-3 for r in records if r["staleness_max"] > 0)
    _, dropped = _check_ledger(source, records, config.training.batch_size)
    assert not dropped

    assert not set(seen["originals"]) & set(source.workers), "both were replaced"
    last = records[-1]
    assert last["worker_restarts_total"] == 2 and last["worker_hangs_total"] == 1
    assert source.admitted_by.get("w0.r1", 0) > 0 and source.admitted_by.get("w1.r1", 0) > 0, source.admitted_by
    assert last["admitted_from_replacements_total"] >= 3 * config.training.batch_size
    assert last["workers_alive"] == 2 and len(source.start_times) == 4
    groups = {slot.placement for slot in source.slots}
    assert groups == {source.placement_id}, "replacements run in the run's placement group"
    assert not ray_module.is_initialized()
    _assert_ray_gone(seen["daemons"])


def test_synchronous_run_drops_nothing_and_a_resumed_run_uses_no_draw_twice(ray_module, tiny_model_dir, tmp_path):
    """max_staleness 0: synchronous training. The fleet draws one batch with the newest adapter and waits for
    the next update, so even a slow trainer wastes nothing: every batch is fresh, nothing is dropped, and
    every step after an update waits for its draw. The run then dies after two steps and is resumed in a second
    local cluster (started in the same process): the draws pending at the checkpoint are drawn again, and
    no draw is used twice across the two halves."""
    from sao.training import build

    config = Config.load(
        "tiny", engine="ray", batch_size=16, steps=3, critic_warmup=1, rollout_workers=2, max_staleness=0
    )
    first = build.trainer(config, tmp_path / "run", progress=False)
    source, publish, next_batch = first.source, first.source.after_update, first.source.next_batch
    daemons = _ray_children()

    def slow_publish(version: int) -> None:
        time.sleep(0.5)  # a slow trainer: nothing may be drawn with the old adapter meanwhile
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
    _, dropped = _check_ledger(source, first.records, config.training.batch_size)
    assert not dropped, "nothing drawn with a stale adapter"
    assert all(r["staleness_hist"] == {"0": config.training.batch_size} for r in first.records)
    # the critic warmup's batch and the first policy step's train at version 0, so the fleet may draw the second
    # while the first trains (whether it finishes first is timing); every batch after an update must wait for it
    after_update = [r for r in first.records if r["policy_version"] > 0]
    assert after_update and all(r["waited_for"] > 0 for r in after_update), (
        "synchronous: a published version is waited for"
    )
    assert source.counts["received"] <= (len(first.records) + 1) * config.training.batch_size, "never drawn ahead"
    saved = checkpoint.load(tmp_path / "run")["source"]  # after step 2

    second = build.trainer(config, tmp_path / "run", resume=True, progress=False)
    records = second.run()
    assert len(records) == config.algorithm.critic_warmup + config.training.steps and second.source.batches
    assert all(r["staleness_max"] == 0 and r["staleness_hist"] == {"0": config.training.batch_size} for r in records)
    assert all(r["dropped_stale"] == 0 for r in records)
    # a fresh trajectory was written by the trainer's own weights (published, loaded by name): ratio 1
    assert (
        all(r["abs_log_ratio_max"] < 1e-4 for r in records) and records[-1]["policy_version"] == config.training.steps
    )
    before = {seq for batch in source.batches for seq in batch}
    after = [seq for batch in second.source.batches for seq in batch]
    assert len(after) == len(set(after)) and not before & set(after), "no draw used twice across the resume"
    assert not (before | set(after)) & (set(source.dropped) | set(second.source.dropped))
    assert records[-1]["admitted_total"] == len(records) * config.training.batch_size
    assert second.source.next_seq >= saved["next_seq"]
    assert set(saved["pending"]) <= set(after) | set(second.source.dropped) | set(second.source.state_dict()["pending"])


def test_ray_workers_draw_multi_turn_episodes(ray_module, tiny_model_dir, tmp_path):
    """--engine ray --env tiny-calc, synchronous (K = 0): the worker builds calculator environments and draws
    whole episodes; the trainer gets turns, tool calls and observation tokens, and at staleness 0 the
    teacher-forced log-probs match the worker's at every action token. The run's timeline.json passes the trace
    event format's JSON schema and holds a track per process (the trainer, the worker, its environment calls),
    the step's phases, each trajectory with its version and staleness, each tool call, each adapter publish and
    load, and the delivery check."""
    from sao.tiny import calculator as tiny_calc
    from sao.training import build

    tiny_calc.ensure_calc_model(progress=False)
    config = Config.load(
        "tiny",
        env="tiny-calc",
        engine="ray",
        batch_size=8,
        steps=2,
        critic_warmup=1,
        rollout_workers=1,
        max_staleness=0,
        train_prompts=32,
        test_prompts=8,
    )
    trainer = build.trainer(config, tmp_path / "run", progress=False)
    daemons = _ray_children()  # the cluster the source started
    records = trainer.run()
    assert len(records) == 3 and all(r["staleness_max"] == 0 for r in records)
    assert all(r["turns_mean"] >= 1.0 for r in records) and any(r["tool_calls_mean"] > 0 for r in records)
    assert any(r["observation_share"] > 0 for r in records)
    assert all(r["abs_log_ratio_max"] < 1e-4 for r in records), "workers draw with the published weights"
    assert not ray_module.is_initialized()
    _assert_ray_gone(daemons)
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert not trace_errors(trace)
    events = trace["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"trainer rank 0", "ray worker w0", "environment calls (ray worker w0)"}
    spans = {e["name"] for e in events if e["ph"] == "X"}
    assert {"wait", "score", "pass", "checks", "update", "publish", "critic", "checkpoint", "draw call"} <= spans
    rows = [e["args"] for e in events if e["name"] == "trajectory"]
    assert len(rows) == len(records) * 8 and {(r["version"], r["staleness"]) for r in rows} <= {(0, 0), (1, 0)}
    assert sorted({r["step"] for r in rows}) == [r["step"] for r in records] and all(r["env_s"] >= 0 for r in rows)
    steps = [e["args"] for e in events if e["name"] == "env.step"]
    assert steps and all(s["outcome"] == "ok" and "tool_calls" in s for s in steps)
    assert {"env.build", "env.init", "env.close"} <= spans
    assert [e["args"]["version"] for e in events if e["name"] == "adapter publish"] == [0, 1, 2]
    loads = [e["args"] for e in events if e["name"] == "adapter load"]
    assert loads and all(a["loaded"] is True for a in loads)
    checks = [e["args"] for e in events if e["name"] == "delivery check"]
    assert checks and all(c["passed"] and c["mismatch_fresh"] < c["tolerance"] for c in checks)


def test_episodes_in_flight_go_on_under_each_published_adapter(ray_module, tiny_model_dir, tmp_path):
    """K = 2, one worker, a calculator whose tool call waits for the trainer's next publish, and a trainer that
    publishes only while an episode waits on its tool: the worker takes the new adapter at the episode's next turn and
    feeds the cache again. Rows span versions, nothing is dropped, every token's staleness stays within K, and at
    staleness 0 (the later turns of a spanning row included) the worker's log-probs are the policy's."""
    from sao.tiny import calculator as tiny_calc
    from sao.training import build

    tiny_calc.ensure_calc_model(progress=False)
    # The two sides meet through files: "published" holds the trainer's last published version, "waiting" exists
    # while it waits for a batch (nothing is published until episodes finish), "ended" once the run is over, and an
    # episode's "tool-*" while it waits on its tool.
    signals = tmp_path / "signals"
    signals.mkdir()
    (signals / "published").write_text("0")

    def published() -> int:
        return int((signals / "published").read_text() or 0)

    def calculator(task_id, fields):
        import os
        import time as clock

        from sao.tasks.calc import CalcEnv

        class WaitsForAPublish(CalcEnv):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.began_under = published()

            def step(self, action):
                waiting = signals / f"tool-{os.getpid()}-{id(self)}"
                waiting.touch()
                try:
                    deadline = clock.monotonic() + 60  # a bound, never reached when the trainer runs
                    while clock.monotonic() < deadline and published() == self.began_under:
                        if (signals / "waiting").exists() or (signals / "ended").exists():
                            break
                        clock.sleep(0.01)
                finally:
                    waiting.unlink()
                return super().step(action)

        return WaitsForAPublish(task_id, fields, tool_format="tag")

    K = 2
    config = Config.load(
        "tiny",
        env="tiny-calc",
        engine="ray",
        batch_size=8,
        steps=6,
        critic_warmup=1,
        rollout_workers=1,
        max_staleness=K,
        train_prompts=64,
        test_prompts=8,
    )
    trainer = build.trainer(config, tmp_path / "run", progress=False, env_factory=calculator)
    source = trainer.source
    next_batch, after_update, close = source.next_batch, source.after_update, source.close

    def waits(g: int, phase: str, policy_version: int):
        (signals / "waiting").touch()
        try:
            return next_batch(g, phase, policy_version)
        finally:
            (signals / "waiting").unlink()

    publishes_inside_a_tool = []

    def publishes(version: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and next(signals.glob("tool-*"), None) is None:
            time.sleep(0.01)
        publishes_inside_a_tool.append(next(signals.glob("tool-*"), None) is not None)
        after_update(version)  # on the workers' board before the file: an episode that sees the file finds it
        (signals / "published").write_text(str(version))

    def ends() -> None:
        (signals / "ended").touch()
        close()

    source.next_batch, source.after_update, source.close = waits, publishes, ends
    records = trainer.run()
    assert len(records) == 7 and records[-1]["dropped_stale_total"] == 0
    fresh = [r["mismatch_fresh"] for r in records if r["mismatch_fresh"] == r["mismatch_fresh"]]
    assert fresh and max(fresh) < 1e-4, "each token matches the version that drew it"
    assert len(publishes_inside_a_tool) == 6 and all(publishes_inside_a_tool), publishes_inside_a_tool
    spanning = [r for r in records if r["spanning_rows"] > 0]
    assert len(spanning) >= 3, [r["spanning_rows"] for r in records]
    for r in spanning:
        levels = {int(level) for level in r["token_staleness_hist"]}
        assert max(levels) <= K and len(levels) > 1, r["token_staleness_hist"]


def test_a_draw_answers_the_version_its_first_action_was_drawn_by(ray_module, tiny_model_dir, tmp_path):
    """The call carries v0, but the board already holds v3 when the episodes start: the worker takes v3 before the
    first action, so the draw is v3's (counting it as v0's would make every row look three updates staler)."""
    from sao.model.policy import lora_state
    from sao.rollout.ray_fleet import AdapterBoard, RolloutWorker
    from sao.tiny import calculator as tiny_calc
    from sao.training import build

    tiny_calc.ensure_calc_model(progress=False)
    config = Config.load(
        "tiny",
        env="tiny-calc",
        engine="ray",
        batch_size=4,
        steps=1,
        critic_warmup=0,
        rollout_workers=1,
        train_prompts=8,
        test_prompts=4,
    )
    source = build.trainer(config, tmp_path / "run", progress=False).source
    try:
        weights = {n: p.detach().clone() for n, p in lora_state(source.policy).items()}
        worker = RolloutWorker(source.fleet._model_path, source.fleet._settings, ray_module.get(source.fleet._episodes))
        board = ray_module.remote(AdapterBoard).options(num_cpus=0).remote()
        ray_module.get(board.post.remote([3, ray_module.put(weights)]))
        drawn = worker.draw(source._next_job(4, deadline=0), [0, ray_module.put(weights)], board)
        assert drawn["version"] == 3 and worker.version == 3
        assert worker.draw(source._next_job(4, deadline=0), [0, ray_module.put(weights)])["version"] == 3
    finally:
        source.close()
