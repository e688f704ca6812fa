"""vLLM as a rollout engine: start its OpenAI-compatible server in its own venv and process, and talk to it over HTTP.

    VllmServer     ``PYTHON -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 and a free port, float32, LoRA on
                   (runtime loading allowed), ``--logprobs-mode processed_logprobs`` so that each recorded log-prob is
                   log_softmax(logits / T) at the sampled token, the footing sao's ratio needs; stdout and stderr go
                   to a log file; ``start`` waits for ``/health``; ``stop`` ends the whole process group
    VllmClient     ``/health``, ``/v1/models``, runtime adapter load / unload, and ``complete``: a token-id prompt in,
                   token ids and one log-prob per completion token out, every reply checked, each call within its
                   ``timeout`` (connect, headers and body) and its reply within a size bound; the development
                   routes a full-weight reload goes through (``sao.rollout.vllm_weights`` strings them together)
    complete_many  many completions at once from a bounded pool of threads (vLLM batches them continuously)

Only the standard library is imported here: vLLM pins its own torch and transformers, so it lives in a venv of its
own (``make install-vllm``) and never in sao's process. Deliberately left out: chat completions and text prompts
(the caller owns the chat template and the token ids), streaming, top-k log-probs, ``n > 1``, multi-GPU options,
and any check of a server this module did not start (a server started with the default ``raw_logprobs`` returns
pre-temperature log-probs, and no reply says so).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import ipaddress
import json
import math
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sao.core.errors import ConfigError, DataError, SaoError
from sao.core.reading import Limits, parse_json
from sao.rollout.engines import Completion

VLLM_VENV = ".venv-vllm"
# Options that trade run-time speed for start-up time, by name (``VllmServer(compile_mode=...)``).
COMPILE_MODES: dict[str, tuple[str, ...]] = {
    "eager": ("--enforce-eager",),  # no torch.compile, no graphs: the fastest start
    "O0": ("-O0",),
    "default": (),  # vLLM's -O2: torch.compile warm-up on the first start, a compile cache after that
}
FINISH_REASONS = ("stop", "length")
REPLY_LIMITS = Limits(max_bytes=256 << 20)  # a reply of the vLLM server: token ids and log-probs of a batch
MAX_REPLY_BYTES = 16 << 20  # the most a reply other than a completion may hold (a model list, an error)
REPLY_BYTES_PER_TOKEN = 4 << 10  # a completion's reply: its prompt echoed, and each token's id, text and log-prob


class VllmError(SaoError):
    """The vLLM server could not be started, reached, or refused a request; the message is one line. ``status``: the
    HTTP status of a refusal (None when there was no reply)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _Late(Exception):
    """A call ran past its deadline (the watchdog closed its socket)."""


