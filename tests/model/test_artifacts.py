"""The adapter folder and the merged export load with plain PEFT/transformers calls and compute what the trained
policy computes; broken or clashing folders are one-line errors; a failed write leaves no half folder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sao.cli import main
from sao.core.errors import ConfigError
from sao.core.io import OutputError
from sao.model.artifacts import load_value_head, merge, save_adapter
from sao.model.policy import ValueHead, add_lora, load_base, lora_state

CHAT = [{"role": "user", "content": "What is 3+4? End with #### N."}]
PAIRS = [  # (prompt, reply) in the tiny task's chat format
    ("<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n", "3+4 = 7 #### 7<|im_end|>"),
    ("<|im_start|>user\nCompute 7-9.<|im_end|>\n<|im_start|>assistant\n", "7-9 = -2 #### -2<|im_end|>"),
    ("<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n", "#### 42<|im_end|>"),
]
# Float32 tolerance for merged vs adapter log-probs, in nats: see the merge test's docstring.
MERGE_ATOL = 1e-4


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """(policy, tokenizer, value head) as a run leaves them: LoRA B perturbed so the adapter is not a no-op,
    a second "sampler" adapter present (it must not be exported), a non-zero value head."""
    base, tokenizer = load_base(tiny_model_dir, torch.device("cpu"))
    policy = add_lora(base)
    policy.add_adapter("sampler", policy.peft_config["default"])
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in lora_state(policy).items():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))  # [out, r]
        value_head = ValueHead(base.config.hidden_size)
        value_head.linear.weight.copy_(torch.randn(value_head.linear.weight.shape, generator=generator))  # [1, H]
        value_head.linear.bias.fill_(0.25)  # [1]
    return policy, tokenizer, value_head


@pytest.fixture
def adapter_dir(trained, tiny_model_dir, tmp_path):
    policy, tokenizer, value_head = trained
    return save_adapter(policy, tokenizer, value_head, tmp_path / "run" / "adapter", base_model=str(tiny_model_dir))


def reply_logprobs(model, tokenizer, prompt: str, reply: str) -> torch.Tensor:
    """log π(reply token | everything before it) for one unpadded row, from the model's plain forward. → [R]."""
    ids = torch.tensor([tokenizer.encode(prompt + reply)])  # [1, P+R]
    prompt_len = len(tokenizer.encode(prompt))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()  # [1, P+R, V]
    logprobs = torch.log_softmax(logits[0, prompt_len - 1 : -1], dim=-1)  # [R, V]
    return logprobs.gather(-1, ids[0, prompt_len:, None]).squeeze(-1)


def all_logprobs(model, tokenizer) -> torch.Tensor:
    return torch.cat([reply_logprobs(model, tokenizer, p, r) for p, r in PAIRS])


def test_adapter_folder_loads_with_plain_peft_and_transformers(trained, adapter_dir, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, tokenizer, value_head = trained
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir).eval()
    assert set(loaded.peft_config) == {"default"}
    assert not any("sampler" in key for key in load_file(adapter_dir / "adapter_model.safetensors"))
    assert not [p.name for p in adapter_dir.iterdir() if p.is_dir()], "PEFT puts other adapters in subfolders"
    expected, got = lora_state(policy), lora_state(loaded)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    torch.testing.assert_close(all_logprobs(loaded, tokenizer), all_logprobs(policy, tokenizer))

    plain_tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert plain_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == text
    ids = plain_tokenizer.encode(text)
    assert ids == tokenizer.encode(text)
    assert plain_tokenizer.decode(ids) == text

    head = load_value_head(adapter_dir)
    for name, tensor in value_head.state_dict().items():
        torch.testing.assert_close(head.state_dict()[name], tensor, rtol=0, atol=0)
    info = json.loads((adapter_dir / "value_head.json").read_text())
    hidden = policy.get_base_model().config.hidden_size
    assert info["hidden_size"] == hidden and info["parameters"] == hidden + 1 and info["dtype"] == "float32"
    assert info["base_model"] == str(tiny_model_dir)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == info["base_model"]


