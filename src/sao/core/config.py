"""Every setting of a run, in sections, with the published protocol as the default; ``Config.load`` makes one.

    model      the base model, its LoRA adapter, the device       training   steps, batch, optimiser, logging
    data       the tasks, their reward, the environment           eval       pass@1 settings and the experiment
    algorithm  SAO's own fields (``sao.algorithm.SAO``)            serve      the OpenAI-compatible endpoint
    rollout    what every source reads; ``--rollout NAME`` picks a source, whose own section (``config.source``)
               is registered beside it (``sao.rollout.registry``)

``Config.load()`` is the recipe page's round 1; ``Config.load("tiny")`` the CPU stand-in. Every field documents itself
and states its check where it is declared (``option``). A setting's flat name (``--batch-size``, ``batch_size`` in a
settings file) is its field's name; a section's name sets its principal field (``--model`` the model's name,
``--data`` the dataset, ``--rollout`` the source). ``Config.load`` reads flat or sectioned settings, a preset, a
settings file, and the config.json files older sao versions wrote (their settings under today's names).

Deliberately left out: merging the command line (the CLI: preset < file < flags) and validating a sweep grid.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sao.core.errors import ConfigError
from sao.core.reading import Limits, parse_json, parse_yaml
from sao.core.registry import BASELINES, CORRECTIONS, PRESETS, Registry
from sao.core.settings import (
    Section,
    SourceSection,
    all_of,
    at_least,
    between,
    convert,
    flag_of,
    help_of,
    non_negative,
    not_blank,
    one_of,
    option,
    positive,
    share,
)

MAX_LR = 1.0  # the largest --lr and --critic-lr accepted
SEED_LIMIT = 2**63  # seeds are below it
MAX_THREADS = 1024
MAX_LORA_RANK = 1024  # beyond any layer's width: the adapter would not even be allocated
MAX_PORT = 65535
MAX_TIMEOUT = 86_400.0  # a plug-in call's timeout at most: a day
MAX_TRAIN_RUNS = 10_000  # seeds per arm: far beyond any experiment, small enough to hold as a list
CONFIG_LIMITS = Limits(max_bytes=1 << 20, max_nodes=100_000)  # a settings file: 1 MiB, 100k values at most
# The rollout layer's registry of sources, resolved on first use: core offers the seam (``SourceSection``), the
# layer above fills it, as every registry entry names its implementation by import path.
SOURCES_AT = "sao.rollout.registry"


def sources() -> Registry:
    """The registry of rollout sources (``sao.rollout.registry.SOURCES``): name → its settings section."""
    return importlib.import_module(SOURCES_AT).SOURCES


def _band(value: tuple[float, float]) -> str | None:
    lo, hi = value
    ok = math.isfinite(lo) and math.isfinite(hi) and 0.0 <= lo < 1.0 < hi
    return None if ok else "must bracket 1: need 0 <= lo < 1 < hi"


def _in_registry(registry: Registry | Any) -> Any:
    def check(name: str) -> str | None:
        known = registry() if callable(registry) else registry
        if name in known:
            return None
        close = difflib.get_close_matches(name, known.names(), n=1)
        return f"must be a {known.kind}: one of {', '.join(known.names())}" + (
            f" (did you mean {close[0]!r}?)" if close else ""
        )

    return check


def _shares(value: float | tuple[float, ...] | None) -> str | None:
    if value is None or isinstance(value, float | int):
        return None if value is None else share(value)
    return next((f"entry {i}: {problem}" for i, p in enumerate(value) if (problem := share(p))), None)


def _seed(value: int) -> str | None:
    return None if 0 <= value < SEED_LIMIT else "must be a whole number from 0 to 2**63 - 1"


# --- the sections ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSettings(Section):
    name: str = option(
        "Qwen/Qwen2.5-1.5B-Instruct",
        'Hub id or local directory of the base causal LM; "tiny" builds the CPU stand-in. The page\'s base.',
        flag="model",
        check=not_blank,
    )
    lora_rank: int = option(16, "LoRA rank. The page's 16.", check=between(1, MAX_LORA_RANK))
    lora_alpha: int = option(
        32, "LoRA alpha (the adapter is scaled by alpha / rank). The page's 32.", check=at_least(1)
    )
    device: str = option(
        "auto", '"auto" picks CUDA when available, else the CPU; "cpu", "cuda", "cuda:N" or "mps" must exist here.'
    )
    threads: int = option(
        0,
        "torch's CPU threads in this process. 0 = automatic: 1 for the tiny stand-in model on the CPU (its small "
        "operations gain nothing from more, and lost 13x with two when other processes kept 2 cores busy), torch's "
        "default otherwise. A set OMP_NUM_THREADS replaces the automatic choice (torch's default follows it).",
        check=between(0, MAX_THREADS, " (0 = automatic)"),
    )
    grad_checkpoint: bool = option(
        False,
        "Recompute each decoder layer's activations in the backward instead of storing them: ~1/3 more compute for a "
        "fraction of the memory, so larger micro-batches fit (the bench measures both).",
    )
    logprob_chunk: int = option(1024, "Rows per full-vocabulary log-softmax chunk (memory only).", check=at_least(1))
    finetune: str = option(
        "lora",
        'What the policy trains: "lora" (a LoRA adapter on the frozen base, the page\'s) or "full" (every weight, '
        "the paper's regime; --preset paper sets the paper's lr 1e-6). With \"full\" the stale sampler is a frozen "
        "copy of the whole model (one more copy of the weights), the run leaves OUT/model/ (a Hugging Face folder) "
        "instead of OUT/adapter/, and the weights are kept in float32 (bf16 compute under --shard fsdp on a GPU).",
        check=one_of("lora", "full"),
    )
    critic: str = option(
        "head",
        "The critic: \"head\" (the page's override: one linear layer on the policy trunk's detached last hidden state) "
        "or \"model\" (the paper's: a value model of its own, the policy's base or --critic-model, its trunk trained "
        "by the critic loss with its own LoRA or full weights as --finetune says, a zero-initialised linear head, its "
        'own AdamW at --critic-lr; the same warmup and --critic-steps). "model" costs one more forward per step '
        "and --critic-steps forward+backward passes of the value model.",
        check=one_of("head", "model"),
    )
    critic_model: str | None = option(
        None,
        "--critic model: the value model's base (hub id or folder); None: the policy's base. It reads the policy's "
        "tokens, so its tokenizer must be the policy's (another vocabulary is refused at start).",
        check=not_blank,
    )


@dataclass(frozen=True)
class DataSettings(Section):
    dataset: str | None = option(
        None,
        "The tasks: None for GSM8K from the hub (openai/gsm8k), a directory with train.jsonl and test.jsonl, a .jsonl "
        'or .parquet file, a hub dataset name, or a generated task set ("tiny", "tiny-calc").',
        flag="data",
    )
    train_prompts: int = option(
        512, "Training prompts drawn from the train split after decontamination. The page's 512.", check=at_least(1)
    )
    test_prompts: int = option(
        120, "Held-out tasks drawn from the test split for eval. The page's 120.", check=at_least(1)
    )
    data_seed: int = option(
        0, "Seed of the held-out and training draws; fixed so that every run scores the same tasks.", check=_seed
    )
    prompt_field: str | None = option(
        None,
        'With --data FILE or a hub dataset: the field holding the prompt text (default "question"); a dotted path '
        "(extra_info.question) reads a nested object.",
    )
    answer_field: str | None = option(
        None,
        'With --data FILE or a hub dataset: the field holding the gold answer (default "answer"); a dotted path '
        "(reward_model.ground_truth, verl's layout) reads a nested object.",
    )
    messages_field: str | None = option(
        None,
        "With --data: a field holding the prompt as chat messages instead of --prompt-field (verl's and SkyRL's "
        '"prompt"); a dotted path reads a nested object.',
    )
    reward: str | None = option(
        None,
        'Your reward, "module:function" called as function(completion, row) -> float, row a dict of the task\'s '
        "fields; default: the task's own (GSM8K's grader: exact numeric match of the final answer).",
    )
    env: str | None = option(
        None,
        "The environment each trajectory talks to: None = one reply graded by the task's reward (the page's "
        'protocol); "gsm8k" (the same, as an environment), "gsm8k-calc" (a calculator tool), "tiny-calc" (the CPU '
        'preset\'s calculator task), "skyrl:<id>" (a SkyRL-Gym environment, e.g. skyrl:gsm8k_multi_turn), or '
        '"module:Class" (your own, built as Class(task_id, fields)).',
    )
    reward_timeout: float = option(
        300.0,
        "Seconds one call of the reward may take (a batched reward: the whole batch); a call still running then "
        "ends its trajectories as cut, scored 0 and counted (reward_timeouts in the step log). 0 = no limit. A "
        "reward that raises or calls sys.exit is a one-line error naming it and the row.",
        check=between(0, MAX_TIMEOUT, " seconds (0 = no limit)"),
    )
    reward_concurrency: int = option(
        16,
        "Calls of a per-completion reward in flight at once (a pool of threads, as environment steps have): a batch's "
        "replies are scored together, so a reward that waits on a judge or a sandbox costs its slowest call per "
        "batch, and one that hangs costs --reward-timeout once per batch, not once per reply. 1 = one after "
        "another (for a reward that is not safe to call from several threads at once).",
        check=at_least(1),
    )
    env_timeout: float = option(
        300.0,
        "Seconds one call of an environment (building it, init, step, close) may run; past it the trajectory ends "
        "as truncated and the batch goes on (a plain call's thread is abandoned, an async one cancelled), counted in "
        "env_timeouts and env_fault_share in the step log. A call that raises or calls sys.exit, or answers what sao "
        "cannot use (a reward against the reward rule, an observation too long for the room left), ends its "
        "trajectory the same way, counted in env_fault_share, with one log line naming the environment and the "
        "task. 0 = no limit. Default 300 s: a hung tool costs one trajectory, never the run, while any honest tool "
        "call fits.",
        check=between(0, MAX_TIMEOUT, " seconds (0 = no limit)"),
    )
    truncated_reward: str = option(
        "zero",
        'How a reply that hit the token limit without finishing is scored, in training and eval: "zero" (it scores 0)'
        ' or "grade" (graded like any reply: the grader may find an answer in the cut-off text, e.g. "... = 18" scored'
        " right against 18). Our choice, not the page's: the recipe page does not say how to score cut-off replies. "
        "Each step and eval logs truncated_replies and truncated_with_credit (those the grader would credit). "
        "Environments score their own episodes and are not affected.",
        check=one_of("zero", "grade"),
    )


@dataclass(frozen=True)
class AlgorithmSettings(Section):
    """SAO's own fields: ``sao.algorithm.SAO`` is these settings with the update."""

    ratio: tuple[float, float] = option(
        (0.7, 6.0),
        "IS band (lo, hi) of the ratio; must bracket 1. The page's; the paper's coding band is (0.2, 4.0).",
        check=_band,
        aliases=("band",),
    )
    gae_alpha: float = option(1.5, "λ_i = 1 − 1/(α L_i). SAO's α (VAPO used 0.05).", check=positive)
    gae_lambda: float | None = option(
        None,
        "None: each trajectory's λ_i = max(0, 1 − 1/(α L_i)) (the recipe's length-adaptive GAE). A number in [0, 1]: "
        "that λ for every trajectory, whatever its length. 1 is no bootstrapping: with γ = 1 every action token's "
        "advantage is its return-to-go minus V(s_t), so the critic is only a baseline and its errors at later tokens "
        "never enter an earlier token's advantage (the ablation of λ(L)).",
        check=lambda v: None if v is None or (math.isfinite(v) and 0.0 <= v <= 1.0) else "must be in [0, 1] (or None)",
    )
    correction: str = option(
        "dis",
        'Correction rule f(ratio): "dis" (the recipe: mask outside the band), "none" (the baseline: the plain ratio), '
        '"tis" (truncated at --tis-cap), "seqmask" (a whole trajectory masked), "random" (a control: drop each token '
        "with probability --random-mask-share whatever its ratio). An experiment's arms are named by their rule.",
        check=_in_registry(CORRECTIONS),
        aliases=("arm",),
    )
    tis_cap: float = option(
        2.0, 'Cap C for the "tis" rule only.', check=lambda c: None if math.isfinite(c) and c >= 1 else "must be >= 1"
    )
    random_mask_share: float | tuple[float, ...] | None = option(
        None,
        'The "random" rule only: the probability that each action token is dropped, one number or one per '
        'staleness level 0, 1, 2, ... (levels past the list\'s end take its last entry). None: the share the "dis" '
        "arm masked at each staleness level (its mean over the policy steps at that level) in the same cell and "
        "seed of the experiment, so that the two arms drop as much at every level and differ in which tokens; "
        "`sao train --correction random` needs a value. Which tokens are dropped is a hash of (seed, step, row, "
        "position), never of a float.",
        check=lambda p: _shares(p),
    )
    baseline: str = option(
        "critic",
        'What the advantages are taken against: "critic" (the value head V(s_t), the method), "batch-mean" (each '
        "trajectory's return against the mean return of the other trajectories in its batch, one constant per "
        'trajectory: what the critic buys over the cheapest baseline a single rollout allows), "oracle" (each '
        "prompt's success rate under the sampler, from --oracle-samples fresh rollouts of it drawn beside the batch "
        "and never trained on: the positive control, the best a prompt-level baseline can do; local source only; "
        'it costs those rollouts every step), or "none" (V = 0). The critic trains in every case; only the '
        "advantages change.",
        check=_in_registry(BASELINES),
    )
    oracle_samples: int = option(
        8,
        'Fresh rollouts per prompt behind each oracle rate: the "oracle" baseline\'s (every step, for every prompt '
        "of the batch) and the oracle ceiling's (--ceiling-every). The baseline shrinks each prompt's rate toward "
        "the mean of all of them by the empirical-Bayes weight (between-prompt variance against the K-sample noise), "
        "so that a few samples never make it worse than the batch mean. Drawing them costs K batches' rows of "
        "sampling (on the CPU about K/2 batches' time: the rows are drawn together).",
        check=at_least(2),
    )
    critic_steps: int = option(2, "Critic updates per policy update. The page's 2.", check=at_least(0))
    critic_warmup: int | str = option(
        10,
        'Critic-only steps, each on a fresh batch, before the first policy step. The page\'s 10. "auto": critic-only '
        "steps until the critic's explained variance on batches it has not trained on (each warmup batch is scored "
        "before the critic trains on it) reaches --critic-warmup-target on two batches in a row, at most "
        "--critic-warmup-limit steps; the length taken is logged (critic_warmup_steps) and said.",
        check=lambda v: (
            (None if v == "auto" else 'must be a whole number >= 0 or "auto"') if isinstance(v, str) else at_least(0)(v)
        ),
    )
    critic_warmup_target: float = option(
        0.0,
        "--critic-warmup auto: the explained variance to reach (0: the critic predicts returns at least as well as "
        "the batch's own mean).",
        check=between(-1.0, 1.0),
    )
    critic_warmup_limit: int = option(
        50, "--critic-warmup auto: the most critic-only steps taken whatever the explained variance.", check=at_least(2)
    )


