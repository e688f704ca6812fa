"""Drawing trajectories: the plain decode loop and the stale sampler the protocol asks for.

    draw    prefill once, then one token per step from a KV cache: float32 logits / τ, a seeded Gumbel-max draw
            (``gumbel_sample_``), the drawn token's log-probability (logit − logsumexp) recorded with it; no top-p,
            top-k or repetition penalty (the ratio needs common support); a row stops at EOS
    stale   a second LoRA adapter on the same base, a frozen copy of the policy's: at step k it draws, then copies
            the policy when k is a multiple of LAG (LAG = 0 refreshes before every draw)

``PlainDecoder`` puts the loop behind the ``Decoder`` protocol; the GPU engine keeps the same contract.
Deliberately left out: beam search, speculative decoding, stop strings other than EOS.
Design notes: docs/design/sampler.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from sao.model.forward import cache_keyword, logits_fp32, position_ids_from, trunk_and_head
from sao.model.policy import POLICY_ADAPTER, SAMPLER_ADAPTER, context_length, lora_state
from sao.rollout.types import Rollout


def encode_prompts(tokenizer, prompts: Sequence[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompt strings (already chat-formatted) into left-padded [B, P] ids and bool mask."""
    enc = tokenizer(list(prompts), add_special_tokens=False, padding=True, return_tensors="pt")
    if tokenizer.padding_side != "left":
        raise ValueError("the tokenizer must pad on the left for batched decoding")
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of values, stable across processes and machines."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def gumbel_sample_(logits: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits) by Gumbel-max, and its log-probability. In place: both inputs
    are overwritten, so the only vocabulary-sized tensors are the two passed in.

    logits [B, V] float32, already divided by the temperature; noise [B, V] float32 uniform in [0, 1).
    token = argmax(logits + g) with g = −log(−log u); log-prob = logits[token] − logsumexp(logits), the
    formula of the teacher-forced pass. Returns (token [B] long, log-prob [B] float32).

    This is the one sampling formula of the project: the plain loop and the engine both call it, so on the
    CPU they draw the same tokens bit for bit. (Gumbel-max on log_softmax(logits) is the same distribution
    in exact arithmetic, but its float rounding picks a different argmax about once in 4M draws.)
    """
    gumbel_neg = noise.clamp_min_(1e-20).log_().neg_().log_()  # −g = log(−log u), in place  [B, V]
    token = torch.sub(logits, gumbel_neg, out=noise).argmax(dim=-1)  # logits + g, in place  [B]
    chosen = logits.gather(-1, token[:, None]).squeeze(-1)  # [B]
    # logsumexp as torch.logsumexp computes it (max, exp of the shifted logits, sum, log, + max), in place
    top = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    lse = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))  # [B]
    return token, chosen - lse


@torch.no_grad()
def draw(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    generator: torch.Generator,
    share: tuple[slice, int] | None = None,
) -> Rollout:
    """Sample up to ``max_new_tokens`` per prompt with the model's active adapter (the plain path). ``share``: these
    prompts are rows ``share[0]`` of a batch of ``share[1]`` (one process's part of a batch the processes draw
    together): each step draws the whole batch's [B, V] noise and these rows take theirs, so every row gets the
    tokens one call over the whole batch gives it."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    from transformers import DynamicCache

    trunk, head = trunk_and_head(model)
    kw = cache_keyword(trunk)
    B = prompt_ids.shape[0]
    device = prompt_ids.device
    eos = torch.tensor(list(eos_token_ids), device=device)
    cache = DynamicCache()
    mask = prompt_mask.long()
    positions = position_ids_from(mask)
    out = trunk(input_ids=prompt_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{kw: cache})
    hidden = out.last_hidden_state[:, -1]  # [B, H]
    next_pos = positions[:, -1] + 1  # [B]

    tokens, logps = [], []
    done = torch.zeros(B, dtype=torch.bool, device=device)
    alive_masks = []
    for _ in range(max_new_tokens):
        logits = logits_fp32(head, hidden, temperature)  # [B, V]
        if share is None:
            noise = torch.rand(logits.shape, generator=generator, device=device, dtype=torch.float32)  # [B, V]
        else:  # the whole batch's draw, these rows' part of it
            noise = torch.rand((share[1], logits.shape[1]), generator=generator, device=device, dtype=torch.float32)[
                share[0]
            ]
        token, token_logp = gumbel_sample_(logits, noise)  # [B], [B]
        alive = ~done
        tokens.append(torch.where(alive, token, torch.full_like(token, pad_token_id)))
        logps.append(torch.where(alive, token_logp, torch.zeros_like(token_logp)))
        alive_masks.append(alive)
        done = done | torch.isin(token, eos)
        if bool(done.all()):
            break
        mask = torch.cat([mask, alive.long()[:, None]], dim=1)
        out = trunk(
            input_ids=tokens[-1][:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{kw: cache},
        )
        hidden = out.last_hidden_state[:, -1]
        next_pos = next_pos + 1

    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask.bool(),
        response_ids=torch.stack(tokens, dim=1),
        response_mask=torch.stack(alive_masks, dim=1),
        action_mask=torch.stack(alive_masks, dim=1),
        sampler_logprobs=torch.stack(logps, dim=1),
        cut=~done,
    )


