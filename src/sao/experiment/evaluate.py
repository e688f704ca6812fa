"""pass@1 on held-out tasks: k samples per task at a fixed temperature, all drawn together, graded by program.

    per-task score   s_j = (1/k) Σ_i correct(sample_i of task j)        the unit ``stats.compare`` pairs
    pass@1           mean_j s_j
    cut-off replies  the scorer's rule (``Scorer.cut_off``): a reply that hit the token limit without finishing
                     scores 0 ("zero", the default; "grade": graded like any other), counted in
                     ``truncated_replies`` and ``truncated_with_credit`` (those the grader would have credited)
    pass_at_1        the protocol's eval of a model with a run's parts (``sao.tasks.setup.TaskParts``)

Every sample of every task goes into one decode batch (``eval_batch`` sequences at a time: 480 = 120 tasks
× 4 samples at once on a GPU), drawn with the same sampler as training (``sampler.draw``) at the eval
temperature, from a generator seeded by the caller. The same seed gives the same samples, so an eval that
was interrupted is simply run again.

Deliberately left out: greedy decoding, pass@k for k > 1, majority voting, LLM judges.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from sao.core.errors import ConfigError
from sao.core.machine import on_terminal
from sao.model.memory import with_oom_retry
from sao.model.policy import POLICY_ADAPTER
from sao.rollout.episodes import render_segments, segments
from sao.rollout.sampler import derived_seed
from sao.rollout.sources import Episodes, draw_batch, draw_episode_batch, make_decoder
from sao.rollout.types import Decoder, Sampling
from sao.tasks import gsm8k
from sao.tasks.base import Scorer, Task
from sao.tasks.environments import prompt_text
from sao.tasks.setup import TaskParts


@dataclass
class EvalResult:
    """One eval of one model. ``per_task`` is aligned with ``task_ids``."""

    label: str
    pass_at_1: float
    per_task: list[float]
    task_ids: list[str]
    samples: int
    temperature: float
    seed: int
    mean_reply_chars: float
    mean_reply_tokens: float
    truncation_share: float
    seconds: float
    examples: list[dict[str, Any]]  # a few (question, reply, gold, correct; an episode also its spans) to show
    batch: int = 0  # sequences decoded together (after any out-of-memory halving)
    oom_retries: int = 0
    truncated_reward: str = "grade"  # how cut-off replies were scored ("grade": what evals before the option did)
    truncated_replies: int = 0  # samples that hit the token limit without finishing
    truncated_with_credit: int = 0  # of those, how many the grader credits (> 0); with "zero" they scored 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        return cls(**d)


@torch.no_grad()
def evaluate(
    decoder: Decoder,
    tokenizer: Any,
    tasks: list[Task],
    *,
    instruction: str,
    samples: int = 4,
    temperature: float = 0.7,
    max_new_tokens: int = 256,
    batch: int = 480,
    seed: int = 0,
    eos_token_ids: list[int] | None = None,
    label: str = "model",
    progress: bool = False,
    episodes: Episodes | None = None,
    scorer: Scorer | None = None,
) -> EvalResult:
    """pass@1 of what ``decoder`` draws (the plain loop over a model, or a ``sao.rollout.engine.Engine``) over
    ``tasks``, ``samples`` draws each. A sample's score is the task's ``scorer`` on the reply (default: the GSM8K
    grader, a cut-off reply scoring 0); with ``episodes`` each sample is a multi-turn episode and its score the
    environment's total reward.

    Out of memory: the eval restarts with half the batch (its samples then differ from a full-batch eval
    of the same seed, because each batch has its own generator); ``oom_retries`` says how often.
    """
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    scorer = scorer or Scorer(gsm8k.reward)
    start = time.perf_counter()

    def attempt(rows: int) -> EvalResult:  # out of memory: the eval restarts with half the batch
        return _evaluate_once(
            decoder,
            tokenizer,
            tasks,
            instruction,
            samples,
            temperature,
            max_new_tokens,
            rows,
            seed,
            eos_token_ids,
            label,
            progress,
            episodes,
            scorer,
        )

    result, batch, retries = with_oom_retry(attempt, batch, lambda rows: None)
    result.seconds = time.perf_counter() - start
    result.batch, result.oom_retries = batch, retries
    return result


def _evaluate_once(
    decoder,
    tokenizer,
    tasks,
    instruction,
    samples,
    temperature,
    max_new_tokens,
    batch,
    seed,
    eos_token_ids,
    label,
    progress,
    episodes,
    scorer,
) -> EvalResult:
    from tqdm import tqdm

    sampling = Sampling(max_new_tokens, temperature, eos_token_ids or [tokenizer.eos_token_id], tokenizer.pad_token_id)
    prompts = [prompt_text(tokenizer, t, instruction) for t in tasks]
    rows = [(j, i, prompts[j]) for j in range(len(tasks)) for i in range(samples)]  # task-major
    correct = torch.zeros(len(tasks), dtype=torch.float64)
    chars = tokens = truncated = 0.0
    cut_off = cut_off_credited = 0
    examples: list[dict[str, Any]] = []
    chunks = range(0, len(rows), batch)
    bar = progress and on_terminal()  # a bar redraws with \r: only on a terminal, never into a log file
    for c, first in enumerate(tqdm(chunks, desc=f"eval {label}", disable=not bar, leave=False)):
        chunk = rows[first : first + batch]
        generator = torch.Generator(device=decoder.device).manual_seed(derived_seed(seed, c))
        if episodes is not None:
            ids = [tasks[j].id for j, _, _ in chunk]
            rollout = draw_episode_batch(decoder, tokenizer, ids, episodes, sampling, generator)
            scores = rollout.turns.total.tolist()
        else:
            rollout = draw_batch(decoder, tokenizer, [p for _, _, p in chunk], sampling, generator)
            graded = scorer.score(rollout.texts, [tasks[j].row() for j, _, _ in chunk])
            scores, counts = scorer.cut_off(graded, rollout.cut.tolist())  # a reply cut at the limit: the rule
            cut_off += counts["truncated_replies"]
            cut_off_credited += counts["truncated_with_credit"]
        texts = rollout.texts
        every = max(1, len(tasks) // 6)
        for row, ((j, i, _), text, ok) in enumerate(zip(chunk, texts, scores, strict=True)):
            correct[j] += ok
            chars += len(text)
            if i == 0 and j % every == 0 and len(examples) < 6:
                example = {"question": tasks[j].question, "reply": text, "gold": tasks[j].answer, "correct": ok}
                if episodes is not None:  # the trajectory with its action and observation spans marked
                    spans = segments(tokenizer, rollout, row)
                    example.update(reply=render_segments(spans), spans=spans)
                examples.append(example)
        tokens += float(rollout.lengths.sum())
        truncated += float(rollout.truncated.sum())
    per_task = (correct / samples).tolist()
    n = len(rows)
    return EvalResult(
        label=label,
        pass_at_1=float(sum(per_task) / len(per_task)),
        per_task=per_task,
        task_ids=[t.id for t in tasks],
        samples=samples,
        temperature=temperature,
        seed=seed,
        mean_reply_chars=chars / n,
        mean_reply_tokens=tokens / n,
        truncation_share=truncated / n,
        seconds=0.0,
        examples=examples,
        truncated_reward=scorer.truncated_reward,
        truncated_replies=int(cut_off),
        truncated_with_credit=int(cut_off_credited),
    )


def pass_at_1(
    model, tokenizer, tasks: list[Task], label: str, *, seed: int, parts: TaskParts, progress: bool = False
) -> EvalResult:
    """The protocol's eval of ``model`` (its policy adapter, if it has one) on ``tasks`` with the run's eval settings
    and its parts (``setup.parts``: the scorer, and the environment with its settings): the task's reward on one
    reply per sample, or the environment's total reward on one episode per sample."""
    adapter = POLICY_ADAPTER if hasattr(model, "peft_config") else None
    e, sampling = parts.config.eval, parts.sampling(eval=True)
    return evaluate(
        make_decoder(model, adapter, parts.config.rollout.decoder),
        tokenizer,
        tasks,
        instruction=parts.tasks.instruction,
        samples=e.eval_samples,
        temperature=sampling.temperature,
        max_new_tokens=sampling.max_new_tokens,
        batch=e.eval_batch,
        seed=seed,
        eos_token_ids=sampling.eos_token_ids,
        label=label,
        progress=progress,
        episodes=parts.episodes_for(tasks),
        scorer=parts.scorer,
    )


def load_adapter(model: torch.nn.Module, adapter_dir: str | os.PathLike[str]) -> torch.nn.Module:
    """Wrap a base model with a saved PEFT adapter (from ``sao train``'s ``adapter/`` folder)."""
    from peft import PeftModel

    path = Path(adapter_dir)
    if not (path / "adapter_config.json").exists():
        raise ConfigError(f"--adapter {path} holds no adapter_config.json; point it at a run's adapter/ folder")
    wrapped = PeftModel.from_pretrained(model, path)
    wrapped.eval()
    return wrapped
