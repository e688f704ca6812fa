"""The HTTP face of ``sao serve``: an OpenAI-compatible chat-completions endpoint over ``ServedPolicy``.

    POST /v1/chat/completions   a chat.completion with per-token logprobs and a ``sao`` field (policy version, token
                                ids); the trajectory is in the trace log (fsynced) before the reply is sent
    POST /v1/feedback           {"id", "reward"} → a feedback record (404: unknown id, 409: a second reward)
    GET  /health, /v1/models

Every refusal is a 4xx in OpenAI's error shape, with one line saying what to change. Refused on purpose:
temperature ≤ 0, n > 1, streaming, top_logprobs > 0, any setting that would change the distribution away from the
one recorded, and unknown fields. fastapi is imported here, and this module only when ``sao serve`` runs.
Design notes: docs/design/serve-app.md.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from sao.core.errors import ConfigError, DataError
from sao.core.plugins import PluginError, PluginTimeout
from sao.core.reading import TEMPERATURE_RANGE, Limits, parse_json, reward_problem
from sao.serve.served import ServedPolicy
from sao.serve.tracelog import OPEN, REWARDED, UNKNOWN, TraceLog
from sao.tasks.base import Scorer, Task

MAX_BODY_BYTES = 1 << 20
BODY_LIMITS = Limits(max_bytes=MAX_BODY_BYTES, max_depth=32)  # a request or feedback body
MAX_MESSAGES = 256
ROLES = ("system", "developer", "user", "assistant", "tool")  # "tool": a tool's answer in an agent's conversation
# Fields of OpenAI's request accepted when they keep their default (None or the value shown): anything else
# would change the distribution sampled from, or ask for something not implemented.
NEUTRAL = {
    "top_p": 1,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "stop": [],
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "response_format": {"type": "text"},
    "parallel_tool_calls": None,
    "stream_options": None,
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "reasoning_effort": None,
    "web_search_options": None,
}
IGNORED = ("user", "store", "service_tier", "prompt_cache_key", "safety_identifier")  # no effect on sampling
KNOWN = {
    "model",
    "messages",
    "temperature",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "seed",
    "n",
    "stream",
    "metadata",
    *NEUTRAL,
    *IGNORED,
}


class HTTPProblem(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request", kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status)


@dataclass
class EndpointSettings:
    model_name: str  # what responses and /v1/models call the model
    max_tokens: int  # the largest max_tokens a request may ask for (and the default)
    default_temperature: float
    max_prompt_tokens: int = 4096
    max_waiting: int = 64  # requests queued for the lock beyond this are refused with 503
    needs_answer: bool = True  # the task's own reward grades a gold "answer" (False: --reward reads its own fields)
    context_length: int | None = None  # the model's positions, prompt and reply together (None: not checked)


class Service:
    """What the endpoints share: the policy, the trace log, the task's scorer and the limits."""

    def __init__(self, policy: ServedPolicy, log: TraceLog, settings: EndpointSettings, scorer: Scorer):
        self.policy, self.log, self.settings, self.scorer = policy, log, settings, scorer
        self.started = time.time()
        self.served = self.refused = 0
        self.in_flight = 0  # chat requests admitted and not yet answered (counted on the event loop only)
        self._log_lock = threading.Lock()

    # -- the request ----------------------------------------------------------------------------------------

    def parse(self, body: Any) -> dict[str, Any]:
        """The validated settings of one chat-completions request, or an HTTPProblem that says what is wrong."""
        s = self.settings
        if not isinstance(body, dict):
            raise HTTPProblem(400, "the body must be a JSON object")
        unknown = sorted(set(body) - KNOWN)
        if unknown:
            raise HTTPProblem(400, f"unknown field {unknown[0]!r}; this server takes {', '.join(sorted(KNOWN))}")
        for name, neutral in NEUTRAL.items():
            value = body.get(name)
            if value is not None and value != neutral and not (name == "stop" and value == ""):
                shown = json.dumps(value)[:60]
                raise HTTPProblem(
                    400,
                    f"{name}={shown} is not supported: sao serve samples plain softmax(logits / "
                    "temperature) so that the logged log-probabilities are exact",
                )
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise HTTPProblem(400, "model must be a string")
        messages = self._messages(body.get("messages"))
        temperature = _number(body, "temperature", s.default_temperature)
        if not math.isfinite(temperature) or temperature <= 0:
            raise HTTPProblem(
                400,
                f"temperature must be > 0 (got {temperature}): greedy decoding has no sampling "
                "distribution, so its log-probabilities could not correct anything",
            )
        low, high = TEMPERATURE_RANGE
        if not low <= temperature <= high:
            raise HTTPProblem(
                400,
                f"temperature must be from {low:g} to {high:g} (got {temperature:g}): beyond them "
                "logits / temperature leave float32's range",
            )
        max_tokens = s.max_tokens
        for name in ("max_completion_tokens", "max_tokens"):
            if body.get(name) is not None:
                max_tokens = _integer(body, name)
        if not 1 <= max_tokens <= s.max_tokens:
            raise HTTPProblem(400, f"max_tokens must be between 1 and {s.max_tokens} (got {max_tokens})")
        if _integer(body, "n", 1) != 1:
            raise HTTPProblem(400, "n must be 1: one reply per request (send n requests instead)")
        if _boolean(body, "stream", False):
            raise HTTPProblem(400, "stream=true is not supported; send stream=false")
        logprobs = _boolean(body, "logprobs", False)
        if _integer(body, "top_logprobs", 0) != 0:
            raise HTTPProblem(400, "top_logprobs must be 0: only the drawn token's log-probability is recorded")
        seed = _integer(body, "seed", None)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        elif not 0 <= seed < 1 << 63:
            raise HTTPProblem(400, "seed must be between 0 and 2**63 - 1")
        metadata = body.get("metadata")
        if metadata is not None:
            if not isinstance(metadata, dict) or not metadata:
                raise HTTPProblem(400, 'metadata must be a non-empty JSON object of task fields, e.g. {"answer": "5"}')
            answer = metadata.get("answer")
            if s.needs_answer and (not isinstance(answer, str | int | float) or isinstance(answer, bool)):
                raise HTTPProblem(400, 'metadata needs an "answer" (the gold final answer) for the default reward')
        try:
            prompt_ids = self.policy.prompt_ids(messages)
        except Exception as error:  # a chat template that refuses this sequence of roles raises its own errors
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise HTTPProblem(400, f"the model's chat template refused the messages ({first})") from None
        if len(prompt_ids) > s.max_prompt_tokens:
            raise HTTPProblem(
                400, f"the prompt has {len(prompt_ids)} tokens; this server takes at most {s.max_prompt_tokens}"
            )
        context = s.context_length
        if context is not None and len(prompt_ids) + max_tokens > context:
            room = context - len(prompt_ids)
            fix = f"ask for max_tokens <= {room}" if room >= 1 else "shorten the prompt"
            message = (
                f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: more than the "
                f"model's context of {context} tokens; {fix}"
            )
            raise HTTPProblem(400, message, "context_length_exceeded")
        return {
            "messages": messages,
            "prompt_ids": prompt_ids,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            "seed": seed,
            "metadata": metadata,
        }

    @staticmethod
    def _messages(messages: Any) -> list[dict[str, str]]:
        if messages is None:
            raise HTTPProblem(400, 'messages is missing: send a list of {"role", "content"} objects')
        if not isinstance(messages, list) or not messages:
            raise HTTPProblem(400, 'messages must be a non-empty list of {"role", "content"} objects')
        if len(messages) > MAX_MESSAGES:
            raise HTTPProblem(400, f"messages has {len(messages)} entries; at most {MAX_MESSAGES}")
        out = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise HTTPProblem(400, f"messages[{i}] must be an object with role and content")
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise HTTPProblem(400, f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r})")
            if isinstance(content, list):  # content parts: text only
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise HTTPProblem(400, f'messages[{i}].content parts must all be {{"type": "text", "text"}}')
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise HTTPProblem(400, f"messages[{i}].content must be a string")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        return out

    # -- serving ----------------------------------------------------------------------------------------------

    def admit(self) -> None:
        """Take a place among the requests in flight, or a 503 in OpenAI's shape; ``leave`` after. Both run on the
        event loop before and after any thread is used, so a plain count is exact and the bound is reachable
        whatever the thread pool's size."""
        if self.in_flight >= self.settings.max_waiting:
            raise HTTPProblem(
                503,
                f"more than {self.settings.max_waiting} requests are waiting; retry later",
                "overloaded",
                "server_error",
            )
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    def answer(self, body: Any) -> dict[str, Any]:
        """The response to one chat-completions body: ``parse``, then ``complete``."""
        return self.complete(self.parse(body))

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """Draw the reply, grade it when the request carried task fields, log it, and build the response."""
        completion = self.policy.generate(
            request["prompt_ids"],
            max_tokens=request["max_tokens"],
            temperature=request["temperature"],
            seed=request["seed"],
        )
        created = int(time.time())
        id_ = f"cmpl-{uuid.uuid4().hex}"
        record: dict[str, Any] = {
            "id": id_,
            "policy_version": completion.policy_version,
            "temperature": request["temperature"],
            "messages": request["messages"],
            "prompt_token_ids": completion.prompt_token_ids,
            "completion_token_ids": completion.completion_token_ids,
            "logprobs": completion.logprobs,
            "finish_reason": completion.finish_reason,
            "adapter": completion.adapter,
            "created": created,
            "model": self.settings.model_name,
        }
        metadata = request["metadata"]
        if metadata is not None:
            task = _task(id_, request["messages"], metadata)
            try:
                record["reward"] = self.scorer.score([completion.text], [task.row()])[0]
            except PluginTimeout as error:  # nothing logged: the reply was never answered
                raise HTTPProblem(504, str(error), "reward_timeout", "server_error") from None
            except (ConfigError, PluginError) as error:  # the reward raised, exited or returned no number
                raise HTTPProblem(500, str(error), "reward_failed", "server_error") from None
            record["task"] = metadata
        with self._log_lock:
            self.log.append_trajectory(record, sync=False)
            self.served += 1
        self.log.sync()  # durable before the client hears of it; concurrent replies share the flush
        return self._response(record, completion, request["logprobs"])

    def _response(self, record: dict[str, Any], completion, with_logprobs: bool) -> dict[str, Any]:
        n_prompt, n_completion = len(completion.prompt_token_ids), len(completion.completion_token_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": completion.text},
            "logprobs": None,
            "finish_reason": completion.finish_reason,
        }
        if with_logprobs:
            choice["logprobs"] = {
                "content": [
                    {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": []}
                    for (text, raw), logprob in zip(
                        self._token_texts(completion.completion_token_ids), completion.logprobs, strict=True
                    )
                ]
            }
        sao = {
            "policy_version": record["policy_version"],
            "completion_token_ids": completion.completion_token_ids,
            "prompt_token_ids": completion.prompt_token_ids,
        }
        if "reward" in record:
            sao["reward"] = record["reward"]
        return {
            "id": record["id"],
            "object": "chat.completion",
            "created": record["created"],
            "model": record["model"],
            "choices": [choice],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion,
            },
            "sao": sao,
        }

    def _token_texts(self, ids: list[int]) -> list[tuple[str, list[int]]]:
        """Each token's text and raw bytes (byte-level BPE tokens map back to their exact bytes; a token that
        is part of a multi-byte character shows U+FFFD in its text, as OpenAI's do)."""
        tokenizer = self.policy.tokenizer
        decoder = _byte_decoder()
        special = set(tokenizer.all_special_ids)
        out = []
        for token_id, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
            if token_id not in special and piece and all(c in decoder for c in piece):
                raw = bytes(decoder[c] for c in piece)
            else:
                raw = tokenizer.decode([token_id]).encode("utf-8")
            out.append((raw.decode("utf-8", errors="replace"), list(raw)))
        return out

    def feedback(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise HTTPProblem(400, 'the body must be a JSON object {"id", "reward"}')
        unknown = sorted(set(body) - {"id", "reward"})
        if unknown:
            raise HTTPProblem(400, f'unknown field {unknown[0]!r}; send {{"id", "reward"}}')
        id_, reward = body.get("id"), body.get("reward")
        if not isinstance(id_, str) or not id_:
            raise HTTPProblem(400, "id must be the completion's id (a string)")
        problem = reward_problem(reward)  # the one rule for rewards, wherever they come from
        if problem is not None:
            raise HTTPProblem(400, f"reward: {problem}")
        with self._log_lock:
            status = self.log.status(id_)
            if status == UNKNOWN:
                raise HTTPProblem(404, f"no completion {id_} in this server's trace log", "unknown_id")
            if status == REWARDED:
                raise HTTPProblem(409, f"completion {id_} already has a reward", "already_rewarded")
            assert status == OPEN
            self.log.append_feedback(id_, float(reward))
        return {"id": id_, "reward": float(reward), "object": "feedback"}

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.settings.model_name,
            "policy_version": self.policy.version,
            "adapter": self.policy.adapter,
            "served": self.served,
            "trace_log": str(self.log.path),
            "trace_records": self.log.records,
            "uptime_s": round(time.time() - self.started, 3),
        }


