"""Admission tied to policy versions, and earliest-deadline-first selection: how an asynchronous source (Ray
workers, a remote engine) keeps every trajectory within ``max_staleness`` K updates and drops none.

A draw issued now gets the deadline a + K, where batch a is the first known to train at the newest published
version; it may carry only as many trajectories as fit, with everything already submitted, in the batches up to its
deadline. Batches are then taken earliest deadline first, so nothing ages past K. Pure bookkeeping: a simulated fleet
tests it without Ray or a server. Deliberately left out: the prompt stream and the drawing (each source's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sao.core.names import WARMUP


class Admission:
    """The version-tied admission rule and earliest-deadline-first selection (see the module doc).

    ``formed`` counts the batches formed so far; ``anchor`` = (a, v): batch a is the first known to train at
    the published version v. A call issued now gets the deadline a + K, and may carry ``room(outstanding)``
    trajectories. Items handed to ``choose`` need ``deadline``, ``version`` and ``seq`` attributes."""

    def __init__(self, batch_size: int, max_staleness: int, critic_warmup: int | str):
        self.batch_size, self.max_staleness, self.critic_warmup = batch_size, max_staleness, critic_warmup
        self.formed = 0
        self.anchor = (0, 0)

    def begin(self, step: int, phase: str, version: int) -> None:
        """The trainer asks for batch ``step`` at ``version``. During the critic warmup every batch up to the
        first policy step's (step critic_warmup) trains at this version too; an automatic warmup's end is not known
        ahead, so then only this batch is."""
        self.formed = step
        known = isinstance(self.critic_warmup, int)
        first = max(step, self.critic_warmup) if phase == WARMUP and known else step
        self.anchor = max(self.anchor, (first, version))

    def published(self, version: int) -> None:
        """The trainer published ``version``: the next batch to be formed trains at it."""
        self.anchor = max(self.anchor, (self.formed, version))

    def formed_batch(self, step: int) -> None:
        self.formed = step + 1

    @property
    def deadline(self) -> int:
        """The last step whose batch may take a trajectory submitted now."""
        return self.anchor[0] + self.max_staleness

    def room(self, outstanding: int) -> int:
        """How many more trajectories may be submitted, ``outstanding`` being those submitted and not yet in a
        batch: all of them, and those already in batches, must fit in the batches up to the deadline."""
        return (self.deadline + 1 - self.formed) * self.batch_size - outstanding

    def choose(self, buffer: Sequence[Any], pending_deadlines: Sequence[int]) -> list[Any] | None:
        """The next batch from ``buffer``, earliest deadline first (ties: version, then sequence number); None
        while it is short or a call still out (``pending_deadlines``) is due before the batch's last row."""
        B = self.batch_size
        if len(buffer) < B:
            return None
        ranked = sorted(buffer, key=lambda t: (t.deadline, t.version, t.seq))
        if any(d < ranked[B - 1].deadline for d in pending_deadlines):
            return None
        return ranked[:B]
