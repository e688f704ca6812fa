"""sao.rollout.vllm against a real vLLM CPU server on 127.0.0.1: token ids in and out, log-probs on sao's footing,
adapters by name and at run time, concurrency, and every reply checked.

The server is the session's one on the shipped tiny model (``tiny_vllm``; its start is the cost, 1-3 min on 2 busy
cores, nearly all of it importing vLLM in its processes), here with random PEFT LoRA adapters. The reference for
every log-prob is a teacher-forced pass of the same weights in HF transformers + PEFT (sao's venv):
log_softmax(logits / T) at each sampled token. The process tree gone after stop is checked where a run launches
its own server (tests/rollout/test_vllm_source.py).

Skipped when ``.venv-vllm`` is absent (``make install-vllm`` builds it). The server tests are marked ``slow``; the
reply checks and the unreachable-URL case need no server. Deliberately left out: throughput numbers (see
BENCHMARKS.md) and any mock of vLLM.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import pytest
import torch

from sao.core.errors import ConfigError, DataError
from sao.rollout.vllm import (
    VllmClient,
    VllmError,
    VllmServer,
    check_vllm_python,
    complete_many,
    default_vllm_python,
    free_port,
    parse_completion,
)

VLLM_PYTHON = default_vllm_python()
needs_vllm = pytest.mark.skipif(VLLM_PYTHON is None, reason=".venv-vllm is absent: make install-vllm builds it")
TEMPERATURE = 0.7
MAX_TOKENS = 24
QUESTIONS = ["What is 3+4?", "Compute 9-2.", "7+5=?", "What is 8-9?", "Compute 1+1.", "6-6=?"]


def server_test(test):
    return pytest.mark.slow(needs_vllm(test))


# ---------------------------------------------------------------------------------------------------------------
# The model: the shipped tiny model (2 heads of 32, 1 KV head); adapters r16/alpha32 on every linear layer with
# random A and B (PEFT starts B at 0, which would make an adapter equal to the base).


def build_adapter(base: Path, folder: Path, *, seed: int, rank: int = 16) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sao.model.artifacts import save_adapter
    from sao.model.policy import ValueHead, add_lora

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    policy = add_lora(model, rank=rank, alpha=2 * rank, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:  # [out, r]
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    tokenizer = AutoTokenizer.from_pretrained(base)
    return save_adapter(policy, tokenizer, ValueHead(model.config.hidden_size), folder, base_model=str(base))


class TeacherForcing:
    """HF transformers (+ PEFT) log_softmax(logits / T) at given completion tokens, one unpadded pass per sequence."""

    def __init__(self, base: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        self.adapters: dict[Path, object] = {}

    def logprobs(self, adapter: Path | None, prompt_token_ids, completion_token_ids, temperature: float) -> list[float]:
        from peft import PeftModel

        if adapter is None:
            model = self.model
        else:
            if adapter not in self.adapters:
                from transformers import AutoModelForCausalLM

                fresh = AutoModelForCausalLM.from_pretrained(self.model.name_or_path, dtype=torch.float32)
                self.adapters[adapter] = PeftModel.from_pretrained(fresh, adapter).eval()
            model = self.adapters[adapter]
        ids = torch.tensor([[*prompt_token_ids, *completion_token_ids]])  # [1, P+C]
        P, C = len(prompt_token_ids), len(completion_token_ids)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, P - 1 : P + C - 1].float()  # [C, V]
        logprobs = torch.log_softmax(logits / temperature, dim=-1)  # [C, V]
        return logprobs.gather(1, torch.tensor(completion_token_ids)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def world(tiny_vllm, tiny_model_dir, tmp_path_factory):
    """The session's server on the tiny model, its tokenizer, and random adapters ("a" loaded at the start)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vllm")
    base = tiny_model_dir
    adapters = {
        "a": build_adapter(base, root / "adapter_a", seed=1),
        "b1": build_adapter(base, root / "adapter_b1", seed=2),
        "b2": build_adapter(base, root / "adapter_b2", seed=3),
        "r32": build_adapter(base, root / "adapter_r32", seed=4, rank=32),
    }
    tokenizer = AutoTokenizer.from_pretrained(base)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for c in chats
    ]
    client = tiny_vllm.client()
    client.load_adapter("a", adapters["a"])
    yield {
        "base": base,
        "adapters": adapters,
        "tokenizer": tokenizer,
        "prompts": prompts,
        "server": tiny_vllm,
        "client": client,
        "reference": TeacherForcing(base),
    }
    for name in ("a", "b"):  # the session's server goes on serving other modules
        with contextlib.suppress(VllmError):
            client.unload_adapter(name)