class _Watchdog:
    """Ends a call at its deadline whatever it is waiting for (connect, headers, a body that trickles): the socket
    is shut down, so the read that blocks returns at once."""

    def __init__(self, connection: http.client.HTTPConnection, seconds: float):
        self.connection, self.fired = connection, False
        self.timer = threading.Timer(max(seconds, 0.0), self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self.connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self.timer.cancel()


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def default_vllm_python() -> Path | None:
    """``.venv-vllm/bin/python`` in the current folder or next to this checkout (``make install-vllm``), if present."""
    repo = Path(__file__).resolve().parents[3]
    for root in (Path.cwd(), repo):
        python = root / VLLM_VENV / "bin" / "python"
        if python.is_file():
            return python
    return None


def check_vllm_python(python: str | os.PathLike[str] | None) -> str:
    """The vLLM version that ``python`` imports; a one-line ``ConfigError`` when it is missing or has no vLLM."""
    if python is None:
        raise ConfigError(f"no --vllm-python given and no {VLLM_VENV}/bin/python here; run make install-vllm")
    python = Path(python)
    if not python.is_file():
        raise ConfigError(f"--vllm-python {python} does not exist; run make install-vllm or pass a Python with vLLM")
    # Found and versioned without importing it (importing vllm takes 10-40 s on a busy CPU); a broken install
    # still fails at start, with the reason in the server's log.
    probe = (
        "import importlib.util as u, importlib.metadata as m\n"
        "assert u.find_spec('vllm') is not None, 'No module named vllm'\n"
        "print(m.version(m.packages_distributions()['vllm'][0]))"
    )
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ConfigError(f"--vllm-python {python} could not be run ({_one_line(error)})") from None
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise ConfigError(f"--vllm-python {python} has no vLLM ({_one_line(last)}); run make install-vllm")
    return done.stdout.strip()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def log_tail(path: str | os.PathLike[str], lines: int = 3) -> str:
    """The last non-empty ``lines`` lines of a log file, joined with " | " (empty when unreadable)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


# ---------------------------------------------------------------------------------------------------------------
# The client


class VllmClient:
    """A client for one vLLM OpenAI-compatible server at ``url``.

    Every request retries connection failures until ``connect_deadline`` seconds have passed since it began, then
    raises one ``VllmError`` naming the URL. ``timeout`` bounds each attempt as a whole: connecting, the headers and
    the whole body (a server that accepts and never answers, or answers a byte at a time, is given up on then, with
    one line, never retried); a reply is read to a bound on its size (``MAX_REPLY_BYTES``, more for a completion in
    proportion to its tokens), never whole when it is endless. ``setting``: the flag that sets ``timeout``, named in
    that line. ``alive`` (a server sao started): once it says the process is gone, a connection failure is raised at
    once instead of waited out. Each thread keeps its connection open between requests (HTTP keep-alive: no connect
    per completion). No proxy is ever used (the server is local), whatever the environment says.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 300.0,
        connect_deadline: float = 30.0,
        alive: Callable[[], bool] | None = None,
        setting: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.setting = setting
        self.connect_deadline = connect_deadline
        self.alive = alive
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"vLLM address {url!r} is not an http:// or https:// URL")
        self._https, self._host, self._port, self._prefix = (
            parts.scheme == "https",
            parts.hostname,
            parts.port,
            parts.path.rstrip("/"),
        )
        self._local = threading.local()  # each thread keeps one connection open to the server (HTTP keep-alive)

    @property
    def local(self) -> bool:
        """Whether the server is on this machine (a loopback address): only then does it see this machine's files."""
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(self._host).is_loopback
        return self._host == "localhost"

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            connection = self._local.connection = kind(self._host, self._port, timeout=self.timeout)
        return connection

    def _drop_connection(self) -> None:
        connection, self._local.connection = getattr(self._local, "connection", None), None
        if connection is not None:
            connection.close()

    def _exchange(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str], limit: int
    ) -> tuple[int, bytes]:
        """One request on this thread's connection, connecting, sending and reading the whole reply within
        ``timeout`` seconds (``_Late`` past it) and at most ``limit`` bytes of body. A connection the server closed
        while it lay idle (its keep-alive ran out) fails before any reply: that is tried once more on a new one."""
        for attempt in (0, 1):
            connection = self._connection()
            reused = connection.sock is not None
            connection.timeout = self.timeout  # a fresh connection's connect; the watchdog bounds the whole call
            if reused:
                connection.sock.settimeout(self.timeout)
            watchdog = _Watchdog(connection, self.timeout)
            try:
                connection.request(method, self._prefix + path, body=data, headers=headers)
                response = connection.getresponse()
                status, raw = response.status, self._body(response, path, limit)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop_connection()
                if watchdog.fired:
                    raise _Late() from None
                if reused and attempt == 0:
                    continue
                raise
            except (OSError, http.client.HTTPException) as error:
                connected = connection.sock is not None  # a timeout after connecting: the server is there, silent
                self._drop_connection()
                if watchdog.fired or (isinstance(error, TimeoutError) and connected):
                    raise _Late() from None
                if isinstance(error, http.client.HTTPException):  # garbage where a status line or body should be
                    raise VllmError(
                        f"vLLM server at {self.url} sent a malformed reply to {path} "
                        f"({_one_line(repr(error))}); is it a vLLM server?"
                    ) from None
                raise
            except BaseException:
                self._drop_connection()
                raise
            finally:
                watchdog.cancel()
            if watchdog.fired:  # the reply ended because its socket was closed at the deadline
                self._drop_connection()
                raise _Late()
            if response.will_close:
                self._drop_connection()
            return status, raw
        raise AssertionError("unreachable")

    def _body(self, response: http.client.HTTPResponse, path: str, limit: int) -> bytes:
        """The reply's body, read in pieces up to ``limit`` bytes: a longer one (or one that says it is) is one line,
        never held whole."""
        declared = response.length
        if declared is not None and declared > limit:
            raise VllmError(
                f"vLLM server at {self.url} sent a reply of {declared} bytes to {path}, more than the "
                f"{limit} bytes such a reply can need; is it a vLLM server?"
            )
        pieces, size = [], 0
        while True:
            piece = response.read(1 << 16)
            if not piece:
                return b"".join(pieces)
            size += len(piece)
            if size > limit:
                self._drop_connection()
                raise VllmError(
                    f"vLLM server at {self.url} sent a reply to {path} longer than the {limit} bytes such "
                    "a reply can need; is it a vLLM server?"
                )
            pieces.append(piece)

    def _late(self, path: str) -> VllmError:
        flag = f" ({self.setting})" if self.setting else ""
        return VllmError(
            f"vLLM server at {self.url} did not answer {path} within {self.timeout:g} s{flag}; is it "
            "overloaded or stuck?"
        )

    def _request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        deadline: float | None = None,
        limit: int = MAX_REPLY_BYTES,
    ) -> tuple[int, Any]:
        """(status, decoded JSON or text). HTTP error statuses are returned; connection failures are retried; a call
        past ``timeout`` is one ``VllmError``, not retried (the server got the request)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        wait = self.connect_deadline if deadline is None else deadline
        give_up, pause = time.monotonic() + wait, 0.1
        while True:
            try:
                status, raw = self._exchange(method, path, data, headers, limit)
                break
            except _Late:
                raise self._late(path) from None
            except OSError as error:  # refused, reset, timed out, unresolvable: the server is not (yet) there
                reason = error
                if self.alive is not None and not self.alive():
                    raise VllmError(f"vLLM server at {self.url} has exited ({_one_line(reason)})") from None
                if time.monotonic() + pause > give_up:
                    raise VllmError(
                        f"vLLM server at {self.url} unreachable for {wait:g} s ({_one_line(reason)}); is it running?"
                    ) from None
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
        text = raw.decode("utf-8", errors="replace")
        try:  # the bounded reader: a reply cannot nest or grow without limit
            return status, parse_json(text, where=self.url, limits=REPLY_LIMITS) if text else None
        except DataError:
            return status, text

    @staticmethod
    def _reason(reply: Any) -> str:
        """vLLM's own words from an error reply ({"error": {"message": ...}} or FastAPI's {"detail": ...})."""
        if isinstance(reply, dict):
            error = reply.get("error")
            if isinstance(error, dict) and error.get("message"):
                return _one_line(error["message"])
            if "detail" in reply:
                return _one_line(json.dumps(reply["detail"]))
        return _one_line(reply if isinstance(reply, str) else json.dumps(reply))

    def health(self, *, deadline: float | None = None) -> bool:
        """True when ``/health`` answers 200, False for any other status; unreachable after ``deadline`` raises."""
        status, _ = self._request("GET", "/health", deadline=deadline)
        return status == 200

    def models(self) -> list[str]:
        """The names the server answers to: the base model (its path or ``--served-model-name``), then adapters."""
        status, reply = self._request("GET", "/v1/models")
        if status != 200:
            raise VllmError(f"vLLM server at {self.url} refused /v1/models: {self._reason(reply)}", status)
        try:
            names = [str(card["id"]) for card in reply["data"]]
        except (KeyError, TypeError) as error:
            raise DataError(f"vLLM /v1/models reply has no data[].id ({_one_line(error)})") from None
        if not names:
            raise VllmError(
                f"vLLM server at {self.url} lists no model (/v1/models is empty); start it with --model, "
                "or wait until it has loaded one"
            )
        return names

    def load_adapter(self, name: str, path: str | os.PathLike[str], *, load_inplace: bool = False) -> None:
        """Load a PEFT adapter folder under ``name`` (``load_inplace``: replace the weights of a loaded ``name``).

        vLLM keys its prefix cache by adapter name *and path*: reload changed weights from a new folder, never by
        overwriting the folder a name was loaded from, or cached prompt blocks of the old weights are reused.
        A refusal (rank above ``--max-lora-rank``, a missing folder, a name already loaded) is one ``VllmError``
        with vLLM's reason."""
        body = {"lora_name": name, "lora_path": os.fspath(path), "load_inplace": bool(load_inplace)}
        status, reply = self._request("POST", "/v1/load_lora_adapter", body)
        if status != 200:
            where = "" if self.local else " (the server reads it on its own node: is it on a filesystem both share?)"
            raise VllmError(
                f"vLLM refused to load adapter {name!r} from {os.fspath(path)}: {self._reason(reply)}{where}", status
            )

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``; one ``VllmError`` with vLLM's reason when it is not loaded."""
        status, reply = self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if status != 200:
            raise VllmError(f"vLLM refused to unload adapter {name!r}: {self._reason(reply)}", status)

    def complete(
        self,
        prompt_token_ids: Sequence[int],
        *,
        model: str,
        max_tokens: int,
        temperature: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> Completion:
        """One completion of a token-id prompt by ``model`` (the base model's name or an adapter's), checked.

        Plain sampling at ``temperature``: top-p 1, top-k off, min-p 0 and no penalties are sent explicitly, so that
        a ``generation_config.json`` in the model folder cannot change the distribution the log-probs describe."""
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ConfigError("a completion needs a non-empty prompt")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1 (got {max_tokens})")
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,
            "stop_token_ids": [int(t) for t in stop_token_ids],
            "ignore_eos": bool(ignore_eos),
        }
        if seed is not None:
            body["seed"] = int(seed)
        limit = MAX_REPLY_BYTES + REPLY_BYTES_PER_TOKEN * (len(prompt) + int(max_tokens))
        status, reply = self._request("POST", "/v1/completions", body, limit=limit)
        if status != 200:
            raise VllmError(f"vLLM refused a completion for {model!r}: {self._reason(reply)}", status)
        return parse_completion(reply, prompt, max_tokens=int(max_tokens))

    # -- full weights: vLLM's development routes (the server runs with VLLM_SERVER_DEV_MODE=1) ---------------
    # sao.rollout.vllm_weights.load_weights strings these together; each is one request, a refusal one VllmError.

    def _dev(self, method: str, path: str, body: Mapping[str, Any] | None, what: str) -> Any:
        status, reply = self._request(method, path, body)
        if status == 404:
            raise VllmError(
                f"vLLM server at {self.url} has no {path.split('?')[0]} route: start it with VLLM_SERVER_DEV_MODE=1 "
                "(full weights are reloaded through its development routes)"
            )
        if status != 200:
            raise VllmError(f"vLLM server at {self.url} refused to {what}: {self._reason(reply)}")
        return reply

    def pause(self) -> None:
        """Stop scheduling: requests in flight finish first, new ones wait in the queue until ``resume``."""
        self._dev("POST", "/pause?mode=wait&clear_cache=true", None, "pause")

    def resume(self) -> None:
        self._dev("POST", "/resume", None, "resume")

    def reload_weights(self, folder: str | os.PathLike[str]) -> None:
        """Every worker reloads its weights in place from the safetensors in ``folder`` (a path the server reads)."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": os.fspath(folder)}}
        self._dev("POST", "/collective_rpc", body, f"reload weights from {os.fspath(folder)}")

    def reset_prefix_cache(self, *, attempts: int = 20) -> None:
        """Drop every cached prompt block (they hold keys and values computed by the previous weights). vLLM says
        ``success: false`` while a request still holds blocks: tried again for a while, then one VllmError."""
        for _ in range(attempts):
            reply = self._dev("POST", "/reset_prefix_cache", None, "reset its prefix cache")
            if not isinstance(reply, dict) or reply.get("success", True):
                return
            time.sleep(0.1)
        raise VllmError(f"vLLM server at {self.url} kept its prefix cache after {attempts} tries (blocks held)")

    def set_weight_version(self, version: str) -> None:
        self._dev("POST", "/update_weight_version", {"new_version": str(version)}, "tag its weight version")

    def weight_version(self) -> str:
        """The version tag of the weights the server holds ("default" until one is set)."""
        reply = self._dev("GET", "/weight_info", None, "say its weight version")
        if not isinstance(reply, dict) or not isinstance(reply.get("weight_version"), str):
            raise DataError(f"vLLM /weight_info reply has no weight_version ({_one_line(json.dumps(reply))})")
        return reply["weight_version"]

    def weight_checksums(self) -> dict[str, str]:
        """sha256 of each parameter's bytes as the server holds it, keyed ``dp:pp:pcp:tp:`` rank prefix + name."""
        reply = self._dev("POST", "/weight_checker", {"action": "checksum"}, "checksum its weights")
        checksums = reply.get("checksums") if isinstance(reply, dict) else None
        if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
            raise DataError(f"vLLM /weight_checker reply has no checksums ({_one_line(json.dumps(reply))})")
        return {str(k): v for k, v in checksums.items()}


