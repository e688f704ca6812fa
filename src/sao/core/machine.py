"""The machine a command runs on: whether a ``--device`` exists here, and how many CPU threads torch should use.

    device_problem   "auto", or a device this machine has ("cpu", "cuda", "cuda:N" with a GPU torch can use, "mps")
    torch_threads    the thread count a config asks for (1 for the tiny stand-ins on the CPU, else torch's default)
    apply_threads    set it, once, where a command starts
    on_terminal      whether stderr is a terminal: progress bars only there, never in a log file
    quiet_libraries  the Hugging Face libraries' own bars off (weight loading, downloads)

torch is imported inside the functions, so that reading settings costs nothing. Deliberately left out: picking a
device for a model (``sao.model.policy.pick_device``).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def on_terminal() -> bool:
    """Whether stderr is a terminal: a progress bar redraws itself there with ``\r``, which in a log file (a pipe, a
    redirect, CI) is a line of junk per redraw."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def quiet_libraries() -> None:
    """The Hugging Face libraries' progress bars off (transformers' weight loading, the hub's downloads): for
    ``--quiet``, and wherever stderr is not a terminal (``on_terminal``)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def device_problem(device: str) -> str | None:
    """None when ``device`` is "auto" or a device this machine has; otherwise the problem in one line."""
    if device == "auto":
        return None
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device must be auto, cpu, cuda, cuda:N or mps, got {device!r}"
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return (
                f"--device {device}: this torch sees no CUDA GPU (a CPU-only build, or none visible); "
                "use --device cpu or auto"
            )
        if parsed.index is not None and parsed.index >= count:
            return f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            return f"--device {device}: this torch has no MPS backend here; use --device cpu or auto"
    elif parsed.type != "cpu":
        return f"--device must be auto, cpu, cuda, cuda:N or mps, got {device!r}"
    return None


def torch_threads(config: Any, environ: dict[str, str] | None = None) -> int | None:
    """The CPU thread count ``config`` asks for: ``--threads`` when set; else None (torch's default, which follows
    OMP_NUM_THREADS) when OMP_NUM_THREADS is set or the model is not a tiny stand-in or the device is a GPU;
    else 1. One thread for the tiny models because their operations are too small to split: on a 2-core machine
    that other processes kept busy, torch's default of 2 threads made a tiny-preset step 13x slower (36.9 s
    against 2.8 s)."""
    environ = os.environ if environ is None else environ
    m = config.model
    if m.threads:
        return m.threads
    if environ.get("OMP_NUM_THREADS") or not m.name.startswith("tiny") or m.device not in ("auto", "cpu"):
        return None
    if m.device == "auto":
        import torch

        if torch.cuda.is_available():
            return None
    return 1


def apply_threads(config: Any) -> int:
    """Set torch's intra-op thread count as ``torch_threads`` says (once, at the start of a command); returns the
    count in effect."""
    import torch

    wanted = torch_threads(config)
    if wanted is not None and wanted != torch.get_num_threads():
        torch.set_num_threads(wanted)
    return torch.get_num_threads()
