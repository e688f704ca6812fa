"""Calling user code (a ``--reward`` function, an ``--env`` environment) contained: whatever it raises, including
``SystemExit``, becomes one ``PluginError`` line naming the plug-in and the row, and a call that outlives its
timeout raises ``PluginTimeout`` for the caller to end that trajectory as cut and count it.

A call with a timeout runs on a daemon thread that no other call is using (idle ones are kept for the next call,
so a server grading every reply starts no thread per reply); one that never returns is abandoned there (Python
cannot stop a thread), so a plug-in that hangs costs a thread, not the run. ``KeyboardInterrupt`` is not
contained: Ctrl-C stops sao as it would without plug-ins.

Deliberately left out: processes (a plug-in that corrupts the interpreter is beyond containment), retries.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from sao.core.errors import SaoError
from sao.core.reading import preview


class PluginError(SaoError):
    """A plug-in raised, exited or returned what sao cannot use: one line naming it and the row."""


class PluginTimeout(Exception):
    """A plug-in call did not return within its timeout (the caller cuts and counts the trajectory)."""

    def __init__(self, plugin: str, row: str, timeout: float):
        super().__init__(f"{plugin} did not return within {timeout:g} s on {row}")
        self.plugin, self.row, self.timeout = plugin, row, timeout


def call(fn: Callable[..., Any], *args: Any, plugin: str, row: str, timeout: float = 0.0) -> Any:
    """``fn(*args)``; an exception or ``SystemExit`` from it is a ``PluginError`` naming ``plugin`` and ``row``,
    and with ``timeout`` > 0 a call still running after ``timeout`` seconds is a ``PluginTimeout``."""
    if timeout <= 0:
        return _contained(fn, args, plugin, row)
    outcome: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    def job() -> None:
        try:
            outcome.put((True, _contained(fn, args, plugin, row)))
        except BaseException as error:  # PluginError, or KeyboardInterrupt: handed to the caller's thread
            outcome.put((False, error))

    _WORKERS.run(job)
    try:
        ok, value = outcome.get(timeout=timeout)
    except queue.Empty:
        raise PluginTimeout(plugin, row, timeout) from None
    if not ok:
        raise value
    return value


class _Workers:
    """Daemon threads that run one job at a time. A job goes to an idle thread, or to a new one when none is idle;
    a thread whose job outlived its caller's timeout is busy until that job returns, so it is never handed a
    second one meanwhile. At most ``keep`` idle threads are kept; the rest end."""

    def __init__(self, keep: int = 32):
        self.keep = keep
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="sao-plugin", daemon=True).start()
        inbox.put(job)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            inbox.get()()
            with self._lock:
                if len(self._idle) >= self.keep:
                    return
                self._idle.append(inbox)


_WORKERS = _Workers()


def _contained(fn: Callable[..., Any], args: tuple[Any, ...], plugin: str, row: str) -> Any:
    try:
        return fn(*args)
    except (KeyboardInterrupt, PluginError, PluginTimeout):
        raise
    except BaseException as error:
        raise PluginError(failure(error, plugin, row)) from None


def failure(error: BaseException, plugin: str, row: str) -> str:
    """The one line for what ``plugin`` raised (or the ``sys.exit`` it called) on ``row``."""
    if isinstance(error, SystemExit):
        return f"{plugin} called sys.exit({preview(error.code)}) on {row}; a plug-in must return, not exit"
    return f"{plugin} raised {describe(error)} on {row}"


def describe(error: BaseException) -> str:
    """``Type: its first line`` (cut to 200 characters), for one-line messages."""
    first = (str(error).strip().splitlines() or [""])[0]
    first = first if len(first) <= 200 else first[:200] + "…"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


__all__ = ["PluginError", "PluginTimeout", "call", "describe", "failure"]
