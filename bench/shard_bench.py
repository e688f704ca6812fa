"""What FSDP2 saves per process, and what it costs: DDP against FSDP2 at 2 processes, LoRA and full weights, the
critic head against a value model of its own, side by side in one run.

    python bench/shard_bench.py                          # prints the table (~10 minutes on 2 busy CPU cores)
    python bench/shard_bench.py --record BENCHMARKS.md   # and appends it, with date, machine and command

The model is Qwen2-shaped with random weights built from a config (12 layers, hidden 768, MLP 2048, 12 heads, 2
key-value heads, the tiny preset's tokenizer: ~73M parameters), float32 on the CPU. Each row is one
``torchrun --nproc-per-node 2`` (gloo, one torch thread per process) running sao's own step — the models as the
builder loads and shards them (``sao.training.build.load_models``), ``policy_gradient_pass``, the gradient sum (DDP:
sao's flat all-reduce; FSDP2: its reduce-scatter), ``apply_policy_step``, and the critic's ``fit_critic`` (the
head's or the value model's updates, 2 each) — on a fixed batch of 8 trajectories (32 prompt + 32 reply tokens,
4 per process), whose sampler log-probabilities are the model's own so the gradient is a real one. Columns, for
rank 0: bytes it holds of parameters (frozen ones included), gradients (the trained parameters' after the backward,
before the step) and optimizer state (after the step), for the policy and the critic together; their sum and its
ratio to the DDP row of the same regime; the step's mean wall time over the timed steps and its ratio.

Deliberately left out: GPUs (bf16 compute, NCCL), the stale sampler's copy of the weights (the same share of the
policy's, in either layout), activations and the drawing of rollouts (the training step alone is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROWS = [  # (label, finetune, critic, shard)
    ("LoRA, critic head", "lora", "head", "none"),
    ("LoRA, critic head", "lora", "head", "fsdp"),
    ("full, critic head", "full", "head", "none"),
    ("full, critic head", "full", "head", "fsdp"),
    ("full, value model", "full", "model", "none"),
    ("full, value model", "full", "model", "fsdp"),
]
MIB = 1 << 20


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (an iterable of tensors, DTensors counted by their local shard)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def build_model(folder: Path, layers: int) -> int:
    """A Qwen2-shaped causal LM with random weights (seed 0) and the tiny preset's tokenizer in ``folder``; returns
    its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from sao.tiny import arithmetic as tiny

    tokenizer = AutoTokenizer.from_pretrained(tiny.ensure_model(progress=False))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def child(settings: dict) -> None:
    """One row, under torchrun: sao's step on a fixed batch, rank 0 printing its figures as one JSON line."""
    import torch

    from sao.algorithm.update import SAO
    from sao.core.config import Config
    from sao.model.forward import teacher_forced
    from sao.rollout.types import Rollout
    from sao.training.build import load_models
    from sao.training.distributed import World
    from sao.training.learn import apply_policy_step, critic_optimizer, fit_critic, policy_gradient_pass

    torch.set_num_threads(1)
    world = World.from_env("cpu")
    config = Config(
        model=settings["model"],
        device="cpu",
        finetune=settings["finetune"],
        critic=settings["critic"],
        shard=settings["shard"],
        critic_warmup=0,
    )
    models = load_models(config, world)
    algorithm, t = SAO.of(config.algorithm), config.training
    B, P, R = 8, 32, 32
    g = torch.Generator().manual_seed(0)
    vocab = len(models.tokenizer)
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)  # [B, P]
    response_ids = torch.randint(3, vocab, (B, R), generator=g)  # [B, R]
    prompt_mask, ones = torch.ones(B, P, dtype=torch.bool), torch.ones(B, R, dtype=torch.bool)
    own = world.shard(B)
    with torch.no_grad():  # the model's own log-probabilities: ratios near 1, a real gradient
        mine = models.call(
            teacher_forced, models.policy, prompt_ids[own], prompt_mask[own], response_ids[own], ones[own]
        ).logprobs
        sampler_logprobs = world.gather_rows(mine)
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=ones,
        action_mask=ones,
        sampler_logprobs=sampler_logprobs,
        cut=torch.zeros(B, dtype=torch.bool),
    )
    rewards = torch.rand(B, generator=g).round()
    params = list(models.trainable().values())
    critic_params = models.critic_trainable()
    policy_opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    critic_opt = critic_optimizer(critic_params, t.critic_lr, t.critic_bias_lr)
    every = list(models.policy.parameters()) + list((models.critic or models.value_head).parameters())
    figures: dict = {"parameters_bytes": local_bytes(every)}
    times = []
    for step in range(settings["warmup"] + settings["steps"]):
        world.barrier()
        started = time.perf_counter()
        result = policy_gradient_pass(
            models,
            algorithm,
            rollout,
            rewards,
            rows=B // world.size,
            with_policy_gradient=True,
            temperature=1.0,
            logprob_chunk=1024,
            world=world,
        )
        if step == 0:  # the trained parameters' gradients, this process's part (the critic's have its shapes)
            figures["gradients_bytes"] = local_bytes(p.grad for p in params) + local_bytes(critic_params.values())
        if not models.sharded:
            world.sum_gradients(params)
        apply_policy_step(policy_opt, params, t.grad_clip, result.finite)
        fit_critic(
            models,
            critic_opt,
            rollout,
            result.update.value_targets,
            result.forward.hidden,
            algorithm.critic_steps,
            rows=B // world.size,
            world=world,
        )
        world.barrier()
        if step >= settings["warmup"]:
            times.append(time.perf_counter() - started)
    state = [v for opt in (policy_opt, critic_opt) for s in opt.state.values() for v in s.values()]
    figures["optimizer_bytes"] = local_bytes(v for v in state if isinstance(v, torch.Tensor))
    figures["step_s"] = sum(times) / len(times)
    figures["world_size"] = world.size
    if world.is_main:
        print("FIGURES " + json.dumps(figures), flush=True)


