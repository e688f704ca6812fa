"""tiny-calc: the CPU preset's agent task — 3- and 4-digit sums and differences, and a calculator to call.

    task        "What is 1234+5678?" / "Compute 1234-5678." / "1234+5678=?" with operands 100..9999 and ops + and −:
                2 × 3 × 9900² questions, each named by its index in that fixed order (``tiny-calc/<index>``),
                so a split is a seeded draw of indices and never needs the pool in memory.
    environment ``CalcEnv`` in the tag format (``<calc>1234+5678</calc>`` → a "tool" message ``6912``): the tiny
                tokenizer's chat template has no tools.
    model       its own tiny Qwen2 (byte-level tokenizer from ``sao.tasks.tiny``), warm-started on demonstrations
                from a tutor who calls the tool on ``tool_share`` of the questions (``<calc>a+b</calc>``, the
                environment's answer, then ``#### <answer>``) and answers the rest at once, right only with
                probability ``direct_accuracy`` (the other answers slip by ±1, ±10, ±100 or ±1000). The loss covers
                action tokens only; each observation is produced by ``CalcEnv.step`` and rendered by
                ``render_observation`` exactly as the sampler renders it. The model learns to copy digits (question
                → call, observation → answer), which it does well, and cannot add four-digit numbers, so a
                trajectory that calls the tool is mostly right and one that does not is mostly wrong: RL has a
                visible job — call the tool more often.
    cache       ``ensure_calc_model()`` trains once and saves into ``$SAO_CACHE`` (default ``~/.cache/sao``) under a
                folder keyed by every warm-start setting, written to a temporary folder and renamed when complete.
    measure     ``measure_agent`` plays whole trajectories turn by turn with ``sao.rollout.sampler.draw`` (one call per
                turn, cut at the stop string) and reports accuracy with and without the tool and the tool-use rate.

Deliberately left out: multiplication and division (a call already pays off on addition), more than one call per
demonstration, and any claim about real models — the task exists so the multi-turn pipeline (actions, observations,
per-turn rewards, tool metrics) runs end to end on a CPU and RL has something it can visibly improve.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sao.core.errors import DataError
from sao.rollout.env import render_observation
from sao.rollout.sampler import draw
from sao.tasks.calc import TAG_CLOSE, TAG_OPEN, CalcEnv
from sao.tasks.gsm8k import DataSplit, Task, build_messages
from sao.tasks.tiny import PHRASINGS, build_tokenizer, cache_root

__all__ = [
    "POOL_SIZE",
    "TINY_CALC_INSTRUCTION",
    "CalcWarmStart",
    "calc_model_dir",
    "ensure_calc_model",
    "make_env",
    "make_split",
    "measure_agent",
    "question",
    "tutor_actions",
]

TINY_CALC_INSTRUCTION = "Tool: <calc>. End with #### N."
LOW, HIGH = 100, 9999  # operands: every 3- and 4-digit number
_SPAN = HIGH - LOW + 1
OPS = "+-"
POOL_SIZE = len(PHRASINGS) * len(OPS) * _SPAN * _SPAN
SLIPS = (-1000, -100, -10, -1, 1, 10, 100, 1000)


@dataclass(frozen=True)
class CalcWarmStart:
    """Settings of the tiny-calc warm start; every field is part of the cache key."""

    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    tool_share: float = 0.3
    direct_accuracy: float = 0.3
    threads: int = 2  # torch threads while training: the 2-core CPU the preset targets
    seed: int = 0
    version: int = 1  # bump when the task, the tokenizer, the environment or the recipe changes


# --- the task ------------------------------------------------------------------------------------------


def question(index: int) -> Task:
    """The question at ``index`` of the fixed order: phrasing, then op, then first and second operand."""
    if not 0 <= index < POOL_SIZE:
        raise IndexError(f"tiny-calc has {POOL_SIZE} questions; no index {index}")
    rest, b = divmod(index, _SPAN)
    rest, a = divmod(rest, _SPAN)
    phrasing, op = divmod(rest, len(OPS))
    a, b, op_char = a + LOW, b + LOW, OPS[op]
    answer = a + b if op_char == "+" else a - b
    text = PHRASINGS[phrasing].format(a=a, op=op_char, b=b)
    return Task(id=f"tiny-calc/{index}", question=text, answer=str(answer))


def make_split(n_train: int, n_test: int, seed: int = 0) -> DataSplit:
    """Held-out questions from ``random.Random(seed)`` and training questions from ``random.Random(seed + 1)``
    among the rest: disjoint as strings (each index is a distinct question), each list in index order."""
    if n_train < 0 or n_test < 0:
        raise DataError(f"prompt counts must be non-negative, got n_train={n_train}, n_test={n_test}")
    if n_train + n_test > POOL_SIZE:
        raise DataError(f"tiny-calc has {POOL_SIZE} questions; asked for {n_train} train + {n_test} held out")
    test_ids = sorted(random.Random(seed).sample(range(POOL_SIZE), n_test))
    held = set(test_ids)
    candidates = random.Random(seed + 1).sample(range(POOL_SIZE), n_train + n_test)
    train_ids = sorted([i for i in candidates if i not in held][:n_train])
    counts = {
        "train_pool": POOL_SIZE - n_test,
        "test_pool": POOL_SIZE,
        "test": n_test,
        "train_contaminated": 0,
        "train_kept": POOL_SIZE - n_test,
        "train": n_train,
    }
    return DataSplit(
        train=[question(i) for i in train_ids],
        test=[question(i) for i in test_ids],
        counts=counts,
        source="generated:tiny-calc",
    )


def make_env(task: Task) -> CalcEnv:
    """The task's environment: the calculator in the tag format."""
    return CalcEnv(task.id, {"answer": task.answer, "question": task.question}, tool_format="tag")


