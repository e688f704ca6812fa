"""tiny-calc: the CPU preset's agent task — 3- and 4-digit sums and differences, and a calculator to call.

    task         operands 100..9999, ops + and −, each question named by its index (``tiny-calc/<index>``)
    environment  ``CalcEnv`` in the tag format (``<calc>1234+5678</calc>``); ``make_env(task)`` builds it
    model        a tiny Qwen2 (2 heads of 32 sharing 1 KV head, as vLLM's CPU attention needs) warm-started on a
                 tutor who calls the tool on 30% of the questions and otherwise answers at once, often wrongly:
                 RL has a visible job, to call the tool more often
    shipped      the warm start's weights and training record ship beside this file; ``ensure_calc_model()``
                 builds the model folder from them, other settings train (``train_calc_warm_start``)
    measure      ``measure_agent``: accuracy with and without the tool, and the tool-use rate

Deliberately left out: multiplication and division, more than one call per demonstration, several phrasings, and
any claim about real models. Design notes: docs/design/tiny-calc.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sao.core import hashing
from sao.core.errors import DataError
from sao.core.io import cached_folder
from sao.core.machine import on_terminal
from sao.rollout.environment import EnvFactory, render_observation
from sao.rollout.sampler import draw
from sao.tasks.base import Task, TaskSet
from sao.tasks.calc import TAG_CLOSE, TAG_OPEN, CalcEnv, calc_env_factory
from sao.tasks.gsm8k import build_messages
from sao.tiny.arithmetic import build_tokenizer, cache_root

__all__ = [
    "POOL_SIZE",
    "SHIPPED_SHA256",
    "TINY_CALC_INSTRUCTION",
    "CalcWarmStart",
    "build_from_shipped",
    "calc_model_dir",
    "decision_kept",
    "demonstration",
    "demonstration_batch",
    "direct_actions",
    "draw_index",
    "ensure_calc_model",
    "make_env",
    "make_split",
    "measure_agent",
    "question",
    "tool_actions",
    "train_calc_warm_start",
    "tutor_actions",
]

# No instruction: the tiny model learns the tool and the answer form from its demonstrations, and every prompt
# token costs warm-start time (a prompt is ~37 tokens of a ~93-token demonstration with a call).
TINY_CALC_INSTRUCTION = ""
PHRASING = "What is {a}{op}{b}?"  # one phrasing: copying is learned sooner when the expression sits in one place
LOW, HIGH = 100, 9999  # operands: every 3- and 4-digit number
_SPAN = HIGH - LOW + 1
OPS = "+-"
POOL_SIZE = len(OPS) * _SPAN * _SPAN
MAX_SPLIT = 1_000_000  # train + held out at most: a small part of the pool, so drawing without repeats ends fast
SLIPS = (-1000, -100, -10, -1, 1, 10, 100, 1000)


@dataclass(frozen=True)
class CalcWarmStart:
    """Settings of the tiny-calc warm start; every field is part of the cache key."""

    hidden_size: int = 64
    intermediate_size: int = 128  # the work is copying (attention); 256 was slower and, once, learned no better
    layers: int = 2
    # 2 heads of 32 sharing 1 key/value head, as in tiny: vLLM's CPU attention takes head sizes 32..512 only.
    # With 4 heads of 16, 4 KV heads and RoPE base 100 learned copying in fewer steps than 2 KV heads and base
    # 10000; with 2 heads of 32, 1 KV head reached the target at step 650 and 2 KV heads only at step 1175.
    heads: int = 2
    kv_heads: int = 1
    rope_theta: float = 100.0
    batch_size: int = 64
    lr: float = 1.5e-3  # held after a short warmup until the probe reaches the target, then decayed linearly
    warmup_steps: int = 25
    target_success: float = 0.75  # the probe's mean probability of its whole tool trajectory at temperature 1
    check_every: int = 25  # steps between probes
    decay_steps: int = 100  # after the target: lr decays to 0 over these, sharpening what was learned
    max_steps: int = 1200  # a bound on the time if the target is never reached (the record says so)
    probe_size: int = 64
    tool_share: float = 0.3  # how often the tutor decides to call the tool: the model's starting call rate
    shown_tool_share: float = 0.9  # share of demonstrations that show a call (extra ones without the decision)
    direct_accuracy: float = 0.3
    # torch threads while training (at most the CPU count): the preset's 2-core CPU. Two threads take a step in
    # 0.6× the time of one on an idle machine, but several times longer when other jobs hold the cores.
    threads: int = 2
    seed: int = 0
    version: int = 2  # bump when the task, the tokenizer, the environment or the recipe changes (2: 2 heads of 32)


# --- the task ------------------------------------------------------------------------------------------


def question(index: int) -> Task:
    """The question at ``index`` of the fixed order: op, then first operand, then second (``tiny-calc/<index>``)."""
    if not 0 <= index < POOL_SIZE:
        raise IndexError(f"tiny-calc has {POOL_SIZE} questions; no index {index}")
    rest, b = divmod(index, _SPAN)
    op, a = divmod(rest, _SPAN)
    a, b, op_char = a + LOW, b + LOW, OPS[op]
    answer = a + b if op_char == "+" else a - b
    return Task(id=f"tiny-calc/{index}", question=PHRASING.format(a=a, op=op_char, b=b), answer=str(answer))


def draw_index(rng: random.Random) -> int:
    """One question's index, uniform over the pool (so 81% of questions add or subtract two 4-digit numbers)."""
    return rng.randrange(POOL_SIZE)


