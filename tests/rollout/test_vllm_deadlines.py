"""A vLLM server behind sao that misbehaves over real HTTP (a fake on 127.0.0.1): every call gives up within the
client's timeout whatever the server withholds (the whole reply, or all but a byte at a time), a reply is read to a
bound on its size and never whole when it is endless, and a server that lists no model is one line. From the command
line, ``--vllm-timeout`` bounds every request of ``sao train --rollout vllm``."""

from __future__ import annotations

import resource
import time

import pytest

from fake_vllm import FakeVllm
from sao.rollout.vllm import VllmClient, VllmError

# A call given a deadline of DEADLINE seconds ends well before the server lets go (60 s), even on a loaded machine.
DEADLINE = 1.0
BOUND = 20.0


@pytest.fixture
def fake(request):
    server = FakeVllm(request.param)
    yield server
    server.stop()


def _one_line(error: BaseException, *needles: str) -> str:
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    for needle in needles:
        assert needle in text, text
    return text


@pytest.mark.parametrize(
    ("fake", "call"),
    [("silent", "models"), ("silent", "complete"), ("silent", "load"), ("trickle", "models"), ("trickle", "complete")],
    indirect=["fake"],
)
def test_every_call_gives_up_within_its_timeout(fake, call, faults):
    """Accepting and never answering, or answering a byte every 0.2 s (each read alone within any socket timeout),
    costs the caller its timeout once: one line naming the server and the flag, and the call is not retried."""
    client = VllmClient(fake.url, timeout=DEADLINE, connect_deadline=DEADLINE, setting="--vllm-timeout")
    calls = {
        "models": client.models,
        "complete": lambda: client.complete([1, 2, 3], model="base-model", max_tokens=4),
        "load": lambda: client.load_adapter("a", "/nowhere"),
    }
    began = time.monotonic()
    with pytest.raises(VllmError) as caught:
        calls[call]()
    took = time.monotonic() - began
    _one_line(caught.value, fake.url, f"within {DEADLINE:g} s (--vllm-timeout)")
    assert took < BOUND, f"gave up after {took:.1f} s"
    assert len(fake.calls) == 1, "a call past its timeout is not sent again"
    faults.record(
        "vLLM behind sao", f"a server that {'never answers' if fake.mode == 'silent' else 'trickles'} ({call})"
    )


@pytest.mark.parametrize("fake", ["endless"], indirect=True)
@pytest.mark.parametrize("call", ["models", "complete"])
def test_an_endless_reply_is_read_to_a_bound_not_whole(fake, call, faults):
    client = VllmClient(fake.url, timeout=60.0, connect_deadline=DEADLINE)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(VllmError) as caught:
        client.models() if call == "models" else client.complete([1, 2, 3], model="base-model", max_tokens=4)
    _one_line(caught.value, fake.url, "longer than", "is it a vLLM server?")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"the process grew by {grown_mib:.0f} MiB reading the reply"
    faults.record("vLLM behind sao", f"an endless reply body ({call})")


@pytest.mark.parametrize("fake", ["no-models"], indirect=True)
def test_a_server_listing_no_model_is_one_line(fake, faults):
    with pytest.raises(VllmError) as caught:
        VllmClient(fake.url, timeout=10.0, connect_deadline=DEADLINE).models()
    _one_line(caught.value, fake.url, "lists no model")
    faults.record("vLLM behind sao", "a server listing no model (/v1/models empty)")


@pytest.mark.parametrize("fake", ["ok"], indirect=True)
def test_a_server_that_answers_is_unchanged(fake):
    """The deadline and the bound cost a well-behaved server nothing: the same calls succeed on one connection."""
    client = VllmClient(fake.url, timeout=DEADLINE, connect_deadline=DEADLINE)
    assert client.models() == ["base-model"]
    client.load_adapter("a", "/adapters/a")
    reply = client.complete([1, 2, 3], model="a", max_tokens=2)
    assert reply.completion_token_ids == [7, 7] and reply.sampler_logprobs == [-0.5, -0.5]
    assert client.models() == ["base-model", "a"]


@pytest.mark.parametrize("fake", ["silent"], indirect=True)
def test_sao_train_on_a_vllm_that_never_answers_stops_within_vllm_timeout(
    fake, tmp_path, capsys, faults, tiny_model_dir
):
    """The run's first request (the published adapter's load) is given up on after --vllm-timeout: one line, exit 2,
    --out left as it was found."""
    from helpers import refused_in_one_line

    out = tmp_path / "run"
    argv = [
        "train",
        "--preset",
        "tiny",
        "--rollout",
        "vllm",
        "--vllm-url",
        fake.url,
        "--vllm-timeout",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "1",
        "--critic-warmup",
        "1",
        "--quiet",
        "--out",
        str(out),
    ]
    began = time.monotonic()
    refused_in_one_line(capsys, argv, out, fake.url, "within 2 s (--vllm-timeout)")
    assert fake.calls and time.monotonic() - began < 300, "not the 300 s socket timeout"
    faults.record("vLLM behind sao", "sao train --rollout vllm on a server that never answers")
