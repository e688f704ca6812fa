"""Rollouts and training, the plain Hugging Face + PEFT path against sao's, in one process on one device.

    python bench/bench.py                      # a GPU: the Qwen2.5-1.5B shape with random weights (bf16)
    python bench/bench.py --tiny               # the CPU: the tiny preset (so the CPU path cannot silently slow)
    python bench/bench.py --out bench.json     # also write every figure as JSON
    python bench/bench.py --compile            # also time the engine with compile_elementwise=True (a GPU question)

On the CPU torch runs on ``--threads`` threads (default 1: the tiny model's ops are too small to spread, and
one thread is the figure that repeats on a shared machine); on a GPU the thread count is left alone.

It prints one table, each row side by side with its baseline and, on a GPU, its floor:

    decode            tokens/s and ms per step at batch 64 and 480 (every reply forced to full length),
                      plain = ``sampler.draw`` (HF forward + DynamicCache + PEFT, what ``--decoder plain``
                      runs), HF = ``model.generate`` reading log-probs off ``scores``, sao = ``sao.rollout.engine``;
                      floor = weights + KV cache read once per step at the measured copy bandwidth
    lag-0 |log ratio| mean / p99 / max of each sampler's recorded log-probabilities against the
                      teacher-forced pass (what the IS band sees when nothing is stale)
    train step        64 × (prompt + reply) tokens, forward + backward of the LoRA policy: plain = full
                      logits and a float32 log-softmax, micro-batch 16 (as measured for this project);
                      sao = the trainer's pass (chunked, checkpointed log-probs) at every micro-batch of 8..64,
                      with and without activation checkpointing — the row is the fastest under 30 GiB,
                      each candidate listed below it; floor = 6 · parameters · tokens at the bf16 peak
                      (790 TFLOP/s on an H200)
    protocol          projected wall time of the full protocol: 2 arms × (10 + 40) rollout batches of 64,
                      2 × 40 training steps, 5 evals of 480 samples

Random weights stand in for the hub checkpoint (no network on the bench machines): every kernel has the
real shape, only the numbers differ. It finishes in a few minutes on an H200 (under 8 including warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from sao.model.forward import teacher_forced
from sao.model.policy import add_lora, lora_state, set_activation_checkpointing
from sao.rollout.engine import Engine
from sao.rollout.sampler import draw

H200_BF16_FLOPS = 790e12  # dense bf16 peak used for the floor (the issue's figure)


def qwen_1p5b_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def build(tiny: bool, device: torch.device):
    """(policy with a non-trivial LoRA adapter, vocab size, prompt length, new tokens, parameter count)."""
    if tiny:
        from sao.model.policy import load_base
        from sao.tiny import arithmetic as tiny_mod

        base, _ = load_base(tiny_mod.ensure_model(progress=False), device)
        prompt_len, new_tokens = 48, 20
    else:
        from transformers import Qwen2ForCausalLM

        torch.manual_seed(0)
        with torch.device(device):
            base = Qwen2ForCausalLM(qwen_1p5b_config()).to(torch.bfloat16)
        base.eval()
        prompt_len, new_tokens = 128, 256
    policy = add_lora(base)
    with torch.no_grad():
        for name, tensor in lora_state(policy).items():
            if "lora_B" in name:
                tensor.normal_(0, 0.02)  # a trained-looking adapter, so the LoRA path costs what it costs
    params = sum(p.numel() for p in base.parameters())
    return policy, base.config.vocab_size, prompt_len, new_tokens, params


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeat: int = 1) -> float:
    """Median seconds of ``repeat`` calls (the median: a shared CPU has bursts of other work)."""
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompts(batch: int, length: int, vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(100, min(vocab, 30000), (batch, length), generator=g).to(device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    mask[::4, : length // 8] = False  # a quarter of the rows left-padded
    return ids, mask


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def hf_generate(policy, ids, mask, new_tokens: int, seed: int):
    """HF ``generate`` as a user would call it, the sampler's log-probs read off ``scores``."""
    torch.manual_seed(seed)
    out = policy.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[:, ids.shape[1] :]
    logp = torch.stack(
        [torch.log_softmax(s.float(), -1).gather(-1, tokens[:, i, None]).squeeze(-1) for i, s in enumerate(out.scores)],
        dim=1,
    )
    return tokens, logp