def run_row(model: Path, finetune: str, critic: str, shard: str, steps: int, warmup: int) -> dict:
    settings = {
        "model": str(model),
        "finetune": finetune,
        "critic": critic,
        "shard": shard,
        "steps": steps,
        "warmup": warmup,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        "--child",
        json.dumps(settings),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    found = [line for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"row {finetune}/{critic}/{shard} failed:\n{done.stderr[-3000:]}")
    return json.loads(found[-1].removeprefix("FIGURES "))


def table(rows: list[dict]) -> str:
    """The figures side by side: each FSDP2 row beside the DDP row of the same regime."""
    lines = [
        "| regime | layout | parameters, MiB | gradients, MiB | optimizer, MiB | total per process, MiB | × DDP "
        "| step, s | × DDP |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ddp: dict[str, dict] = {}
    for row in rows:
        total = row["parameters_bytes"] + row["gradients_bytes"] + row["optimizer_bytes"]
        row["total_bytes"] = total
        base = ddp.setdefault(row["label"], row) if row["shard"] == "none" else ddp[row["label"]]
        mem = "" if base is row else f"{total / base['total_bytes']:.2f}"
        speed = "" if base is row else f"{row['step_s'] / base['step_s']:.2f}"
        layout = "DDP" if row["shard"] == "none" else "FSDP2"
        lines.append(
            f"| {row['label']} | {layout} | {row['parameters_bytes'] / MIB:.1f} | "
            f"{row['gradients_bytes'] / MIB:.1f} | {row['optimizer_bytes'] / MIB:.1f} | {total / MIB:.1f} | "
            f"{mem} | {row['step_s']:.2f} | {speed} |"
        )
    full = {r["shard"]: r for r in rows if r["label"] == "full, critic head"}
    if len(full) == 2:
        memory = full["fsdp"]["total_bytes"] / full["none"]["total_bytes"]
        step = full["fsdp"]["step_s"] / full["none"]["step_s"]
        lines += [
            "",
            f"targets (full weights, critic head, 2 processes): FSDP2's state per process {memory:.2f}× "
            f"DDP's (target ≤ 0.55: {'met' if memory <= 0.55 else 'not met'}); FSDP2's step {step:.2f}× DDP's "
            f"(target ≤ 1.5: {'met' if step <= 1.5 else 'not met'})",
        ]
    for shard, layout in (("none", "DDP"), ("fsdp", "FSDP2")):
        pair = {r["label"]: r for r in rows if r["shard"] == shard and r["label"].startswith("full")}
        if len(pair) == 2:
            head, model = pair["full, critic head"], pair["full, value model"]
            memory, step = model["total_bytes"] / head["total_bytes"], model["step_s"] / head["step_s"]
            lines.append(
                f"the value model against the head ({layout}, full weights): state per process {memory:.2f}×, "
                f"step {step:.2f}×"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=12, help="decoder layers of the random model (12: ~73M)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row, after one untimed")
    parser.add_argument("--record", metavar="FILE", help="append the table to FILE (BENCHMARKS.md)")
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    started, load = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sao-shard-bench-") as tmp:
        model = Path(tmp) / "model"
        count = build_model(model, args.layers)
        rows = []
        for label, finetune, critic, shard in ROWS:
            figures = run_row(model, finetune, critic, shard, args.steps, warmup=1)
            rows.append({"label": label, "shard": shard, **figures})
            print(f"  {label}, {shard}: {figures['step_s']:.2f} s a step", file=sys.stderr, flush=True)
    import torch

    header = (
        f"machine: {os.cpu_count()} CPU cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        f"(1/5/15 min) at the start; torch {torch.__version__}; model: Qwen2-shaped, {count / 1e6:.1f}M "
        f"parameters, random weights, float32; batch 8 (4 per process), 32 + 32 tokens; {args.steps} timed steps "
        f"a row; bench took {time.perf_counter() - started:.0f}s"
    )
    text = header + "\n\n" + table(rows)
    print(text)
    if args.record:
        command = "python bench/shard_bench.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        with open(args.record, "a", encoding="utf-8") as handle:
            handle.write(f"\n## {stamp} — sharding and the paper's regime, cpu\n\n`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
