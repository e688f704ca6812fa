"""The live loop's gate (``--gate held-out``): a broken adapter is held back and a normal one published, a version
that regresses on live traffic is rolled back and the server's watcher follows, a gate too small for its margin is
refused at start with the size it needs, and every decision is logged with its interval.

Left out here: the whole serve → log → train → reload loop with a gate (``bench/serve_loop.py --gate``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sao.core import stats
from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.core.io import atomic_write
from sao.training.gate import GATE_FILE, Gate, LiveRewards, read_decisions
from sao.training.trainer import Hook

MARGIN, ALPHA, TASKS = 0.15, 0.2, 40  # 33 tasks reach a margin of 0.15 at alpha 0.2


# --- the statistics -------------------------------------------------------------------------------------------


def test_equal_scores_are_non_inferior_and_a_collapse_is_not():
    served = [1.0, 0.0, 1.0, 1.0, 0.0] * 20
    assert stats.noninferior(served, served, 0.1, 0.05).passed
    worse = stats.noninferior(served, [0.0] * 100, 0.1, 0.05)
    assert not worse.passed and worse.lower < -0.1 and worse.delta == pytest.approx(-0.6)
    slightly = stats.noninferior(served, [1.0, 0.0, 1.0, 0.0, 0.0] * 20, 0.3, 0.05)  # −0.2, well inside 0.3
    assert slightly.passed and -0.3 < slightly.lower < -0.2


def test_the_size_a_margin_needs_is_the_worst_case_half_width():
    from scipy import stats as st

    for margin, alpha in [(0.05, 0.05), (0.1, 0.1), (MARGIN, ALPHA)]:
        n = stats.tasks_for_margin(margin, alpha)
        assert st.t.ppf(1 - alpha, n - 1) / np.sqrt(n) <= margin < st.t.ppf(1 - alpha, n - 2) / np.sqrt(n - 1)
    assert stats.tasks_for_margin(0.05, 0.05) == 1085
    assert stats.tasks_for_margin(MARGIN, ALPHA) <= TASKS


def test_the_confidence_sequence_holds_at_every_sample_count_at_once():
    rng = np.random.default_rng(0)
    n = np.arange(1, 1001)
    radius = np.array([stats.mean_radius(int(k), 0.1) for k in n])
    missed = 0
    for _ in range(300):  # peeking after every reward: a fixed-n interval would miss far more often than alpha
        mean = np.cumsum(rng.random(1000) < 0.4) / n
        missed += bool(np.any(np.abs(mean - 0.4) > radius))
    assert missed / 300 <= 0.1
    assert stats.mean_radius(0, 0.1) == float("inf") and stats.mean_radius(1000, 0.1) < 0.06


# --- refused at start -------------------------------------------------------------------------------------------


def test_a_gate_too_small_for_its_margin_is_refused_at_start_with_the_size_it_needs():
    with pytest.raises(ConfigError, match=r"needs at least 1085") as error:
        Config.load("tiny", gate="held-out", gate_margin=0.05, gate_alpha=0.05)
    assert "\n" not in str(error.value) and "120 held-aside tasks" in str(error.value)
    with pytest.raises(ConfigError, match=r"needs at least 33"):
        Config.load("tiny", gate="held-out", gate_margin=MARGIN, gate_alpha=ALPHA, gate_tasks=20)
    Config.load("tiny", gate="held-out", gate_margin=MARGIN, gate_alpha=ALPHA, gate_tasks=TASKS)  # enough
    assert Config.load("tiny").training.gate == "off"  # off unless asked


def test_the_command_line_refuses_a_small_gate_in_one_line_and_writes_nothing(tmp_path, capsys):
    from sao.cli import main

    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--gate", "held-out", "--gate-margin", "0.05", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs at least 1085" in err
    assert not out.exists()


def test_a_held_out_split_smaller_than_the_gate_needs_is_refused_before_a_model_loads(tmp_path):
    from sao.training import build

    config = Config.load("tiny", gate="held-out", gate_margin=MARGIN, gate_alpha=ALPHA, gate_tasks=200)
    with pytest.raises(ConfigError, match=r"holds 120 tasks.*needs at least 200"):
        build.trainer(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# --- the gate on a real run ------------------------------------------------------------------------------------


class BreakAt(Hook):
    """Scales the policy's LoRA B by ``factor`` in the pass of global step ``step``, before its update."""

    name = "break"

    def __init__(self, step: int, factor: float = 50.0):
        self.step, self.factor = step, factor

    def on_pass(self, trainer, batch, forward):
        if trainer.next_step == self.step:
            from sao.model.policy import lora_state

            with torch.no_grad():
                for name, p in lora_state(trainer.models.policy).items():
                    if "lora_B" in name:
                        p.mul_(self.factor)
        return {}


