"""The policy ``sao serve`` samples from: the preset's base model with the trainer's LoRA adapter, one version
at a time, and the adapter watcher that swaps in each version the trainer publishes.

    version 0    base + a fresh LoRA built exactly as the trainer builds its policy (``Models.load`` with the
                 config's model, rank, alpha and seed: B = 0, so it is the base model), so that version 0's
                 log-probabilities are the trainer's version-0 teacher-forced ones
    version N    ``RUN/published/v{N}/`` (an adapter folder of ``sao.model.artifacts.save_adapter``), named by
                 ``RUN/published/LATEST.json`` = {"version": N, "path": "v{N}"}; its LoRA tensors are copied into
                 the live modules in place, under the generation lock: never in the middle of a reply. A rollback
                 (the trainer's gate, ``sao.training.gate``) is LATEST.json naming an older version again, with
                 ``"rolled_back_from": M``: reloaded like any other, and said as a rollback
    sampling     ``sao.rollout.sampler.draw`` through ``PlainDecoder``: float32 logits / τ, Gumbel-max, and the
                 drawn token's log-probability under exactly that distribution. The EOS token, when drawn, is
                 part of the completion and carries its log-probability (as in the trainer's rollouts)

Deliberately left out: batching concurrent requests (one reply at a time, serialised by a lock), top-p/top-k,
stop strings, and any sampler other than the plain loop.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sao.core.config import Config
from sao.core.errors import ConfigError, DataError, SaoError
from sao.core.reading import Limits, read_json_file
from sao.model.artifacts import ADAPTER_CONFIG
from sao.model.policy import POLICY_ADAPTER, Models, context_length, lora_state, model_path
from sao.rollout.sampler import PlainDecoder, encode_prompts

PUBLISHED, LATEST = "published", "LATEST.json"
GRACE_SECONDS = 10.0  # how long an adapter LATEST.json names may stay unreadable (being written) before it is said
ADAPTER_WEIGHTS = "adapter_model.safetensors"
SMALL = Limits(max_bytes=1 << 20)  # LATEST.json names one version


@dataclass
class Completion:
    """One reply as drawn: ids (EOS included when drawn), their log-probabilities, and how it ended."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS drawn) or "length" (max_tokens reached)
    policy_version: int
    adapter: str