def _distinct(rng: random.Random, n: int, exclude: set[int]) -> list[int]:
    chosen: set[int] = set()
    while len(chosen) < n:
        index = draw_index(rng)
        if index not in exclude:
            chosen.add(index)
    return sorted(chosen)


def make_split(n_train: int, n_test: int, seed: int = 0) -> TaskSet:
    """``n_test`` held-out questions drawn with ``random.Random(seed)`` and ``n_train`` training questions with
    ``random.Random(seed + 1)`` among the rest (``draw_index``, no repeats): disjoint as strings, since each index
    is a distinct question, and each list in index order."""
    if n_train < 0 or n_test < 0:
        raise DataError(f"prompt counts must be non-negative, got n_train={n_train}, n_test={n_test}")
    if n_train + n_test > MAX_SPLIT:
        raise DataError(f"tiny-calc draws at most {MAX_SPLIT} questions; asked for {n_train} train + {n_test} held out")
    test_ids = _distinct(random.Random(seed), n_test, set())
    train_ids = _distinct(random.Random(seed + 1), n_train, set(test_ids))
    counts = {
        "train_pool": POOL_SIZE - n_test,
        "test_pool": POOL_SIZE,
        "test": n_test,
        "train_contaminated": 0,
        "train_kept": POOL_SIZE - n_test,
        "train": n_train,
    }
    return TaskSet(
        train=[question(i) for i in train_ids],
        test=[question(i) for i in test_ids],
        counts=counts,
        source="generated:tiny-calc",
        instruction=TINY_CALC_INSTRUCTION,
    )


def environment(tokenizer: Any) -> EnvFactory:
    """``--env tiny-calc``: the calculator, in the tokenizer's tool format (the tag format for the tiny one)."""
    return calc_env_factory(tokenizer)


def make_env(task: Task) -> CalcEnv:
    """The task's environment: the calculator in the tag format."""
    return CalcEnv(task.id, {"answer": task.answer, "question": task.question}, tool_format="tag")


def _expression(task: Task) -> str:
    """ "1234+5678" from "What is 1234+5678?"."""
    prefix, suffix = PHRASING.split("{a}{op}{b}")
    if not (task.question.startswith(prefix) and task.question.endswith(suffix)):
        raise ValueError(f"not a tiny-calc question: {task.question!r}")
    return task.question[len(prefix) : len(task.question) - len(suffix)]


def tool_actions(task: Task) -> list[str]:
    """The tutor's actions when it calls the tool: ``["<calc>a+b</calc>", "#### <answer>"]``."""
    return [f"{TAG_OPEN}{_expression(task)}{TAG_CLOSE}", f"#### {task.answer}"]


def direct_actions(task: Task, rng: random.Random, accuracy: float) -> list[str]:
    """The tutor's action when it answers at once: ``["#### <guess>"]``, right with probability ``accuracy``,
    else off by ±1, ±10, ±100 or ±1000."""
    value = int(task.answer)
    if rng.random() >= accuracy:
        value += rng.choice(SLIPS)
    return [f"#### {value}"]


def tutor_actions(task: Task, rng: random.Random, tool_share: float, direct_accuracy: float) -> list[str]:
    """The tutor's actions for one question: it calls the tool with probability ``tool_share``."""
    if rng.random() < tool_share:
        return tool_actions(task)
    return direct_actions(task, rng, direct_accuracy)


