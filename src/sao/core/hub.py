"""Whether the Hugging Face hub can give what a run names, asked before anything is downloaded or loaded.

    check_reachable   a model or dataset id that is in a local cache passes; otherwise, with HF_HUB_OFFLINE (or
                      TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE for a dataset) set, or the hub not answering a
                      connection within ``HUB_PROBE_SECONDS``, a one-line ConfigError at once, instead of the hub
                      client's retries (tens of seconds, every retry line on stderr)

The probe's answer is kept for the process: a run that names a dataset and a model on the hub waits once. Behind a
proxy (``HTTPS_PROXY``) the hub client is trusted to find its way.

Deliberately left out: authentication, mirrors other than ``HF_ENDPOINT``, and downloading anything.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

from sao.core.errors import ConfigError

HUB_PROBE_SECONDS = 3.0  # how long an uncached hub id waits to learn whether the hub can be reached at all
PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline_flag(kind: str = "model") -> str | None:
    """The environment variable that puts the hub client offline for a ``kind`` ("model" or "dataset"), or None."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if kind == "model" else ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    return next((name for name in names if _truthy(os.environ.get(name))), None)


def cached(repo_id: str, kind: str = "model") -> bool | None:
    """Whether ``repo_id`` is in a local cache (the hub's; for a dataset, ``datasets``' own too); None when the id
    is not one the hub client accepts (the loader's own error then says so)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # transformers brings huggingface_hub; without it there is nothing to ask
        return True
    try:
        if kind == "model":
            found = try_to_load_from_cache(repo_id, "config.json")
        else:
            found = try_to_load_from_cache(repo_id, "README.md", repo_type="dataset")
    except Exception:  # not a valid repo id
        return None
    if isinstance(found, str):
        return True
    if kind == "dataset":
        root = os.environ.get("HF_DATASETS_CACHE") or os.path.join(
            os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "datasets"
        )
        return (Path(root) / repo_id.replace("/", "___")).is_dir()
    return False


@functools.lru_cache(maxsize=8)
def _probe(host: str, port: int) -> str | None:
    """None when ``host:port`` accepts a connection within ``HUB_PROBE_SECONDS``, else why not, in words."""
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as error:
        return getattr(error, "strerror", None) or type(error).__name__
    return None


def endpoint() -> tuple[str, int]:
    """The hub's host and port (``HF_ENDPOINT``, else huggingface.co:443)."""
    from urllib.parse import urlsplit

    url = os.environ.get("HF_ENDPOINT")
    if not url:
        try:
            from huggingface_hub import constants

            url = constants.ENDPOINT
        except ImportError:
            url = "https://huggingface.co"
    parts = urlsplit(url)
    return parts.hostname or "huggingface.co", parts.port or (80 if parts.scheme == "http" else 443)


def check_reachable(repo_id: str, *, kind: str = "model", fix: str) -> None:
    """Nothing when ``repo_id`` (a ``kind``: "model" or "dataset") is cached here or the hub answers; otherwise a
    one-line ConfigError ending in ``fix``, at once (offline) or within ``HUB_PROBE_SECONDS`` (no hub)."""
    if cached(repo_id, kind) is not False:
        return
    flag = offline_flag(kind)
    if flag is not None:
        raise ConfigError(f"{kind} {repo_id!r} is not in the local hub cache and {flag} is set; {fix}")
    if any(os.environ.get(name) for name in PROXIES):
        return
    host, port = endpoint()
    reason = _probe(host, port)
    if reason is not None:
        raise ConfigError(
            f"{kind} {repo_id!r} is not in the local hub cache and the hub ({host}:{port}) cannot be "
            f"reached ({reason}); {fix}"
        )
