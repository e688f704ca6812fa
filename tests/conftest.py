"""Shared fixtures: the warm-started tiny model is built once per machine (cached) and shared."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    from sao.tasks import tiny

    return tiny.ensure_model(progress=False)


@pytest.fixture
def tiny_config(tiny_model_dir):
    """The tiny preset shrunk for unit tests: small batches, few steps."""
    from sao.core.config import Config

    return Config.preset("tiny", batch_size=16, steps=6, critic_warmup=2, micro_batch=16)


@pytest.fixture
def faults():
    """Record a passed fault case for the README's table (see tests/faults.py)."""
    import faults as table

    return table


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:
        import faults as table

        table.write_readme_table()
