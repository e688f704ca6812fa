"""The embedded default: a tiny Qwen2-shaped model, a tokenizer built here, and a task generated here.

Everything a run needs without a GPU or a network: 600 single-digit questions ("What is 7+5?") graded by
``sao.tasks.gsm8k.grading``; a byte-level ChatML tokenizer of Qwen's family, so the product's prompt and loading
code run unchanged; a 2-layer, width-64 ``Qwen2ForCausalLM`` (~0.14M parameters; 2 heads of 32 sharing 1 KV
head, a head size vLLM's CPU attention takes), warm-started on a careless
tutor who is right half the time, so RL has a real job. The warm start's weights ship beside this file
(``tiny_model.safetensors``, checked against ``SHIPPED_SHA256``) because training them gives other bits on other
CPUs; ``ensure_model`` builds the model folder from them, and ``train_warm_start`` is the recipe that made them.

Deliberately left out: retraining the warm start on every machine, and anything that would make the toy look like
GSM8K. Design notes: docs/design/tiny-arithmetic.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sao.core import hashing
from sao.core.errors import DataError
from sao.core.io import cached_folder
from sao.core.machine import on_terminal
from sao.rollout.sampler import decode, draw, encode_prompts
from sao.tasks.base import Task, TaskSet
from sao.tasks.gsm8k import format_prompt, grading

TINY_INSTRUCTION = "End with #### N."
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PHRASINGS = ("What is {a}{op}{b}?", "Compute {a}{op}{b}.", "{a}{op}{b}=?")
SHIPPED_WEIGHTS = Path(__file__).with_name("tiny_model.safetensors")
# hashing.weights_sha256 of the shipped tensors: a model folder built anywhere must hash to this.
SHIPPED_SHA256 = "bedd40e6bba2d8946c2fdc595ffab06d3fb79dbf555010b2c192e630267e7d9f"


@dataclass(frozen=True)
class WarmStart:
    """Settings of the supervised warm start; every field is part of the cache key."""

    hidden_size: int = 64
    layers: int = 2
    heads: int = 2  # head size 32: the smallest vLLM's CPU attention takes
    kv_heads: int = 1
    steps: int = 700
    batch_size: int = 64
    lr: float = 3e-3
    tutor_accuracy: float = 0.5
    seed: int = 0
    version: int = 5  # bump when the task, the tokenizer or the recipe changes (4: shipped weights; 5: 2 heads of 32)


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes (GPT-2's table), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per byte) plus ChatML's special tokens.

    It is the same family as Qwen's tokenizer, so ``AutoTokenizer`` reloads it as ``Qwen2Tokenizer``
    from the saved folder and tokenizes exactly as it did in memory (a test checks the round trip).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for symbol in _byte_alphabet():
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def all_questions() -> list[Task]:
    """Every question of the task, in a fixed order: 3 phrasings × 2 ops × 10 × 10 operands."""
    tasks = []
    for phrasing in PHRASINGS:
        for op in "+-":
            for a in range(10):
                for b in range(10):
                    answer = a + b if op == "+" else a - b
                    question = phrasing.format(a=a, op=op, b=b)
                    tasks.append(Task(id=f"tiny/{len(tasks)}", question=question, answer=str(answer)))
    return tasks


def problem(index: int) -> tuple[int, str, int]:
    """The (a, op, b) that question ``tiny/<index>`` of ``all_questions`` asks, whichever its phrasing."""
    rest, b = divmod(index % 200, 10)
    op, a = divmod(rest, 10)
    return a, "+-"[op], b


# The version of ``make_split``'s draw, in the task set's source: 1 held questions out as strings (117 of 120
# held-out questions shared their (a, op, b) with a training prompt in another phrasing); 2 holds problems out.
SPLIT_VERSION = 2


def make_split(n_train: int, n_test: int, seed: int = 0) -> TaskSet:
    """Held-out questions and training prompts, disjoint as problems (a, op, b), not only as strings: the held-out
    problems are drawn with ``random.Random(seed)``, each taking its phrasings in a seeded order until ``n_test``
    questions are held out; the training prompts are drawn with ``random.Random(seed + 1)`` among the questions of
    the other problems (a phrasing of a held-out problem that is not itself held out counts as contaminated).
    With the preset's 480 + 120, 40 problems are held out in all 3 phrasings and the other 160 train."""
    pool = all_questions()
    problems = sorted({problem(i) for i in range(len(pool))})  # 200 (a, op, b)
    if n_train < 0 or n_test < 0:
        raise DataError(f"prompt counts must be non-negative, got n_train={n_train}, n_test={n_test}")
    rng = random.Random(seed)
    order = list(range(len(problems)))
    rng.shuffle(order)
    by_problem: dict[tuple[int, str, int], list[int]] = {}
    for i in range(len(pool)):
        by_problem.setdefault(problem(i), []).append(i)
    test_ids: list[int] = []
    held: set[tuple[int, str, int]] = set()
    for k in order:
        if len(test_ids) >= n_test:
            break
        phrasings = list(by_problem[problems[k]])
        rng.shuffle(phrasings)
        test_ids += phrasings[: n_test - len(test_ids)]
        held.add(problems[k])
    held_out = set(test_ids)
    rest = [pool[i] for i in range(len(pool)) if i not in held_out]
    kept = [t for t in rest if problem(int(t.id.split("/")[1])) not in held]
    if len(test_ids) < n_test or n_train > len(kept):
        raise DataError(
            f"the tiny task has {len(problems)} problems in {len(pool)} questions; {n_test} held out leave "
            f"{len(kept)} questions of other problems, and {n_train} train were asked for"
        )
    test = [pool[i] for i in sorted(test_ids)]
    train = sorted(random.Random(seed + 1).sample(kept, n_train), key=lambda t: int(t.id.split("/")[1]))
    counts = {
        "train_pool": len(rest),
        "test_pool": len(pool),
        "test": n_test,
        "train_contaminated": len(rest) - len(kept),
        "train_kept": len(kept),
        "train": n_train,
    }
    return TaskSet(
        train=train,
        test=test,
        counts=counts,
        source=f"generated:tiny-arithmetic/split-v{SPLIT_VERSION}",
        instruction=TINY_INSTRUCTION,
    )


