"""Assertions and helpers shared by several test files."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any


def assert_png_linked(folder: Path, text: str, stem: str, min_bytes: int) -> None:
    """plots/<stem>.png is a real, drawn PNG of a readable size, and the markdown links to it."""
    data = (folder / "plots" / f"{stem}.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width >= 600 and height >= 300
    assert len(data) > min_bytes  # drawn, not an empty canvas
    assert f"](plots/{stem}.png)" in text


def without_keys(obj: Any, keys: set[str]) -> Any:
    """``obj`` (nested dicts and lists) with every dict entry whose key is in ``keys`` left out, at any depth:
    what two runs should share once their timings and other volatile fields are set aside."""
    if isinstance(obj, dict):
        return {k: without_keys(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [without_keys(v, keys) for v in obj]
    return obj


def run_log(folder: Path) -> list[dict[str, Any]]:
    """The step records of a run folder (train_log.jsonl, appended as it goes) or of an experiment folder
    (train_log.json: every run's records with their cell, written once at the end)."""
    import json

    folder = Path(folder)
    if (folder / "train_log.jsonl").exists() or not (folder / "train_log.json").exists():
        return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((folder / "train_log.json").read_text())


TRACE_SCHEMA = Path(__file__).resolve().parent / "fixtures" / "trace-event.schema.json"


def trace_errors(trace: dict[str, Any]) -> list[str]:
    """What the trace event format's JSON schema (tests/fixtures) finds wrong with a timeline: none for a trace
    Perfetto and chrome://tracing read."""
    import json

    import pytest

    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(TRACE_SCHEMA.read_text()))
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(trace)]


def files_in(folder: Path) -> dict[Path, bytes]:
    """Every file below ``folder`` with its bytes ({} when the folder does not exist): what a refusal must leave."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else {}


def refused_in_one_line(capsys, argv: list[str], folder: Path | None, *needles: str) -> str:
    """Runs the CLI: exit code 2, one line on stderr holding every needle, no traceback; with ``folder``, nothing in
    it written, changed or removed (and, when it did not exist, not created). Returns the line."""
    from sao.cli import main

    existed, before = (folder.exists(), files_in(folder)) if folder is not None else (None, None)
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    if folder is not None:
        assert folder.exists() == existed and files_in(folder) == before, "the folder changed"
    return lines[0]


def save_small_model(folder: Path) -> Path:
    """A random one-layer Qwen2 with the tiny task's tokenizer (byte-level, ChatML) saved in ``folder``: a model
    in a second, for tests of what surrounds a model rather than what it learns."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sao.tiny import arithmetic as tiny

    tokenizer = tiny.build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def reference_per_turn(values, rewards, action_mask, alpha):
    """The per-turn reference SAO.update is held to (tests/algorithm, tests/tasks): per row, list the action
    positions, then δ_k, A_k and G_t straight from their definitions, one token at a time. Returns (advantages,
    value targets, λ per row)."""
    B, T = len(values), len(values[0])
    adv = [[0.0] * T for _ in range(B)]
    targets = [[0.0] * T for _ in range(B)]
    lams = []
    for i in range(B):
        pos = [t for t in range(T) if action_mask[i][t]]
        L = len(pos)
        lam = max(0.0, 1.0 - 1.0 / (alpha * L)) if L else 0.0
        lams.append(lam)
        a_next = 0.0
        for k in reversed(range(L)):
            v_next = values[i][pos[k + 1]] if k + 1 < L else 0.0
            delta = rewards[i][pos[k]] + v_next - values[i][pos[k]]
            a_next = delta + lam * a_next
            adv[i][pos[k]] = a_next
        for t in range(T):
            targets[i][t] = sum(rewards[i][p] for p in pos if p >= t)  # G_t: rewards at or after t
    return adv, targets, lams


