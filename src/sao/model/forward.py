"""The teacher-forced pass: one forward over prompt + response that yields, for every response token, the
current policy's log-probability and the trunk's hidden state (the critic's input).

    positions   cumsum(attention_mask) − 1: left padding is skipped exactly as the sampler skips it, so at
                lag 0 the pass reproduces the sampler's recorded log-probabilities up to numerics
    hidden      h_t is taken at the position that *predicts* response token y_t, so V(h_t) is the value of
                the state the token was chosen in
    logprobs    log softmax(lm_head(h_t) / τ)[y_t] in float32, ``chunk`` rows at a time; with gradients on,
                each chunk is checkpointed, so neither the forward nor the backward ever holds a
                full-vocabulary float32 log-softmax of the whole batch

The pass runs over whatever rows it is given: splitting a batch into micro-batches is the trainer's job
(one mechanism, in ``sao.training.learn``). Deliberately left out: packing several sequences into one row,
and any model other than a decoder-only causal LM.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sao.model.policy import causal_lm


def trunk_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder trunk that returns last_hidden_state, lm_head)."""
    lm = causal_lm(model)
    return lm.get_decoder(), lm.get_output_embeddings()


def cache_keyword(trunk: nn.Module) -> str:
    """transformers renamed ``past_key_values`` to ``cache``; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(trunk.forward).parameters else "past_key_values"


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: cumsum(mask) − 1, clamped at 0. [B, T] → [B, T]."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def logits_fp32(head: nn.Module, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary logits in float32, divided by the temperature. [..., H] → [..., V]."""
    logits = head(hidden).float()
    return logits / temperature if temperature != 1.0 else logits


def _chunk_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = logits_fp32(head, hidden, temperature)  # [n, V]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_entropy(head: nn.Module, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits_fp32(head, hidden, temperature), dim=-1)  # [n, V]
    return -(logp.exp() * logp).sum(dim=-1)  # [n]


def token_entropy(head: nn.Module, hidden: torch.Tensor, temperature: float = 1.0, chunk: int = 1024) -> torch.Tensor:
    """H(softmax(head(h) / τ)) for N rows, ``chunk`` rows at a time (checkpointed with gradients on, as
    ``token_logprobs``). [N, H] → [N] float32."""
    out = []
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            out.append(checkpoint(_chunk_entropy, head, h, temperature, use_reentrant=False))
        else:
            out.append(_chunk_entropy(head, h, temperature))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def token_logprobs(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int = 1024
) -> torch.Tensor:
    """log softmax(head(h) / τ)[target] for N rows, ``chunk`` rows at a time. [N, H], [N] → [N] float32.

    With gradients on, each chunk is checkpointed: its [chunk, V] logits are recomputed in the backward
    instead of being stored, so peak memory holds one chunk of logits, not N.
    """
    out = []
    for start in range(0, hidden.shape[0], chunk):
        h, y = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            out.append(checkpoint(_chunk_logprobs, head, h, y, temperature, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(head, h, y, temperature))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


@dataclass
class TeacherForced:
    """The pass over prompt + response. ``logprobs`` keeps its graph when computed with gradients."""

    logprobs: torch.Tensor  # [B, R] float32, 0 where response_mask is False
    hidden: torch.Tensor  # [B, R, H] detached, the critic's input
    entropy: torch.Tensor | None = None  # [B, R] float32 (with ``entropy=True``), 0 where response_mask is False


def teacher_forced(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    logprob_chunk: int = 1024,
    entropy: bool = False,
) -> TeacherForced:
    """One forward over [prompt | response] (prompts left-padded to P, responses right-padded to R).

    Shapes: prompt_ids/prompt_mask [B, P], response_ids/response_mask [B, R]; the hidden state at position
    P − 1 + t is the one that predicts response token t.
    """
    trunk, head = trunk_and_head(model)
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+R]
    mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # [B, P+R]
    out = trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_from(mask), use_cache=False)
    hidden = out.last_hidden_state[:, P - 1 : P + R - 1]  # [B, R, H]
    rmask = response_mask.bool()  # [B, R]
    logprobs = hidden.new_zeros(rmask.shape, dtype=torch.float32)
    targets = response_ids[rmask]  # [N]
    logprobs = logprobs.masked_scatter(rmask, token_logprobs(head, hidden[rmask], targets, temperature, logprob_chunk))
    entropies = None
    if entropy:
        per_token = token_entropy(head, hidden[rmask], temperature, logprob_chunk)  # [N]
        entropies = hidden.new_zeros(rmask.shape, dtype=torch.float32).masked_scatter(rmask, per_token)
    return TeacherForced(logprobs=logprobs, hidden=hidden.detach(), entropy=entropies)
