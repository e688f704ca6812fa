"""`sao probe RUN`: does the frozen trunk's hidden state carry a prompt's difficulty? Offline, from the snapshots a
run with ``--ceiling-every`` kept (``sao.training.oracle``).

For every snapshot in RUN/oracle/: a ridge regression (``sao.algorithm.oracle.ridge_probe``) from the hidden state
at each prompt's last token, and from the hidden state at each kept action token, to the prompt's success rate over
its K rollouts, cross-validated by prompt (a prompt's tokens never sit in the fold that scores them). Its out-of-fold
R² is set beside the share of the rates' variance that is signal at all, 1 − mean(s²/K) / Var(p̂): K rollouts leave
noise in each rate that no representation can predict, so that share is the most R² could reach. RUN is one run's
folder, or an experiment's (every run in it that kept snapshots). Writes RUN/probe.json and prints one line.

Deliberately left out: probing anything but the snapshots' states (the trunk's states at that step, as the critic
read them), and nonlinear probes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from sao.algorithm.oracle import ridge_probe
from sao.core.errors import ConfigError
from sao.core.io import write_json

OUT = "probe.json"
LOG = "train_log.jsonl"


def signal_share(returns: np.ndarray) -> float:
    """The share of the K-sample rates' variance between prompts that is not sampling noise (NaN when the rates do
    not vary)."""
    rates = returns.mean(axis=1)
    spread = float(rates.var(ddof=1))
    noise = float(returns.var(axis=1, ddof=1).mean()) / returns.shape[1]
    return 1.0 - noise / spread if spread > 0 else float("nan")


def _labels(run: Path) -> dict[int, str]:
    """step → the snapshot's name in the run's log ("warmup-end", or the policy steps taken)."""
    out: dict[int, str] = {}
    log = run / LOG
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "ceiling_snapshot" in record:
                out[int(record["step"])] = str(record["ceiling_snapshot"])
    return out


def probe_snapshot(path: Path, seed: int = 0) -> dict[str, Any]:
    """The probe of one snapshot file: R² at the last prompt token and per token, the rates' signal share."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            returns, prompt_hidden = f.get_tensor("returns"), f.get_tensor("prompt_hidden")
            token_hidden, token_prompt = f.get_tensor("token_hidden"), f.get_tensor("token_prompt")
            step = int(f.metadata().get("step", -1))
    except Exception as error:  # safetensors raises its own kinds for a damaged or foreign file
        raise ConfigError(f"{path} is not an oracle snapshot sao wrote ({error})") from None
    rates = returns.astype(np.float64).mean(axis=1)  # [P] each prompt's K-sample success rate
    share = signal_share(returns.astype(np.float64))
    out: dict[str, Any] = {
        "step": step,
        "prompts": int(returns.shape[0]),
        "samples": int(returns.shape[1]),
        "rate_mean": float(rates.mean()),
        "signal_share": share,
    }
    if float(rates.var()) == 0.0:
        return {**out, "prompt_token": None, "per_token": None, "note": "every prompt had the same rate"}
    out["prompt_token"] = ridge_probe(prompt_hidden, rates, seed=seed)
    out["per_token"] = ridge_probe(token_hidden, rates[token_prompt], token_prompt, seed=seed)
    return out


def probe_run(run: Path) -> dict[str, Any]:
    files = sorted((run / "oracle").glob("step-*.safetensors"))
    labels = _labels(run)
    snapshots = []
    for path in files:
        got = probe_snapshot(path)
        snapshots.append({"snapshot": labels.get(got["step"], str(got["step"])), **got})
    return {"run": run.name, "snapshots": snapshots}


def _runs(root: Path) -> list[tuple[str, str, Path]]:
    """(cell, run label, folder) of every run under an experiment folder that kept oracle snapshots."""
    return [
        (run.parent.parent.name, run.name, run)
        for run in sorted(root.glob("cells/*/runs/*"))
        if any((run / "oracle").glob("step-*.safetensors"))
    ]


def probe(path: str | Path) -> tuple[dict[str, Any], str]:
    """Probe a run's folder, or every run of an experiment's; write PATH/probe.json. Returns (its content, one
    line saying what it found)."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder (give a run's or an experiment's folder)")
    if any((root / "oracle").glob("step-*.safetensors")):
        found = {"kind": "run", **probe_run(root)}
        runs = [found]
    else:
        listed = _runs(root)
        if not listed:
            raise ConfigError(
                f"{root} holds no oracle snapshots (a run trained with --ceiling-every K keeps them in "
                "its oracle/ folder)"
            )
        runs = [{"cell": cell, **probe_run(run)} for cell, _, run in listed]
        found = {"kind": "experiment", "runs": runs}
    found["summary"] = summarize(runs)
    write_json(root / OUT, found)
    return found, line(found["summary"], len(runs), root / OUT)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per snapshot name, over the runs: the median R² at the last prompt token and per token, and of the signal
    share."""
    names: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for s in run["snapshots"]:
            names.setdefault(s["snapshot"], []).append(s)

    def median(values: list[Any]) -> float | None:
        kept = [v for v in values if isinstance(v, (int, float)) and v == v]
        return statistics.median(kept) if kept else None

    out = []
    for name, shots in names.items():
        out.append(
            {
                "snapshot": name,
                "runs": len(shots),
                "prompt_token_r2": median([(s.get("prompt_token") or {}).get("r2") for s in shots]),
                "per_token_r2": median([(s.get("per_token") or {}).get("r2") for s in shots]),
                "signal_share": median([s["signal_share"] for s in shots]),
            }
        )
    return out


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}"


def line(summary: list[dict[str, Any]], runs: int, written: Path) -> str:
    parts = [
        f"{s['snapshot']} {_fmt(s['prompt_token_r2'])} / {_fmt(s['per_token_r2'])} (signal {_fmt(s['signal_share'])})"
        for s in summary
    ]
    over = "" if runs == 1 else f" (medians over {runs} runs)"
    return (
        f"sao probe: the hidden state's cross-validated R² for the prompt's success rate, at its last token / per "
        f"token{over}: {'; '.join(parts)}; wrote {written}"
    )
