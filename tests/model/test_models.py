"""The teacher-forced pass, chunked log-probabilities, the value head and what each optimizer may move."""

from __future__ import annotations

import pytest
import torch

from sao.model.forward import teacher_forced, token_logprobs
from sao.model.policy import ValueHead, add_lora, load_base, lora_state
from sao.rollout.sampler import SAMPLER_ADAPTER, PlainDecoder, StaleSampler, encode_prompts


@pytest.fixture
def policy(tiny_model_dir):
    base, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    return add_lora(base), tokenizer


def _rollout(policy, tokenizer, n=6, seed=0, adapter=None):
    prompts = [f"<|im_start|>user\nWhat is {i}+{i + 1}?<|im_end|>\n<|im_start|>assistant\n" for i in range(n)]
    prompts[0] = "<|im_start|>user\nCompute 7-9. End with #### N.<|im_end|>\n<|im_start|>assistant\n"  # longer
    ids, mask = encode_prompts(tokenizer, prompts, torch.device("cpu"))
    return PlainDecoder(policy, adapter).generate(
        ids,
        mask,
        max_new_tokens=12,
        temperature=1.0,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
    )


def test_chunked_logprobs_equal_the_naive_full_softmax_in_value_and_gradient():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    naive = torch.log_softmax(head(hidden), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    (g_naive,) = torch.autograd.grad(naive.sum(), hidden)
    for chunk in (1, 5, 37, 100):
        chunked = token_logprobs(head, hidden, targets, chunk=chunk)
        (g_chunk,) = torch.autograd.grad(chunked.sum(), hidden)
        torch.testing.assert_close(chunked, naive)
        torch.testing.assert_close(g_chunk, g_naive)
    hot = token_logprobs(head, hidden, targets, temperature=0.5, chunk=8)
    torch.testing.assert_close(hot, torch.log_softmax(head(hidden) / 0.5, -1).gather(-1, targets[:, None]).squeeze(-1))


def test_teacher_forced_pass_reproduces_the_samplers_logprobs_at_lag_zero(policy):
    model, tokenizer = policy
    rollout = _rollout(model, tokenizer)
    assert not rollout.prompt_mask.all(), "the batch must contain left padding to test positions"
    with torch.no_grad():
        tf = teacher_forced(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
    m = rollout.response_mask
    gap = (tf.logprobs - rollout.sampler_logprobs)[m].abs()
    assert gap.max() < 1e-4, f"|log ratio| max {gap.max():.2e}"
    assert (tf.logprobs[~m] == 0).all()
    assert tf.hidden.shape[:2] == m.shape and not tf.hidden.requires_grad
    tensors = (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, m)
    rows = [teacher_forced(model, *(t[i : i + 2] for t in tensors)) for i in range(0, len(m), 2)]
    torch.testing.assert_close(torch.cat([r.logprobs for r in rows]), tf.logprobs, atol=1e-5, rtol=0)


def test_sampler_records_the_logprob_of_the_drawn_token_and_stops_at_eos(policy):
    model, tokenizer = policy
    rollout = _rollout(model, tokenizer, seed=3)
    eos = tokenizer.eos_token_id
    for row, mask, lp, truncated in zip(
        rollout.response_ids, rollout.response_mask, rollout.sampler_logprobs, rollout.truncated, strict=True
    ):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        assert (lp[:n] < 0).all() and (lp[n:] == 0).all()
        assert (row[n:] == tokenizer.pad_token_id).all()
        assert bool(truncated) == (row[n - 1].item() != eos)
    again = _rollout(model, tokenizer, seed=3)
    assert torch.equal(again.response_ids, rollout.response_ids), "same generator seed, same draw"


def test_value_head_gradient_never_reaches_the_trunk_or_the_adapter(policy):
    model, tokenizer = policy
    rollout = _rollout(model, tokenizer)
    head = ValueHead(model.get_base_model().config.hidden_size)
    assert head(torch.randn(3, head.linear.in_features)).abs().max() == 0, "zero-initialised"
    tf = teacher_forced(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
    loss = (head(tf.hidden)[rollout.response_mask] - 1.0).pow(2).mean()
    loss.backward()
    assert head.linear.weight.grad is not None and head.linear.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())


def test_policy_optimizer_moves_only_the_policy_lora_weights(policy):
    model, tokenizer = policy
    sampler = StaleSampler(model, lag=4)
    lora = list(lora_state(model).values())
    assert {id(p) for p in lora} == {id(p) for p in model.parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rollout = _rollout(model, tokenizer)
    tf = teacher_forced(model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask)
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    (-(tf.logprobs.sum())).backward()
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "the step moved nothing"
    assert all("lora_" in n and ".default." in n for n in changed), sorted(changed)[:3]
    assert sampler.version == 0


def test_stale_sampler_is_a_frozen_copy_until_refreshed(policy):
    model, tokenizer = policy
    sampler = StaleSampler(model, lag=2)
    with torch.no_grad():
        for p in lora_state(model).values():
            p.add_(0.05 * torch.randn_like(p))
    fresh = _rollout(model, tokenizer, seed=1)
    stale = _rollout(model, tokenizer, seed=1, adapter=SAMPLER_ADAPTER)
    assert not torch.equal(fresh.sampler_logprobs, stale.sampler_logprobs)
    assert all(p.requires_grad for p in lora_state(model).values()), "the policy adapter is trainable again"
    sampler.refresh(version=7)
    refreshed = _rollout(model, tokenizer, seed=1, adapter=SAMPLER_ADAPTER)
    assert torch.equal(refreshed.response_ids, fresh.response_ids) and sampler.version == 7


def test_activation_checkpointing_saves_less_and_keeps_the_gradient(policy):
    """With checkpointing on, the forward keeps a fraction of the activations for the backward (counted
    through autograd's saved-tensor hooks) and the LoRA gradient is the same."""
    from sao.model.policy import set_activation_checkpointing

    model, tokenizer = policy
    rollout = _rollout(model, tokenizer)
    saved, grads = [], []
    for enabled in (False, True):
        set_activation_checkpointing(model, enabled)
        count = {"numel": 0}

        def pack(tensor, count=count):
            count["numel"] += tensor.numel()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            tf = teacher_forced(
                model, rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask
            )
        tf.logprobs.sum().backward()
        saved.append(count["numel"])
        grads.append([p.grad.clone() for p in lora_state(model).values()])
        model.zero_grad(set_to_none=True)
    set_activation_checkpointing(model, False)
    assert saved[1] < 0.7 * saved[0], saved
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
