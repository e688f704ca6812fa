"""The rollout sources by name, each with the settings section it owns: ``--rollout NAME`` picks one.

    SOURCES          name → the source's settings section (a ``SourceSection``): its fields (flags and docs),
                     its checks, what it needs beside the step, and the implementation it names by import path
    local            the stale sampler in this process (``sao.rollout.sources``): reproducible, the default
    ray              asynchronous rollout workers on Ray (``sao.rollout.ray_workers``)
    traces           a serving system's trace log (``sao.rollout.traces``)
    vllm, vllm-async vLLM as the stale sampler, or asynchronous (``sao.rollout.remote`` over ``sao.rollout.vllm``)
    TRACE_FORMATS    other systems' trajectory records ``--traces`` reads beside sao's own, a ``TraceFormat``

A section lives here, not in its source's module, so that parsing a command line loads no torch; a source of your
own registers its section beside it: ``SOURCES.register("mine", MySettings)`` with ``MySettings.implementation =
"my.module:MySource"``. Deliberately left out: the settings every source reads (``sao.core.config.RolloutSettings``).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from sao.core.registry import Registry
from sao.core.settings import SourceSection, at_least, non_negative, not_blank, one_of, option, positive


def _staleness(what: str) -> Any:
    return option(4, what, check=at_least(0, " (0 = only fresh trajectories)"))


LAG_HELP = "The sampler's adapter is refreshed every LAG policy steps: staleness 0, then 1..LAG. The page's 4."


@dataclass(frozen=True)
class LocalSettings(SourceSection):
    """``--rollout local``: the recipe's stale sampler in this process; a step's batch is a pure function of the seed
    and the adapters, so a run and its resume draw the same numbers."""

    implementation: ClassVar[str] = "sao.rollout.sources:LocalStaleSource"
    full_weights: ClassVar[bool] = True  # the stale sampler is then a frozen copy of the whole model
    draws_on_demand: ClassVar[bool] = True  # the oracle baseline and ceiling roll its prompts out again
    lag: int = option(4, LAG_HELP, check=at_least(0, " (0 = always fresh)"))
    sampler_dtype: str = option(
        "auto",
        "The dtype the stale sampler draws in. \"auto\": the model's own (one set of base weights, as the trainer's). "
        '"bfloat16" or "float32": on a model of another dtype the sampler draws with a copy of the base model in that '
        "dtype plus the sampler's LoRA weights cast to it (re-copied before every draw), so the recorded sampler "
        "log-probabilities carry its numerics while the teacher-forced pass keeps the trainer's: bfloat16 on a "
        "float32 trainer is the engine-mismatch regime, where the ratio at lag 0 measures the numerics alone "
        "(abs_log_ratio_* in the log); \"float16\" the same with half precision's rounding instead of bfloat16's. "
        "Costs one copy of the base weights.",
        check=one_of("auto", "bfloat16", "float16", "float32"),
    )
    sampler_logit_noise: float = option(
        0.0,
        "A sampler-side perturbation of controlled size: Gaussian noise of this standard deviation added to every "
        "logit the sampler draws from (before the temperature), seeded by (seed, step), so that each drawn token and "
        "its recorded log-probability come from the perturbed distribution while the trainer's pass stays clean. At "
        "lag 0 the ratio then measures this mismatch alone, a dose from ~0 up to well past the band (mismatch by "
        "dose, with --sampler-dtype). 0: off. Costs one copy of the model, as another --sampler-dtype does.",
        check=lambda v: None if math.isfinite(v) and 0.0 <= v <= 100.0 else "must be a number in [0, 100]",
    )

    def check(self, config: Any) -> str | None:
        if self.sampler_dtype == "auto" and not self.sampler_logit_noise:
            return None
        if config.model.finetune == "full":
            return (
                "--sampler-dtype with --finetune full is not offered (nor --sampler-logit-noise): the stale sampler "
                "is a copy of the whole model"
            )
        if config.training.shard == "fsdp":
            return (
                "--sampler-dtype with --shard fsdp is not offered (nor --sampler-logit-noise): the sampler's copy "
                "would hold the whole model unsharded"
            )
        return None


@dataclass(frozen=True)
class RaySettings(SourceSection):
    """``--rollout ray``: asynchronous rollout workers (Ray actors), admitted under a staleness bound."""

    implementation: ClassVar[str] = "sao.rollout.ray_workers:RaySource"
    max_staleness: int = _staleness(
        "The oldest a trajectory may be when it is put in a batch (policy updates since the adapter that wrote it). "
        "Workers draw only as far ahead as this allows, so nothing drawn ages past it (0 = synchronous training); "
        "anything older would be dropped and counted. Equal to the default LAG, so both sources train on the same "
        "staleness range (0..4)."
    )
    rollout_workers: int = option(
        2, "Rollout workers (Ray actors), each with its own copy of the model.", check=at_least(1)
    )
    rollout_batch: int = option(
        0,
        "Prompts per worker draw call. 0 = --batch-size on GPU workers (one engine call fills the GPU) and 8 on CPU "
        "workers (small, so that trajectories arrive continuously).",
        check=at_least(0, " (0 = automatic)"),
    )
    worker_timeout: float = option(
        300.0,
        "Seconds a rollout worker may take to answer one draw call (its start, import and model load, may take "
        "max(this, 900 s)); past it the worker counts as hung: it is killed and replaced like a dead one, and its "
        "prompts are drawn again.",
        check=positive,
    )
    worker_cpus: float = option(
        1.0, "CPUs Ray reserves for each worker (also its torch thread count).", check=non_negative
    )
    worker_gpus: float = option(
        0.0,
        "GPUs Ray reserves for each rollout worker; > 0 puts the worker's model on CUDA, fractions share a GPU "
        "between workers.",
        check=non_negative,
    )
    ray_address: str | None = option(
        None,
        'Address of a running Ray cluster to join ("auto", "ray://host:10001", "host:6379"); None starts a local one '
        "for the run and stops it afterwards.",
        check=not_blank,
    )


@dataclass(frozen=True)
class TraceSettings(SourceSection):
    """``--rollout traces`` (or ``--traces LOG`` alone): a serving system's logged trajectories, each trained at the
    staleness its policy version gives it; the run takes min(--steps, what the log allows) steps."""

    implementation: ClassVar[str] = "sao.rollout.traces:TraceSource"
    implied_by: ClassVar[str | None] = "traces"
    full_weights: ClassVar[bool] = True  # the server that wrote the log takes the published weights
    max_staleness: int = _staleness(
        "Traces older than this (policy updates since their version) are dropped and counted."
    )
    follow: bool = option(
        False,
        "Wait for the log to grow (new lines, new files) instead of ending the run when it is read to its end; the run "
        "ends cleanly after --follow-timeout seconds with no new line. For a live server's log.",
    )
    follow_timeout: float = option(
        600.0,
        "--follow: seconds without a new trace line after which the run ends cleanly with what it did.",
        check=positive,
    )
    skip_bad_traces: bool = option(
        False,
        "Count and skip malformed lines instead of stopping with a one-line error naming the file, line and field. Off "
        "by default, because a malformed log usually means a writer bug or the wrong file.",
    )

    sampler_tolerance: float = option(
        1e-3,
        "Mean |log r| over the action tokens of staleness-0 traces above which the run stops, as with the vLLM "
        "sources: the server did not sample from the adapter the trainer holds, or with other numerics (sao serve's "
        "float32 sampler agrees to ~1e-6; a bf16 server against the float32 trainer needs ~3e-2: raise it there, "
        "knowing the ratio then carries that mismatch). Checked on every batch with staleness-0 rows.",
        check=positive,
    )

    def needs(self) -> dict[str, Any]:
        return {"footing_audit": True, "summary": True, "publish": True, "sampler_tolerance": self.sampler_tolerance}

    def check(self, config: Any) -> str | None:
        if config.rollout.traces is None:
            return "--rollout traces needs --traces LOG (a JSONL file or a folder of *.jsonl files)"
        if config.data.env is not None and config.training.gate == "off":
            return (
                "--traces with --env: the trajectories come from the log, not from an environment; --env there only "
                "names the environment the gate plays its held-aside tasks in (--gate held-out)"
            )
        return None


@dataclass(frozen=True)
class RemoteSettings(SourceSection):
    """A remote inference engine as the sampler (``sao.rollout.remote``): what every engine's sources read. An engine
    is a subclass naming its client (``engine``, an ``ENGINES`` entry of ``sao.rollout.engines``) with the settings
    it adds; its stale sampler adds ``lag``, its asynchronous source ``max_staleness``."""

    engine: ClassVar[str] = ""
    sampler_tolerance: float = option(
        1e-3,
        "Mean |log r| over staleness-0 action tokens above which the run stops: the sampler is not serving the "
        "adapter the trainer published (a float32 engine agrees to ~3e-6; a bf16 one against a float32 trainer needs "
        "~3e-2). Checked on every batch with fresh rows.",
        check=positive,
    )

    def needs(self) -> dict[str, Any]:
        return {"footing_audit": True, "sampler_tolerance": self.sampler_tolerance}

    def connect(self, context: Any) -> Any:
        """The engine's ``sao.rollout.engines.Connection`` for a run (``context``: its ``SourceContext``): clients of
        running servers, or servers started here and their clients."""
        raise NotImplementedError(f"{type(self).__name__} names no engine: define connect(context)")

    @property
    def concurrency(self) -> int:
        """Requests in flight per server at most."""
        return 64


@dataclass(frozen=True)
class VllmServers(RemoteSettings):
    """vLLM's settings, shared by its two sources."""

    engine: ClassVar[str] = "vllm"
    vllm_url: str | None = option(
        None,
        "The URLs of running vLLM OpenAI servers (comma-separated; requests are spread over them), started with "
        "--enable-lora, runtime LoRA loading and --logprobs-mode processed_logprobs.",
        check=not_blank,
    )
    vllm_launch: bool = option(
        False,
        "Start the servers here (on 127.0.0.1, from --vllm-python), stop them when the run ends or fails, and restart "
        "one that dies (its requests drawn again).",
    )
    vllm_python: str | None = option(
        None,
        "--vllm-launch: the Python that has vLLM (default: .venv-vllm/bin/python, made by make install-vllm).",
        check=not_blank,
    )
    vllm_servers: int = option(1, "--vllm-launch: how many servers to start.", check=at_least(1))
    vllm_max_loras: int = option(
        4, "Adapters a vLLM server holds at once (--max-loras); older versions are unloaded.", check=at_least(2)
    )
    vllm_concurrency: int = option(
        64, "Requests in flight per vLLM server at most (vLLM batches them continuously).", check=at_least(1)
    )
    vllm_timeout: float = option(
        120.0,
        "Seconds a vLLM server may stay unreachable, and the most one request to it may take (connecting, the "
        "headers and the whole reply), before the run stops with one line.",
        check=positive,
    )

    @property
    def concurrency(self) -> int:
        return self.vllm_concurrency

    @property
    def client_options(self) -> dict[str, Any]:
        """How each request honours --vllm-timeout: connecting, the headers and the whole reply."""
        return {"timeout": self.vllm_timeout, "connect_deadline": self.vllm_timeout, "setting": "--vllm-timeout"}

    def connect(self, context: Any) -> Any:
        import logging
        from pathlib import Path

        from sao.core.errors import ConfigError
        from sao.rollout.engines import Connection
        from sao.rollout.vllm import VllmClient, VllmServer, default_vllm_python
        from sao.rollout.vllm_weights import reload_into

        urls = [u.strip() for u in (self.vllm_url or "").split(",") if u.strip()]
        resident = max(2, self.vllm_max_loras - 1)  # adapters per server at once (one slot spare)
        if urls:
            clients = [VllmClient(u, **self.client_options) for u in urls]
            remote = sorted({client.url for client in clients if not client.local})
            if remote:  # vLLM loads adapters and weights by path: those servers must see this run's folder
                logging.getLogger("sao.rollout").warning(
                    "the vLLM servers at %s load every adapter and full-weight version this run publishes by its path "
                    "under %s: that folder must be on a filesystem their nodes mount at the same path",
                    ", ".join(remote),
                    Path(context.out_dir).resolve(),
                )
            return Connection(clients, resident_adapters=resident, load_weights=reload_into)
        if not self.vllm_launch:
            raise ConfigError(
                "--rollout vllm needs --vllm-url URL[,URL...] (running servers) or --vllm-launch (sao starts one from "
                "--vllm-python)"
            )
        c, m = context.config, context.models
        max_len = min(int(getattr(m.policy.config, "max_position_embeddings", 4096)), 4096)
        servers = [
            VllmServer(
                m.name,
                python=self.vllm_python or default_vllm_python(),
                max_model_len=max_len,
                max_lora_rank=c.model.lora_rank,
                max_loras=self.vllm_max_loras,
                seed=c.training.seed + i,
                log_path=Path(context.out_dir) / f"vllm-server-{i}.log",
                dev_mode=True,  # full weights are reloaded through vLLM's development routes (on 127.0.0.1 only)
            )
            for i in range(self.vllm_servers)
        ]
        options = self.client_options
        return Connection(
            [],
            servers,
            max_model_len=max_len,
            resident_adapters=resident,
            client_options=options,
            load_weights=reload_into,
        )


