"""The critic's explained variance on the tiny presets, with the value head's bias at the weight's rate (the page's
single rate) and at a rate of its own (``critic_bias_lr``), seed by seed.

For each model (tiny, tiny-calc), each setting and each seed, one run of the preset's protocol (10 critic-only
steps, then 40 policy steps, the dis arm) and three figures from its log: the EV of the last warmup batch (the
critic scored on a batch before it trains on it, so this is held-out), the mean EV over the last 10 policy steps,
and the reward over the last 10 policy steps. ``--record FILE`` appends the table with the command that made it.

    python bench/critic.py --seeds 1 2 3 --record BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

import sao

SETTINGS = {"one rate (page)": None, "bias at 0.1": 0.1}


def one_run(env: str | None, seed: int, bias_lr: float | None, out: Path, steps: int) -> dict[str, float]:
    config = {"preset": "tiny", "seed": seed, "critic_bias_lr": bias_lr, "steps": steps}
    if env:
        config["env"] = env
    trainer = sao.train(config, out, progress=False)
    records = trainer.records
    warmup = [r for r in records if r["phase"] != "policy"]
    policy = [r for r in records if r["phase"] == "policy"][-10:]
    finite = [r["explained_variance"] for r in policy if math.isfinite(r["explained_variance"])]
    return {
        "ev_end_of_warmup": warmup[-1]["explained_variance"],
        "ev_last_10": statistics.mean(finite) if finite else float("nan"),
        "reward_last_10": statistics.mean(r["reward_mean"] for r in policy),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=40, help="policy steps per run (the preset's 40)")
    parser.add_argument("--envs", nargs="+", default=["tiny", "tiny-calc"])
    parser.add_argument("--record", type=Path, help="append the table to this markdown file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for env in args.envs:
            for name, bias_lr in SETTINGS.items():
                for seed in args.seeds:
                    out = Path(scratch) / f"{env}-{bias_lr}-{seed}"
                    figures = one_run(None if env == "tiny" else env, seed, bias_lr, out, args.steps)
                    rows.append((env, name, seed, figures))
                    print(
                        f"{env:9} {name:16} seed {seed}: EV end of warmup {figures['ev_end_of_warmup']:+.3f}, "
                        f"last 10 {figures['ev_last_10']:+.3f}, reward last 10 {figures['reward_last_10']:.3f}",
                        flush=True,
                    )
    lines = [
        "| model | critic | seed | EV, end of warmup | EV, last 10 steps | reward, last 10 steps |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for env, name, seed, f in rows:
        lines.append(
            f"| {env} | {name} | {seed} | {f['ev_end_of_warmup']:+.3f} | {f['ev_last_10']:+.3f} | "
            f"{f['reward_last_10']:.3f} |"
        )
    for env in args.envs:
        for name in SETTINGS:
            cell = [f for e, n, _, f in rows if e == env and n == name]
            above = sum(f["ev_last_10"] > 0 for f in cell)
            lines.append(
                f"| {env} | {name} | mean | {statistics.mean(f['ev_end_of_warmup'] for f in cell):+.3f} | "
                f"{statistics.mean(f['ev_last_10'] for f in cell):+.3f} ({above}/{len(cell)} > 0) | "
                f"{statistics.mean(f['reward_last_10'] for f in cell):.3f} |"
            )
    table = "\n".join(lines)
    print(table)
    if args.record:
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python bench/critic.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with args.record.open("a") as f:
            took = f"bench took {time.time() - started:.0f}s; the dis arm on the preset protocol"
            f.write(f"\n## {stamp} — the critic's explained variance, cpu\n\n`{command}`\n\n{took}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