@dataclass(frozen=True)
class RolloutSettings(Section):
    """What every source reads; the source's own settings are its section (``Config.source``)."""

    source: str = option(
        "local",
        'Where batches come from: "local" (the stale sampler in this process, reproducible), "ray" (asynchronous '
        'rollout workers), "traces" (a serving system\'s log, --traces), "vllm" / "vllm-async" (vLLM as the sampler); '
        "more by registering one (sao.rollout.registry). Each has its own settings.",
        flag="rollout",
        aliases=("engine",),
        check=_in_registry(sources),
    )
    temperature: float = option(
        1.0, "Rollout temperature. 1.0 with no top-p/top-k/penalty: the ratio needs common support.", check=positive
    )
    max_new_tokens: int = option(256, "Rollout length cap (per action). The page's 256.", check=at_least(1))
    decoder: str = option(
        "auto",
        'How tokens are decoded: "plain" (the reference loop), "graph" (sao.rollout.engine: static KV cache, the '
        'decode step as a CUDA graph on a GPU, eager elsewhere), or "auto": graph on a GPU, plain on the CPU.',
        check=one_of("auto", "plain", "graph"),
    )
    max_turns: int = option(
        4,
        "Actions per trajectory at most (an environment may end it sooner); hitting it ends it as truncated.",
        check=at_least(1),
    )
    max_total_tokens: int = option(
        1024,
        "Response tokens per trajectory at most, actions and observations together (--max-new-tokens caps each "
        "action); hitting it ends the trajectory as truncated.",
        check=at_least(1),
    )
    env_concurrency: int = option(
        16,
        "Environment steps in flight at once per draw call (a pool of threads; async def environments share one event "
        "loop): a trajectory whose observation is back decodes on without waiting for the rest of its batch (through "
        "vLLM every trajectory has its own thread anyway). The tokens do not depend on which tool finishes first. "
        "0 = the batch-synchronous loop of earlier versions: every turn waits for the slowest step, the steps called "
        "one after another, drawn exactly as those versions drew.",
        check=at_least(0, " (0 = batch-synchronous)"),
    )
    env_rejoin: str = option(
        "turn",
        'When a row whose observation is back decodes on. "turn": once every step of the turn is back (the steps '
        "still run at once, so a turn costs its slowest call, not their sum): which rows share a decode call never "
        'depends on timing, so a run and its resume draw the same numbers. "row": at once, without waiting for '
        "the rest of its batch (a turn costs that row's own calls): faster with uneven tools, but the batch layout "
        "follows the order tools finish in, so log-probs can differ in their last bits from run to run and a "
        "resumed run is not bit-identical. The local decoder only (through vLLM every trajectory has its own "
        "thread).",
        check=lambda v: None if v in ("turn", "row") else 'must be "turn" or "row"',
    )
    traces: str | None = option(
        None,
        "The trace log: a JSONL file or a folder of *.jsonl files a serving system wrote (format: trace.schema.json, "
        "docs/traces-and-serving.md). `sao train --traces LOG` trains on it (each trace names the policy version that "
        "sampled it; --max-staleness bounds how old it may be; rewards come from the trace or from --reward on its "
        "task; the run takes min(--steps, what the log allows) steps and publishes each adapter); `sao serve` appends "
        "to it.",
        check=not_blank,
    )