def test_merged_model_loads_plainly_and_matches_the_adapter_models_logprobs(trained, adapter_dir, tmp_path):
    """Tolerance 1e-4 nats, absolute, in float32. The adapter model computes x Wᵀ + s (x Aᵀ) Bᵀ and the merged
    one x (W + s B A)ᵀ: the same function with the float32 roundings (~6e-8 relative per operation) in a
    different order. Through the tiny model's two layers and a log-softmax over 259 logits the two differ by
    ~1e-5 (measured up to 9e-6); 1e-4 leaves a 10x margin and is still far below the adapter's own effect
    on these log-probs (asserted > 0.1), so a merge that dropped or doubled the adapter would fail."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy, tokenizer, _ = trained
    out = merge(adapter_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    merged_tokenizer = AutoTokenizer.from_pretrained(out)

    adapter_lp = all_logprobs(policy, tokenizer)  # [sum R]
    merged_lp = all_logprobs(merged, merged_tokenizer)
    with policy.disable_adapter():
        base_lp = all_logprobs(policy, tokenizer)
    assert (adapter_lp - base_lp).abs().max() > 0.1, "the perturbed adapter must change the log-probs"
    torch.testing.assert_close(merged_lp, adapter_lp, rtol=0, atol=MERGE_ATOL)

    assert not [name for name, _ in merged.named_modules() if "lora" in name.lower()]
    assert not [key for key in load_file(out / "model.safetensors") if "lora" in key.lower()]
    info = json.loads((out / "sao_export.json").read_text())
    assert info["adapter"] == "adapter" and info["dtype"] == "float32" and info["tokenizer_from"] == "adapter"
    assert info["lora_layers_merged"] == 14 and info["merge_relative_error"] < 1e-5  # 2 layers x 7 projections


def test_the_reported_bf16_merge_error_is_the_one_the_merged_weights_carry(adapter_dir, tiny_model_dir, tmp_path):
    """A bf16 base is merged in bf16; sao_export.json's merge_relative_error must equal the error measured
    from the files: ‖(W_merged − W_base) − s·B A‖ / ‖s·B A‖ over all LoRA layers."""
    from transformers import AutoModelForCausalLM

    bf16_base = tmp_path / "base-bf16"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(bf16_base)
    out = merge(adapter_dir, tmp_path / "merged", base_model_path=str(bf16_base))

    info = json.loads((out / "sao_export.json").read_text())
    base_weights, merged_weights = load_file(bf16_base / "model.safetensors"), load_file(out / "model.safetensors")
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    error_sq = change_sq = 0.0
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        weight_key = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        delta = scale * adapter[key.replace(".lora_A.", ".lora_B.")].float() @ a.float()  # [out, in]
        assert merged_weights[weight_key].dtype == torch.bfloat16
        carried = merged_weights[weight_key].float() - base_weights[weight_key].float()  # [out, in]
        error_sq += float((carried - delta).square().sum())
        change_sq += float(delta.square().sum())
    measured = (error_sq / change_sq) ** 0.5
    assert info["dtype"] == "bfloat16" and info["base_model"] == str(bf16_base)
    assert measured > 1e-3, "bf16 rounding should be visible at this adapter size"
    assert info["merge_relative_error"] == pytest.approx(measured, rel=1e-3)


@pytest.mark.parametrize(
    ("file", "damage"),
    [
        ("value_head.json", "delete"),
        ("value_head.json", "garble"),
        ("value_head.safetensors", "delete"),
        ("value_head.safetensors", "garble"),
    ],
)
def test_a_missing_or_malformed_value_head_file_is_a_one_line_error_naming_it(adapter_dir, file, damage):
    target = adapter_dir / file
    if damage == "delete":
        target.unlink()
    else:
        target.write_bytes(b"{not json" if file.endswith(".json") else target.read_bytes()[:20])
    with pytest.raises(ConfigError) as caught:
        load_value_head(adapter_dir)
    message = str(caught.value)
    assert file in message and len(message.splitlines()) == 1


def test_merging_into_a_non_empty_folder_is_a_config_error_and_leaves_it_untouched(adapter_dir, tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        merge(adapter_dir, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".merged.")]


def test_a_failed_save_keeps_the_previous_adapter_folder_whole(trained, adapter_dir, tiny_model_dir, monkeypatch):
    policy, tokenizer, value_head = trained
    before = sorted(p.name for p in adapter_dir.iterdir())

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizer, "save_pretrained", disk_full)
    with pytest.raises(OutputError, match="No space left"):
        save_adapter(policy, tokenizer, value_head, adapter_dir, base_model=str(tiny_model_dir))
    assert sorted(p.name for p in adapter_dir.iterdir()) == before
    assert [p.name for p in adapter_dir.parent.iterdir()] == ["adapter"]  # no staging folder left behind
    monkeypatch.undo()
    save_adapter(policy, tokenizer, value_head, adapter_dir, base_model=str(tiny_model_dir))  # replacing works
    assert sorted(p.name for p in adapter_dir.iterdir()) == before
    assert [p.name for p in adapter_dir.parent.iterdir()] == ["adapter"]


def test_export_command_merges_a_train_folder_and_prints_one_line(adapter_dir, tmp_path, capsys):
    run = adapter_dir.parent
    out = tmp_path / "served"
    assert main(["export", str(run), "--merge", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and str(out) in printed[0] and "merged model" in printed[0]
    assert {"model.safetensors", "config.json", "tokenizer.json", "sao_export.json"} <= {p.name for p in out.iterdir()}

    assert main(["export", str(adapter_dir), "--merge", str(out)]) == 2  # the adapter folder itself; OUT now full
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0]
    assert main(["export", str(tmp_path / "nothing"), "--merge", str(tmp_path / "x")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err


def test_full_weights_are_written_as_shards_that_load_back_with_the_tied_output_layer(tiny_model_dir, tmp_path):
    """save_full_weights: shards with an index (a tensor never split), the tied output layer written out (vLLM's CPU
    build repacks it only then), and from_pretrained gives back every weight bit for bit."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from sao.model.artifacts import save_full_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    folder = save_full_weights(model, tmp_path / "v1", max_shard_bytes=100_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    with safe_open(str(folder / index["weight_map"]["lm_head.weight"]), "pt") as handle:
        assert torch.equal(handle.get_tensor("lm_head.weight"), model.get_input_embeddings().weight)
    again = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for (name, saved), (_, loaded) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(saved, loaded), name
