"""Training on logged traces: rollouts a serving system wrote, one to many policy versions old, each action token
with the log-probability the server sampled it with. ``TraceSource`` is a ``Source`` (``sao.rollout.sources``).

The format is JSONL: trajectory records (id, policy_version, temperature, a prompt, a completion as token ids,
OpenAI ``choices`` or ``segments``, finish_reason, a reward or task fields) and feedback records (a later reward),
the contract with ``sao serve``, shipped as ``trace.schema.json`` beside this file. A malformed record is a
one-line ``DataError`` (``--skip-bad-traces`` counts it instead); a well-formed one that cannot be trained on is a
counted drop. Batches follow log order, staleness is judged when a batch is taken, and the read position and
pending trajectories are saved with the checkpoint, so ``--resume`` uses nothing twice and loses nothing.

Other systems' records are read too: a line that a registered ``TraceFormat`` (``TRACE_FORMATS``: TRL's OpenEnv
proxy trace, tinker-cookbook's capture) recognises by its fields is mapped to sao records and checked like one.

Deliberately left out: per-trace temperatures within one run, top-p/top-k traces, and any bound on how many
trajectories may wait for feedback. Design notes: docs/design/traces.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from sao.core.errors import DataError
from sao.core.reading import TEMPERATURE_RANGE, Limits, parse_jsonl_line, reward_problem
from sao.model.policy import context_length
from sao.rollout.registry import TRACE_FORMATS
from sao.rollout.sources import SourceContext, SourceExhausted
from sao.rollout.types import Batch, Rollout, Turns

SCHEMA_FILE = Path(__file__).with_name("trace.schema.json")
# What the hand validator knows; a test checks that trace.schema.json says the same.
TRACE_REQUIRED = ("id", "policy_version", "temperature")
TRACE_FIELDS = (
    "type",
    "id",
    "policy_version",
    "temperature",
    "messages",
    "prompt_token_ids",
    "completion_token_ids",
    "logprobs",
    "choices",
    "segments",
    "turn_rewards",
    "finish_reason",
    "reward",
    "task",
    "adapter",
    "created",
    "model",
)
FEEDBACK_REQUIRED = ("type", "id", "reward")
FEEDBACK_FIELDS = ("type", "id", "reward")
FINISH_REASONS = ("stop", "length")
OBSERVATION_ROLES = ("tool", "observation", "user", "system")
DROP_REASONS = (
    "bad_record",
    "misaligned",
    "too_stale",
    "future_version",
    "no_reward",
    "duplicate_id",
    "footing_mismatch",
    "empty",
    "too_long",
)
MAX_LINE_BYTES = 64 << 20  # a longer line is a bad record (nothing a server writes for one trajectory is near it)
TRACE_LIMITS = Limits(max_bytes=MAX_LINE_BYTES, max_depth=16)  # one record: a trace nests 5 deep
LOGPROB_SLACK = 1e-5  # a recorded log-probability may exceed 0 by float noise, not more
POLL_SECONDS = 0.2


class _Bad(Exception):
    """A malformed record: which field, and what is wrong with it."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"field {field_name!r}: {problem}")


BadRecord = _Bad  # what a trace format raises for a record it cannot map: the field, and what is wrong with it


class _Misaligned(Exception):
    """Token strings that do not re-encode to the same tokens."""


@dataclass
class Trace:
    """One usable trajectory, as lists (it lives in the source's state until it is batched)."""

    id: str
    version: int  # the oldest action token's version (the record's policy_version unless a segment is older)
    temperature: float
    prompt: list[int]
    response: list[int]
    logprobs: list[float]  # 0 off the action tokens
    action: list[bool]
    turn_ends: list[int]  # the last token of each assistant segment
    turn_rewards: list[float] | None = None  # one per assistant segment, when logged
    reward: float | None = None
    task: dict[str, Any] | None = None
    cut: bool = False  # finish_reason "length": the last action hit the token limit
    where: str = ""
    # per response token: the version that sampled it, when assistant segments carry their own policy_version (an
    # agent whose later actions a newer adapter served); None: every token is ``version``'s
    versions: list[int] | None = None

    @property
    def newest(self) -> int:
        """The newest version among the action tokens."""
        return (
            self.version
            if self.versions is None
            else max(v for v, a in zip(self.versions, self.action, strict=True) if a)
        )

    @property
    def rewarded(self) -> bool:
        return self.reward is not None or self.turn_rewards is not None or self.task is not None