@dataclass(frozen=True)
class TrainingSettings(Section):
    steps: int = option(40, "Policy steps after the critic warmup. The page's 40.", check=at_least(0))
    batch_size: int = option(
        64, "Prompts (= trajectories: one rollout per prompt) per optimizer step. The page's 64.", check=at_least(1)
    )
    lr: float = option(
        1e-5,
        "AdamW on the LoRA adapter. The page's round 1 (round 2 is 1e-4).",
        check=all_of(positive, lambda v: None if v <= MAX_LR else f"must be at most {MAX_LR:g}"),
    )
    lr_schedule: str = option(
        "constant",
        'The policy learning rate over the policy steps: "constant" (the page\'s), "linear" (to 0 at the last step) '
        'or "cosine" (to 0), each after --warmup-steps of linear warmup from 0.',
        check=one_of("constant", "linear", "cosine"),
    )
    warmup_steps: int = option(
        0, "Policy steps of linear learning-rate warmup (0: none, the page's).", check=at_least(0)
    )
    weight_decay: float = option(0.0, "AdamW weight decay on the LoRA adapter (the page's 0).", check=non_negative)
    kl_coef: float = option(
        0.0,
        "β of an optional KL(policy‖reference) penalty per action token (the reference: the base model without the "
        "adapter; k3 estimator). 0: off, as in the protocol. It costs one more forward pass per step.",
        check=non_negative,
    )
    entropy_coef: float = option(
        0.0, "Weight of an optional entropy bonus per action token (0: off, as in the protocol).", check=non_negative
    )
    critic_lr: float = option(
        1e-4,
        "AdamW on the value head. The page's override: a one-layer head at 5e-6 does not leave its zero init.",
        check=all_of(positive, lambda v: None if v <= MAX_LR else f"must be at most {MAX_LR:g}"),
    )
    critic_bias_lr: float | None = option(
        None,
        "AdamW on the value head's bias alone, in reward units (the weight keeps --critic-lr); None: --critic-lr, the "
        "page's single rate. Adam moves every parameter by about its rate a step, and hidden states share a large "
        "common component (the tiny model's Σ_i |mean h_i| ≈ 31 over its 64 dimensions), so at one rate the weight "
        "moves the mean value ~30× faster than the bias: the head fits the batch mean through w · h, which varies "
        "along each reply where a terminal return does not, and its explained variance is negative. The tiny "
        "presets set 0.1.",
        check=lambda v: (
            None if v is None else all_of(positive, lambda x: None if x <= MAX_LR else f"must be at most {MAX_LR:g}")(v)
        ),
    )
    grad_clip: float = option(1.0, "Global norm clip on the policy gradient. The page's 1.0.", check=positive)
    seed: int = option(
        17,
        "Training seed: set right before the adapter is built, and the root of every sampler and data-order RNG. The "
        "page's 17. Run s of --train-runs uses seed + s.",
        check=_seed,
    )
    micro_batch: int = option(
        0,
        "Rows per forward+backward in the training pass; 0 = as many as fit in free GPU memory (the whole batch on the"
        " CPU). Memory only: the loss is a sum over rows, so every micro-batch size gives the same update.",
        check=at_least(0, " (0 = automatic)"),
    )
    checkpoint_every: int = option(
        1,
        "Steps between checkpoints (a killed run resumes from the last one and repeats the steps after it, exactly "
        "with the local source).",
        check=at_least(1),
    )
    keep_checkpoints: int = option(1, "Checkpoints kept in OUT/checkpoints/ (the newest).", check=at_least(1))
    publish: bool = option(
        False,
        "After each policy update write the adapter to OUT/published/v{N}/ and point OUT/published/LATEST.json at it "
        "(version 0 at the start; the newest 3 kept), for a server to reload (sao serve). On with --traces.",
    )
    gate: str = option(
        "off",
        '"held-out": publish an adapter only when it is non-inferior to the version being served (sao.training.gate):'
        " after each policy update the candidate and the served version answer the same held-aside tasks (the first "
        "--gate-tasks of the held-out split) with the same sampling seeds (one reply each at --eval-temperature), and "
        "the candidate is published only when the lower bound of the one-sided (1 - --gate-alpha) paired interval of "
        "candidate - served is above -(--gate-margin); otherwise it is held back and training goes on. With a trace "
        "log, a served version whose live reward falls below its predecessor's by more than the margin (an always-"
        "valid confidence sequence, so checking after every step is accounted for) is rolled back: LATEST.json points "
        "at the predecessor again, and sao serve (with or without --upstream) reloads it. Every decision, with its "
        'interval, is a line of OUT/gate.jsonl and fields of the step\'s record. Implies --publish. "off": every '
        "update is published (--publish, --traces).",
        check=one_of("off", "held-out"),
    )
    gate_margin: float = option(
        0.05,
        "--gate: the non-inferiority margin, in reward units, declared before the run: a candidate may be at most "
        "this much worse than the served version (and a served version this much worse than its predecessor on live "
        "traffic) before it is held back (rolled back).",
        check=between(1e-6, 1.0),
    )
    gate_tasks: int = option(
        0,
        "--gate: how many held-aside tasks the comparison uses (the first of the held-out split); 0 = the whole split "
        "(--test-prompts). Too few to reach --gate-margin is refused at start with the size needed: t(1 - alpha, n - "
        "1) / sqrt(n) <= margin, the half-width with the worst-case sd 1 of a paired difference of rewards in [0, 1] "
        "(1085 tasks for margin 0.05 at alpha 0.05, 166 for 0.1 at 0.1).",
        check=at_least(0, " (0 = the whole held-out split)"),
    )
    gate_alpha: float = option(
        0.05,
        "--gate: the error rate of each decision: the one-sided level of the non-inferiority test, and of the "
        "rollback's confidence sequence (which holds at every check at once).",
        check=lambda v: None if math.isfinite(v) and 0 < v < 0.5 else "must be a number in (0, 0.5)",
    )
    ceiling_every: int = option(
        0,
        "The oracle ceiling: what a prompt-level baseline could reach, against what the critic reached. K > 0: at the "
        "critic warmup's end, every K policy steps and after the last, --ceiling-prompts training prompts (the same "
        "ones each time) are each rolled out --oracle-samples times by the sampler at the rollout temperature; the "
        "step's record gets their success rates' ceiling, Var(p)/p̄(1 − p̄) per trajectory and its token-weighted "
        "twin (the way the critic's explained variance counts), the critic's explained variance on those same "
        "rollouts and its share of the ceiling; OUT/oracle/ keeps the rates and the trunk's hidden states for `sao "
        "probe`. Each snapshot costs prompts × samples rollouts (64 × 8: about 4 batches' sampling on the CPU) and "
        "one teacher-forced pass over them. 0: off, and a run pays nothing. Local source, one process.",
        check=at_least(0, " (0 = off)"),
    )
    ceiling_prompts: int = option(
        64, "--ceiling-every: the training prompts rolled out at each snapshot.", check=at_least(3)
    )
    fault_budget: float = option(
        0.5,
        "The largest share of trajectories an environment may end by a fault (a call that raised, hung past "
        "--env-timeout, or answered what sao cannot use: None, a NaN or string reward) over the last --fault-window "
        "steps; past it the run stops with one line and its checkpoint, for --resume once the environment is fixed. "
        "Default 0.5: a flaky tool fails a few percent of its calls and never comes near it, a broken one (every call "
        "failing) passes it in the first window, so a run spends at most --fault-window steps on trajectories whose "
        "rewards say nothing about the replies. 1 turns the check off.",
        check=between(0.0, 1.0),
    )
    fault_window: int = option(
        4,
        "Steps over which --fault-budget is measured. Default 4: long enough that a passing outage (a tool server "
        "restarting for a step) does not stop a run, short enough that a broken environment costs a few steps.",
        check=at_least(1),
    )
    dead_band_share: float = option(
        0.001,
        "Reachability warning threshold: a masked share below this (0.1%) on stale batches means the band is dead at "
        "these settings. A share in [0, 1); 0 turns the warning off.",
        check=share,
    )
    track: str | None = option(
        None,
        'Experiment tracking: "tensorboard" (OUT/tensorboard/), "trackio" (its local store) or "wandb" (offline only); '
        "each logs every step record and the eval. None: train_log.jsonl alone. Not compared on --resume.",
        check=lambda v: None if v is None else one_of("tensorboard", "trackio", "wandb")(v),
    )
    hooks: str | None = option(
        None,
        'Your hooks (sao.training.trainer.Hook subclasses), "module:Class", several separated by commas: each built '
        "as Class() and run after the built-in ones. A hook passed to sao.train whose class is built with no "
        "arguments is recorded in config.json by its class (passed.hooks), so that --config replays it.",
        check=not_blank,
    )
    log_every: int = option(
        10,
        "When stderr is not a terminal (a log file, CI), one plain line every N steps instead of a progress bar.",
        check=at_least(1),
    )
    timeline_steps: int = option(
        100,
        "OUT/timeline.json, the run's timeline in the Chrome trace event format (Perfetto and chrome://tracing open "
        "it): a track per process (trainer ranks, Ray workers, vLLM requests as sao sees them, environment calls), "
        "each step's phases, each trajectory's draw with its version and staleness, each environment call, adapter "
        "publishes and loads, checkpoints. A rolling window: it keeps the newest N steps at least and 2N at most "
        "(at most 4000 trajectory, request and call spans a step; the rest are counted on the step's span). "
        "0 = no timeline file. The step records' time_* phase timers are kept either way. Not compared on --resume.",
        check=at_least(0, " (0 = no timeline file)"),
    )
    otel_endpoint: str | None = option(
        None,
        "OpenTelemetry: the OTLP/HTTP collector to send each step's spans to (rl.loop with rl.sample, rl.reward, "
        "rl.train, rl.sync and rl.eval under it, the run, step, version and staleness as attributes), e.g. "
        "http://127.0.0.1:4318 (/v1/traces is added). Needs pip install 'sao[otel]'. None: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT variables when set, else off. An "
        "unreachable collector costs one warning: spans are sent in the background, and dropped and counted when "
        "they cannot be. Not compared on --resume.",
        check=not_blank,
    )
    shard: str = option(
        "none",
        'How the trainer spreads over torchrun\'s processes: "none" (data parallel: every process holds the whole '
        'model, gradients summed; one process without torchrun) or "fsdp" (FSDP2: the policy, a --critic model and '
        "their optimizer states sharded over the processes, fully_shard per decoder layer then the root; bf16 "
        "compute with float32 reduction on GPUs, float32 on the CPU). Either way a step is the single-process step "
        'on the whole batch. "fsdp" writes sharded checkpoints (torch.distributed.checkpoint, safetensors) that '
        "resume on any number of processes; without torchrun it runs unsharded on one process, with a notice.",
        check=one_of("none", "fsdp"),
    )