def parse_completion(reply: Any, prompt_token_ids: Sequence[int], *, max_tokens: int) -> Completion:
    """Check a ``/v1/completions`` reply and return its one choice; any violation is a one-line ``DataError``."""

    def bad(what: str) -> DataError:
        return DataError(f"vLLM completion reply {what}")

    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise bad(f"has {len(choices) if isinstance(choices, list) else 'no'} choices; expected exactly 1")
    choice = choices[0]
    echoed, token_ids = choice.get("prompt_token_ids"), choice.get("token_ids")
    if not isinstance(echoed, list) or not all(type(t) is int for t in echoed):
        raise bad("has no prompt_token_ids (return_token_ids is needed: vLLM >= 0.10)")
    if echoed != list(prompt_token_ids):
        first = next((i for i, (a, b) in enumerate(zip(echoed, prompt_token_ids, strict=False)) if a != b), None)
        where = f"first differs at position {first}" if first is not None else "lengths differ"
        raise bad(f"echoes {len(echoed)} prompt token ids for the {len(prompt_token_ids)} sent ({where})")
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        raise bad("has no completion token_ids")
    if not token_ids or len(token_ids) > max_tokens:
        raise bad(f"has {len(token_ids)} completion tokens; expected 1..{max_tokens}")
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list):
        raise bad("has no logprobs.token_logprobs (send logprobs: 0)")
    if len(values) != len(token_ids):
        raise bad(f"has {len(values)} log-probs for {len(token_ids)} completion tokens")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value > 1e-6:
            raise bad(f"log-prob {i} is {value!r}; expected a finite number <= 0")
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise bad(f"finish_reason is {finish!r}; expected one of {list(FINISH_REASONS)}")
    if finish == "length" and len(token_ids) != max_tokens:
        raise bad(f"finished by length after {len(token_ids)} of max_tokens {max_tokens} tokens")
    text = choice.get("text")
    return Completion(
        prompt_token_ids=echoed,
        completion_token_ids=token_ids,
        sampler_logprobs=[float(v) for v in values],
        finish_reason=finish,
        text=text if isinstance(text, str) else "",
    )


