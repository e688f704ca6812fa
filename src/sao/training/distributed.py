"""Training over ``torch.distributed``: one process per device, launched by torchrun.

The policy step is a sum over trajectories, so rank r trains rows [r·B/N, (r+1)·B/N) with the whole batch's
action-token count in the coefficients, and the sum of the ranks' gradients is the whole batch's. The local source
runs on every rank, each drawing its rows of the batch; any other source runs on rank 0, which broadcasts each batch
(``BroadcastSource``; its failure, or its end, reaches every rank). Unsharded (``--shard none``) the trained
gradients are summed in one flat all-reduce before the clip (written out, not DDP, which averages and cannot hold
back a non-finite step); sharded (``--shard fsdp``, ``sao.model.sharding``) FSDP2 sums them. Log-probabilities and
values are gathered so every rank logs what a single process logs; rank 0 alone writes files (each rank writes its
own shards of a sharded checkpoint). Without torchrun every collective is the identity.

Deliberately left out: tensor and pipeline parallelism, overlapping the all-reduce with the backward, and
``sao recipe``/``sweep`` under torchrun. Design notes: docs/design/distributed.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from sao.core.errors import ConfigError, SaoError
from sao.rollout.sources import Source
from sao.rollout.types import Batch

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a rank waiting this long for the others stops with an error


@dataclass(frozen=True)
class World:
    """The processes training one run together; ``World()`` is a single process (every collective a no-op)."""

    size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_size: int = 1  # processes of this group on this node
    backend: str | None = None
    joined: bool = False  # this World started the process group (so ``leave`` ends it); False: the caller did

    @classmethod
    def from_env(cls, device: str = "auto") -> World:
        """Join the process group torchrun described in the environment (WORLD_SIZE > 1), else one process.
        ``device`` is the run's --device setting: a GPU setting uses nccl and cuda:LOCAL_RANK, the CPU gloo."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if on_gpu and local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"process {rank} of {size} wants cuda:{local_rank} but this node has {torch.cuda.device_count()} GPUs; "
                "lower --nproc-per-node"
            )
        backend = "nccl" if on_gpu else "gloo"
        if on_gpu:
            torch.cuda.set_device(local_rank)
        import torch.distributed as dist

        joined = not dist.is_initialized()
        if joined:
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        return cls(size=size, rank=rank, local_rank=local_rank, local_size=local_size, backend=backend, joined=joined)

    def leave(self) -> None:
        """End the process group this World started, once the process is done with it (``sao train`` after a run
        that finished), as torch asks of every process (nccl warns at exit otherwise). Not done after a failure (a
        peer may still be inside a collective), nor by ``Trainer.run``: a second group started in the same process
        does not connect reliably (gloo on torch 2.13), so a program that trains twice under torchrun ends the group
        itself. Known gap: while the models still hold the group, its gloo threads outlive this call, and one that
        frees a finished collective's tensors as the interpreter shuts down can abort the process (SIGABRT)."""
        if not self.joined:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that draws, writes and reports."""
        return self.rank == 0

    def device(self, setting: str) -> str:
        """The device this process trains on: cuda:LOCAL_RANK when the group runs on GPUs, else ``setting``."""
        return f"cuda:{self.local_rank}" if self.backend == "nccl" else setting

    def training_gpus(self) -> list[int] | None:
        """The GPUs (cuda indices) this node's training processes use, when the group runs on GPUs; else None."""
        return list(range(self.local_size)) if self.backend == "nccl" else None

    def shard(self, rows: int) -> slice:
        """This process's rows of a batch of ``rows``: an equal contiguous block per rank."""
        if rows % self.size:
            raise ConfigError(f"--batch-size {rows} must be a multiple of the {self.size} training processes")
        n = rows // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    # -- collectives (identities on one process) -------------------------------------------------------------

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """[b, ...] on every rank → [size·b, ...], the ranks' rows in rank order (the whole batch)."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def sum_(self, tensors: Iterable[torch.Tensor]) -> None:
        """Sum each tensor over the ranks, in place, through one flat buffer (float32 at least)."""
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return
        import torch.distributed as dist

        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)  # bf16 → float32
        flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])  # [Σ numel]
        dist.all_reduce(flat)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.detach().copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def sum_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Sum the parameters' gradients over the ranks (a missing gradient counts as zeros)."""
        if self.size == 1:
            return
        params = list(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.sum_(p.grad for p in params)

    def total(self, value: float) -> float:
        """Σ over ranks of a number."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._device())
        self.sum_([t])
        return float(t)

    def all(self, flag: bool) -> bool:
        """True when ``flag`` is True on every rank."""
        return flag if self.size == 1 else self.total(0.0 if flag else 1.0) == 0.0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; tensors in it should be on the CPU)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (pickled) on rank 0, in rank order; None on the other ranks."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (pickled; tensors in it should be on the CPU), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' ``value``s."""
        if self.size == 1:
            return value
        return min(self.all_gather_objects(value))

    def lost(self, error: RuntimeError, saved_at: int) -> RuntimeError:
        """What to raise for ``error`` from a step: a ``GroupLost`` (one line) when a collective failed because
        another process of the group stopped, else ``error`` itself. ``saved_at``: the newest checkpoint's step."""
        text = str(error)
        if self.size == 1 or not (_is_dist_error(error) or any(sign in text for sign in LOST_PEER_SIGNS)):
            return error
        first = (text.strip().splitlines() or [type(error).__name__])[0][:160]
        return GroupLost(
            f"training process {self.rank} of {self.size}: another process of the group stopped "
            f"({first}); the checkpoint after step {saved_at} is intact: run the same command with "
            "--resume"
        )

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")


SINGLE = World()

# What a collective says when the process at the other end is gone (gloo's transport, nccl's watchdog).
LOST_PEER_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "gloo/transport",
)