def tutor_reply(task: Task, rng: random.Random, accuracy: float) -> str:
    """The careless tutor's worked answer: right with probability ``accuracy``, else a slip."""
    value = int(task.answer)
    if rng.random() >= accuracy:
        value += rng.choice([-10, -2, -1, 1, 2, 10])
    expression = task.question
    for prefix, suffix in (("What is ", "?"), ("Compute ", "."), ("", "=?")):
        if expression.startswith(prefix) and expression.endswith(suffix):
            expression = expression[len(prefix) : len(expression) - len(suffix)]
            break
    return f"{expression}={value}\n#### {value}"


@torch.no_grad()
def sampled_accuracy(model, tokenizer, tasks: list[Task], seed: int, temperature: float = 1.0) -> float:
    """Share of the questions answered right, one sample each at ``temperature`` (the RL start point)."""
    prompts = [format_prompt(tokenizer, t.question, TINY_INSTRUCTION) for t in tasks]
    ids, mask = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    rollout = draw(
        model,
        ids,
        mask,
        max_new_tokens=24,
        temperature=temperature,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
    )
    texts = decode(tokenizer, rollout)
    return sum(grading.reward(x, t.answer) for x, t in zip(texts, tasks, strict=True)) / len(tasks)


def cache_root() -> Path:
    """``$SAO_CACHE`` if set, else ``~/.cache/sao``."""
    return Path(os.environ.get("SAO_CACHE") or Path.home() / ".cache" / "sao")


def warm_start_dir(settings: WarmStart = WarmStart()) -> Path:
    key = {**asdict(settings), "weights": SHIPPED_SHA256}
    return cache_root() / f"tiny-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}"


