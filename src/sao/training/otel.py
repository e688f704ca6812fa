"""OpenTelemetry for a run, opt-in (``pip install 'sao[otel]'``): each step as a tree of ``rl.*`` spans.

    rl.loop            one step: the run, the step, the policy version it trains from and its staleness
      rl.sample        asking the source for the batch (rl.sample.draw, rl.sample.env: drawing here, and of it
                       waiting on environment calls); an rl.trajectory per row under it, with its version and staleness
      rl.reward        the scorer
      rl.train         the pass, the checks, the update and the critic steps (``rl.phase`` says which)
      rl.sync          publishing the adapter (rl.eval under it when the gate evaluates)
      rl.eval          an evaluation after the step (--eval-every)

The spans are made from the timeline's events once the step is durable, with the times recorded, and the SDK's batch
processor sends them in the background: a collector that cannot be reached costs one warning, and what it did not
take is dropped and counted (said when the run closes). ``endpoint`` reads --otel-endpoint, or the standard
OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variables. Deliberately left out: metrics, logs, and carrying a trace context
into Ray workers or vLLM servers (their spans are in timeline.json).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sao.core.errors import ConfigError

if TYPE_CHECKING:
    from sao.core.config import Config

SPAN_NAMES = {
    "wait": "rl.sample",
    "draw": "rl.sample.draw",
    "env": "rl.sample.env",
    "score": "rl.reward",
    "pass": "rl.train",
    "checks": "rl.train",
    "update": "rl.train",
    "critic": "rl.train",
    "publish": "rl.sync",
    "eval": "rl.eval",
    "stats": "rl.stats",
}
EXPORT_TIMEOUT_S = 5.0  # one export request at most (in the background)
RETRY_AFTER_S = 30.0  # after a failed export, batches are dropped (and counted) this long before the next try
INSTALL = "pip install 'sao[otel]'"


def endpoint(config: Config, environ: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(the OTLP/HTTP traces URL to send to, or None: off; where it came from, for messages)."""
    env = os.environ if environ is None else environ
    url = config.training.otel_endpoint
    if url is not None:
        url = url.strip()
        return (url if url.rstrip("/").endswith("/v1/traces") else url.rstrip("/") + "/v1/traces"), "--otel-endpoint"
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None, ""
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None, ""
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip(), "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip().rstrip("/") + "/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT"
    return None, ""


