"""``--engine ray``: asynchronous rollout workers on Ray, with bounded staleness and nothing wasted.

N ``RolloutWorker`` actors, each with its own base model + LoRA adapter, decode through the local path's
``Decoder`` in one Ray placement group (never on the trainer's GPU when sao starts the cluster). Admission is tied
to policy versions (as in AReaL and SkyRL): a call is issued only while everything submitted fits in the batches up
to its deadline, so nothing trains more than K = ``max_staleness`` updates old; batches are taken earliest deadline
first, so nothing is dropped. The adapter is published with ``ray.put`` after every policy step (and posted on an
``AdapterBoard`` actor, where a worker looks between the turns of its episodes: an episode in flight goes on under
the newest version, each token recording its own); a hung or dead worker is replaced and its prompts drawn again.
The source's counters go into every step's log record.

A Ray run is not bit-reproducible (the local engine is the one for experiments). Deliberately left out: a separate
inference engine, sharding one model over devices, interrupting a single reply for a new adapter, shared
environments, and pinning the trainer's GPU on a cluster sao did not start. Design notes: docs/design/ray-workers.md.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sao.core.errors import ConfigError
from sao.model.policy import POLICY_ADAPTER, add_lora, eos_ids, load_base, lora_state
from sao.rollout.sampler import derived_seed
from sao.rollout.sources import (
    WARMUP,
    Episodes,
    PromptOrder,
    SourceContext,
    draw_batch,
    draw_episode_batch,
    make_decoder,
)
from sao.rollout.types import Batch, Rollout, Sampling

if TYPE_CHECKING:
    from sao.core.config import Config

MAX_CONSECUTIVE_DEATHS = 3  # a worker slot that fails this often in a row without delivering stops the run
SLOW_START_WARNING_S = 120.0  # say so when no worker has delivered after this long (cluster too small?)
CPU_ROLLOUT_BATCH = 8  # prompts per call on CPU workers: small, so that trajectories arrive continuously
START_TIMEOUT_S = 900.0  # a worker's start (import, model load, maybe a download) may take max(this, worker_timeout)


def import_ray():
    """Ray, or a one-line error that says how to get it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine ray needs Ray: pip install 'sao[ray]'") from None
    return ray


def _death_errors(ray) -> tuple[type[BaseException], ...]:
    """Errors that mean the worker (or its node) is gone, as opposed to a bug in the draw itself."""
    ex = ray.exceptions
    return tuple(
        getattr(ex, name)
        for name in ("RayActorError", "WorkerCrashedError", "NodeDiedError", "ObjectLostError")
        if hasattr(ex, name)
    )


def rollout_batch_size(config: Config) -> int:
    """Prompts per worker call: --rollout-batch, or 0 → the training batch on GPU workers, 8 on CPU ones."""
    if config.rollout.rollout_batch > 0:
        return config.rollout.rollout_batch
    return config.training.batch_size if config.rollout.worker_gpus > 0 else CPU_ROLLOUT_BATCH


def worker_gpu_ids(visible: str | None, device_count: int, reserved: Sequence[int]) -> list[str]:
    """The GPU ids a local Ray cluster may hand to workers: this process's visible GPUs (``visible`` is
    CUDA_VISIBLE_DEVICES, None when unset) without the ``reserved`` ones (indices in visible order: the
    training processes' devices)."""
    if visible is None:
        ids = [str(i) for i in range(device_count)]
    else:
        ids = [part.strip() for part in visible.split(",") if part.strip()][:device_count]
    return [gpu for index, gpu in enumerate(ids) if index not in set(reserved)]


# ---------------------------------------------------------------------------------------------------------
# The worker (a plain class; ``ray.remote`` wraps it when the source starts, so importing this module
# never needs Ray).


