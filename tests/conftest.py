"""Shared fixtures, and the markers that split the suite.

Every test that builds or trains the tiny model (it asks for ``tiny_model_dir``, ``tiny_config`` or a Ray
cluster) is marked ``slow`` here, so ``make test-fast`` (``pytest -m "not slow"``) is the edit loop with no
training at all. Every test that records a fault case for the fault table (docs/faults.md; it asks for ``faults``) is
marked ``faults``: ``make docs`` reruns those and rewrites the table; a full ``make test`` only checks it.
"""

from __future__ import annotations

import os
import sys
import textwrap
import uuid

import pytest

SLOW_FIXTURES = {"tiny_model_dir", "tiny_config", "ray_module", "recipe_run", "tiny_vllm"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups to name each test's worker
def pytest_collection_modifyitems(config, items):
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if "faults" in names:
            item.add_marker(pytest.mark.faults)
        # Under pytest-xdist (make test: -n 2 --dist loadgroup) a file's tests run on one worker, so that its
        # module-scoped fixtures are built once; every test on the vLLM server shares one worker and one server.
        group = "vllm" if "tiny_vllm" in names else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def tiny_model_dir():
    from sao.tiny import arithmetic as tiny

    return tiny.ensure_model(progress=False)


@pytest.fixture
def tiny_config(tiny_model_dir):
    """The tiny preset shrunk for unit tests: small batches, few steps."""
    from sao.core.config import Config

    return Config.load("tiny", batch_size=16, steps=6, critic_warmup=2, micro_batch=16)


@pytest.fixture
def faults():
    """Record a passed fault case for the fault table (docs/faults.md, see tests/faults.py)."""
    import faults as table

    return table


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Under pytest-xdist: the fault cases a worker proved, merged into the controller's table."""
    import faults as table

    table.merge(getattr(node, "workeroutput", {}).get("faults", {}))


def pytest_sessionfinish(session, exitstatus):
    """With every fault kind exercised: ``SAO_WRITE_DOCS=1`` (``make docs``) rewrites the fault table in docs/faults.md;
    otherwise a table that differs from what the tests just proved fails the run. A pytest-xdist worker hands its
    cases to the controller, which checks the whole table."""
    import faults as table

    worker = getattr(session.config, "workeroutput", None)
    if worker is not None:
        worker["faults"] = table.cases()
        return
    if exitstatus != 0:
        return

    if not table.complete():
        return
    if os.environ.get("SAO_WRITE_DOCS") == "1":
        table.write_table()
    elif not table.table_is_current():
        print("\ndocs/faults.md's fault table differs from the cases that passed: run `make docs` and commit it.")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def tiny_vllm(tiny_model_dir, tmp_path_factory):
    """One vLLM CPU server on the tiny model for the whole session (its start is the cost: a minute or two), or a
    skip when .venv-vllm is absent (``make install-vllm`` builds it; ``make test`` does). Its development routes are
    on (full-weight reloads); a test that reloads its weights puts the tiny model's back."""
    from sao.rollout.vllm import VllmServer, default_vllm_python

    python = default_vllm_python()
    if python is None:
        pytest.skip(".venv-vllm is absent: make install-vllm builds it")
    root = tmp_path_factory.mktemp("tiny-vllm")
    server = VllmServer(
        tiny_model_dir,
        python=python,
        max_model_len=256,
        max_lora_rank=16,
        max_loras=4,
        seed=0,
        log_path=root / "server.log",
        env={"VLLM_CACHE_ROOT": str(root / "cache")},
        dev_mode=True,
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module into tmp_path under a fresh name, puts tmp_path on sys.path, returns the name."""
    names = []

    def write(source: str) -> str:
        name = f"sao_user_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        monkeypatch.syspath_prepend(str(tmp_path))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)