# ---------------------------------------------------------------------------------------------------------
# One record.


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Any, name: str, vocab_size: int, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or not all(_integer(t) for t in value):
        raise _Bad(name, "must be a list of whole numbers (token ids)")
    if not value and not allow_empty:
        raise _Bad(name, "must not be empty")
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _Bad(
            name, f"token id {bad} is outside this model's vocabulary (0..{vocab_size - 1}); is it another model's log?"
        )
    return list(value)


def _logprobs(value: Any, name: str, n: int) -> list[float]:
    if not isinstance(value, list) or not all(_number(x) for x in value):
        raise _Bad(name, "must be a list of finite numbers (log-probabilities)")
    if len(value) != n:
        raise _Bad(name, f"has {len(value)} entries for {n} tokens; one log-probability per token")
    if any(x > LOGPROB_SLACK for x in value):
        raise _Bad(name, "holds a log-probability above 0")
    return [float(x) for x in value]


def _messages(value: Any) -> list[dict[str, Any]]:
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )
    if not ok:
        raise _Bad("messages", 'must be a non-empty list of {"role": str, "content": str}')
    return value


def check_record(record: Any) -> str:
    """The record's kind ("trace" or "feedback") after checking its shape against the schema; raises ``_Bad``.
    Token alignment and the vocabulary are checked when the record is converted (``parse_trace``)."""
    if not isinstance(record, dict):
        raise _Bad("record", "each line must be one JSON object")
    kind = record.get("type", "trace")
    if kind not in ("trace", "feedback"):
        raise _Bad("type", f'must be "trace" (or absent) or "feedback", got {kind!r}')
    if not isinstance(record.get("id"), str) or not record["id"]:
        raise _Bad("id", "missing or not a non-empty string")
    if kind == "feedback":
        problem = reward_problem(record.get("reward"))
        if problem is not None:
            raise _Bad("reward", f"a feedback record needs a reward: {problem}")
        return kind
    version = record.get("policy_version")
    if not _integer(version) or not 0 <= version < 1 << 63:
        raise _Bad("policy_version", f"must be a whole number >= 0, got {version!r}")
    temperature = record.get("temperature")
    if not _number(temperature):
        raise _Bad("temperature", f"must be a finite number, got {temperature!r}")
    if temperature <= 0:
        raise _Bad(
            "temperature", f"is {temperature}: greedy traces (temperature <= 0) have no log-probs to correct with"
        )
    low, high = TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise _Bad(
            "temperature", f"is {temperature:g}: outside {low:g}..{high:g}, where logits / temperature fit float32"
        )
    if "messages" not in record and "prompt_token_ids" not in record:
        raise _Bad("messages", "give the prompt as messages or prompt_token_ids (or both)")
    if "messages" in record:
        _messages(record["messages"])
    completions = [k for k in ("completion_token_ids", "choices", "segments") if k in record]
    if len(completions) != 1:
        raise _Bad(
            "completion_token_ids",
            "give the completion as exactly one of completion_token_ids (+ logprobs), choices or segments",
        )
    if "completion_token_ids" in record and "logprobs" not in record:
        raise _Bad("logprobs", "completion_token_ids needs logprobs, one per token")
    if "logprobs" in record and "completion_token_ids" not in record:
        raise _Bad("logprobs", "top-level logprobs go with completion_token_ids")
    if "turn_rewards" in record and "segments" not in record:
        raise _Bad("turn_rewards", "turn_rewards go with segments")
    if "turn_rewards" in record and record.get("reward") is not None:
        raise _Bad("turn_rewards", "give reward or turn_rewards, not both")
    finish = record.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise _Bad("finish_reason", f'must be "stop" or "length", got {finish!r}')
    reward = record.get("reward")
    if reward is not None and (problem := reward_problem(reward)) is not None:
        raise _Bad("reward", problem)
    if record.get("task") is not None and not isinstance(record["task"], dict):
        raise _Bad("task", "must be an object of task fields (e.g. question, answer)")
    for name, ok in (("adapter", str), ("model", str)):
        if record.get(name) is not None and not isinstance(record[name], ok):
            raise _Bad(name, "must be a string")
    if record.get("created") is not None and not _number(record["created"]):
        raise _Bad("created", "must be a unix time (a number)")
    return kind


