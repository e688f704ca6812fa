"""Provenance: the weights hash is the tensors' (not the file's), the tokenizer and data hashes see content only,
differing pieces are named in words, and two builds of the tiny model — in fresh processes with 1 and with 2
torch threads — are the same model, the one shipped with sao."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file

from sao.core import hashing
from sao.experiment import provenance as prov
from sao.tiny import arithmetic as tiny

BUILD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from sao.core import hashing as provenance
from sao.tiny import arithmetic as tiny
folder = tiny.ensure_model(progress=False)
weights, tokenizer = provenance.weights_sha256(folder)[0], provenance.tokenizer_sha256(folder)
data = (folder / "model.safetensors").read_bytes().hex()
print(json.dumps({"threads": torch.get_num_threads(), "weights": weights, "tokenizer": tokenizer, "file": data}))
"""


@pytest.mark.slow
def test_two_builds_of_the_tiny_model_with_1_and_2_threads_are_the_shipped_model(tmp_path):
    builds = []
    for threads in (1, 2):
        env = {**os.environ, "SAO_CACHE": str(tmp_path / f"cache-{threads}"), "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(
            [sys.executable, "-c", BUILD, str(threads)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        builds.append(json.loads(done.stdout.strip().splitlines()[-1]))
    one, two = builds
    assert (one["threads"], two["threads"]) == (1, 2)
    assert one["weights"] == two["weights"] == tiny.SHIPPED_SHA256
    assert one["tokenizer"] == two["tokenizer"] is not None
    assert one["file"] == two["file"], "the saved model file is the same bytes, not only the same tensors"


def test_the_shipped_weights_are_small_and_hash_to_the_recorded_value(tmp_path):
    assert tiny.SHIPPED_WEIGHTS.stat().st_size < 1_000_000
    (tmp_path / "model.safetensors").write_bytes(tiny.SHIPPED_WEIGHTS.read_bytes())
    assert hashing.weights_sha256(tmp_path)[0] == tiny.SHIPPED_SHA256


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(4, 3, generator=g),
        "b.bias": torch.randn(5, generator=g),
        "c.weight": torch.randn(2, 2, generator=g),
    }


def test_weights_hash_is_the_tensors_whatever_the_sharding_and_metadata(tmp_path):
    tensors = _tensors()
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    save_file(tensors, one / "model.safetensors", metadata={"format": "pt"})
    save_file({"c.weight": tensors["c.weight"]}, two / "model-00001-of-00002.safetensors")
    rest = {k: v for k, v in tensors.items() if k != "c.weight"}
    save_file(rest, two / "model-00002-of-00002.safetensors", metadata={"written_by": "someone else"})
    h1, how = hashing.weights_sha256(one)
    assert h1 == hashing.weights_sha256(two)[0] and "3 in 1 file" in how
    changed = dict(tensors, **{"b.bias": tensors["b.bias"].clone()})
    changed["b.bias"][2] += 1e-6
    save_file(changed, one / "model.safetensors")
    assert hashing.weights_sha256(one)[0] != h1, "one changed value changes the hash"
    save_file({k: v.double() for k, v in tensors.items()}, one / "model.safetensors")
    assert hashing.weights_sha256(one)[0] != h1, "so does the dtype"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert hashing.weights_sha256(empty)[0] is None


def test_tokenizer_hash_ignores_json_layout_but_not_content(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"b": 1, "a": [1, 2]}))
    first = hashing.tokenizer_sha256(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"a": [1, 2], "b": 1}, indent=4))
    assert hashing.tokenizer_sha256(tmp_path) == first
    (tmp_path / "tokenizer.json").write_text(json.dumps({"a": [1, 2], "b": 2}))
    assert hashing.tokenizer_sha256(tmp_path) != first
    assert hashing.tokenizer_sha256(tmp_path / "missing") is None


@dataclass
class _Task:
    id: str
    question: str
    answer: str