@dataclass(frozen=True)
class EvalSettings(Section):
    eval_samples: int = option(4, "Samples per held-out task for pass@1. The page's 4.", check=at_least(1))
    eval_temperature: float = option(0.7, "Eval sampling temperature. The page's 0.7.", check=positive)
    eval_max_new_tokens: int = option(256, "Eval reply length cap; the same as training by default.", check=at_least(1))
    eval_batch: int = option(
        480,
        "Sequences decoded together during eval (all samples of 120 tasks × 4 at once on a GPU).",
        check=at_least(1),
    )
    base_evals: int = option(
        3, "Evals of the untrained base model, for the noise floor. The page's 3.", check=at_least(0)
    )
    train_runs: int = option(
        1,
        "Training seeds per arm. The page ran 1; a verdict about the training procedure (improved, regressed, flat)"
        ' needs 2+: with 1 the two arms are two trained models and the verdict is "unresolved". At alpha 0.05 it'
        " needs 6+: with n seeds the exact sign-flip p cannot go below 2^(1-n).",
        check=between(1, MAX_TRAIN_RUNS),
    )
    eval_every: int = option(
        0,
        "sao recipe/sweep/confirm: also evaluate each run's policy every K policy steps (same eval settings and "
        "sampling seed as the final eval), so pass@1 over steps exists per arm and seed; 0 = the final eval only.",
        check=at_least(0, " (0 = the final eval only)"),
    )