class ServedPolicy:
    """The base model + the current adapter version, a tokenizer, and the lock every use of them takes."""

    def __init__(self, config: Config, *, device: str = "cpu"):
        self.config = config
        self.model_path = model_path(config.model.name)
        self.models = Models.load(
            self.model_path,
            device=device,
            lora_rank=config.model.lora_rank,
            lora_alpha=config.model.lora_alpha,
            seed=config.training.seed,
        )
        self.tokenizer = self.models.tokenizer
        self.context_length = context_length(self.models.policy)  # prompt + reply, in tokens
        self.lock = threading.Lock()  # one reply or one adapter swap at a time
        self.version, self.adapter = 0, "initial"
        self._lora = lora_state(self.models.policy, POLICY_ADAPTER)  # live tensors by name
        self._decoder = PlainDecoder(self.models.policy)

    # -- prompts and sampling ------------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids, _ = encode_prompts(self.tokenizer, [text], torch.device("cpu"))
        return ids[0].tolist()

    def complete(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, seed: int) -> Completion:
        """One reply to ``prompt_ids`` (already chat-formatted), drawn with the current adapter. Callers hold
        ``self.lock`` (``generate`` does) so that the version recorded is the one that drew the reply."""
        device = self.models.device
        generator = torch.Generator(device=device).manual_seed(seed)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, P]
        rollout = self._decoder.generate(
            ids,
            torch.ones_like(ids, dtype=torch.bool),
            max_new_tokens=max_tokens,
            temperature=temperature,
            eos_token_ids=self.models.eos_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            generator=generator,
        )
        keep = rollout.response_mask[0]  # [R] True through the EOS token
        completion = rollout.response_ids[0][keep].tolist()
        return Completion(
            prompt_token_ids=list(prompt_ids),
            completion_token_ids=completion,
            logprobs=rollout.sampler_logprobs[0][keep].tolist(),
            text=self.tokenizer.decode(completion, skip_special_tokens=True),
            finish_reason="length" if bool(rollout.truncated[0]) else "stop",
            policy_version=self.version,
            adapter=self.adapter,
        )

    def generate(self, prompt_ids: list[int], **settings: Any) -> Completion:
        with self.lock:
            return self.complete(prompt_ids, **settings)

    # -- adapter versions ----------------------------------------------------------------------------------

    def read_adapter(self, folder: Path) -> dict[str, torch.Tensor]:
        """The LoRA tensors of a saved adapter folder, keyed by the live parameter names, checked to match
        the live adapter name for name and shape (a ConfigError otherwise: the folder is not this policy's)."""
        from safetensors.torch import load_file

        config_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
        if not weights.is_file() or not config_file.is_file():
            raise ConfigError(f"{folder} holds no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
        saved_config = read_json_file(config_file, error=ConfigError)
        try:
            state = load_file(str(weights))
        except Exception as error:  # OSError, ValueError, safetensors' own error on a file still being written
            raise ConfigError(f"{folder}: could not read the adapter ({type(error).__name__}: {error})") from None
        rank, alpha = saved_config.get("r"), saved_config.get("lora_alpha")
        if (rank, alpha) != (self.config.model.lora_rank, self.config.model.lora_alpha):
            raise ConfigError(
                f"{folder}: LoRA rank {rank}, alpha {alpha}; this server runs rank {self.config.model.lora_rank}, "
                f"alpha {self.config.model.lora_alpha}"
            )
        marker = f".{POLICY_ADAPTER}."
        live = {name.replace(marker, "."): name for name in self._lora}  # saved name → live name
        if set(state) != set(live):
            missing, extra = sorted(set(live) - set(state)), sorted(set(state) - set(live))
            raise ConfigError(
                f"{folder}: the adapter's tensors do not match ({len(missing)} missing, {len(extra)} "
                f"unexpected, e.g. {(missing or extra)[0]})"
            )
        out = {}
        for saved, name in live.items():
            if state[saved].shape != self._lora[name].shape:
                raise ConfigError(
                    f"{folder}: {saved} has shape {tuple(state[saved].shape)}, expected {tuple(self._lora[name].shape)}"
                )
            out[name] = state[saved]
        return out

    def take(self, folder: Path, version: int) -> None:
        """Serve the adapter in ``folder`` as ``version`` from the next reply on (read outside the lock)."""
        self.swap(self.read_adapter(folder), version, str(folder))

    @torch.no_grad()
    def swap(self, tensors: dict[str, torch.Tensor], version: int, adapter: str) -> None:
        """Copy ``tensors`` (from ``read_adapter``) into the live adapter: between replies, never during one."""
        with self.lock:
            for name, value in tensors.items():
                self._lora[name].copy_(value.to(self._lora[name].device, self._lora[name].dtype))
            self.version, self.adapter = version, adapter


class AdapterWatcher:
    """Polls ``RUN/published/LATEST.json`` and swaps each new version into ``policy`` (a daemon thread)."""

    def __init__(self, policy: ServedPolicy, run: str | os.PathLike[str], *, interval: float = 0.5, say=print):
        self.policy, self.run, self.interval, self.say = policy, Path(run), interval, say
        self.latest = self.run / PUBLISHED / LATEST
        self._failed: set[tuple[int, str]] = set()  # versions whose load failed, reported once each
        self._failing_since: dict[tuple[int, str], float] = {}  # a version not readable yet: maybe mid-write
        self.grace = GRACE_SECONDS
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sao-serve-watch", daemon=True)

    def start(self) -> AdapterWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as error:  # never let the watcher die: report and poll again
                self.say(f"sao serve: adapter watcher: {type(error).__name__}: {error}")
            self._stop.wait(self.interval)

    def poll(self) -> bool:
        """Load the version LATEST.json names when it differs from the served one. True when one was loaded."""
        try:
            if not self.latest.exists():
                return False  # nothing published yet: keep serving what is served
            latest = read_json_file(self.latest, limits=SMALL)
            version, path = latest["version"], latest["path"]
            if not isinstance(version, int) or isinstance(version, bool) or version < 0 or not isinstance(path, str):
                raise ValueError
        except FileNotFoundError:
            return False  # nothing published yet: keep serving what is served
        except (OSError, ValueError, KeyError, TypeError, DataError):
            key = (-1, "LATEST")
            if key not in self._failed:
                self._failed.add(key)
                self.say(
                    f"sao serve: {self.latest} is not {{'version': N, 'path': 'vN'}}; keeping v{self.policy.version}"
                )
            return False
        if version == self.policy.version:
            return False
        folder = (self.latest.parent / path).resolve()
        served = self.policy.version
        try:
            self.policy.take(folder, version)  # read outside the lock: replies keep flowing meanwhile
        except SaoError as error:  # a half-written adapter is waited for: retried each poll, said once if it stays
            since = self._failing_since.setdefault((version, path), time.monotonic())
            if (version, path) not in self._failed and time.monotonic() - since >= self.grace:
                self._failed.add((version, path))
                self.say(f"sao serve: cannot load v{version}: {error}; keeping v{self.policy.version}")
            return False
        self._failing_since.pop((version, path), None)
        rolled_back = latest.get("rolled_back_from")
        if isinstance(rolled_back, int) and not isinstance(rolled_back, bool):  # the trainer's gate (--gate)
            self.say(f"sao serve: rolled back to v{version}: v{rolled_back} regressed on live traffic")
        elif version < served:
            self.say(f"sao serve: the trainer published v{version} after v{served} (a resumed run?)")
        self.say(f"sao serve: serving adapter v{version} ({folder}) at {time.strftime('%H:%M:%S')}")
        return True


__all__ = ["AdapterWatcher", "Completion", "ServedPolicy"]
