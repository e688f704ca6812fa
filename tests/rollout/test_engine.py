"""sao.rollout.engine: the static-cache decoder keeps the sampler contract, draws the plain loop's tokens on the CPU,
agrees with the teacher-forced pass at least as tightly as the plain loop, calls SDPA the way the fused CUDA kernels
take it, and keeps a bounded cache of graphs that stores an entry only after its capture succeeded. On the CPU it
runs eagerly; the tests marked gpu (CUDA graphs, the SDPA backend, a failed capture on a real device) skip there."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sao.core.errors import ConfigError
from sao.model.forward import teacher_forced
from sao.model.policy import add_lora, load_base, lora_state
from sao.rollout import engine as engine_module
from sao.rollout.engine import Engine, _bucket, _Graph
from sao.rollout.sampler import SAMPLER_ADAPTER, PlainDecoder, StaleSampler, draw, encode_prompts, gumbel_sample_
from sao.tasks.gsm8k import format_prompt
from sao.tiny import arithmetic as tiny


def _policy(model_dir, dtype=torch.float32, device="cpu", lora_scale=0.05):
    base, tokenizer = load_base(model_dir, torch.device(device), dtype=dtype)
    policy = add_lora(base)
    with torch.no_grad():
        for name, tensor in lora_state(policy).items():
            if "lora_B" in name:  # a trained-looking adapter, so that the LoRA path is exercised
                tensor.normal_(0, lora_scale, generator=torch.Generator().manual_seed(1))
    return policy, tokenizer


def _prompts(tokenizer, n=24, device="cpu", every=7):
    tasks = tiny.all_questions()[::every][:n]
    texts = [format_prompt(tokenizer, t.question, tiny.TINY_INSTRUCTION) for t in tasks]
    texts[0] = texts[0].replace("What is", "Please tell me, what is")  # ragged prompt lengths: left padding
    return encode_prompts(tokenizer, texts, torch.device(device))


def _kwargs(tokenizer, **extra):
    return {
        "max_new_tokens": 20,
        "temperature": 1.0,
        "eos_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
        **extra,
    }


def _lag0_gap(policy, rollout) -> torch.Tensor:
    with torch.no_grad():
        tf = teacher_forced(
            policy, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask
        )
    return (tf.logprobs - rollout.sampler_logprobs)[rollout.response_mask].abs()


def test_engine_draws_what_the_plain_loop_draws_in_float32(tiny_model_dir):
    """Same noise stream, same float32 logits: on the CPU the engine reproduces the plain loop token for token."""
    policy, tokenizer = _policy(tiny_model_dir)
    ids, mask = _prompts(tokenizer)
    engine = Engine(policy, adapter="default")
    fast = engine.generate(ids, mask, **_kwargs(tokenizer), generator=torch.Generator().manual_seed(3))
    plain = draw(policy, ids, mask, **_kwargs(tokenizer), generator=torch.Generator().manual_seed(3))
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert torch.equal(fast.response_mask, plain.response_mask)
    assert torch.equal(fast.truncated, plain.truncated)
    torch.testing.assert_close(fast.sampler_logprobs, plain.sampler_logprobs, atol=1e-5, rtol=0)
    assert _lag0_gap(policy, fast).max() < 1e-4


def test_engine_agrees_with_teacher_forcing_at_least_as_tightly_as_the_plain_loop_in_bf16(tiny_model_dir):
    policy, tokenizer = _policy(tiny_model_dir, dtype=torch.bfloat16)
    ids, mask = _prompts(tokenizer, n=64)
    engine = Engine(policy, adapter="default")
    fast = engine.generate(ids, mask, **_kwargs(tokenizer), generator=torch.Generator().manual_seed(0))
    plain = draw(policy, ids, mask, **_kwargs(tokenizer), generator=torch.Generator().manual_seed(0))
    gap_engine, gap_plain = _lag0_gap(policy, fast), _lag0_gap(policy, plain)
    # measured on this model: engine mean ~1e-6, plain ~1e-3 (HF's decode path differs from its full pass)
    assert gap_engine.mean() <= gap_plain.mean()
    assert gap_engine.max() <= max(gap_plain.max(), 1e-3)


def test_engine_follows_the_stale_samplers_adapter_across_refreshes(tiny_model_dir):
    policy, tokenizer = _policy(tiny_model_dir)
    sampler = StaleSampler(policy, lag=4)
    engine = Engine(policy, adapter=SAMPLER_ADAPTER)
    ids, mask = _prompts(tokenizer)
    with torch.no_grad():
        for tensor in lora_state(policy).values():
            tensor.add_(0.1 * torch.randn_like(tensor))  # the policy moves on; the sampler has not been refreshed
    for refreshed in (False, True):
        if refreshed:
            sampler.refresh(version=1)
        sampler_decoder = PlainDecoder(policy, SAMPLER_ADAPTER)
        want = sampler_decoder.generate(ids, mask, **_kwargs(tokenizer), generator=torch.Generator().manual_seed(5))
        got = engine.generate(ids, mask, **_kwargs(tokenizer), generator=torch.Generator().manual_seed(5))
        assert torch.equal(got.response_ids, want.response_ids), f"refreshed={refreshed}"


def test_engine_stops_at_eos_and_pads_like_the_sampler(tiny_model_dir):
    policy, tokenizer = _policy(tiny_model_dir, lora_scale=0.0)
    ids, mask = _prompts(tokenizer)
    rollout = Engine(policy, adapter="default").generate(
        ids, mask, **_kwargs(tokenizer, max_new_tokens=40), generator=torch.Generator().manual_seed(0)
    )
    assert rollout.response_ids.shape[1] == int(rollout.response_mask.sum(1).max()) < 40
    for row, m, lp in zip(rollout.response_ids, rollout.response_mask, rollout.sampler_logprobs, strict=True):
        n = int(m.sum())
        assert row[n - 1] == tokenizer.eos_token_id and (row[n:] == tokenizer.pad_token_id).all()
        assert (lp[:n] < 0).all() and (lp[n:] == 0).all()
    assert not rollout.truncated.any()


def test_unsupported_architecture_is_a_config_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ConfigError, match="--decoder plain"):
        Engine(model)


# -- sampling: one formula for both paths ---------------------------------------------------------------------


def test_gumbel_sample_draws_from_the_softmax_and_records_logit_minus_logsumexp():
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0]]).repeat(40_000, 1)  # [N, 4]
    want = torch.softmax(logits[0], -1)
    noise = torch.rand(logits.shape, generator=torch.Generator().manual_seed(0))
    token, logp = gumbel_sample_(logits.clone(), noise)
    freq = torch.bincount(token, minlength=4).float() / len(token)
    assert (freq - want).abs().max() < 0.01  # 40k draws: the standard error is under 0.0025
    torch.testing.assert_close(logp, torch.log(want)[token], atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_and_plain_loop_draw_the_same_tokens_over_many_rows_and_steps(tiny_model_dir, temperature):
    """96 rows × 48 steps, no EOS stop (every draw counts), float32: token for token, as the shared
    ``gumbel_sample_`` makes them by construction (the old log-softmax formula differed about once in 4M)."""
    policy, tokenizer = _policy(tiny_model_dir)
    ids, mask = _prompts(tokenizer, n=96, every=3)
    kw = _kwargs(tokenizer, max_new_tokens=48, temperature=temperature, eos_token_ids=[])
    fast = Engine(policy, adapter="default").generate(ids, mask, **kw, generator=torch.Generator().manual_seed(11))
    plain = draw(policy, ids, mask, **kw, generator=torch.Generator().manual_seed(11))
    assert fast.response_ids.shape == (96, 48)
    assert torch.equal(fast.response_ids, plain.response_ids)
    # the hidden states differ by float32 rounding (HF's modules vs the engine's), more so 48 tokens in
    torch.testing.assert_close(fast.sampler_logprobs, plain.sampler_logprobs, atol=5e-5, rtol=0)


# -- weights: fused buffers that follow the model ---------------------------------------------------------


def test_fused_buffers_are_refilled_from_the_model_at_every_call(tiny_model_dir):
    """A change the version counter cannot see (through ``.data``) is still picked up by the next call."""
    policy, tokenizer = _policy(tiny_model_dir)
    engine = Engine(policy, adapter="default")
    ids, mask = _prompts(tokenizer, n=8)
    kw = _kwargs(tokenizer, eos_token_ids=[])
    before = engine.generate(ids, mask, **kw, generator=torch.Generator().manual_seed(2))
    for name, tensor in lora_state(policy).items():
        if "lora_A" in name and ("q_proj" in name or "gate_proj" in name):
            tensor.data.mul_(-3.0)
    after = engine.generate(ids, mask, **kw, generator=torch.Generator().manual_seed(2))
    want = draw(policy, ids, mask, **kw, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(after.response_ids, before.response_ids)
    assert torch.equal(after.response_ids, want.response_ids)


# -- attention: the call the fused CUDA kernels take ------------------------------------------------------


def test_every_sdpa_call_has_as_many_query_heads_as_key_heads_and_no_gqa_flag(tiny_model_dir, monkeypatch):
    """GQA (the tiny model: 2 query heads, 1 K/V head) folded into the query axis: on CUDA, ``enable_gqa`` with an
    explicit mask falls back to the math kernel, which materialises the repeated K/V; none of that here."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape, k.shape, attn_mask.dtype, attn_mask.shape, kwargs))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(engine_module.F, "scaled_dot_product_attention", spy)
    policy, tokenizer = _policy(tiny_model_dir)
    ids, mask = _prompts(tokenizer, n=4)
    Engine(policy, adapter="default").generate(ids, mask, **_kwargs(tokenizer), generator=torch.Generator())
    prefill, decode = calls[: len(policy.get_base_model().model.layers)], calls[-1]
    assert len(calls) > len(prefill)
    config = policy.get_base_model().config
    kv_heads, group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    assert (kv_heads, group) == (1, 2), "the tiny model's shape this test was written for"
    for q, k, dtype, bias, kwargs in calls:
        assert q[1] == k[1] == kv_heads and "enable_gqa" not in kwargs and dtype == torch.float32
        assert bias[1] == 1 and bias[2] in (1, q[2])
    assert decode[0][2] == group  # the decode step: 2 query heads per K/V head, one position each