@dataclass(frozen=True)
class ServeSettings(Section):
    host: str = option("127.0.0.1", "Address `sao serve` listens on; anything but a loopback address warns.")
    port: int = option(
        8000, "TCP port (0: any free one; the first line printed says which).", check=between(0, MAX_PORT)
    )
    watch: str | None = option(
        None, "A `sao train --traces` run folder: serve each adapter it publishes.", check=not_blank
    )
    max_prompt_tokens: int = option(4096, "Longest prompt accepted, in tokens.", check=at_least(1))
    upstream_timeout: float = option(
        120.0,
        "--upstream: seconds the vLLM server may stay unreachable before a request fails with one line.",
        check=positive,
    )
    upstream: str | None = option(
        None,
        "The URL of a vLLM OpenAI server to draw replies from (continuous batching: concurrent clients are served "
        "concurrently); sao renders, logs, grades and loads each published adapter into it. None: sao's own sampler.",
        check=not_blank,
    )


SECTIONS: dict[str, type[Section]] = {
    "model": ModelSettings,
    "data": DataSettings,
    "algorithm": AlgorithmSettings,
    "rollout": RolloutSettings,
    "training": TrainingSettings,
    "eval": EvalSettings,
    "serve": ServeSettings,
}


def _flat_names() -> dict[str, tuple[str, str]]:
    """Every flat name (and alias) of the sections → (section, field)."""
    names: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            for name in (flag_of(f), *f.metadata.get("aliases", ())):
                if name in names:
                    raise RuntimeError(f"two settings spelled {name!r}: {names[name]} and {(section, f.name)}")
                names[name] = (section, f.name)
    return names


FLAT = _flat_names()
CANONICAL = {
    name: flag_of(next(f for f in dataclasses.fields(SECTIONS[s]) if f.name == n)) for name, (s, n) in FLAT.items()
}
NOTICES = {
    alias: f"--{alias} is now --{CANONICAL[alias]} (same values); --{alias} still works"
    for alias in ("engine", "band", "arm")
}
# Names older sao versions wrote inside a section, read as today's flat names (settings files and config.json).
OLD_FIELDS = {
    ("data", "seed"): "data_seed",
    **{("eval", n): f"eval_{n}" for n in ("samples", "temperature", "max_new_tokens", "batch", "every")},
}


def source_fields(section: type[SourceSection]) -> dict[str, dataclasses.Field]:
    return {flag_of(f): f for f in dataclasses.fields(section)}


def _taken_by(name: str) -> list[str]:
    """The sources whose own section has a setting called ``name``."""
    return [kind for kind in sources() if name in source_fields(sources().get(kind))]


