"""Environments that do not hold the batch: the tiny-calc agent with a tool that sleeps, drawn both ways.

Batch 16 (``--batch``), 3 turns (``--turns``): the tiny-calc model (``sao.tiny.calculator``) acts, its calculator
answers after sleeping a seeded random 0–1 s (``--max-sleep``) per call, and a final answer before the last turn
is answered "again?" so that every row makes every call. The same sleeps, seed and tasks go through

    synchronous   --env-concurrency 0: every turn waits for the slowest step, the steps one after another
    turn          --env-concurrency 16 (``--concurrency``), --env-rejoin turn (the default): a turn's steps at
                  once, the batch decoding on when the last is back (the same numbers whatever finishes first)
    row           --env-rejoin row: a row whose observation is back decodes on without waiting for the rest

and the table puts their draw times beside what they are measured against: the sum over turns of each turn's
slowest call (a batch-synchronous loop with concurrent calls could not do better), the slowest row's own sleeps
(the target) and a draw with no sleeps (the decoding alone). ``--record BENCHMARKS.md`` appends the table with the
date and the command, as bench/bench.py does.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sao.model.policy import load_base  # noqa: E402
from sao.rollout.episodes import draw_episodes  # noqa: E402
from sao.rollout.sampler import PlainDecoder, derived_seed  # noqa: E402
from sao.tasks.gsm8k import build_messages  # noqa: E402
from sao.tiny import calculator  # noqa: E402


class SleepyCalc:
    """tiny-calc's calculator, each step sleeping ``sleeps[turn]`` seconds first; an answer before the last turn
    gets "again?" (reward 0, not done), so every row makes ``len(sleeps)`` calls."""

    def __init__(self, task, sleeps: list[float]):
        self.inner, self.sleeps, self.turn = calculator.make_env(task), sleeps, 0
        self.stop_strings = self.inner.stop_strings

    def init(self, prompt):
        return self.inner.init(prompt)

    def step(self, action: str):
        time.sleep(self.sleeps[self.turn])
        self.turn += 1
        out = self.inner.step(action)
        if out["done"] and self.turn < len(self.sleeps):
            return {
                "observations": [{"role": "user", "content": "again?"}],
                "reward": 0.0,
                "done": False,
                "metadata": out.get("metadata", {}),
            }
        return out

    def close(self):
        self.inner.close()


def sleeps_for(seed: int, rows: int, turns: int, max_sleep: float) -> list[list[float]]:
    """[rows][turns] seconds, uniform in [0, max_sleep), a function of (seed, row, turn)."""
    return [
        [random.Random(derived_seed(seed, i, t, "sleep")).uniform(0, max_sleep) for t in range(turns)]
        for i in range(rows)
    ]


def draw(
    model, tokenizer, tasks, sleeps, concurrency: int, seed: int, turns: int, rejoin: str = "row"
) -> tuple[float, object]:
    envs = [SleepyCalc(task, s) for task, s in zip(tasks, sleeps, strict=True)]
    prompts = [build_messages(t.question, calculator.TINY_CALC_INSTRUCTION) for t in tasks]
    started = time.perf_counter()
    rollout = draw_episodes(
        PlainDecoder(model),
        tokenizer,
        envs,
        prompts,
        max_new_tokens=24,
        max_turns=turns,
        max_total_tokens=256,
        temperature=1.0,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
        env_concurrency=concurrency,
        rejoin=rejoin,
        close=True,
    )
    return time.perf_counter() - started, rollout


def _made(sleeps: list[list[float]], rollout) -> list[list[float]]:
    """The sleeps of the calls each row made (a row cut by a token limit makes fewer)."""
    return [s[:c] for s, c in zip(sleeps, rollout.turns.count.tolist(), strict=True)]


def _spread(rollout) -> str:
    counts = rollout.turns.count.tolist()
    return f"{min(counts)}–{max(counts)}" if min(counts) != max(counts) else str(counts[0])


def table(f: dict) -> str:
    overhead = f["concurrent_s"] - f["slowest_row_s"] - f["no_sleep_s"]
    lines = [
        f"device: cpu; torch threads {f['threads']}; model: tiny-calc; batch {f['batch']}, {f['turns']} turns, each "
        f"call sleeping a seeded random 0–{f['max_sleep']:g} s; bench took {f['bench_seconds']:.0f}s",
        "",
        "| what | seconds |",
        "| --- | ---: |",
        f"| synchronous draw (--env-concurrency 0, today's loop) | {f['synchronous_s']:.2f} |",
        f"| concurrent steps, --env-rejoin turn (the default) | {f['turn_s']:.2f} |",
        f"| concurrent steps, --env-rejoin row | {f['concurrent_s']:.2f} |",
        f"| speed-up, turn / row | {f['synchronous_s'] / f['turn_s']:.1f}x / "
        f"{f['synchronous_s'] / f['concurrent_s']:.1f}x |",
        f"| each turn's slowest call, summed over turns | {f['turn_max_sum_s']:.2f} |",
        f"| every call the synchronous draw made, summed (its tool time) | {f['all_calls_s']:.2f} |",
        f"| slowest row's own sleeps (the target) | {f['slowest_row_s']:.2f} |",
        f"| draw with no sleeps (decoding alone) | {f['no_sleep_s']:.2f} |",
        f"| row − target − decoding (the overhead) | {overhead:.2f} |",
        f"| calls made per row, concurrent / synchronous | {f['calls_per_row']} / {f['calls_per_row_sync']} |",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-sleep", type=float, default=1.0, help="each call sleeps uniform [0, this) seconds")
    parser.add_argument("--concurrency", type=int, default=16, help="--env-concurrency of the concurrent draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--record", help="append the table, with date and command, to this file (BENCHMARKS.md)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_started = time.perf_counter()
    model, tokenizer = load_base(calculator.ensure_calc_model(progress=False), torch.device("cpu"))
    tasks = calculator.make_split(args.batch, 0, seed=args.seed).train
    sleeps = sleeps_for(args.seed, args.batch, args.turns, args.max_sleep)
    none = [[0.0] * args.turns for _ in tasks]
    draw(model, tokenizer, tasks, none, args.concurrency, args.seed, args.turns)  # warm-up
    no_sleep_s, _ = draw(model, tokenizer, tasks, none, args.concurrency, args.seed, args.turns)
    concurrent_s, concurrent = draw(model, tokenizer, tasks, sleeps, args.concurrency, args.seed, args.turns)
    synchronous_s, synchronous = draw(model, tokenizer, tasks, sleeps, 0, args.seed, args.turns, "turn")
    turn_s, _ = draw(model, tokenizer, tasks, sleeps, args.concurrency, args.seed, args.turns, "turn")
    made = _made(sleeps, concurrent)
    figures = {
        "threads": args.threads,
        "batch": args.batch,
        "turns": args.turns,
        "max_sleep": args.max_sleep,
        "concurrency": args.concurrency,
        "synchronous_s": synchronous_s,
        "concurrent_s": concurrent_s,
        "turn_s": turn_s,
        "no_sleep_s": no_sleep_s,
        "slowest_row_s": max(sum(s) for s in made),
        "all_calls_s": sum(sum(s) for s in _made(sleeps, synchronous)),
        "turn_max_sum_s": sum(max((s[t] for s in made if t < len(s)), default=0.0) for t in range(args.turns)),
        "calls_per_row": _spread(concurrent),
        "calls_per_row_sync": _spread(synchronous),
    }
    figures["bench_seconds"] = time.perf_counter() - bench_started
    text = table(figures)
    print("\n" + text + "\n")
    if args.record:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        argv = sys.argv[1:]
        portable = [Path(a).name if i and argv[i - 1] == "--record" else a for i, a in enumerate(argv)]
        command = "python bench/agents.py " + " ".join(portable)
        with open(args.record, "a", encoding="utf-8") as handle:
            handle.write(f"\n## {stamp} — cpu, agents with a sleeping tool\n\n`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
