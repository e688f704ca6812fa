"""Scale-out on the CPU preset: Ray rollout workers and the data-parallel trainer, and what a worker's start costs.

    python bench/scaling.py                          # prints the table (a few minutes on 2 cores)
    python bench/scaling.py --record BENCHMARKS.md   # and appends it, with date, machine and command

Why: ``--engine ray`` and ``torchrun`` exist for throughput, so their figures belong beside the single-process
ones, measured the same way every time. Rows:

    ray W workers, K      ``sao train --preset tiny --engine ray`` with W CPU workers (1 torch thread each) at
                          --max-staleness K (0 = synchronous, 2 = asynchronous), batch 16: trajectories/s trained
                          (B × steps / wall time of the steps after the first, which waits for the workers to
                          start), the time the trainer waited for rollouts and in how many steps, trajectories
                          drawn against admitted and dropped (waste), staleness mean and max, and the slowest
                          worker start (asking for the actor → its ``ready``)
    torchrun N            ``torchrun --nproc-per-node N sao train --preset tiny`` (local engine, gloo), batch 64,
                          one torch thread per process (more threads than cores on a shared machine only measure
                          the contention): trajectories/s (B / mean step time after the first), and the share of
                          a step spent drawing (rank 0 draws the whole batch; the other ranks wait for it)
    worker start          a fresh process doing what a Ray worker does before it can draw: import
                          ``sao.rollout.ray_workers`` (and whether that pulled in scipy), import transformers'
                          model classes and PEFT, load the model and build the decoder; the median of 3

The machine's load average is recorded with the figures: on a shared 2-core machine it moves them.
Deliberately left out: GPU rows (they need a GPU: ``--worker-gpus 1`` on a machine with several, see the
README), several nodes, and the protocol's model (these are the tiny preset's rates, not a 1.5B model's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTUP = r"""
import json, sys, time
t0 = time.perf_counter()
import sao.rollout.ray_workers as rw
t1 = time.perf_counter()
scipy_from_sao = "scipy" in sys.modules
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model
t2 = time.perf_counter()
settings = {"threads": 1, "device": "cpu", "dtype": "float32", "lora_rank": 16, "lora_alpha": 32, "seed": 17,
            "max_new_tokens": 20, "temperature": 1.0, "decoder": "auto"}
rw.RolloutWorker(sys.argv[1], settings)
t3 = time.perf_counter()
print(json.dumps({"sao_import_s": t1 - t0, "hf_import_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t0,
                  "scipy_from_sao": scipy_from_sao}))