# -- the graph cache: buckets, LRU, store after success ---------------------------------------------------


def test_batch_sizes_round_up_to_buckets():
    assert [_bucket(b) for b in (1, 2, 3, 5, 8, 17, 32, 33, 64, 65, 480, 481)] == [
        1,
        2,
        4,
        8,
        8,
        32,
        32,
        64,
        64,
        96,
        480,
        512,
    ]


def test_padded_rows_are_dropped_and_the_real_rows_draw_the_plain_loops_tokens(tiny_model_dir):
    """5 rows run in the bucket of 8: the noise stream is the plain loop's (one [5, V] draw a step), the
    three padding rows never show, and 7 rows later reuse the same entry."""
    policy, tokenizer = _policy(tiny_model_dir)
    ids, mask = _prompts(tokenizer, n=7)
    engine = Engine(policy, adapter="default")
    kw = _kwargs(tokenizer)
    fast = engine.generate(ids[:5], mask[:5], **kw, generator=torch.Generator().manual_seed(4))
    plain = draw(policy, ids[:5], mask[:5], **kw, generator=torch.Generator().manual_seed(4))
    assert fast.response_ids.shape[0] == fast.truncated.shape[0] == 5
    assert torch.equal(fast.response_ids, plain.response_ids)
    assert torch.equal(fast.response_mask, plain.response_mask)
    (entry,) = engine._graphs.values()
    assert entry.rows == 8
    engine.generate(ids, mask, **kw, generator=torch.Generator().manual_seed(4))
    assert list(engine._graphs.values()) == [entry]


