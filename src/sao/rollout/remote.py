"""A remote inference engine draws the trajectories, sao trains on them (``--rollout vllm``, ``vllm-async``).

    Fleet             the engine's servers for one run (``RemoteSettings.connect``: running ones, or started here and
                      restarted when they die), each published adapter written to OUT/<engine>-adapters/v{N}/ and
                      loaded into every server by a name of this run's own, the oldest unloaded once no request needs
                      it; or a full-weight version folder reloaded into every server in place (``load_weights``)
    RemoteSource      the recipe's stale sampler with the engine as the sampler: its adapter refreshed every LAG policy
                      steps (LAG 0: before every draw), each batch drawn at once, one seeded request per prompt
    RemoteAsyncSource requests stay in flight while the trainer steps, admitted under ``--max-staleness`` K
                      (``sao.rollout.admission``, nothing dropped); an episode's later actions are drawn by the adapter
                      published by then, each token keeping its version (a row is as stale as its oldest token)

Token in, token out through ``sao.rollout.engines.EngineClient``: sao renders the chat template and sends token ids;
the engine returns token ids and log-probs after temperature; nothing is re-tokenised. With an environment each action
is one request carrying the whole token prefix, every row on its own thread, so a slow tool holds only its own
trajectory. Deliberately left out: stop strings on the server (an action is cut at its stop string here, so the kept
tokens are a prefix of a sample) and sharing a server's adapters between runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sao.core import timeline
from sao.core.errors import ConfigError, SaoError
from sao.core.io import write_json
from sao.core.names import POLICY
from sao.core.plugins import PluginError, describe
from sao.model.artifacts import save_adapter, save_full_weights
from sao.model.policy import causal_lm
from sao.rollout.admission import Admission
from sao.rollout.engines import Connection, EngineClient
from sao.rollout.environment import (
    STOP_TAIL,
    EnvCalls,
    EnvFault,
    check_env,
    checked_env,
    checked_init,
    checked_step,
    encode_bounded,
    every_row_failed,
    reaches_stop,
    render_observation,
    tool_count,
)
from sao.rollout.sampler import derived_seed
from sao.rollout.sources import SourceContext
from sao.rollout.types import Batch, Rollout, Turns

log = logging.getLogger("sao.rollout")


class Fleet:
    """The engine's servers of one run and the adapters it has loaded into them."""

    def __init__(self, context: SourceContext):
        settings, m = context.config.source, context.models
        self.tokenizer, self.models, self.out = m.tokenizer, m, context.out_dir
        self.tag = (
            "sao-"
            + hashlib.sha256(f"{Path(context.out_dir).resolve()}:{os.getpid()}:{time.time()}".encode()).hexdigest()[:8]
        )
        self.adapters_dir = Path(self.out) / f"{settings.engine}-adapters"  # v{N}/ a published version's folder
        self.weights_dir = Path(self.out) / f"{settings.engine}-weights"  # v{N}/ under full fine-tuning
        self.servers_file = Path(self.out) / f"{settings.engine}-servers.json"
        self.track = timeline.REMOTE.format(engine=settings.engine)  # its requests' process on the timeline
        connection: Connection = settings.connect(context)
        self.keep = connection.resident_adapters
        self.max_model_len = connection.max_model_len
        self.loaded: OrderedDict[int, str] = OrderedDict()  # version → adapter name, oldest first
        self.weights: tuple[Path, int] | None = None  # the full-weight version every server holds, if any
        self.weights_name: str | None = None  # the model name requests use once full weights are loaded
        self.weights_loader = connection.load_weights
        self.servers = connection.servers
        self.clients: list[EngineClient] = connection.clients
        if self.servers:
            self._start_all()
            self.clients = [server.client(**connection.client_options) for server in self.servers]
        self.client_options = connection.client_options
        self.restarts = 0
        self.restart_lock = threading.Lock()
        self.slots = {id(c): i for i, c in enumerate(self.clients)}  # each client's place in the fleet

    def _start_all(self) -> None:
        """Start every server (at once: each spends its start importing its engine) and say which in
        OUT/<engine>-servers.json."""
        Path(self.out).mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda s: s.start(), self.servers))
        self._record()

    def _record(self) -> None:
        servers = [
            {"url": s.url, "pid": s.pid, "log": str(s.log_path), "startup_seconds": s.startup_seconds}
            for s in self.servers
        ]
        write_json(self.servers_file, servers)

    def publish(self, version: int) -> str:
        """The policy's adapter now, written as OUT/<engine>-adapters/v{version}/ and loaded into every server; returns
        its name. A fresh folder per version: vLLM keys its prefix cache by adapter name and path. Under full
        fine-tuning, the policy's weights instead (``publish_weights``)."""
        if self.models.finetune == "full":
            return self.publish_weights(version)
        if version in self.loaded:
            return self.loaded[version]
        folder = self.adapters_dir / f"v{version}"
        with timeline.span("adapter publish", "adapter", timeline.TRAINER.format(rank=0), "step", version=version):
            if not folder.is_dir():  # a resumed run's sampler: its folder was written when that version was published
                m = self.models
                save_adapter(m.policy, m.tokenizer, m.value_head, folder, base_model=m.name, policy_version=version)
            name = f"{self.tag}-v{version}"
            for server, client in enumerate(self.distinct()):
                with timeline.span(
                    "adapter load", "adapter", self.track, "adapter loads", version=version, server=server, adapter=name
                ) as told:
                    told["loaded"] = False
                    self._with_restart(client, lambda cl: cl.load_adapter(name, folder))
                    told["loaded"] = True  # the server answered the load with success
        self.loaded[version] = name
        return name

    def publish_weights(self, version: int) -> str:
        """Full fine-tuning: the policy's weights now, written as OUT/<engine>-weights/v{version}/ (safetensors shards,
        no value head beside them) and reloaded into every server (``load_weights``); the folders before the previous
        version are removed (the previous one is what a failed reload falls back to). Returns the model name."""
        if self.weights is not None and self.weights[1] == version:
            return self.weights_name
        m = self.models
        if m.sharded:
            raise ConfigError(
                "--finetune full with a remote engine needs the whole model in the process that "
                "publishes: leave out --shard fsdp (or use --rollout local)"
            )
        folder = self.weights_dir / f"v{version}"
        with timeline.span("weights publish", "adapter", timeline.TRAINER.format(rank=0), "step", version=version):
            if not folder.is_dir():  # a resumed run's sampler: its folder was written when that version was published
                save_full_weights(causal_lm(m.policy), folder, tokenizer=m.tokenizer)
            previous = self.weights[1] if self.weights is not None else None
            self.weights_name = self.load_weights(folder, version)
        for old in self.weights_dir.glob("v*"):  # keep this version and the one before it
            if old.name[1:].isdigit() and int(old.name[1:]) not in (version, previous):
                shutil.rmtree(old, ignore_errors=True)
        return self.weights_name

    def load_weights(self, folder: str | os.PathLike[str], version: int) -> str:
        """Full weights: the version ``folder`` (safetensors shards, ``sao.model.artifacts.save_full_weights``) reloaded
        into every server in place, tagged ``version`` and checked (vLLM: ``sao.rollout.vllm_weights``); a server that
        refuses or does not receive it is one line. Returns the model name requests use from now on: the base model's,
        which answers with these weights. The folder must fit the weights the servers hold (the last version, or the
        base model's folder), and a server reads it itself: on another node it must be on a filesystem both share."""
        if self.weights_loader is None:
            raise ConfigError("this engine serves adapters only: it cannot take full weights")
        folder, load = Path(folder), self.weights_loader
        previous = self.weights[0] if self.weights is not None else self.models.name
        names = [
            self._with_restart(client, lambda cl: load(cl, folder, version, previous=previous))
            for client in self.distinct()
        ]
        self.weights = (folder, version)
        return names[0]

    def release(self, needed: set[int]) -> None:
        """Unload the oldest adapters beyond the resident bound that no request still needs."""
        for version in list(self.loaded):
            if len(self.loaded) <= self.keep:
                return
            if version in needed:
                continue
            name = self.loaded.pop(version)
            for client in self.distinct():
                with contextlib.suppress(SaoError):
                    client.unload_adapter(name)
            shutil.rmtree(self.adapters_dir / f"v{version}", ignore_errors=True)

    def distinct(self) -> list[EngineClient]:
        """One client per server: an address given twice spreads requests twice as often to it, and loads once."""
        first: dict[str, EngineClient] = {}
        for client in self.clients:
            first.setdefault(client.url, client)
        return list(first.values())

    def complete(self, index: int, prompt: Sequence[int], **params: Any):
        """One completion on server ``index`` (mod the fleet); a launched server that died is restarted once and
        its adapters reloaded, and the request sent again."""
        client = self.clients[index % len(self.clients)]
        with timeline.span(
            "request",
            "request",
            self.track,
            timeline.thread("request thread"),
            server=index % len(self.clients),
            adapter=params.get("model"),
            prompt_tokens=len(prompt),
        ) as told:
            reply = self._with_restart(client, lambda cl: cl.complete(prompt, **params))
            told.update(completion_tokens=len(reply.completion_token_ids), finish=reply.finish_reason)
        return reply

    def _with_restart(self, client: EngineClient, call):
        """``call(client)``; when a server started here has died, it is restarted once (by the first request to find
        it dead: the others in flight wait for that restart and are sent again to the new one) and its adapters
        reloaded."""
        try:
            return call(client)
        except SaoError:
            if not self.servers:
                raise  # a server we did not start: one line, the run stops
            i = self.slots[id(client)]
            with self.restart_lock:
                current = self.clients[i]
                if current is client:  # nobody restarted it since this request began
                    if self.servers[i].running():
                        raise  # a refusal, not a death: one line, the run stops
                    self.restarts += 1
                    server = self.servers[i].restart()
                    self._record()
                    current = server.client(**self.client_options)
                    if self.weights is not None:  # a new server holds the base model
                        self.weights_loader(current, *self.weights, previous=self.models.name)
                    for version, name in self.loaded.items():
                        current.load_adapter(name, self.adapters_dir / f"v{version}")
                    self.clients[i] = current
                    self.slots[id(current)] = i
            return call(current)

    def close(self) -> None:
        for name in self.loaded.values():
            for client in self.distinct():
                with contextlib.suppress(SaoError):
                    client.unload_adapter(name)
        self.loaded.clear()
        for server in self.servers:
            server.stop()


