"""``--rollout ray``: asynchronous rollout workers on Ray, with bounded staleness and nothing wasted.

N rollout workers (``sao.rollout.ray_fleet``: each an actor with its own base model + LoRA adapter, decoding through
the local path's ``Decoder`` in one Ray placement group, never on the trainer's GPU when sao starts the cluster) draw
the seeded prompt stream. Admission is tied to policy versions (``sao.rollout.admission``, as in AReaL and SkyRL): a
call is issued only while everything submitted fits in the batches up to its deadline, so nothing trains more than
K = ``max_staleness`` updates old; batches are taken earliest deadline first, so nothing is dropped. The adapter is
published with ``ray.put`` after every policy step (and posted on the fleet's board, where a worker looks between the
turns of its episodes: an episode in flight goes on under the newest version, each token recording its own); a hung
or dead worker is replaced and its prompts drawn again. The source's counters go into every step's log record.

A Ray run is not bit-reproducible (the local engine is the one for experiments). Deliberately left out: sharding one
model over devices, interrupting a single reply for a new adapter, shared environments, and pinning the trainer's
GPU on a cluster sao did not start. Design notes: docs/design/ray-workers.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sao.core import timeline
from sao.core.errors import ConfigError
from sao.model.policy import lora_state
from sao.rollout.admission import Admission
from sao.rollout.ray_fleet import RayFleet, Slot, import_ray
from sao.rollout.sampler import derived_seed
from sao.rollout.sources import Episodes, PromptOrder, SourceContext
from sao.rollout.types import Batch, Rollout

if TYPE_CHECKING:
    from sao.core.config import Config

MAX_CONSECUTIVE_DEATHS = 3  # a worker slot that fails this often in a row without delivering stops the run
SLOW_START_WARNING_S = 120.0  # say so when no worker has delivered after this long (cluster too small?)
CPU_ROLLOUT_BATCH = 8  # prompts per call on CPU workers: small, so that trajectories arrive continuously


def rollout_batch_size(config: Config) -> int:
    """Prompts per worker call: --rollout-batch, or 0 → the training batch on GPU workers, 8 on CPU ones."""
    if config.source.rollout_batch > 0:
        return config.source.rollout_batch
    return config.training.batch_size if config.source.worker_gpus > 0 else CPU_ROLLOUT_BATCH


@dataclass
class _Trajectory:
    seq: int  # the prompt draw's sequence number
    task_id: str
    version: int  # the adapter version that wrote it
    deadline: int  # the last step whose batch may take it (its call's deadline)
    worker: str  # the actor that drew it ("w0", or "w0.r1" for slot 0's first replacement)
    rollout: Rollout  # one row
    drawn: tuple[float, float, float, int] | None = None  # its call's (start, end, env seconds) and its row in it


def _trajectory_span(t: _Trajectory, version: int, step: int, dropped: bool = False) -> None:
    """Trajectory ``t``'s draw on the timeline, on its worker's track, once its staleness is known."""
    if t.drawn is None or timeline.recording() is None:
        return
    start, end, env_s, row = t.drawn
    timeline.complete(
        "trajectory",
        "trajectory",
        f"ray worker {t.worker}",
        f"row {row}",
        start,
        end,
        task=t.task_id,
        seq=t.seq,
        version=t.version,
        staleness=version - t.version,
        step=step,
        env_s=env_s,
        dropped=dropped,
    )


class RaySource:
    """Batches from asynchronous Ray rollout workers, admitted under ``config.source.max_staleness``.

    A ``sao.rollout.sources.Source``, like ``LocalStaleSource``. Not bit-reproducible (arrival order depends on
    timing); ``state_dict`` keeps the prompt-stream position, the draws still pending and the counters.
    ``batches`` and ``dropped`` record the sequence numbers of every batch and every dropped trajectory.
    ``reserved_gpus``: the GPUs (indices in this process's visible order) the training processes use, kept
    from a local cluster's workers; None: the policy's own device.
    """

    def __init__(
        self,
        config: Config,
        *,
        model_path: str,
        policy: torch.nn.Module,
        pad_token_id: int,
        prompts: dict[str, str],
        order: PromptOrder,
        label: str = "ray",
        progress: bool = True,
        reserved_gpus: Sequence[int] | None = None,
        episodes: Episodes | None = None,
    ):
        c = self.config = config
        self.ray = import_ray()
        self.policy, self.pad_token_id, self.prompts, self.order = policy, pad_token_id, prompts, order
        self.device = next(policy.parameters()).device
        self.label, self.progress, self.episodes = label, progress, episodes
        self.rollout_batch = rollout_batch_size(c)
        if reserved_gpus is None:
            index = self.device.index if self.device.index is not None else 0
            reserved_gpus = [index] if self.device.type == "cuda" else []
        worker = {
            "device": "cuda" if c.source.worker_gpus > 0 else "cpu",
            "dtype": str(next(policy.parameters()).dtype).removeprefix("torch."),  # the trainer's: the same function
            "threads": max(1, math.floor(c.source.worker_cpus)),
            "lora_rank": c.model.lora_rank,
            "lora_alpha": c.model.lora_alpha,
            "seed": c.training.seed,
            "max_new_tokens": c.rollout.max_new_tokens,
            "temperature": c.rollout.temperature,
            "decoder": c.rollout.decoder,
        }
        turn_loop = episodes is not None and episodes.env_rejoin == "turn"  # episodes look at the board between turns
        self.fleet = RayFleet(
            c.source,
            model_path=model_path,
            worker=worker,
            episodes=episodes,
            reserved_gpus=reserved_gpus,
            board=turn_loop,
        )
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._adapter: list[Any] | None = None  # [version, ObjectRef of the LoRA state dict]
        self._buffer: list[_Trajectory] = []
        self._retry: deque[int] = deque()  # sequence numbers to draw again before new ones
        # read and set under the lock
        self.admission = Admission(c.training.batch_size, c.source.max_staleness, c.algorithm.critic_warmup)
        self.next_seq = 0
        self.calls = 0
        self.batches: list[list[int]] = []
        self.dropped: list[int] = []
        self.admitted_by: dict[str, int] = {}  # actor name ("w0", "w0.r1", ...) → its admitted trajectories
        self.counts = {
            "received": 0,
            "admitted": 0,
            "dropped_stale": 0,
            "worker_restarts": 0,
            "worker_hangs": 0,
            "admitted_from_replacements": 0,
        }
        self._logged = {"worker_restarts": 0, "worker_hangs": 0}  # as of the last batch, for per-step counts
        self._closed = False
        self._started_at = time.perf_counter()
        self.max_staleness = c.source.max_staleness
        self.tasks: dict[str, Any] = {}
        atexit.register(self.close)

    @classmethod
    def build(cls, context: SourceContext) -> RaySource:
        """``--rollout ray``: workers drawing the context's prompts (or episodes) with the policy's adapters."""
        context.check_batch()
        m = context.models
        source = cls(
            context.config,
            model_path=m.name,
            policy=m.policy,
            pad_token_id=m.tokenizer.pad_token_id,
            prompts=context.prompts,
            order=context.order,
            label=context.label,
            progress=context.progress,
            reserved_gpus=context.reserved_gpus,
            episodes=context.episodes,
        )
        source.tasks = context.tasks
        return source

    @property
    def slots(self) -> list[Slot]:
        return self.fleet.slots

    @property
    def workers(self) -> list[Any]:
        return self.fleet.workers

    @property
    def start_times(self) -> list[float]:
        return self.fleet.start_times

    @property
    def placement_id(self) -> str | None:
        return self.fleet.placement_id

    # -- the prompt stream -----------------------------------------------------------------------------

    def task_id(self, seq: int) -> str:
        """Prompt draw ``seq``: the same seeded order the local source reads."""
        return self.order.id_at(seq)

    def _next_job(self, size: int, deadline: int) -> dict[str, Any]:
        seqs = []
        while len(seqs) < size:
            if self._retry:
                seqs.append(self._retry.popleft())
            else:
                seqs.append(self.next_seq)
                self.next_seq += 1
        ids = [self.task_id(s) for s in seqs]
        self.calls += 1
        seed = derived_seed(self.config.training.seed, "ray-rollout", self.calls, tuple(seqs))
        prompts = [self.prompts[i] for i in ids]
        return {"seqs": seqs, "task_ids": ids, "prompts": prompts, "seed": seed, "deadline": deadline, "timeline": None}

    # -- admission (under the lock) --------------------------------------------------------------------

    def _outstanding(self) -> int:
        """Trajectories submitted and not yet in a batch: buffered or in a call in flight."""
        return len(self._buffer) + sum(len(s.job["seqs"]) for s in self.slots if s.job is not None)

    def _issue(self) -> None:
        """A draw call to every ready, idle worker while there is room, with the newest adapter. A call carries
        up to ``rollout_batch`` prompts; when the room is less than the idle workers could take, it is shared
        evenly among them (at K = 0, seven GPU workers draw a seventh of the batch each, not one the whole)."""
        idle = self.fleet.idle()
        for i, slot in enumerate(idle):
            room = self.admission.room(self._outstanding())
            if room <= 0:
                return
            share = -(-room // (len(idle) - i))  # ceil: the rest of the room over the workers still idle
            job = self._next_job(min(self.rollout_batch, share), self.admission.deadline)
            job["timeline"] = slot.name if timeline.recording() is not None else None  # the worker records too
            self.fleet.draw(slot, job, self._adapter)

    # -- the pump (a driver thread) --------------------------------------------------------------------

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    self._issue()
                    calls = self.fleet.calls()
                if not calls:
                    self._stop.wait(0.02)
                    continue
                for ref in self.fleet.wait(list(calls), timeout=0.02):
                    slot, kind = calls[ref]
                    value, death = self.fleet.outcome(ref)
                    if death is not None:
                        self._replace(slot, death, hung=False)
                    elif kind == "start":
                        with self._cond:
                            self.fleet.started(slot, value)
                    else:
                        self._collect(slot, value)
                for slot, error in self.fleet.overdue():
                    self._replace(slot, error, hung=True)
        except BaseException as error:  # handed to the trainer's thread by next_batch
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _collect(self, slot: Slot, result: dict[str, Any]) -> None:
        recorder = timeline.recording()
        if result.get("timeline") and recorder is not None:
            recorder.extend(result["timeline"])
        with self._cond:
            drawn = result["rollout"]
            rows = [drawn.row(i) for i in range(drawn.prompt_ids.shape[0])]
            job = slot.job
            for i, (seq, task_id, row) in enumerate(zip(result["seqs"], job["task_ids"], rows, strict=True)):
                span = (*result["drawn"], i) if "drawn" in result else None
                self._buffer.append(_Trajectory(seq, task_id, result["version"], job["deadline"], slot.name, row, span))
            self.counts["received"] += len(rows)
            slot.job = slot.future = None
            slot.deaths = 0
            self._cond.notify_all()

    def _replace(self, slot: Slot, error: BaseException, hung: bool) -> None:
        """The worker in ``slot`` is dead or hung: its prompts go back to the stream (same sequence numbers),
        and a fresh actor takes the slot and its bundle."""
        with self._cond:
            if slot.job is not None:
                self._retry.extendleft(reversed(slot.job["seqs"]))  # drawn again, same sequence numbers
            slot.job = slot.future = slot.starting = None
            deaths = slot.deaths + 1
            self.counts["worker_restarts"] += 1
            self.counts["worker_hangs"] += int(hung)
            if deaths >= MAX_CONSECUTIVE_DEATHS:
                raise RuntimeError(
                    f"rollout worker slot {slot.index} failed {deaths} times in a row without delivering a draw; "
                    f"last error: {error}"
                ) from error
            self.fleet.respawn(slot, deaths)
            self._cond.notify_all()

    # -- the trainer's side ----------------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        with timeline.span("adapter publish", "adapter", timeline.TRAINER.format(rank=0), "step", version=version):
            weights = {n: p.detach().cpu().clone() for n, p in lora_state(self.policy).items()}
            ref = self.ray.put(weights)
        with self._cond:
            self._adapter = [version, ref]
            if self.fleet.board is not None:
                self.fleet.board.post.remote([version, ref])
            self.admission.published(version)
            self._cond.notify_all()

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        if self._closed:
            raise RuntimeError("RaySource.next_batch after close()")
        B, K = self.config.training.batch_size, self.config.source.max_staleness
        with self._cond:
            self.admission.begin(step, phase, policy_version)
            self._cond.notify_all()
        if self._thread is None:  # first batch: after any checkpoint was loaded, so step and version are right
            self._publish(policy_version)
            self._thread = threading.Thread(target=self._pump, name="sao-ray-pump", daemon=True)
            self._thread.start()
        version = policy_version
        start, waited_for, dropped, warned = time.perf_counter(), 0, 0, False
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"the Ray rollout pump stopped: {self._error}") from self._error
                keep = []
                for item in self._buffer:  # the safety net: admission makes this drop nothing
                    if version - item.version > K:
                        self.dropped.append(item.seq)
                        self.counts["dropped_stale"] += 1
                        dropped += 1
                        _trajectory_span(item, version, step, dropped=True)
                    else:
                        keep.append(item)
                self._buffer = keep
                pending = [s.job["deadline"] for s in self.slots if s.job is not None]
                chosen = self.admission.choose(self._buffer, pending)
                if chosen is not None:
                    break
                waited_for = waited_for or max(1, B - len(self._buffer))
                self._cond.wait(timeout=1.0)
                if not warned and time.perf_counter() - start > SLOW_START_WARNING_S and not self._buffer:
                    warned = True
                    self._say(
                        f"warning: no rollout has arrived for {SLOW_START_WARNING_S:.0f} s; does the cluster have "
                        f"{self.config.source.rollout_workers} × ({self.config.source.worker_cpus} CPU, "
                        f"{self.config.source.worker_gpus} GPU) free?",
                        always=True,
                    )
            waited_s = time.perf_counter() - start if waited_for else 0.0
            taken = {id(t) for t in chosen}
            self._buffer = [t for t in self._buffer if id(t) not in taken]
            self.admission.formed_batch(step)
            self.counts["admitted"] += B
            self.counts["admitted_from_replacements"] += sum("." in t.worker for t in chosen)
            for t in chosen:
                self.admitted_by[t.worker] = self.admitted_by.get(t.worker, 0) + 1
                _trajectory_span(t, version, step)
            self.batches.append([t.seq for t in chosen])
            per_step = {k: self.counts[k] - self._logged[k] for k in self._logged}
            self._logged = {k: self.counts[k] for k in self._logged}
            info = {
                "admitted": B,
                "admitted_total": self.counts["admitted"],
                "dropped_stale": dropped,
                "dropped_stale_total": self.counts["dropped_stale"],
                "waited_for": waited_for,
                "waited_s": waited_s,
                "staleness_max": max(version - t.version for t in chosen),
                "workers_alive": sum(s.ready for s in self.slots),
                "worker_restarts": per_step["worker_restarts"],
                "worker_restarts_total": self.counts["worker_restarts"],
                "worker_hangs": per_step["worker_hangs"],
                "worker_hangs_total": self.counts["worker_hangs"],
                "worker_start_s_max": max(self.start_times, default=float("nan")),
                "admitted_from_replacements_total": self.counts["admitted_from_replacements"],
                "received_total": self.counts["received"],
                "buffered": len(self._buffer),
                "rollouts_per_s": self.counts["received"] / (time.perf_counter() - self._started_at),
            }
        if self.episodes is not None:  # drawn on the workers: their environment's share, from each call
            timeline.env_share([t.drawn[:3] for t in chosen if t.drawn is not None])
        rows = [t.rollout for t in chosen]
        if any(r.versions is not None for r in rows):  # some rows span versions: every row gets its tokens'
            rows = [
                r
                if r.versions is not None
                else dataclasses.replace(r, versions=torch.full_like(r.response_ids, t.version))
                for r, t in zip(rows, chosen, strict=True)
            ]
        rollout = Rollout.concat(rows, self.pad_token_id).to(self.device)
        info["spanning_rows"] = int(rollout.spanning().sum())
        return Batch(
            task_ids=[t.task_id for t in chosen],
            rollout=rollout,
            staleness=[version - t.version for t in chosen],
            info=info,
        )

    def after_update(self, policy_version: int) -> None:
        """Publish the policy's new adapter; every worker's next draw call carries it, and the fleet may draw
        one batch further ahead."""
        self._publish(policy_version)

    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            pending = [*self._retry, *(t.seq for t in self._buffer)]
            pending += [seq for s in self.slots if s.job is not None for seq in s.job["seqs"]]
            return {"engine": "ray", "next_seq": self.next_seq, "pending": sorted(pending), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the prompt stream; the draws pending at the checkpoint are drawn again first."""
        if self._thread is not None:
            raise RuntimeError("RaySource.load_state_dict must come before the first batch")
        if state.get("engine") != "ray":
            raise ConfigError("--resume: the checkpoint was written by another engine; use a new --out")
        self.next_seq = int(state["next_seq"])
        self._retry = deque(int(s) for s in state["pending"])
        self.counts.update(state["counts"])
        self._logged = {k: self.counts[k] for k in self._logged}

    def close(self) -> None:
        """Stop the pump and the fleet (and Ray, if the fleet started or joined it)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.fleet.close()
        c, times = self.counts, self.fleet.start_times
        starts = f"{min(times):.1f}-{max(times):.1f} s" if times else "none started"
        self._say(
            f"ray: {c['received']} trajectories drawn, {c['admitted']} admitted, {c['dropped_stale']} dropped as "
            f"older than {self.config.source.max_staleness}, {c['worker_restarts']} worker restarts "
            f"({c['worker_hangs']} hung); worker start {starts}"
        )

    def _say(self, message: str, always: bool = False) -> None:
        if always or self.progress:
            from tqdm import tqdm

            tqdm.write(f"[{self.label}] {message}")
