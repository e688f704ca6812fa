"""``--engine ray``: asynchronous rollout workers on Ray, with bounded staleness.

The default engine (``LocalStaleSource`` in ``sao.rollout.source``) *simulates* staleness: one process, a frozen
copy of the adapter refreshed every LAG steps, so every run reproduces exactly. This module is the regime
it stands in for: a rollout fleet that never waits for the trainer.

    workers   N Ray actors (``RolloutWorker``), each with its own copy of the base model + LoRA adapter
              at the version it last received. A worker draws ``rollout_batch`` prompts per call with
              ``sao.rollout.sampler.draw`` (the same sampler, temperature and EOS ids as the local path), seeded
              per call, and returns the trajectories tagged with its adapter version.
    prompts   the seeded prompt stream (``PromptOrder``, the order the local source reads); prompt draw
              number s carries sequence number s.
    pump      a driver thread keeps one draw call in flight on every worker (``ray.wait``) and files the
              finished trajectories into a buffer while the trainer is busy with its step. It stops
              issuing when (max_staleness + 1) × batch_size trajectories are buffered or in flight: the
              trainer takes batch_size per update in order of adapter version, so anything drawn beyond
              that would be too stale by the time its turn came.
    batches   ``next_batch`` drops buffered trajectories older than ``max_staleness`` (staleness =
              the trainer's policy_version − the trajectory's adapter version, measured when the batch is
              formed), waits while fewer than batch_size remain, and takes the oldest batch_size
              (``Rollout.concat`` re-pads rows of different widths). The update is the same ``SAO.update``.
    adapter   after every policy step the LoRA tensors are published with ``ray.put`` (CPU copies); each
              worker's next draw call carries the newest reference, and the worker loads it by parameter
              name before drawing.
    failures  a worker whose call dies (``RayActorError``, a crashed process, ``ray.kill``) is replaced by
              a fresh actor and its prompts are drawn again under the same sequence numbers; they were
              never admitted, so nothing is lost or used twice. A slot that dies three times in a row
              without delivering stops the run with the cause.

Every step's log record gets the source's counters (``admitted``, ``dropped_stale``, ``waited_for``,
``waited_s``, ``staleness_max``, ``workers_alive``, ``worker_restarts``, ...; keys ending in ``_total``
count since the start of the run), next to the trainer's own per-trajectory ``staleness_hist``.

Use the local engine for the experiment (reproducible, resumable bit for bit); use this one for
throughput, when decoding dominates and more devices are at hand. A Ray run is NOT bit-reproducible: which
adapter version wrote which trajectory depends on timing. Resume is sensible but not exact: the prompt
stream continues where the checkpoint left it, and trajectories pending at the checkpoint are drawn again.

Deliberately left out: a separate inference engine (vLLM and the like; workers use the reference decode
loop), sharding one model over several devices, partial rollouts interrupted by a weight update, and
pinning the trainer's own GPU (start the cluster with the trainer's GPU hidden; see the README).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from sao.core.config import Config
from sao.core.errors import ConfigError
from sao.model.policy import add_lora, eos_ids, load_base, lora_state
from sao.rollout.sampler import Rollout, decode, derived_seed, draw, encode_prompts
from sao.rollout.source import Batch, PromptOrder

MAX_CONSECUTIVE_DEATHS = 3  # a worker slot that dies this often in a row without delivering stops the run
SLOW_START_WARNING_S = 120.0  # say so when no worker has delivered after this long (cluster too small?)


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


# ---------------------------------------------------------------------------------------------------------
# The worker (a plain class; ``ray.remote`` wraps it when the source starts, so importing this module
# never needs Ray).


class RolloutWorker:
    """One rollout worker: the base model, a LoRA adapter at the version it last received, the sampler."""

    def __init__(self, model_path: str, settings: dict[str, Any]):
        self.settings = settings
        torch.set_num_threads(max(1, int(settings["threads"])))
        self.device = torch.device(settings["device"])
        base, self.tokenizer = load_base(model_path, self.device, getattr(torch, settings["dtype"]))
        self.policy = add_lora(base, rank=settings["lora_rank"], alpha=settings["lora_alpha"], seed=settings["seed"])
        self.params = lora_state(self.policy)
        for p in self.params.values():
            p.requires_grad_(False)
        self.eos = eos_ids(self.tokenizer, base)
        self.version = -1  # nothing received yet: the first call always carries an adapter

    @torch.no_grad()
    def load_adapter(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if set(weights) != set(self.params):
            missing = sorted(set(self.params) ^ set(weights))[:3]
            raise ValueError(f"published adapter does not match the worker's LoRA parameters (e.g. {missing})")
        for name, p in self.params.items():
            p.copy_(weights[name].to(device=p.device, dtype=p.dtype))
        self.version = version

    def draw(self, job: dict[str, Any], adapter: list[Any]) -> dict[str, Any]:
        """Draw one reply per prompt of ``job`` with the newest adapter; ``adapter`` is [version, ObjectRef]
        (nested in a list so Ray fetches the weights only when the version is new to this worker)."""
        version, ref = adapter
        if version != self.version:
            import ray

            self.load_adapter(version, ray.get(ref))
        s = self.settings
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, job["prompts"], self.device)
        generator = torch.Generator(device=self.device).manual_seed(job["seed"])
        rollout = draw(
            self.policy,
            prompt_ids,
            prompt_mask,
            max_new_tokens=s["max_new_tokens"],
            temperature=s["temperature"],
            eos_token_ids=self.eos,
            pad_token_id=self.tokenizer.pad_token_id,
            generator=generator,
        )
        rollout.texts = decode(self.tokenizer, rollout)
        return {"seqs": job["seqs"], "version": self.version, "rollout": _to(rollout, torch.device("cpu"))}


def _to(rollout: Rollout, device: torch.device) -> Rollout:
    return Rollout(
        prompt_ids=rollout.prompt_ids.to(device),
        prompt_mask=rollout.prompt_mask.to(device),
        response_ids=rollout.response_ids.to(device),
        response_mask=rollout.response_mask.to(device),
        sampler_logprobs=rollout.sampler_logprobs.to(device),
        truncated=rollout.truncated.to(device),
        texts=list(rollout.texts),
    )


def _rows(rollout: Rollout) -> list[Rollout]:
    """Split a drawn batch into one-row rollouts trimmed to their own prompt and response lengths."""
    out = []
    for i in range(rollout.prompt_ids.shape[0]):
        p = int(rollout.prompt_mask[i].sum())
        r = max(int(rollout.response_mask[i].sum()), 1)
        P = rollout.prompt_ids.shape[1]
        out.append(
            Rollout(
                prompt_ids=rollout.prompt_ids[i : i + 1, P - p :].clone(),
                prompt_mask=rollout.prompt_mask[i : i + 1, P - p :].clone(),
                response_ids=rollout.response_ids[i : i + 1, :r].clone(),
                response_mask=rollout.response_mask[i : i + 1, :r].clone(),
                sampler_logprobs=rollout.sampler_logprobs[i : i + 1, :r].clone(),
                truncated=rollout.truncated[i : i + 1].clone(),
                texts=rollout.texts[i : i + 1],
            )
        )
    return out


# ---------------------------------------------------------------------------------------------------------
# The source.


@dataclass
class _Trajectory:
    seq: int  # the prompt draw's sequence number
    task_id: str
    version: int  # the adapter version that wrote it
    rollout: Rollout  # one row


@dataclass
class _Slot:
    """A worker position: the actor now filling it and its call in flight (at most one)."""

    actor: Any
    job: dict[str, Any] | None = None
    future: Any = None
    delivered: bool = False  # this actor has returned a draw since it was started
    deaths: int = 0  # consecutive deaths without a delivery


class RaySource:
    """Batches from asynchronous Ray rollout workers, admitted under ``config.max_staleness``.

    A ``sao.rollout.source.Source``, like ``LocalStaleSource``. Not bit-reproducible (arrival order depends on
    timing); ``state_dict`` keeps the prompt-stream position, the draws still pending and the counters.
    ``batches`` and ``dropped`` record the sequence numbers of every batch and every dropped trajectory.
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
    ):
        ray = self.ray = import_ray()
        c = self.config = config
        self.policy, self.pad_token_id, self.prompts, self.order = policy, pad_token_id, prompts, order
        self.device = next(policy.parameters()).device
        self.label, self.progress = label, progress
        self.cap = (c.max_staleness + 1) * c.batch_size
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            self._init_ray()
        dtype = next(policy.parameters()).dtype
        self._model_path = model_path
        self._settings = {
            "device": "cuda" if c.worker_gpus > 0 else "cpu",
            "dtype": str(dtype).removeprefix("torch."),  # the trainer's: the ratio compares the same function
            "threads": max(1, math.floor(c.worker_cpus)),
            "lora_rank": c.lora_rank,
            "lora_alpha": c.lora_alpha,
            "seed": c.seed,
            "max_new_tokens": c.max_new_tokens,
            "temperature": c.temperature,
        }
        self._actor_class = ray.remote(RolloutWorker).options(
            num_cpus=c.worker_cpus, num_gpus=c.worker_gpus, max_restarts=0
        )
        self._death = _death_errors(ray)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._adapter: list[Any] | None = None  # [version, ObjectRef of the LoRA state dict]
        self._buffer: list[_Trajectory] = []
        self._retry: deque[int] = deque()  # sequence numbers to draw again before new ones
        self.next_seq = 0
        self.calls = 0
        self.batches: list[list[int]] = []
        self.dropped: list[int] = []
        self.counts = {"received": 0, "admitted": 0, "dropped_stale": 0, "worker_restarts": 0}
        self._restarts_logged = 0  # worker_restarts as of the last batch, for the per-step count
        self._closed = False
        self._started_at = time.perf_counter()
        self.slots = [_Slot(self._spawn()) for _ in range(c.rollout_workers)]
        atexit.register(self.close)

    def _spawn(self) -> Any:
        """A new worker actor; it loads the model in the background, and its first call waits for that."""
        return self._actor_class.remote(self._model_path, self._settings)

    def _kill(self, actor: Any) -> None:
        with contextlib.suppress(Exception):  # already gone
            self.ray.kill(actor, no_restart=True)

    def _init_ray(self) -> None:
        c = self.config
        kwargs: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
        if c.ray_address is None:
            if c.worker_gpus > 0 and c.rollout_workers * c.worker_gpus > torch.cuda.device_count():
                raise ConfigError(
                    f"--rollout-workers {c.rollout_workers} × --worker-gpus {c.worker_gpus} needs more GPUs than "
                    f"this machine has ({torch.cuda.device_count()}); lower them or join a cluster with --ray-address"
                )
            needed = math.ceil(c.rollout_workers * c.worker_cpus)
            kwargs.update(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)
        else:
            kwargs["address"] = c.ray_address
        try:
            self.ray.init(**kwargs)
        except ConnectionError as error:
            raise ConfigError(f"--ray-address {c.ray_address!r}: could not join the Ray cluster ({error})") from None

    @property
    def workers(self) -> list[Any]:
        """The actor handles now filling the worker slots."""
        return [slot.actor for slot in self.slots]

    # -- the prompt stream -----------------------------------------------------------------------------

    def task_id(self, seq: int) -> str:
        """Prompt draw ``seq``: the same seeded order the local source reads."""
        return self.order.id_at(seq)

    def _next_job(self) -> dict[str, Any]:
        seqs = []
        while len(seqs) < self.config.rollout_batch:
            if self._retry:
                seqs.append(self._retry.popleft())
            else:
                seqs.append(self.next_seq)
                self.next_seq += 1
        ids = [self.task_id(s) for s in seqs]
        self.calls += 1
        seed = derived_seed(self.config.seed, "ray-rollout", self.calls, tuple(seqs))
        return {"seqs": seqs, "task_ids": ids, "prompts": [self.prompts[i] for i in ids], "seed": seed}

    # -- the pump (a driver thread) --------------------------------------------------------------------

    def _outstanding(self) -> int:
        return len(self._buffer) + sum(len(s.job["seqs"]) for s in self.slots if s.job is not None)

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cond:
                    for slot in self.slots:
                        if slot.future is None and self._outstanding() < self.cap:
                            slot.job = self._next_job()
                            slot.future = slot.actor.draw.remote(slot.job, self._adapter)
                    futures = {s.future: s for s in self.slots if s.future is not None}
                if not futures:
                    self._stop.wait(0.02)
                    continue
                ready, _ = self.ray.wait(list(futures), num_returns=1, timeout=0.1)
                for ref in ready:
                    self._collect(futures[ref], ref)
        except BaseException as error:  # handed to the trainer's thread by next_batch
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _collect(self, slot: _Slot, ref: Any) -> None:
        try:
            result = self.ray.get(ref)
        except self._death as error:
            with self._cond:
                self._retry.extendleft(reversed(slot.job["seqs"]))  # drawn again, same sequence numbers
                slot.job = slot.future = None
                slot.deaths += 1
                self.counts["worker_restarts"] += 1
                if slot.deaths >= MAX_CONSECUTIVE_DEATHS:
                    raise RuntimeError(
                        f"a rollout worker died {slot.deaths} times in a row without delivering a draw; "
                        f"last error: {error}"
                    ) from error
            self._kill(slot.actor)
            slot.actor = self._spawn()
            slot.delivered = False
            return
        with self._cond:
            rows = _rows(result["rollout"])
            for seq, task_id, row in zip(result["seqs"], slot.job["task_ids"], rows, strict=True):
                self._buffer.append(_Trajectory(seq, task_id, result["version"], row))
            self.counts["received"] += len(rows)
            slot.job = slot.future = None
            slot.delivered, slot.deaths = True, 0
            self._cond.notify_all()

    # -- the trainer's side ----------------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        weights = {n: p.detach().cpu().clone() for n, p in lora_state(self.policy).items()}
        ref = self.ray.put(weights)
        with self._cond:
            self._adapter = [version, ref]

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        if self._closed:
            raise RuntimeError("RaySource.next_batch after close()")
        if self._thread is None:  # first batch: after any checkpoint was loaded, so the version is right
            self._publish(policy_version)
            self._thread = threading.Thread(target=self._pump, name="sao-ray-pump", daemon=True)
            self._thread.start()
        B, K = self.config.batch_size, self.config.max_staleness
        version = policy_version
        start, waited_for, dropped, warned = time.perf_counter(), 0, 0, False
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError(f"the Ray rollout pump stopped: {self._error}") from self._error
                keep = []
                for item in self._buffer:
                    if version - item.version > K:
                        self.dropped.append(item.seq)
                        self.counts["dropped_stale"] += 1
                        dropped += 1
                    else:
                        keep.append(item)
                self._buffer = keep
                if len(self._buffer) >= B:
                    break
                waited_for = waited_for or B - len(self._buffer)
                self._cond.wait(timeout=1.0)
                if not warned and time.perf_counter() - start > SLOW_START_WARNING_S and not self._buffer:
                    warned = True
                    self._say(
                        f"warning: no rollout has arrived for {SLOW_START_WARNING_S:.0f} s; does the cluster have "
                        f"{self.config.rollout_workers} × ({self.config.worker_cpus} CPU, "
                        f"{self.config.worker_gpus} GPU) free?",
                        always=True,
                    )
            waited_s = time.perf_counter() - start if waited_for else 0.0
            self._buffer.sort(key=lambda t: (t.version, t.seq))
            chosen, self._buffer = self._buffer[:B], self._buffer[B:]
            self.counts["admitted"] += B
            self.batches.append([t.seq for t in chosen])
            restarts_before, self._restarts_logged = self._restarts_logged, self.counts["worker_restarts"]
            info = {
                "admitted": B,
                "admitted_total": self.counts["admitted"],
                "dropped_stale": dropped,
                "dropped_stale_total": self.counts["dropped_stale"],
                "waited_for": waited_for,
                "waited_s": waited_s,
                "staleness_max": max(version - t.version for t in chosen),
                "workers_alive": sum(s.delivered for s in self.slots),
                "worker_restarts": self.counts["worker_restarts"] - restarts_before,
                "worker_restarts_total": self.counts["worker_restarts"],
                "received_total": self.counts["received"],
                "buffered": len(self._buffer),
                "rollouts_per_s": self.counts["received"] / (time.perf_counter() - self._started_at),
            }
        rollout = _to(Rollout.concat([t.rollout for t in chosen], self.pad_token_id), self.device)
        return Batch(
            task_ids=[t.task_id for t in chosen],
            rollout=rollout,
            staleness=[version - t.version for t in chosen],
            info=info,
        )

    def after_update(self, policy_version: int) -> None:
        """Publish the policy's new adapter; every worker's next draw call carries it."""
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
        self._restarts_logged = self.counts["worker_restarts"]

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
            if self.owns_ray:
                self.ray.shutdown()
        c = self.counts
        self._say(
            f"ray: {c['received']} trajectories drawn, {c['admitted']} admitted, {c['dropped_stale']} dropped as "
            f"older than {self.config.max_staleness}, {c['worker_restarts']} worker restarts"
        )

    def _say(self, message: str, always: bool = False) -> None:
        if always or self.progress:
            from tqdm import tqdm

            tqdm.write(f"[{self.label}] {message}")
