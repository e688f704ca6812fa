"""The GPU rollout engine: a static-KV-cache decoder whose decode step is captured once as a CUDA graph over
the model's own weights and the sampler's LoRA adapter.

Every decode step is one graph replay over preallocated buffers (the plain loop launches hundreds of small kernels
per token): fused q/k/v and gate/up GEMMs, GQA folded into the query axis for the fused SDPA kernels, an eager
prefill, sampling as ``sampler.gumbel_sample_`` draws, one graph per (batch bucket, cache length, temperature, EOS
ids, pad id), least recently used evicted. The arithmetic mirrors Hugging Face's Qwen2/Llama modules op for op,
because any difference from the teacher-forced pass shows up as a ratio ≠ 1 at lag 0. On a CPU it runs eagerly and
draws the plain loop's tokens exactly; ``--decoder auto`` uses it on CUDA, ``--decoder graph`` on either.

Deliberately left out: paged attention and continuous batching, tensor parallelism, other architectures, LoRA
variants, speculative decoding, and merging B·A into the bf16 base weights.
Design notes: docs/design/rollout-engine.md.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from sao.core.errors import ConfigError
from sao.model.forward import position_ids_from
from sao.model.policy import causal_lm, context_length, lora_state
from sao.rollout.sampler import gumbel_sample_
from sao.rollout.types import Rollout

SUPPORTED = ("qwen2", "llama", "mistral")
# The SDPA backends the engine allows on CUDA: the fused kernels. The math backend is left out on purpose,
# so that a call it would have to take raises instead of materialising repeated K/V every step.
FUSED_ATTENTION = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
MAX_GRAPHS = 4


# -- the elementwise pieces (pure functions, so that ``compile_elementwise`` can fuse each) ------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: float32 statistics, cast back, then the weight. [..., H] → [..., H]."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face applies it: x·cos + rotate_half(x)·sin. x [B, heads, T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _adapter_sum(base: torch.Tensor, lora: torch.Tensor, scaling: float | torch.Tensor) -> torch.Tensor:
    """PEFT's sum: the base output (model dtype) plus the float32 adapter output times its scaling, cast back."""
    return (base + lora * scaling).to(base.dtype)


@dataclass(frozen=True)
class _Ops:
    norm: Callable
    rope: Callable
    swiglu: Callable
    adapter_sum: Callable


EAGER = _Ops(_rms_norm, _rope, _swiglu, _adapter_sum)


def _compiled_ops() -> _Ops:
    """The same functions through ``torch.compile``, emulating eager's bf16 rounding between ops."""
    options = {"emulate_precision_casts": True}
    return _Ops(*(torch.compile(f, options=options) for f in (_rms_norm, _rope, _swiglu, _adapter_sum)))


# -- weights ----------------------------------------------------------------------------------------------


class _Linear:
    """y = W x + b over the model's own tensors (by reference): the o/down projections and the LM head, with
    PEFT's LoRA branch when the layer has one (base product in the model dtype, s · B(A x) in float32)."""

    def __init__(self, module: nn.Module, adapter: str | None):
        base = getattr(module, "base_layer", module)
        self.weight, self.bias = base.weight, base.bias
        self.lora = _lora_of(module, adapter)  # (A, B, scaling) or None

    def __call__(self, x: torch.Tensor, ops: _Ops = EAGER) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora is None:
            return y
        a, b, scaling = self.lora
        return ops.adapter_sum(y, F.linear(F.linear(x.to(a.dtype), a), b), scaling)


def _lora_of(module: nn.Module, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    if adapter is None or not hasattr(module, "lora_A") or adapter not in module.lora_A:
        return None
    if getattr(module, "use_dora", {}).get(adapter):
        raise ConfigError("the graph decoder does not implement DoRA adapters; use --decoder plain")
    return module.lora_A[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter])