class Tokens:
    """What parsing needs from the tokenizer: prompts through the chat template, and exact token bytes."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, list(eos_token_ids)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.byte_of = {ch: b for b, ch in enumerate(byte_alphabet())}
        self._bytes: dict[int, bytes] = {}

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt as the chat template renders it with the generation prompt (and ``tools``, when given)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                "the run's tokenizer has no chat template: log the prompt as prompt_token_ids instead of messages"
            )
        extra = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as error:  # a template that rejects the roles, say
            raise _Bad("messages", f"the chat template refused them ({str(error).splitlines()[0][:100]})") from None
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a special token: its text)."""
        if token_id not in self._bytes:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            value = None
            if self.byte_level and token_id not in self.special and isinstance(piece, str):
                try:
                    value = bytes(self.byte_of[ch] for ch in piece)
                except KeyError:  # an added token with ordinary characters
                    value = None
            if value is None:
                value = self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
            self._bytes[token_id] = value
        return self._bytes[token_id]


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes (GPT-2's table), in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = [], 0
    for b in range(256):
        if b in printable:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


def _choice_tokens(record: dict[str, Any], tokens: Tokens) -> tuple[list[int], list[float], str | None]:
    """(token ids, log-probs, finish_reason) from an OpenAI chat-completions ``choices`` field, aligned exactly."""
    choices = record["choices"]
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Bad("choices", "must be a non-empty list of chat-completion choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict) or not isinstance(message.get("content"), str | None):
        raise _Bad("choices[0].message.content", "missing or not a string")
    content = message.get("content") or ""
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list):
        raise _Bad("choices[0].logprobs.content", "missing: request logprobs from the server")
    got: list[bytes] = []
    values: list[float] = []
    for j, entry in enumerate(entries):
        where = f"choices[0].logprobs.content[{j}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str) or not _number(entry.get("logprob")):
            raise _Bad(where, 'must be {"token": str, "logprob": number, "bytes": [int] or null}')
        raw = entry.get("bytes")
        if raw is not None and not (isinstance(raw, list) and all(_integer(b) and 0 <= b < 256 for b in raw)):
            raise _Bad(where + ".bytes", "must be a list of byte values 0..255 or null")
        if entry["logprob"] > LOGPROB_SLACK:
            raise _Bad(where + ".logprob", "is above 0")
        got.append(bytes(raw) if raw is not None else entry["token"].encode("utf-8"))
        values.append(float(entry["logprob"]))
    finish = choice.get("finish_reason")
    if finish is not None and finish not in FINISH_REASONS:
        raise _Bad("choices[0].finish_reason", f'must be "stop" or "length", got {finish!r}')
    ids = tokens.encode(content)
    if len(got) == len(ids) + 1:  # the server logged the stop token too: keep it when it is an EOS token
        eos = next((e for e in tokens.eos if tokens.token_bytes(e) == got[-1]), None)
        if eos is None:
            raise _Misaligned(f"{len(got)} logged tokens for the text's {len(ids)}")
        ids = [*ids, eos]
    if len(got) != len(ids):
        raise _Misaligned(f"{len(got)} logged tokens, but the text encodes to {len(ids)}")
    for j, (token_id, logged) in enumerate(zip(ids, got, strict=True)):
        if tokens.token_bytes(token_id) != logged:
            raise _Misaligned(f"token {j} is {logged!r} in the log and {tokens.token_bytes(token_id)!r} here")
    return ids, values, finish


def parse_trace(record: dict[str, Any], tokens: Tokens, where: str) -> Trace:
    """A checked trajectory record as a ``Trace``; raises ``_Bad`` (malformed) or ``_Misaligned``."""
    if "prompt_token_ids" in record:  # what the server fed the model: it wins over re-rendering the messages
        prompt = _token_ids(record["prompt_token_ids"], "prompt_token_ids", tokens.vocab_size)
    else:
        prompt = tokens.prompt(record["messages"])
    finish = record.get("finish_reason")
    turn_rewards = None
    if "completion_token_ids" in record:
        ids = _token_ids(record["completion_token_ids"], "completion_token_ids", tokens.vocab_size, allow_empty=True)
        values = _logprobs(record["logprobs"], "logprobs", len(ids))
        action, turn_ends = [True] * len(ids), [len(ids) - 1]
    elif "choices" in record:
        ids, values, choice_finish = _choice_tokens(record, tokens)
        finish = finish if finish is not None else choice_finish
        action, turn_ends = [True] * len(ids), [len(ids) - 1]
    else:
        segments = record["segments"]
        if not isinstance(segments, list) or not segments:
            raise _Bad("segments", "must be a non-empty list of {role, token_ids[, logprobs]}")
        ids, values, action, turn_ends, versions = [], [], [], [], []
        for j, segment in enumerate(segments):
            name = f"segments[{j}]"
            if not isinstance(segment, dict) or not isinstance(segment.get("role"), str):
                raise _Bad(name, "must be an object with a role")
            role = segment["role"]
            seg_ids = _token_ids(segment.get("token_ids"), name + ".token_ids", tokens.vocab_size)
            seg_version = segment.get("policy_version", record["policy_version"])
            if not _integer(seg_version) or not 0 <= seg_version < 1 << 63:
                raise _Bad(name + ".policy_version", f"must be a whole number >= 0, got {seg_version!r}")
            if role == "assistant":
                values += _logprobs(segment.get("logprobs"), name + ".logprobs", len(seg_ids))
                action += [True] * len(seg_ids)
                ids += seg_ids
                versions += [seg_version] * len(seg_ids)
                turn_ends.append(len(ids) - 1)
            elif role in OBSERVATION_ROLES:
                values += [0.0] * len(seg_ids)
                action += [False] * len(seg_ids)
                ids += seg_ids
                versions += [versions[-1] if versions else record["policy_version"]] * len(seg_ids)
            else:
                raise _Bad(name + ".role", f"must be assistant or one of {', '.join(OBSERVATION_ROLES)}, got {role!r}")
        if not turn_ends:
            raise _Bad("segments", "hold no assistant segment: nothing the model wrote")
        if "turn_rewards" in record:
            given = record["turn_rewards"]
            if not isinstance(given, list) or len(given) != len(turn_ends):
                raise _Bad("turn_rewards", f"must be {len(turn_ends)} numbers, one per assistant segment")
            problem = next((p for x in given if (p := reward_problem(x)) is not None), None)
            if problem is not None:
                raise _Bad("turn_rewards", problem)
            turn_rewards = [float(x) for x in given]
    reward = record.get("reward")
    version = int(record["policy_version"])
    spans = "segments" in record and any(v != version for v in versions)  # a segment of another version
    return Trace(
        id=record["id"],
        version=min(v for v, a in zip(versions, action, strict=True) if a) if spans else version,
        temperature=float(record["temperature"]),
        prompt=prompt,
        response=ids,
        logprobs=values,
        action=action,
        turn_ends=turn_ends,
        turn_rewards=turn_rewards,
        reward=None if reward is None else float(reward),
        task=record.get("task"),
        cut=finish == "length",
        where=where,
        versions=versions if spans else None,
    )


# ---------------------------------------------------------------------------------------------------------
# Other systems' records.


class TraceFormat(Protocol):
    """Another system's trajectory records, a ``TRACE_FORMATS`` entry: which lines are its own, and each line as the
    sao records it stands for, which are then checked and used like any. A record that cannot be trained on honestly
    (no sampler log-probs, an unknown temperature, a truncated distribution) raises ``BadRecord`` naming its field."""

    name: str

    def detect(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` (one parsed line that is not a sao record) is this format's, by its fields."""
        ...

    def records(self, record: dict[str, Any], tokens: Tokens, where: str) -> list[dict[str, Any]]:
        """The sao trajectory records ``record`` holds (none for a line that holds no trajectory); ``where`` is its
        file:line, the id of a record that carries none (``line_id``)."""
        ...


# Sampling settings that leave the distribution softmax(logits / T), each with its neutral values: any other value
# reshapes or truncates it, and the recorded log-probs are then of a distribution the trainer does not compute.
NEUTRAL_SAMPLING: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1),
    "top_k": (None, 0, -1),
    "min_p": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
}


def sampled_temperature(params: Any, name: str) -> float:
    """The temperature a foreign record's sampling settings ``params`` (its field ``name``) drew at; ``BadRecord``
    when none is recorded (a server's default is not known here) or another setting reshaped the distribution."""
    if not isinstance(params, dict):
        raise _Bad(name, "missing: the record does not say how it was sampled (its temperature)")
    for key, neutral in NEUTRAL_SAMPLING.items():
        value = params.get(key)
        if isinstance(value, bool) or value not in neutral:
            raise _Bad(
                f"{name}.{key}",
                f"is {value!r}: the tokens were drawn from a distribution {key} reshaped, "
                "which the trainer's ratio does not recompute; sample with temperature alone",
            )
    temperature = params.get("temperature")
    if temperature is None:
        raise _Bad(
            f"{name}.temperature",
            "absent: the sampling temperature is not recorded (a server's default is "
            "unknown here), so the log-probs cannot be placed; set temperature in every request",
        )
    if not _number(temperature):
        raise _Bad(f"{name}.temperature", f"must be a finite number, got {temperature!r}")
    return float(temperature)


def sampler_logprobs(value: Any, name: str, n: int) -> list[float]:
    """The per-token log-probabilities a foreign record logged for its ``n`` tokens; ``BadRecord`` when absent (nothing
    to correct against: a ratio of 1 would be assumed silently) or not one finite number per token."""
    if value is None or value == []:
        raise _Bad(
            name,
            f"missing: the record holds no sampler log-probs for its {n} tokens, and without them "
            "nothing can be corrected; log the sampler's per-token log-probs",
        )
    return _logprobs(value, name, n)


def trace_formats() -> list[TraceFormat]:
    """Every registered foreign format (each imported on first use)."""
    return [TRACE_FORMATS.get(name) for name in TRACE_FORMATS]


def format_of(record: Any, known: list[TraceFormat]) -> TraceFormat | None:
    """The foreign format ``record`` is in; None for a sao record (it has a policy_version or is feedback) or for
    anything no format claims (checked as a sao record, so its error names sao's fields)."""
    if not isinstance(record, dict) or "policy_version" in record or record.get("type") == "feedback":
        return None
    return next((f for f in known if f.detect(record)), None)


def line_id(where: str) -> str:
    """The id of a record that carries none: its file's name and line number ("proxy.jsonl:7"), the same on every
    reading of an append-only log."""
    path, _, line = where.rpartition(":")
    return f"{Path(path).name}:{line}"


# ---------------------------------------------------------------------------------------------------------
# The source.


def _log_files(root: Path) -> list[Path]:
    if root.is_dir():
        return sorted(p for p in root.glob("*.jsonl") if p.is_file())
    return [root]


class TraceSource:
    """Batches of logged trajectories (see the module doc), in log order, with every drop counted."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        *,
        batch_size: int,
        max_staleness: int,
        temperature: float,
        vocab_size: int,
        eos_token_ids: list[int],
        pad_token_id: int,
        follow: bool = False,
        follow_timeout: float = 600.0,
        skip_bad: bool = False,
        device: torch.device | str = "cpu",
        warn: Callable[[str], None] = print,
        poll_seconds: float = POLL_SECONDS,
        context_length: int | None = None,
    ):
        self.root = Path(path)
        if not self.root.exists() and not follow:
            raise DataError(f"--traces {self.root}: no such file or folder")
        if self.root.exists() and not self.root.is_dir() and not self.root.is_file():
            raise DataError(
                f"--traces {self.root}: not a regular file (a FIFO or a device has no records to train "
                "on); give the trace log sao serve writes, or a folder of *.jsonl logs"
            )
        if self.root.is_dir() and not _log_files(self.root) and not follow:
            raise DataError(f"--traces {self.root}: the folder holds no *.jsonl files")
        if not follow and self.root.exists() and all(p.stat().st_size == 0 for p in _log_files(self.root)):
            raise DataError(
                f"--traces {self.root}: the log is empty, nothing to train on; serve some requests "
                "first, or pass --follow to wait for them"
            )
        self.tokenizer, self.tokens = tokenizer, Tokens(tokenizer, vocab_size, eos_token_ids)
        self.batch_size, self.max_staleness, self.temperature = batch_size, max_staleness, temperature
        self.pad_token_id, self.device = pad_token_id, torch.device(device)
        self.follow, self.follow_timeout, self.skip_bad = follow, follow_timeout, skip_bad
        self.warn, self.poll_seconds = warn, poll_seconds
        self.context_length = context_length  # prompt + completion tokens a trace may hold (None: not checked)
        self.offsets: dict[str, int] = {}  # file → bytes read
        self.identity: dict[str, list[int]] = {}  # file → [device, inode] of the file those bytes were read from
        self.lines: dict[str, int] = {}  # file → lines read
        self.seen: set[str] = set()  # every trajectory id read: used, usable, waiting or dropped
        self.ready: list[Trace] = []  # usable, not yet batched, in log order
        self.pending: dict[str, Trace] = {}  # waiting for their feedback
        self.early: dict[str, float] = {}  # feedback read before its trajectory
        # not_trajectories: lines of another system's format that hold no trajectory (a tinker train_op)
        self.counts: dict[str, int] = {
            "used": 0,
            **{f"dropped_{r}": 0 for r in DROP_REASONS},
            "feedback_used": 0,
            "feedback_ignored": 0,
            "not_trajectories": 0,
        }
        self.formats = trace_formats()
        self.read_as: dict[str, int] = {}  # foreign format → lines read in it
        self.used_staleness: dict[str, int] = {}  # histogram of the staleness of the trajectories used
        self.ended: str | None = None
        self._warned_footing = False
        self.tasks: dict[str, Any] = {}  # rows carry their own tasks (``Batch.tasks``)

    @classmethod
    def build(cls, context: SourceContext) -> TraceSource:
        """``--rollout traces`` (or ``--traces LOG`` alone): the log the config names, read for the context's model."""
        c, m = context.config, context.models
        r, s = c.rollout, c.source
        return cls(
            r.traces,
            m.tokenizer,
            batch_size=c.training.batch_size,
            max_staleness=s.max_staleness,
            temperature=r.temperature,
            vocab_size=m.policy.get_input_embeddings().num_embeddings,
            eos_token_ids=m.eos_token_ids,
            pad_token_id=m.tokenizer.pad_token_id,
            follow=s.follow,
            follow_timeout=s.follow_timeout,
            skip_bad=s.skip_bad_traces,
            device=m.device,
            warn=context.warn,
            context_length=context_length(m.policy),
        )

    # -- reading ----------------------------------------------------------------------------------------

    def _read(self, want: int) -> int:
        """Read complete new lines, file by file in name order, until ``want`` trajectories are usable or no
        line is left; returns the number of lines read."""
        count = 0
        for path in _log_files(self.root) if self.root.exists() else []:
            key = str(path)
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):  # checked before opening: a FIFO would block the open
                    raise DataError(f"--traces {path}: not a regular file; a trace log is a file sao serve writes")
                handle = open(path, "rb")  # noqa: SIM115 (closed below; the identity is the open file's)
            except OSError:
                continue  # not there (yet, under --follow)
            with handle:
                info = os.fstat(handle.fileno())
                identity = [info.st_dev, info.st_ino]
                if self.identity.get(key, identity) != identity:  # another file at the same path: a new log
                    self.warn(
                        f"{path} was replaced by another file (device and inode changed): reading the new "
                        f"file from its start, after {self.lines.get(key, 0)} lines of the old one"
                    )
                    self.offsets[key], self.lines[key] = 0, 0
                self.identity[key] = identity
                offset, size = self.offsets.get(key, 0), info.st_size
                if size < offset:
                    raise DataError(f"{path} is shorter than the {offset} bytes already read: a log must only grow")
                if size == offset:
                    continue
                handle.seek(offset)
                while len(self.ready) < want:
                    line = handle.readline(MAX_LINE_BYTES + 1)
                    if not line:
                        break
                    if not line.endswith(b"\n"):
                        if len(line) > MAX_LINE_BYTES:
                            rest = handle.readline()
                            while rest and not rest.endswith(b"\n"):
                                rest = handle.readline()
                            if not rest and self.follow:
                                break  # the long line is not finished yet: skip it once it is
                            self.offsets[key] = handle.tell()
                            self.lines[key] = self.lines.get(key, 0) + 1
                            self._bad(
                                f"{path}:{self.lines[key]}", f"field 'record': a line over {MAX_LINE_BYTES >> 20} MiB"
                            )
                            count += 1
                            continue
                        if self.follow:
                            break  # a writer may be mid-line: read it once its newline is there
                    self.offsets[key] = handle.tell()
                    self.lines[key] = self.lines.get(key, 0) + 1
                    count += 1
                    self._line(line, f"{path}:{self.lines[key]}")
            if len(self.ready) >= want:
                break
        return count

    def _bad(self, where: str, problem: str) -> None:
        """A malformed line: one-line ``DataError`` naming file:line and the field, or a counted drop."""
        if not self.skip_bad:
            raise DataError(f"{where}: {problem} (--skip-bad-traces counts and skips such lines)")
        self.counts["dropped_bad_record"] += 1

    def _line(self, line: bytes, where: str) -> None:
        text = line.strip()
        if not text:
            return  # a blank line is not a record
        try:  # the bounded reader: nesting, long integers, NaN and 1e400 are refused before anything reads them
            record = parse_jsonl_line(text, where=where, limits=TRACE_LIMITS)
        except DataError as error:
            problem = str(error).removeprefix(f"{where}: ")
            return self._bad(where, problem if problem.startswith("field ") else f"field 'record': {problem}")
        fmt = format_of(record, self.formats)
        if fmt is None:
            return self._record(record, where)
        try:
            records = fmt.records(record, self.tokens, where)
        except _Bad as bad:
            return self._bad(where, f"{bad} (a {fmt.name} record)")
        self.read_as[fmt.name] = self.read_as.get(fmt.name, 0) + 1
        if not records:
            self.counts["not_trajectories"] += 1  # a tinker train_op, say
        for each in records:
            self._record(each, where, fmt.name)

    def _record(self, record: Any, where: str, mapped_from: str | None = None) -> None:
        """One sao record (read, or mapped from a ``mapped_from`` record): checked, then used, waiting or dropped."""
        try:
            kind = check_record(record)
            if kind == "feedback":
                return self._feedback(record["id"], float(record["reward"]))
            if record["id"] in self.seen:
                self.counts["dropped_duplicate_id"] += 1
                return
            trace = parse_trace(record, self.tokens, where)
        except _Bad as bad:
            return self._bad(where, str(bad) if mapped_from is None else f"{bad} (a {mapped_from} record, mapped)")
        except _Misaligned:
            self.seen.add(record["id"])
            self.counts["dropped_misaligned"] += 1
            return
        self.seen.add(trace.id)
        if not any(trace.action):
            self.counts["dropped_empty"] += 1
        elif self.context_length is not None and len(trace.prompt) + len(trace.response) > self.context_length:
            self.counts["dropped_too_long"] += 1  # more tokens than the model attends over: not trainable as logged
        elif abs(trace.temperature - self.temperature) > 1e-6:
            self.counts["dropped_footing_mismatch"] += 1
            if not self._warned_footing:
                self._warned_footing = True
                self.warn(
                    f"{where}: trace {trace.id!r} was sampled at temperature {trace.temperature}, this run trains"
                    f" at --temperature {self.temperature}: dropped (and every such trace); set --temperature to"
                    " the serving temperature"
                )
        elif trace.rewarded:
            self.ready.append(trace)
        elif trace.id in self.early:
            trace.reward = self.early.pop(trace.id)
            self.counts["feedback_used"] += 1
            self.ready.append(trace)
        else:
            self.pending[trace.id] = trace

    def _feedback(self, trace_id: str, reward: float) -> None:
        if trace_id in self.pending:
            trace = self.pending.pop(trace_id)
            trace.reward = reward
            self.ready.append(trace)
            self.counts["feedback_used"] += 1
        elif trace_id in self.seen or trace_id in self.early:
            self.counts["feedback_ignored"] += 1  # its trajectory had a reward, was dropped, or feedback came twice
        else:
            self.early[trace_id] = reward

    # -- batches ----------------------------------------------------------------------------------------

    def _admit(self, policy_version: int) -> None:
        """Drop the waiting trajectories that are too stale or from a future version, counting each."""
        kept = []
        for trace in self.ready:  # the bound holds for every action token: the oldest is the row's staleness
            staleness = policy_version - trace.version
            if policy_version - trace.newest < 0:
                self.counts["dropped_future_version"] += 1
            elif staleness > self.max_staleness:
                self.counts["dropped_too_stale"] += 1
            else:
                kept.append(trace)
        self.ready = kept

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        idle_since = None
        while True:
            self._admit(policy_version)
            if len(self.ready) >= self.batch_size:
                break
            if self._read(self.batch_size):
                idle_since = None
                continue
            if not self.follow:
                self._end(f"the trace log {self.root} is read to its end")
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= self.follow_timeout:
                self._end(f"no new trace in {self.root} for {self.follow_timeout:g} s")
            time.sleep(self.poll_seconds)
        rows, self.ready = self.ready[: self.batch_size], self.ready[self.batch_size :]
        staleness = [policy_version - t.version for t in rows]
        self.counts["used"] += len(rows)
        for s in staleness:
            self.used_staleness[str(s)] = self.used_staleness.get(str(s), 0) + 1
        return Batch(
            task_ids=[t.id for t in rows],
            rollout=self.rollout(rows),
            staleness=staleness,
            info=self.info(),
            tasks=[t.task if (t.reward is None and t.turn_rewards is None) else None for t in rows],
        )

    def _end(self, why: str) -> None:
        """No further batch: what waits for feedback will not get it in this run."""
        self.counts["dropped_no_reward"] += len(self.pending)
        self.pending.clear()
        left = len(self.ready)
        self.ended = why + (f"; {left} usable trace(s) left, fewer than a batch of {self.batch_size}" if left else "")
        raise SourceExhausted(self.ended)

    def rollout(self, rows: list[Trace]) -> Rollout:
        """The trajectories as the trainer's batch: prompts left-padded, responses right-padded, each turn's
        reward on its last action token (0 where the trainer will grade the row's task)."""
        B, P, R = len(rows), max(len(t.prompt) for t in rows), max(len(t.response) for t in rows)
        pad = self.pad_token_id
        prompt_ids = torch.full((B, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.bool)
        response_ids = torch.full((B, R), pad, dtype=torch.long)
        response_mask = torch.zeros(B, R, dtype=torch.bool)
        action_mask = torch.zeros(B, R, dtype=torch.bool)
        logprobs = torch.zeros(B, R, dtype=torch.float32)
        turn_rewards = torch.zeros(B, R, dtype=torch.float32)
        for i, t in enumerate(rows):
            n = len(t.response)
            prompt_ids[i, P - len(t.prompt) :] = torch.tensor(t.prompt)
            prompt_mask[i, P - len(t.prompt) :] = True
            response_ids[i, :n] = torch.tensor(t.response)
            response_mask[i, :n] = True
            action_mask[i, :n] = torch.tensor(t.action)
            logprobs[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
            if t.turn_rewards is not None:
                for end, value in zip(t.turn_ends, t.turn_rewards, strict=True):
                    turn_rewards[i, end] = value
            elif t.reward is not None:
                turn_rewards[i, t.turn_ends[-1]] = t.reward
        texts = self.tokenizer.batch_decode([t.response for t in rows], skip_special_tokens=True)
        d = self.device
        versions = None
        if any(t.versions is not None for t in rows):  # [B, R] each token's version (a row of one: that one)
            versions = torch.tensor(
                [(t.versions or [t.version] * len(t.response)) + [t.version] * (R - len(t.response)) for t in rows],
                dtype=torch.long,
                device=d,
            )
        return Rollout(
            prompt_ids=prompt_ids.to(d),
            prompt_mask=prompt_mask.to(d),
            response_ids=response_ids.to(d),
            response_mask=response_mask.to(d),
            action_mask=action_mask.to(d),
            sampler_logprobs=logprobs.to(d),
            cut=torch.tensor([t.cut for t in rows], device=d),
            texts=texts,
            turns=Turns(
                rewards=turn_rewards.to(d),
                count=torch.tensor([len(t.turn_ends) for t in rows], device=d),
                tool_calls=torch.zeros(B, dtype=torch.long, device=d),
                tool_errors=torch.zeros(B, dtype=torch.long, device=d),
                unfinished=torch.zeros(B, dtype=torch.bool, device=d),
            ),
            versions=versions,
        )

    def info(self) -> dict[str, Any]:
        """The counters so far (logged with each step, and the run's summary)."""
        dropped = sum(self.counts[f"dropped_{r}"] for r in DROP_REASONS)
        return {
            **{f"traces_{k}": v for k, v in self.counts.items()},
            "traces_dropped": dropped,
            "traces_waiting_for_feedback": len(self.pending),
            "traces_feedback_unmatched": len(self.early),  # feedback for an id not (yet) logged: used if it comes
            "traces_staleness_hist": dict(sorted(self.used_staleness.items(), key=lambda kv: int(kv[0]))),
        }

    def summary(self) -> dict[str, Any]:
        """The run's totals: the counters, the staleness histogram of what was used, and why reading ended."""
        return {
            **self.info(),
            "traces_usable_unused": len(self.ready),
            "traces_ended": self.ended,
            "traces_read_as": dict(self.read_as),
        }

    # -- the rest of the Source protocol ---------------------------------------------------------------

    def after_update(self, policy_version: int) -> None:
        """Nothing here: the trainer publishes each adapter for the server (``RUN/published``)."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "offsets": dict(self.offsets),
            "lines": dict(self.lines),
            "identity": dict(self.identity),
            "seen": sorted(self.seen),
            "ready": [dataclasses.asdict(t) for t in self.ready],
            "pending": [dataclasses.asdict(t) for t in self.pending.values()],
            "early": dict(self.early),
            "counts": dict(self.counts),
            "used_staleness": dict(self.used_staleness),
            "warned_footing": self._warned_footing,
            "read_as": dict(self.read_as),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offsets, self.lines = dict(state["offsets"]), dict(state["lines"])
        self.identity = {k: list(v) for k, v in state.get("identity", {}).items()}  # absent in older checkpoints
        self.seen = set(state["seen"])
        self.ready = [Trace(**t) for t in state["ready"]]
        self.pending = {t["id"]: Trace(**t) for t in state["pending"]}
        self.early = dict(state["early"])
        self.counts = {**self.counts, **state["counts"]}
        self.used_staleness = dict(state["used_staleness"])
        self._warned_footing = bool(state.get("warned_footing", False))
        self.read_as = dict(state.get("read_as", {}))  # absent in older checkpoints

    def close(self) -> None:
        pass


__all__ = [
    "DROP_REASONS",
    "SCHEMA_FILE",
    "BadRecord",
    "Tokens",
    "Trace",
    "TraceFormat",
    "TraceSource",
    "check_record",
    "line_id",
    "parse_trace",
]