def gated(tiny_config: Config, **changes) -> Config:
    return tiny_config.replace(
        batch_size=8,
        micro_batch=8,
        critic_warmup=1,
        gate="held-out",
        gate_margin=MARGIN,
        gate_alpha=ALPHA,
        gate_tasks=TASKS,
        **changes,
    )


def test_the_gates_episodes_run_under_the_runs_environment_settings(tiny_config, tmp_path):
    """The held-aside episodes are drawn as the training ones are: the same environment timeout, concurrency and
    rejoin rule (they were assembled apart once, and ran with no timeout at all)."""
    from sao.training import build

    config = gated(
        tiny_config,
        env="tiny-calc",
        env_timeout=7.0,
        env_concurrency=3,
        env_rejoin="row",
        max_turns=2,
        max_total_tokens=64,
    )
    trainer = build.trainer(config, tmp_path / "run", progress=False)
    try:
        gate = next(h for h in trainer.hooks if isinstance(h, Gate))
        held, train = gate.held.episodes, trainer.source.episodes
        for name in ("env_timeout", "env_concurrency", "env_rejoin", "max_turns", "max_total_tokens", "name"):
            assert getattr(held, name) == getattr(train, name), name
        assert (held.env_timeout, held.env_concurrency, held.env_rejoin) == (7.0, 3, "row")
        assert set(held.fields) == {t.id for t in gate.held.tasks} and not set(held.fields) & set(train.fields)
    finally:
        trainer.run_dir.undo()


def test_the_gate_publishes_a_normal_adapter_and_holds_back_a_broken_one(tiny_config, tmp_path):
    from sao.training import build

    out = tmp_path / "run"
    trainer = build.trainer(gated(tiny_config, steps=4), out, progress=False, hooks=[BreakAt(step=3)])
    records = trainer.run()
    decisions = read_decisions(out)
    assert [(d["decision"], d["version"]) for d in decisions] == [
        ("published", 0),
        ("published", 1),
        ("published", 2),
        ("held_back", 3),
        ("held_back", 4),
    ]
    broken = decisions[3]
    assert broken["lower"] <= -MARGIN and broken["candidate_mean"] < broken["served_mean"] - MARGIN
    assert broken["served"] == 2 and broken["n"] == TASKS and broken["margin"] == MARGIN
    assert all(d["lower"] > -MARGIN for d in decisions[1:3])
    latest = json.loads((out / "published" / "LATEST.json").read_text())
    assert latest == {"version": 2, "path": "v2"}  # the server keeps the last version that passed
    assert not (out / "published" / "v3").exists() and not (out / "published" / "v4").exists()
    logged = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r.get("gate_decisions") for r in logged] == [
        None,
        ["published"],
        ["published"],
        ["held_back"],
        ["held_back"],
    ]
    assert logged[3]["gate_served"] == 2 and logged[3]["gate_lower"] == pytest.approx(broken["lower"])
    assert len(records) == 5
    gate = next(h for h in trainer.hooks if isinstance(h, Gate))
    gate.held.scores(trainer.models.policy)  # judging a candidate leaves the policy's LoRA trainable
    assert all(p.requires_grad for p in trainer.policy_params)


class KillAfter(Hook):
    """Stands for a SIGKILL after step ``step``'s decision and before its checkpoint."""

    name = "kill"

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, record):
        if record["step"] == self.step:
            raise KeyboardInterrupt


def test_a_gated_run_killed_before_a_checkpoint_resumes_with_each_decision_once(tiny_config, tmp_path):
    from sao.training import build

    out, config = tmp_path / "run", gated(tiny_config, steps=3)
    with pytest.raises(KeyboardInterrupt):
        build.trainer(config, out, progress=False, hooks=[KillAfter(step=3)]).run()
    assert [d["version"] for d in read_decisions(out)] == [0, 1, 2]  # step 3's decision was not durable yet
    build.trainer(config, out, progress=False, resume=True).run()
    assert [d["version"] for d in read_decisions(out)] == [0, 1, 2, 3]