class _Fused:
    """Linears that read the same input, run with fewer GEMMs: ``(q, k, v)`` or ``(gate, up)``. ``__call__``
    returns one output per linear, each what the linear (with PEFT's LoRA branch) returns, up to the
    summation order inside the GEMMs.

        fuse_base   (q, k, v) one base GEMM over a concatenated copy of the weights [ΣN, H] (biases likewise,
                    zero where a linear has none); one A GEMM over the stacked A matrices [Σr, H]; one B GEMM
                    over the B matrices on the diagonal of [ΣN, Σr] (zeros elsewhere, so each output reads
                    only its own A rows); one adapter sum, with one scaling or one per column [ΣN]
        otherwise   (gate, up) one base GEMM per linear over the model's own weights (a fused copy would
                    cost 1.5 GB on the 1.5B model); one A GEMM over the stacked A matrices; each linear's own
                    B (by reference) on its slice of the A output, and its own adapter sum

    The stacked and concatenated buffers are the engine's own; ``sync`` re-fills them from the model in place."""

    def __init__(self, modules: Sequence[nn.Module], adapter: str | None, fuse_base: bool):
        bases = [getattr(m, "base_layer", m) for m in modules]
        self.bases = [(b.weight, b.bias) for b in bases]
        self.sizes = [b.weight.shape[0] for b in bases]  # N_i
        self.loras = [_lora_of(m, adapter) for m in modules]  # (A [r_i, H], B [N_i, r_i], scaling) or None
        self.ranks = [0 if lora is None else lora[0].shape[0] for lora in self.loras]
        w0 = bases[0].weight
        self.weight = self.bias = self.lora_a = self.lora_b = None
        self.scaling: float | torch.Tensor = 1.0
        if fuse_base:
            self.weight = torch.empty(sum(self.sizes), w0.shape[1], dtype=w0.dtype, device=w0.device)  # [ΣN, H]
            if any(b is not None for _, b in self.bases):
                self.bias = torch.zeros(sum(self.sizes), dtype=w0.dtype, device=w0.device)  # [ΣN]
        present = [lora for lora in self.loras if lora is not None]
        if present:
            a0 = present[0][0]
            self.lora_a = torch.empty(sum(self.ranks), a0.shape[1], dtype=a0.dtype, device=a0.device)  # [Σr, H]
            if fuse_base:
                self.lora_b = torch.zeros(sum(self.sizes), sum(self.ranks), dtype=a0.dtype, device=a0.device)
                if len({lora[2] for lora in present}) == 1:
                    self.scaling = present[0][2]
                else:
                    scalings = [0.0 if lora is None else lora[2] for lora in self.loras]
                    columns = [torch.full((n,), s, dtype=a0.dtype) for n, s in zip(self.sizes, scalings, strict=True)]
                    self.scaling = torch.cat(columns).to(a0.device)  # [ΣN]
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the model's current weights into the engine's buffers, in place (their addresses never change)."""
        if self.weight is not None:
            torch.cat([w for w, _ in self.bases], out=self.weight)
        if self.bias is not None:
            start = 0
            for (_, b), n in zip(self.bases, self.sizes, strict=True):
                if b is not None:
                    self.bias[start : start + n].copy_(b)
                start += n
        if self.lora_a is not None:
            torch.cat([lora[0] for lora in self.loras if lora is not None], out=self.lora_a)
        if self.lora_b is not None:
            row = col = 0
            for lora, n, r in zip(self.loras, self.sizes, self.ranks, strict=True):
                if lora is not None:
                    self.lora_b[row : row + n, col : col + r].copy_(lora[1])
                row, col = row + n, col + r

    def __call__(self, x: torch.Tensor, ops: _Ops = EAGER) -> list[torch.Tensor]:
        """x [..., H] → one [..., N_i] per linear."""
        if self.weight is not None:
            base = F.linear(x, self.weight, self.bias)  # [..., ΣN]
            if self.lora_a is not None:
                lora = F.linear(F.linear(x.to(self.lora_a.dtype), self.lora_a), self.lora_b)  # [..., ΣN] float32
                base = ops.adapter_sum(base, lora, self.scaling)
            return list(base.split(self.sizes, dim=-1))
        outs = [F.linear(x, w, b) for w, b in self.bases]  # [..., N_i] each
        if self.lora_a is None:
            return outs
        down = F.linear(x.to(self.lora_a.dtype), self.lora_a).split(self.ranks, dim=-1)  # [..., r_i] each
        return [
            y if lora is None else ops.adapter_sum(y, F.linear(d, lora[1]), lora[2])
            for y, d, lora in zip(outs, down, self.loras, strict=True)
        ]


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: _Fused
    o: _Linear
    gate_up: _Fused
    down: _Linear


def _bucket(batch: int) -> int:
    """The batch size a graph is built for: the next power of two up to 32, then the next multiple of 32."""
    if batch <= 32:
        return 1 << max(batch - 1, 0).bit_length()
    return _round_up(batch, 32)


def _round_up(n: int, k: int) -> int:
    return int(math.ceil(n / k) * k)


# -- the engine -------------------------------------------------------------------------------------------


class Engine:
    """Static-cache decoder over a (PEFT-wrapped) Qwen2/Llama causal LM. ``generate`` returns a ``Rollout``
    exactly like ``sampler.draw``.

    capture: CUDA graphs (default: on CUDA devices); max_graphs: entries kept, least recently used evicted;
    compile_elementwise: ``torch.compile`` the decode step's elementwise chains (off: not yet measured faster)."""

    def __init__(
        self,
        model: nn.Module,
        adapter: str | None = None,
        capture: bool | None = None,
        sync_every: int = 8,
        max_graphs: int = MAX_GRAPHS,
        compile_elementwise: bool = False,
    ):
        lm = causal_lm(model)
        cfg = lm.config
        if cfg.model_type not in SUPPORTED:
            raise ConfigError(
                f"--decoder graph supports {SUPPORTED} models, not {cfg.model_type!r}; use --decoder plain"
            )
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.device = next(lm.parameters()).device
        self.dtype = next(lm.parameters()).dtype
        self.context_length = context_length(cfg)  # prompt + response positions, at most
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.sync_every = sync_every
        self.max_graphs = max_graphs
        self.decode_ops = _compiled_ops() if compile_elementwise else EAGER
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rotary = lm.get_decoder().rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().to(self.device)
        self.rope_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.layers: list[_Layer] = []
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self._pool = None  # one CUDA memory pool for every capture, made at the first
        self._stream = None  # one side stream for every warm-up and capture (cuBLAS keeps a workspace per stream)
        self._bind(model, adapter)

    # -- weights -------------------------------------------------------------------------------------------

    def _bind(self, model: nn.Module, adapter: str | None) -> None:
        """Take the model's tensors: by reference where a linear runs alone, into fused buffers (re-filled
        by ``sync_weights``) where linears share an input. ``adapter`` None: the base alone."""
        if adapter is not None and not lora_state(model, adapter):
            raise ConfigError(f"the model has no LoRA adapter named {adapter!r}")
        lm = causal_lm(model)
        decoder = lm.get_decoder()
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    qkv=_Fused([attn.q_proj, attn.k_proj, attn.v_proj], adapter, fuse_base=True),
                    o=_Linear(attn.o_proj, adapter),
                    gate_up=_Fused([mlp.gate_proj, mlp.up_proj], adapter, fuse_base=False),
                    down=_Linear(mlp.down_proj, adapter),
                )
            )
        self.embed = decoder.embed_tokens.weight
        self.final_norm = decoder.norm.weight
        self.head = _Linear(lm.get_output_embeddings(), None)

    def sync_weights(self) -> None:
        """Re-read the model's weights into the fused buffers (``generate`` does this at every call)."""
        for layer in self.layers:
            layer.qkv.sync()
            layer.gate_up.sync()

    # -- the network ---------------------------------------------------------------------------------------

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [B, T] as [B, 1, T, D] in the model dtype (float32 tables, then cast)."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None]
        return cos, sin

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor):
        """softmax(q kᵀ / √D + bias) v with each K/V head's G query heads folded into the query axis, so the
        SDPA call has equal head counts (no enable_gqa, no repeated K/V). q [B, H, T, D], keys/values
        [B, KV, S, D], bias [B, 1, T, S] additive (0 or −inf) in the model dtype → [B, T, H·D]."""
        B, H, T, D = q.shape
        G = H // self.kv_heads
        if G > 1:
            q = q.reshape(B, self.kv_heads, G * T, D)  # row g·T + t; a view when T = 1 (the decode step)
            if T > 1:  # the prefill: every folded row t sees row t of the mask
                bias = bias[:, :, None].expand(B, 1, G, T, bias.shape[-1]).reshape(B, 1, G * T, -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=D**-0.5)  # [B, KV, G·T, D]
        return out.view(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)

    def _block(
        self, i: int, x: torch.Tensor, cos, sin, bias: torch.Tensor, cache_k, cache_v, slots, ops: _Ops = EAGER
    ) -> torch.Tensor:
        """One decoder layer on x [B, T, H]. K/V of the T new positions go to ``slots`` of the cache (or, with
        slots None, the first T positions); attention reads the whole cache under ``bias`` [B, 1, T, S]."""
        w = self.layers[i]
        B, T, _ = x.shape
        h = ops.norm(x, w.ln1, self.eps)
        q, k, v = w.qkv(h, ops)  # [B, T, H·D], [B, T, KV·D], [B, T, KV·D]
        q = ops.rope(q.view(B, T, self.heads, self.head_dim).transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = ops.rope(k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)  # [B, KV, T, D]
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, KV, T, D]
        if slots is None:
            cache_k[i, :, :, :T] = k
            cache_v[i, :, :, :T] = v
        else:
            cache_k[i].index_copy_(2, slots, k)
            cache_v[i].index_copy_(2, slots, v)
        x = x + w.o(self._attention(q, cache_k[i], cache_v[i], bias), ops)
        h = ops.norm(x, w.ln2, self.eps)
        gate, up = w.gate_up(h, ops)  # [B, T, I] each
        return x + w.down(ops.swiglu(gate, up), ops)

    # -- generation ----------------------------------------------------------------------------------------

    def _kernels(self):
        """On CUDA: only the fused SDPA backends (a math fallback raises). On the CPU: torch's choice."""
        return sdpa_kernel(list(FUSED_ATTENTION)) if self.device.type == "cuda" else contextlib.nullcontext()

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
        share: tuple[slice, int] | None = None,
    ) -> Rollout:
        """Sample up to ``max_new_tokens`` per left-padded prompt; the same contract as ``sampler.draw`` (``share``
        included: these rows' part of each step's whole-batch noise)."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        B, P = prompt_ids.shape
        self.sync_weights()
        key = (_bucket(B), _round_up(P + max_new_tokens, 64), float(temperature), tuple(eos_token_ids), pad_token_id)
        with self._kernels():
            entry = self._entry(key)
            return entry.run(prompt_ids, prompt_mask.bool(), max_new_tokens, generator, share)

    @contextlib.contextmanager
    def stepper(self, rows: int, capacity: int) -> Iterator[EngineStepper]:
        """A multi-turn session over ``rows`` rows (``sao.rollout.episodes``): the engine's kernels on a static
        cache of ``capacity`` columns to start with (it grows if the episodes need more), decoded eagerly."""
        self.sync_weights()
        yield EngineStepper(self, rows, capacity)

    def _entry(self, key: tuple) -> _Graph:
        """The cached entry for ``key`` (now the most recently used), or a new one: the least recently used
        are evicted first to make room, and the new one is stored only once its capture has succeeded."""
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return self._graphs[key]
        while len(self._graphs) >= self.max_graphs:
            _, old = self._graphs.popitem(last=False)
            old.release()
            self._empty_cache()
        entry = None
        try:
            entry = _Graph(self, *key)
            if self.capture:
                if self._pool is None:
                    self._pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
                entry.capture(self._pool, self._stream)
        except BaseException:
            if entry is not None:
                entry.release()  # its buffers go now, even while the traceback still holds the object
            del entry
            self._empty_cache()
            raise
        self._graphs[key] = entry
        return entry

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class _Graph:
    """Buffers (and, on CUDA, the captured decode step) for one batch bucket, cache length and temperature."""

    def __init__(self, engine: Engine, rows: int, length: int, temperature: float, eos, pad_token_id: int):
        e = engine
        self.e, self.rows, self.S = e, rows, length
        self.temperature = temperature
        self.pad = pad_token_id
        dev = e.device
        shape = (len(e.layers), rows, e.kv_heads, length, e.head_dim)
        self.cache_k = torch.zeros(shape, dtype=e.dtype, device=dev)
        self.cache_v = torch.zeros(shape, dtype=e.dtype, device=dev)
        vocab = e.head.weight.shape[0]
        self.eos = torch.tensor(list(eos) or [-1], device=dev)
        # static inputs and outputs of the decode step
        self.hidden = torch.zeros(rows, 1, e.embed.shape[1], dtype=e.dtype, device=dev)
        self.key_bias = torch.full((rows, length), -math.inf, dtype=e.dtype, device=dev)  # 0 where a slot holds a key
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # where the next token's K/V go
        self.column = torch.zeros(1, dtype=torch.long, device=dev)  # which response position is being drawn
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=dev)  # RoPE position of the next token
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)  # logits / τ, consumed by sampling
        self.noise = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)  # uniform in, consumed by sampling
        self.done = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.tokens = torch.zeros(rows, length, dtype=torch.long, device=dev)
        self.logps = torch.zeros(rows, length, dtype=torch.float32, device=dev)
        self.alive = torch.zeros(rows, length, dtype=torch.bool, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.released = False

    def release(self) -> None:
        """Drop the graph and every buffer (an evicted entry, or one whose capture failed)."""
        self.graph = None
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, None)
        self.released = True

    def _step(self) -> None:
        """Sample from self.hidden, record, then advance the network by the drawn token. Capturable: no host
        syncs, no allocation that depends on data, every index a device tensor."""
        e, ops = self.e, self.e.decode_ops
        h = ops.norm(self.hidden[:, -1], e.final_norm, e.eps)  # [B, H]
        self.logits.copy_(e.head(h))  # [B, V] float32, as logits_fp32 computes it
        if self.temperature != 1.0:
            self.logits.div_(self.temperature)
        token, token_logp = gumbel_sample_(self.logits, self.noise)  # [B], [B]
        alive = ~self.done
        out_token = torch.where(alive, token, torch.full_like(token, self.pad))
        self.tokens.index_copy_(1, self.column, out_token[:, None])
        self.logps.index_copy_(1, self.column, torch.where(alive, token_logp, torch.zeros_like(token_logp))[:, None])
        self.alive.index_copy_(1, self.column, alive[:, None])
        self.done.logical_or_(torch.isin(token, self.eos))
        # the drawn token through the network; its K/V land in `slot`
        self.key_bias.index_fill_(1, self.slot, 0.0)
        x = F.embedding(out_token[:, None], e.embed)  # [B, 1, H]
        cos, sin = e._rope_tables(self.next_pos[:, None])
        bias = self.key_bias[:, None, None, :]  # [B, 1, 1, S]
        for i in range(len(e.layers)):
            x = e._block(i, x, cos, sin, bias, self.cache_k, self.cache_v, self.slot, ops)
        self.hidden.copy_(x)
        self.slot.add_(1)
        self.column.add_(1)
        self.next_pos.add_(1)

    def _prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """The B real rows' prompts into the cache; rows B.. (the bucket's padding) start finished."""
        e = self.e
        B, P = prompt_ids.shape
        positions = position_ids_from(prompt_mask)  # [B, P]
        cos, sin = e._rope_tables(positions)
        causal = torch.ones(P, P, dtype=torch.bool, device=e.device).tril()
        seen = (causal[None] & prompt_mask[:, None, :]) | torch.eye(P, dtype=torch.bool, device=e.device)[None]
        # [B, 1, P, P]: padded queries see themselves only, so nothing is NaN
        bias = torch.zeros(B, 1, P, P, dtype=e.dtype, device=e.device).masked_fill_(~seen[:, None], -math.inf)
        x = F.embedding(prompt_ids, e.embed)  # [B, P, H]
        ks, vs = self.cache_k[:, :B, :, :P], self.cache_v[:, :B, :, :P]
        for i in range(len(e.layers)):
            x = e._block(i, x, cos, sin, bias, ks, vs, None)
        self.hidden.zero_()
        self.hidden[:B].copy_(x[:, -1:])
        self.key_bias.fill_(-math.inf)
        self.key_bias[:B, :P].masked_fill_(prompt_mask, 0.0)
        self.slot.fill_(P)
        self.column.zero_()
        self.next_pos.zero_()
        self.next_pos[:B].copy_(positions[:, -1] + 1)
        self.done.zero_()
        self.done[B:] = True

    def capture(self, pool, stream: torch.cuda.Stream) -> None:
        """Warm up on the side ``stream``, then capture one decode step into ``pool`` (CUDA only). Runs on the
        zeroed buffers; the prefill of every run resets the state the warm-up and the capture advanced."""
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        caller.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._step()
        finally:
            torch.cuda.set_stream(caller)  # torch.cuda.graph leaves its stream current if the capture's end fails
        self.graph = graph

    def run(
        self,
        prompt_ids,
        prompt_mask,
        max_new_tokens: int,
        generator: torch.Generator,
        share: tuple[slice, int] | None = None,
    ) -> Rollout:
        B = prompt_ids.shape[0]
        self._prefill(prompt_ids, prompt_mask)
        steps = 0
        whole = None if share is None else torch.empty(share[1], self.noise.shape[1], device=self.noise.device)
        for steps in range(1, max_new_tokens + 1):
            if whole is None:
                self.noise[:B].uniform_(generator=generator)  # one [B, V] draw per step, as the plain loop draws
            else:  # the whole batch's draw, these rows' part of it
                self.noise[:B].copy_(whole.uniform_(generator=generator)[share[0]])
            if self.rows > B:
                self.noise[B:].fill_(0.5)  # the padding rows: any finite noise (their tokens are discarded)
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            if steps % self.e.sync_every == 0 and bool(self.done.all()):
                break
        n = steps
        alive = self.alive[:B, :n]
        # rows that finished early have their trailing columns marked dead already; trim columns no row uses
        used = max(int(alive.sum(dim=1).max()) if n else 0, 1)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=self.tokens[:B, :used].clone(),
            response_mask=alive[:, :used].clone(),
            action_mask=alive[:, :used].clone(),
            sampler_logprobs=self.logps[:B, :used].clone(),
            cut=~self.done[:B].clone(),
        )


class EngineStepper:
    """The engine as ``sao.rollout.episodes`` drives it: every fed column (holes included) takes the next cache
    slot; a query sees the real keys before it and its own chunk's real keys up to itself (a hole sees only
    itself, so nothing is NaN, and nothing attends to it). Eager everywhere: rows act and wait between turns."""

    def __init__(self, engine: Engine, rows: int, capacity: int):
        self.e, self.rows, self.used = engine, rows, 0
        self._allocate(_round_up(max(capacity, 1), 64))

    def _allocate(self, capacity: int) -> None:
        e, old = self.e, getattr(self, "cache_k", None)
        shape = (len(e.layers), self.rows, e.kv_heads, capacity, e.head_dim)
        cache_k = torch.zeros(shape, dtype=e.dtype, device=e.device)
        cache_v = torch.zeros(shape, dtype=e.dtype, device=e.device)
        key_real = torch.zeros(self.rows, capacity, dtype=torch.bool, device=e.device)  # [B, S]
        if old is not None:
            cache_k[..., : self.used, :] = self.cache_k[..., : self.used, :]
            cache_v[..., : self.used, :] = self.cache_v[..., : self.used, :]
            key_real[:, : self.used] = self.key_real[:, : self.used]
        self.cache_k, self.cache_v, self.key_real, self.capacity = cache_k, cache_v, key_real, capacity

    @torch.no_grad()
    def feed(self, ids: torch.Tensor, real: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e = self.e
        B, L = ids.shape
        if self.used + L > self.capacity:
            self._allocate(_round_up(max(2 * self.capacity, self.used + L), 64))
        slots = torch.arange(self.used, self.used + L, device=e.device)  # [L]
        self.key_real[:, slots] = real
        S = self.capacity
        # [B, L, S]: the keys each new query sees — earlier real keys, its chunk's real keys up to itself, itself
        seen = self.key_real[:, None, :].expand(B, L, S).clone()
        later = torch.arange(S, device=e.device)[None, :] > slots[:, None]  # [L, S] keys after the query
        seen &= ~later[None]
        seen[:, torch.arange(L, device=e.device), slots] = True
        bias = torch.zeros(B, 1, L, S, dtype=e.dtype, device=e.device).masked_fill_(~seen[:, None], -math.inf)
        cos, sin = e._rope_tables(positions)
        x = F.embedding(ids, e.embed)  # [B, L, H]
        with e._kernels():
            for i in range(len(e.layers)):
                x = e._block(i, x, cos, sin, bias, self.cache_k, self.cache_v, slots)
        self.used += L
        return _rms_norm(x, e.final_norm, e.eps)  # [B, L, H] as the trunk's last_hidden_state

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = self.e.head(hidden).float()  # [B, V]
        return logits / temperature if temperature != 1.0 else logits
