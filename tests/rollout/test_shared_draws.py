"""Each torchrun process draws its rows of a batch (``draw_batch(rows=...)``, the decoders' ``share``): the rows
drawn apart and put together are the batch one call draws, token for token, on the plain loop and on the engine."""

from __future__ import annotations

import pytest
import torch

from sao.rollout.types import Rollout


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    from sao.model.policy import eos_ids, load_base
    from sao.rollout.types import Sampling
    from sao.tasks.environments import prompt_text
    from sao.tiny import arithmetic as tiny

    model, tokenizer = load_base(str(tiny_model_dir), torch.device("cpu"))
    prompts = [prompt_text(tokenizer, t, tiny.TINY_INSTRUCTION) for t in tiny.make_split(12, 4, 0).train]
    return model, tokenizer, prompts, Sampling(20, 1.0, eos_ids(tokenizer, model), tokenizer.pad_token_id)


@pytest.mark.parametrize("kind", ["plain", "graph"])
def test_rows_drawn_apart_are_the_rows_of_one_draw(tiny_policy, kind):
    from sao.rollout.sources import draw_batch, make_decoder

    model, tokenizer, prompts, sampling = tiny_policy
    decoder = make_decoder(model, None, kind)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = draw_batch(decoder, tokenizer, prompts, sampling, torch.Generator().manual_seed(5))
        parts = [
            draw_batch(decoder, tokenizer, prompts, sampling, torch.Generator().manual_seed(5), rows=rows)
            for rows in (slice(0, 4), slice(4, 8), slice(8, 12))
        ]
    finally:
        torch.set_num_threads(threads)
    joined = Rollout.concat(parts, tokenizer.pad_token_id)
    assert joined.texts == whole.texts and len(set(whole.texts)) > 3, "the same replies, and not all alike"
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "action_mask", "cut"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    assert torch.allclose(joined.sampler_logprobs, whole.sampler_logprobs, atol=1e-5, rtol=0)
    assert [p.prompt_ids.shape[1] for p in parts] == [whole.prompt_ids.shape[1]] * 3, "the batch's prompt padding"
