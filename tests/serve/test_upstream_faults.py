"""``sao serve --upstream`` in front of a vLLM server that misbehaves (a fake over real HTTP on 127.0.0.1): one that
lists no model is one line at start; one that restarts, forgetting the adapter loaded into it, gets it loaded again
by the first request that finds it gone, and that request is answered; one that never answers costs a request its
``--upstream-timeout``."""

from __future__ import annotations

import time

import pytest

from fake_vllm import FakeVllm
from helpers import refused_in_one_line, save_small_model
from sao.core.config import Config
from sao.rollout.vllm import VllmError


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    return save_small_model(tmp_path_factory.mktemp("small-model"))


@pytest.fixture
def fake(request):
    server = FakeVllm(getattr(request, "param", "ok"))
    yield server
    server.stop()


def _policy(model_dir, url: str, timeout: float = 10.0):
    from sao.serve.upstream import UpstreamPolicy

    config = Config(model=str(model_dir), data="tiny", max_new_tokens=4, upstream=url, upstream_timeout=timeout)
    return UpstreamPolicy(config, url)


def test_after_vllm_restarts_the_served_adapter_is_loaded_again(small_model_dir, fake, tmp_path, faults):
    policy = _policy(small_model_dir, fake.url)
    folder = tmp_path / "published" / "v3"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")  # an adapter (a folder without one holds full weights)
    policy.take(folder, 3)
    assert fake.adapters == {f"{policy.tag}-v3": str(folder)}
    fake.restart()  # the server comes back with no adapter of ours
    reply = policy.generate([1, 2, 3], max_tokens=2, temperature=1.0, seed=0)
    assert reply.policy_version == 3 and reply.adapter == str(folder), "served by the same version, not the base"
    assert fake.adapters == {f"{policy.tag}-v3": str(folder)}, "loaded again from its folder"
    loads = [path for _, path in fake.calls if path == "/v1/load_lora_adapter"]
    assert len(loads) == 2
    policy.generate([1, 2, 3], max_tokens=2, temperature=1.0, seed=1)
    assert len([p for _, p in fake.calls if p == "/v1/load_lora_adapter"]) == 2, "loaded again once, not per request"
    faults.record("vLLM behind sao", "sao serve --upstream after vLLM restarts (the served adapter loaded again)")


def test_a_request_for_the_base_model_is_not_retried_as_an_adapter(small_model_dir, fake):
    """Only an adapter vLLM forgot is loaded again: a refusal of anything else is the request's one-line error."""
    policy = _policy(small_model_dir, fake.url)
    fake.base = "another-base"  # the server now answers to another name for its base model
    with pytest.raises(VllmError, match="does not exist"):
        policy.generate([1, 2, 3], max_tokens=2, temperature=1.0, seed=0)
    assert not [p for _, p in fake.calls if p == "/v1/load_lora_adapter"]


@pytest.mark.parametrize("fake", ["no-models"], indirect=True)
def test_sao_serve_on_a_server_listing_no_model_is_one_line(small_model_dir, fake, tmp_path, capsys, faults):
    pytest.importorskip("fastapi")
    log = tmp_path / "traces.jsonl"
    argv = [
        "serve",
        "--model",
        str(small_model_dir),
        "--data",
        "tiny",
        "--traces",
        str(log),
        "--port",
        "0",
        "--upstream",
        fake.url,
        "--upstream-timeout",
        "5",
    ]
    refused_in_one_line(capsys, argv, tmp_path, fake.url, "lists no model")
    faults.record("vLLM behind sao", "sao serve --upstream on a server listing no model")


@pytest.mark.parametrize("fake", ["silent"], indirect=True)
def test_a_request_to_a_server_that_never_answers_ends_at_upstream_timeout(small_model_dir, fake):
    fake.mode = "ok"
    policy = _policy(small_model_dir, fake.url, timeout=1.0)  # starts: the model list is answered
    fake.mode = "silent"
    began = time.monotonic()
    with pytest.raises(VllmError, match=r"within 1 s \(--upstream-timeout\)"):
        policy.generate([1, 2, 3], max_tokens=2, temperature=1.0, seed=0)
    assert time.monotonic() - began < 20
