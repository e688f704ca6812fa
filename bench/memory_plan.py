"""Memory per GPU of a sharded training job and its vLLM servers, computed from the model's shape: docs/scale-out.md's
table is this program's output.

    python bench/memory_plan.py                  # Qwen2.5-7B's shape, 2 trainer nodes x 8 GPUs, 80 GiB GPUs
    python bench/memory_plan.py --config config.json --nodes 4 --gpus-per-node 8 --gpu-gib 141

How, per training GPU (P parameters counted from the config; N = nodes x GPUs ranks; FSDP2 divides by N, DDP not):
    weights      full: the fp32 master copy, 4P; LoRA: the frozen base in bf16, 2P (the adapter's MBs left out)
    gradients    full: fp32, 4P (reduce-scattered into each rank's shard under FSDP2); LoRA: the adapter's only
    AdamW        full: exp_avg and exp_avg_sq in fp32, 8P; LoRA: the adapter's only
    gathered     FSDP2: bf16 copies of the units in use, never sharded away: the root (embeddings, output layer,
                 final norm) and two decoder layers (the one computing, the one prefetched)
    activations  what is left after 3 GiB of CUDA context, in micro-batch tokens: sao's measured ~100 bytes x hidden
                 x layers per token (bf16, SDPA; sao.model.memory), or with --grad-checkpoint ~2 x hidden x layers
                 per token plus one layer's ~100 x hidden recomputed
    vLLM         one server per GPU: bf16 weights, 2P, and the KV cache in 90% of the GPU, in tokens at
                 2 (K and V) x layers x KV heads x head dim x 2 bytes each
Left out: --critic model (the same state again), LoRA's own state (MBs), the log-probs' vocabulary chunks, and
anything measured here: these are sums of tensor sizes.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

GIB = 1 << 30
ACTIVATION_BYTES_PER_HIDDEN = 100  # sao.model.memory's measured constant (kept here: no torch import needed)
CHECKPOINTED_BYTES_PER_HIDDEN = 2  # the bf16 input of each layer, per token
VLLM_MEMORY_SHARE = 0.9  # vLLM's default --gpu-memory-utilization
CONTEXT_GIB = 3  # the CUDA context, NCCL buffers and allocator slack: a budget, not a measurement

# Qwen/Qwen2.5-7B-Instruct's config.json (the fields the sizes need): 7,615,616,512 parameters.
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


def parameters(config: dict) -> dict[str, int]:
    """Parameter counts of a Llama/Qwen2-shaped causal LM by part: embeddings, output layer, one decoder layer,
    all layers, total. Qwen2 has biases on q, k and v; Llama has them when ``attention_bias`` is set."""
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // heads
    bias = config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if bias else 0)  # q, k, v, o (+ biases)
    layer = attention + 3 * h * i + 2 * h  # + gate, up, down; two RMSNorms
    embeddings = vocab * h
    output = 0 if config.get("tie_word_embeddings", True) else vocab * h
    total = embeddings + output + n * layer + h  # + the final norm
    return {"embeddings": embeddings, "output": output, "layer": layer, "layers": n * layer, "total": total}


def plan(config: dict, *, nodes: int, gpus_per_node: int, gpu_gib: float) -> dict:
    """Bytes per training GPU for full and LoRA fine-tuning under DDP and FSDP2, the micro-batch tokens the rest of
    the GPU holds (with and without activation checkpointing), and the vLLM servers' budget."""
    p = parameters(config)
    P, ranks = p["total"], nodes * gpus_per_node
    h, n = config["hidden_size"], config["num_hidden_layers"]
    per_token = ACTIVATION_BYTES_PER_HIDDEN * h * n  # bytes of activations a token of a micro-batch keeps
    per_token_checkpointed = CHECKPOINTED_BYTES_PER_HIDDEN * h * n  # + one layer's worth, recomputed in the backward
    gathered = 2 * (p["embeddings"] + p["output"] + h + 2 * p["layer"])
    rows = []
    for finetune, state in (
        ("full", {"weights": 4 * P, "gradients": 4 * P, "adamw": 8 * P}),
        ("lora", {"weights": 2 * P, "gradients": 0, "adamw": 0}),
    ):
        for shard, divide, extra in (("ddp", 1, 0), ("fsdp2", ranks, gathered)):
            sharded = {k: v / divide for k, v in state.items()}
            held = sum(sharded.values()) + extra
            room = (gpu_gib - CONTEXT_GIB) * GIB - held
            tokens = max(0, int(room // per_token))
            checkpointed = max(0, int(room // (per_token_checkpointed + ACTIVATION_BYTES_PER_HIDDEN * h)))
            rows.append(
                {
                    "finetune": finetune,
                    "shard": shard,
                    **sharded,
                    "gathered": extra,
                    "held": held,
                    "tokens": tokens,
                    "tokens_checkpointed": checkpointed,
                }
            )
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv_per_token = 2 * n * kv_heads * head_dim * 2
    kv_tokens = max(0, int((VLLM_MEMORY_SHARE * gpu_gib * GIB - 2 * P) // kv_per_token))
    return {
        "parameters": p,
        "ranks": ranks,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "gpu_gib": gpu_gib,
        "rows": rows,
        "activation_per_token": per_token,
        "publish_bytes": 2 * P,
        "vllm": {"weights": 2 * P, "kv_per_token": kv_per_token, "kv_tokens": kv_tokens},
    }


def render(result: dict) -> str:
    """The plan as docs/scale-out.md prints it."""

    def gib(x: float) -> str:
        return f"{x / GIB:.1f}"

    p, v = result["parameters"], result["vllm"]
    lines = [
        f"Parameters: {p['total']:,} ({p['embeddings']:,} embeddings, {p['output']:,} output layer, "
        f"{p['layer']:,} per decoder layer); {result['nodes']} nodes x {result['gpus_per_node']} GPUs = "
        f"{result['ranks']} ranks of {result['gpu_gib']:g} GiB.",
        "",
        "| fine-tuning | sharding | weights | gradients | AdamW | gathered | held GiB/GPU | micro-batch tokens that "
        "fit | with --grad-checkpoint |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cells = [gib(r[k]) for k in ("weights", "gradients", "adamw", "gathered", "held")]
        fit = [f"{r[k]:,}" if r[k] else "none" for k in ("tokens", "tokens_checkpointed")]
        lines.append(f"| {r['finetune']} | {r['shard']} | " + " | ".join(cells + fit) + " |")
    lines += [
        "",
        f"Activations: {result['activation_per_token'] / (1 << 20):.1f} MiB per token of a micro-batch, after "
        f"{CONTEXT_GIB} GiB for the CUDA context. A vLLM server on one GPU holds {gib(v['weights'])} GiB of bf16 "
        f"weights and, in 90% of the GPU, a KV cache of {v['kv_tokens']:,} tokens ({v['kv_per_token']:,} bytes each). "
        f"Each full-weight version published in bf16 is {gib(result['publish_bytes'])} GiB on the shared filesystem.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="a model's config.json (default: Qwen2.5-7B's shape)")
    parser.add_argument("--nodes", type=int, default=2, help="training nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text()) if args.config else QWEN25_7B
    config = config.get("text_config", config)
    if min(args.nodes, args.gpus_per_node) < 1 or not math.isfinite(args.gpu_gib) or args.gpu_gib <= CONTEXT_GIB:
        parser.error(f"--nodes and --gpus-per-node must be positive, --gpu-gib above {CONTEXT_GIB}")
    result = plan(config, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_gib=args.gpu_gib)
    print(render(result), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
