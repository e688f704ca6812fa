"""The remote-engine seam: what a remote source (``sao.rollout.remote``) needs of an inference server.

    EngineClient   one server: token ids in, token ids and processed log-probs out (``complete``), adapters loaded
                   and unloaded by name, its health; ``url`` names it
    EngineServer   a server sao started (and so restarts when it dies, and stops)
    Connection     what an engine hands the source: its clients, the servers it started, its limits
    Completion     one checked completion: the sampled tokens with the log-probability each was drawn with

An engine is a ``RemoteSettings`` subclass (``sao.rollout.registry``) whose ``connect(context)`` returns a
``Connection``; vLLM's is ``sao.rollout.vllm``. Only the standard library is imported here. Deliberately left out:
chat requests and text prompts (the source owns the template and the token ids) and streaming.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Completion:
    """One checked completion. ``sampler_logprobs[i]`` is log p(completion_token_ids[i]) as the sampler drew it."""

    prompt_token_ids: list[int]  # [P] as echoed by the server (checked equal to what was sent)
    completion_token_ids: list[int]  # [C] the sampled tokens, a stop token included when one was drawn
    sampler_logprobs: list[float]  # [C] one finite log-prob <= 0 per completion token, after temperature
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_tokens reached)
    text: str  # the server's detokenised completion (special tokens skipped), for reading only


class EngineClient(Protocol):
    """One inference server as a remote source uses it. Every failure is one line (a ``SaoError``)."""

    url: str  # the server's identity: two clients with one url are one server

    def health(self, *, deadline: float | None = None) -> bool:
        """Whether the server answers as healthy; unreachable after ``deadline`` seconds raises."""
        ...

    def complete(
        self,
        prompt_token_ids: Sequence[int],
        *,
        model: str,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> Completion:
        """One completion of a token-id prompt by ``model`` (an adapter's name, or the base model's), sampled at
        ``temperature`` with no top-p, top-k or penalty, each token's log-probability recorded after temperature."""
        ...

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        """Serve the PEFT adapter folder ``path`` under ``name`` (a fresh name per version)."""
        ...

    def unload_adapter(self, name: str) -> None: ...


class EngineServer(Protocol):
    """A server the run started: it is restarted when it dies and stopped when the run ends."""

    url: str
    pid: int | None
    log_path: Path | None
    startup_seconds: float | None

    def start(self) -> EngineServer: ...

    def running(self) -> bool: ...

    def restart(self) -> EngineServer: ...

    def client(self, **kwargs: object) -> EngineClient: ...

    def stop(self) -> None: ...


@dataclass
class Connection:
    """An engine's servers as a remote source sees them: a client per server (an address given twice spreads requests
    twice as often to it), the servers started for this run (none when it joined running ones, in the same order as
    ``clients`` otherwise), the longest prompt + reply they take, and how many adapters one holds at once."""

    clients: list[EngineClient]
    servers: list[EngineServer] = field(default_factory=list)
    max_model_len: int = 4096
    resident_adapters: int = 3
    client_options: dict[str, object] = field(default_factory=dict)  # how a started server's client is made
    # How a full-weight version reaches one server: (client, folder, version, previous folder or None) → the name
    # requests then use; None when the engine serves adapters only (vLLM's: sao.rollout.vllm_weights.reload_into).
    load_weights: Callable[..., str] | None = None