"""


def worker_start(model_dir: str, repeats: int = 3) -> dict:
    runs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, "-c", STARTUP, model_dir], env=env, capture_output=True, text=True, timeout=600, check=True
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) if k != "scipy_from_sao" else runs[0][k] for k in runs[0]}


def ray_row(workers: int, K: int, steps: int, batch: int) -> dict:
    import torch

    from sao.core.config import Config
    from sao.training.trainer import Trainer

    torch.set_num_threads(1)  # the trainer's own thread; each worker gets --worker-cpus 1 = one thread
    config = Config.load(
        "tiny", rollout="ray", batch_size=batch, steps=steps, critic_warmup=1, rollout_workers=workers, max_staleness=K
    )
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(config, Path(out) / "run", progress=False)
        records = trainer.run()
        source = trainer.source
    steady = records[1:]
    seconds = sum(r["time"] for r in steady)
    staleness = [int(s) for r in steady for s, n in r["staleness_hist"].items() for _ in range(n)]
    return {
        "workers": workers,
        "K": K,
        "batch": batch,
        "steps": len(records),
        "trajectories_per_s": batch * len(steady) / seconds,
        "waited_s": sum(r["waited_s"] for r in steady),
        "waited_steps": sum(r["waited_for"] > 0 for r in steady),
        "drawn": source.counts["received"],
        "admitted": source.counts["admitted"],
        "dropped": source.counts["dropped_stale"],
        "staleness_mean": statistics.fmean(staleness),
        "staleness_max": max(staleness),
        "worker_start_s": max(source.start_times),
    }


def torchrun_row(processes: int, steps: int, batch: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # one torch thread per process
    sao = Path(sys.executable).parent / "sao"
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(processes),
            str(sao),
            "train",
            "--preset",
            "tiny",
            "--batch-size",
            str(batch),
            "--steps",
            str(steps),
            "--critic-warmup",
            "1",
            "--quiet",
            "--out",
            str(Path(out) / "run"),
        ]
        started = time.perf_counter()
        subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, check=True)
        wall = time.perf_counter() - started
        records = json.loads((Path(out) / "run" / "train_log.json").read_text())
    steady = records[1:]
    step_s = statistics.fmean(r["time"] for r in steady)
    return {
        "processes": processes,
        "threads": int(env["OMP_NUM_THREADS"]),
        "batch": batch,
        "steps": len(records),
        "step_s": step_s,
        "trajectories_per_s": batch / step_s,
        "sample_share": statistics.fmean(r["time_sample"] for r in steady) / step_s,
        "wall_s": wall,
        "world_size": records[-1]["world_size"],
        "reward_last": records[-1]["reward_mean"],
    }


def table(f: dict) -> str:
    lines = [
        f"machine: {f['cores']} CPU cores, load average {f['load'][0]:.1f} / {f['load'][1]:.1f} / {f['load'][2]:.1f} "
        f"(1/5/15 min) at the start; torch {f['torch']}, ray {f['ray_version']}; bench took {f['bench_seconds']:.0f}s",
        "",
        "| ray rollout workers | K | trajectories/s | waited (s, steps) | drawn / admitted / dropped "
        "| staleness mean, max | slowest worker start, s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in f["ray"]:
        lines.append(
            f"| {r['workers']} (batch {r['batch']}, {r['steps']} steps) | {r['K']} | {r['trajectories_per_s']:.1f} | "
            f"{r['waited_s']:.1f}, {r['waited_steps']}/{r['steps'] - 1} | {r['drawn']} / {r['admitted']} / "
            f"{r['dropped']} | {r['staleness_mean']:.2f}, {r['staleness_max']} | {r['worker_start_s']:.1f} |"
        )
    lines += [
        "",
        "| torchrun processes × threads | batch | step, s | trajectories/s | drawing share of a step |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in f["torchrun"]:
        lines.append(
            f"| {r['processes']} × {r['threads']} | {r['batch']} | {r['step_s']:.3f} | {r['trajectories_per_s']:.0f} | "
            f"{r['sample_share']:.0%} |"
        )
    s = f["start"]
    lines += [
        "",
        "| worker start (fresh process, median of 3) | s |",
        "| --- | ---: |",
        f"| import sao.rollout.ray_workers (scipy loaded: {'yes' if s['scipy_from_sao'] else 'no'}) "
        f"| {s['sao_import_s']:.1f} |",
        f"| import transformers' model classes and PEFT | {s['hf_import_s']:.1f} |",
        f"| load the model, add LoRA, build the decoder | {s['load_s']:.1f} |",
        f"| total | {s['total_s']:.1f} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--record", help="append the table, with date, machine and command, to this file")
    parser.add_argument("--steps", type=int, default=8, help="policy steps per Ray run (default 8)")
    parser.add_argument("--ddp-steps", type=int, default=4, help="policy steps per torchrun run (default 4)")
    args = parser.parse_args(argv)
    import ray
    import torch

    from sao.tiny import arithmetic as tiny

    started, load = time.perf_counter(), os.getloadavg()
    model_dir = str(tiny.ensure_model(progress=False))
    figures = {"cores": os.cpu_count(), "load": load, "torch": torch.__version__, "ray_version": ray.__version__}
    figures["start"] = worker_start(model_dir)
    figures["ray"] = [ray_row(w, K, args.steps, 16) for w in (1, 2) for K in (0, 2)]
    figures["torchrun"] = [torchrun_row(n, args.ddp_steps, 64) for n in (1, 2)]
    figures["bench_seconds"] = time.perf_counter() - started
    text = table(figures)
    print("\n" + text + "\n")
    if args.record:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        command = "python bench/scaling.py" + (" --record " + Path(args.record).name)
        with open(args.record, "a", encoding="utf-8") as handle:
            handle.write(f"\n## {stamp} — scale-out, cpu\n\n`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
