"""A rollout engine for GPU runs: static KV cache, and the decode step captured once as a CUDA graph over
the model's own weights and the stale sampler's adapter.

Why: the recipe page's run spent almost all of its 45.8 GPU-minutes in ``generate``. The plain loop
(``sampler.draw``) launches hundreds of small kernels per token from Python and grows its cache every
step; here every decode step is one graph replay over preallocated buffers.

    weights     the model's own tensors, referenced, never copied: the base weights and the sampler's
                LoRA adapter, which a refresh rewrites in place — so a graph captured once keeps decoding
                with the current sampler; the adapter is applied as PEFT applies it (see ``_Linear``)
    prefill     eager, once per call: the left-padded prompts through every layer, K/V into the cache
    decode      one graph per (batch, cache length, temperature): sample from the last hidden state's
                float32 logits (log-softmax → Gumbel-max with noise drawn outside the graph from the
                caller's generator; the drawn token's log-probability is read from the same logits),
                mark finished rows, then run the new token through every layer writing K/V at its slot
    stop        the host checks "all rows finished" every ``sync_every`` steps (one sync per 8 tokens)

The arithmetic mirrors Hugging Face's Qwen2/Llama modules op for op — RMSNorm in float32 cast back before
the weight, RoPE tables in float32 cast to the model dtype, the same SDPA call — because the sampler's
recorded log-probabilities are compared with a teacher-forced pass through those modules: every numerical
difference between the two shows up as a ratio ≠ 1 at lag 0. The bench reports the lag-0 |log ratio| of
both paths side by side.

On a CPU ``Engine`` runs the same code eagerly (no graph) — the tests check it there against the teacher-
forced pass; the trainer uses it only when ``--decoder graph`` and a GPU are both present.

Deliberately left out: paged attention and continuous batching (one fixed batch per call is what RL
rollouts are), tensor parallelism, architectures other than Qwen2/Llama-style decoders, speculative
decoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sao.core.errors import ConfigError
from sao.model.forward import position_ids_from
from sao.model.policy import causal_lm, lora_state
from sao.rollout.sampler import Rollout

SUPPORTED = ("qwen2", "llama", "mistral")


class _Linear:
    """y = W x + b, plus PEFT's LoRA branch when the layer has one, computed the way PEFT computes it:
    the base product in the model dtype, the adapter in float32 (s · B(A x)), the sum cast back. Merging
    B·A into a bf16 W would be faster but rounds most of a small adapter away: measured on the tiny model
    in bf16, it raised the lag-0 |log ratio| ~8x above the plain path's, so the adapter stays separate."""

    def __init__(self, weight: torch.Tensor, bias, lora_a, lora_b, scaling: float):
        self.weight, self.bias = weight, bias
        self.lora_a, self.lora_b, self.scaling = lora_a, lora_b, scaling

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_a is None:
            return y
        return (y + F.linear(F.linear(x.to(self.lora_a.dtype), self.lora_a), self.lora_b) * self.scaling).to(y.dtype)


