"""A fake inference engine on the remote-engine seam: a new engine is this one file plus its registry line (the last).

``FakeClient`` is a "server" in this process: its own copy of the base model, the adapters it was handed loaded by
name, each completion drawn by sao's reference sampler at the requested temperature with the log-probability of each
token after temperature, as a real engine in ``processed_logprobs`` mode returns them. ``--fake-ignores-adapters``
makes it a broken server that keeps answering with the base model, for the delivery check to catch.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load_file

from sao.core.settings import option
from sao.model.policy import add_lora, load_base, lora_state
from sao.rollout.engines import Completion, Connection
from sao.rollout.registry import SOURCES, RemoteSettings
from sao.rollout.sampler import draw


class FakeClient:
    def __init__(self, model_name: str, lora_rank: int, lora_alpha: int, ignores_adapters: bool):
        base, self.tokenizer = load_base(model_name, torch.device("cpu"))
        self.model = add_lora(base, rank=lora_rank, alpha=lora_alpha)
        self.params = lora_state(self.model)
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.ignores_adapters, self.url, self.lock = ignores_adapters, f"fake://{id(self)}", threading.Lock()
        self.untrained = {n: torch.zeros_like(p) for n, p in self.params.items() if "lora_B" in n}

    def health(self, *, deadline: float | None = None) -> bool:
        return True

    def load_adapter(self, name: str, path: str | os.PathLike[str]) -> None:
        state = load_file(os.path.join(path, "adapter_model.safetensors"))
        self.adapters[name] = {n: state[n.replace(".default.", ".")] for n in self.params}

    def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name)

    @torch.no_grad()
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
        with self.lock:  # one "GPU": requests take turns
            weights = self.untrained if self.ignores_adapters else self.adapters[model]
            for name, p in self.params.items():
                p.copy_(weights.get(name, p))
            prompt = torch.tensor([list(prompt_token_ids)])
            generator = torch.Generator().manual_seed(seed or 0)
            drawn = draw(
                self.model,
                prompt,
                torch.ones_like(prompt, dtype=torch.bool),
                max_new_tokens=max_tokens,
                temperature=temperature,
                eos_token_ids=list(stop_token_ids),
                pad_token_id=self.tokenizer.pad_token_id,
                generator=generator,
            )
        keep = drawn.response_mask[0]  # [R] through the stop token
        ids = drawn.response_ids[0][keep].tolist()
        reason = "stop" if ids and ids[-1] in stop_token_ids else "length"
        return Completion(list(prompt_token_ids), ids, drawn.sampler_logprobs[0][keep].tolist(), reason, "")


@dataclasses.dataclass(frozen=True)
class FakeSettings(RemoteSettings):
    """``--rollout fake``: an engine in this process (tests only), as the stale sampler."""

    implementation = "sao.rollout.remote:RemoteSource"
    engine = "fake"
    lag: int = option(4, "The sampler's adapter is refreshed every LAG policy steps.")
    fake_ignores_adapters: bool = option(False, "Answer with the base model whatever adapter is asked for.")

    def connect(self, context: Any) -> Connection:
        m = context.models
        client = FakeClient(
            m.name, context.config.model.lora_rank, context.config.model.lora_alpha, self.fake_ignores_adapters
        )
        return Connection([client], max_model_len=512)


SOURCES.register("fake", FakeSettings)
