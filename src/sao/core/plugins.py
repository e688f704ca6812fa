"""Calling user code (a ``--reward`` function, an ``--env`` environment) contained: whatever it raises, including
``SystemExit``, becomes one ``PluginError`` line naming the plug-in and the row, and a call that outlives its
timeout raises ``PluginTimeout`` for the caller to end that trajectory as cut and count it.

A call with a timeout runs on a daemon thread that no other call is using (idle ones are kept for the next call,
so a server grading every reply starts no thread per reply); one that never returns is abandoned there (Python
cannot stop a thread, and a daemon thread never keeps the process alive past the run), so a plug-in that hangs
costs a thread, not the run. ``call_each`` calls one plug-in for many rows at once, bounded, so that a plug-in that
hangs on every row costs its timeout once per batch, not once per row. ``KeyboardInterrupt`` is not contained:
Ctrl-C stops sao as it would without plug-ins.

Deliberately left out: processes (a plug-in that corrupts the interpreter is beyond containment), retries.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
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


def call_each(
    fn: Callable[[Any], Any],
    items: Sequence[Any],
    *,
    plugin: str,
    rows: Sequence[str],
    timeout: float = 0.0,
    concurrency: int = 16,
) -> list[Any]:
    """``fn(item)`` for every item, at most ``concurrency`` at once, the results in item order. A call past ``timeout``
    seconds (counted from when it started; 0: no limit) is abandoned and its place holds a ``PluginTimeout``; once one
    has timed out, the items not yet started are given up the same way (every worker may be held by a hung call: a
    batch pays its timeout once, not once per row). What a call raises or its ``sys.exit`` is a ``PluginError`` naming
    ``plugin`` and the row (``rows[i]``): no further call is started, and the first in item order is raised once the
    calls in flight have ended or timed out. With ``concurrency`` 1 and no timeout the calls run here, in order."""
    if len(rows) != len(items):
        raise ValueError(f"{len(rows)} row names for {len(items)} items")
    if concurrency <= 1 and timeout <= 0:
        return [call(fn, item, plugin=plugin, row=row) for item, row in zip(items, rows, strict=True)]
    results: list[Any] = [None] * len(items)
    outcome: queue.SimpleQueue[tuple[int, bool, Any]] = queue.SimpleQueue()
    running: dict[int, float] = {}  # item → when its call started
    started, stop = 0, False

    def job(i: int) -> None:
        try:
            outcome.put((i, True, _contained(fn, (items[i],), plugin, rows[i])))
        except BaseException as error:  # PluginError, or KeyboardInterrupt: handed to the caller's thread
            outcome.put((i, False, error))

    while True:
        while not stop and started < len(items) and len(running) < max(concurrency, 1):
            running[started] = time.monotonic()
            _WORKERS.run(lambda i=started: job(i))
            started += 1
        if not running:
            break
        wait = None if timeout <= 0 else max(0.0, min(running.values()) + timeout - time.monotonic())
        try:
            i, ok, value = outcome.get(timeout=wait)
        except queue.Empty:  # the oldest calls are past their deadline: abandoned, and the rest given up
            now = time.monotonic()
            for i in [i for i, began in running.items() if now - began >= timeout]:
                del running[i]
                results[i] = PluginTimeout(plugin, rows[i], timeout)
            stop = True
            continue
        if i not in running:  # the late answer of a call already abandoned
            continue
        del running[i]
        if not ok and not isinstance(value, PluginError):
            raise value  # KeyboardInterrupt
        results[i] = value
        stop = stop or not ok
    for i in range(started, len(items)):
        results[i] = PluginTimeout(plugin, rows[i], timeout)
    failed = next((r for r in results if isinstance(r, PluginError)), None)
    if failed is not None:
        raise failed
    return results


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


__all__ = ["PluginError", "PluginTimeout", "call", "call_each", "describe", "failure"]