def complete_many(
    client: VllmClient,
    prompts: Sequence[Sequence[int]],
    *,
    seeds: Sequence[int] | None = None,
    max_concurrency: int = 16,
    **params: Any,
) -> list[Completion]:
    """``client.complete`` for every prompt at once from at most ``max_concurrency`` threads; results in prompt
    order. ``seeds[i]`` seeds prompt i; ``params`` (model, max_tokens, temperature, ...) go to every request.
    On the first failure the requests not yet sent are cancelled, and it is raised once those in flight finish."""
    if seeds is not None and len(seeds) != len(prompts):
        raise ConfigError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    if max_concurrency < 1:
        raise ConfigError(f"max_concurrency must be >= 1 (got {max_concurrency})")

    def one(i: int) -> Completion:
        return client.complete(prompts[i], seed=None if seeds is None else seeds[i], **params)

    with ThreadPoolExecutor(max_workers=min(max_concurrency, max(1, len(prompts)))) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        try:
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


# ---------------------------------------------------------------------------------------------------------------
# The server


class VllmServer:
    """One vLLM OpenAI-compatible server process serving ``model`` (a ``save_pretrained`` folder) on 127.0.0.1.

    ``compile_mode`` picks the start-up trade (``COMPILE_MODES``). On the CPU build vLLM turns torch.compile off
    whenever LoRA is enabled, so all modes start alike there; "eager" says so explicitly and also skips the JIT
    kernel warm-up. The start is spent importing vLLM in each of its processes (API server, engine core, model
    worker). ``in_process_worker`` runs the worker inside the engine core (``--distributed-executor-backend uni``
    with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): one import fewer, but vLLM's CPU thread binding is skipped (its own
    code calls that path unsupported on the CPU) and decoding was slower; for short-lived test servers only.
    ``lora_modules`` maps names to adapter folders loaded at start; more can be loaded at run time. ``dev_mode``
    turns on vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/pause``,
    ``/update_weight_version``, ``/weight_checker``, ...), which the full-weight sync needs; anyone who can reach the
    port can then call any worker method, so keep such a server on 127.0.0.1 or a private network. The process and
    its engine-core child share a new process group, which ``stop`` ends (SIGTERM, then SIGKILL after ``grace``
    seconds); ``stop`` is also registered with ``atexit``. Use as a context manager or call ``start``/``stop``.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        python: str | os.PathLike[str] | None = None,
        max_model_len: int = 512,
        max_lora_rank: int = 16,
        max_loras: int = 2,
        seed: int = 0,
        compile_mode: str = "eager",
        lora_modules: Mapping[str, str | os.PathLike[str]] | None = None,
        kvcache_gib: int = 1,
        in_process_worker: bool = False,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 300.0,
        grace: float = 10.0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        dev_mode: bool = False,
    ):
        if compile_mode not in COMPILE_MODES:
            raise ConfigError(f"compile_mode {compile_mode!r} is not one of {sorted(COMPILE_MODES)}")
        self.model = Path(model)
        self.python = Path(python) if python is not None else default_vllm_python()
        self.max_model_len, self.max_lora_rank, self.max_loras = max_model_len, max_lora_rank, max_loras
        self.seed = seed
        self.compile_mode = compile_mode
        self.lora_modules = {str(k): os.fspath(v) for k, v in (lora_modules or {}).items()}
        self.kvcache_gib = kvcache_gib
        self.in_process_worker = in_process_worker
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout, self.grace = startup_timeout, grace
        self.extra_args, self.env = tuple(extra_args), dict(env or {})
        self.dev_mode = dev_mode
        self.host, self.port = "127.0.0.1", 0
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self.version: str | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def command(self) -> list[str]:
        """The command line that starts the server (the port is chosen by ``start``)."""
        args = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(self.max_model_len),
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--logprobs-mode",
            "processed_logprobs",
            "--seed",
            str(self.seed),
            "--disable-uvicorn-access-log",
            # Whole prefills: vLLM 0.32's CPU worker crashes its engine ("CPU Generator does not use offset") when a
            # seeded request's prefill is split across steps, which 64 seeded ~45-token prompts already cause under
            # the default 2048-token step budget. Every request sao sends is seeded.
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(max(2048, self.max_model_len)),
            *COMPILE_MODES[self.compile_mode],
        ]
        if self.in_process_worker:
            args += ["--distributed-executor-backend", "uni"]
        if self.lora_modules:
            args += ["--lora-modules", *(f"{name}={path}" for name, path in self.lora_modules.items())]
        return args + list(self.extra_args)

    def client(self, **kwargs: Any) -> VllmClient:
        """A ``VllmClient`` for this server; a request to it stops waiting as soon as the process has exited."""
        return VllmClient(self.url, alive=self.running, **kwargs)

    def running(self) -> bool:
        """Whether the server process started here is still running."""
        process = self.process
        return process is not None and process.poll() is None

    def start(self) -> VllmServer:
        """Start the server and wait until ``/health`` answers 200; a one-line ``VllmError`` with the log's last lines
        when it exits or is not up within ``startup_timeout`` seconds (it is stopped then)."""
        with self._lock:
            if self.process is not None and self.process.poll() is None:
                return self
            if not self.model.is_dir():
                raise ConfigError(f"vLLM model {self.model} is not a folder; pass a save_pretrained folder")
            self.version = check_vllm_python(self.python)
            self.port = free_port(self.host)
            if self.log_path is None:
                handle, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
                os.close(handle)
                self.log_path = Path(name)
            env = {
                **os.environ,
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                "VLLM_CPU_KVCACHE_SPACE": str(int(self.kvcache_gib)),  # vLLM reads an int (GiB)
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",  # a local folder: never ask a hub
                **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.in_process_worker else {}),
                **({"VLLM_SERVER_DEV_MODE": "1"} if self.dev_mode else {}),
                **self.env,
            }
            began = time.monotonic()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    self.command(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own process group: stop() ends the engine core child too
                )
            atexit.register(self.stop)
        probe = VllmClient(self.url, timeout=5.0, connect_deadline=0.0)
        while True:
            code = self.process.poll()
            if code is not None:
                self.stop()
                raise VllmError(
                    f"vLLM server exited with code {code} while starting; log {self.log_path}: "
                    f"{log_tail(self.log_path)}"
                )
            elapsed = time.monotonic() - began
            if elapsed > self.startup_timeout:
                self.stop()
                raise VllmError(
                    f"vLLM server not up after {self.startup_timeout:g} s; log {self.log_path}: "
                    f"{log_tail(self.log_path)}"
                )
            with contextlib.suppress(VllmError):
                if probe.health(deadline=0.0):
                    self.startup_seconds = elapsed
                    return self
            time.sleep(0.5)

    def stop(self) -> None:
        """End the server: SIGTERM to its process group (and to any descendant that left it), SIGKILL to whatever is
        left after ``grace`` seconds. Safe to call twice."""
        with self._lock:
            process, self.process = self.process, None
            atexit.unregister(self.stop)
        if process is None:
            return
        group = process.pid  # start_new_session: the group id is the server's pid
        tree = process_tree(process.pid)  # the API process, its engine core and helpers
        for send in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, send)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, send)
            give_up = time.monotonic() + self.grace
            while time.monotonic() < give_up:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=0.1)  # reap the API process as soon as it exits
                if not group_alive(group) and not any(alive(pid) for pid in tree):
                    return
                time.sleep(0.1)

    def restart(self) -> VllmServer:
        """Stop, then start again (on a new free port; runtime-loaded adapters are gone, ``lora_modules`` are not)."""
        self.stop()
        return self.start()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _proc_stats() -> list[tuple[int, str, int, int]]:
    """(pid, state, ppid, pgrp) of every process in /proc (empty where there is no /proc)."""
    stats = []
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats.append((int(entry.name), fields[0], int(fields[1]), int(fields[2])))
            except (OSError, IndexError, ValueError):
                continue
    return stats


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every running descendant of it."""
    children: dict[int, list[int]] = {}
    for child, state, parent, _ in _proc_stats():
        if state not in ("Z", "X"):
            children.setdefault(parent, []).append(child)
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def group_alive(group: int) -> bool:
    """Whether any process of process group ``group`` is still running (zombies count as gone)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stats = _proc_stats()
    return not stats or any(pgrp == group and state not in ("Z", "X") for _, state, _, pgrp in stats)