def lm_eval_file(
    folder: Path,
    scores,
    *,
    task: str = "gsm8k",
    date: str = "2026-03-01T10-00-00.000000",
    metric: str = "exact_match",
    filters=("strict-match",),
    docs=None,
) -> Path:
    """One lm-eval run's samples file as lm-evaluation-harness's --log_samples writes it (samples_<task>_<date>.jsonl:
    a line per document and filter with doc_id, doc, target, arguments, resps, filtered_resps, filter, metrics, the
    hashes, and each metric's value): ``scores[j]`` is document j's value of ``metric`` under each filter."""
    import hashlib
    import json

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in filters:
        for j, value in enumerate(scores):
            doc = (docs or {}).get(j, {"question": f"What is {j}+1?", "answer": str(j + 1)})
            text = json.dumps(doc, indent=2, ensure_ascii=False)
            prompt = f"Question: {doc['question']}\nAnswer:"
            lines.append(
                {
                    "doc_id": j,
                    "doc": doc,
                    "target": doc["answer"],
                    "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": {"until": ["Question:"]}}},
                    "resps": [[f"#### {doc['answer']}"]],
                    "filtered_resps": [doc["answer"]],
                    "filter": name,
                    "metrics": [metric],
                    "doc_hash": hashlib.sha256(text.encode()).hexdigest(),
                    "prompt_hash": hashlib.sha256(prompt.encode()).hexdigest(),
                    "target_hash": hashlib.sha256(doc["answer"].encode()).hexdigest(),
                    metric: value,
                }
            )
    path = folder / f"samples_{task}_{date}.jsonl"
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def multi_turn_batch(B, T, seed, dtype=None, spread=0.3, p_zero_reward=0.3):
    """Ragged agentic rows: turns (runs of action tokens) separated by observation gaps, sometimes opening
    with an observation, then padding; each turn's reward (random, sometimes exactly 0) on its last action
    token and 0 everywhere else (tests/algorithm, tests/integrations). float64 unless ``dtype`` says otherwise."""
    import torch

    dtype = dtype or torch.float64
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        length = draw(1, T)
        t = draw(0, 1) * draw(1, 3)  # an opening observation half the time
        while t < length:
            turn = draw(1, 5)
            mask[i, t : min(t + turn, length)] = True
            t += turn + draw(1, 4)  # the observation gap after the turn
        mask[i, 0] |= not bool(mask[i].any())  # at least one action token per row
    next_is_action = torch.cat([mask[:, 1:], torch.zeros(B, 1, dtype=torch.bool)], dim=1)
    turn_end = mask & ~next_is_action  # [B, T] each turn's last action token
    reward = torch.randn(B, T, generator=g, dtype=dtype)
    reward = torch.where(torch.rand(B, T, generator=g) < p_zero_reward, torch.zeros_like(reward), reward)
    sampler = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    return {
        "logprobs": sampler + torch.randn(B, T, generator=g, dtype=dtype) * spread,
        "sampler_logprobs": sampler,
        "values": torch.rand(B, T, generator=g, dtype=dtype),
        "rewards": torch.where(turn_end, reward, torch.zeros_like(reward)),
        "action_mask": mask,
    }


# The child torchrun starts on every rank: optionally SIGKILL rank 1 as it enters step `kill_at`, then the CLI.
CHILD = r"""
import os, signal, sys
from sao import cli
from sao.training import trainer
kill_at = int(sys.argv[1])
if kill_at >= 0:
    real_step = trainer.Trainer.step
    def step(self, g):
        if g == kill_at and self.world.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(self, g)
    trainer.Trainer.step = step
code = cli.main(sys.argv[2:])
import torch.distributed as dist
print(f"process group still joined: {dist.is_initialized()}", file=sys.stderr)
sys.exit(code)
"""

# A tiny `sao train` of two steps on a few prompts: the flags of the CLI tests that need a finished run.
SMALL_RUN = [
    "--preset",
    "tiny",
    *("--batch-size", "8", "--steps", "2", "--critic-warmup", "1", "--train-prompts", "32", "--test-prompts", "8"),
    "--quiet",
]

# The tiny preset shrunk for a torchrun test: as settings (one process's run) and as the same flags (torchrun's).
TORCHRUN_SETTINGS = {"batch_size": 8, "steps": 2, "critic_warmup": 1, "train_prompts": 64, "lag": 1}
TORCHRUN_FLAGS = [
    "--preset",
    "tiny",
    *(f for name, value in TORCHRUN_SETTINGS.items() for f in (f"--{name.replace('_', '-')}", str(value))),
    "--quiet",
]
TORCHRUN_TIMEOUT_S = 600


def torchrun(tmp_path: Path, args: list[str], kill_at: int = -1) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2`` of the CLI with ``args``, one thread per rank (2 cores); with
    ``kill_at`` >= 0, rank 1 is SIGKILLed as it enters that step."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(child)]
    return subprocess.run(
        [*command, str(kill_at), *args], env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
    )


def ranks_said(done: subprocess.CompletedProcess) -> str:
    """A torchrun's stderr for an assertion message: the processes' own last lines (what the launcher's report
    would push out of a plain tail) and the launcher's root cause."""
    text = done.stderr
    at = text.find("torch/distributed/elastic")  # the launcher's first line about a process that stopped
    own = text[: text.rfind("\n", 0, at) + 1] if at >= 0 else text
    root = text[text.find("Root Cause") :] if "Root Cause" in text else ""
    return own[-3000:] + root


def fake_datasets(monkeypatch, load_dataset) -> None:
    """``datasets`` replaced by ``load_dataset``, standing for a hub that answers (the id taken as cached)."""
    import importlib.machinery
    import types

    from sao.core import hub

    monkeypatch.setattr(hub, "cached", lambda repo_id, kind="model": True)
    module = types.ModuleType("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)  # as an installed one has
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