# --- the whole ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class Config:
    """A run's settings: one section each (see the module doc) and the chosen source's own (``source``).
    ``Config.load(preset, file, **settings)`` makes one; ``Config(lr=1e-3, steps=2)`` takes flat names over the
    protocol, ``Config(training=TrainingSettings(...))`` whole sections; ``replace(**flat)`` changes settings;
    ``to_dict()`` is what config.json holds (the source's section inside ``rollout``, under its name)."""

    model: ModelSettings
    data: DataSettings
    algorithm: AlgorithmSettings
    rollout: RolloutSettings
    training: TrainingSettings
    eval: EvalSettings
    serve: ServeSettings
    source: SourceSection

    def __init__(self, **settings: Any) -> None:
        given = settings.pop("source", None)
        sections = {k: v for k, v in settings.items() if k in SECTIONS and isinstance(v, SECTIONS[k])}
        flat = _upgrade({k: v for k, v in settings.items() if k not in sections})
        rollout = sections.get("rollout") or RolloutSettings()
        kind = _source_kind(flat, rollout.source)
        section = sources().get(kind)
        own = {name: flat.pop(name) for name in list(flat) if name not in FLAT and name in source_fields(section)}
        for name in flat:
            if name not in FLAT and _taken_by(name):
                raise ConfigError(
                    f"--{name.replace('_', '-')} is a setting of --rollout "
                    f"{', '.join(_taken_by(name))}, not of --rollout {kind}"
                )
        grouped = _group(flat, where="")
        for name, cls in SECTIONS.items():
            base = sections.get(name) or cls()
            object.__setattr__(self, name, dataclasses.replace(base, **grouped[name]) if name in grouped else base)
        if self.rollout.source != kind:
            object.__setattr__(self, "rollout", dataclasses.replace(self.rollout, source=kind))
        fields = source_fields(section)
        try:
            values = {fields[n].name: convert(section, fields[n].name, v, n) for n, v in own.items()}
            base = given if isinstance(given, section) else section()
            object.__setattr__(self, "source", dataclasses.replace(base, **values))
        except TypeError:  # a registered section that is not a dataclass
            raise ConfigError(f"--rollout {kind}: its settings section {section!r} is not a dataclass") from None
        for problem in (*(rule(self) for rule in RULES), self.source.check(self)):
            if problem:
                raise ConfigError(problem)

    @classmethod
    def load(cls, preset: str | None = None, file: str | Path | None = None, **settings: Any) -> Config:
        """The one way a run's settings are made: the preset's defaults (``preset``, else the file's ``"preset"``,
        else the protocol's), then the settings ``file`` holds (YAML or JSON; a config.json sao wrote replays
        as it is), then ``settings`` (flat names, or sections as mappings: ``training={"lr": 1e-3}``). An old
        spelling is read with a one-line notice; a setting given twice is refused."""
        where = f"--config {file}" if file is not None else ""
        from_file = read_config_file(file)[0] if file is not None else {}
        given = flatten({k: v for k, v in settings.items() if k != "preset"}, "settings")
        if "preset" in settings and preset is None:
            preset = settings["preset"]
        chosen = preset if preset is not None else from_file.pop("preset", None)
        from_file.pop("preset", None)
        if chosen is not None and not isinstance(chosen, str):
            raise ConfigError(f"'preset' must be a preset's name, got {type(chosen).__name__}")
        if chosen is not None and chosen not in PRESETS:
            raise ConfigError(PRESETS.unknown(chosen, "--preset"))
        changes = {**canonical(from_file, where), **canonical(given)}
        values = {**canonical(preset_values(chosen or "protocol", changes)), **changes}
        if from_file and _source_kind(changes, "local") != _source_kind(from_file, "local"):
            values = {k: v for k, v in values.items() if k in FLAT or k in changes}  # a flag chose another source
        try:
            return cls(**values)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}" if where and "--config" not in str(error) else str(error)) from None

    # -- flat names ----------------------------------------------------------------------------------------

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name, the source's own included."""
        out = {}
        for values in (*(getattr(self, section) for section in SECTIONS), self.source):
            for f in dataclasses.fields(values):
                out[flag_of(f)] = getattr(values, f.name)
        return out

    def replace(self, **changes: Any) -> Config:
        """This config with settings changed, by flat name (``replace(lr=1e-3, ratio=(0.5, 4))``); another
        ``rollout`` starts from that source's defaults."""
        changes = canonical(changes)
        keep = "rollout" not in changes or changes["rollout"] == self.rollout.source
        return Config(**{s: getattr(self, s) for s in SECTIONS}, **({"source": self.source} if keep else {}), **changes)

    def to_dict(self) -> dict[str, Any]:
        """The sectioned settings, as config.json holds them: the source's own inside ``rollout``, by its name."""
        out = {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}
        out["rollout"][self.rollout.source] = dataclasses.asdict(self.source)
        return out

    @staticmethod
    def help(name: str) -> str:
        """The doc of the setting spelled ``name`` (flat), on one line; a source's own settings too."""
        if name in FLAT:
            section, field_name = FLAT[name]
            return help_of(next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == field_name))
        for kind in sources():
            if name in (fields := source_fields(sources().get(kind))):
                return help_of(fields[name])
        raise ConfigError(f"unknown setting {name!r}")


def _source_kind(flat: dict[str, Any], default: str) -> str:
    """The source the flat settings choose: ``rollout`` (or its old spelling), else the one a shared setting they
    give picks over the default (``traces`` → "traces"), else ``default``."""
    kind = flat.get("rollout", flat.get("engine"))
    implied = [k for k in sources() if (by := sources().get(k).implied_by) and flat.get(by) is not None]
    if kind is None:
        kind = implied[0] if implied and default == RolloutSettings().source else default
    if not isinstance(kind, str) or kind not in sources():
        raise ConfigError(f"--rollout {_in_registry(sources)(str(kind))}, got {kind!r}")
    for other in implied:
        if other != kind:
            raise ConfigError(
                f"--{sources().get(other).implied_by} goes with --rollout {other} (the trajectories "
                f"come from it), not with --rollout {kind}; leave one of them out"
            )
    return kind


