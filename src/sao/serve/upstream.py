"""``sao serve --upstream URL``: the same endpoint, its replies drawn by a vLLM server.

``UpstreamPolicy`` stands where ``ServedPolicy`` does: it renders the chat template and sends token ids to vLLM
(``/v1/completions``), and takes back token ids and log-probs after temperature, so the trace log is what it is
with sao's own sampler; requests are not serialised (vLLM batches them continuously). Each adapter the trainer
publishes is loaded into vLLM under a name of this server's own and replies go to it from then on; the base
model answers until the first one (version 0: LoRA's B is 0, so the base is the trainer's version 0). A rollback
(LATEST.json naming an older version again) switches back to that version's name when vLLM still holds it, and
loads it again otherwise: the same watcher drives both servers. A published full-weight version (a folder of
safetensors shards, no adapter_config.json) is reloaded into vLLM in place (``sao.rollout.vllm_weights``: the
server runs with VLLM_SERVER_DEV_MODE=1 and reads the folder itself) and replies go to the base model's name; the
swap waits for the replies in flight and holds new ones back until it is done, so each reply records the version
whose weights drew it. A vLLM that restarts forgets every adapter loaded into it: the first request it answers
"no such model" loads the served one again (once) and is sent again. Every call honours ``--upstream-timeout``.

Deliberately left out: launching vLLM (start it, or let ``sao train --rollout vllm --vllm-launch`` do so) and
checking that the server logs processed log-probs (the trainer's footing audit does, before any step trains).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sao.core.config import Config
from sao.model.artifacts import ADAPTER_CONFIG
from sao.rollout.vllm import VllmClient, VllmError
from sao.rollout.vllm_weights import WeightFolder, base_weights, load_weights
from sao.serve.served import Completion


class SwapGate:
    """Replies pass together; a full-weight swap passes alone, after the replies in flight and before any new one."""

    def __init__(self):
        self._cond = threading.Condition()
        self._replies, self._swapping, self._waiting = 0, False, 0

    @contextlib.contextmanager
    def reply(self) -> Iterator[None]:
        with self._cond:
            while self._swapping or self._waiting:
                self._cond.wait()
            self._replies += 1
        try:
            yield
        finally:
            with self._cond:
                self._replies -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def swap(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._swapping or self._replies:
                self._cond.wait()
            self._waiting -= 1
            self._swapping = True
        try:
            yield
        finally:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()


class UpstreamPolicy:
    """The vLLM server at ``url`` behind the endpoint: a tokenizer here, the model and the adapters there."""

    def __init__(self, config: Config, url: str, *, keep: int = 3):
        from transformers import AutoTokenizer

        from sao.model.policy import model_path

        self.config, self.url, self.keep = config, url, keep
        self.tokenizer = AutoTokenizer.from_pretrained(model_path(config.model.name))
        wait = config.serve.upstream_timeout
        self.client = VllmClient(url, timeout=wait, connect_deadline=wait, setting="--upstream-timeout")
        models = self.client.models()
        self.base = models[0]  # vLLM lists the base model first
        self.tag = "serve-" + hashlib.sha256(f"{url}:{os.getpid()}:{time.time()}".encode()).hexdigest()[:8]
        self.lock = threading.Lock()  # adapter swaps only; replies run concurrently
        self.gate = SwapGate()  # full-weight swaps: no reply in flight while the weights change
        self.model = model_path(config.model.name)
        self.weights: WeightFolder | None = None  # the full weights vLLM holds, once a version was swapped in
        self.reload_lock = threading.Lock()  # one reload after a restart, whoever finds it first
        self.version, self.adapter, self.name = 0, "initial", self.base
        self.loaded: list[str] = []
        self.eos = sorted(
            {i for i in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if i is not None}
            if self.tokenizer.eos_token_id is None
            else {self.tokenizer.eos_token_id}
        )

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, seed: int) -> Completion:
        with self.gate.reply():
            with self.lock:
                name, version, adapter = self.name, self.version, self.adapter

            def ask() -> Any:
                return self.client.complete(
                    prompt_ids,
                    model=name,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=seed,
                    stop_token_ids=self.eos,
                )

            try:
                reply = ask()
            except VllmError as error:
                if name == self.base or not _unknown_model(error):
                    raise
                self._load_again(name, adapter)  # the server restarted and forgot it: loaded again, the request resent
                reply = ask()
        return Completion(
            prompt_token_ids=list(reply.prompt_token_ids),
            completion_token_ids=list(reply.completion_token_ids),
            logprobs=list(reply.sampler_logprobs),
            text=self.tokenizer.decode(reply.completion_token_ids, skip_special_tokens=True),
            finish_reason=reply.finish_reason,
            policy_version=version,
            adapter=adapter,
        )

    def _load_again(self, name: str, folder: str) -> None:
        """Load adapter ``name`` from ``folder`` into the server again, unless it already holds it (another request
        got here first); what it no longer holds is forgotten here too."""
        with self.reload_lock:
            held = set(self.client.models())
            if name not in held:
                self.client.load_adapter(name, folder)
                held.add(name)
            with self.lock:
                self.loaded = [n for n in self.loaded if n in held]

    def take(self, folder: Path, version: int) -> None:
        """Serve the adapter or the full weights in ``folder`` as ``version`` from the next request on (vLLM reads
        the folder by path)."""
        if not (Path(folder) / ADAPTER_CONFIG).is_file():
            weights = WeightFolder(folder)
            with self.gate.swap():
                load_weights(self.client, weights, version, previous=self.weights or base_weights(self.model))
                with self.lock:
                    self.name, self.version, self.adapter = self.base, version, str(folder)
                    self.weights = weights
            return
        name = f"{self.tag}-v{version}"
        if name not in self.loaded:  # a rollback to a version vLLM still holds switches back to it
            self.client.load_adapter(name, folder)
        with self.lock:
            self.name, self.version, self.adapter = name, version, str(folder)
            self.loaded = [n for n in self.loaded if n != name] + [name]
            old, self.loaded = self.loaded[: -self.keep], self.loaded[-self.keep :]
        for stale in old:  # a request already sent to one of these finishes: vLLM holds the adapter while it runs
            with contextlib.suppress(VllmError):
                self.client.unload_adapter(stale)

    def describe(self) -> dict[str, Any]:
        return {"upstream": self.url, "base": self.base}


def _unknown_model(error: VllmError) -> bool:
    """Whether vLLM refused a request for naming a model it does not hold (its 404 "The model ... does not exist")."""
    return error.status == 404 or "does not exist" in str(error)