# --- rollback on live traffic -------------------------------------------------------------------------------------


def fake_trainer(out: Path, policy_version: int = 5) -> SimpleNamespace:
    said: list[str] = []
    return SimpleNamespace(
        out=out,
        world=SimpleNamespace(is_main=True),
        label="test",
        next_step=7,
        policy_version=policy_version,
        say=said.append,
        warn=said.append,
        said=said,
    )


def served_chain(out: Path, versions: list[int]) -> Gate:
    """A gate whose served chain is ``versions``, each published (a folder and LATEST.json at the last)."""
    for v in versions:
        (out / "published" / f"v{v}").mkdir(parents=True)
    (out / "published" / "LATEST.json").write_text(json.dumps({"version": versions[-1], "path": f"v{versions[-1]}"}))
    gate = Gate(held=None, margin=0.1, alpha=0.05, live=LiveRewards(out / "traces.jsonl"))  # type: ignore[arg-type]
    gate.chain = [{"version": v, "scores": []} for v in versions]
    return gate


def log_rewards(path: Path, version: int, rewards: list[float], start: int = 0) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        for i, r in enumerate(rewards):
            handle.write(
                json.dumps(
                    {"id": f"v{version}-{start + i}", "policy_version": version, "temperature": 0.7, "reward": r}
                )
                + "\n"
            )


def test_a_candidate_within_the_margin_of_the_served_version_but_not_of_the_best_one_is_held_back(tmp_path):
    """Candidates each within the margin of the last cannot walk the served quality down: v0 scored 0.80 on the
    held-aside tasks and v1 0.70 (within 0.1 of it); a candidate at 0.66 is within 0.1 of v1, not of v0."""
    trainer, gate = fake_trainer(tmp_path), served_chain(tmp_path, [0, 1])
    ones = lambda k: [1.0] * k + [0.0] * (200 - k)  # noqa: E731 (200 held-aside tasks, the first k right)
    gate.chain[0]["scores"], gate.chain[1]["scores"] = ones(160), ones(140)
    gate.held = SimpleNamespace(scores=lambda model: ones(132))
    trainer.models = SimpleNamespace(policy=None)
    gate.on_update(trainer, 2)
    (decision,) = gate.decisions
    assert decision["decision"] == "held_back" and decision["served"] == 1 and decision["best"] == 0
    assert decision["lower"] > -0.1 >= decision["best_lower"], decision
    assert gate.served == 1 and not (tmp_path / "published" / "v2").exists()
    assert "against the best served v0" in trainer.said[-1]


def test_a_version_that_regresses_on_live_traffic_is_rolled_back(tmp_path):
    rng = np.random.default_rng(1)
    trainer, gate = fake_trainer(tmp_path), served_chain(tmp_path, [0, 2])
    log = tmp_path / "traces.jsonl"
    log_rewards(log, 0, list((rng.random(200) < 0.8).astype(float)))  # the predecessor's replies: ~0.8
    checks = []
    for chunk in range(20):  # v2's replies arrive, ~0.2; the test runs after every step, as the trainer does
        log_rewards(log, 2, list((rng.random(10) < 0.2).astype(float)), start=10 * chunk)
        test = gate.check_live(trainer)
        checks.append(test)
        if gate.served == 0:
            break
    assert gate.served == 0 and gate.rolled_back == [2]
    assert not checks[0].regressed and checks[-1].regressed and checks[-1].upper < -0.1  # it waited for evidence
    latest = json.loads((tmp_path / "published" / "LATEST.json").read_text())
    assert latest == {"version": 0, "path": "v0", "rolled_back_from": 2}
    gate._write(trainer)
    (decision,) = read_decisions(tmp_path)
    assert decision["decision"] == "rolled_back" and decision["version"] == 2 and decision["served"] == 0
    assert decision["upper"] < -0.1 and decision["lower"] < decision["delta"] < decision["upper"]
    assert decision["n_before"] == 200 and decision["n"] == checks[-1].n
    assert any("rolled back v2 to v0" in line for line in trainer.said)