def preset_values(name: str, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A preset's flat settings, with its overlay for the environment ``changes`` (or the preset) names."""
    preset = dict(PRESETS.get(name))
    overlays = preset.pop("by_env", {})
    env = (changes or {}).get("env", preset.get("env"))
    return {**preset, **overlays.get(env, {})}


def _section_names(section: str, cls: type[Section], inner: str) -> str | None:
    """The flat name of field ``inner`` written in ``section`` (today's, or an older version's)."""
    names = {f.name: flag_of(f) for f in dataclasses.fields(cls)}
    return names.get(inner) or OLD_FIELDS.get((section, inner))


def flatten(values: dict[str, Any], where: str = "settings") -> dict[str, Any]:
    """A flat or sectioned mapping as flat names: ``{"training": {"lr": 1e-3}}`` → ``{"lr": 1e-3}``. A section
    name whose value is not a mapping is the flat setting of that name (``"model": "tiny"``, ``"data": None``); a
    rollout section holds its source's own settings under the source's name."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of settings (name: value), got {type(values).__name__}")
    flat: dict[str, Any] = {}
    given: dict[str, str] = {}  # flat name -> where it was given, to refuse a setting given twice

    def put(name: str, value: Any, spelled: str) -> None:
        if name in flat:
            raise ConfigError(f"{where}: {spelled} and {given[name]} set the same setting; give one")
        flat[name], given[name] = value, spelled

    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: a setting's name must be a string, got {_kind(key)} ({key!r:.40})")
        if key in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                if key == "rollout" and inner in sources() and isinstance(inner_value, dict):
                    for name, source_value in flatten_source(inner, inner_value, where).items():
                        put(name, source_value, f"{key}.{inner}.{name}")
                    continue
                name = _section_names(key, SECTIONS[key], str(inner))
                if name is None and key == "rollout" and _taken_by(str(inner)):  # written before sources had sections
                    name = str(inner)
                if name is None:
                    known = [f.name for f in dataclasses.fields(SECTIONS[key])]
                    raise ConfigError(f"{where}: {_unknown(str(inner), known, f'in section {key!r}')}")
                put(name, inner_value, f"{key}.{inner}")
        elif isinstance(value, dict) and key not in FLAT and key != "preset":  # a section's name misspelled
            close = difflib.get_close_matches(key, list(SECTIONS), n=1)
            hint = f" (did you mean the section {close[0]!r}?)" if close else f" (sections: {', '.join(SECTIONS)})"
            raise ConfigError(f"{where}: unknown section {key!r}{hint}")
        else:
            put(key, value, key)
    return flat


def flatten_source(kind: str, values: dict[str, Any], where: str) -> dict[str, Any]:
    fields = source_fields(sources().get(kind))
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise ConfigError(f"{where}: {_unknown(str(unknown[0]), list(fields), f'in section rollout.{kind}')}")
    return dict(values)


def flat_view(values: dict[str, Any]) -> dict[str, Any]:
    """Recorded settings (a results.json's or config.json's, sectioned today or flat from earlier versions) as
    today's flat names, for reading: never refuses, unknown names kept as written, old spellings (``band``,
    ``engine``, ``arm``) spelled as their setting."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                if key == "rollout" and isinstance(inner_value, dict):
                    flat.update(inner_value)
                else:
                    flat[_section_names(key, SECTIONS[key], inner) or inner] = inner_value
        else:
            flat[CANONICAL.get(key, key)] = value
    return flat


def _unknown(name: str, known: list[str], what: str = "") -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown setting {name!r}{' ' + what if what else ''}{hint}"


def setting_names() -> list[str]:
    """Every setting's flat name, the sources' own included (old spellings left out)."""
    return sorted({*CANONICAL.values(), *(n for k in sources() for n in source_fields(sources().get(k)))})


def canonical(values: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Flat settings with every old spelling as its setting's flat name (``band`` → ``ratio``, with a one-line
    notice); an unknown name, or one setting given twice, is a ConfigError."""
    at = f"{where}: " if where else ""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # flat name → the spelling that set it
    known = set(setting_names())
    for name, value in values.items():
        if name not in FLAT and name not in known:
            raise ConfigError(f"{at}{_unknown(str(name), setting_names())}")
        if name in NOTICES:
            print(f"notice: {NOTICES[name]}", file=sys.stderr)
        spelled = CANONICAL.get(name, name)
        if spelled in out:
            raise ConfigError(f"{at}{name!r} and {given[spelled]!r} set the same setting; give one")
        out[spelled], given[spelled] = value, name
    return out


def _upgrade(values: dict[str, Any]) -> dict[str, Any]:
    """Spellings older sao versions wrote, read as today's: ``--model tiny --env tiny-calc`` meant the calculator
    agent's own model and task set, which now have names of their own."""
    out = dict(values)
    if out.get("env") == "tiny-calc":
        for name in ("model", "data"):
            if out.get(name) == "tiny":
                out[name] = "tiny-calc"
    return out


def recorded(values: dict[str, Any]) -> dict[str, Any]:
    """Flat settings a run recorded (config.json, results.json), less the settings of sources it did not use: older
    versions wrote every source's settings in one section, and those had no part in the run."""
    kind = _source_kind(values, RolloutSettings().source)
    own = source_fields(sources().get(kind))
    return {k: v for k, v in values.items() if k in FLAT or k in own or not _taken_by(k)}