def _expression(task: Task) -> str:
    for prefix, suffix in (("What is ", "?"), ("Compute ", "."), ("", "=?")):
        if task.question.startswith(prefix) and task.question.endswith(suffix):
            return task.question[len(prefix) : len(task.question) - len(suffix)]
    raise ValueError(f"not a tiny-calc question: {task.question!r}")


def tutor_actions(task: Task, rng: random.Random, tool_share: float, direct_accuracy: float) -> list[str]:
    """The tutor's actions for one question: ``["<calc>a+b</calc>", "#### <answer>"]`` with probability
    ``tool_share``, else ``["#### <guess>"]`` with the guess right with probability ``direct_accuracy``."""
    value = int(task.answer)
    if rng.random() < tool_share:
        return [f"{TAG_OPEN}{_expression(task)}{TAG_CLOSE}", f"#### {value}"]
    if rng.random() >= direct_accuracy:
        value += rng.choice(SLIPS)
    return [f"#### {value}"]


def demonstration(tokenizer: Any, task: Task, actions: list[str], instruction: str) -> tuple[list[int], list[int]]:
    """Token ids and labels (−100 off the actions) of one whole demonstrated trajectory.

    Each action is played into the task's environment; an action ending at the stop string is followed by
    the environment's observation rendered by ``render_observation`` (the sampler's text), the last one by EOS.
    """
    env = make_env(task)
    messages, _ = env.init(build_messages(task.question, instruction))
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    for action in actions:
        out = env.step(action)
        tokens = tokenizer(action, add_special_tokens=False)["input_ids"]
        if out["done"]:
            tokens = [*tokens, tokenizer.eos_token_id]
        ids, labels = ids + tokens, labels + tokens
        if out["done"]:
            break
        observation = render_observation(tokenizer, out["observations"], eos_text=None)
        seen = tokenizer(observation, add_special_tokens=False)["input_ids"]
        ids, labels = ids + seen, labels + [-100] * len(seen)
    return ids, labels


# --- measuring an agent --------------------------------------------------------------------------------