def _task(id_: str, messages: list[dict[str, str]], metadata: dict[str, Any]) -> Task:
    """The task a reward function grades: the metadata as its fields, its "answer" as the gold answer, the
    last user turn as its question, the request's messages as its prompt."""
    question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    answer = metadata.get("answer", "")
    answer = str(answer).strip() if isinstance(answer, str | int | float) else ""
    return Task(id=id_, question=question, answer=answer, fields=dict(metadata), messages=messages)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HTTPProblem(400, f"{name} must be a number")
    return float(value)


def _integer(body: dict, name: str, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPProblem(400, f"{name} must be an integer")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HTTPProblem(400, f"{name} must be true or false")
    return value


_BYTE_DECODER: dict[str, int] = {}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the printable stand-in of each byte → the byte."""
    if not _BYTE_DECODER:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        extra = 0
        for b in range(256):
            if b in printable:
                _BYTE_DECODER[chr(b)] = b
            else:
                _BYTE_DECODER[chr(256 + extra)] = b
                extra += 1
    return _BYTE_DECODER


async def _json_body(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        raise HTTPProblem(413, f"the body is over {MAX_BODY_BYTES} bytes", "body_too_large")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise HTTPProblem(413, f"the body is over {MAX_BODY_BYTES} bytes", "body_too_large")
    except ClientDisconnect:  # one line, not uvicorn's traceback: nothing was drawn or logged for it
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        print(
            f"sao serve: {client} hung up after {len(raw)} bytes of its request body; nothing logged",
            file=sys.stderr,
            flush=True,
        )
        raise HTTPProblem(400, "the client hung up before its body was complete", "client_disconnected") from None
    try:  # the bounded reader: nesting, long integers, NaN and 1e400 refused before anything reads them
        return parse_json(bytes(raw), where="the body", limits=BODY_LIMITS)
    except DataError as error:
        raise HTTPProblem(400, str(error), "invalid_json") from None


async def _guarded(work: Any, *args: Any) -> Any:
    """``work`` in the thread pool; anything it raises but an HTTPProblem becomes a 500 in OpenAI's shape with
    one line (and one line on stderr), never uvicorn's plain-text page and a traceback."""
    try:
        return await run_in_threadpool(work, *args)
    except HTTPProblem:
        raise
    except Exception as error:
        first = (str(error).strip().splitlines() or [""])[0][:200]
        what = "the trace log could not be written" if isinstance(error, OSError) else "internal error"
        print(f"sao serve: {what}: {type(error).__name__}: {first}", file=sys.stderr, flush=True)
        raise HTTPProblem(
            500,
            f"{what} ({type(error).__name__}: {first}); the request was not logged",
            "internal_error",
            "server_error",
        ) from None


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="sao serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPProblem)
    async def problem(request: Request, error: HTTPProblem) -> JSONResponse:
        service.refused += 1
        return _error(error.status, error.message, error.code, error.kind)

    @app.exception_handler(404)
    async def not_found(request: Request, error: Exception) -> JSONResponse:
        return _error(404, f"no route {request.method} {request.url.path}", "not_found")

    @app.exception_handler(405)
    async def wrong_method(request: Request, error: Exception) -> JSONResponse:
        return _error(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        service.admit()
        try:
            body = await _json_body(request)
            return JSONResponse(await _guarded(service.answer, body))  # one trip to the thread pool
        finally:
            service.leave()

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> JSONResponse:
        body = await _json_body(request)
        return JSONResponse(await _guarded(service.feedback, body))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(service.health())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": service.settings.model_name,
            "object": "model",
            "created": int(service.started),
            "owned_by": "sao",
        }
        return JSONResponse({"object": "list", "data": [card]})

    return app


__all__ = ["EndpointSettings", "HTTPProblem", "Service", "create_app"]