@dataclass
class Drawn:
    """One trajectory as vLLM drew it, as lists, with the adapter version that wrote it."""

    task_id: str
    version: int  # the version of its first action: the oldest of its tokens (admission goes by it)
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token: the version that sampled it
    action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # per token: a turn's reward on its last action token
    cut: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    unfinished: bool = False
    faults: int = 0  # 1: the environment raised, ran past --env-timeout, or answered what sao cannot use or fit
    timed_out: bool = False  # the fault was a call past --env-timeout
    fault: str | None = None  # what ended it by a fault: one line naming the environment and the task
    context_cut: bool = False  # ended because the server's context (max_model_len) was full
    seq: int = 0
    deadline: int = 0
    drawn: tuple[float, float, float, str] | None = None  # (start, end, seconds on its environment, its thread)

    def extend(self, ids: list[int], version: int, logprobs: list[float] | None = None) -> None:
        """Tokens of an action (with the sampler's ``logprobs``) or of an observation (none), written at ``version``."""
        self.response += ids
        self.versions += [version] * len(ids)
        self.action += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.rewards += [0.0] * len(ids)


def cut_at_stop(tokenizer: Any, ids: list[int], stops: tuple[str, ...]) -> int | None:
    """How many of an action's tokens ``ids`` to keep when they reach one of the environment's ``stops`` (the action
    ends there), or None when none is reached."""
    for k in range(1, len(ids) + 1):
        if reaches_stop(tokenizer, ids[max(0, k - STOP_TAIL) : k], stops):
            return k
    return None