def ensure_model(settings: WarmStart = WarmStart(), progress: bool = True) -> Path:
    """The warm-started tiny model's directory, built from the shipped weights and cached on first use (~1 s).
    ``progress`` is kept for callers; the build has nothing slow to show."""
    return cached_folder(
        warm_start_dir(settings), lambda scratch: build_from_shipped(settings, scratch), "warmstart.json"
    )


def _model_config(settings: WarmStart, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=4 * settings.hidden_size,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
    )


def build_from_shipped(settings: WarmStart, out: Path) -> dict:
    """Write the tiny model folder into ``out``: the tokenizer built here, the config from ``settings``, the
    shipped warm-start tensors; checks that the saved weights hash to ``SHIPPED_SHA256``. Returns the record
    it writes to ``warmstart.json``. The same bytes on every machine: nothing here is computed in floating point
    but the sampled accuracy it records."""
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    if settings != WarmStart():
        raise DataError(f"the shipped tiny model was made with {WarmStart()}; other settings need train_warm_start")
    if not SHIPPED_WEIGHTS.is_file():
        raise DataError(f"{SHIPPED_WEIGHTS} is missing: reinstall sao (the tiny model's weights ship with it)")
    tokenizer = build_tokenizer()
    model = Qwen2ForCausalLM(_model_config(settings, tokenizer))
    state = load_file(SHIPPED_WEIGHTS)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the head is tied to the embedding
        raise DataError(f"{SHIPPED_WEIGHTS} does not fit the tiny config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights, _ = hashing.weights_sha256(out)
    if weights != SHIPPED_SHA256:
        raise DataError(f"the tiny model built from {SHIPPED_WEIGHTS.name} hashes to {weights}, not {SHIPPED_SHA256}")
    record = {
        "settings": asdict(settings),
        "weights": SHIPPED_WEIGHTS.name,
        "weights_sha256": weights,
        "sampled_accuracy": sampled_accuracy(model, tokenizer, all_questions(), settings.seed),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "warmstart.json").write_text(json.dumps(record, indent=2))
    return record


def train_warm_start(settings: WarmStart, out: Path, progress: bool = True) -> None:
    """The recipe that made the shipped weights: the careless tutor's demonstrations, AdamW with a one-cycle
    schedule, ``settings.steps`` steps; writes a model folder (and ``warmstart.json``) into ``out``. Its tensors
    depend on this CPU's floating point, which is why sao ships one result instead of running this everywhere.
    To remake the shipped file: run it, copy ``out/model.safetensors`` over ``SHIPPED_WEIGHTS`` and set
    ``SHIPPED_SHA256`` to ``hashing.weights_sha256(out)``."""
    from tqdm import tqdm
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(settings.seed)
    model = Qwen2ForCausalLM(_model_config(settings, tokenizer))
    tasks = all_questions()
    rng = random.Random(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=settings.lr, total_steps=settings.steps, pct_start=0.1
    )
    prompts = {t.id: tokenizer(format_prompt(tokenizer, t.question, TINY_INSTRUCTION))["input_ids"] for t in tasks}
    losses = []
    start = time.time()
    model.train()
    for _ in tqdm(range(settings.steps), desc="tiny warm start", disable=not (progress and on_terminal()), leave=False):
        rows, labels = [], []
        for task in rng.choices(tasks, k=settings.batch_size):
            p = prompts[task.id]
            r = tokenizer(tutor_reply(task, rng, settings.tutor_accuracy))["input_ids"] + [tokenizer.eos_token_id]
            rows.append(p + r)
            labels.append([-100] * len(p) + r)
        width = max(map(len, rows))
        ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
        target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        loss = model(input_ids=ids, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {
        "settings": asdict(settings),
        "sampled_accuracy": sampled_accuracy(model, tokenizer, tasks, settings.seed),
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss_first": losses[0],
        "loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
        "seconds": time.time() - start,
    }
    (out / "warmstart.json").write_text(json.dumps(record, indent=2))
