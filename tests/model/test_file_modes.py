"""What a run leaves for people to use follows the user's umask like every other file sao writes (safetensors writes its
own files 0o600), a disk that fills while an adapter's safetensors are written is one line with the previous adapter
intact and no staging folder left, and a truncated adapter is one line naming the file before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sao
from helpers import save_small_model
from sao.core.errors import ConfigError
from sao.core.io import file_mode, folder_mode
from sao.model.artifacts import merge, save_adapter
from sao.model.policy import ValueHead, add_lora, load_base, lora_state

SRC = Path(sao.__file__).resolve().parents[1]  # the sao under test, for the processes a test starts


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(base folder, policy with a non-trivial adapter, tokenizer, value head) on a random one-layer model."""
    base_dir = save_small_model(tmp_path_factory.mktemp("base"))
    base, tokenizer = load_base(base_dir, torch.device("cpu"))
    policy = add_lora(base, rank=4, alpha=8)
    with torch.no_grad():
        for name, param in lora_state(policy).items():
            if "lora_B" in name:
                param.fill_(0.01)
    return base_dir, policy, tokenizer, ValueHead(base.config.hidden_size)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in root.rglob("*")}


def _wrong_modes(root: Path) -> dict[str, str]:
    want = {True: folder_mode(), False: file_mode()}
    return {name: oct(mode) for name, mode in _modes(root).items() if mode != want[(root / name).is_dir()]}


def test_an_adapter_and_a_merged_export_follow_the_umask(small, tmp_path, faults):
    base_dir, policy, tokenizer, head = small
    adapter = save_adapter(policy, tokenizer, head, tmp_path / "run" / "adapter", base_model=str(base_dir))
    merged = merge(adapter, tmp_path / "merged")
    assert {"adapter_model.safetensors", "value_head.safetensors"} <= set(os.listdir(adapter))
    assert any(name.endswith(".safetensors") for name in os.listdir(merged))
    assert _wrong_modes(tmp_path) == {}, f"umask {0o777 & ~folder_mode():03o}"
    faults.record("run folders", "an adapter (PEFT's and the value head's safetensors) under the umask")
    faults.record("run folders", "a merged export (transformers' safetensors) under the umask")


FULL_DISK = """
    import resource, signal, sys, torch
    from pathlib import Path
    from helpers import save_small_model
    from sao.model.artifacts import save_adapter
    from sao.model.policy import ValueHead, add_lora, load_base
    root = Path(sys.argv[1])
    base, tokenizer = load_base(save_small_model(root / "base"), torch.device("cpu"))
    policy, head = add_lora(base, rank=4, alpha=8), ValueHead(base.config.hidden_size)
    save_adapter(policy, tokenizer, head, root / "adapter", base_model="base")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000, resource.RLIM_INFINITY))
    try:
        save_adapter(policy, tokenizer, head, root / "adapter", base_model="base")
    except Exception as error:
        print(type(error).__name__, error, sep="|")
"""


def test_a_full_disk_while_an_adapter_is_written_is_one_line_and_keeps_the_previous_one(tmp_path, faults):
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    kind, message = done.stdout.strip().split("|", 1)
    assert kind == "OutputError" and "\n" not in message, done.stdout
    assert str(tmp_path / "adapter") in message and "free space" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"], "a staging folder was left"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size > 1_000, "the previous adapter stands"
    faults.record("run folders", "a full disk while an adapter's safetensors are written")


@pytest.mark.parametrize("cut", [0, 5, 100, -10])
def test_a_truncated_adapter_is_refused_before_any_model_loads(small, tmp_path, cut, faults):
    _, policy, tokenizer, head = small
    adapter = save_adapter(policy, tokenizer, head, tmp_path / "adapter", base_model=str(tmp_path / "no-such-base"))
    weights = adapter / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:cut])  # a negative cut: all but that many bytes
    with pytest.raises(ConfigError) as caught:
        merge(adapter, tmp_path / "merged")  # the base does not exist: only the adapter's check can answer first
    message = str(caught.value)
    assert "\n" not in message and str(weights) in message and "truncated" in message, message
    assert not (tmp_path / "merged").exists()
    faults.record(
        "run folders",
        f"a truncated adapter_model.safetensors ({cut if cut >= 0 else 'all but 10'} bytes kept) under merge",
    )