class Drawing:
    """What both sources share: prompts as token ids, one request per single reply, an episode loop per row."""

    def __init__(self, context: SourceContext):
        c, m = context.config, context.models
        self.config, self.models, self.tokenizer = c, m, m.tokenizer
        self.tasks, self.prompts, self.episodes = context.tasks, context.prompts, context.episodes
        self.order = context.order
        self.batch_size, self.seed = c.training.batch_size, c.training.seed
        self.eos = list(m.eos_token_ids)
        self.fleet = Fleet(context)
        self.kind = c.rollout.source  # the name it was registered by, kept in its checkpoint state
        self.device = m.device
        threads = max(1, c.source.concurrency * len(self.fleet.clients))
        self.pool = ThreadPoolExecutor(threads)
        # every trajectory already has its own thread here: the steps run beside them, under --env-timeout
        e = self.episodes
        self.env_calls = EnvCalls(threads, c.data.env_timeout, e.name if e else "the environment")
        if self.episodes is not None and self.tasks:
            check_env(self.episodes.env_factory)  # a class with a wrong plain/async mix: one line, at start

    def prompt_ids(self, task_id: str) -> list[int]:
        return self.tokenizer(self.prompts[task_id], add_special_tokens=False)["input_ids"]

    def draw(
        self,
        task_id: str,
        version: int,
        name: str,
        seed: int,
        server: int,
        newest: Callable[[], tuple[int, str]] | None = None,
    ) -> Drawn:
        """``draw_one``, timed for the timeline (the trajectory's span is placed when its staleness is known)."""
        started, waited = timeline.now(), timeline.env_waited()
        d = self.draw_one(task_id, version, name, seed, server, newest)
        d.drawn = (started, timeline.now(), timeline.env_waited() - waited, timeline.thread("request thread"))
        return d

    def trajectories(self, rows: Sequence[Drawn], policy_version: int, step: int) -> None:
        """The batch's trajectories on the timeline, each on the thread that drew it, if one is kept."""
        if timeline.recording() is None:
            return
        for d in rows:
            if d.drawn is not None:
                start, end, env_s, thread = d.drawn
                timeline.complete(
                    "trajectory",
                    "trajectory",
                    self.fleet.track,
                    thread,
                    start,
                    end,
                    task=d.task_id,
                    seq=d.seq,
                    version=d.version,
                    staleness=policy_version - d.version,
                    step=step,
                    env_s=env_s,
                    turns=d.turns,
                )

    def draw_one(
        self,
        task_id: str,
        version: int,
        name: str,
        seed: int,
        server: int,
        newest: Callable[[], tuple[int, str]] | None = None,
    ) -> Drawn:
        """One trajectory of ``task_id`` by adapter ``name`` (version ``version``). With ``newest`` (the asynchronous
        source), each later action of an episode is drawn by the adapter ``newest()`` names then: a trajectory in
        flight when a new adapter is published goes on under it, every token recording its version."""
        r = self.config.rollout
        if self.episodes is None:
            prompt = self.prompt_ids(task_id)
            room = self.fleet.max_model_len - len(prompt)
            reply = self.fleet.complete(
                server,
                prompt,
                model=name,
                max_tokens=max(1, min(r.max_new_tokens, room)),
                temperature=r.temperature,
                seed=seed,
                stop_token_ids=self.eos,
            )
            ids = reply.completion_token_ids
            return Drawn(
                task_id,
                version,
                prompt,
                list(ids),
                [version] * len(ids),
                [True] * len(ids),
                list(reply.sampler_logprobs),
                cut=reply.finish_reason == "length" and ids[-1] not in self.eos,
            )
        return self._episode(task_id, version, name, seed, server, newest)

    def _episode(
        self,
        task_id: str,
        version: int,
        name: str,
        seed: int,
        server: int,
        newest: Callable[[], tuple[int, str]] | None,
    ) -> Drawn:
        """A multi-turn episode, as ``sao.rollout.episodes`` draws one, an action per request."""
        e, r, tok, calls = self.episodes, self.config.rollout, self.tokenizer, self.env_calls
        env_name = calls.name
        d = Drawn(task_id, version, [])

        def fault(error: BaseException | str) -> Drawn:  # the trajectory ends here, counted
            d.faults, d.unfinished, d.timed_out = 1, True, bool(getattr(error, "timed_out", False))
            d.fault = str(error)
            log.warning("%s", error)
            return d

        try:
            env = checked_env(
                calls.call(e.env_factory, task_id, e.fields[task_id], task=task_id, what="building it"),
                env_name,
                task_id,
            )
        except EnvFault as error:
            d.prompt = self.prompt_ids(task_id)
            return fault(error)
        check_env(env)
        try:
            try:
                start, info = checked_init(
                    calls.call(env.init, e.messages[task_id], task=task_id, what="init"), env_name, task_id
                )
            except (EnvFault, PluginError) as error:
                d.prompt = self.prompt_ids(task_id)
                return fault(error)
            tools = (info or {}).get("tools") or None
            text = tok.apply_chat_template(start, tools=tools, tokenize=False, add_generation_prompt=True)
            d.prompt = tok(text, add_special_tokens=False)["input_ids"]
            stops = tuple(getattr(env, "stop_strings", ()) or ())
            while True:
                context_room = self.fleet.max_model_len - len(d.prompt) - len(d.response)
                room = min(r.max_new_tokens, e.max_total_tokens - len(d.response), context_room)
                if room < 1:
                    d.unfinished, d.context_cut = True, context_room < 1 and len(d.response) < e.max_total_tokens
                    return d
                if newest is not None and d.turns > 0:  # a later action: the adapter published by now draws it
                    version, name = newest()
                reply = self.fleet.complete(
                    server,
                    d.prompt + d.response,
                    model=name,
                    max_tokens=room,
                    temperature=r.temperature,
                    seed=derived_seed(seed, d.turns),
                    stop_token_ids=self.eos,
                )
                ids, logps = list(reply.completion_token_ids), list(reply.sampler_logprobs)
                ended = ids[-1] if ids[-1] in self.eos else None
                keep = cut_at_stop(tok, ids, stops) if ended is None and stops else None
                if keep is not None:  # an action also ends at a stop string: the tokens up to it
                    ids, logps = ids[:keep], logps[:keep]
                d.cut = ended is None and keep is None and len(ids) >= room
                d.extend(ids, version, logps)
                d.turns += 1
                try:  # a tool that raises, hangs or answers a malformed step ends this trajectory only
                    result = checked_step(
                        calls.call(env.step, tok.decode(ids, skip_special_tokens=True), task=task_id), env_name, task_id
                    )
                    meta = result.get("metadata") or {}
                    made = tool_count(meta, "tool_calls", env_name, task_id)
                    errors = tool_count(meta, "tool_errors", env_name, task_id)
                    done = bool(result.get("done", False))
                except (EnvFault, PluginError) as error:
                    return fault(error)
                d.rewards[-1] = result["reward"]
                d.tool_calls += made
                d.tool_errors += errors
                if d.cut or d.turns >= e.max_turns or len(d.response) >= e.max_total_tokens:
                    d.unfinished = d.cut or not done
                    return d
                if done:
                    return d
                eos_text = tok.decode([ended]) if ended is not None else None
                context_room = self.fleet.max_model_len - len(d.prompt) - len(d.response)
                room = min(e.max_total_tokens - len(d.response), context_room)
                try:
                    obs = render_observation(tok, result["observations"], eos_text)
                    obs_ids = encode_bounded(tok, obs, room)
                except Exception as error:  # observations the template cannot render
                    return fault(
                        f"{env_name} (step) on {task_id}: its observations could not be rendered: {describe(error)}"
                    )
                if obs_ids is None or len(obs_ids) >= room:  # no room for the observation and another action
                    d.context_cut = context_room < e.max_total_tokens - len(d.response)
                    return fault(
                        f"{env_name} (step) on {task_id}: an observation of "
                        f"{f'over {room}' if obs_ids is None else len(obs_ids)} tokens, {room} left"
                    )
                d.extend(obs_ids, version)
        finally:
            try:  # closing cannot undo the episode
                calls.call(env.close, task=task_id, what="close")
            except EnvFault as error:
                log.warning("%s", error)

    def rollout(self, rows: Sequence[Drawn]) -> Rollout:
        """The trajectories as the trainer's batch: prompts left-padded, responses right-padded. A batch in which no
        trajectory got to act (its environment failed on every one before the first action) is one line naming the
        environment: there is nothing in it to train on."""
        if self.episodes is not None and rows and not any(any(d.action) for d in rows):
            raise every_row_failed(self.env_calls.name, len(rows), next((d.fault for d in rows if d.fault), None))
        B, P = len(rows), max(len(d.prompt) for d in rows)
        R = max(max(len(d.response) for d in rows), 1)
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.full((B, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.bool)
        response_ids = torch.full((B, R), pad, dtype=torch.long)
        response_mask, action_mask = torch.zeros(B, R, dtype=torch.bool), torch.zeros(B, R, dtype=torch.bool)
        logprobs, rewards = torch.zeros(B, R), torch.zeros(B, R)
        for i, d in enumerate(rows):
            n = len(d.response)
            prompt_ids[i, P - len(d.prompt) :] = torch.tensor(d.prompt)
            prompt_mask[i, P - len(d.prompt) :] = True
            if n:
                response_ids[i, :n] = torch.tensor(d.response)
                response_mask[i, :n] = True
                action_mask[i, :n] = torch.tensor(d.action)
                logprobs[i, :n] = torch.tensor(d.logprobs, dtype=torch.float32)
                if d.rewards:
                    rewards[i, :n] = torch.tensor(d.rewards, dtype=torch.float32)
        spans = any(len(set(d.versions)) > 1 for d in rows)
        versions = None
        if spans:  # [B, R] each token's version (padding: the row's first)
            versions = torch.tensor([d.versions + [d.version] * (R - len(d.versions)) for d in rows], dtype=torch.long)
        texts = self.tokenizer.batch_decode([d.response for d in rows], skip_special_tokens=True)
        turns = None
        if self.episodes is not None:
            turns = Turns(
                rewards=rewards,
                count=torch.tensor([d.turns for d in rows]),
                tool_calls=torch.tensor([d.tool_calls for d in rows]),
                tool_errors=torch.tensor([d.tool_errors for d in rows]),
                unfinished=torch.tensor([d.unfinished for d in rows]),
                faults=torch.tensor([d.faults for d in rows]),
                timeouts=torch.tensor([d.timed_out for d in rows]),
                context_cuts=torch.tensor([d.context_cut for d in rows]),
            )
        return Rollout(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            action_mask,
            logprobs,
            torch.tensor([d.cut for d in rows]),
            texts,
            turns,
            versions,
        ).to(self.device)

    def adapter(self, version: int) -> Path | None:
        """The folder of the adapter version ``version`` drew with (for re-scoring under it), while it exists."""
        folder = self.fleet.adapters_dir / f"v{version}"
        return folder if folder.is_dir() else None

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.env_calls.close()
        self.fleet.close()


class RemoteSource(Drawing):
    """``--rollout vllm``: the stale sampler, with the engine as the sampler (refreshed every LAG policy steps)."""

    def __init__(self, context: SourceContext):
        context.check_batch()
        super().__init__(context)
        self.lag = self.max_staleness = context.config.source.lag
        self.sampler_version, self.name = 0, None
        warmup = context.config.algorithm.critic_warmup
        self.first_policy_step = warmup if isinstance(warmup, int) else None  # "auto": the first POLICY batch's step

    @classmethod
    def build(cls, context: SourceContext) -> RemoteSource:
        return cls(context)

    def _refresh(self, version: int) -> None:
        self.name = self.fleet.publish(version)
        self.sampler_version = version
        self.fleet.release({version})

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        if phase == POLICY and self.first_policy_step is None:  # an automatic critic warmup ends here
            self.first_policy_step = step
        k = step - (self.first_policy_step or 0)  # policy step (unused during the warmup)
        if self.name is None:  # the first batch (or the first after a resume): the sampler's version is loaded
            self._refresh(self.sampler_version)
        if phase == POLICY and self.lag == 0:
            self._refresh(policy_version)
        ids = self.order.batch(step, self.batch_size)
        started = time.perf_counter()
        seeds = [derived_seed(self.seed, step, j, "vllm") for j in range(len(ids))]
        with timeline.phase("draw"):  # the trainer waits for the requests it just sent
            futures = [
                self.pool.submit(self.draw, i, self.sampler_version, self.name, seeds[j], j) for j, i in enumerate(ids)
            ]
            rows = [f.result() for f in futures]
        staleness = policy_version - self.sampler_version
        self.trajectories(rows, policy_version, step)
        if self.episodes is not None:  # drawn on the pool's threads: their environment's share, from each row
            timeline.env_share([d.drawn[:3] for d in rows if d.drawn is not None])
        info = {
            "engine_adapter_version": self.sampler_version,
            "engine_seconds": time.perf_counter() - started,
            "engine_restarts_total": self.fleet.restarts,
        }
        if phase == POLICY and self.lag > 0 and k % self.lag == 0:
            self._refresh(policy_version)
        return Batch(task_ids=ids, rollout=self.rollout(rows), staleness=[staleness] * len(ids), info=info)

    def after_update(self, policy_version: int) -> None:
        """Nothing here: the sampler takes the policy's adapter on its own schedule, at draw time."""

    def state_dict(self) -> dict[str, Any]:
        state = {"sampler_version": self.sampler_version, "first_policy_step": self.first_policy_step}
        return {"source": self.kind, **state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The sampler's version: its adapter folder, kept in OUT/<engine>-adapters/, is loaded at the next draw."""
        if state.get("source") != self.kind:
            raise ConfigError("--resume: the checkpoint was written by another rollout source; use a new --out")
        self.sampler_version = int(state["sampler_version"])
        self.first_policy_step = state.get("first_policy_step", self.first_policy_step)
        if self.adapter(self.sampler_version) is None:
            folder = self.fleet.adapters_dir / f"v{self.sampler_version}"
            raise ConfigError(
                f"--resume: {folder} is missing, so the sampler's adapter cannot be restored; start "
                "again with a new --out"
            )
        self.fleet.loaded.pop(self.sampler_version, None)
        self.name = None


class RemoteAsyncSource(Drawing):
    """``--rollout vllm-async``: requests in flight while the trainer steps, admitted under ``--max-staleness``."""

    def __init__(self, context: SourceContext):
        context.check_batch()
        super().__init__(context)
        c = context.config
        self.max_staleness = c.source.max_staleness
        self.admission = Admission(c.training.batch_size, c.source.max_staleness, c.algorithm.critic_warmup)
        self.cond = threading.Condition()
        self.buffer: list[Drawn] = []
        self.in_flight: dict[int, Drawn] = {}
        self.using: dict[int, int] = {}  # trajectory in flight → the version its current action is drawn by
        self.next_seq, self.version, self.name = 0, 0, None
        self.retry: list[int] = []  # sequence numbers pending at a checkpoint: drawn again first
        self.error: BaseException | None = None
        self.counts = {"received": 0, "admitted": 0, "dropped_stale": 0}
        self.stopped = False

    @classmethod
    def build(cls, context: SourceContext) -> RemoteAsyncSource:
        return cls(context)

    def _issue(self) -> None:
        """Requests while the admission rule has room (under the lock), with the newest adapter."""
        while not self.stopped:
            room = self.admission.room(len(self.buffer) + len(self.in_flight))
            if room <= 0:
                return
            if self.retry:
                seq = self.retry.pop(0)
            else:
                seq = self.next_seq
                self.next_seq += 1
            d = Drawn(self.order.id_at(seq), self.version, [], seq=seq, deadline=self.admission.deadline)
            self.in_flight[seq] = d
            self.using[seq] = self.version
            self.pool.submit(self._run, d, self.name)

    def _newest(self, seq: int) -> tuple[int, str]:
        """The adapter published last, for the next action of trajectory ``seq`` (kept loaded while it may use it)."""
        with self.cond:
            self.using[seq] = self.version
            return self.version, self.name

    def _run(self, slot: Drawn, name: str) -> None:
        try:
            drawn = self.draw(
                slot.task_id,
                slot.version,
                name,
                derived_seed(self.seed, slot.seq, "vllm-async"),
                slot.seq,
                newest=lambda: self._newest(slot.seq),
            )
            drawn.seq, drawn.deadline = slot.seq, slot.deadline
        except BaseException as error:  # the trainer's next_batch raises it
            with self.cond:
                self.error = self.error or error
                self.cond.notify_all()
            return
        with self.cond:
            self.in_flight.pop(slot.seq, None)
            self.using.pop(slot.seq, None)
            self.buffer.append(drawn)
            self.counts["received"] += 1
            self._issue()
            self.cond.notify_all()

    def next_batch(self, step: int, phase: str, policy_version: int) -> Batch:
        if self.name is None:
            self.name, self.version = self.fleet.publish(policy_version), policy_version
        started = time.perf_counter()
        with self.cond:
            self.admission.begin(step, phase, policy_version)
            self._issue()
            while True:
                if self.error is not None:
                    raise self.error
                pending = [d.deadline for d in self.in_flight.values()]
                chosen = self.admission.choose(self.buffer, pending)
                if chosen is not None:
                    break
                self.cond.wait(timeout=1.0)
            taken = {id(d) for d in chosen}
            self.buffer = [d for d in self.buffer if id(d) not in taken]
            self.admission.formed_batch(step)
            self.counts["admitted"] += len(chosen)
            versions = [d.version for d in chosen]  # each row's oldest
            needed = {d.version for d in self.buffer} | {d.version for d in self.in_flight.values()} | {self.version}
            needed |= set(self.using.values())  # the versions in-flight actions are drawn by
            needed |= {v for d in chosen for v in d.versions} | set(versions)  # the trainer may re-score under them
        self.fleet.release(needed)
        self.trajectories(chosen, policy_version, step)
        if self.episodes is not None:
            timeline.env_share([d.drawn[:3] for d in chosen if d.drawn is not None])
        info = {
            "admitted_total": self.counts["admitted"],
            "received_total": self.counts["received"],
            "waited_s": time.perf_counter() - started,
            "engine_versions": sorted({v for d in chosen for v in d.versions or versions}),
            "spanning_rows": sum(len(set(d.versions)) > 1 for d in chosen),
            "staleness_max": max(policy_version - v for v in versions),
            "engine_restarts_total": self.fleet.restarts,
        }
        return Batch(
            task_ids=[d.task_id for d in chosen],
            rollout=self.rollout(chosen),
            staleness=[policy_version - v for v in versions],
            info=info,
        )

    def after_update(self, policy_version: int) -> None:
        """The new adapter goes to every server; requests issued from now on use it, and the admission rule lets the
        fleet draw one batch further ahead."""
        name = self.fleet.publish(policy_version)
        with self.cond:
            self.name, self.version = name, policy_version
            self.admission.published(policy_version)
            self._issue()

    def state_dict(self) -> dict[str, Any]:
        with self.cond:
            pending = sorted({*(d.seq for d in self.buffer), *self.in_flight})
        return {"source": self.kind, "next_seq": self.next_seq, "pending": pending, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") != self.kind:
            raise ConfigError("--resume: the checkpoint was written by another rollout source; use a new --out")
        self.next_seq, self.retry = int(state["next_seq"]), [int(s) for s in state["pending"]]
        self.counts.update(state["counts"])

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        super().close()