def test_graph_cache_keeps_the_most_recently_used_entries_and_releases_the_evicted(tiny_model_dir):
    policy, tokenizer = _policy(tiny_model_dir)
    ids, mask = _prompts(tokenizer, n=4)
    engine = Engine(policy, adapter="default", max_graphs=2)
    kw = _kwargs(tokenizer, max_new_tokens=2)

    def run(rows):
        engine.generate(ids[:rows], mask[:rows], **kw, generator=torch.Generator())
        return [entry.rows for entry in engine._graphs.values()]  # least recently used first

    assert run(1) == [1]
    assert run(2) == [1, 2]
    first = engine._graphs[next(iter(engine._graphs))]
    assert run(1) == [2, 1]  # a hit moves the entry to the end
    second = engine._graphs[next(iter(engine._graphs))]
    assert run(4) == [1, 4]  # the least recently used (2 rows) goes
    assert second.released and second.cache_k is None and second.noise is None
    assert not first.released


def test_a_failed_capture_stores_nothing_frees_its_buffers_and_a_smaller_retry_succeeds(tiny_model_dir, monkeypatch):
    """Simulated out-of-memory during the capture of the 16-row bucket (capture=True on the CPU, the capture
    itself stubbed): the entry is released before the error reaches the caller, who retries with 8 rows."""
    attempts, emptied = [], []

    def capture(self, pool, stream):
        attempts.append(weakref.ref(self))
        if self.rows > 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(_Graph, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "the shared pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "the side stream")
    policy, tokenizer = _policy(tiny_model_dir)
    ids, mask = _prompts(tokenizer, n=16)
    assert len(ids) == 16
    engine = Engine(policy, adapter="default", capture=True)
    monkeypatch.setattr(engine, "_empty_cache", lambda: emptied.append(True))
    kw = _kwargs(tokenizer)
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        engine.generate(ids, mask, **kw, generator=torch.Generator())
    failed = attempts[0]()  # still alive: the traceback the caller holds references it
    assert failed is not None and raised.value.__traceback__ is not None
    assert failed.released and failed.cache_k is None and failed.logits is None  # yet its buffers are gone
    assert not engine._graphs and emptied == [True]
    del failed, raised
    half = engine.generate(ids[:8], mask[:8], **kw, generator=torch.Generator().manual_seed(1))
    assert [entry.rows for entry in engine._graphs.values()] == [8] and half.response_ids.shape[0] == 8
    assert engine._pool == "the shared pool"


# -- torch.compile (off by default) ---------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_elementwise_ops_draw_the_eager_tokens(tiny_model_dir):
    """The flag works (compiles on first use, precision casts emulated); whether it is faster is a GPU question."""
    pytest.importorskip("torch._inductor")
    policy, tokenizer = _policy(tiny_model_dir)
    ids, mask = _prompts(tokenizer, n=4)
    kw = _kwargs(tokenizer, max_new_tokens=6, eos_token_ids=[])
    eager = Engine(policy, adapter="default").generate(ids, mask, **kw, generator=torch.Generator().manual_seed(0))
    compiled = Engine(policy, adapter="default", compile_elementwise=True)
    fast = compiled.generate(ids, mask, **kw, generator=torch.Generator().manual_seed(0))
    assert compiled.decode_ops is not engine_module.EAGER
    assert torch.equal(fast.response_ids, eager.response_ids)
    torch.testing.assert_close(fast.sampler_logprobs, eager.sampler_logprobs, atol=1e-5, rtol=0)


# -- on a GPU -------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _qwen_shaped_policy(layers: int = 2):
    """Qwen2.5-1.5B's attention shape (12 query heads, 2 K/V heads, head_dim 128), random weights, bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=1536,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = Qwen2ForCausalLM(config).to(torch.bfloat16)
    base.eval()
    policy = add_lora(base)
    with torch.no_grad():
        for name, tensor in lora_state(policy).items():
            if "lora_B" in name:
                tensor.normal_(0, 0.02)
    return policy


def _random_prompts(batch: int, length: int = 100):
    ids = torch.randint(10, 4000, (batch, length), generator=torch.Generator().manual_seed(batch)).cuda()
    mask = torch.ones(batch, length, dtype=torch.bool, device="cuda")
    mask[::3, :17] = False  # some rows left-padded
    return ids, mask


_GPU_KW = {"max_new_tokens": 24, "temperature": 1.0, "eos_token_ids": [], "pad_token_id": 0}


@pytest.mark.gpu
@cuda
def test_cuda_graph_replay_equals_the_eager_step(tiny_model_dir):
    policy, tokenizer = _policy(tiny_model_dir, dtype=torch.bfloat16, device="cuda")
    ids, mask = _prompts(tokenizer, device="cuda")
    graphed = Engine(policy, adapter="default", capture=True)
    eager = Engine(policy, adapter="default", capture=False)
    runs = []
    for engine in (graphed, eager):
        gen = torch.Generator(device="cuda").manual_seed(0)
        runs.append(engine.generate(ids, mask, **_kwargs(tokenizer), generator=gen))
    assert torch.equal(runs[0].response_ids, runs[1].response_ids)
    torch.testing.assert_close(runs[0].sampler_logprobs, runs[1].sampler_logprobs)
    assert graphed._graphs and next(iter(graphed._graphs.values())).graph is not None


@pytest.mark.gpu
@cuda
def test_engine_agrees_with_teacher_forcing_at_least_as_tightly_as_the_plain_loop_on_cuda(tiny_model_dir):
    policy, tokenizer = _policy(tiny_model_dir, dtype=torch.bfloat16, device="cuda")
    ids, mask = _prompts(tokenizer, n=64, device="cuda")
    fast = Engine(policy, adapter="default").generate(
        ids, mask, **_kwargs(tokenizer), generator=torch.Generator(device="cuda").manual_seed(0)
    )
    plain = draw(policy, ids, mask, **_kwargs(tokenizer), generator=torch.Generator(device="cuda").manual_seed(0))
    gap_engine, gap_plain = _lag0_gap(policy, fast), _lag0_gap(policy, plain)
    print(
        f"lag-0 |log ratio| on CUDA, mean / max: engine {gap_engine.mean():.3g} / {gap_engine.max():.3g}, "
        f"plain {gap_plain.mean():.3g} / {gap_plain.max():.3g}"
    )
    assert gap_engine.mean() <= gap_plain.mean()
    assert gap_engine.max() <= max(gap_plain.max(), 1e-3)


@pytest.mark.gpu
@cuda
def test_decode_attention_takes_a_fused_sdpa_kernel_at_qwen_1p5b_head_shape():
    """With the math backend disallowed (a fallback would raise), the eager run's profile shows the memory-efficient
    or flash kernel and never the math one, and the graph captures under the same restriction."""
    from torch.profiler import ProfilerActivity, profile

    policy = _qwen_shaped_policy()
    ids, mask = _random_prompts(16)
    fused = {"aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention"}
    for capture in (False, True):
        engine = Engine(policy, adapter="default", capture=capture)
        gen = torch.Generator(device="cuda").manual_seed(0)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            if capture:  # no profiler around a capture
                out = engine.generate(ids, mask, **_GPU_KW, generator=gen)
            else:
                with profile(activities=[ProfilerActivity.CPU]) as prof:  # the aten op names are what it asserts on
                    out = engine.generate(ids, mask, **_GPU_KW, generator=gen)
                names = {event.name for event in prof.events()}
                attention = sorted(n for n in names if "attention" in n)
                assert names & fused and not any("attention_math" in n for n in names), attention
        assert out.response_ids.shape == (16, 24) and torch.isfinite(out.sampler_logprobs).all()
        assert (next(iter(engine._graphs.values())).graph is not None) == capture


@pytest.mark.gpu
@cuda
def test_a_capture_that_fails_on_cuda_frees_its_memory_and_a_smaller_batch_then_captures(monkeypatch):
    """Out of memory raised inside a real capture (in the second layer of the step, with the first layer's
    kernels already captured): nothing is stored, the entry's buffers are returned, the caller's stream is
    current again, and the retry at a smaller batch captures into the same pool and decodes what the eager
    step decodes."""
    policy = _qwen_shaped_policy()
    real_block = Engine._block

    def block(self, i, x, *args, **kwargs):
        if i == 1 and x.shape[0] > 32 and torch.cuda.is_current_stream_capturing():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated, mid-capture)")
        return real_block(self, i, x, *args, **kwargs)

    monkeypatch.setattr(Engine, "_block", block)
    engine = Engine(policy, adapter="default", capture=True)
    ids, mask = _random_prompts(64)
    engine.generate(ids[:8], mask[:8], **_GPU_KW, generator=torch.Generator(device="cuda"))  # pool, stream, cuBLAS
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.generate(ids, mask, **_GPU_KW, generator=torch.Generator(device="cuda"))
    torch.cuda.synchronize()
    assert [e.rows for e in engine._graphs.values()] == [8] and torch.cuda.current_stream() == stream
    assert torch.cuda.memory_allocated() - baseline < 2**20  # the 64-row entry's KV cache alone is 16 MiB
    gen = torch.Generator(device="cuda").manual_seed(3)
    got = engine.generate(ids[:32], mask[:32], **_GPU_KW, generator=gen)
    entry = engine._graphs[next(reversed(engine._graphs))]
    assert entry.graph is not None and entry.rows == 32 and len(engine._graphs) == 2
    want = Engine(policy, adapter="default", capture=False).generate(
        ids[:32], mask[:32], **_GPU_KW, generator=torch.Generator(device="cuda").manual_seed(3)
    )
    assert torch.equal(got.response_ids, want.response_ids)


@pytest.mark.gpu
@cuda
def test_graphs_share_one_pool_and_an_evicted_graph_returns_its_memory():
    policy = _qwen_shaped_policy()
    engine = Engine(policy, adapter="default", capture=True, max_graphs=1)
    for rows in (64, 8):
        ids, mask = _random_prompts(rows)
        engine.generate(ids, mask, **_GPU_KW, generator=torch.Generator(device="cuda"))
        if rows == 64:
            torch.cuda.synchronize()
            with_64 = torch.cuda.memory_allocated()
            first_pool = engine._pool
    torch.cuda.synchronize()
    assert engine._pool is first_pool and [e.rows for e in engine._graphs.values()] == [8]
    assert torch.cuda.memory_allocated() < with_64  # the 64-row entry's buffers went with it
