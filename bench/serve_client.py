"""A bounded client for ``sao serve``: sends tiny arithmetic tasks, each with its gold answer in ``metadata`` so the
server grades the reply and logs the reward beside the trajectory.

    python bench/serve_client.py --url http://127.0.0.1:8000 --count 2000 --max-seconds 600

It talks to loopback addresses only, sends at most ``--count`` requests in at most ``--max-seconds``, one at
a time (the server serialises them anyway), waits at most ``--timeout`` for each, and gives up after
``--max-errors`` failed requests in a row (a server being restarted refuses connections for a few seconds:
the client waits ``--retry-wait`` and tries again). Standard library only.

Prints one line every ``--every`` replies: the mean reward of those replies and the adapter versions that
wrote them, so a reward that rises as the trainer publishes is visible here.

``run_agents`` plays the tiny-calc agent through the same endpoint the way an agent harness does: a request per
action, the tool run here (sleeping a seeded random time, as a slow tool would), and each whole episode appended to
an agent trace log of its own as one ``segments`` record, every assistant segment with the adapter version that
served it (so an episode that spans a published update is trained token by token on the right versions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
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


def served_version(url: str, timeout: float) -> int | None:
    """The adapter version ``GET /health`` says is served, or None when the server does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as response:
            return int(json.loads(response.read())["policy_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tiny_tasks(seed: int) -> list[dict[str, Any]]:
    """The tiny preset's training tasks as chat messages with their gold answers, in a seeded order."""
    from sao.core.config import Config
    from sao.tasks.setup import task_set

    split = task_set(Config.load("tiny"))
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
    wrong_while_serving: int | None = None,
    say=print,
) -> dict[str, Any]:
    """Send up to ``count`` tasks; returns counts, the mean reward, and replies by adapter version.
    ``wrong_while_serving`` V: while ``/health`` says version V is served, the gold answer sent is wrong, so V's
    replies earn 0: a simulated regression of one version on live traffic (for the gate's rollback)."""
    host = urllib.parse.urlsplit(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"serve_client: {url} is not a loopback address; this client only talks to this machine")
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    tasks = tiny_tasks(seed)
    deadline = time.monotonic() + max_seconds
    sent = ok = errors_in_a_row = failed = 0
    rewards: list[float] = []
    versions: Counter[int] = Counter()
    window: list[tuple[float, int]] = []
    while sent < count and time.monotonic() < deadline:
        task = tasks[sent % len(tasks)]
        answer = task["answer"]
        if wrong_while_serving is not None and served_version(url, timeout) == wrong_while_serving:
            answer = str(int(answer) + 1000)  # no reply of the tiny model says this
        body: dict[str, Any] = {
            "model": "sao-tiny",
            "messages": task["messages"],
            "logprobs": True,
            "metadata": {"answer": answer},
            "seed": seed * 1_000_003 + sent,
        }
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


def calc_tasks(seed: int) -> list[Any]:
    """The tiny-calc training tasks (``Task``s: messages, gold answer), in a seeded order."""
    from sao.core.config import Config
    from sao.tasks.setup import task_set

    split = task_set(Config.load("tiny", env="tiny-calc"))
    tasks = list(split.train)
    random.Random(seed).shuffle(tasks)
    return tasks


class AgentLog:
    """An agent harness's trace log: whole episodes, one JSON line each, appended and fsynced under a lock."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.lock = threading.Lock()

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record) + "\n").encode()
        with self.lock, open(self.path, "ab") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def run_agents(
    url: str,
    log: str | os.PathLike[str],
    *,
    count: int,
    max_seconds: float,
    concurrency: int = 8,
    tool_seconds: float = 0.5,
    max_turns: int = 3,
    timeout: float = 30.0,
    seed: int = 0,
    max_errors: int = 30,
    retry_wait: float = 0.5,
    wrong_while_serving: int | None = None,
    wrong_from: int | None = None,
    say=print,
) -> dict[str, Any]:
    """Play up to ``count`` tiny-calc episodes against the chat endpoint at ``url``, ``concurrency`` at once, and
    append each finished one to ``log``. The tool sleeps up to ``tool_seconds`` (seeded) before it answers.

    An action is the reply cut after the calculator's stop string (the tokens kept are a prefix of the sample); the
    next request renders the conversation again, and its prompt must start with every token so far (else the episode
    is not logged: counted ``misaligned``); what follows them is the tool's segment. ``wrong_while_serving`` V: an
    episode whose last action V served earns 0 (a simulated regression of V on live traffic); ``wrong_from`` V: so
    does one whose last action any version from V on served (a regression that every later version carries)."""
    from sao.tasks.calc import TAG_CLOSE
    from sao.tiny.calculator import make_env

    if urllib.parse.urlsplit(url).hostname not in LOOPBACK:
        raise SystemExit(f"serve_client: {url} is not a loopback address; this client only talks to this machine")
    agent_log, tasks = AgentLog(log), calc_tasks(seed)
    request = _Sender(
        url.rstrip("/") + "/v1/chat/completions", time.monotonic() + max_seconds, timeout, max_errors, retry_wait
    )
    counts: Counter[str] = Counter()
    versions: Counter[str] = Counter()
    rewards: list[float] = []
    lock = threading.Lock()

    def episode(i: int) -> None:
        task, rng = tasks[i % len(tasks)], random.Random(f"{seed}:{i}")
        env = make_env(task)
        messages, _ = env.init(task.chat())
        prompt: list[int] = []  # the first request's prompt
        tokens: list[int] = []  # the prompt, then every segment so far
        segments: list[dict[str, Any]] = []
        turn_rewards: list[float] = []
        finish, served = "stop", None
        for turn in range(max_turns):
            reply = request({"messages": messages, "logprobs": True, "seed": seed * 1_000_003 + i * 16 + turn})
            if reply is None:
                with lock:
                    counts["failed"] += 1
                return
            asked = reply["sao"]["prompt_token_ids"]
            if turn == 0:
                prompt = tokens = list(asked)
            elif asked[: len(tokens)] != tokens:
                with lock:
                    counts["misaligned"] += 1
                return
            else:
                segments.append({"role": "tool", "token_ids": asked[len(tokens) :]})
                tokens = list(asked)
            ids, logprobs, text, finish = _action(reply, TAG_CLOSE)
            served = int(reply["sao"]["policy_version"])
            segments.append({"role": "assistant", "token_ids": ids, "logprobs": logprobs, "policy_version": served})
            tokens = tokens + ids
            time.sleep(rng.uniform(0.0, tool_seconds))  # the tool's own time
            result = env.step(text)
            turn_rewards.append(float(result["reward"]))
            if result["done"] or finish == "length":
                break
            messages = [*messages, {"role": "assistant", "content": text}, *result["observations"]]
        if served == wrong_while_serving or (wrong_from is not None and served is not None and served >= wrong_from):
            turn_rewards = [0.0] * len(turn_rewards)
        record = {
            "id": f"agent-{seed}-{i}",
            "policy_version": segments[0]["policy_version"],
            "temperature": 1.0,
            "prompt_token_ids": prompt,
            "segments": segments,
            "turn_rewards": turn_rewards,
            "finish_reason": finish,
        }
        agent_log.append(record)
        with lock:
            counts["logged"] += 1
            counts["spanning"] += len({s["policy_version"] for s in segments if s["role"] == "assistant"}) > 1
            versions[str(served)] += 1
            rewards.append(sum(turn_rewards))

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(episode, range(count)))
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    say(
        f"agents: {counts['logged']} episodes logged ({counts['spanning']} spanning versions), {counts['misaligned']} "
        f"misaligned, {counts['failed']} failed; mean reward {mean:.3f}; last action by version {dict(versions)}"
    )
    return {**dict(counts), "reward_mean": mean, "versions": dict(versions)}


class _Sender:
    """POSTs chat bodies until ``deadline``: a refused connection or an error status waits ``retry_wait`` and sends
    again; ``max_errors`` failures in a row (across every thread) give up. Answers the reply, or None."""

    def __init__(self, endpoint: str, deadline: float, timeout: float, max_errors: int, retry_wait: float):
        self.endpoint, self.deadline, self.timeout = endpoint, deadline, timeout
        self.max_errors, self.retry_wait = max_errors, retry_wait
        self.lock, self.errors = threading.Lock(), 0  # failures in a row

    def __call__(self, body: dict[str, Any]) -> dict[str, Any] | None:
        while time.monotonic() < self.deadline:
            try:
                status, reply = post(self.endpoint, body, self.timeout)
            except OSError:  # refused while the server restarts: wait and send again
                status, reply = 0, {}
            with self.lock:
                self.errors = 0 if status == 200 else self.errors + 1
                if status == 200:
                    return reply
                if self.errors >= self.max_errors:
                    return None
            time.sleep(self.retry_wait)
        return None


def _action(reply: dict[str, Any], stop: str) -> tuple[list[int], list[float], str, str]:
    """(token ids, log-probs, text, finish reason) of the action in a chat reply: the sample cut after the first
    ``stop`` string (the rest of it is not an action), or all of it."""
    choice = reply["choices"][0]
    ids, entries = reply["sao"]["completion_token_ids"], choice["logprobs"]["content"]
    logprobs = [entry["logprob"] for entry in entries]
    for k in range(len(ids)):
        piece = bytes(b for entry in entries[: k + 1] for b in entry["bytes"]).decode(errors="replace")
        if piece.endswith(stop):
            return ids[: k + 1], logprobs[: k + 1], piece, "stop"
    return ids, logprobs, choice["message"]["content"], choice["finish_reason"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve_client.py", description=(__doc__ or "").splitlines()[0])
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
    result = run(
        args.url,
        count=args.count,
        max_seconds=args.max_seconds,
        timeout=args.timeout,
        seed=args.seed,
        every=args.every,
        temperature=args.temperature,
    )
    print(
        f"sent {result['sent']}, answered {result['ok']}, failed {result['failed']}, mean reward "
        f"{result['reward_mean']:.3f}, replies by adapter version {result['versions']}"
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
