"""A fake vLLM OpenAI server over real HTTP on 127.0.0.1, from the standard library: what sao's vLLM client sees of a
server that lists no model, never answers, answers a byte at a time, sends an endless body, or restarts and forgets
the adapters loaded into it. Enough of vLLM's API for the client: /health, /v1/models, /v1/load_lora_adapter,
/v1/unload_lora_adapter and /v1/completions (token ids echoed, one log-prob per token).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeVllm:
    """``mode``: "ok", "no-models" (lists none), "silent" (accepts, never answers), "trickle" (a byte of headers every
    ``pause`` seconds), "endless" (headers, then a body that never ends). ``restart()`` forgets every adapter, as a
    restarted vLLM does. ``calls`` lists (method, path) of every request; ``stop()`` ends it."""

    def __init__(self, mode: str = "ok", base: str = "base-model", pause: float = 0.2):
        self.mode, self.base, self.pause = mode, base, pause
        self.adapters: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.released = threading.Event()  # set by stop(): handlers that hold a connection open let go
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                fake.answer(self, "GET")

            def do_POST(self) -> None:
                fake.answer(self, "POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def restart(self) -> None:
        self.adapters.clear()

    def stop(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- answers ---------------------------------------------------------------------------------------------------

    def answer(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = json.loads(handler.rfile.read(length)) if length else None
        self.calls.append((method, handler.path))
        if self.mode == "silent":
            self.released.wait(60)  # accepted, read, never answered
            return
        if self.mode == "trickle":
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 10_000:
                if self.released.wait(self.pause):
                    return
                try:
                    handler.wfile.write(bytes([byte]))
                    handler.wfile.flush()
                except OSError:
                    return
            return
        if self.mode == "endless":
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Connection", "close")
            handler.end_headers()
            chunk = b"0," * (1 << 15)
            try:
                handler.wfile.write(b"[")
                while not self.released.is_set():
                    handler.wfile.write(chunk)
            except OSError:
                return
            return
        status, reply = self.route(method, handler.path, body)
        data = json.dumps(reply).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/health":
            return 200, {}
        if path == "/v1/models":
            names = [] if self.mode == "no-models" else [self.base, *self.adapters]
            return 200, {"object": "list", "data": [{"id": name, "object": "model"} for name in names]}
        if path == "/v1/load_lora_adapter":
            if body["lora_name"] in self.adapters:
                return 400, {"error": {"message": f"The lora adapter '{body['lora_name']}' has already been loaded."}}
            self.adapters[body["lora_name"]] = body["lora_path"]
            return 200, "Success"
        if path == "/v1/unload_lora_adapter":
            self.adapters.pop(body["lora_name"], None)
            return 200, "Success"
        if path == "/v1/completions":
            if body["model"] != self.base and body["model"] not in self.adapters:
                return 404, {
                    "error": {
                        "message": f"The model `{body['model']}` does not exist.",
                        "type": "NotFoundError",
                        "code": 404,
                    }
                }
            tokens = [7] * min(3, body["max_tokens"])
            choice = {
                "index": 0,
                "text": "abc",
                "prompt_token_ids": body["prompt"],
                "token_ids": tokens,
                "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
                "finish_reason": "length" if len(tokens) == body["max_tokens"] else "stop",
            }
            return 200, {"choices": [choice], "model": body["model"]}
        return 404, {"detail": "Not Found"}


def wait_for(condition, seconds: float = 10.0) -> bool:
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