def sdk_missing() -> str | None:
    """Why the SDK cannot be used here (in words), or None when it can."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as error:
        return f"the OpenTelemetry SDK and its OTLP/HTTP exporter are not installed ({error.name}): {INSTALL}"
    return None


def check(config: Config) -> None:
    """--otel-endpoint without the SDK: a one-line ConfigError, before anything is loaded or written."""
    url, where = endpoint(config)
    missing = sdk_missing() if url is not None and where == "--otel-endpoint" else None
    if missing is not None:
        raise ConfigError(f"--otel-endpoint: {missing}")


def from_config(config: Config, warn: Callable[[str], None]) -> Telemetry | None:
    """The run's telemetry, or None when off. --otel-endpoint without the SDK is a ConfigError; OTEL_* variables
    without it (they may be set for other programs) a warning."""
    url, where = endpoint(config)
    if url is None:
        return None
    missing = sdk_missing()
    if missing is None:
        return Telemetry(url, warn=warn)
    if where == "--otel-endpoint":
        raise ConfigError(f"--otel-endpoint: {missing}")
    warn(f"{where} is set but {missing}; this run sends no spans")
    return None


class Telemetry:
    """Spans of each step, sent to ``url`` (or handed to ``exporter``: the SDK's in-memory one in a test)."""

    def __init__(self, url: str | None = None, *, exporter: Any = None, warn: Callable[[str], None] = print):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
        self.url = url or type(exporter).__name__
        self.exporter = _Counting(exporter, self.url, warn)
        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "sao"}
        self.provider = TracerProvider(resource=Resource.create(named))  # this run's own, not the global one
        self.processor = BatchSpanProcessor(self.exporter, schedule_delay_millis=1000)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("sao")
        self.ended = 0  # spans made

    def steps(self, run: str, events: list[dict[str, Any]]) -> None:
        """Each step span among ``events`` (a drain of the recorder) as an rl.loop tree."""
        from opentelemetry import trace

        for step in (e for e in events if e.get("cat") == "step"):
            args = step.get("args") or {}
            base = _attributes(
                {
                    "rl.run": run,
                    "rl.step": args.get("step"),
                    "rl.version": args.get("version"),
                    "rl.staleness": args.get("staleness"),
                }
            )
            root = self.tracer.start_span(
                "rl.loop", start_time=_ns(step["ts"]), attributes={**base, "rl.phase": args.get("phase") or ""}
            )
            opened: list[tuple[Any, float]] = [(root, step["ts"] + step["dur"])]  # (span, end in µs), outermost first
            mine = [e for e in events if (e.get("args") or {}).get("step") == args.get("step")]
            phases = sorted((e for e in mine if e.get("cat") == "phase"), key=lambda e: (e["ts"], -e["dur"]))
            sample = None
            for event in phases:
                while len(opened) > 1 and event["ts"] >= opened[-1][1]:
                    opened.pop()
                name = SPAN_NAMES.get(event["name"], f"rl.{event['name']}")
                span = self.tracer.start_span(
                    name,
                    context=trace.set_span_in_context(opened[-1][0]),
                    start_time=_ns(event["ts"]),
                    attributes={**base, "rl.phase": event["name"]},
                )
                span.end(end_time=_ns(event["ts"] + event["dur"]))
                self.ended += 1
                opened.append((span, event["ts"] + event["dur"]))
                sample = span if event["name"] == "wait" else sample
            for event in (e for e in mine if e.get("cat") == "trajectory"):
                extra = _attributes({f"rl.{k}": v for k, v in (event.get("args") or {}).items() if k != "step"})
                span = self.tracer.start_span(
                    "rl.trajectory",
                    context=trace.set_span_in_context(sample or root),
                    start_time=_ns(event["ts"]),
                    attributes={**base, **extra},
                )
                span.end(end_time=_ns(event["ts"] + event["dur"]))
                self.ended += 1
            root.end(end_time=_ns(step["ts"] + step["dur"]))
            self.ended += 1

    def close(self) -> str:
        """Send what is queued (unless the collector is down: then it is dropped at once) and stop; one line on
        what was sent and what was dropped."""
        self.processor.shutdown()
        sent, ended = self.exporter.sent, self.ended
        dropped = max(ended - sent, 0)
        line = f"OpenTelemetry: {sent} of {ended} spans sent to {self.url}"
        return line + (f", {dropped} dropped" if dropped else "")


class _Counting:
    """The exporter, counting what it delivered; after a failure (said once) batches are dropped without a try for
    ``RETRY_AFTER_S``, and at close while the collector is down, so no export waits on a dead address twice."""

    def __init__(self, inner: Any, url: str, warn: Callable[[str], None]):
        self.inner, self.url, self.warn = inner, url, warn
        self.sent = self.failed = 0
        self.down_until = 0.0
        self.warned = self.shut = False
        self._lock = threading.Lock()

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if time.monotonic() < self.down_until:
            self.failed += len(spans)
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception as error:  # an exporter that raises: the same as a refused batch
            result, reason = SpanExportResult.FAILURE, f"{type(error).__name__}: {error}"
        else:
            reason = "the export failed"
        if result == SpanExportResult.SUCCESS:
            self.sent += len(spans)
            return result
        self.failed += len(spans)
        self.down_until = time.monotonic() + RETRY_AFTER_S
        with self._lock:
            first, self.warned = not self.warned, True
        if first:
            self.warn(
                f"OpenTelemetry: the collector at {self.url} did not take the spans ({reason}); training goes "
                "on, and spans it cannot take are dropped and counted"
            )
        return result

    def shutdown(self) -> None:
        if not self.shut:
            self.shut = True
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _ns(us: float) -> int:
    return int(us * 1000)


def _attributes(values: dict[str, Any]) -> dict[str, Any]:
    """OpenTelemetry attributes: None left out, anything else not a plain value as text."""
    return {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in values.items() if v is not None}