class GroupLost(SaoError, RuntimeError):
    """A training process could not go on because another one of its group stopped (killed, crashed, lost)."""


def _is_dist_error(error: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(error, getattr(dist, "DistError", ()))


# ---------------------------------------------------------------------------------------------------------
# Rows of a rollout, and the source every rank reads.


class BroadcastSource:
    """A ``Source`` for a group of ranks: rank 0 reads the real source and broadcasts every batch; the other
    ranks hold no source (``source`` None) and receive. The publish hook, the state and close reach the real
    source on rank 0 only, so only rank 0 starts Ray workers or keeps a stale sampler."""

    def __init__(self, world: World, source: Source | None, device: torch.device | str, root: nn.Module | None = None):
        """``root``: the policy's FSDP root when sharded (gathered around the publish hook)."""
        if world.is_main and source is None:
            raise ValueError("rank 0 needs the real source")
        self.world, self.source, self.device, self.root = world, source, torch.device(device), root
        self.first = True  # the first batch: sharded, the policy is gathered around it (see ``next_batch``)
        # what every rank reads of the source: its training tasks by id (for the scorer; a source that grades its own
        # rows has none) and its staleness bound (for the hooks)
        shared = {"tasks": getattr(source, "tasks", None), "max_staleness": getattr(source, "max_staleness", None)}
        shared = world.broadcast(shared if world.is_main else None)
        self.tasks, self.max_staleness = shared["tasks"] or {}, shared["max_staleness"]

    def __getattr__(self, name: str) -> Any:
        """Anything else the real source offers (its summary, its sampler's adapters) on rank 0; not elsewhere."""
        source = self.__dict__.get("source")
        if source is None:
            raise AttributeError(name)
        return getattr(source, name)

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        """Rank 0's batch on every rank. When rank 0's source fails or has no further batch, every rank raises the
        same error (``SourceExhausted`` ends the run cleanly everywhere) instead of waiting for a batch. Sharded, the
        first call runs with the policy gathered on every rank: a source publishes its first adapter from it."""
        from sao.model.sharding import gathered

        batch, failure = None, None
        with gathered(self.root if self.first else None):  # a source publishes its first adapter in its first call
            self.first = False
            if self.source is not None:
                try:
                    batch = self.source.next_batch(step, phase, policy_version)
                    batch = dataclasses.replace(batch, rollout=batch.rollout.to("cpu"))
                except Exception as error:
                    failure = error
        batch, sent = self.world.broadcast((batch, _picklable(failure)))
        if failure is not None:
            raise failure
        if sent is not None:
            raise sent
        return dataclasses.replace(batch, rollout=batch.rollout.to(self.device))

    def after_update(self, policy_version: int) -> None:
        """The real source's publish hook on rank 0; sharded, with the policy gathered on every rank around it (the
        source reads the whole adapter to publish it)."""
        from sao.model.sharding import gathered

        with gathered(self.root):
            if self.source is not None:
                self.source.after_update(policy_version)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict() if self.source is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def _picklable(error: Exception | None) -> Exception | None:
    """``error`` as it can cross to the other ranks: itself when it pickles, else a RuntimeError with its line."""
    if error is None:
        return None
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"rank 0's source failed: {type(error).__name__}: {error}")