def _linear(module: nn.Module, adapter: str | None) -> _Linear:
    """A Linear (or a PEFT LoRA wrapper of one) as an ``_Linear`` holding references to its tensors."""
    base = getattr(module, "base_layer", module)
    if adapter is not None and hasattr(module, "lora_A") and adapter in module.lora_A:
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        return _Linear(base.weight, base.bias, a, b, float(module.scaling[adapter]))
    return _Linear(base.weight, base.bias, None, None, 1.0)


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    gate: _Linear
    up: _Linear
    down: _Linear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: float32 statistics, cast back, then the weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Engine:
    """Static-cache decoder over a (PEFT-wrapped) Qwen2/Llama causal LM. ``generate`` returns a ``Rollout``
    exactly like ``sampler.draw``."""

    def __init__(self, model: nn.Module, adapter: str | None = None, capture: bool | None = None, sync_every: int = 8):
        lm = causal_lm(model)
        cfg = lm.config
        if cfg.model_type not in SUPPORTED:
            raise ConfigError(
                f"--decoder graph supports {SUPPORTED} models, not {cfg.model_type!r}; use --decoder plain"
            )
        self.device = next(lm.parameters()).device
        self.dtype = next(lm.parameters()).dtype
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.sync_every = sync_every
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rotary = lm.get_decoder().rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().to(self.device)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.layers: list[_Layer] = []
        self._graphs: dict[tuple, _Graph] = {}
        self._bind(model, adapter)

    # -- weights -------------------------------------------------------------------------------------------

    def _bind(self, model: nn.Module, adapter: str | None) -> None:
        """Reference (never copy) the model's tensors: the base weights and ``adapter``'s LoRA weights. The
        stale sampler's adapter changes only at a refresh, in place, so a captured graph reading these
        tensors always decodes with the current sampler. ``adapter`` None: the base alone."""
        if adapter is not None and not lora_state(model, adapter):
            raise ConfigError(f"the model has no LoRA adapter named {adapter!r}")
        lm = causal_lm(model)
        decoder = lm.get_decoder()
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            names = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
            names |= {"gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    **{k: _linear(m, adapter) for k, m in names.items()},
                )
            )
        self.embed = decoder.embed_tokens.weight
        self.final_norm = decoder.norm.weight
        self.head = _linear(lm.get_output_embeddings(), None)

    # -- the network ---------------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, T] as [B, 1, T, D] in the model dtype (float32 tables, then cast)."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None]
        return cos, sin

    def _block(
        self, i: int, x: torch.Tensor, cos, sin, mask: torch.Tensor, cache_k, cache_v, slots: torch.Tensor | None
    ):
        """One decoder layer on x [B, T, H]. K/V of the T new positions go to ``slots`` of the cache (or, with
        slots None, the first T positions); attention reads the whole cache under ``mask`` [B, 1, T, S]."""
        w = self.layers[i]
        B, T, _ = x.shape
        h = _rms_norm(x, w.ln1, self.eps)
        q = w.q(h).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = w.k(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = w.v(h).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if slots is None:
            cache_k[i, :, :, :T] = k
            cache_v[i, :, :, :T] = v
        else:
            cache_k[i].index_copy_(2, slots, k)
            cache_v[i].index_copy_(2, slots, v)
        keys, values = cache_k[i], cache_v[i]
        attn = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=self.kv_heads != self.heads
        )
        x = x + w.o(attn.transpose(1, 2).reshape(B, T, -1))
        h = _rms_norm(x, w.ln2, self.eps)
        return x + w.down(F.silu(w.gate(h)) * w.up(h))

    # -- generation ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        temperature: float,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        generator: torch.Generator,
    ) -> Rollout:
        """Sample up to ``max_new_tokens`` per left-padded prompt; the same contract as ``sampler.draw``."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        B, P = prompt_ids.shape
        length = _round_up(P + max_new_tokens, 64)
        key = (B, length, float(temperature), tuple(eos_token_ids), pad_token_id)
        state = self._graphs.get(key)
        if state is None:
            state = _Graph(self, B, length, temperature, eos_token_ids, pad_token_id)
            self._graphs[key] = state
        return state.run(prompt_ids, prompt_mask.bool(), max_new_tokens, generator)


def _round_up(n: int, k: int) -> int:
    return int(math.ceil(n / k) * k)


class _Graph:
    """Buffers (and, on CUDA, the captured decode step) for one batch size, cache length and temperature."""

    def __init__(self, engine: Engine, batch: int, length: int, temperature: float, eos, pad_token_id: int):
        e = engine
        self.e, self.B, self.S = e, batch, length
        self.temperature = temperature
        self.pad = pad_token_id
        dev = e.device
        n_layers = len(e.layers)
        shape = (n_layers, batch, e.kv_heads, length, e.head_dim)
        self.cache_k = torch.zeros(shape, dtype=e.dtype, device=dev)
        self.cache_v = torch.zeros(shape, dtype=e.dtype, device=dev)
        vocab = e.head.weight.shape[0]
        self.eos = torch.tensor(list(eos) or [-1], device=dev)
        # static inputs and outputs of the decode step
        self.hidden = torch.zeros(batch, 1, e.embed.shape[1], dtype=e.dtype, device=dev)
        self.valid = torch.zeros(batch, length, dtype=torch.bool, device=dev)  # which cache slots hold keys
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # where the next token's K/V go
        self.column = torch.zeros(1, dtype=torch.long, device=dev)  # which response position is being drawn
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=dev)  # RoPE position of the next token
        self.noise = torch.zeros(batch, vocab, dtype=torch.float32, device=dev)
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.tokens = torch.zeros(batch, length, dtype=torch.long, device=dev)
        self.logps = torch.zeros(batch, length, dtype=torch.float32, device=dev)
        self.alive = torch.zeros(batch, length, dtype=torch.bool, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        """Sample from self.hidden, record, then advance the network by the drawn token. Capturable: no host
        syncs, no allocation that depends on data, every index a device tensor."""
        e = self.e
        h = _rms_norm(self.hidden[:, -1], e.final_norm, e.eps)
        logits = e.head(h).float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
        token = (logprobs - torch.log(-torch.log(self.noise.clamp_min(1e-20)))).argmax(dim=-1)  # Gumbel-max
        token_logp = logprobs.gather(-1, token[:, None]).squeeze(-1)
        alive = ~self.done
        out_token = torch.where(alive, token, torch.full_like(token, self.pad))
        self.tokens.index_copy_(1, self.column, out_token[:, None])
        self.logps.index_copy_(1, self.column, torch.where(alive, token_logp, torch.zeros_like(token_logp))[:, None])
        self.alive.index_copy_(1, self.column, alive[:, None])
        self.done.logical_or_(torch.isin(token, self.eos))
        # the drawn token through the network; its K/V land in `slot`
        self.valid.index_fill_(1, self.slot, True)
        x = F.embedding(out_token[:, None], e.embed)
        cos, sin = e._rope(self.next_pos[:, None])
        mask = self.valid[:, None, None, :]  # [B, 1, 1, S]
        for i in range(len(e.layers)):
            x = e._block(i, x, cos, sin, mask, self.cache_k, self.cache_v, self.slot)
        self.hidden.copy_(x)
        self.slot.add_(1)
        self.column.add_(1)
        self.next_pos.add_(1)

    def _prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        e, P = self.e, prompt_ids.shape[1]
        positions = position_ids_from(prompt_mask)
        cos, sin = e._rope(positions)
        causal = torch.ones(P, P, dtype=torch.bool, device=e.device).tril()
        mask = (causal[None] & prompt_mask[:, None, :]) | torch.eye(P, dtype=torch.bool, device=e.device)[None]
        mask = mask[:, None]  # [B, 1, P, P]: padded queries see themselves only, so nothing is NaN
        x = F.embedding(prompt_ids, e.embed)
        ks, vs = self.cache_k[:, :, :, :P], self.cache_v[:, :, :, :P]
        for i in range(len(e.layers)):
            x = e._block(i, x, cos, sin, mask, ks, vs, None)
        self.hidden.copy_(x[:, -1:])
        self.valid.zero_()
        self.valid[:, :P] = prompt_mask
        self.slot.fill_(P)
        self.column.zero_()
        self.next_pos.copy_(positions[:, -1] + 1)
        self.done.zero_()

    def _capture(self) -> None:
        """Warm up on a side stream, then capture one decode step (CUDA only)."""
        saved = [t.clone() for t in (self.hidden, self.valid, self.slot, self.column, self.next_pos, self.done)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        for t, s in zip(
            (self.hidden, self.valid, self.slot, self.column, self.next_pos, self.done), saved, strict=True
        ):
            t.copy_(s)  # warm-up and capture advanced the state; the prefill's state is what the run starts from

    def run(self, prompt_ids, prompt_mask, max_new_tokens: int, generator: torch.Generator) -> Rollout:
        self._prefill(prompt_ids, prompt_mask)
        if self.e.capture and self.graph is None:
            self._capture()
        steps = 0
        for steps in range(1, max_new_tokens + 1):
            self.noise.uniform_(generator=generator)
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            if steps % self.e.sync_every == 0 and bool(self.done.all()):
                break
        n = steps
        alive = self.alive[:, :n]
        last_alive = alive.sum(dim=1)
        # rows that finished early have their trailing columns marked dead already; trim columns no row uses
        used = int(last_alive.max()) if n else 0
        used = max(used, 1)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=self.tokens[:, :used].clone(),
            response_mask=alive[:, :used].clone(),
            sampler_logprobs=self.logps[:, :used].clone(),
            truncated=~self.done.clone(),
        )