def test_data_hash_sees_every_field_and_the_order():
    tasks = [_Task("t/0", "What is 1+1?", "2"), _Task("t/1", "What is 2+2?", "4")]
    h = prov.tasks_sha256(tasks)
    assert h == prov.tasks_sha256([_Task("t/0", "What is 1+1?", "2"), _Task("t/1", "What is 2+2?", "4")])
    assert h != prov.tasks_sha256(tasks[::-1])
    assert h != prov.tasks_sha256([tasks[0], _Task("t/1", "What is 2+2?", "5")])


def _block(weights="w1", threads=1, test="d1") -> dict:
    return {
        "model": {"weights_sha256": weights, "tokenizer_sha256": "t"},
        "data": {"train_sha256": "d0", "test_sha256": test},
        "machine": {"cpu": "x", "cpu_capability": "AVX2", "torch_threads": threads},
        "code": {"versions": {"torch": "2"}, "commit": "c"},
    }


def test_differences_name_the_pieces_whose_hashes_differ_and_note_the_machine():
    assert prov.differences({"a": _block(), "b": _block()}) == []
    found = prov.differences({"a": _block(), "b": _block(weights="w2"), "c": _block(weights="w2")})
    assert len(found) == 1 and "model weights differ" in found[0] and "w2: b, c" in found[0] and "w1: a" in found[0]
    data = prov.differences({"a": _block(), "b": _block(test="d2")})
    assert len(data) == 1 and "held-out tasks differ" in data[0]
    machine = prov.differences({"a": _block(), "b": _block(threads=2)})
    assert len(machine) == 1 and "torch threads" in machine[0] and "bit for bit" in machine[0]
    assert prov.differences({"a": _block(), "old": {}}) == [], "a piece without a hash is not a difference"
    assert prov.missing({"a": _block(), "old": {}}) == ["old"]


def test_machine_records_the_cpus_instruction_set_and_torchs_kernel_choice(tmp_path):
    block = prov.machine()
    assert block["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    if os.path.exists("/proc/cpuinfo"):
        assert isinstance(block["cpu_flags"], list) and set(block["cpu_flags"]) <= prov.CPU_FLAGS
        if block["cpu_capability"] in ("AVX2", "AVX512"):
            assert "avx2" in block["cpu_flags"], "torch's AVX2 kernels need the flag the CPU lists"
    one = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse4_2 avx2 fma avx512f amx_bf16 ht\n"
    fake = tmp_path / "cpuinfo"
    fake.write_text(one + one.replace("avx512f ", "").replace("Some", "Other"))
    assert prov.cpuinfo(fake) == ("Some CPU", ["amx_bf16", "avx2", "avx512f", "fma", "sse4_2"]), "the first processor"
    assert prov.cpuinfo(tmp_path / "absent") == (None, None)
    blocks = {"a": {"machine": {"cpu_flags": ["avx2"]}}, "b": {"machine": {"cpu_flags": ["avx512f"]}}}
    warnings = prov.differences(blocks)
    assert "CPU instruction-set extensions" in " ".join(warnings)


def test_collect_records_hashes_machine_and_code(tiny_model_dir):
    split = tiny.make_split(8, 4)
    block = prov.collect(str(tiny_model_dir), split.train, split.test, split.source)
    assert block["model"]["weights_sha256"] == tiny.SHIPPED_SHA256 and block["model"]["tokenizer_sha256"]
    assert block["data"]["train"] == 8 and len(block["data"]["test_sha256"]) == 64
    assert block["machine"]["torch_threads"] == torch.get_num_threads() and block["machine"]["cpu"]
    assert block["code"]["versions"]["torch"] == torch.__version__
    commit = block["code"]["commit"]
    assert commit == "unknown" or (len(commit) == 40 and int(commit, 16) >= 0)
    missing = prov.model_block("no-such-org/no-such-model-anywhere")
    assert missing["weights_sha256"] is None and missing["weights_hashed"] == "not available locally"
