"""Running ``sao serve``: the policy, the trace log, the adapter watcher and uvicorn, started and stopped together.

``Server.start()`` runs uvicorn in a thread on a socket bound here (port 0 picks a free one; ``.port`` says
which), ``Server.run()`` in the foreground until SIGINT/SIGTERM. ``ensure_serve_extra`` turns a missing
fastapi/uvicorn into one line that says how to install them.

Deliberately left out: TLS, authentication (the server binds 127.0.0.1 unless told otherwise), several
workers (one model, one lock).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from sao.core.config import Config
from sao.core.errors import ConfigError, SaoError


def ensure_serve_extra() -> None:
    """A ConfigError naming the install command when fastapi or uvicorn is missing."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"sao serve needs {' and '.join(missing)}: pip install 'sao[serve]'")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), or a one-line ConfigError: a port outside 0..65535,
    a host that is no address or name this machine resolves, an address in use or not this machine's."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"--port must be a whole number between 0 and 65535 (0 picks a free port), got {port!r}")
    if not isinstance(host, str) or not host or len(host) > 253 or any(c.isspace() for c in host):
        raise ConfigError(f"--host {host!r} is not a host name or an IP address; e.g. 127.0.0.1, ::1 or 0.0.0.0")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, ValueError) as error:
        why = getattr(error, "strerror", None) or str(error)
        raise ConfigError(
            f"--host {host}: not an address or a name this machine resolves ({why}); e.g. 127.0.0.1, ::1 or 0.0.0.0"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def served_adapter(
    adapter: str | os.PathLike[str] | None, watch: str | os.PathLike[str] | None
) -> tuple[Path, int] | None:
    """``--adapter DIR``: (its adapter folder, the policy version it holds); None without one. A folder holding no
    adapter, one that does not say its version, ``--adapter`` with ``--watch``, and ``--watch`` on a finished run
    that was trained without publishing (it never will) are one-line ConfigErrors, before any model loads."""
    from sao.model.artifacts import find_adapter_dir, policy_version

    if adapter is not None and watch is not None:
        raise ConfigError("--adapter serves one adapter, --watch every version a run publishes: give one of them")
    if watch is not None:
        never = never_publishes(Path(watch))
        if never:
            raise ConfigError(f"--watch {watch}: {never}; serve its trained adapter with --adapter {watch}")
        return None
    if adapter is None:
        return None
    folder = find_adapter_dir(adapter)
    version = policy_version(folder)
    if version is None and folder.parent.name == "published" and folder.name[1:].isdigit():
        version = int(folder.name[1:])  # RUN/published/vN, written before adapters recorded their version
    if version is None:
        raise ConfigError(
            f"--adapter {adapter}: {folder} does not record the policy version it holds (an adapter "
            "written by an older sao or another tool), which every trace must carry; serve its run "
            "with --watch RUN instead"
        )
    return folder, version


def never_publishes(run: Path) -> str | None:
    """Why a run folder will never publish an adapter for ``--watch``, or None: a run whose config.json says it
    neither publishes (--publish, --gate, --traces) nor has published anything."""
    from sao.core.config import Config, flatten, recorded
    from sao.core.io import read_json
    from sao.training.checkpoint import CONFIG_FILE, LATEST_FILE, PUBLISHED_DIR

    if (run / PUBLISHED_DIR / LATEST_FILE).exists():
        return None
    try:
        config = Config.load(**recorded(flatten(read_json(run / CONFIG_FILE)["config"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SaoError):
        return None  # no run there yet (the trainer may start later), or not one sao can read: watched as it is
    t = config.training
    if t.publish or t.gate != "off" or config.source.needs().get("publish"):
        return None
    return "that run was trained without --publish, so it publishes nothing to watch"


class Server:
    """The whole server: build it, ``start()`` (background) or ``run()`` (foreground), ``stop()``."""

    def __init__(
        self,
        config: Config,
        traces: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        watch: str | os.PathLike[str] | None = None,
        adapter: str | os.PathLike[str] | None = None,
        max_tokens: int | None = None,
        max_prompt_tokens: int = 4096,
        poll_interval: float = 0.5,
        say=print,
    ):
        ensure_serve_extra()
        from sao.serve.app import EndpointSettings, Service, create_app
        from sao.serve.served import AdapterWatcher, ServedPolicy
        from sao.serve.tracelog import TraceLog, check_free
        from sao.tasks import setup

        self.say = say
        max_tokens = max_tokens or config.rollout.max_new_tokens
        if max_tokens < 1 or max_prompt_tokens < 1:
            raise ConfigError("--max-tokens and --max-prompt-tokens must be >= 1")
        # Everything that can fail comes before the trace log is created: a failed start writes nothing.
        given = served_adapter(adapter, watch)  # a folder with no adapter, or a run that never publishes: now
        setup.preflight(config)  # the model's folder and --reward, before the model loads
        check_free(traces)  # a second server on the same log (by any name) stops here, before loading a model
        self.sock = listen(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.watcher: AdapterWatcher | None = None
        self.log: TraceLog | None = None
        try:
            if config.serve.upstream:  # vLLM draws; sao renders, logs, grades and loads the adapters
                from sao.serve.upstream import UpstreamPolicy

                self.policy = UpstreamPolicy(config, config.serve.upstream)
            else:
                device = config.model.device if config.model.device != "auto" else "cpu"
                self.policy = ServedPolicy(config, device=device)
            scorer = setup.scorer(config)  # a bad --reward fails here
            if given is not None:
                self.policy.take(*given)
            self.watcher = AdapterWatcher(self.policy, watch, interval=poll_interval, say=say) if watch else None
            if self.watcher is not None and not self.watcher.poll():  # the latest published version from the start
                say(f"sao serve: {watch} has published nothing yet: serving the base model (v0) until it does")
            settings = EndpointSettings(
                model_name=f"sao-{name}" if (name := config.model.name).startswith("tiny") else name,
                max_tokens=max_tokens,
                default_temperature=config.rollout.temperature,
                max_prompt_tokens=max_prompt_tokens,
                needs_answer=config.data.reward is None,
                context_length=getattr(self.policy, "context_length", None),
            )
            self.log = TraceLog(traces)
            self.service = Service(self.policy, self.log, settings, scorer)
            self.app = create_app(self.service)
        except BaseException:
            self.sock.close()
            if self.log is not None:
                self.log.close()
            raise
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def describe(self) -> str:
        log = self.log
        extra = f", cut a torn last line of {log.torn_bytes} bytes" if log.torn_bytes else ""
        extra += f", {log.bad_lines} unreadable lines skipped" if log.bad_lines else ""
        return (
            f"sao serve: {self.service.settings.model_name} with adapter v{self.policy.version} on {self.url} "
            f"(trace log {log.path}: {log.records} trajectories{extra})"
        )

    def _make_uvicorn(self):
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_keep_alive=5,
                                limit_concurrency=self.service.settings.max_waiting + 64,
                                lifespan="off")  # fmt: skip  # above max_waiting: the JSON 503 fires first
        self._uvicorn = uvicorn.Server(config)
        return self._uvicorn

    def run(self) -> None:
        """Serve in the foreground until SIGINT or SIGTERM."""
        server = self._make_uvicorn()
        if self.watcher is not None:
            self.watcher.start()
        try:
            server.run(sockets=[self.sock])
        finally:
            self.close()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve from a background thread (tests, notebooks); returns once it accepts connections."""
        server = self._make_uvicorn()
        if self.watcher is not None:
            self.watcher.start()
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not server.started:
            self.stop()
            raise RuntimeError(f"sao serve did not start within {timeout} s")
        return self

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.close()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        self.sock.close()
        if self.log is not None:
            self.log.close()


def serve(config: Config, traces: str | Path, *, host: str, host_given: bool, port: int, **options: Any) -> int:
    """``sao serve``: refuse nothing loopback, warn about anything else, then serve until interrupted."""
    if not is_loopback(host) and not host_given:
        raise ConfigError(f"refusing to listen on {host}: pass --host explicitly to serve beyond this machine")
    server = Server(config, traces, host=host, port=port, **options)  # a bad host or port fails here
    if not is_loopback(host):
        print(
            f"sao serve: warning: listening on {host}, not loopback: anyone who can reach this port can sample "
            "from the model and write to the trace log (there is no authentication)"
        )
    print(server.describe(), flush=True)
    server.run()
    return 0


__all__ = ["Server", "ensure_serve_extra", "is_loopback", "serve"]