def lag0_gap(policy, ids, mask, tokens, logp, micro: int) -> dict[str, float]:
    response_mask = torch.ones_like(tokens, dtype=torch.bool)
    with torch.no_grad():
        parts = [
            teacher_forced(
                policy, ids[s : s + micro], mask[s : s + micro], tokens[s : s + micro], response_mask[s : s + micro]
            ).logprobs
            for s in range(0, len(ids), micro)
        ]
    gap = (torch.cat(parts) - logp).abs().flatten().float()
    return {"mean": float(gap.mean()), "p99": float(torch.quantile(gap[:1_000_000], 0.99)), "max": float(gap.max())}


def plain_train_step(policy, ids, mask, tokens, micro: int) -> None:
    """The plain loop: full logits, float32 log-softmax over the vocabulary, backward per micro-batch."""
    full = torch.cat([ids, tokens], 1)
    attn = torch.cat([mask, torch.ones_like(tokens, dtype=torch.bool)], 1).long()
    P = ids.shape[1]
    for s in range(0, len(full), micro):
        out = policy(input_ids=full[s : s + micro], attention_mask=attn[s : s + micro])
        logp = torch.log_softmax(out.logits[:, P - 1 : -1].float(), -1)
        lp = logp.gather(-1, full[s : s + micro, P:, None]).squeeze(-1)
        (-lp.mean()).backward()
    policy.zero_grad(set_to_none=True)


