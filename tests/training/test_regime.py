"""The paper's regime in one process: full fine-tuning trains every weight and a value model of its own trains its
trunk; both are checkpointed and resumed to the numbers of a run that never stopped, and leave Hugging Face folders
that load and export. ``--shard fsdp`` without torchrun trains exactly what ``--shard none`` trains (with a notice),
writes sharded checkpoints and resumes from them; a disk that fills while one is written leaves the previous one to
resume from. A value model of another vocabulary is refused in one line. (Two processes: test_sharded.py.)"""

from __future__ import annotations

import errno
import shutil

import pytest
import torch

from helpers import run_log
from sao.training.trainer import Hook

SETTINGS = {"batch_size": 8, "steps": 2, "critic_warmup": 1, "train_prompts": 64, "lag": 1}


class StopAt(Hook):
    """Stops the run as step ``step`` ends, before its checkpoint: the next run resumes from the one before."""

    name = "stop-at"

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, record) -> None:
        if record["step"] == self.step:
            raise KeyboardInterrupt("stopped by the test")


def _strip(records):
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in records]  # the timers: volatile


def _train(config, out, **kwargs):
    from sao.training import build

    torch.set_num_threads(1)
    return build.trainer(config, out, progress=False, **kwargs).run()


def _interrupted_then_resumed(config, out, step: int = 2):
    with pytest.raises(KeyboardInterrupt):
        _train(config, out, hooks=[StopAt(step)])
    assert len(run_log(out)) == step and (out / "checkpoints" / f"step-{step:06d}").is_dir()
    _train(config, out, resume=True)
    return run_log(out)


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_full_weights_and_a_value_model_train_every_weight_and_resume_exactly(tiny_model_dir, tmp_path, capsys):
    from sao import cli
    from sao.core.config import Config

    config = Config.load("tiny", **SETTINGS, finetune="full", critic="model")
    _train(config, tmp_path / "whole")
    whole = run_log(tmp_path / "whole")
    assert _strip(_interrupted_then_resumed(config, tmp_path / "resumed")) == _strip(whole)
    assert all(r["world_size"] == 1 for r in whole) and whole[-1]["grad_norm"] > 0

    base = _tensors(tiny_model_dir)
    trained = _tensors(tmp_path / "whole" / "model")
    assert set(base) <= set(trained)  # (and lm_head.weight, the tied head written out for vLLM)
    assert all(not torch.equal(trained[k], base[k]) for k in base), "every weight trained"
    critic = _tensors(tmp_path / "whole" / "critic")  # the value model's trunk: the base's, less its head
    assert {f"model.{k}" for k in critic} == {k for k in base if k.startswith("model.")}
    assert all(not torch.equal(critic[k], base[f"model.{k}"]) for k in critic), "the critic loss trained the trunk"
    assert (tmp_path / "whole" / "critic" / "value_head.safetensors").is_file()

    exported = tmp_path / "exported"
    assert cli.main(["export", str(tmp_path / "whole"), "--merge", str(exported)]) == 0
    assert "every weight trained" in capsys.readouterr().out
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert all(torch.equal(p, trained[n]) for n, p in model.state_dict().items() if n in trained)


def test_fsdp_without_torchrun_is_the_unsharded_step_and_resumes_from_its_sharded_checkpoint(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    import torch.distributed.checkpoint as dcp

    from sao.core.config import Config
    from sao.core.io import OutputError

    _train(Config.load("tiny", **SETTINGS, critic="model"), tmp_path / "plain")
    config = Config.load("tiny", **SETTINGS, critic="model", shard="fsdp")
    _train(config, tmp_path / "fsdp")
    plain, sharded = run_log(tmp_path / "plain"), run_log(tmp_path / "fsdp")
    assert "notice: --shard fsdp without torchrun" in capsys.readouterr().err
    assert _strip(sharded) == _strip(plain), "one process: the same step, bit for bit"
    step = tmp_path / "fsdp" / "checkpoints" / "step-000003"
    files = sorted(p.name for p in step.rglob("*") if p.is_file())
    assert files == ["shard-00001-model-00001-of-00001.safetensors", "state.json", "tensors.safetensors"], files
    critic = {p.name for p in (tmp_path / "fsdp" / "critic").iterdir()}  # the value model's LoRA and head
    assert {"adapter_config.json", "adapter_model.safetensors", "value_head.safetensors"} <= critic

    # The disk fills while the checkpoint after step 2 is written: one line, the one after step 1 intact.
    out, real_save = tmp_path / "full-disk", dcp.save

    def save(state, storage_writer, **kwargs):
        if "step-000003" in str(storage_writer.path):
            real_save(dict(list(state.items())[:2]), storage_writer=storage_writer, **kwargs)  # a part reached the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(dcp, "save", save)
    with pytest.raises(OutputError) as caught:
        _train(config, out)
    message = str(caught.value)
    assert "No space left on device" in message and "previous checkpoint is intact" in message and caught.value.space
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"], "no partial folder left"
    monkeypatch.setattr(dcp, "save", real_save)
    _train(config, out, resume=True)
    assert _strip(run_log(out)) == _strip(sharded)


def test_a_value_model_of_another_vocabulary_is_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from sao import cli

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<another-token>"])
    tokenizer.save_pretrained(other)
    out = tmp_path / "run"
    code = cli.main(
        ["train", "--preset", "tiny", "--critic", "model", "--critic-model", str(other), "--out", str(out), "--quiet"]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "its tokenizer is not the policy's (260 tokens against 259" in err
    assert not out.exists()


def test_resuming_with_another_finetune_names_the_setting_and_another_process_count_is_allowed(tmp_path):
    from sao.core import run_folder
    from sao.core.config import Config
    from sao.core.errors import ConfigError
    from sao.training import checkpoint

    out = tmp_path / "run"
    started = {"config": Config.load("tiny", shard="fsdp").to_dict(), "world_size": 2}
    run_folder.claim(out, started, resume=False)
    out.mkdir()
    checkpoint.write_config(out, started)
    assert run_folder.claim(out, {**started, "world_size": 1}, resume=True).out == out  # on one process
    other = {"config": Config.load("tiny", shard="fsdp", finetune="full").to_dict(), "world_size": 2}
    with pytest.raises(ConfigError) as caught:
        run_folder.claim(out, other, resume=True)
    assert 'started with other settings (--finetune "lora" then, "full" now)' in str(caught.value)
