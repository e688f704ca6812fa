"""A bounded client for ``sao serve``: sends tiny arithmetic tasks, each with its gold answer in ``metadata`` so the
server grades the reply and logs the reward beside the trajectory.

    python -m sao.serve.client --url http://127.0.0.1:8000 --count 2000 --max-seconds 600

It talks to loopback addresses only, sends at most ``--count`` requests in at most ``--max-seconds``, one at
a time (the server serialises them anyway), waits at most ``--timeout`` for each, and gives up after
``--max-errors`` failed requests in a row (a server being restarted refuses connections for a few seconds:
the client waits ``--retry-wait`` and tries again). Standard library only.

Prints one line every ``--every`` replies: the mean reward of those replies and the adapter versions that
wrote them, so a reward that rises as the trainer publishes is visible here.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from typing import Any

from sao.core.errors import DataError
from sao.core.reading import parse_json

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    """POST JSON; (status, decoded body) for 2xx and 4xx/5xx alike. Connection failures raise OSError."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, parse_json(response.read(), where=url)
    except urllib.error.HTTPError as error:
        try:
            return error.code, parse_json(error.read(), where=url)
        except DataError:
            return error.code, {}


def tiny_tasks(seed: int) -> list[dict[str, Any]]:
    """The tiny preset's training tasks as chat messages with their gold answers, in a seeded order."""
    from sao.core.config import Config
    from sao.tasks.setup import task_set

    split = task_set(Config.preset("tiny"))
    tasks = [{"messages": t.chat(split.instruction), "answer": t.answer} for t in split.train]
    random.Random(seed).shuffle(tasks)
    return tasks


def run(
    url: str,
    *,
    count: int,
    max_seconds: float,
    timeout: float = 30.0,
    seed: int = 0,
    every: int = 50,
    max_errors: int = 30,
    retry_wait: float = 1.0,
    temperature: float | None = None,
    say=print,
) -> dict[str, Any]:
    """Send up to ``count`` tasks; returns counts, the mean reward, and replies by adapter version."""
    host = urllib.parse.urlsplit(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"sao.serve.client: {url} is not a loopback address; this client only talks to this machine")
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    tasks = tiny_tasks(seed)
    deadline = time.monotonic() + max_seconds
    sent = ok = errors_in_a_row = failed = 0
    rewards: list[float] = []
    versions: Counter[int] = Counter()
    window: list[tuple[float, int]] = []
    while sent < count and time.monotonic() < deadline:
        task = tasks[sent % len(tasks)]
        body: dict[str, Any] = {"model": "sao-tiny", "messages": task["messages"], "logprobs": True,
                                "metadata": {"answer": task["answer"]}, "seed": seed * 1_000_003 + sent}  # fmt: skip
        if temperature is not None:
            body["temperature"] = temperature
        sent += 1
        try:
            status, reply = post(endpoint, body, min(timeout, max(0.1, deadline - time.monotonic())))
        except OSError as error:  # refused while the server restarts, or a timeout
            failed += 1
            errors_in_a_row += 1
            if errors_in_a_row >= max_errors:
                say(f"  giving up after {errors_in_a_row} failed requests in a row ({error})")
                break
            time.sleep(retry_wait)
            continue
        if status != 200:
            failed += 1
            errors_in_a_row += 1
            say(f"  request {sent}: HTTP {status}: {reply.get('error', {}).get('message', reply)}")
            if errors_in_a_row >= max_errors:
                break
            continue
        errors_in_a_row = 0
        ok += 1
        reward = float(reply["sao"].get("reward", float("nan")))
        version = int(reply["sao"]["policy_version"])
        rewards.append(reward)
        versions[version] += 1
        window.append((reward, version))
        if len(window) == every:
            mean = sum(r for r, _ in window) / len(window)
            seen = sorted({v for _, v in window})
            say(f"  replies {ok - every + 1}-{ok}: reward {mean:.3f}, adapter versions {seen[0]}..{seen[-1]}")
            window = []
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    return {"sent": sent, "ok": ok, "failed": failed, "reward_mean": mean, "versions": dict(sorted(versions.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sao.serve.client", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (loopback only)")
    parser.add_argument("--count", type=int, default=200, help="requests to send at most (default 200)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="stop sending after this long (default 300)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for one reply (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="task order and sampling seeds (default 0)")
    parser.add_argument("--every", type=int, default=50, help="print a line every this many replies (default 50)")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    args = parser.parse_args(argv)
    if args.count < 1 or args.max_seconds <= 0 or args.timeout <= 0 or args.every < 1:
        parser.error("--count, --max-seconds, --timeout and --every must be positive")
    result = run(args.url, count=args.count, max_seconds=args.max_seconds, timeout=args.timeout, seed=args.seed,
                 every=args.every, temperature=args.temperature)  # fmt: skip
    print(f"sent {result['sent']}, answered {result['ok']}, failed {result['failed']}, mean reward "
          f"{result['reward_mean']:.3f}, replies by adapter version {result['versions']}")  # fmt: skip
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