def _group(values: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """Flat settings → {section: {field: value}}, each value converted to its declared type; unknown names get a
    did-you-mean, and a setting given twice (by two of its spellings) is refused."""
    grouped: dict[str, dict[str, Any]] = {}
    seen: dict[tuple[str, str], str] = {}
    for name, value in values.items():
        at = f"{where}: " if where else ""
        if name not in FLAT:
            raise ConfigError(f"{at}{_unknown(str(name), setting_names())}")
        section, field_name = FLAT[name]
        if (section, field_name) in seen:
            raise ConfigError(f"{at}{name!r} and {seen[section, field_name]!r} set the same setting; give one")
        seen[section, field_name] = name
        try:
            grouped.setdefault(section, {})[field_name] = convert(SECTIONS[section], field_name, value, name)
        except ConfigError as error:
            raise ConfigError(f"{at}{error}") from None
    return grouped


# --- checks across sections ---------------------------------------------------------------------------------------


def _random_needs_a_share(c: Config) -> str | None:
    if c.algorithm.correction == "random" and c.algorithm.random_mask_share is None:
        return (
            "--correction random needs --random-mask-share (sao sweep and sao confirm take it from the dis arm of "
            "the same cell and seed)"
        )
    return None


def _seeds_fit(c: Config) -> str | None:
    if c.training.seed + c.eval.train_runs - 1 >= SEED_LIMIT:
        return "--seed must be a whole number from 0 to 2**63 - 1 (with --train-runs, seed + train_runs - 1)"
    return None


def _gate_fits(c: Config) -> str | None:
    t = c.training
    if t.gate == "off":
        return None
    from sao.core.stats import tasks_for_margin

    have = t.gate_tasks or c.data.test_prompts
    need = tasks_for_margin(t.gate_margin, t.gate_alpha)
    if have < need:
        given = f"--gate-tasks {t.gate_tasks}" if t.gate_tasks else f"--test-prompts {c.data.test_prompts}"
        return (
            f"--gate held-out cannot reach --gate-margin {t.gate_margin:g} at --gate-alpha {t.gate_alpha:g} with "
            f"{have} held-aside tasks ({given}): it needs at least {need} (the worst-case sd 1 of a paired reward "
            "difference); give more tasks or a wider margin"
        )
    return None


def _device_exists(c: Config) -> str | None:
    from sao.core.machine import device_problem

    return device_problem(c.model.device)


def _critic_model_named(c: Config) -> str | None:
    if c.model.critic_model is not None and c.model.critic != "model":
        return "--critic-model names the value model's base: it needs --critic model"
    return None


def _full_finetune_fits(c: Config) -> str | None:
    if c.model.finetune != "full":
        return None
    if c.training.kl_coef > 0:
        return (
            "--kl-coef with --finetune full: the KL reference is the base without the adapter, and full "
            "fine-tuning has no adapter to switch off; leave --kl-coef at 0"
        )
    if not type(c.source).full_weights:
        return (
            f"--finetune full with --rollout {c.rollout.source}: its sampler takes LoRA adapters only; use "
            "--rollout local or vllm, or --finetune lora"
        )
    if c.training.gate != "off":
        return "--gate held-out compares LoRA adapters: it needs --finetune lora"
    return None


def _shard_fits(c: Config) -> str | None:
    if c.training.shard != "fsdp":
        return None
    if c.rollout.decoder == "graph":
        return (
            "--decoder graph with --shard fsdp: the graph engine keeps pointers to weights that FSDP gathers "
            "anew for every draw; use --decoder plain or auto"
        )
    if c.training.gate != "off":
        return "--gate held-out with --shard fsdp is not offered: the gate draws with unsharded adapter copies"
    return None


def _oracle_draws_locally(c: Config) -> str | None:
    if c.source.draws_on_demand:
        return None
    if c.algorithm.baseline == "oracle":
        return (
            f"--baseline oracle draws --oracle-samples more rollouts of every prompt beside each batch, which only "
            f"--rollout local does; --rollout {c.rollout.source} cannot"
        )
    if c.training.ceiling_every:
        return (
            f"--ceiling-every rolls out prompts by the sampler at each snapshot, which only --rollout local does; "
            f"--rollout {c.rollout.source} cannot"
        )
    return None


RULES = (
    _random_needs_a_share,
    _seeds_fit,
    _gate_fits,
    _device_exists,
    _critic_model_named,
    _full_finetune_fits,
    _shard_fits,
    _oracle_draws_locally,
)


# --- settings files ---------------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Settings from a YAML (.yaml, .yml) or JSON file as flat names: ``(values, grid)``.

    The file holds a mapping of settings (flat, sectioned, or both; a ``"preset"`` key allowed) or a file sao wrote
    (``config.json``, ``experiment.json``) as it is: a mapping whose "config" key holds the settings; its other
    top-level keys ("data", "source", ...) are ignored, except "grid", returned as read (None when absent) for a
    sweep, and what the run was passed ("passed", "replayable": ``settings_of``). Read through the bounded reader
    (``sao.core.reading``); values are type-checked here, so that an error names the file; ranges are checked when
    the Config is built.
    """
    path = Path(path)
    where = f"--config {path}"
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"{where}: expected a .yaml, .yml or .json file")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(CONFIG_LIMITS.max_bytes + 1)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a folder, not a settings file") from None
    except OSError as error:
        raise ConfigError(f"{where}: cannot be read ({error.strerror})") from None
    if len(raw) > CONFIG_LIMITS.max_bytes:
        raise ConfigError(f"{where}: larger than {CONFIG_LIMITS.max_bytes >> 20} MiB; is this a settings file?")
    parse = parse_json if suffix == ".json" else parse_yaml
    return settings_of(parse(raw, where=where, limits=CONFIG_LIMITS, error=ConfigError), where)


# What a run passed as objects (config.json's "passed", by import path or path) → the setting that names it.
PASSED_AS = {"dataset": "data", "reward_fn": "reward", "env_factory": "env", "hooks": "hooks"}


def settings_of(data: Any, where: str = "settings") -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A mapping of settings as a settings file holds it (``read_config_file``), or a file sao wrote, read as flat
    names: ``(values, grid)``. A config.json replays as it is: what the run was passed by import path or path
    (its ``"passed"``: the dataset, the reward, the environment, the hooks) becomes the setting that names it, and
    one that says it cannot be replayed (``"replayable": false``) is refused with its reasons."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of settings (name: value), got {_kind(data)}")
    grid, written = None, "config" in data
    passed: dict[str, Any] = {}
    if written:  # a file sao wrote
        grid = data.get("grid")
        if grid is not None and not isinstance(grid, dict):
            raise ConfigError(f"{where}: 'grid' must be a mapping (lags, lrs, bands, arms), got {_kind(grid)}")
        passed = _replayed(data, where)
        data = data["config"]
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: 'config' must be a mapping of settings (name: value), got {_kind(data)}")
    flat = _upgrade(flatten(data, where))
    if passed.get("hooks") and flat.get("hooks"):  # the run's own --hooks, then those it was passed
        passed["hooks"] = f"{flat['hooks']},{passed['hooks']}"
    flat.update(passed)
    preset = flat.pop("preset", None)
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"{where}: 'preset' must be a preset's name, got {_kind(preset)}")
    flat = recorded(flat) if written else flat
    values = {}
    for name, value in flat.items():
        if name not in FLAT and not _taken_by(name):
            raise ConfigError(f"{where}: {_unknown(str(name), setting_names())}")
        if name in FLAT:  # a source's own settings are converted when its section is built
            section, field_name = FLAT[name]
            try:
                value = convert(SECTIONS[section], field_name, value, name)
            except ConfigError as error:
                raise ConfigError(f"{where}: {error}") from None
        values[name] = value
    if preset is not None:
        values["preset"] = preset
    return values, grid


def _replayed(record: dict[str, Any], where: str) -> dict[str, Any]:
    """The settings that replay what a written record says its run was passed (``PASSED_AS``); a ConfigError when
    it says the run cannot be replayed (an object passed with no import path, rows rather than a path)."""
    if record.get("replayable") is False:
        reasons = record.get("not_replayable")
        why = "; ".join(str(r) for r in reasons) if isinstance(reasons, list) and reasons else "it says so"
        raise ConfigError(
            f"{where}: this run cannot be replayed from its settings ({why}); run it again from Python "
            "with the same objects"
        )
    passed = record.get("passed")
    if passed is None:
        return {}
    if not isinstance(passed, dict):
        raise ConfigError(f"{where}: 'passed' must be a mapping (what the run was passed), got {_kind(passed)}")
    out = {}
    for name, value in passed.items():
        if name not in PASSED_AS:
            raise ConfigError(
                f"{where}: the run was passed {name} as an object, which no setting names; run it "
                "again from Python with the same objects"
            )
        if not isinstance(value, str):
            raise ConfigError(f"{where}: passed.{name} must be a string, got {_kind(value)}")
        out[PASSED_AS[name]] = value
    return out


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (an empty file or null)"
    names = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "true/false"}
    return names.get(type(value), f"a {type(value).__name__}")