def test_a_version_as_good_as_its_predecessor_is_never_rolled_back_however_often_it_is_checked(tmp_path):
    rng = np.random.default_rng(2)
    trainer, gate = fake_trainer(tmp_path), served_chain(tmp_path, [0, 2])
    log = tmp_path / "traces.jsonl"
    log_rewards(log, 0, list((rng.random(300) < 0.5).astype(float)))
    for chunk in range(100):
        log_rewards(log, 2, list((rng.random(10) < 0.45).astype(float)), start=10 * chunk)
        assert not gate.check_live(trainer).regressed
    assert gate.served == 2 and not read_decisions(tmp_path)


def test_rewards_by_version_come_from_traces_and_their_feedback(tmp_path):
    log = tmp_path / "traces.jsonl"
    lines = [
        {"id": "a", "policy_version": 1, "reward": 1.0},
        {"id": "b", "policy_version": 1},
        {"id": "c", "policy_version": 2, "turn_rewards": [0.25, 0.5]},
        {"type": "feedback", "id": "b", "reward": 0},
    ]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"id": "torn", "policy_ver')
    live = LiveRewards(log)
    assert live.read() == 3
    assert live.of(1) == (1.0, 2) and live.of(2) == (0.75, 1) and live.of(3) == (0.0, 0)
    with open(log, "a") as handle:
        handle.write('sion": 3, "reward": 0.5}\n')
    restored = LiveRewards(log)
    restored.load_state_dict(json.loads(json.dumps(live.state_dict())))
    assert restored.read() == 1 and restored.of(3) == (0.5, 1)


def test_the_servers_watcher_honours_a_rollback(tmp_path):
    from sao.serve.served import AdapterWatcher

    taken: list[tuple[Path, int]] = []
    policy = SimpleNamespace(version=2, take=lambda folder, version: taken.append((folder, version)))
    said: list[str] = []
    run = tmp_path / "run"
    (run / "published" / "v0").mkdir(parents=True)
    atomic_write(
        run / "published" / "LATEST.json", json.dumps({"version": 0, "path": "v0", "rolled_back_from": 2}).encode()
    )
    assert AdapterWatcher(policy, run, say=said.append).poll()  # type: ignore[arg-type]
    assert taken == [((run / "published" / "v0").resolve(), 0)]
    assert any("rolled back to v0: v2 regressed on live traffic" in line for line in said)


def test_the_upstream_server_switches_back_to_a_version_vllm_still_holds(tmp_path):
    from sao.serve.upstream import UpstreamPolicy

    calls: list[tuple[str, str]] = []
    client = SimpleNamespace(
        load_adapter=lambda name, folder: calls.append(("load", name)),
        unload_adapter=lambda name: calls.append(("unload", name)),
    )
    upstream = UpstreamPolicy.__new__(UpstreamPolicy)
    upstream.client, upstream.tag, upstream.keep, upstream.loaded = client, "t", 3, []
    upstream.lock = __import__("threading").Lock()
    for version in (1, 2):  # published adapters (a folder without adapter_config.json would be full weights)
        (tmp_path / f"v{version}").mkdir()
        (tmp_path / f"v{version}" / "adapter_config.json").write_text("{}")
    for version in (1, 2, 1):  # v2 regressed: back to v1, which vLLM still holds
        upstream.take(tmp_path / f"v{version}", version)
    assert calls == [("load", "t-v1"), ("load", "t-v2")]
    assert upstream.name == "t-v1" and upstream.version == 1 and upstream.loaded == ["t-v2", "t-v1"]


def test_gate_jsonl_is_strict_json_even_while_an_interval_is_unbounded(tmp_path):
    trainer, gate = fake_trainer(tmp_path), served_chain(tmp_path, [0, 2])
    gate._decide(
        trainer,
        "rollback_impossible",
        version=2,
        served=2,
        to=0,
        delta=float("nan"),
        lower=float("-inf"),
        upper=float("inf"),
        n=0,
        n_before=0,
        live_mean=float("nan"),
        live_mean_before=float("nan"),
    )
    gate._write(trainer)
    text = (tmp_path / GATE_FILE).read_text()
    assert "Infinity" not in text and json.loads(text)["upper"] is None
