"""A per-completion reward scores a batch's rows concurrently, bounded, as environment steps run: one that hangs on
every row costs its timeout once per batch (its rows scored 0 and counted as cut), and a call that is abandoned
never keeps the process alive past the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import sao
from sao.core.plugins import PluginError
from sao.tasks.base import Scorer

SRC = Path(sao.__file__).resolve().parents[1]  # the sao under test, for the processes a test starts
ROWS = [{"id": f"t/{i}"} for i in range(8)]


def test_a_batch_is_scored_at_once_not_row_after_row(faults):
    """Every row's call waits until all eight are running at once: only concurrent scoring can answer any of them
    (a barrier, not a clock, decides)."""
    together = threading.Barrier(len(ROWS), timeout=60)

    def reward(completion: str, row: dict) -> float:
        together.wait()
        return 1.0

    values, late = Scorer(reward, timeout=120).score_within(["c"] * len(ROWS), ROWS)
    assert values == [1.0] * len(ROWS) and late == [False] * len(ROWS)
    faults.record("rewards in parallel", "a reward that answers only when a whole batch calls it at once")


def test_a_reward_that_hangs_on_every_row_costs_its_timeout_once_per_batch(faults):
    release = threading.Event()
    started: list[str] = []

    def reward(completion: str, row: dict) -> float:
        started.append(row["id"])
        release.wait(120)
        return 1.0

    timeout = 1.5
    try:
        began = time.monotonic()
        values, late = Scorer(reward, timeout=timeout).score_within(["c"] * len(ROWS), ROWS)
        took = time.monotonic() - began
    finally:
        release.set()
    assert values == [0.0] * len(ROWS) and late == [True] * len(ROWS), "scored 0, counted as cut"
    assert sorted(started) == sorted(r["id"] for r in ROWS), "every row's call started"
    assert took < len(ROWS) * timeout, f"{took:.1f} s: the timeout was paid row after row"
    faults.record("rewards in parallel", "a reward that hangs on every row of a batch")


def test_a_reward_hung_on_every_row_holds_no_more_threads_than_its_bound(faults):
    """Python cannot stop a hung call: its thread is abandoned. Once the first calls time out the rows not yet started
    are given up too, so a batch leaves at most ``concurrency`` such threads behind, not one per row."""
    release = threading.Event()
    started: list[str] = []

    def reward(completion: str, row: dict) -> float:
        started.append(row["id"])
        release.wait(120)
        return 1.0

    try:
        values, late = Scorer(reward, timeout=1.0, concurrency=2).score_within(["c"] * len(ROWS), ROWS)
    finally:
        release.set()
    assert late == [True] * len(ROWS) and values == [0.0] * len(ROWS)
    assert len(started) == 2, f"{len(started)} calls started for a bound of 2"
    faults.record("rewards in parallel", "a reward hung on every row: no more threads left behind than its bound")


def test_the_bound_holds_and_the_first_error_in_row_order_is_raised():
    running, most = [0], [0]
    lock = threading.Lock()

    def reward(completion: str, row: dict) -> float:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        if row["id"] in ("t/5", "t/6"):
            raise ValueError(f"no grade for {row['id']}")
        return 0.5

    scorer = Scorer(reward, timeout=60, concurrency=3)
    with pytest.raises(PluginError, match="raised ValueError: no grade for t/5 on t/5"):
        scorer.score_within(["c"] * len(ROWS), ROWS)
    assert 1 <= most[0] <= 3
    assert Scorer(lambda c, r: 0.25, timeout=0, concurrency=1).score(["a", "b"], ROWS[:2]) == [0.25, 0.25]


ABANDONED = """
    import asyncio, sys, time
    from sao.tasks.base import Scorer

    def hangs(completion, row):
        time.sleep(3600)

    async def hangs_async(completion, row):
        time.sleep(3600)  # blocks its event loop: only its thread can be let go
        return 1.0

    async def server():  # an event loop runs on this thread, as in sao serve
        reward = hangs_async if sys.argv[1] == "async" else hangs
        print(Scorer(reward, timeout=0.5).score_within(["c", "c"], [{"id": "a"}, {"id": "b"}])[1], flush=True)

    asyncio.run(server())
"""


@pytest.mark.parametrize("kind", ["plain", "async"])
def test_an_abandoned_reward_call_never_keeps_the_process_alive(kind):
    """Abandoned calls run on daemon threads: the process exits when its work is done, whatever they still do."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(ABANDONED), kind],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process was kept alive by an abandoned reward call")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[True, True]"