def _cut_at_stop(tokenizer: Any, tokens: list[int], stops: list[str]) -> tuple[list[int], bool]:
    """The action's tokens up to and including the first token whose text completes a stop string."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if not any(s in text for s in stops):
        return tokens, False
    for k in range(1, len(tokens) + 1):
        prefix = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        if any(s in prefix for s in stops):
            return tokens[:k], True
    return tokens, False  # unreachable: the whole text holds a stop string


@torch.no_grad()
def measure_agent(
    model: Any,
    tokenizer: Any,
    tasks: list[Task],
    *,
    seed: int,
    temperature: float = 1.0,
    max_turns: int = 4,
    max_new_tokens: int = 24,
    instruction: str = TINY_CALC_INSTRUCTION,
) -> dict[str, float]:
    """Play one trajectory per task, turn by turn, and summarise them.

    Each turn draws the next action for every unfinished trajectory with ``draw`` (one batch, left-padded),
    cuts it at the environment's stop string, steps the environment, and appends the action's tokens and the
    rendered observation to that trajectory's context. A trajectory with no final answer after ``max_turns``
    actions scores 0 (truncated). Returns ``accuracy``, ``tool_use`` (share with at least one call),
    ``accuracy_with_tool`` / ``accuracy_without_tool`` (NaN when no trajectory falls in the group),
    ``tool_error_rate`` (errors per call), ``truncated`` and ``turns`` (mean actions per trajectory).
    """
    device = next(model.parameters()).device
    envs = [make_env(t) for t in tasks]
    contexts: list[list[int]] = []
    for env, task in zip(envs, tasks, strict=True):
        messages, _ = env.init(build_messages(task.question, instruction))
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        contexts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    n = len(tasks)
    rewards, calls, errors, turns = [0.0] * n, [0] * n, [0] * n, [0] * n
    finished = [False] * n
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    for _ in range(max_turns):
        active = [i for i in range(n) if not finished[i]]
        if not active:
            break
        width = max(len(contexts[i]) for i in active)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(contexts[i])) + contexts[i] for i in active])
        mask = torch.tensor([[False] * (width - len(contexts[i])) + [True] * len(contexts[i]) for i in active])
        rollout = draw(
            model,
            ids.to(device),  # [A, W]
            mask.to(device),  # [A, W]
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            eos_token_ids=[eos],
            pad_token_id=tokenizer.pad_token_id,
            generator=generator,
        )
        for row, i in enumerate(active):
            drawn = rollout.response_ids[row][rollout.response_mask[row]].tolist()
            tokens, at_stop = _cut_at_stop(tokenizer, drawn, envs[i].stop_strings)
            out = envs[i].step(tokenizer.decode(tokens, skip_special_tokens=True))
            turns[i] += 1
            calls[i] += out["metadata"]["tool_calls"]
            errors[i] += out["metadata"]["tool_errors"]
            if out["done"]:
                rewards[i], finished[i] = float(out["reward"]), True
                continue
            eos_text = tokenizer.eos_token if not at_stop and tokens and tokens[-1] == eos else None
            observation = render_observation(tokenizer, out["observations"], eos_text)
            contexts[i] = contexts[i] + tokens + tokenizer(observation, add_special_tokens=False)["input_ids"]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    used = [calls[i] > 0 for i in range(n)]
    return {
        "accuracy": mean(rewards),
        "tool_use": mean([float(u) for u in used]),
        "accuracy_with_tool": mean([r for r, u in zip(rewards, used, strict=True) if u]),
        "accuracy_without_tool": mean([r for r, u in zip(rewards, used, strict=True) if not u]),
        "tool_error_rate": sum(errors) / sum(calls) if sum(calls) else 0.0,
        "truncated": mean([float(not f) for f in finished]),
        "turns": mean([float(t) for t in turns]),
    }


# --- the warm start ------------------------------------------------------------------------------------


def calc_model_dir(settings: CalcWarmStart = CalcWarmStart()) -> Path:
    key = hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root() / f"tiny-calc-{key}"


def ensure_calc_model(settings: CalcWarmStart = CalcWarmStart(), progress: bool = True) -> Path:
    """The warm-started tiny-calc model's folder, training and caching it on first use (about a minute)."""
    target = calc_model_dir(settings)
    if (target / "warmstart.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        _train_and_save(settings, scratch, progress)
        try:
            os.rename(scratch, target)
        except OSError:  # another process finished first: theirs is as good as ours
            if not (target / "warmstart.json").exists():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _padded(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])  # [N, width]


def _train_and_save(settings: CalcWarmStart, out: Path, progress: bool) -> None:
    from tqdm import tqdm
    from transformers import Qwen2Config, Qwen2ForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        tokenizer = build_tokenizer()
        torch.manual_seed(settings.seed)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=settings.hidden_size,
            intermediate_size=4 * settings.hidden_size,
            num_hidden_layers=settings.layers,
            num_attention_heads=settings.heads,
            num_key_value_heads=settings.kv_heads,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        )
        model = Qwen2ForCausalLM(config)
        rng = random.Random(settings.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=settings.lr, total_steps=settings.steps, pct_start=0.1
        )
        losses = []
        start = time.time()
        model.train()
        for _ in tqdm(range(settings.steps), desc="tiny-calc warm start", disable=not progress, leave=False):
            buckets: dict[bool, list[tuple[list[int], list[int]]]] = {True: [], False: []}
            for _ in range(settings.batch_size):
                task = question(rng.randrange(POOL_SIZE))
                actions = tutor_actions(task, rng, settings.tool_share, settings.direct_accuracy)
                buckets[len(actions) > 1].append(demonstration(tokenizer, task, actions, TINY_CALC_INSTRUCTION))
            # Demos with and without a call go through the model separately, so that short ones are not padded
            # to long ones; the loss is the mean over every action token of the batch either way.
            total = sum(label != -100 for bucket in buckets.values() for _, labels in bucket for label in labels)
            optimizer.zero_grad()
            step_loss = 0.0
            for bucket in buckets.values():
                if not bucket:
                    continue
                ids = _padded([d[0] for d in bucket], tokenizer.pad_token_id)  # [N, W]
                labels = _padded([d[1] for d in bucket], -100)  # [N, W]
                logits = model(input_ids=ids).logits[:, :-1].float()  # [N, W-1, V]
                flat = logits.reshape(-1, logits.shape[-1])  # [N*(W-1), V]
                loss = torch.nn.functional.cross_entropy(flat, labels[:, 1:].reshape(-1), reduction="sum") / total
                loss.backward()
                step_loss += loss.item()
            optimizer.step()
            schedule.step()
            losses.append(step_loss)
        seconds = time.time() - start
        model.eval()
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        split = make_split(480, 120, seed=0)
        measured = measure_agent(model, tokenizer, split.train + split.test, seed=settings.seed)
        record = {
            "settings": asdict(settings),
            **measured,
            "measured_on": "make_split(480, 120, seed=0), train + test, one trajectory each at temperature 1",
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss_first": losses[0],
            "loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
            "seconds": seconds,
        }
        (out / "warmstart.json").write_text(json.dumps(record, indent=2))
    finally:
        torch.set_num_threads(threads)