class RolloutWorker:
    """One rollout worker: the base model, a LoRA adapter at the version it last received, the decoder."""

    def __init__(self, model_path: str, settings: dict[str, Any], episodes: Episodes | None = None):
        started = time.perf_counter()
        self.settings, self.episodes = settings, episodes
        torch.set_num_threads(max(1, int(settings["threads"])))  # the CPUs Ray reserved for this worker
        self.device = torch.device(settings["device"])
        base, self.tokenizer = load_base(model_path, self.device, getattr(torch, settings["dtype"]))
        self.policy = add_lora(base, rank=settings["lora_rank"], alpha=settings["lora_alpha"], seed=settings["seed"])
        self.params = lora_state(self.policy)
        for p in self.params.values():
            p.requires_grad_(False)
        self.decoder = make_decoder(self.policy, POLICY_ADAPTER, settings["decoder"])
        eos, pad = eos_ids(self.tokenizer, base), self.tokenizer.pad_token_id
        self.sampling = Sampling(settings["max_new_tokens"], settings["temperature"], eos, pad)
        self.version = -1  # nothing received yet: the first call always carries an adapter
        self.load_s = time.perf_counter() - started

    def ready(self) -> dict[str, Any]:
        """Answered once the model is loaded: the process id, what the start cost inside the actor, the decoder
        and the placement group the actor runs in."""
        import ray

        group = ray.get_runtime_context().get_placement_group_id()
        return {"pid": os.getpid(), "load_s": self.load_s, "decoder": type(self.decoder).__name__, "placement": group}

    @torch.no_grad()
    def load_adapter(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if set(weights) != set(self.params):
            missing = sorted(set(self.params) ^ set(weights))[:3]
            raise ValueError(f"published adapter does not match the worker's LoRA parameters (e.g. {missing})")
        for name, p in self.params.items():
            p.copy_(weights[name].to(device=p.device, dtype=p.dtype))
        self.version = version

    def draw(self, job: dict[str, Any], adapter: list[Any], board: Any = None) -> dict[str, Any]:
        """Draw one reply per prompt of ``job`` with the newest adapter; ``adapter`` is [version, ObjectRef]
        (nested in a list so Ray fetches the weights only when the version is new to this worker). Episodes look
        at ``board`` (an ``AdapterBoard``) between turns and go on under a newer version; the call answers the
        version its first tokens were drawn by."""
        held = [self._take(adapter)]  # the version held at the call, then at each look at the board

        def refresh() -> int:  # the episode loop asks before the first action and between turns
            held.append(self._take(import_ray().get(board.newest.remote())))
            return held[-1]

        generator = torch.Generator(device=self.device).manual_seed(job["seed"])
        if self.episodes is not None:  # one multi-turn episode per task, its environment built here
            tokenizer, episodes, sampling = self.tokenizer, self.episodes, self.sampling
            rollout = draw_episode_batch(self.decoder, tokenizer, job["task_ids"], episodes, sampling, generator,
                                         refresh=None if board is None else refresh)  # fmt: skip
        else:
            rollout = draw_batch(self.decoder, self.tokenizer, job["prompts"], self.sampling, generator)
        first = held[1] if len(held) > 1 else held[0]  # the first action's: the board may have had a newer one
        return {"seqs": job["seqs"], "version": first, "rollout": rollout.to(torch.device("cpu"))}

    def _take(self, adapter: list[Any] | None) -> int:
        """Load ``adapter`` ([version, ObjectRef]) if it is newer than the one held; the version held."""
        if adapter is not None and adapter[0] > self.version:
            self.load_adapter(adapter[0], import_ray().get(adapter[1]))
        return self.version


class AdapterBoard:
    """The newest published adapter as [version, ObjectRef] (a list, so Ray hands the reference on unresolved):
    the trainer posts each one, workers read it between the turns of their episodes."""

    def __init__(self) -> None:
        self.adapter: list[Any] | None = None

    def post(self, adapter: list[Any]) -> None:
        self.adapter = adapter

    def newest(self) -> list[Any] | None:
        return self.adapter


# ---------------------------------------------------------------------------------------------------------
# Admission and selection: pure bookkeeping, so that a simulated fleet can test it without Ray.


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


# ---------------------------------------------------------------------------------------------------------
# The source.


@dataclass
class _Trajectory:
    seq: int  # the prompt draw's sequence number
    task_id: str
    version: int  # the adapter version that wrote it
    deadline: int  # the last step whose batch may take it (its call's deadline)
    worker: str  # the actor that drew it ("w0", or "w0.r1" for slot 0's first replacement)
    rollout: Rollout  # one row


@dataclass
class _Slot:
    """A worker position: the actor now filling it, its start-up call, and its draw call (at most one)."""

    index: int
    actor: Any
    spawned: float  # perf_counter when the actor was asked for
    starting: Any = None  # the ready() call while the actor imports and loads its model
    generation: int = 0  # 0: the first actor in this slot; n: its n-th replacement
    pid: int | None = None
    placement: str | None = None  # the placement group the actor reported it runs in
    job: dict[str, Any] | None = None
    future: Any = None
    since: float = 0.0  # perf_counter when the draw call in flight was made
    delivered: bool = False  # this actor has returned a draw since it was started
    deaths: int = 0  # consecutive failures without a delivery

    @property
    def name(self) -> str:
        return f"w{self.index}" if self.generation == 0 else f"w{self.index}.r{self.generation}"

    @property
    def ready(self) -> bool:
        return self.starting is None and self.pid is not None


class RaySource:
    """Batches from asynchronous Ray rollout workers, admitted under ``config.rollout.max_staleness``.

    A ``sao.rollout.sources.Source``, like ``LocalStaleSource``. Not bit-reproducible (arrival order depends on
    timing); ``state_dict`` keeps the prompt-stream position, the draws still pending and the counters.
    ``batches`` and ``dropped`` record the sequence numbers of every batch and every dropped trajectory;
    ``start_times`` the seconds from asking for each actor to its answering ``ready``.
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
        ray = self.ray = import_ray()
        c = self.config = config
        self.policy, self.pad_token_id, self.prompts, self.order = policy, pad_token_id, prompts, order
        self.device = next(policy.parameters()).device
        self.label, self.progress = label, progress
        self.rollout_batch = rollout_batch_size(c)
        if reserved_gpus is None:
            index = self.device.index if self.device.index is not None else 0
            reserved_gpus = [index] if self.device.type == "cuda" else []
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            self._init_ray(reserved_gpus)
        dtype = next(policy.parameters()).dtype
        self._model_path = model_path
        self._settings = {
            "device": "cuda" if c.rollout.worker_gpus > 0 else "cpu",
            "dtype": str(dtype).removeprefix("torch."),  # the trainer's: the ratio compares the same function
            "threads": max(1, math.floor(c.rollout.worker_cpus)),
            "lora_rank": c.model.lora_rank,
            "lora_alpha": c.model.lora_alpha,
            "seed": c.training.seed,
            "max_new_tokens": c.rollout.max_new_tokens,
            "temperature": c.rollout.temperature,
            "decoder": c.rollout.decoder,
        }
        self._episodes = None if episodes is None else ray.put(episodes)  # stored once, shared by every actor
        self._death = _death_errors(ray)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._adapter: list[Any] | None = None  # [version, ObjectRef of the LoRA state dict]
        # where episodes in flight find a newer adapter between turns (the turn loop only: see draw_episodes)
        turn_loop = episodes is not None and episodes.env_rejoin == "turn"
        self._board = ray.remote(AdapterBoard).options(num_cpus=0).remote() if turn_loop else None
        self._buffer: list[_Trajectory] = []
        self._retry: deque[int] = deque()  # sequence numbers to draw again before new ones
        # read and set under the lock
        self.admission = Admission(c.training.batch_size, c.rollout.max_staleness, c.algorithm.critic_warmup)
        self.next_seq = 0
        self.calls = 0
        self.batches: list[list[int]] = []
        self.dropped: list[int] = []
        self.start_times: list[float] = []
        self.admitted_by: dict[str, int] = {}  # actor name ("w0", "w0.r1", ...) → its admitted trajectories
        self.counts = {
            "received": 0, "admitted": 0, "dropped_stale": 0, "worker_restarts": 0, "worker_hangs": 0,
            "admitted_from_replacements": 0,
        }  # fmt: skip
        self._logged = {"worker_restarts": 0, "worker_hangs": 0}  # as of the last batch, for per-step counts
        self._closed = False
        self._started_at = time.perf_counter()
        self._actor_class = ray.remote(RolloutWorker)
        try:
            self._placement = self._place_workers(c)
        except BaseException:
            if self.owns_ray:
                ray.shutdown()
            raise
        self.placement_id = self._placement.id.hex() if self._placement is not None else None
        self.slots = [self._new_slot(i) for i in range(c.rollout.rollout_workers)]
        self.max_staleness = c.rollout.max_staleness
        self.tasks: dict[str, Any] = {}
        atexit.register(self.close)

    @classmethod
    def build(cls, context: SourceContext) -> RaySource:
        """``--rollout ray``: workers drawing the context's prompts (or episodes) with the policy's adapters."""
        context.check_batch()
        m = context.models
        source = cls(
            context.config, model_path=m.name, policy=m.policy, pad_token_id=m.tokenizer.pad_token_id,
            prompts=context.prompts, order=context.order, label=context.label, progress=context.progress,
            reserved_gpus=context.reserved_gpus, episodes=context.episodes,
        )  # fmt: skip
        source.tasks = context.tasks
        return source

    # -- the cluster -----------------------------------------------------------------------------------

    def _init_ray(self, reserved_gpus: Sequence[int]) -> None:
        c = self.config
        kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
        if c.rollout.ray_address is not None:
            kwargs["address"] = c.rollout.ray_address
            try:
                self.ray.init(**kwargs)
            except ConnectionError as error:
                raise ConfigError(
                    f"--ray-address {c.rollout.ray_address!r}: could not join the cluster ({error})"
                ) from None
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = worker_gpu_ids(visible, torch.cuda.device_count(), reserved_gpus)
        r = c.rollout
        if r.worker_gpus > 0 and r.rollout_workers * r.worker_gpus > len(gpus):
            raise ConfigError(
                f"--rollout-workers {r.rollout_workers} × --worker-gpus {r.worker_gpus} needs more GPUs than the "
                f"{len(gpus)} this machine has beside the training processes' {len(reserved_gpus)}; lower them or "
                "join a cluster with --ray-address"
            )
        needed = math.ceil(c.rollout.rollout_workers * c.rollout.worker_cpus)
        kwargs.update(num_cpus=max(os.cpu_count() or 1, needed), num_gpus=len(gpus), include_dashboard=False)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # what the local raylet sees, and hands out
        try:
            self.ray.init(**kwargs)
        finally:  # this process keeps the devices it had
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible

    def _place_workers(self, c: Config) -> Any:
        """A placement group with one (worker_cpus, worker_gpus) bundle per worker, ready; None when a worker
        reserves nothing (there is nothing to place)."""
        bundle = {k: v for k, v in (("CPU", c.rollout.worker_cpus), ("GPU", c.rollout.worker_gpus)) if v > 0}
        if not bundle:
            return None
        from ray.util import placement_group

        group = placement_group([dict(bundle) for _ in range(c.rollout.rollout_workers)], strategy="PACK")
        try:
            self.ray.get(group.ready(), timeout=c.rollout.worker_timeout)
        except self.ray.exceptions.GetTimeoutError:
            self._remove_placement(group)
            raise ConfigError(
                f"the Ray cluster could not place {c.rollout.rollout_workers} workers × {bundle} within "
                "--worker-timeout "
                f"{c.rollout.worker_timeout:.0f} s (it has {self.ray.cluster_resources()}); lower --rollout-workers, "
                "--worker-cpus or --worker-gpus"
            ) from None
        return group

    def _remove_placement(self, group: Any) -> None:
        from ray.util import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(group)

    def _new_slot(self, index: int, generation: int = 0) -> _Slot:
        """Ask for a new worker actor in slot ``index`` (bundle ``index``); it loads its model in the background
        and answers ``ready`` when it can draw."""
        c = self.config
        options: dict[str, Any] = {
            "num_cpus": c.rollout.worker_cpus,
            "num_gpus": c.rollout.worker_gpus,
            "max_restarts": 0,
        }
        if self._placement is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement, placement_group_bundle_index=index
            )
        actor = self._actor_class.options(**options).remote(self._model_path, self._settings, self._episodes)
        slot = _Slot(index=index, actor=actor, spawned=time.perf_counter(), generation=generation)
        slot.starting = actor.ready.remote()
        return slot

    def _kill(self, actor: Any) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(actor, no_restart=True)

    @property
    def workers(self) -> list[Any]:
        """The actor handles now filling the worker slots."""
        return [slot.actor for slot in self.slots]

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
        return {"seqs": seqs, "task_ids": ids, "prompts": prompts, "seed": seed, "deadline": deadline}

    # -- admission (under the lock) --------------------------------------------------------------------

    def _outstanding(self) -> int:
        """Trajectories submitted and not yet in a batch: buffered or in a call in flight."""
        return len(self._buffer) + sum(len(s.job["seqs"]) for s in self.slots if s.job is not None)

    def _issue(self) -> None:
        """A draw call to every ready, idle worker while there is room, with the newest adapter. A call carries
        up to ``rollout_batch`` prompts; when the room is less than the idle workers could take, it is shared
        evenly among them (at K = 0, seven GPU workers draw a seventh of the batch each, not one the whole)."""
        idle = [slot for slot in self.slots if slot.ready and slot.job is None]
        for i, slot in enumerate(idle):
            room = self.admission.room(self._outstanding())
            if room <= 0:
                return
            share = -(-room // (len(idle) - i))  # ceil: the rest of the room over the workers still idle
            slot.job = self._next_job(min(self.rollout_batch, share), self.admission.deadline)
            slot.future = slot.actor.draw.remote(slot.job, self._adapter, self._board)
            slot.since = time.perf_counter()

    # -- the pump (a driver thread) --------------------------------------------------------------------

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    self._issue()
                    calls = {s.future: (s, "draw") for s in self.slots if s.future is not None}
                    calls.update({s.starting: (s, "start") for s in self.slots if s.starting is not None})
                if not calls:
                    self._stop.wait(0.02)
                    continue
                ready, _ = self.ray.wait(list(calls), num_returns=1, timeout=0.02)
                for ref in ready:
                    slot, kind = calls[ref]
                    self._started(slot, ref) if kind == "start" else self._collect(slot, ref)
                self._check_deadlines()
        except BaseException as error:  # handed to the trainer's thread by next_batch
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _started(self, slot: _Slot, ref: Any) -> None:
        try:
            info = self.ray.get(ref)
        except self._death as error:
            self._replace(slot, error, hung=False)
            return
        with self._cond:
            slot.starting, slot.pid, slot.placement = None, int(info["pid"]), info["placement"]
            self.start_times.append(time.perf_counter() - slot.spawned)

    def _collect(self, slot: _Slot, ref: Any) -> None:
        try:
            result = self.ray.get(ref)
        except self._death as error:
            self._replace(slot, error, hung=False)
            return
        with self._cond:
            drawn = result["rollout"]
            rows = [drawn.row(i) for i in range(drawn.prompt_ids.shape[0])]
            job = slot.job
            for seq, task_id, row in zip(result["seqs"], job["task_ids"], rows, strict=True):
                self._buffer.append(_Trajectory(seq, task_id, result["version"], job["deadline"], slot.name, row))
            self.counts["received"] += len(rows)
            slot.job = slot.future = None
            slot.delivered, slot.deaths = True, 0
            self._cond.notify_all()

    def _check_deadlines(self) -> None:
        """A draw call older than --worker-timeout, or a start older than max(START_TIMEOUT_S, --worker-timeout):
        the worker is hung; replace it."""
        now, limit = time.perf_counter(), self.config.rollout.worker_timeout
        start_limit = max(START_TIMEOUT_S, limit)
        for slot in list(self.slots):
            if slot.starting is not None and now - slot.spawned > start_limit:
                self._replace(slot, TimeoutError(f"{slot.name} did not start within {start_limit:.0f} s"), hung=True)
            elif slot.future is not None and now - slot.since > limit:
                self._replace(slot, TimeoutError(f"{slot.name} did not answer a draw within {limit:.0f} s"), hung=True)

    def _replace(self, slot: _Slot, error: BaseException, hung: bool) -> None:
        """The worker in ``slot`` is dead or hung: its prompts go back to the stream (same sequence numbers),
        the actor is killed, and a fresh one takes the slot and its bundle."""
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
        self._kill(slot.actor)
        new = self._new_slot(slot.index, slot.generation + 1)
        new.deaths = deaths
        with self._cond:
            self.slots[slot.index] = new
            self._cond.notify_all()

    # -- the trainer's side ----------------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        weights = {n: p.detach().cpu().clone() for n, p in lora_state(self.policy).items()}
        ref = self.ray.put(weights)
        with self._cond:
            self._adapter = [version, ref]
            if self._board is not None:
                self._board.post.remote([version, ref])
            self.admission.published(version)
            self._cond.notify_all()

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        if self._closed:
            raise RuntimeError("RaySource.next_batch after close()")
        B, K = self.config.training.batch_size, self.config.rollout.max_staleness
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
                        f"{self.config.rollout.rollout_workers} × ({self.config.rollout.worker_cpus} CPU, "
                        f"{self.config.rollout.worker_gpus} GPU) free?",
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
        rows = [t.rollout for t in chosen]
        if any(r.versions is not None for r in rows):  # some rows span versions: every row gets its tokens'
            rows = [r if r.versions is not None else dataclasses.replace(r, versions=torch.full_like(
                r.response_ids, t.version)) for r, t in zip(rows, chosen, strict=True)]  # fmt: skip
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
        """Stop the pump and the workers; shut Ray down if this source started (or joined) it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.ray.is_initialized():
            for slot in self.slots:
                self._kill(slot.actor)
            if self._board is not None:
                self._kill(self._board)
            if self._placement is not None:
                self._remove_placement(self._placement)
            if self.owns_ray:
                self.ray.shutdown()
        c = self.counts
        starts = f"{min(self.start_times):.1f}-{max(self.start_times):.1f} s" if self.start_times else "none started"
        self._say(
            f"ray: {c['received']} trajectories drawn, {c['admitted']} admitted, {c['dropped_stale']} dropped as "
            f"older than {self.config.rollout.max_staleness}, {c['worker_restarts']} worker restarts "
            f"({c['worker_hangs']} "
            f"hung); worker start {starts}"
        )

    def _say(self, message: str, always: bool = False) -> None:
        if always or self.progress:
            from tqdm import tqdm

            tqdm.write(f"[{self.label}] {message}")