class PlainDecoder:
    """The reference decoder (``draw``) behind the ``Decoder`` protocol: the model runs with ``adapter`` active
    (None: whatever is active), and the policy's own adapter is active again afterwards."""

    def __init__(self, model: nn.Module, adapter: str | None = None):
        self.model, self.adapter = model, adapter
        self.device = next(model.parameters()).device
        self.context_length = context_length(model)  # prompt + response positions, at most

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **settings) -> Rollout:
        with self.active() as model:
            return draw(model, prompt_ids, prompt_mask, **settings)

    @contextmanager
    def stepper(self, rows: int, capacity: int) -> Iterator[HFStepper]:
        """A multi-turn session (``sao.rollout.episodes``): the model with this decoder's adapter active, over a
        growing ``DynamicCache`` (``rows`` and ``capacity`` are the engine's concern; this cache grows as fed)."""
        with self.active() as model:
            yield HFStepper(model)

    @contextmanager
    def active(self):
        """The model with this decoder's adapter active (multi-turn episodes draw through it too)."""
        if self.adapter is None or not hasattr(self.model, "set_adapter"):
            yield self.model
            return
        self.model.set_adapter(self.adapter, inference_mode=True)
        try:
            yield self.model
        finally:
            self.model.set_adapter(POLICY_ADAPTER)
            for p in lora_state(self.model, self.adapter).values():
                p.requires_grad_(False)  # set_adapter marks the active adapter trainable


class HFStepper:
    """The plain loop: the Hugging Face model (its active adapter) over a growing ``DynamicCache``."""

    def __init__(self, model: nn.Module):
        from transformers import DynamicCache

        self.trunk, self.head = trunk_and_head(model)
        self.kw, self.cache = cache_keyword(self.trunk), DynamicCache()
        self.mask: torch.Tensor | None = None  # [B, S] every column fed so far: 1 real, 0 a hole

    def feed(self, ids: torch.Tensor, real: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.mask = real.long() if self.mask is None else torch.cat([self.mask, real.long()], dim=1)
        out = self.trunk(
            input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True, **{self.kw: self.cache}
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        return logits_fp32(self.head, hidden, temperature)


def decode(tokenizer, rollout: Rollout) -> list[str]:
    """Response texts with special tokens (EOS, padding) dropped."""
    ids = [row[m].tolist() for row, m in zip(rollout.response_ids.cpu(), rollout.response_mask.cpu(), strict=True)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


class StaleSampler:
    """A frozen copy of the policy's LoRA adapter on the same base weights, refreshed every ``lag`` steps.

    ``version`` is the number of policy updates the copy has seen; the trainer's staleness for a batch is
    ``policy_version − sampler.version`` at the time of the draw.
    """

    def __init__(self, policy: nn.Module, lag: int, copy: nn.Module | None = None):
        """``copy``: full fine-tuning's frozen copy of the whole policy (``Models.sampler``), refreshed weight by
        weight; without it the sampler is a second LoRA adapter on the policy's base."""
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.policy, self.copy = policy, copy
        self.lag = lag
        self.version = 0
        if copy is None and SAMPLER_ADAPTER not in policy.peft_config:
            policy.add_adapter(SAMPLER_ADAPTER, policy.peft_config[POLICY_ADAPTER])
            policy.set_adapter(POLICY_ADAPTER)
        self.names, self._pairs = self._pair_parameters()
        self.refresh(version=0)

    def _pair_parameters(self) -> tuple[list[str], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The sampler's tensors by name, each with the policy's tensor it copies."""
        if self.copy is not None:
            theirs = dict(self.copy.named_parameters())
            names = list(theirs)
            pairs = [(p, theirs[name]) for name, p in self.policy.named_parameters()]
        else:
            src = lora_state(self.policy, POLICY_ADAPTER)
            dst = lora_state(self.policy, SAMPLER_ADAPTER)
            names, pairs = [], []
            for name, p in src.items():
                twin = name.replace(f".{POLICY_ADAPTER}.", f".{SAMPLER_ADAPTER}.")
                names.append(twin)
                pairs.append((p, dst[twin]))
        for _, q in pairs:
            q.requires_grad_(False)
        return names, pairs

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        """Copy the policy's adapter into the sampler's; ``version`` is the policy's update count."""
        for p, q in self._pairs:
            q.copy_(p)
        self.version = version

    def weights(self) -> dict[str, torch.Tensor] | None:
        """A copy of the sampler's LoRA tensors under PEFT's saved names (the adapter's name left out); None for a
        full copy (nothing to re-score it with) or a sharded adapter (each process holds a part)."""
        from torch.distributed.tensor import DTensor

        if self.copy is not None or any(isinstance(q, DTensor) for _, q in self._pairs):
            return None
        return {
            n.replace(f".{SAMPLER_ADAPTER}.", "."): p.detach().clone()
            for n, p in lora_state(self.policy, SAMPLER_ADAPTER).items()
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """The sampler's tensors by name (references, not copies): a sharded checkpoint saves and loads them in
        place (``sao.training.checkpoint``)."""
        return {name: q.detach() for name, (_, q) in zip(self.names, self._pairs, strict=True)}

    def refresh_before_draw(self, step: int) -> bool:
        """LAG = 0: the sampler is the current policy for every draw."""
        return self.lag == 0

    def refresh_after_draw(self, step: int) -> bool:
        """LAG ≥ 1: after drawing step k's batch, take the policy's version k when k % LAG == 0."""
        return self.lag > 0 and step % self.lag == 0

    def state_dict(self) -> dict:
        return {"version": self.version, "weights": [q.detach().cpu().clone() for _, q in self._pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for (_, q), w in zip(self._pairs, state["weights"], strict=True):
            q.copy_(w.to(q.device))
        self.version = int(state["version"])