def agreement(world, completions, adapter: Path | None, temperature: float) -> tuple[float, float, int]:
    """(mean, max, count) of |teacher-forced - recorded| log-prob over every completion token."""
    diffs = []
    for done in completions:
        forced = world["reference"].logprobs(adapter, done.prompt_token_ids, done.completion_token_ids, temperature)
        diffs += [abs(f - r) for f, r in zip(forced, done.sampler_logprobs, strict=True)]
    return sum(diffs) / len(diffs), max(diffs), len(diffs)


# ---------------------------------------------------------------------------------------------------------------
# Against the server


@server_test
def test_token_ids_in_and_out(world):
    client, tokenizer, prompt = world["client"], world["tokenizer"], world["prompts"][0]
    base_name = str(world["base"])
    assert client.health()
    assert client.models()[0] == base_name and "a" in client.models()
    done = client.complete(prompt, model=base_name, max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    assert done.prompt_token_ids == prompt
    assert 1 <= len(done.completion_token_ids) == len(done.sampler_logprobs) <= MAX_TOKENS
    assert done.finish_reason in ("stop", "length")
    assert all(lp <= 0 for lp in done.sampler_logprobs)
    # The ids are the record; the text is for reading. One token is one byte here, and vLLM's incremental
    # detokeniser holds back a trailing incomplete UTF-8 sequence that a whole decode shows as U+FFFD.
    decoded = tokenizer.decode(done.completion_token_ids, skip_special_tokens=True)
    assert decoded.rstrip("\ufffd") == done.text.rstrip("\ufffd")
    # The same seed draws the same tokens; ignore_eos runs to max_tokens.
    again = client.complete(prompt, model=base_name, max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    assert again.completion_token_ids == done.completion_token_ids
    full = client.complete(prompt, model=base_name, max_tokens=MAX_TOKENS, seed=6, ignore_eos=True)
    assert len(full.completion_token_ids) == MAX_TOKENS and full.finish_reason == "length"


@server_test
def test_processed_logprobs_match_teacher_forcing_at_temperature(world):
    """processed_logprobs records log_softmax(logits / T): sao's ratio footing, for the base and for an adapter."""
    client, prompts = world["client"], world["prompts"]
    for model, adapter in ((str(world["base"]), None), ("a", world["adapters"]["a"])):
        replies = complete_many(
            client,
            prompts,
            seeds=range(len(prompts)),
            model=model,
            max_tokens=MAX_TOKENS,
            temperature=TEMPERATURE,
            ignore_eos=True,
        )
        mean, worst, count = agreement(world, replies, adapter, TEMPERATURE)
        assert count == len(prompts) * MAX_TOKENS
        assert mean < 1e-4 and worst < 1e-3, (model, mean, worst)
        # The untempered footing (what raw_logprobs would record) is far off: the check has teeth.
        untempered, _, _ = agreement(world, replies, adapter, 1.0)
        assert untempered > 1e-2, (model, untempered)


@server_test
def test_adapter_by_name_differs_from_base(world):
    client, prompt = world["client"], world["prompts"][1]
    base = client.complete(prompt, model=str(world["base"]), max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    lora = client.complete(prompt, model="a", max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    assert base.prompt_token_ids == lora.prompt_token_ids
    # Score the adapter's own tokens under the base: the adapter really moved the distribution.
    base_scores = world["reference"].logprobs(None, prompt, lora.completion_token_ids, 1.0)
    gap = sum(abs(b - a) for b, a in zip(base_scores, lora.sampler_logprobs, strict=True)) / len(base_scores)
    assert gap > 0.05, gap
    assert base.sampler_logprobs != lora.sampler_logprobs


@server_test
def test_load_unload_and_reload_in_place(world):
    client, prompt, adapters = world["client"], world["prompts"][2], world["adapters"]

    def matches(adapter_path: Path) -> float:
        done = client.complete(prompt, model="b", max_tokens=12, temperature=TEMPERATURE, seed=11, ignore_eos=True)
        mean, _, _ = agreement(world, [done], adapter_path, TEMPERATURE)
        return mean

    client.load_adapter("b", adapters["b1"])
    assert "b" in client.models()
    assert matches(adapters["b1"]) < 1e-4
    with pytest.raises(VllmError, match="already been loaded") as refused:
        client.load_adapter("b", adapters["b2"])
    assert "\n" not in str(refused.value)
    # A new version from a new folder (prefix-cache blocks are keyed by name and path).
    client.load_adapter("b", adapters["b2"], load_inplace=True)
    assert matches(adapters["b2"]) < 1e-4
    assert matches(adapters["b1"]) > 1e-2
    client.unload_adapter("b")
    assert "b" not in client.models()
    with pytest.raises(VllmError, match="'b'") as gone:
        client.complete(prompt, model="b", max_tokens=4)
    assert "\n" not in str(gone.value)
    with pytest.raises(VllmError, match="cannot be found"):
        client.unload_adapter("b")


@server_test
def test_adapter_load_refused_is_one_line(world):
    client = world["client"]
    with pytest.raises(VllmError) as too_big:
        client.load_adapter("big", world["adapters"]["r32"])
    message = str(too_big.value)
    assert "\n" not in message and "big" in message and "32" in message and "16" in message, message
    with pytest.raises(VllmError) as missing:
        client.load_adapter("nowhere", world["base"].parent / "no_such_adapter")
    assert "\n" not in str(missing.value) and "no_such_adapter" in str(missing.value)
    assert "big" not in client.models() and "nowhere" not in client.models()
    assert client.health()  # the server survived both


@server_test
def test_concurrent_requests_match_one_at_a_time(world):
    client, prompts = world["client"], world["prompts"] * 2  # 12 requests
    params = {"model": "a", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    seeds = list(range(100, 100 + len(prompts)))
    began = time.monotonic()
    together = complete_many(client, prompts, seeds=seeds, max_concurrency=12, **params)
    concurrent_seconds = time.monotonic() - began
    alone = [client.complete(p, seed=s, **params) for p, s in zip(prompts[:3], seeds[:3], strict=True)]
    assert [d.prompt_token_ids for d in together] == prompts
    for one, many in zip(alone, together, strict=False):
        assert one.completion_token_ids == many.completion_token_ids
        assert max(abs(x - y) for x, y in zip(one.sampler_logprobs, many.sampler_logprobs, strict=True)) < 1e-4
    assert concurrent_seconds < 60
    with pytest.raises(ConfigError):
        complete_many(client, prompts, seeds=seeds[:2], **params)


# ---------------------------------------------------------------------------------------------------------------
# No server needed


def test_unreachable_url_is_one_line_after_the_deadline(faults):
    url = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(VllmError) as error:
        VllmClient(url, connect_deadline=1.0).complete([1, 2, 3], model="m", max_tokens=2)
    assert time.monotonic() - began < 5
    assert url in str(error.value) and "\n" not in str(error.value)
    faults.record("sampler servers", "an unreachable vLLM address")


def test_a_python_without_vllm_is_one_line(tmp_path, faults):
    if VLLM_PYTHON is None:
        with pytest.raises(ConfigError, match="make install-vllm"):
            check_vllm_python(None)
    with pytest.raises(ConfigError, match="has no vLLM") as error:
        check_vllm_python(sys.executable)  # sao's own venv: no vllm, by design
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="does not exist"):
        check_vllm_python(tmp_path / "python")
    with pytest.raises(ConfigError, match="compile_mode"):
        VllmServer(tmp_path, compile_mode="fast")
    faults.record("sampler servers", "a Python without vLLM")


def reply(**choice):
    base = {
        "prompt_token_ids": [1, 2, 3],
        "token_ids": [7, 8],
        "logprobs": {"token_logprobs": [-0.5, -1.25]},
        "finish_reason": "stop",
        "text": "ab",
    }
    return {"choices": [{**base, **choice}]}


@pytest.mark.parametrize(
    ("choice", "words"),
    [
        ({"prompt_token_ids": None}, "no prompt_token_ids"),
        ({"prompt_token_ids": [1, 2, 4]}, "first differs at position 2"),
        ({"prompt_token_ids": [1, 2]}, "lengths differ"),
        ({"token_ids": None}, "no completion token_ids"),
        ({"token_ids": []}, "0 completion tokens"),
        ({"logprobs": None}, "no logprobs.token_logprobs"),
        ({"logprobs": {"token_logprobs": [-0.5]}}, "1 log-probs for 2"),
        ({"logprobs": {"token_logprobs": [-0.5, None]}}, "log-prob 1 is None"),
        ({"logprobs": {"token_logprobs": [-0.5, 0.3]}}, "log-prob 1 is 0.3"),
        ({"finish_reason": "abort"}, "finish_reason is 'abort'"),
        ({"finish_reason": "length"}, "finished by length after 2 of max_tokens 4"),
    ],
)
def test_every_reply_is_checked(choice, words, faults):
    assert parse_completion(reply(), [1, 2, 3], max_tokens=4).sampler_logprobs == [-0.5, -1.25]
    with pytest.raises(DataError, match="vLLM completion reply") as error:
        parse_completion(reply(**choice), [1, 2, 3], max_tokens=4)
    assert words in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(DataError, match="expected exactly 1"):
        parse_completion({"choices": []}, [1, 2, 3], max_tokens=4)
    faults.record("sampler servers", f"a vLLM reply with {words}")