def sao_train_step(policy, ids, mask, tokens, micro: int) -> None:
    """The trainer's pass: per micro-batch forward with chunked, checkpointed log-probs, then backward."""
    response_mask = torch.ones_like(tokens, dtype=torch.bool)
    for s in range(0, len(ids), micro):
        part = slice(s, s + micro)
        tf = teacher_forced(policy, ids[part], mask[part], tokens[part], response_mask[part])
        (-tf.logprobs.mean()).backward()
    policy.zero_grad(set_to_none=True)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    n = 1 << 30 if device.type == "cuda" else 1 << 26
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    seconds = timed(lambda: b.copy_(a), device, repeat=5)
    return 2 * n / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU")
    parser.add_argument("--out", help="write the figures as JSON")
    parser.add_argument("--skip-hf-generate", action="store_true", help="leave out the HF generate row")
    parser.add_argument(
        "--record", help="append the table, with date, device and command, to this file (BENCHMARKS.md)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    parser.add_argument("--compile", action="store_true", help="also time the engine with compile_elementwise=True")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    tiny = args.tiny or device.type == "cpu"
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    policy, vocab, P, N, params = build(tiny, device)
    cfg = policy.get_base_model().config
    kv_bytes_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    )
    weight_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    figures: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "tiny": tiny}
    figures["parameters"] = params
    figures["threads"] = torch.get_num_threads() if device.type == "cpu" else None
    engine = Engine(policy, adapter="default")
    compiled = Engine(policy, adapter="default", compile_elementwise=True) if args.compile else None

    rows = []
    for batch in (64, 480):
        ids, mask = prompts(batch, P, vocab, device)
        kw = {"max_new_tokens": N, "temperature": 1.0, "eos_token_ids": [], "pad_token_id": 0}
        # warm-up (and, on a GPU, the graph capture) on a short run, then one timed run each
        engine.generate(ids, mask, **{**kw, "max_new_tokens": 8}, generator=generator(device, 0))
        draw(policy, ids, mask, **{**kw, "max_new_tokens": 4}, generator=generator(device, 0))
        sync(device)
        engine.generate(ids, mask, **kw, generator=generator(device, 0))  # the full-length graph, captured
        fast_repeat, slow_repeat = (5, 3) if device.type == "cpu" else (3, 1)
        t_sao = timed(lambda: engine.generate(ids, mask, **kw, generator=generator(device, 1)), device, fast_repeat)  # noqa: B023
        t_plain = timed(lambda: draw(policy, ids, mask, **kw, generator=generator(device, 1)), device, slow_repeat)  # noqa: B023
        floor_ms = None
        if bandwidth:
            kv = batch * kv_bytes_per_token * (P + N / 2)  # the cache read at the average step
            floor_ms = 1e3 * (weight_bytes + kv) / bandwidth
        row = {"batch": batch, "plain_s": t_plain, "sao_s": t_sao, "floor_ms_per_step": floor_ms}
        row["plain_tok_s"], row["sao_tok_s"] = batch * N / t_plain, batch * N / t_sao
        row["plain_ms_per_step"], row["sao_ms_per_step"] = 1e3 * t_plain / N, 1e3 * t_sao / N
        if compiled is not None:  # compiles (first call) and captures on the warm-up, then timed like sao
            compiled.generate(ids, mask, **kw, generator=generator(device, 0))
            run_compiled = lambda: compiled.generate(ids, mask, **kw, generator=generator(device, 1))  # noqa: B023, E731
            t_compiled = timed(run_compiled, device, fast_repeat)
            row["sao_compiled_tok_s"], row["sao_compiled_ms_per_step"] = batch * N / t_compiled, 1e3 * t_compiled / N
        if batch == 64 and not args.skip_hf_generate:
            policy.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=2, do_sample=True, pad_token_id=0)
            t_hf = timed(lambda: hf_generate(policy, ids, mask, N, 1), device)  # noqa: B023
            row["hf_generate_tok_s"], row["hf_generate_ms_per_step"] = batch * N / t_hf, 1e3 * t_hf / N
        rows.append(row)
        print(
            f"decode batch {batch}: plain {row['plain_tok_s']:.0f} tok/s, sao {row['sao_tok_s']:.0f} tok/s", flush=True
        )
    figures["decode"] = rows

    # lag-0 agreement with the teacher-forced pass, batch 64
    ids, mask = prompts(64, P, vocab, device)
    kw = {"max_new_tokens": N, "temperature": 1.0, "eos_token_ids": [], "pad_token_id": 0}
    micro = 16
    plain = draw(policy, ids, mask, **kw, generator=generator(device, 2))
    fast = engine.generate(ids, mask, **kw, generator=generator(device, 2))
    figures["lag0"] = {
        "plain": lag0_gap(policy, ids, mask, plain.response_ids, plain.sampler_logprobs, micro),
        "sao": lag0_gap(policy, ids, mask, fast.response_ids, fast.sampler_logprobs, micro),
    }
    if not args.skip_hf_generate:
        tokens, logp = hf_generate(policy, ids, mask, N, 2)
        figures["lag0"]["hf_generate"] = lag0_gap(policy, ids, mask, tokens, logp, micro)
    means = ", ".join(f"{k} {v['mean']:.2e}" for k, v in figures["lag0"].items())
    print(f"lag-0 |log ratio| mean: {means}", flush=True)

    # training step, 64 × (P + N) tokens
    tokens = fast.response_ids

    def measure(fn, mb: int, checkpointing: bool = False) -> dict | None:
        set_activation_checkpointing(policy, checkpointing)
        try:
            fn(policy, ids[:mb], mask[:mb], tokens[:mb], mb)  # warm-up
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t = timed(lambda: fn(policy, ids, mask, tokens, mb), device, 3)
        except RuntimeError as error:  # out of memory: this candidate does not fit
            if "out of memory" not in str(error).lower():
                raise
            policy.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return None
        finally:
            set_activation_checkpointing(policy, False)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        row = {"seconds": t, "peak_gib": peak, "micro_batch": mb, "checkpointing": checkpointing}
        print(f"train step micro-batch {mb}{' +ckpt' if checkpointing else ''}: {t:.3f}s, peak {peak} GiB", flush=True)
        return row

    train = {"plain": measure(plain_train_step, 16)}
    # sao's pass: every micro-batch that fits, with and without activation checkpointing; the reported one is
    # the fastest under the 30 GiB budget (on the CPU: the fastest)
    candidates = [measure(sao_train_step, mb, ck) for ck in (False, True) for mb in (8, 16, 32, 64)]
    train["sao_candidates"] = [c for c in candidates if c is not None]
    fits = [c for c in train["sao_candidates"] if c["peak_gib"] is None or c["peak_gib"] <= 30]
    train["sao"] = min(fits or train["sao_candidates"], key=lambda c: c["seconds"])
    tokens_per_step = 64 * (P + N)
    train["floor_s"] = 6 * params * tokens_per_step / H200_BF16_FLOPS if device.type == "cuda" else None
    figures["train"] = train

    # the full protocol, projected
    d64 = {r["batch"]: r for r in rows}
    proj = {}
    for name in ("plain", "sao"):
        rollouts = 2 * 50 * d64[64][f"{name}_s"]
        evals = 5 * d64[480][f"{name}_s"]
        training = 2 * 40 * train[name]["seconds"]
        proj[name] = {
            "rollouts_s": rollouts,
            "evals_s": evals,
            "train_s": training,
            "total_s": rollouts + evals + training,
        }
    figures["protocol"] = proj
    figures["bench_seconds"] = time.perf_counter() - started
    text = table(figures)
    print("\n" + text + "\n")
    if args.record:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        command = "python bench/bench.py " + " ".join(_portable(sys.argv[1:]))
        with open(args.record, "a", encoding="utf-8") as handle:
            handle.write(f"\n## {stamp} — {figures['device']}\n\n`{command}`\n\n{text}\n")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