def decision_kept(tool_share: float, shown_tool_share: float) -> float:
    """Of the demonstrations that show a call, the share whose first action token (the decision to call) is
    trained, so that the trained decisions call the tool at ``tool_share``: with s = shown_tool_share,
    s·k / (s·k + 1 − s) = tool_share."""
    if not 0 < tool_share <= shown_tool_share < 1:
        raise ValueError(f"need 0 < tool_share <= shown_tool_share < 1, got {tool_share} and {shown_tool_share}")
    return tool_share * (1 - shown_tool_share) / (shown_tool_share * (1 - tool_share))


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


SHIPPED_WEIGHTS = Path(__file__).with_name("tiny_calc_model.safetensors")
SHIPPED_RECORD = Path(__file__).with_name("tiny_calc_warmstart.json")
SHIPPED_SHA256 = "365483679ef14b59d45935bc9e9ed652026a1e7754f01114b64c5b9d7f55846b"


def calc_model_dir(settings: CalcWarmStart = CalcWarmStart()) -> Path:
    key = {**asdict(settings), **({"weights": SHIPPED_SHA256} if settings == CalcWarmStart() else {})}
    return cache_root() / f"tiny-calc-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"


def ensure_calc_model(settings: CalcWarmStart = CalcWarmStart(), progress: bool = True) -> Path:
    """The warm-started tiny-calc model's folder, cached on first use: built from the shipped weights (~1 s)
    with the default settings, trained (~2 min on 2 cores) with any other."""

    def build(scratch: Path) -> None:
        if settings == CalcWarmStart():
            build_from_shipped(scratch)
        else:
            train_calc_warm_start(settings, scratch, progress)

    return cached_folder(calc_model_dir(settings), build, "warmstart.json")


def _padded(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])  # [N, width]


def probe_success(model: Any, probe: list[tuple[list[int], list[int]]], pad_token_id: int) -> float:
    """Mean over the probe's tool demonstrations of the probability, at temperature 1, that the model writes the
    whole trajectory after deciding to call: call, answer and EOS (every trained token but the first). It is what
    ``accuracy_with_tool`` will be, measured without sampling, so the warm start can stop once it is high enough."""
    ids = _padded([d[0] for d in probe], pad_token_id)  # [N, W]
    labels = _padded([d[1] for d in probe], -100)[:, 1:]  # [N, W-1]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)  # [N, W-1, V]
    model.train(was_training)
    trained = labels != -100  # [N, W-1]
    trained[torch.arange(len(probe)), trained.float().argmax(dim=1)] = False  # the decision token
    token = logprobs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)  # [N, W-1]
    return (token * trained).sum(dim=1).exp().mean().item()


def demonstration_batch(
    tokenizer: Any, rng: random.Random, settings: CalcWarmStart
) -> dict[bool, list[tuple[list[int], list[int]]]]:
    """One batch of demonstrations, split by whether they show a call (so that each part is padded only to its
    own length; the loss is still the mean over every trained token of the batch).

    ``shown_tool_share`` of them show a call, since copying digits (question → call, observation → answer) is
    what takes the model longest to learn; the decision to call (the first action token) is trained on only
    ``decision_kept`` of those, so that the trained decisions call at ``tool_share``, the tutor's own rate.
    """
    keep = decision_kept(settings.tool_share, settings.shown_tool_share)
    buckets: dict[bool, list[tuple[list[int], list[int]]]] = {True: [], False: []}
    for _ in range(settings.batch_size):
        task = question(draw_index(rng))
        calls = rng.random() < settings.shown_tool_share
        actions = tool_actions(task) if calls else direct_actions(task, rng, settings.direct_accuracy)
        ids, labels = demonstration(tokenizer, task, actions, TINY_CALC_INSTRUCTION)
        if calls and rng.random() >= keep:
            first = next(i for i, label in enumerate(labels) if label != -100)
            labels[first] = -100  # shown, not decided: this demonstration does not vote on calling
        buckets[calls].append((ids, labels))
    return buckets


