"""The models: a Hugging Face causal LM with a LoRA adapter (the policy), a linear value head on its trunk
(the critic), and the one teacher-forced pass that feeds both.

    policy    base LM (hub id or local path) + LoRA rank 16, alpha 32 on every linear layer of attention
              and MLP (q, k, v, o, gate, up, down projections), built right after ``torch.manual_seed(17)``
    critic    V(s_t) = w · h_t + b on the trunk's last hidden state h_t, zero-initialised, reading
              ``h.detach()`` so that the critic never trains the trunk
    pass      one forward over prompt + response: for every response token y_t, log π(y_t | y_<t) and h_t,
              both taken at the position that predicts y_t (so V is the value of the state the token was
              chosen in)

Per-token log-probabilities are computed over the vocabulary in chunks of rows (``logprob_chunk``) with
activation checkpointing, so neither the forward nor the backward ever holds a full-vocabulary float32
log-softmax of the whole batch. Positions are taken from the attention mask (left-padded prompts), exactly
as the sampler does, so that at lag 0 the two agree up to numerics.

Deliberately left out: value heads with their own trunk, full fine-tuning, quantisation and multi-GPU
sharding; the fast GPU decoder lives in ``sao.engine``.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sao.errors import ConfigError

DEFAULT_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"
# Every linear layer of a Qwen2/Llama-style block; the ones a model lacks are skipped.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
POLICY_ADAPTER = "default"


def pick_device(device: str | None = None) -> torch.device:
    """``None``/"auto" → CUDA when available, else CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"--device {device!r} is not a device torch knows ({error})") from None


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, float32 on the CPU (SPEC §2)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_base(model: str | os.PathLike[str], device: torch.device, dtype: torch.dtype | None = None):
    """Load a causal LM and its tokenizer by hub id or local directory. Returns (model, tokenizer).

    The tokenizer pads on the left (batched prompts end where the response begins) and falls back to
    its EOS token for padding when it has no pad token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.fspath(model)
    path = os.path.expanduser(name)
    if not os.path.isdir(path) and (name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.path.exists(path)):
        raise ConfigError(f"model path {name!r} is not a directory; pass a hub id or a save_pretrained directory")
    dtype = dtype or default_dtype(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"could not load model {name!r}: {first} (no network? pass a local directory with --model)"
        ) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm.to(device)
    lm.eval()  # no dropout anywhere: the sampler and the teacher-forced pass must see the same function
    lm.generation_config.pad_token_id = tokenizer.pad_token_id
    return lm, tokenizer


def add_lora(model: nn.Module, rank: int = 16, alpha: int = 32, seed: int = 17, dropout: float = 0.0):
    """Wrap ``model`` with a trainable LoRA adapter; every base weight is frozen.

    ``torch.manual_seed(seed)`` runs right before the adapter is built, so the adapter's init depends on the
    seed alone. Dropout is 0 by default: with dropout the teacher-forced pass would not be the function
    the sampler drew from.
    """
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    targets = [t for t in LORA_TARGETS if t in names]
    if not targets:
        raise ConfigError(f"the model has none of the LoRA target layers {list(LORA_TARGETS)}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none")
    torch.manual_seed(seed)
    policy = get_peft_model(model, config)
    policy.eval()
    return policy


def lora_state(policy: nn.Module, adapter: str = POLICY_ADAPTER) -> dict[str, torch.Tensor]:
    """The adapter's LoRA tensors by parameter name (references, not copies)."""
    marker = f".{adapter}."
    return {n: p for n, p in policy.named_parameters() if "lora_" in n and marker in n}


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Recompute each decoder layer in the backward instead of storing its activations.

    Hugging Face only checkpoints layers whose ``training`` flag is set, and the policy runs in eval mode
    (no dropout: the teacher-forced pass must be the function the sampler drew from). So the flag is set on
    the decoder layers alone, not recursively: their dropout children stay in eval mode."""
    lm = causal_lm(model)
    kwargs = {"use_reentrant": False}
    if hasattr(lm, "activation_checkpointing_enable"):  # the newer name for the same switch
        lm.activation_checkpointing_enable(kwargs) if enabled else lm.activation_checkpointing_disable()
    elif enabled:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_disable()
    for layer in lm.get_decoder().layers:
        layer.training = enabled


class ValueHead(nn.Module):
    """V(h) = w · h + b, zero-initialised: the critic starts at V ≡ 0 and learns from the MC returns."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] hidden states (any dtype) → [...] float32 values."""
        return self.linear(hidden.float()).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------
# Pieces of the LM the sampler and the teacher-forced pass share.


def causal_lm(model: nn.Module) -> nn.Module:
    """The underlying *ForCausalLM, through a PEFT wrapper if there is one."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


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


def teacher_forced(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    micro_batch: int | None = None,
    logprob_chunk: int = 1024,
) -> TeacherForced:
    """One forward over [prompt | response] (prompts left-padded, responses right-padded).

    Shapes: prompt_ids/prompt_mask [B, P], response_ids/response_mask [B, R]. Rows are processed
    ``micro_batch`` at a time (all graphs are kept, so the result is one pass over the batch); the hidden
    state at position P − 1 + t is the one that predicts response token t.
    """
    trunk, head = trunk_and_head(model)
    B, P = prompt_ids.shape
    R = response_ids.shape[1]
    step = micro_batch or B
    logprobs, hiddens = [], []
    for s in range(0, B, step):
        ids = torch.cat([prompt_ids[s : s + step], response_ids[s : s + step]], dim=1)  # [b, P+R]
        mask = torch.cat([prompt_mask[s : s + step], response_mask[s : s + step]], dim=1).long()
        out = trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_from(mask), use_cache=False)
        h = out.last_hidden_state[:, P - 1 : P + R - 1]  # [b, R, H]
        rmask = response_mask[s : s + step].bool()  # [b, R]
        lp = h.new_zeros(rmask.shape, dtype=torch.float32)
        lp = lp.masked_scatter(rmask, token_logprobs(head, h[rmask], ids[:, P:][rmask], temperature, logprob_chunk))
        logprobs.append(lp)
        hiddens.append(h.detach())
    return TeacherForced(logprobs=torch.cat(logprobs), hidden=torch.cat(hiddens))


# Activation bytes a LoRA training pass keeps per token, per layer, per unit of hidden size (bf16, SDPA
# attention, no activation checkpointing): 41 GB peak at 16 rows × 384 tokens on the 1.5B shape, less
# ~13 GB of weights and full-vocabulary logits, is ~100 bytes · hidden · layers per token.
ACTIVATION_BYTES_PER_HIDDEN = 100


def auto_micro_batch(model: nn.Module, seq_len: int, batch: int, headroom: float = 0.7) -> int:
    """Rows per micro-batch that fit in free accelerator memory (a power of two ≤ batch); the whole batch on
    the CPU. An estimate — the trainer halves it and retries if a step still runs out of memory."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return batch
    free, _ = torch.cuda.mem_get_info(device)
    config = causal_lm(model).config
    per_row = ACTIVATION_BYTES_PER_HIDDEN * config.hidden_size * config.num_hidden_layers * seq_len
    rows = max(1, int(free * headroom // per_row))
    return min(batch, 1 << (rows.bit_length() - 1))


def parameter_count(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def describe(model: Any) -> str:
    """One line: parameter counts and dtype."""
    total, trainable = parameter_count(model), parameter_count(model, trainable_only=True)
    dtype = next(model.parameters()).dtype
    return f"{total / 1e6:.2f}M parameters ({trainable / 1e6:.3f}M trainable), {str(dtype).removeprefix('torch.')}"