@dataclass(frozen=True)
class VllmSettings(VllmServers):
    """``--rollout vllm``: vLLM as the recipe's stale sampler (its adapter refreshed every LAG policy steps)."""

    implementation: ClassVar[str] = "sao.rollout.remote:RemoteSource"
    full_weights: ClassVar[bool] = True  # each refresh reloads the policy's weights into the servers in place
    lag: int = option(4, LAG_HELP, check=at_least(0, " (0 = always fresh)"))


@dataclass(frozen=True)
class VllmAsyncSettings(VllmServers):
    """``--rollout vllm-async``: requests stay in flight while the trainer steps, admitted under --max-staleness."""

    implementation: ClassVar[str] = "sao.rollout.remote:RemoteAsyncSource"
    max_staleness: int = _staleness(
        "The oldest a trajectory may be when it is put in a batch; requests are issued only as far ahead as this "
        "allows, so nothing is dropped."
    )


TRACE_FORMATS = Registry(
    "trace format", {"openenv": "sao.rollout.openenv_traces:FORMAT", "tinker": "sao.rollout.tinker_traces:FORMAT"}
)
SOURCES = Registry(
    "rollout source",
    {
        "local": LocalSettings,
        "ray": RaySettings,
        "traces": TraceSettings,
        "vllm": VllmSettings,
        "vllm-async": VllmAsyncSettings,
    },
)


def build_source(name: str, context: Any) -> Any:
    """The source registered as ``name``, built from a ``sao.rollout.sources.SourceContext`` by its implementation's
    ``build`` (its module imported now)."""
    return _implementation(name).build(context)


def builds_on_every_rank(name: str) -> bool:
    """Whether the source registered as ``name`` is built on every torchrun process (its class sets
    ``every_rank = True``: each process draws its rows), rather than on rank 0 alone."""
    return bool(getattr(_implementation(name), "every_rank", False))


def _implementation(name: str) -> Any:
    module, _, attribute = SOURCES.get(name).implementation.partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found