def _portable(argv: list[str]) -> list[str]:
    """The command line as recorded: file arguments by their names alone (no machine's paths in the record)."""
    out, after_path_flag = [], False
    for arg in argv:
        if after_path_flag:
            arg = Path(arg).name
        elif arg.startswith(("--record=", "--out=")):
            flag, _, value = arg.partition("=")
            arg = f"{flag}={Path(value).name}"
        out.append(arg)
        after_path_flag = arg in ("--record", "--out")
    return out


def _f(x, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def table(f: dict) -> str:
    """The figures as a markdown table (and a header line), as printed and as recorded."""
    lines: list[str] = []
    add = lines.append
    gpu = f["device"] != "cpu"
    threads = f"; torch threads {f['threads']}" if f.get("threads") else ""
    model = "tiny preset" if f["tiny"] else "Qwen2.5-1.5B shape, random weights, bf16"
    add(
        f"device: {f['device']}{threads}; model: {model}"
        f" ({f['parameters'] / 1e6:.1f}M parameters); bench took {f['bench_seconds']:.0f}s"
    )
    add("")
    add("| what | plain HF + PEFT | HF generate | sao | speed-up | floor |")
    add("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in f["decode"]:
        hf = _f(r.get("hf_generate_tok_s"), ".0f")
        floor = f"{_f(r['floor_ms_per_step'], '.2f')} ms" if gpu else "—"
        add(
            f"| decode batch {r['batch']}, tokens/s | {r['plain_tok_s']:.0f} | {hf} | {r['sao_tok_s']:.0f} | "
            f"{r['sao_tok_s'] / r['plain_tok_s']:.1f}x | — |"
        )
        hf_ms = _f(r.get("hf_generate_ms_per_step"), ".2f")
        add(
            f"| decode batch {r['batch']}, ms/step | {r['plain_ms_per_step']:.2f} | {hf_ms} | "
            f"{r['sao_ms_per_step']:.2f} | | {floor} |"
        )
        if gpu and r["floor_ms_per_step"]:
            share = r["floor_ms_per_step"] / r["sao_ms_per_step"]
            add(f"| decode batch {r['batch']}, share of floor | | | {share:.1%} | | |")
        if "sao_compiled_tok_s" in r:
            add(
                f"| decode batch {r['batch']}, sao with compile_elementwise, tokens/s (ms/step) | | | "
                f"{r['sao_compiled_tok_s']:.0f} ({r['sao_compiled_ms_per_step']:.2f}) | "
                f"{r['sao_compiled_tok_s'] / r['sao_tok_s']:.2f}x of sao | |"
            )
    lag = f["lag0"]
    fmt = lambda d: f"{d['mean']:.3g} / {d['p99']:.3g} / {d['max']:.3g}"  # noqa: E731
    hf_lag = fmt(lag["hf_generate"]) if "hf_generate" in lag else "—"
    add(f"| lag-0 \\|log ratio\\| mean / p99 / max | {fmt(lag['plain'])} | {hf_lag} | {fmt(lag['sao'])} | | |")
    t = f["train"]
    plain, sao = t["plain"], t["sao"]
    how = f"micro-batch {sao['micro_batch']}" + (", checkpointed" if sao.get("checkpointing") else "")
    add(
        f"| train step, s | {plain['seconds']:.3f} (micro-batch {plain['micro_batch']}) | | "
        f"{sao['seconds']:.3f} ({how}) | {plain['seconds'] / sao['seconds']:.2f}x | "
        f"{_f(t['floor_s'], '.3f')}{' s' if t['floor_s'] else ''} |"
    )
    if gpu:
        add(f"| train step peak memory, GiB | {_f(t['plain']['peak_gib'])} | | {_f(t['sao']['peak_gib'])} | | |")
    for c in t.get("sao_candidates", []):
        how = f"micro-batch {c['micro_batch']}" + (", checkpointed" if c["checkpointing"] else "")
        add(f"| sao train step, {how} | | | {c['seconds']:.3f} s, {_f(c['peak_gib'])} GiB | | |")
    p = f["protocol"]
    add(
        f"| full protocol projected, min | {p['plain']['total_s'] / 60:.1f} | | {p['sao']['total_s'] / 60:.1f} | "
        f"{p['plain']['total_s'] / p['sao']['total_s']:.1f}x | |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