def _model(settings: CalcWarmStart, tokenizer: Any):
    """A randomly initialised tiny-calc model of ``settings``' shape (seeded by the caller)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        max_position_embeddings=512,
        rope_theta=settings.rope_theta,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
    )
    return Qwen2ForCausalLM(config)


def _save(model: Any, tokenizer: Any, out: Path) -> None:
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_from_shipped(out: Path) -> dict:
    """Write the default tiny-calc model folder into ``out`` from the shipped tensors, check that its weights
    hash to ``SHIPPED_SHA256``, and copy the record the training wrote to ``warmstart.json``. Nothing here is
    computed in floating point: the same bytes on every machine."""
    from safetensors.torch import load_file

    for shipped in (SHIPPED_WEIGHTS, SHIPPED_RECORD):
        if not shipped.is_file():
            raise DataError(f"{shipped} is missing: reinstall sao (the tiny-calc model ships with it)")
    tokenizer = build_tokenizer()
    model = _model(CalcWarmStart(), tokenizer)
    missing, unexpected = model.load_state_dict(load_file(SHIPPED_WEIGHTS), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the head is tied to the embedding
        raise DataError(
            f"{SHIPPED_WEIGHTS} does not fit the tiny-calc config: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    _save(model, tokenizer, out)
    weights, _ = hashing.weights_sha256(out)
    if weights != SHIPPED_SHA256:
        raise DataError(
            f"the tiny-calc model built from {SHIPPED_WEIGHTS.name} hashes to {weights}, not {SHIPPED_SHA256}"
        )
    record = {**json.loads(SHIPPED_RECORD.read_text()), "weights": SHIPPED_WEIGHTS.name, "weights_sha256": weights}
    (out / "warmstart.json").write_text(json.dumps(record, indent=2))
    return record


def train_calc_warm_start(settings: CalcWarmStart, out: Path, progress: bool = True) -> None:
    """The recipe that made the shipped weights (see docs/design/tiny-calc.md): writes a model folder and
    ``warmstart.json`` into ``out``. To remake the shipped files: run it with the default settings, copy
    ``out/model.safetensors`` over ``SHIPPED_WEIGHTS`` and ``out/warmstart.json`` over ``SHIPPED_RECORD``, and set
    ``SHIPPED_SHA256`` to ``hashing.weights_sha256(out)``."""
    from tqdm import tqdm

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(settings.threads, os.cpu_count() or 1)))
    try:
        tokenizer = build_tokenizer()
        torch.manual_seed(settings.seed)
        model = _model(settings, tokenizer)
        rng = random.Random(settings.seed)
        probe_rng = random.Random(settings.seed + 10_000)
        probe = []
        for _ in range(settings.probe_size):
            task = question(draw_index(probe_rng))
            probe.append(demonstration(tokenizer, task, tool_actions(task), TINY_CALC_INSTRUCTION))
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
        losses, probes = [], []
        reached = None  # the step at which the probe first reached the target
        start, cpu_start = time.time(), time.process_time()
        model.train()
        bar = tqdm(
            total=settings.max_steps, desc="tiny-calc warm start", disable=not (progress and on_terminal()), leave=False
        )
        for step in range(settings.max_steps):
            if reached is not None and step >= reached + settings.decay_steps:
                break
            if step < settings.warmup_steps:
                factor = (step + 1) / settings.warmup_steps
            elif reached is None:
                factor = 1.0
            else:
                factor = (reached + settings.decay_steps - step) / settings.decay_steps
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * factor
            buckets = demonstration_batch(tokenizer, rng, settings)
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
            losses.append(step_loss)
            bar.update()
            if reached is None and (step + 1) % settings.check_every == 0:
                probes.append(round(probe_success(model, probe, tokenizer.pad_token_id), 4))
                if probes[-1] >= settings.target_success:
                    reached = step + 1
        bar.close()
        seconds, cpu_seconds = time.time() - start, time.process_time() - cpu_start
        _save(model, tokenizer, out)
        split = make_split(480, 120, seed=0)
        measured = measure_agent(
            model, tokenizer, split.train + split.test, seed=settings.seed, instruction=TINY_CALC_INSTRUCTION
        )
        record = {
            "settings": asdict(settings),
            **measured,
            "measured_on": "make_split(480, 120, seed=0), train + test, one trajectory each at temperature 1",
            "parameters": sum(p.numel() for p in model.parameters()),
            "steps": len(losses),
            "target_reached_at": reached,
            "probe_every_check": probes,
            "probe_final": round(probe_success(model, probe, tokenizer.pad_token_id), 4),
            "loss_first": losses[0],
            "loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
            "loss_by_100_steps": [
                round(sum(losses[i : i + 100]) / len(losses[i : i + 100]), 4) for i in range(0, len(losses), 100)
            ],
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
        }
        (out / "warmstart.json").write_text(json.dumps(record, indent=2))
    finally:
        torch.set_num_threads(threads)
