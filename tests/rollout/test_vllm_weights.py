"""Full weights into a real vLLM CPU server (the session's, on the tiny model): a version folder reloaded in place,
tagged and checksummed, the server's log-probs then equal to a teacher-forced pass of those weights in sao's venv;
a push the server refuses and one that never arrives are each one line; sao serve --upstream takes a published
full-weight version. The folder checks before any request need no server.

The session's server is given the tiny model's weights back when this module ends (checked the same way). No mock
of vLLM: the one fault injected (a reload that is never sent) is injected into sao's own client.
"""

from __future__ import annotations

import hashlib
import json
import struct
import urllib.request
from pathlib import Path

import pytest
import torch

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.model.artifacts import save_full_weights
from sao.rollout.registry import RemoteSettings
from sao.rollout.vllm import VllmClient, VllmError
from sao.rollout.vllm_weights import EMPTY_DIGEST, WeightFolder, load_weights

TEMPERATURE = 0.7
TOLERANCE = RemoteSettings().sampler_tolerance  # the delivery check's mean |log r| bound (--sampler-tolerance)
LONG_PROMPT = [1, *((5 * j) % 200 + 20 for j in range(140))]  # fills whole prefix-cache blocks


def _model(base: Path, *, noise: float = 0.0, seed: int = 0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(noise * torch.randn(parameter.shape, generator=generator))
    return model


def _teacher_forced(model, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """log_softmax(logits / T) at each reply token, one unpadded pass: [C]."""
    ids = torch.tensor([prompt + reply])  # [1, P+C]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [C, V]
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, torch.tensor(reply)[:, None])[:, 0]


def _gap(model, completion) -> torch.Tensor:
    """|teacher-forced − served| log-prob per reply token: [C]."""
    forced = _teacher_forced(model, completion.prompt_token_ids, completion.completion_token_ids)
    return (forced - torch.tensor(completion.sampler_logprobs)).abs()


@pytest.fixture(scope="module")
def versions(tiny_vllm, tiny_model_dir, tmp_path_factory):
    """The tiny model written as a full-weight folder (to put back at the end) and two changed versions of it."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("weights")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    models = {
        "base": _model(tiny_model_dir),
        "v1": _model(tiny_model_dir, noise=0.05, seed=1),
        "v2": _model(tiny_model_dir, noise=0.05, seed=2),
    }
    folders = {name: save_full_weights(model, root / name, tokenizer=tokenizer) for name, model in models.items()}
    client = tiny_vllm.client()
    yield {"client": client, "base_name": str(tiny_model_dir), "models": models, "folders": folders, "root": root}
    load_weights(tiny_vllm.client(), folders["base"], "default")  # the session's server goes on serving the base
    done = tiny_vllm.client().complete(
        LONG_PROMPT, model=str(tiny_model_dir), max_tokens=8, temperature=TEMPERATURE, seed=9, ignore_eos=True
    )
    assert _gap(models["base"], done).max() < 1e-3, "the tiny model's weights are back"


# ---------------------------------------------------------------------------------------------------------------
# Against the server


def test_pushed_full_weights_are_served_as_a_teacher_forced_pass_scores_them(versions):
    client, name, models = versions["client"], versions["base_name"], versions["models"]
    before = client.complete(LONG_PROMPT, model=name, max_tokens=16, temperature=TEMPERATURE, seed=3, ignore_eos=True)
    assert _gap(models["base"], before).mean() < TOLERANCE  # its prompt blocks are now in the prefix cache

    loaded = load_weights(client, versions["folders"]["v1"], 1)
    assert client.weight_version() == "1" and loaded.version == "1"
    # Embeddings, norms, the fused qkv biases and the output layer are compared; the CPU build's linear layers
    # are packed for oneDNN (their parameters empty: nothing to compare) and the log-probs below cover them.
    assert loaded.checked >= 8, loaded
    after = client.complete(LONG_PROMPT, model=name, max_tokens=16, temperature=TEMPERATURE, seed=3, ignore_eos=True)
    served = _gap(models["v1"], after)
    assert served.mean() < TOLERANCE and served.max() < 1e-3, served
    assert _gap(models["base"], after).mean() > 50 * TOLERANCE, "the old weights score it far off: the check bites"


def test_a_full_weight_push_the_server_refuses_is_one_line_and_it_serves_the_last_version_again(
    versions, monkeypatch, faults
):
    """The server cannot read the folder it is sent (a path of the trainer's node only): it refuses, and is given the
    weights it held before, so it goes on serving them (vLLM leaves a failed reload half done otherwise)."""
    client, folders, models = versions["client"], versions["folders"], versions["models"]
    load_weights(client, folders["v1"], 1)
    real = VllmClient.reload_weights
    sent: list[str] = []

    def elsewhere(self, folder):  # the first reload names a path only the trainer's node has
        sent.append(str(folder))
        return real(self, versions["root"] / "only-on-the-trainer" if len(sent) == 1 else folder)

    monkeypatch.setattr(VllmClient, "reload_weights", elsewhere)
    with pytest.raises(VllmError, match="refused to reload weights") as caught:
        load_weights(client, folders["v2"], 2, previous=WeightFolder(folders["v1"]))
    message = str(caught.value)
    assert "\n" not in message and "filesystem the server's node shares" in message and "serves" in message
    assert sent == [str(folders["v2"]), str(folders["v1"])]
    assert client.weight_version() == "1"
    after = client.complete(
        LONG_PROMPT, model=versions["base_name"], max_tokens=8, temperature=TEMPERATURE, seed=4, ignore_eos=True
    )
    assert _gap(models["v1"], after).max() < 1e-3, "the server still serves v1"
    faults.record("sampler servers", "a full-weight version the vLLM server refuses to load")


def test_a_full_weight_push_that_never_arrives_is_one_line(versions, monkeypatch, faults):
    client, folders = versions["client"], versions["folders"]
    monkeypatch.setattr(VllmClient, "reload_weights", lambda self, folder: None)  # the reload is never sent
    with pytest.raises(VllmError, match="the weights did not arrive") as caught:
        load_weights(client, folders["v2"], 2)
    assert "\n" not in str(caught.value) and "model.embed_tokens.weight" in str(caught.value)
    monkeypatch.undo()
    monkeypatch.setattr(VllmClient, "set_weight_version", lambda self, version: None)  # the tag is never sent
    with pytest.raises(VllmError, match="holds weight version '2' after loading '3'"):
        load_weights(client, folders["v1"], 3)
    faults.record("sampler servers", "a full-weight version that never reaches the vLLM server")


def test_the_fleet_loads_a_version_into_every_server_and_samples_with_it(versions, tmp_path):
    """What --rollout vllm calls with full weights: one folder into every server, requests to the base's name."""
    from sao import api as sao_api

    url = versions["client"].url
    config = {"preset": "tiny", "rollout": "vllm", "vllm_url": f"{url},{url}", "batch_size": 8, "train_prompts": 16}
    source = sao_api.trainer(config, tmp_path / "run", progress=False).source
    try:
        name = source.fleet.load_weights(versions["folders"]["v2"], 7)
        assert name == versions["base_name"] and source.fleet.weights[1] == 7
        replies = [
            source.fleet.complete(
                i, LONG_PROMPT[:40], model=name, max_tokens=8, temperature=TEMPERATURE, seed=i, ignore_eos=True
            )
            for i in range(2)
        ]
    finally:
        source.close()
    assert all(_gap(versions["models"]["v2"], r).max() < 1e-3 for r in replies)


def test_a_full_weight_run_on_vllm_serves_each_synced_version_exactly(versions, tmp_path):
    """--rollout vllm --finetune full: every refresh writes the policy's weights and reloads them into the server in
    place, and the next rows drawn at staleness 0 agree with the trainer's own pass (else the run would stop at
    --sampler-tolerance); the weights really moved between syncs."""
    import sao

    config = {
        "preset": "tiny",
        "rollout": "vllm",
        "vllm_url": versions["client"].url,
        "finetune": "full",
        "lag": 0,
        "lr": 1e-3,
        "steps": 3,
        "critic_warmup": 1,
        "batch_size": 8,
        "train_prompts": 32,
        "test_prompts": 8,
    }
    trainer = sao.train(config, tmp_path / "run", progress=False)
    policy = [r for r in trainer.records if r["phase"] == "policy"]
    assert [r["engine_adapter_version"] for r in policy] == [0, 1, 2]  # a sync before every draw (LAG 0)
    assert all(r["staleness"] == 0 for r in policy)
    fresh = [r["mismatch_fresh"] for r in policy]
    assert max(fresh) < 1e-4, fresh  # the server drew with exactly the weights the trainer had published
    published = tmp_path / "run" / "vllm-weights"
    assert trainer.records[-1]["policy_version"] == 3 and sorted(p.name for p in published.iterdir()) == ["v1", "v2"]
    from safetensors.torch import load_file

    moved = load_file(str(published / "v2" / "model.safetensors"))
    base = versions["models"]["base"].state_dict()
    assert any(not torch.equal(moved[n], base[n]) for n in moved if n in base)  # the synced weights had trained


def test_serve_upstream_takes_a_published_full_weight_version(versions, tiny_vllm, tmp_path):
    from sao.serve.server import Server
    from sao.training.checkpoint import publish

    run = tmp_path / "run"
    publish(run, 4, lambda folder: save_full_weights(versions["models"]["v1"], folder))
    config = Config.load("tiny", upstream=tiny_vllm.url, traces=str(tmp_path / "traces.jsonl"))
    server = Server(config, tmp_path / "traces.jsonl", port=0, watch=run, say=lambda line: None)
    server.start()
    try:
        body = {
            "messages": [{"role": "user", "content": "What is 3+4?\n\nEnd with #### N."}],
            "logprobs": True,
            "metadata": {"answer": "7"},
            "seed": 1,
            "temperature": TEMPERATURE,
        }
        request = urllib.request.Request(
            f"{server.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
    finally:
        server.stop()
    assert reply["sao"]["policy_version"] == 4 and tiny_vllm.client().weight_version() == "4"
    (line,) = [json.loads(x) for x in (tmp_path / "traces.jsonl").read_text().splitlines()]
    forced = _teacher_forced(versions["models"]["v1"], line["prompt_token_ids"], line["completion_token_ids"])
    assert (forced - torch.tensor(line["logprobs"])).abs().max() < 1e-3


# ---------------------------------------------------------------------------------------------------------------
# The folder, before any request


def _safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_the_expected_checksums_are_vllms_digests_fused_parts_included(tmp_path):
    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    embed = torch.randn(5, 3)
    _safetensors(
        tmp_path / "w" / "model.safetensors",
        {
            "model.layers.0.self_attn.q_proj.weight": q,
            "model.layers.0.self_attn.k_proj.weight": k,
            "model.layers.0.self_attn.v_proj.weight": v,
            "model.embed_tokens.weight": embed,
            "lm_head.weight": embed.clone(),
        },
    )
    folder = WeightFolder(tmp_path / "w")

    def digest(t: torch.Tensor) -> str:  # as vLLM's /weight_checker computes it
        return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()

    qkv = "model.layers.0.self_attn.qkv_proj.base_layer.weight"
    assert folder.digests(qkv) == {digest(torch.cat([q, k, v]))}
    padded = torch.cat([embed, torch.zeros(59, 3)])  # vLLM pads the vocabulary to a multiple of 64 with zeros
    assert folder.digests("model.embed_tokens.weight") == {digest(embed), digest(padded)}
    assert folder.digests("model.layers.0.mlp.gate_up_proj.weight") == set()  # not in the folder
    served = {
        f"dp0:pp0:pcp0:tp0:{qkv}": digest(torch.cat([q, k, v])),
        "dp0:pp0:pcp0:tp0:model.embed_tokens.weight": digest(padded + 1),
        "dp0:pp0:pcp0:tp0:model.layers.0.self_attn.o_proj.base_layer.weight": EMPTY_DIGEST,
    }
    check = folder.compare(served)
    assert (check.checked, check.unverifiable, check.differ) == (2, 1, ["model.embed_tokens.weight"])
    sharded = {"dp0:pp0:pcp0:tp0:model.embed_tokens.weight": "a", "dp0:pp0:pcp0:tp1:model.embed_tokens.weight": "b"}
    assert folder.compare(sharded).unverifiable == 1  # tensor-parallel shards are not the whole tensor


def test_a_folder_the_server_could_not_use_is_refused_before_any_request(tmp_path, faults):
    embed = {"model.embed_tokens.weight": torch.randn(5, 3)}
    cases = {
        "missing": (tmp_path / "nothing-here", "is not a folder"),
        "empty": (tmp_path / "empty", "holds no \\*.safetensors"),
        "tied": (_safetensors(tmp_path / "tied" / "model.safetensors", embed).parent, "no lm_head.weight"),
    }
    (tmp_path / "empty").mkdir()
    index = tmp_path / "index"
    _safetensors(index / "model-00001-of-00002.safetensors", {"lm_head.weight": torch.randn(5, 3)})
    (index / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "lm_head.weight": "model-00001-of-00002.safetensors",
                    "x": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    cases["shard missing"] = (index, "names 1 shard\\(s\\) not in the folder")
    torn = tmp_path / "torn" / "model.safetensors"
    torn.parent.mkdir()
    torn.write_bytes(struct.pack("<Q", 1000) + b'{"a": 1}')
    cases["torn"] = (torn.parent, "is not a safetensors file")
    for folder, message in cases.values():
        with pytest.raises(ConfigError, match=message) as caught:
            load_weights(VllmClient("http://127.0.0.1:9", connect_deadline=0.0), folder, 1)  # never contacted
        assert "\n" not in str(caught.value)
    # A version that does not fit the served weights: vLLM would die half-loaded, so it is never sent.
    served = {"model.embed_tokens.weight": torch.randn(5, 3), "lm_head.weight": torch.randn(5, 3)}
    _safetensors(tmp_path / "served" / "model.safetensors", served)
    for name, changed in {
        "shape": {**served, "lm_head.weight": torch.randn(6, 3)},
        "extra": {**served, "model.extra.weight": torch.randn(2)},
        "missing": {"lm_head.weight": torch.randn(5, 3)},
    }.items():
        _safetensors(tmp_path / name / "model.safetensors", changed)
        with pytest.raises(ConfigError, match="do not fit the served model") as caught:
            load_weights(
                VllmClient("http://127.0.0.1:9", connect_deadline=0.0),
                tmp_path / name,
                1,
                previous=WeightFolder(tmp_path / "served"),
            )
        assert "\n" not in str(caught.value)
    faults.record("sampler servers", "a full-weight folder vLLM could not use")


def test_a_server_on_another_node_is_told_apart_and_the_shared_folder_is_said_at_start(
    tiny_model_dir, tmp_path, caplog
):
    """Adapters and weights reach vLLM by path: a server that is not on this machine needs the run folder on a
    filesystem it shares, and the run says so before its first batch."""
    import logging

    from sao import api as sao_api

    local = ["http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"]
    assert all(VllmClient(url).local for url in local)
    assert not any(VllmClient(url).local for url in ("http://10.0.0.3:8000", "http://node3:8000"))
    config = {"preset": "tiny", "rollout": "vllm", "vllm_url": "http://127.0.0.1:9,http://node3:8000"}
    with caplog.at_level(logging.WARNING, logger="sao.rollout"):
        source = sao_api.trainer(config, tmp_path / "run", progress=False).source
    source.close()
    (said,) = [r.getMessage() for r in caplog.records if "filesystem" in r.getMessage()]
    assert "http://node3:8000" in said and "127.0.0.1" not in said and str((tmp_path / "run").resolve()) in said
