"""Ray rollout workers as a fleet: the cluster (joined, or started for the run), one placement bundle per worker,
the worker actors in their slots, their start-up, and a fresh actor in the slot of one that died or hung.

    RolloutWorker   one actor: the base model, a LoRA adapter at the version it last received, the decoder
    AdapterBoard    the newest published adapter, where workers look between the turns of their episodes
    RayFleet        the actors of one run, in slots; ``respawn`` replaces the actor in a slot

Importing this module never needs Ray (``ray.remote`` wraps the classes when a fleet starts). Deliberately left out:
what the workers draw and when (the source, ``sao.rollout.ray_workers``, owns the prompt stream and admission).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sao.core import timeline
from sao.core.errors import ConfigError
from sao.model.policy import POLICY_ADAPTER, add_lora, eos_ids, load_base, lora_state
from sao.rollout.sources import Episodes, draw_batch, draw_episode_batch, make_decoder
from sao.rollout.types import Sampling

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


def worker_gpu_ids(visible: str | None, device_count: int, reserved: Sequence[int]) -> list[str]:
    """The GPU ids a local Ray cluster may hand to workers: this process's visible GPUs (``visible`` is
    CUDA_VISIBLE_DEVICES, None when unset) without the ``reserved`` ones (indices in visible order: the
    training processes' devices)."""
    if visible is None:
        ids = [str(i) for i in range(device_count)]
    else:
        ids = [part.strip() for part in visible.split(",") if part.strip()][:device_count]
    return [gpu for index, gpu in enumerate(ids) if index not in set(reserved)]


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
        self.track: str | None = None  # this worker's process on the timeline, while a call records one

    def ready(self) -> dict[str, Any]:
        """Answered once the model is loaded: the process id, what the start cost inside the actor, the decoder
        and the placement group the actor runs in."""
        import ray

        group = ray.get_runtime_context().get_placement_group_id()
        return {"pid": os.getpid(), "load_s": self.load_s, "decoder": type(self.decoder).__name__, "placement": group}

    @torch.no_grad()
    def load_adapter(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with timeline.span("adapter load", "adapter", self.track or "ray worker", "calls", version=version) as told:
            told["loaded"] = False
            if set(weights) != set(self.params):
                missing = sorted(set(self.params) ^ set(weights))[:3]
                raise ValueError(f"published adapter does not match the worker's LoRA parameters (e.g. {missing})")
            for name, p in self.params.items():
                p.copy_(weights[name].to(device=p.device, dtype=p.dtype))
            self.version = version
            told["loaded"] = True  # every tensor the trainer published, of the worker's own names, copied in

    def draw(self, job: dict[str, Any], adapter: list[Any], board: Any = None) -> dict[str, Any]:
        """Draw one reply per prompt of ``job`` with the newest adapter; ``adapter`` is [version, ObjectRef]
        (nested in a list so Ray fetches the weights only when the version is new to this worker). Episodes look
        at ``board`` (an ``AdapterBoard``) between turns and go on under a newer version; the call answers the
        version its first tokens were drawn by."""
        recorder = timeline.start() if job.get("timeline") else None  # the trainer keeps a timeline
        if recorder is not None:
            self.track, recorder.suffix = f"ray worker {job['timeline']}", f" (ray worker {job['timeline']})"
        started, waited = timeline.now(), timeline.env_waited()
        held = [self._take(adapter)]  # the version held at the call, then at each look at the board

        def refresh() -> int:  # the episode loop asks before the first action and between turns
            held.append(self._take(import_ray().get(board.newest.remote())))
            return held[-1]

        generator = torch.Generator(device=self.device).manual_seed(job["seed"])
        if self.episodes is not None:  # one multi-turn episode per task, its environment built here
            tokenizer, episodes, sampling = self.tokenizer, self.episodes, self.sampling
            rollout = draw_episode_batch(
                self.decoder,
                tokenizer,
                job["task_ids"],
                episodes,
                sampling,
                generator,
                refresh=None if board is None else refresh,
            )
        else:
            rollout = draw_batch(self.decoder, self.tokenizer, job["prompts"], self.sampling, generator)
        first = held[1] if len(held) > 1 else held[0]  # the first action's: the board may have had a newer one
        drawn = (started, timeline.now(), timeline.env_waited() - waited)  # and the seconds on the environment
        out = {"seqs": job["seqs"], "version": first, "rollout": rollout.to(torch.device("cpu")), "drawn": drawn}
        if recorder is not None:  # the call's events go back with it, each row's span is the trainer's to place
            timeline.complete(
                "draw call",
                "call",
                self.track,
                "calls",
                *drawn[:2],
                rows=len(job["seqs"]),
                version=first,
                pid=os.getpid(),
                env_s=drawn[2],
            )
            out["timeline"] = recorder.drain()[0]
        return out

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


@dataclass
class Slot:
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
    deaths: int = 0  # consecutive failures without a delivery

    @property
    def name(self) -> str:
        return f"w{self.index}" if self.generation == 0 else f"w{self.index}.r{self.generation}"

    @property
    def ready(self) -> bool:
        return self.starting is None and self.pid is not None


class RayFleet:
    """The worker actors of one run, one per slot, on a Ray cluster this fleet joined or started (``owns_ray``).

    ``settings`` is the run's ``RaySettings``; ``worker`` what each actor is built with (``RolloutWorker``'s
    settings); ``board`` starts an ``AdapterBoard``. Not thread-safe: the source calls it under its own lock, but
    for ``outcome`` (a blocking wait on one call's result)."""

    def __init__(
        self,
        settings: Any,
        *,
        model_path: str,
        worker: dict[str, Any],
        episodes: Episodes | None,
        reserved_gpus: Sequence[int],
        board: bool,
    ) -> None:
        ray = self.ray = import_ray()
        self.settings = settings
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            self._init_ray(reserved_gpus)
        self._model_path, self._settings = model_path, worker
        self._episodes = None if episodes is None else ray.put(episodes)  # stored once, shared by every actor
        self._death = _death_errors(ray)
        self.board = ray.remote(AdapterBoard).options(num_cpus=0).remote() if board else None
        self.start_times: list[float] = []  # seconds from asking for each actor to its answering ready()
        self._actor_class = ray.remote(RolloutWorker)
        try:
            self._placement = self._place_workers()
        except BaseException:
            if self.owns_ray:
                ray.shutdown()
            raise
        self.placement_id = self._placement.id.hex() if self._placement is not None else None
        self.slots = [self._new_slot(i) for i in range(settings.rollout_workers)]

    # -- the cluster -----------------------------------------------------------------------------------

    def _init_ray(self, reserved_gpus: Sequence[int]) -> None:
        r = self.settings
        kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
        if r.ray_address is not None:
            kwargs["address"] = r.ray_address
            try:
                self.ray.init(**kwargs)
            except ConnectionError as error:
                raise ConfigError(f"--ray-address {r.ray_address!r}: could not join the cluster ({error})") from None
            return
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = worker_gpu_ids(visible, torch.cuda.device_count(), reserved_gpus)
        if r.worker_gpus > 0 and r.rollout_workers * r.worker_gpus > len(gpus):
            raise ConfigError(
                f"--rollout-workers {r.rollout_workers} × --worker-gpus {r.worker_gpus} needs more GPUs than the "
                f"{len(gpus)} this machine has beside the training processes' {len(reserved_gpus)}; lower them or "
                "join a cluster with --ray-address"
            )
        needed = math.ceil(r.rollout_workers * r.worker_cpus)
        kwargs.update(num_cpus=max(os.cpu_count() or 1, needed), num_gpus=len(gpus), include_dashboard=False)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # what the local raylet sees, and hands out
        try:
            self.ray.init(**kwargs)
        finally:  # this process keeps the devices it had
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible

    def _place_workers(self) -> Any:
        """A placement group with one (worker_cpus, worker_gpus) bundle per worker, ready; None when a worker
        reserves nothing (there is nothing to place)."""
        r = self.settings
        bundle = {k: v for k, v in (("CPU", r.worker_cpus), ("GPU", r.worker_gpus)) if v > 0}
        if not bundle:
            return None
        from ray.util import placement_group

        group = placement_group([dict(bundle) for _ in range(r.rollout_workers)], strategy="PACK")
        try:
            self.ray.get(group.ready(), timeout=r.worker_timeout)
        except self.ray.exceptions.GetTimeoutError:
            self._remove_placement(group)
            raise ConfigError(
                f"the Ray cluster could not place {r.rollout_workers} workers × {bundle} within "
                "--worker-timeout "
                f"{r.worker_timeout:.0f} s (it has {self.ray.cluster_resources()}); lower --rollout-workers, "
                "--worker-cpus or --worker-gpus"
            ) from None
        return group

    def _remove_placement(self, group: Any) -> None:
        from ray.util import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(group)

    def _new_slot(self, index: int, generation: int = 0) -> Slot:
        """Ask for a new worker actor in slot ``index`` (bundle ``index``); it loads its model in the background
        and answers ``ready`` when it can draw."""
        r = self.settings
        options: dict[str, Any] = {"num_cpus": r.worker_cpus, "num_gpus": r.worker_gpus, "max_restarts": 0}
        if self._placement is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement, placement_group_bundle_index=index
            )
        actor = self._actor_class.options(**options).remote(self._model_path, self._settings, self._episodes)
        slot = Slot(index=index, actor=actor, spawned=time.perf_counter(), generation=generation)
        slot.starting = actor.ready.remote()
        return slot

    def _kill(self, actor: Any) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(actor, no_restart=True)

    @property
    def workers(self) -> list[Any]:
        """The actor handles now filling the worker slots."""
        return [slot.actor for slot in self.slots]

    def idle(self) -> list[Slot]:
        """The slots whose actor has started and has no draw call in flight."""
        return [slot for slot in self.slots if slot.ready and slot.job is None]

    def draw(self, slot: Slot, job: dict[str, Any], adapter: list[Any] | None) -> None:
        """Ask the actor in ``slot`` to draw ``job`` with ``adapter`` ([version, ObjectRef]); it looks at the board
        between turns."""
        slot.job, slot.since = job, time.perf_counter()
        slot.future = slot.actor.draw.remote(job, adapter, self.board)

    def calls(self) -> dict[Any, tuple[Slot, str]]:
        """Every call in flight: its reference → (slot, "draw" or "start")."""
        calls = {s.future: (s, "draw") for s in self.slots if s.future is not None}
        calls.update({s.starting: (s, "start") for s in self.slots if s.starting is not None})
        return calls

    def wait(self, refs: list[Any], timeout: float) -> list[Any]:
        return self.ray.wait(refs, num_returns=1, timeout=timeout)[0]

    def outcome(self, ref: Any) -> tuple[Any, BaseException | None]:
        """A finished call's (value, None), or (None, the error) when its actor or node is gone."""
        try:
            return self.ray.get(ref), None
        except self._death as error:
            return None, error

    def started(self, slot: Slot, info: dict[str, Any]) -> None:
        slot.starting, slot.pid, slot.placement = None, int(info["pid"]), info["placement"]
        self.start_times.append(time.perf_counter() - slot.spawned)

    def overdue(self) -> list[tuple[Slot, BaseException]]:
        """Slots whose draw call is older than --worker-timeout, or whose start is older than max(START_TIMEOUT_S,
        --worker-timeout): their actor is hung."""
        now, limit = time.perf_counter(), self.settings.worker_timeout
        start_limit = max(START_TIMEOUT_S, limit)
        out = []
        for slot in self.slots:
            if slot.starting is not None and now - slot.spawned > start_limit:
                out.append((slot, TimeoutError(f"{slot.name} did not start within {start_limit:.0f} s")))
            elif slot.future is not None and now - slot.since > limit:
                out.append((slot, TimeoutError(f"{slot.name} did not answer a draw within {limit:.0f} s")))
        return out

    def respawn(self, slot: Slot, deaths: int) -> Slot:
        """Kill the actor in ``slot`` and ask for a fresh one in its place and bundle."""
        self._kill(slot.actor)
        new = self._new_slot(slot.index, slot.generation + 1)
        new.deaths = deaths
        self.slots[slot.index] = new
        return new

    def close(self) -> None:
        """Every actor killed, the placement removed, and Ray shut down if this fleet started (or joined) it."""
        if self.ray.is_initialized():
            for slot in self.slots:
                self._kill(slot.actor)
            if self.board is not None:
                self._kill(self.board)
            if self._placement is not None:
                self._remove_placement(self._placement)
            if self.owns_ray:
                self.ray.shutdown()
