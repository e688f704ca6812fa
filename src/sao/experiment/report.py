"""report.md and plots/ for one experiment folder — a `sao recipe` or a `sao sweep` — from its JSON alone.

A recipe is a one-cell sweep, so one page serves both: a cell is one (lag, lr, band) setting; in every cell each
arm trains with the same seeds and is compared with the baseline ``none`` (and with the untrained base). The
module only lays out what results.json and train_log.json hold: four plots (training reward, masked share by
staleness, the worst ratio against the band, pass@1 with the paired deltas; pass@1 over steps with
``--eval-every``; the ratios' effective sample size per step where the log has it), one small panel per cell, and a
page that states the verdict in words with the tables behind it, the off-policy diagnostics (the masked share by
the band's side, the tokens outside the band and where in the reply), and the provenance. A planned confirmation
(`sao confirm`) states its plan first — primary endpoint, family, fresh seeds, smallest effect, decision rule,
estimands, correction or gatekeeping, power, and the power the runs realised — then what came out after the
correction. Verdicts, intervals, p-values, floors, power, folds and checks are read, never recomputed; the only
arithmetic is averaging over seeds for display, counting, and the realised power of a results.json written before
it was recorded (``realised_power``). Without train_log.json (a committed folder keeps results.json only) report.md
is rebuilt from results.json and the plots drawn from the log are kept as they are.

Deliberately left out: statistics (``sao.core.stats`` owns them), correction for multiple comparisons outside a
planned family (the page says each interval is its own), judgement beyond the recorded verdicts, HTML, and
imports above ``sao.core``: matplotlib loads only when plots are drawn, and nothing here loads torch.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sao.core import stats
from sao.core.config import flat_view
from sao.core.errors import DataError
from sao.core.io import atomic_write
from sao.core.names import BASELINE, POLICY
from sao.core.reading import read_json_file

COLORS = {"dis": "#1f6fb4", "none": "#e0700f", "tis": "#2a9d3f", "seqmask": "#8e44ad", "base": "#808080"}
SPARE_COLORS = ("#17becf", "#bcbd22", "#e377c2", "#8c564b")  # any further arm, in grid order
SEPARATED = ("improved", "regressed")
PLOTS = {  # file stem → caption in report.md; every plot has one panel per cell but the last
    "reward": "Training reward per step (thin: each seed; thick: the mean over seeds; grey: the critic warmup).",
    "masked_share": "Masked share by staleness, mean over seeds (hatched: what the band would have masked on `none`).",
    "ratio_max": "Largest trainer/sampler ratio per step, log scale (thick: mean over seeds); dashed: the band edges.",
    "evals": "pass@1 per cell and arm with its 95% interval (dots: seeds, ×: diverged; grey: base mean ± noise "
    "floor), and each arm's paired delta against `none` with its 95% interval (shaded: ± noise floor).",
}
EVAL_CURVE = (
    "eval_curve",
    "Held-out pass@1 over policy steps (`--eval-every`; thin: each seed, thick: the mean "
    "over seeds; step 0 is the untrained policy, grey: base mean ± noise floor).",
)
ESS_PLOT = (
    "ess",
    "Effective sample size of the trainer/sampler ratios per step, (Σ r)² / (N Σ r²) over the action "
    "tokens: 1 when every ratio is equal, 1/N when one token carries the weight (thin: each seed; thick: the "
    "mean over seeds).",
)
PHASES_PLOT = (
    "phases",
    "Where each step's time goes: seconds per phase, stacked, the mean over the cell's runs "
    "(`other`: the rest of the step; drawing and its environment calls first). Each run's timeline.json "
    "holds every span behind these sums.",
)
LOG_PLOTS = ("reward", "ratio_max", "mismatch", "ess", "phases")  # from train_log.json; the rest from results.json
PHASE_KEYS = (
    "wait",
    "draw",
    "env",
    "score",
    "pass",
    "checks",
    "update",
    "publish",
    "eval",
    "critic",
    "stats",
    "other",
)  # a record's time_<phase>, in step order (sao.core.timeline.PHASES and the rest)
TIMELINE = "timeline.json"  # each run's, under cells/<cell>/runs/<run>/
MISMATCH_PLOT = (
    "mismatch",
    "Mean |log r| per action token, split by cause (mean over seeds, log scale): the "
    "sampling engine's numerics on staleness-0 rows (solid) and on stale rows re-scored under the "
    "version that drew them (dotted), against the drift staleness made (dashed). A mask that fires on "
    "the first calls for a numerics fix, on the last for a fresher sampler.",
)
KEY_SERIES = (
    "reward_mean",
    "masked_share",
    "would_be_masked_share",
    "ratio_max",
    "explained_variance",
    "response_length",
    "kl_sampler_policy",  # and, for agents (shown when logged):
    "turns_mean",
    "tool_calls_mean",
    "tool_use_share",
    "tool_error_rate",
    "observation_share",
    # and, when the Mismatch hook ran (a vLLM sampler): the ratio split into its two causes
    "mismatch_fresh",
    "mismatch_rescored",
    "staleness_drift",
    # and, where logged, the off-policy diagnostics
    "ratio_ess_share",
    "masked_share_low",
    "masked_share_high",
)
SHARE_SERIES = {
    "reward_mean",
    "masked_share",
    "would_be_masked_share",
    "tool_use_share",
    "tool_error_rate",
    "observation_share",
    "ratio_ess_share",
    "masked_share_low",
    "masked_share_high",
}
CONFIG_KEYS = (
    "model",
    "data",
    "ratio",
    "lag",
    "lr",
    "critic_lr",
    "steps",
    "critic_warmup",
    "critic_steps",
    "batch_size",
    "train_runs",
    "seed",
    "base_evals",
    "eval_samples",
    "eval_temperature",
    "temperature",
    "max_new_tokens",
    "grad_clip",
    "lora_rank",
    "lora_alpha",
    "gae_alpha",
    "dead_band_share",
    "tis_cap",
    "rollout",
    "env",
    "max_turns",
    "reward",
    "truncated_reward",
    "eval_every",
    "random_mask_share",
    "threads",
)
WALL_TOTALS = {
    "train_total": "**train, total**",
    "eval_total": "**eval, total**",
    "compute_total": "**compute, total**",
    "this_invocation": "this invocation",
}
EXAMPLES_PER_MODEL = 3
ORIGIN = "Model, data and machine"  # the section of hashes and machine (its usual name contains "nan")
DASH = "—"

# ---------------------------------------------------------------------------------------------------------
# Formatting: every number in report.md goes through one of these.


def _num(x: Any, missing: float | None = None) -> float | None:
    """A finite float, or ``missing`` for anything else (None, NaN, bool, text); plots pass NaN: a gap."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return missing
    return float(x)


def fmt(x: Any) -> str:
    """4 significant digits (a float keeps its point); integers as integers; booleans as yes/no; missing as —."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        text = f"{x:.4g}"
        return text if any(c in text for c in ".e") else text + ".0"  # a float keeps its point: 6.0, not 6
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(fmt(v) for v in x) + ")"
    return str(x)


def fmt_count(x: Any) -> str:
    """A count, or a mean of counts: a whole number without a point, otherwise as ``fmt``."""
    v = _num(x)
    return str(int(v)) if v is not None and v.is_integer() else fmt(x)


def fmt_share(x: Any) -> str:
    """A fraction (pass@1, a masked share) to 4 decimals, e.g. 0.0123; a tiny non-zero one in e-notation."""
    v = _num(x)
    if v is None:
        return DASH
    return f"{v:.1e}" if v != 0 and abs(v) < 5e-5 else f"{v:.4f}"


def fmt_signed(x: Any) -> str:
    """A delta of pass@1 with its sign, e.g. +0.0604."""
    v = _num(x)
    return DASH if v is None else f"{v:+.4f}"


def fmt_interval(lo: Any, hi: Any) -> str:
    return f"[{fmt_signed(lo)}, {fmt_signed(hi)}]"


def fmt_seconds(x: Any) -> str:
    v = _num(x)
    if v is None:
        return DASH
    return f"{v:.1f} s" if v < 120 else f"{v:.0f} s ({v / 60:.1f} min)"


def _share_pct(x: Any) -> str:
    v = _num(x)
    return DASH if v is None else f"{fmt_share(v)} ({v:.2%})"


def _cell(x: Any) -> str:
    """Text made safe for one markdown table cell."""
    text = str(x).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def _text(x: Any) -> str:
    """Text made safe for a markdown paragraph or list item (no HTML, one line)."""
    return " ".join(str(x).replace("&", "&amp;").replace("<", "&lt;").split())


def _table(header: list[str], rows: Iterable[list[str]], text: int = 2) -> list[str]:
    """A markdown table: the first ``text`` columns align left, the numbers after them right."""
    rule = [":---" if i < text else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    return [*lines, *("| " + " | ".join(row) + " |" for row in rows), ""]


def _plural(n: Any, word: str) -> str:
    return f"{fmt_count(n)} {word}{'' if _num(n) == 1 else 's'}"


def _join(items: list[str]) -> str:
    return "; ".join(items[:-1]) + "; and " + items[-1] if len(items) > 1 else "".join(items)


def _mean(values: Iterable[Any]) -> float | None:
    vals = [v for v in map(_num, values) if v is not None]
    return statistics.fmean(vals) if vals else None


def _pair(x: Any) -> tuple[float | None, float | None]:
    return (_num(x[0]), _num(x[1])) if isinstance(x, list) and len(x) == 2 else (None, None)


# ---------------------------------------------------------------------------------------------------------
# Reading and checking the folder. A schema is a type, a (test, words) pair, a dict (a JSON object whose
# listed keys, where present and not null, have that shape; "key!" is required; "*" is every value) or a
# one-item list (a JSON list of that shape).

NUMBER = (lambda v: _num(v) is not None, "a number")
BAND = (lambda v: isinstance(v, list) and len(v) == 2 and all(_num(x) is not None for x in v), "a two-number list")
EVAL = {"examples": [{}]}
FOLDS = {"*": {}}  # series → {"first", "last", "mean", "max", "min", "n"}
RUN = {"checks": {"masked_share_by_staleness": {"*": {}}}, "curves": FOLDS, "diverged": list}
ARM = {"pass_at_1": list, "pass_at_1_ci": list, "evals": [EVAL], "curves": FOLDS, "runs": {"*": RUN}}
CELL = {
    "name!": str,
    "lag!": NUMBER,
    "lr!": NUMBER,
    "band!": BAND,
    "arms!": {"*": ARM},
    "compare": {"*": {}},
    "vs_base": {"*": {}},
}
RESULTS = {
    "config!": {},
    "verdict!": str,
    "cells!": [CELL],
    "grid": {},
    "seeds": list,
    "data": {},
    "versions": {},
    "base": {"evals": [EVAL], "pass_at_1": list},
    "primary": {},
    "warnings": list,
    "wall_time": {"train": {}, "eval": {}},
}
RECORD = {"cell!": str, "arm!": str, "seed!": NUMBER, "step!": NUMBER, "phase!": str}
JSON_NAMES = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}


def _check(value: Any, schema: Any, where: str, path: Any) -> None:
    if isinstance(schema, tuple):
        ok, want = schema[0](value), schema[1]
    else:
        kind = dict if isinstance(schema, dict) else list if isinstance(schema, list) else schema
        ok, want = isinstance(value, kind), f"a JSON {JSON_NAMES[kind]}"
    if not ok:
        found = JSON_NAMES.get(type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)
        raise DataError(f"{path}: {where or 'the top level'} should be {want} (found: {found}); not a sao file")
    if isinstance(schema, list):
        for i, item in enumerate(value):
            _check(item, schema[0], f"{where}[{i}]", path)
    elif isinstance(schema, dict):
        for key, sub in schema.items():
            items = value.items() if key == "*" else [(key.rstrip("!"), value.get(key.rstrip("!")))]
            for name, v in items:
                here = f"{where}.{name}" if where else str(name)
                if v is not None:
                    _check(v, sub, here, path)
                elif key.endswith("!"):
                    raise DataError(f"{path} lacks '{here}': not a sao file")


def _validate(results: Any, log: Any, results_path: Any, log_path: Any) -> None:
    _check(results, RESULTS, "", results_path)
    if not results["cells"]:
        raise DataError(f"{results_path} holds no cell: not a finished sao run")
    if log is not None:
        _check(log, [RECORD], "", log_path)


def load(out_dir: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """(results, train_log) of an experiment folder, checked for the shape the report relies on; train_log is None
    when the folder did not keep train_log.json (only results.json is required)."""
    paths, loaded = (Path(out_dir) / "results.json", Path(out_dir) / "train_log.json"), []
    for path in paths:
        if not path.is_file():
            if path.name == "train_log.json":
                loaded.append(None)
                continue
            raise DataError(f"{path} is missing: run `sao recipe` or `sao sweep` into this folder first")
        try:
            loaded.append(read_json_file(path, expect=(dict, list)))  # the bounded reader: size, depth, numbers
        except DataError as e:
            raise DataError(f"{path} is not readable JSON ({str(e).removeprefix(f'{path}: ')})") from None
    _validate(*loaded, *paths)
    return loaded[0], loaded[1]


def _arms(results: dict[str, Any]) -> list[str]:
    """The arms in the grid's order, then any other arm a cell holds."""
    seen = [a for a in (results.get("grid") or {}).get("arms") or [] if isinstance(a, str)]
    return list(dict.fromkeys([*seen, *(a for cell in results["cells"] for a in cell["arms"])]))


def _each(results: dict[str, Any], arms: list[str]) -> Iterable[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(cell, arm name, arm) for every arm of every cell, in cell then grid-arm order."""
    return ((cell, name, cell["arms"][name]) for cell in results["cells"] for name in arms if name in cell["arms"])


def _where(cell: dict[str, Any]) -> str:
    return f"lag {fmt(cell['lag'])}, lr {fmt(cell['lr'])}, band {fmt(cell['band'])}"


def _short(cell: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    """The cell's settings that vary across the grid, one per line (all three when none varies)."""
    parts = [(k, f"{k} {fmt(cell[k])}") for k in ("lag", "lr", "band")]
    varying = [p for k, p in parts if len({json.dumps(c[k]) for c in cells}) > 1]
    return "\n".join(varying or [p for _, p in parts])


def _comparisons(results: dict[str, Any]) -> list[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(cell, key, comparison) for every comparison against the baseline, in cell order."""
    return [(cell, key, c) for cell in results["cells"] for key, c in (cell.get("compare") or {}).items()]


def _name(key: str, c: dict[str, Any]) -> str:
    return f"{c['after']} − {c['before']}" if "after" in c and "before" in c else key.replace("_vs_", " − ")


def _is_primary(results: dict[str, Any], cell: dict[str, Any], key: str) -> bool:
    primary = results.get("primary") or {}
    return primary.get("cell") == cell["name"] and primary.get("comparison") == key


def _per_seed(results: dict[str, Any], arm: dict[str, Any]) -> list[tuple[Any, bool]]:
    """(pass@1, whether that seed's run diverged) per value, in seed order (results' ``seeds``)."""
    values, seeds = arm.get("pass_at_1") or [], results.get("seeds") or []
    bad = {run.get("seed") for run in (arm.get("runs") or {}).values() if run.get("diverged")}
    return [(v, len(seeds) == len(values) and seeds[i] in bad) for i, v in enumerate(values)]


def _diverged(arm: dict[str, Any]) -> tuple[int, int]:
    """(diverged runs, runs) of an arm."""
    runs = (arm.get("runs") or {}).values()
    return sum(bool(run.get("diverged")) for run in runs), len(runs) or len(arm.get("pass_at_1") or [])


def _by_staleness(arm: dict[str, Any], name: str) -> dict[int, tuple[float | None, ...]]:
    """staleness → (steps per run, share, median max ratio), each the mean over the arm's runs; the share is what
    the arm's rule masked, or for the baseline (which masks nothing) what the band would have masked."""
    rows: dict[int, list[dict[str, Any]]] = {}
    for run in (arm.get("runs") or {}).values():
        for s, row in ((run.get("checks") or {}).get("masked_share_by_staleness") or {}).items():
            if str(s).isdigit():
                rows.setdefault(int(s), []).append(row)
    keys = ("steps", "would_be_masked_share" if name == BASELINE else "masked_share", "ratio_max_median")
    return {s: tuple(_mean(r.get(k) for r in got) for k in keys) for s, got in sorted(rows.items())}


def _runs(log: list[dict[str, Any]]) -> dict[str, dict[str, dict[Any, list[dict[str, Any]]]]]:
    """cell → arm → seed → that run's records in step order."""
    out: dict[str, dict[str, dict[Any, list[dict[str, Any]]]]] = {}
    for r in sorted(log, key=lambda r: r["step"]):
        out.setdefault(r["cell"], {}).setdefault(r["arm"], {}).setdefault(r["seed"], []).append(r)
    return out


# ---------------------------------------------------------------------------------------------------------
# Plots: one small panel per cell, rows = (lr, band), columns = lags.


def _panels(cells: list[dict[str, Any]]):
    from matplotlib.figure import Figure  # lazily: only drawing needs matplotlib

    lags = sorted({c["lag"] for c in cells})
    combos = list(dict.fromkeys((c["lr"], tuple(c["band"])) for c in cells))
    fig = Figure(figsize=(max(9.0, 5.0 * len(lags) + 0.6), max(4.8, 3.4 * len(combos) + 1.6)), layout="constrained")
    grid = fig.subplots(len(combos), len(lags), squeeze=False, sharey=True)  # one scale: cells compare at a glance
    axes = {}
    for c in cells:
        axes[c["name"]] = ax = grid[combos.index((c["lr"], tuple(c["band"])))][lags.index(c["lag"])]
        ax.set_title(_where(c), fontsize=9)
        ax.grid(alpha=0.3)
    for ax in grid.flat:
        ax.set_visible(any(ax is a for a in axes.values()))
    return fig, axes


LEGEND_COLUMNS = 2  # a legend set below its panel


def _legend(target, axes: Iterable[Any], **kw: Any) -> int:
    """One legend for several panels: each label once. How many entries it has."""
    seen = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    if seen:
        target.legend(list(seen.values()), list(seen), fontsize=8, **kw)
    return len(seen)


def _save(fig, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    atomic_write(path, buffer.getvalue())


def _steps_panel(ax, runs: dict[str, dict[Any, list[dict]]], arms: list[str], colors: dict, key: str) -> None:
    """Each seed a thin line, each arm's mean over seeds a thick one; grey span over the critic warmup."""
    warm = [r["step"] for seeds in runs.values() for rows in seeds.values() for r in rows if r["phase"] != POLICY]
    if warm:
        ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, color="0.88", zorder=0, label="critic warmup")
    for arm in [a for a in arms if a in runs]:
        seeds, by_step = runs[arm], {}
        for rows in seeds.values():
            if len(seeds) > 1:
                ys = [_num(r.get(key), math.nan) for r in rows]  # a null is a gap in the line
                ax.plot([r["step"] for r in rows], ys, color=colors[arm], lw=0.8, alpha=0.45, label=f"{arm}: each seed")
            for r in rows:
                by_step.setdefault(r["step"], []).append(r.get(key))
        steps = sorted(by_step)
        label = f"{arm}: mean of {len(seeds)} seeds" if len(seeds) > 1 else f"{arm}: seed {next(iter(seeds))}"
        ax.plot(
            steps,
            [_num(_mean(by_step[s]), math.nan) for s in steps],
            color=colors[arm],
            lw=2.2,
            label=label,
            marker="o" if len(steps) <= 12 else None,
            ms=3,
        )
    ax.set_xlabel("step")


MISMATCH = {
    "mismatch_fresh": ("-", "engine, staleness-0 rows"),
    "mismatch_rescored": (":", "engine, stale rows"),
    "staleness_drift": ("--", "staleness drift"),
}  # key → (line style, what it measures)


def _has_mismatch(log: list[dict[str, Any]]) -> bool:
    return any(isinstance(r.get(k), (int, float)) for r in log for k in MISMATCH)


def _mismatch_panel(ax, runs: dict[str, dict[Any, list[dict]]], arms: list[str], colors: dict) -> None:
    """Mean |log r| per action token, split: the sampling engine's numerics (staleness-0 rows; stale rows
    re-scored under the version that drew them) against the drift staleness made; the mean over seeds per arm."""
    for arm in [a for a in arms if a in runs]:
        for key, (style, what) in MISMATCH.items():
            by_step: dict[int, list[Any]] = {}
            for rows in runs[arm].values():
                for r in rows:
                    by_step.setdefault(r["step"], []).append(r.get(key))
            steps = [s for s in sorted(by_step) if _mean(by_step[s]) is not None]
            if steps:
                ax.plot(
                    steps,
                    [_mean(by_step[s]) for s in steps],
                    color=colors[arm],
                    ls=style,
                    lw=1.6,
                    marker=".",
                    ms=3,
                    label=f"{arm}: {what}",
                )
    ax.set_yscale("log")
    ax.set_xlabel("step")


def _has_phases(log: list[dict[str, Any]] | None) -> bool:
    return log is not None and any(isinstance(r.get("time_pass"), (int, float)) for r in log)


def _phase_means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of each phase over ``rows`` (phases no row spent time in left out)."""
    means = {k: _mean(r.get(f"time_{k}") for r in rows) for k in PHASE_KEYS}
    return {k: v for k, v in means.items() if v}


def _phases_panel(ax, runs: dict[str, dict[Any, list[dict]]]) -> None:
    """Each phase's seconds per step, the mean over every arm and seed of the cell, stacked in step order."""
    by_step: dict[Any, list[dict[str, Any]]] = {}
    for seeds in runs.values():
        for rows in seeds.values():
            for r in rows:
                by_step.setdefault(r["step"], []).append(r)
    steps = sorted(by_step)
    keys = [k for k in PHASE_KEYS if any(_phase_means(by_step[s]).get(k) for s in steps)]
    if not steps or not keys:
        return
    from matplotlib import colormaps

    palette = colormaps["tab20"]
    ax.stackplot(
        steps,
        [[_num(_mean(r.get(f"time_{k}") for r in by_step[s]), 0.0) for s in steps] for k in keys],
        labels=keys,
        colors=[palette(PHASE_KEYS.index(k) / len(PHASE_KEYS)) for k in keys],
        alpha=0.9,
    )
    ax.set_xlabel("step")


def _band_axis(ax, band: list[float]) -> None:
    """Log scale with plain tick labels, and the band edges as dashed red lines."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    for edge in [e for e in band if e > 0]:
        ax.axhline(edge, color="#c0392b", ls="--", lw=1.1, label="band edges")


def _masked_panel(ax, cell: dict[str, Any], arms: list[str], colors: dict, dead: Any) -> None:
    """Bars per arm at each staleness (the baseline's would-be share hatched); dotted: the dead-band threshold."""
    present = [a for a in arms if a in cell["arms"]]
    stale = {a: _by_staleness(cell["arms"][a], a) for a in present}
    levels = sorted({s for v in stale.values() for s in v})
    width = 0.8 / max(len(present), 1)
    for i, arm in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j, s in enumerate(levels) if s in stale[arm]]
        ys = [_num(stale[arm][s][1], math.nan) for s in levels if s in stale[arm]]
        ax.bar(
            xs,
            ys,
            width=width * 0.95,
            color=colors[arm],
            edgecolor="white",
            hatch="//" if arm == BASELINE else None,
            label=f"{arm}: {'would-be masked' if arm == BASELINE else 'masked'}",
        )
    if _num(dead):
        ax.axhline(dead, color="black", ls=":", lw=1, label=f"dead-band threshold {fmt(dead)}")
    steps = [_mean(stale[a][s][0] for a in present if s in stale[a]) for s in levels]
    ax.set_xticks(range(len(levels)), [f"{s}\n({_plural(n, 'step')})" for s, n in zip(levels, steps, strict=True)])
    ax.set_xlabel("staleness (policy updates since the sampler was refreshed)")


def _yerr(mid: float, lo: float | None, hi: float | None) -> list[list[float]] | None:
    """Error bar lengths below and above ``mid`` (none without both ends; never negative)."""
    return None if lo is None or hi is None else [[max(mid - lo, 0.0)], [max(hi - mid, 0.0)]]


def _plot_evals(path: Path, results: dict, arms: list[str], colors: dict) -> None:
    """Left: pass@1 per cell and arm against the base; right: each comparison's delta against the floor."""
    from matplotlib.figure import Figure

    cells = results["cells"]
    fig = Figure(figsize=(max(12.0, 2.2 * len(cells) + 4), 5.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    base = results.get("base") or {}
    base_mean, floor = _mean(base.get("pass_at_1") or []), _num(base.get("noise_floor"))
    if base_mean is not None:
        if floor:
            left.axhspan(
                base_mean - floor,
                base_mean + floor,
                color=COLORS["base"],
                alpha=0.15,
                lw=0,
                label=f"base ± noise floor {fmt_share(floor)}",
            )
        left.axhline(base_mean, color=COLORS["base"], ls="--", lw=1.5, label=f"base mean {fmt_share(base_mean)}")
    column, slot = {id(c): j for j, c in enumerate(cells)}, 0.8 / len(arms)  # x: cell, then arm within it
    for cell, name, arm in _each(results, arms):
        x, seeds = column[id(cell)] + (arms.index(name) - (len(arms) - 1) / 2) * slot, _per_seed(results, arm)
        for k, (v, why) in enumerate(seeds):
            dx = x + slot * 0.2 + (k - (len(seeds) - 1) / 2) * slot * 0.12
            left.scatter(
                [dx],
                [_num(v, math.nan)],
                marker="x" if why else "o",
                s=40 if why else 14,
                color=colors[name],
                lw=1.6 if why else 0,
                zorder=3,
                label="diverged seed" if why else None,
            )
        mean, (lo, hi) = _num(arm.get("pass_at_1_mean")), _pair(arm.get("pass_at_1_ci"))
        if mean is not None:
            left.errorbar(
                [x - slot * 0.12],
                [mean],
                _yerr(mean, lo, hi),
                fmt="o",
                ms=6,
                color=colors[name],
                mec="black",
                mew=0.6,
                capsize=3,
                zorder=4,
                label=f"{name}: mean, 95% interval",
            )
    left.set_ylim(max(left.get_ylim()[0], -0.05), min(left.get_ylim()[1], 1.05))  # an interval may reach past 0 or 1
    left.set_ylabel("pass@1 on the held-out tasks")
    left.set_title("pass@1 per cell and arm")
    comps = _comparisons(results)
    primary = next(((cell, k, c) for cell, k, c in comps if _is_primary(results, cell, k)), None)
    keys = list(dict.fromkeys(k for _, k, _ in comps))
    for j, cell in enumerate(cells):
        mine = [(k, c) for owner, k, c in comps if owner is cell]
        f = next((v for _, c in mine if (v := _num(c.get("noise_floor")))), None)
        if f:
            right.fill_between([j - 0.45, j + 0.45], -f, f, color="0.88", lw=0, label="± noise floor")
        for k, c in mine:
            x = j + (keys.index(k) - (len(keys) - 1) / 2) * (0.8 / len(keys))
            d, lo, hi = _num(c.get("delta")), _num(c.get("ci_low")), _num(c.get("ci_high"))
            size = 8 if _is_primary(results, cell, k) else 5  # the primary comparison stands out
            if d is not None:
                right.errorbar(
                    [x],
                    [d],
                    _yerr(d, lo, hi),
                    fmt="o",
                    color=colors.get(c.get("after"), "black"),
                    capsize=4,
                    ms=size,
                    mec="black",
                    label=_name(k, c),
                )
    right.axhline(0, color="black", lw=0.8)
    right.set_ylabel("delta pass@1, after − before (95% interval)")
    title = f"Verdict: {results['verdict']}"
    if primary:
        cell, k, c = primary
        title += f"\n{_name(k, c)} at {_where(cell)}:\n{fmt_signed(c.get('delta'))} "
        title += fmt_interval(c.get("ci_low"), c.get("ci_high"))
    right.set_title(title, fontsize=10)
    rows = 0
    for ax in (left, right):
        ax.set_xticks(range(len(cells)), [_short(c, cells) for c in cells])
        ax.set_xlim(-0.6, len(cells) - 0.4)
        ax.grid(axis="y", alpha=0.3)
        # below its panel, where it hides no seed: a plan with many arms has as many labels as points in a corner
        entries = _legend(ax, [ax], loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=LEGEND_COLUMNS)
        rows = max(rows, -(-entries // LEGEND_COLUMNS))
    fig.set_size_inches(fig.get_size_inches()[0], 5.2 + 0.2 * rows)
    _save(fig, path)


def _has_eval_curve(results: dict[str, Any]) -> bool:
    return any(isinstance(arm.get("eval_curve"), dict) for cell in results["cells"] for arm in cell["arms"].values())


def _eval_curve_panel(ax, cell: dict[str, Any], arms: list[str], colors: dict, base: dict[str, Any]) -> None:
    """pass@1 at each evaluated policy step: each seed thin, the mean over seeds thick; the base band in grey."""
    base_mean, floor = _mean(base.get("pass_at_1") or []), _num(base.get("noise_floor"))
    if base_mean is not None:
        ax.axhspan(
            base_mean - (floor or 0),
            base_mean + (floor or 0),
            color=COLORS["base"],
            alpha=0.15,
            lw=0,
            label="base mean ± noise floor",
        )
    for name in [a for a in arms if isinstance(cell["arms"].get(a, {}).get("eval_curve"), dict)]:
        curve = cell["arms"][name]["eval_curve"]
        steps = curve.get("policy_steps") or []
        for values in (curve.get("per_seed") or {}).values():
            ax.plot(steps, [_num(v, math.nan) for v in values], color=colors[name], lw=0.8, alpha=0.4)
        ax.plot(
            steps,
            [_num(v, math.nan) for v in curve.get("mean") or []],
            color=colors[name],
            lw=2.2,
            marker="o",
            ms=3,
            label=f"{name}: mean over seeds",
        )
    ax.set_xlabel("policy step")


def _has_ess(log: list[dict[str, Any]] | None) -> bool:
    return log is not None and any(isinstance(r.get("ratio_ess_share"), (int, float)) for r in log)


def _write_plots(results: dict[str, Any], log: list[dict[str, Any]] | None, plots: Path) -> None:
    """The PNGs under ``plots``: those with a panel per cell, then the evals. Without a log only those drawn from
    results.json (the masked share, the eval curve and the evals); the log's plots already there are left alone."""
    cells, arms, runs = results["cells"], _arms(results), _runs(log or [])
    colors = {a: COLORS.get(a) or SPARE_COLORS[i % len(SPARE_COLORS)] for i, a in enumerate(arms)}
    figures = {
        "reward": (
            "Training reward per step",
            "training reward",
            lambda ax, c: _steps_panel(ax, runs.get(c["name"], {}), arms, colors, "reward_mean"),
        ),
        "masked_share": (
            "Masked share by staleness (mean over seeds)",
            "share of generated tokens",
            lambda ax, c: _masked_panel(ax, c, arms, colors, _config(results).get("dead_band_share")),
        ),
        "ratio_max": (
            "Worst token's ratio per step against the band",
            "max ratio π_trainer / π_sampler",
            lambda ax, c: (
                _steps_panel(ax, runs.get(c["name"], {}), arms, colors, "ratio_max"),
                _band_axis(ax, c["band"]),
            ),
        ),
    }
    if _has_ess(log):
        figures[ESS_PLOT[0]] = (
            "Effective sample size of the ratios per step",
            "ESS / action tokens",
            lambda ax, c: _steps_panel(ax, runs.get(c["name"], {}), arms, colors, "ratio_ess_share"),
        )
    if log is None:
        figures = {k: v for k, v in figures.items() if k not in LOG_PLOTS}
    if log is not None and _has_mismatch(log):
        figures[MISMATCH_PLOT[0]] = (
            "Where the ratio comes from: the engine's numerics against staleness",
            "mean |log r| per action token",
            lambda ax, c: _mismatch_panel(ax, runs.get(c["name"], {}), arms, colors),
        )
    if _has_phases(log):
        figures[PHASES_PLOT[0]] = (
            "Where each step's time goes (mean over the cell's runs)",
            "seconds",
            lambda ax, c: _phases_panel(ax, runs.get(c["name"], {})),
        )
    if _has_eval_curve(results):
        base = results.get("base") or {}
        figures[EVAL_CURVE[0]] = (
            "Held-out pass@1 over policy steps",
            "pass@1",
            lambda ax, c: _eval_curve_panel(ax, c, arms, colors, base),
        )
    for stem, (title, ylabel, draw) in figures.items():
        fig, axes = _panels(cells)
        for cell in cells:
            draw(axes[cell["name"]], cell)
            axes[cell["name"]].set_ylabel(ylabel)
        fig.suptitle(title)
        _legend(fig, axes.values(), loc="outside lower center", ncol=4)
        _save(fig, plots / f"{stem}.png")
    _plot_evals(plots / "evals.png", results, arms, colors)


# ---------------------------------------------------------------------------------------------------------
# report.md


def _verdict_words(c: dict[str, Any], key: str = "verdict", bold: bool = False) -> str:
    """The verdict for a table cell, bold where it separates (or always, with ``bold``), with its size against δ
    where one was recorded: "**regressed**, by less than δ"."""
    verdict = _cell(c.get(key) or DASH)
    separates = bold or verdict in SEPARATED or verdict in stats.COLLAPSE_VERDICTS
    text = f"**{verdict}**" if separates else verdict
    finding = c.get("finding") if key == "verdict" else None
    if isinstance(finding, str) and c.get("magnitude") and finding.startswith(str(c.get(key))):
        text += _cell(finding[len(str(c.get(key))) :])
    return text


def _comparison_table(
    found: list[tuple[dict[str, Any], str, dict[str, Any]]], what: str, before: str, first: str = "cell"
) -> list[str]:
    """One row per (cell, label, comparison), then each comparison's reason in words; ``first`` heads the column of
    the cells' names."""
    rows = []
    for cell, label, c in found:
        rows.append(
            [
                _cell(cell["name"]),
                label,
                fmt_share(c.get("before_mean")),
                fmt_share(c.get("after_mean")),
                fmt_signed(c.get("delta")),
                fmt_interval(c.get("ci_low"), c.get("ci_high")),
                f"±{fmt_share(c.get('noise_floor'))}",
                f"{_cell(c.get('unit', DASH))} ({fmt(c.get('n'))})"
                + (f"<br>{_cell(c['about'])}" if c.get("about") not in (None, "training procedure") else ""),
                _verdict_words(c),
            ]
        )
    level = f"{_level(found[0][2].get('alpha') if found else None, 1)} interval"  # 95% at the default alpha
    header = [first, what, f"{before} mean", "arm mean", "delta", level, "noise floor", "unit (n)", "verdict"]
    reasons = [f"- {_text(cell['name'])}, {label}: {_text(c.get('reason') or DASH)}" for cell, label, c in found]
    return [*_table(header, rows), *reasons, ""]


def _summary(results: dict[str, Any], comps: list) -> list[str]:
    """Two sentences for a grid, written from the verdicts and the baseline's divergence counts."""
    if len(results["cells"]) < 2:
        return []
    separated = [
        f"{_name(k, c)} {c['verdict']} at {_where(cell)} ({fmt_signed(c.get('delta'))} "
        f"{fmt_interval(c.get('ci_low'), c.get('ci_high'))})"
        for cell, k, c in comps
        if c.get("verdict") in SEPARATED
    ]
    verdicts = [str(c.get("verdict") or DASH) for _, _, c in comps]
    tally = ", ".join(f"{v} {verdicts.count(v)}" for v in sorted(set(verdicts)))
    text = f"{len(separated)} of {_plural(len(comps), 'comparison')} separated" + (
        f": {_join(separated)}." if separated else f" (verdicts: {tally})."
    )
    broke = [
        f"{_where(cell)} ({n}/{runs})"
        for cell in results["cells"]
        if BASELINE in cell["arms"]
        for n, runs in [_diverged(cell["arms"][BASELINE])]
        if n
    ]
    text += f" `{BASELINE}` diverged in a seed of {len(broke)} of {_plural(len(results['cells']), 'cell')}"
    return [f"**Summary** (written by code from results.json). {text}" + (f": {_join(broke)}." if broke else "."), ""]


def _headline(results: dict[str, Any]) -> str:
    """The verdict in bold, and its size against δ where the primary comparison recorded one."""
    done = results.get("confirmation")
    first = done.get("primary") if isinstance(done, dict) else None
    if not isinstance(first, dict):
        first = next((c for cell, k, c in _comparisons(results) if _is_primary(results, cell, k)), None)
    if isinstance(first, dict) and first.get("verdict") == results["verdict"] and first.get("magnitude"):
        return _verdict_words(first, bold=True)
    return f"**{_text(results['verdict'])}**"


def _verdict_section(results: dict[str, Any]) -> list[str]:
    out = [f"## Verdict: {_headline(results)}", "", _text(results.get("reason") or DASH), ""]
    comps = _comparisons(results)
    if not comps:
        return [*out, "results.json holds no comparison.", ""]
    named = [(cell, _name(k, c) + (" (primary)" if _is_primary(results, cell, k) else ""), c) for cell, k, c in comps]
    out += _comparison_table(named, "comparison", BASELINE)
    proxies = [
        [_cell(cell["name"]), name, fmt_signed(c.get("proxy_delta")), fmt(c.get("proxy_diverges"))]
        for cell, name, c in named
        if "proxy_delta" in c
    ]
    if proxies:
        out += _table(
            [
                "cell",
                "comparison",
                "proxy delta (training reward, last 10 steps)",
                "proxy rises while the target falls",
            ],
            proxies,
        )
    if len(comps) > 1 and results.get("confirmation"):
        out += [
            "Each interval here is its own 95% interval; the planned family's Holm-adjusted p-values and the "
            "verdicts after the correction are in *What came out*, above.",
            "",
        ]
    elif len(comps) > 1:
        n = _plural(len(comps), "comparison")
        out += [
            f"Each interval is its own 95% interval, with no correction for multiple comparisons across the {n}: "
            "by chance alone about 1 in 20 misses the true delta.",
            "",
        ]
    return out + _summary(results, comps)


def _pass_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    base = results.get("base") or {}
    values, evals = base.get("pass_at_1") or [], base.get("evals") or []
    evals_of_base = evals
    rows = [
        [
            _cell(e.get("label") or f"base-{i}"),
            fmt_share(v),
            fmt(e.get("mean_reply_tokens")),
            fmt_share(e.get("truncation_share")),
        ]
        for i, v in enumerate(values)
        for e in [evals[i] if i < len(evals) else {}]
    ]
    out = ["## pass@1", ""]
    if rows:
        rows.append(["**base mean**", f"**{fmt_share(_mean(values))}**", "", ""])
        out += _table(["base eval", "pass@1", "mean reply tokens", "truncation share"], rows, text=1)
        out += [
            f"The untrained model's pass@1 over {_plural(len(values), 'repeated eval')}: run_std "
            f"{fmt(base.get('run_std'))} over {fmt(base.get('runs'))} runs gives the noise floor "
            f"±{fmt_share(base.get('noise_floor'))}, shared by every cell: a delta within it is "
            "indistinguishable from re-evaluating the same model.",
            "",
        ]
    else:
        out += ["results.json holds no base eval, so no noise floor.", ""]
    rows, notes = [], []
    for cell, name, arm in _each(results, arms):
        runs, evals = arm.get("runs") or {}, arm.get("evals") or []
        count = "{}/{}".format(*_diverged(arm))
        why = [f"{_text(k)}: {_text(', '.join(map(str, r['diverged'])))}" for k, r in runs.items() if r.get("diverged")]
        if why:
            notes.append(f"- [d{len(notes) + 1}] {_text(cell['name'])}, {name}: {'; '.join(why)}")
            count += f" [d{len(notes)}]"
        rows.append(
            [
                _cell(cell["name"]),
                name,
                fmt_share(arm.get("pass_at_1_mean")),
                "[{}, {}]".format(*map(fmt_share, _pair(arm.get("pass_at_1_ci")))),
                ", ".join(fmt_share(v) + ("†" if w else "") for v, w in _per_seed(results, arm)) or DASH,
                fmt(_mean(e.get("mean_reply_tokens") for e in evals)),
                fmt_share(_mean(e.get("truncation_share") for e in evals)),
                count,
            ]
        )
    out += [
        "Each arm: the mean over seeds with its 95% t interval over seeds (it can reach below 0 with few "
        "seeds), each seed's value († a diverged seed); reply tokens and truncation share are means over "
        "the arm's evals.",
        "",
    ]
    out += _table(
        ["cell", "arm", "pass@1 mean", "95% interval", "per seed", "mean reply tokens", "truncation share", "diverged"],
        rows,
    )
    trained = [e for _, _, arm in _each(results, arms) for e in arm.get("evals") or []]
    out += _cut_off_line(results, [*evals_of_base, *trained])
    if notes:
        return [*out, "Diverged runs, with the reasons recorded:", "", *notes, ""]
    return [*out, "No run diverged.", ""]


def _cut_off_line(results: dict[str, Any], evals: list[dict[str, Any]]) -> list[str]:
    """How the evals scored replies cut off at the token limit, and how many there were (when recorded)."""
    counted = [e for e in evals if isinstance(e, dict) and "truncated_replies" in e]
    if not counted:
        return []
    rule = _config(results).get("truncated_reward")
    how = {
        "zero": "score 0 (`truncated_reward` zero: our choice, not the page's)",
        "grade": "are graded like any reply (`truncated_reward` grade)",
    }.get(rule, f"are scored as {_text(rule)}")
    samples = sum(len(e.get("per_task") or []) * int(_num(e.get("samples"), 0)) for e in counted)
    cut = sum(int(_num(e.get("truncated_replies"), 0)) for e in counted)
    credit = sum(int(_num(e.get("truncated_with_credit"), 0)) for e in counted)
    return [
        f"Replies cut off at the token limit {how}: {cut} of {samples} eval samples were cut off, and the grader "
        f"would have credited {credit} of them.",
        "",
    ]


def _vs_base_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    found = [
        (cell, name, c)
        for cell, name, _ in _each(results, arms)
        if (c := (cell.get("vs_base") or {}).get(name)) is not None
    ]
    out = ["## Each arm against the base", ""]
    if not found:
        return [*out, "results.json holds no comparison with the base (no base eval was run).", ""]
    return out + _comparison_table(found, "arm", "base")


def _reach_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    rows = []
    for cell, name, arm in _each(results, arms):
        m, w, r, kl = (
            (arm.get("curves") or {}).get(k) or {}
            for k in ("masked_share", "would_be_masked_share", "ratio_max", "kl_sampler_policy")
        )
        rows.append(
            [
                _cell(cell["name"]),
                name,
                _share_pct(m.get("mean")),
                fmt_share(m.get("max")),
                _share_pct(w.get("mean")),
                fmt_share(w.get("max")),
                fmt(r.get("max")),
                fmt(kl.get("mean")),
                fmt(kl.get("max")),
            ]
        )
    out = [
        "## Reachability",
        "",
        "The masked share is what the arm's rule masked; the would-be share what the band "
        "would have masked on that arm. Policy steps, the step-wise mean over seeds.",
        "",
    ]
    out += _table(
        [
            "cell",
            "arm",
            "masked share, mean per step",
            "masked, worst step",
            "would-be masked share, mean",
            "would-be, worst step",
            "max ratio, worst step",
            "KL mean",
            "KL max",
        ],
        rows,
    )
    pairs = [(f"{a}: {'would-be masked' if a == BASELINE else 'masked'} share", f"{a}: median max ratio") for a in arms]
    header, rows = ["cell", "staleness", "steps per run", *(h for pair in pairs for h in pair)], []
    for cell in results["cells"]:
        stale = {a: _by_staleness(arm, a) for a, arm in cell["arms"].items()}
        for s in sorted({s for v in stale.values() for s in v}):
            got = [stale.get(name, {}).get(s, (None, None, None)) for name in arms]
            rows.append(
                [
                    _cell(cell["name"]),
                    str(s),
                    fmt_count(_mean(v[s][0] for v in stale.values() if s in v)),
                    *(text for g in got for text in (fmt_share(g[1]), fmt(g[2]))),
                ]
            )
    if rows:
        out += ["Masked share by staleness (policy steps; each value the mean over seeds):", ""]
        out += _table(header, rows, text=1)
    warnings = results.get("warnings") or []
    if not warnings:
        return [*out, "No reachability warning was raised during training.", ""]
    return [
        *out,
        f"Training raised {_plural(len(warnings), 'reachability warning')}:",
        "",
        *(f"> {_cell(w)}" for w in warnings),
        "",
    ]


OUTSIDE_SHOWN = 5  # the tokens outside the band listed per cell and arm


def _outside(arm: dict[str, Any]) -> tuple[list[list[Any]], list[int], list[int]]:
    """Over an arm's runs: (the tokens outside the band as [text, below, above, seen], most frequent first; outside
    per tenth of the reply; action tokens per tenth), summed from each run's checks."""
    totals: dict[str, list[int]] = {}
    by_position: list[int] = []
    tokens: list[int] = []
    for run in (arm.get("runs") or {}).values():
        c = run.get("checks") or {}
        for entry in c.get("outside_band_tokens") or []:
            if isinstance(entry, list) and len(entry) == 4:
                got = totals.setdefault(str(entry[0]), [0, 0, 0])
                for i in range(3):
                    got[i] += int(_num(entry[i + 1], 0))
        for key, into in (("outside_band_by_position", by_position), ("tokens_by_position", tokens)):
            values = [int(_num(v, 0)) for v in c.get(key) or []]
            if values and len(values) == (len(into) or len(values)):
                into[:] = [a + b for a, b in zip(into or [0] * len(values), values, strict=True)]
    top = sorted(totals.items(), key=lambda kv: (-(kv[1][0] + kv[1][1]), kv[0]))
    return [[text, *counts] for text, counts in top], by_position, tokens


def _off_policy_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    """The ratios' effective sample size and the masked share by the band's side (policy steps, from the curves),
    and which tokens fell outside the band and where in the reply (from each run's checks): for runs that logged
    them; nothing for a results.json written before."""
    rows, token_rows, place_rows = [], [], []
    for cell, name, arm in _each(results, arms):
        curves = arm.get("curves") or {}
        if isinstance(curves.get("ratio_ess_share"), dict):
            ess, *sides = (
                curves.get(k) or {}
                for k in (
                    "ratio_ess_share",
                    "masked_share_low",
                    "masked_share_high",
                    "would_be_masked_share_low",
                    "would_be_masked_share_high",
                )
            )
            rows.append(
                [
                    _cell(cell["name"]),
                    name,
                    fmt_share(ess.get("mean")),
                    fmt_share(ess.get("min")),
                    *(fmt_share(side.get("mean")) for side in sides),
                ]
            )
        top, by_position, tokens = _outside(arm)
        for text, below, above, seen in top[:OUTSIDE_SHOWN]:
            token_rows.append(
                [
                    _cell(cell["name"]),
                    name,
                    _cell(json.dumps(text, ensure_ascii=False)),
                    str(below),
                    str(above),
                    str(seen),
                    fmt_share((below + above) / seen if seen else None),
                ]
            )
        if by_position and len(by_position) == len(tokens):
            shares = [fmt_share(o / t if t else None) for o, t in zip(by_position, tokens, strict=True)]
            place_rows.append([_cell(cell["name"]), name, *shares])
    if not rows and not token_rows:
        return []
    out = ["## Off-policy diagnostics", ""]
    if rows:
        out += [
            "Per policy step, the mean over steps of the step-wise mean over seeds: the effective sample size of "
            "the trainer/sampler ratios as a share of the action tokens, (Σ r)² / (N Σ r²), and the masked share "
            "split by the band's side (at or below its low edge, at or above its high edge); the would-be shares "
            "are the band's on any rule.",
            "",
        ]
        out += _table(
            [
                "cell",
                "arm",
                "ESS share, mean",
                "ESS share, worst step",
                "masked low",
                "masked high",
                "would-be low",
                "would-be high",
            ],
            rows,
        )
    if token_rows:
        out += [
            f"The tokens most often outside the band (at most {OUTSIDE_SHOWN} per cell and arm), summed over the "
            "runs' policy steps: how often each fell below and above the band and how often it was written. On "
            "`dis` these are the masked tokens; on `none` the ones the band would have masked.",
            "",
        ]
        out += _table(["cell", "arm", "token", "below", "above", "seen", "share outside"], token_rows, text=3)
    if place_rows:
        out += [
            "Where in the reply: the share of action tokens outside the band in each tenth of the reply (by a "
            "token's place among its reply's action tokens).",
            "",
        ]
        out += _table(["cell", "arm", *(f"tenth {i + 1}" for i in range(len(place_rows[0]) - 2))], place_rows)
    return out


def _median(values: Iterable[Any]) -> float | None:
    kept = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
    return statistics.median(kept) if kept else None


def _defined_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    """The arms a plan or grid defined by name, with the settings each trained with (doses, ablations)."""
    rows, seen = [], set()
    for _, name, arm in _each(results, arms):
        if isinstance(arm.get("settings"), dict) and name not in seen:
            seen.add(name)
            extra = {k: v for k, v in arm["settings"].items() if k not in ("correction", "baseline")}
            rule, baseline = (arm.get(k) or arm["settings"].get(k) for k in ("correction", "baseline"))
            rows.append(
                [
                    name,
                    _cell(fmt(rule)),
                    _cell(fmt(baseline)),
                    _cell(", ".join(f"{k} {fmt(v)}" for k, v in extra.items()) or DASH),
                ]
            )
    if not rows:
        return []
    return [
        "## Arms defined by the plan",
        "",
        "Each trains with these settings over the shared configuration, with "
        "the same seeds as the other arms of its cell; its masked share and effective sample size are in the "
        "tables above.",
        "",
        *_table(["arm", "rule", "baseline", "settings"], rows, text=4),
    ]


def _ceiling_section(results: dict[str, Any], arms: list[str], probe: dict[str, Any] | None) -> list[str]:
    """The oracle ceiling's snapshots against the critic (``--ceiling-every``), the oracle baseline's draws, and the
    probe (``sao probe``, where the folder holds its probe.json): medians over each arm's runs."""
    rows, oracle_rows = [], []
    for cell, name, arm in _each(results, arms):
        shots: dict[str, list[dict[str, Any]]] = {}
        drawn = []
        for run in (arm.get("runs") or {}).values():
            c = run.get("checks") or {}
            for shot in c.get("ceiling") or []:
                if isinstance(shot, dict):
                    shots.setdefault(str(shot.get("snapshot")), []).append(shot)
            if isinstance(c.get("oracle_baseline"), dict):
                drawn.append({**c["oracle_baseline"], "critic": c.get("critic_ev_last10")})
        for label, got in shots.items():
            rows.append(
                [
                    _cell(cell["name"]),
                    name,
                    _cell(label),
                    str(len(got)),
                    *(
                        fmt(_median(g.get(k) for g in got))
                        for k in ("mean", "prompt_level", "token_level", "critic_ev", "critic_share")
                    ),
                ]
            )
        if drawn:
            oracle_rows.append(
                [
                    _cell(cell["name"]),
                    name,
                    fmt(drawn[0].get("samples")),
                    *(
                        fmt(_median(d.get(k) for d in drawn))
                        for k in ("shrinkage_mean", "batch_ceiling_mean", "ev_last10", "critic")
                    ),
                ]
            )
    probed = (probe or {}).get("summary") or []
    if not rows and not oracle_rows and not probed:
        return []
    out = ["## The critic against what was reachable", ""]
    if rows:
        out += [
            "At each snapshot the same training prompts were rolled out K times each by the sampler. The ceiling "
            "is the explained variance a baseline that knows each prompt's success rate could reach, 1 − E[Var(R "
            "| prompt)] / Var(R) (Var(p) / p̄(1 − p̄) for 0/1 rewards), without the K-sample bias: per trajectory, "
            "and per token (each rollout weighted by its action tokens, the units of the critic's explained "
            "variance). The critic's explained variance is measured on those same rollouts; its share is that "
            "over the per-token ceiling. A critic reads the reply so far as well as the prompt, so it can exceed "
            "a prompt-level ceiling; a ceiling near 0 says the prompts hardly differ in difficulty. Medians over "
            "the arm's runs.",
            "",
        ]
        out += _table(
            [
                "cell",
                "arm",
                "snapshot",
                "runs",
                "success rate",
                "ceiling per trajectory",
                "ceiling per token",
                "critic EV",
                "critic's share",
            ],
            rows,
            text=3,
        )
    if oracle_rows:
        out += [
            "The oracle baseline: every step, each prompt of the batch rolled out K more times by the sampler "
            "that drew it (never trained on), its rate shrunk toward their mean by the empirical-Bayes weight. "
            "Its explained variance is the baseline's own (the update's); the critic's is the head that trains "
            "beside it. Medians over the arm's runs of each run's mean.",
            "",
        ]
        out += _table(
            [
                "cell",
                "arm",
                "K",
                "shrinkage weight",
                "ceiling of each batch's prompts",
                "oracle baseline EV, last 10",
                "critic EV, last 10",
            ],
            oracle_rows,
        )
    if probed:
        out += [
            "`sao probe`: a ridge regression from the trunk's hidden state (at each prompt's last token, and per "
            "token) to the prompts' K-sample success rates, cross-validated by prompt; R² near 0 or below: the "
            "state carries nothing of the difficulty the probe can use. The signal share is the most R² could "
            "reach (the rest of the rates' variance is sampling noise). Medians over the probed runs.",
            "",
        ]
        out += _table(
            ["snapshot", "runs", "R² at the last prompt token", "R² per token", "signal share"],
            [
                [
                    _cell(p.get("snapshot")),
                    fmt(p.get("runs")),
                    fmt(p.get("prompt_token_r2")),
                    fmt(p.get("per_token_r2")),
                    fmt(p.get("signal_share")),
                ]
                for p in probed
            ],
            text=1,
        )
    return out


CHECKS = [  # (column, the keys shown joined by →, formatter), one row per run
    ("critic EV at warmup end", ("critic_ev_warmup_end",), fmt),
    ("critic EV, last 10", ("critic_ev_last10",), fmt),
    ("critic loss, warmup end → last 10", ("critic_loss_warmup_end", "critic_loss_last10"), fmt),
    ("grad norm mean", ("grad_norm_mean",), fmt),
    ("grad norm max", ("grad_norm_max",), fmt),
    ("clip at {clip} ever bound", ("clip_ever_bound",), fmt),
    ("clip-bound steps", ("clip_bound_steps",), fmt),
    ("non-finite tokens", ("nonfinite_tokens",), fmt_count),
    ("skipped steps", ("skipped_steps",), fmt),
    ("lag-0 \\|log ratio\\| mean", ("lag0_abs_log_ratio_mean",), fmt),
    ("lag-0 \\|log ratio\\| max", ("lag0_abs_log_ratio_max",), fmt),
    ("masked share, worst step", ("masked_share_max",), fmt_share),
    ("reward first 10 → last 10", ("reward_first10", "reward_last10"), fmt_share),
    ("response length, last 10", ("response_length_last10",), fmt),
    ("truncation share, last 10", ("truncation_share_last10",), fmt_share),
]


def _checks_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    clip = fmt(_config(results).get("grad_clip"))
    rows = [
        [_cell(cell["name"]), _cell(label), *(" → ".join(f(c.get(k)) for k in keys) for _, keys, f in CHECKS)]
        for cell, _, arm in _each(results, arms)
        for label, run in (arm.get("runs") or {}).items()
        for c in [run.get("checks") or {}]
    ]
    header = ["cell", "run", *(name.format(clip=clip) for name, _, _ in CHECKS)]
    return ["## Checks", "", *_table(header, rows)] if rows else []


def _curves_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    rows = []
    for key in KEY_SERIES:
        f = fmt_share if key in SHARE_SERIES else fmt
        for cell, name, arm in _each(results, arms):
            if (fold := (arm.get("curves") or {}).get(key)) is not None:
                values = [f(fold.get(k)) for k in ("first", "last", "mean", "max", "min")]
                rows.append([key, _cell(cell["name"]), name, *values, fmt(fold.get("n"))])
    header = ["series", "cell", "arm", "first", "last", "mean", "max", "min", "steps"]
    note = "Policy steps only; for several seeds, the step-wise mean over seeds."
    return ["## Training curves", "", note, "", *_table(header, rows, text=3)] if rows else []


def _time_section(
    results: dict[str, Any], log: list[dict[str, Any]] | None, arms: list[str], timelines: list[str]
) -> list[str]:
    """Mean seconds per step of each phase, by cell and arm (from the log, when there is one), and the link to every
    run's timeline."""
    if not _has_phases(log) and not timelines:
        return []
    runs, rows = _runs(log) if _has_phases(log) else {}, []
    for cell in results["cells"]:
        for arm in [a for a in arms if a in runs.get(cell["name"], {})]:
            records = [r for seed_rows in runs[cell["name"]][arm].values() for r in seed_rows]
            means, step = _phase_means(records), _mean(r.get("time") for r in records)
            parts = ", ".join(f"{k} {fmt(v)} ({v / step:.0%})" for k, v in means.items() if step)
            rows.append([_cell(cell["name"]), arm, fmt_seconds(step), _cell(parts or DASH)])
    note = (
        "Mean seconds per step of each phase, over the arm's seeds (train_log.json's `time_*`; they add up to "
        "`time`, `other` being the rest)."
    )
    out = ["## Where the time goes", ""]
    if rows:
        out += [note, "", *_table(["cell", "arm", "step", "phases"], rows, text=2)]
    if timelines:
        out += [
            "Each run's timeline (Chrome trace event format: open it in Perfetto, ui.perfetto.dev, or "
            "chrome://tracing): every phase, every trajectory's draw with its version and staleness, every "
            "environment call, adapter publish and load.",
            "",
            *(f"- [{_text(path)}]({path})" for path in timelines),
            "",
        ]
    return out


def _examples_section(results: dict[str, Any], arms: list[str]) -> list[str]:
    cell = results["cells"][0]["arms"]
    firsts = [(results.get("base") or {}).get("evals") or [], *(cell[a].get("evals") or [] for a in arms if a in cell)]
    rows = [
        [
            _cell(evals[0].get("label", DASH)),
            *(_cell(ex.get(k, DASH)) for k in ("question", "reply", "gold")),
            fmt(ex.get("correct")),
        ]
        for evals in firsts
        if evals
        for ex in (evals[0].get("examples") or [])[:EXAMPLES_PER_MODEL]
    ]
    header = ["eval", "question", "reply", "gold", "correct"]
    return ["## Example eval replies", "", *_table(header, rows, text=len(header))] if rows else []


def _tail_sections(results: dict[str, Any]) -> list[str]:
    """Wall time, configuration with the data counts, and versions."""
    wall = results.get("wall_time") or {}
    rows = [
        [f"{phase} {_cell(label)}", fmt_seconds(s)]
        for phase in ("train", "eval")
        for label, s in (wall.get(phase) or {}).items()
    ]
    rows += [[label, fmt_seconds(wall[k])] for k, label in WALL_TOTALS.items() if k in wall]
    out = ["## Wall time", "", *_table(["phase", "time"], rows, text=1)] if rows else []
    config, per_cell = _config(results), len(results["cells"]) > 1
    keys = [k for k in CONFIG_KEYS if k in config and not (per_cell and k in ("lag", "lr", "ratio"))]
    out += ["## Configuration", "", *(["Shared by every cell; lag, lr and band are set per cell.", ""] * per_cell)]
    out += _table(["setting", "value"], [[k, _cell(fmt(config[k]))] for k in keys], text=2)
    if results.get("data"):
        out += ["Data: " + ", ".join(f"{_cell(k)} {_cell(fmt(v))}" for k, v in results["data"].items()) + ".", ""]
    versions = [[_cell(k), _cell(v)] for k, v in (results.get("versions") or {}).items()]
    out += ["## Versions", "", *_table(["package", "version"], versions or [[DASH, DASH]], text=2)]
    return out + _provenance_section(results)


def _provenance_section(results: dict[str, Any]) -> list[str]:
    """The hashes and the machine this invocation ran with (results.json's ``provenance``), when recorded."""
    p = results.get("provenance")
    if not isinstance(p, dict):
        return [
            f"## {ORIGIN}",
            "",
            "results.json records no hashes of its model and data (written before sao recorded them).",
            "",
        ]
    model, data = p.get("model") or {}, p.get("data") or {}
    machine, code = p.get("machine") or {}, p.get("code") or {}
    commit = str(code.get("commit") or DASH) + (" (source differs from it)" if code.get("dirty") else "")
    rows = [
        ["model", _cell(model.get("name", DASH))],
        ["model weights sha256", _cell(model.get("weights_sha256"))],
        ["tokenizer sha256", _cell(model.get("tokenizer_sha256"))],
        ["training prompts sha256", f"{_cell(data.get('train_sha256'))} ({fmt(data.get('train'))})"],
        ["held-out tasks sha256", f"{_cell(data.get('test_sha256'))} ({fmt(data.get('test'))})"],
        [
            "CPU",
            f"{_cell(machine.get('cpu'))}, {_cell(machine.get('cpu_capability'))}, {fmt(machine.get('cores'))} cores",
        ],
        [
            "torch threads (intra-op, inter-op)",
            f"{fmt(machine.get('torch_threads'))}, {fmt(machine.get('torch_interop_threads'))}",
        ],
        ["GPU", _cell(machine.get("gpu") or DASH)],
        ["sao commit", _cell(commit)],
    ]
    out = [
        f"## {ORIGIN}",
        "",
        "What this invocation ran with; every run folder and `base-evals.provenance.json` "
        "keep the same record of each invocation that made them, and a piece whose hashes differ is named in the "
        "warnings.",
        "",
    ]
    out += _table(["what", "value"], rows, text=2)
    out += [f"> warning: {_cell(w)}" for w in p.get("warnings") or []] + ([""] if p.get("warnings") else [])
    unrecorded = p.get("pieces_without_provenance") or []
    if unrecorded:
        out += [
            f"{_plural(len(unrecorded), 'piece')} record no hashes (made before sao recorded them): "
            f"{_text(', '.join(unrecorded))}.",
            "",
        ]
    return out


def _plan_section(results: dict[str, Any]) -> list[str]:
    """A planned confirmation: the plan as it was fixed before the run (its smallest effect, correction, gatekeeping
    and power), then the family's outcome after the correction."""
    plan, done = results.get("plan"), results.get("confirmation")
    if not isinstance(plan, dict) or not isinstance(done, dict):
        return []
    return [*_plan_as_fixed(plan, done, results), *_plan_outcome(plan, done)]


def _plan_as_fixed(plan: dict[str, Any], done: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """The plan's own lines: its endpoint, family, δ, correction, arms and seeds, and its power (and the power it
    realised, beside)."""
    primary, seeds = plan.get("primary") or {}, plan.get("seeds") or []
    arms = plan.get("arms") or []
    share = plan.get("random_mask_share")
    if share is None:
        at = "the share dis masked at each staleness level in the same cell and seed"
    elif isinstance(share, list | tuple):
        at = "share " + ", ".join(fmt_share(p) for p in share) + " at staleness 0, 1, ..."
    else:
        at = f"share {fmt_share(share)}"
    controls = {"random": "a random token mask at " + at, "tis": "truncated IS", "seqmask": "sequence masking"}
    named = [f"`{a}` ({controls[a]})" if a in controls else f"`{a}`" for a in arms]
    cited = plan.get("exploratory") or []
    fresh = (
        "; ".join(f"{_text(e.get('path'))} used {_seed_span(e.get('seeds') or [])}" for e in cited)
        if cited
        else "the plan cites no exploratory run"
    )
    alpha, family = plan.get("alpha"), plan.get("family") or []
    floor = (results.get("base") or {}).get("noise_floor")
    rule = plan.get("decision_rule")  # absent: the plan was written under the observed-above-delta rule
    effect = (
        f"δ = {fmt_share(plan['smallest_effect'])}: improved or regressed needs |delta| above it, flat "
        f"needs the {_level(alpha, 2)} interval inside ± δ"
        if _num(plan.get("smallest_effect")) is not None
        else f"none stated: each comparison uses this run's noise floor (±{fmt_share(floor)}) as δ"
    )
    if rule and _num(plan.get("smallest_effect")) is not None:
        effect = (
            f"δ = {fmt_share(plan['smallest_effect'])}: the verdict says the direction (improved or regressed "
            f"when the {_level(alpha, 1)} interval excludes 0, whatever the size) and apart its size: beyond δ "
            f"(the interval clears it), within δ (the {_level(alpha, 2)} interval inside ± δ; flat when the "
            "interval also covers 0) or undetermined"
        )
    if plan.get("gatekeeping"):
        correction = (
            f"gatekeeping: the primary alone at alpha {fmt(alpha)}; then {_text(plan.get('correction'))} "
            f"across the other {_plural(max(len(family) - 1, 0), 'comparison')} at alpha {fmt(alpha)}, "
            "only if the primary came out as expected (otherwise they are reported, not claimed)"
        )
    else:
        correction = f"{_text(plan.get('correction'))} across the whole family at alpha {fmt(alpha)}"
    out = [
        "## Plan (fixed before the run)",
        "",
        f"- **Plan file:** `{_text(plan.get('file'))}`, sha256 `{_text(str(plan.get('sha256'))[:16])}…` "
        f"(kept beside the results){'; written ' + _text(plan['written']) if plan.get('written') else ''}.",
        f"- **Primary endpoint:** {_text(primary.get('after'))} − {_text(primary.get('before'))} in "
        f"{_text(primary.get('cell'))}, expected **{_text(primary.get('expect'))}**.",
        f"- **Family:** {_plural(len(family), 'comparison')}: the primary, and "
        f"{_text(', '.join(plan.get('secondary') or []) or 'nothing else')} in every cell of the grid.",
        f"- **Smallest effect of interest:** {effect}.",
        *_stated_lines(plan, alpha),
        f"- **Correction:** {correction}. A flat verdict is each comparison's own equivalence test, not corrected "
        "across the family.",
        f"- **Arms:** {', '.join(named)}.",
        f"- **Seeds:** {_plural(len(seeds), 'fresh training seed')} per arm ({_seed_span(seeds)}), disjoint from "
        f"every exploratory run cited: {fresh}.",
        "",
    ]
    power = plan.get("power")
    if isinstance(power, dict):
        out[-1:] = [
            f"- **Power (computed before the run):** {_text(power.get('summary'))}.",
            *_realised_line(plan, done, results["cells"]),
            "",
        ]
        if power.get("warning"):
            out += [f"> warning: {_cell(power['warning'])}", ""]
    else:
        out[-1:] = ["- **Power:** not recorded (the plan was run before sao computed it).", ""]
    return out


def _plan_outcome(plan: dict[str, Any], done: dict[str, Any]) -> list[str]:
    """What came out: the primary's outcome, the gate, and the family's table (with the rank and collapse columns
    where the plan asked for them)."""
    alpha, first = plan.get("alpha"), done.get("primary") or {}
    out = [
        "## What came out",
        "",
        f"**Primary: {_text(done.get('outcome'))}** (expected {_text(done.get('expect'))}; after "
        f"{_text(done.get('correction'))}: {_text(first.get('finding') or first.get('verdict'))}). "
        f"{_text(first.get('reason'))}",
        "",
    ]
    gate = done.get("gate")
    if gate == "open":
        out += [
            "Gatekeeping: the primary came out as expected, so the secondary comparisons were tested, "
            "Holm-adjusted among themselves.",
            "",
        ]
    elif gate == "closed":
        out += [
            "Gatekeeping: the primary did not come out as expected, so the secondary comparisons below are "
            "reported but not claimed: each verdict is unresolved, whatever it would be alone.",
            "",
        ]
    family_rows = done.get("family") or []
    ranked = any(isinstance(r.get("rank"), dict) for r in family_rows)
    collapsing = any(isinstance(r.get("collapse"), dict) for r in family_rows)
    rows = [
        [
            _cell(r.get("cell")),
            _cell(r.get("comparison")) + (" (primary)" if i == 0 else ""),
            fmt_signed(r.get("delta")),
            fmt_interval(r.get("ci_low"), r.get("ci_high")),
            fmt(r.get("p_value")),
            _cell(r.get("p_rule") or DASH),
            fmt(r.get("p_holm")),
            fmt_share(r.get("smallest_effect")),
            _cell(r.get("verdict_unadjusted")),
            _verdict_words(r),
            *(_rank_cells(r.get("rank")) if ranked else []),
            *(_collapse_cells(r.get("collapse")) if collapsing else []),
        ]
        for i, r in enumerate(family_rows)
    ]
    adjusted = "adjusted p (primary alone, then Holm)" if plan.get("gatekeeping") else "Holm-adjusted p"
    header = [
        "cell",
        "comparison",
        "delta",
        f"{_level(alpha, 1)} interval",
        "p",
        "p rule",
        adjusted,
        "δ",
        "verdict alone",
        "verdict",
        *(["Hodges–Lehmann [interval]", "sign test p (+ / − / tie)"] if ranked else []),
        *(["collapsed runs (after, before)", "McNemar p"] if collapsing else []),
    ]
    out += _table(header, rows)
    if ranked or collapsing:
        beside = []
        if ranked:
            beside.append(
                "the Hodges–Lehmann shift of the per-seed deltas with its signed-rank interval, and the sign test over "
                "the seeds that differ"
            )
        if collapsing:
            beside.append(
                f"each arm's runs below pass@1 {fmt(plan.get('collapse_floor'))} and McNemar's exact test of the seeds "
                "where one arm collapsed and the other did not (a collapse: row is a member of the family)"
            )
        out += ["Beside the mean (reported, not corrected across the family): " + "; ".join(beside) + ".", ""]
    return out


def _rank_cells(rank: Any) -> list[str]:
    if not isinstance(rank, dict):
        return [DASH, DASH]
    counts = f"{fmt(rank.get('positive'))} / {fmt(rank.get('negative'))} / {fmt(rank.get('ties'))}"
    return [
        f"{fmt_signed(rank.get('hodges_lehmann'))} {fmt_interval(rank.get('low'), rank.get('high'))}",
        f"{fmt(rank.get('sign_p'))} ({counts})",
    ]


def _collapse_cells(collapse: Any) -> list[str]:
    if not isinstance(collapse, dict):
        return [DASH, DASH]
    n = fmt(collapse.get("n"))
    return [
        f"{fmt(collapse.get('after_collapsed'))}, {fmt(collapse.get('before_collapsed'))} of {n}",
        fmt(collapse.get("p_value")),
    ]


def _stated_lines(plan: dict[str, Any], alpha: Any) -> list[str]:
    """The plan's decision rule and estimands beyond the mean, where it states them (a plan written before these
    fields existed shows none)."""
    out = []
    rule, expect = plan.get("decision_rule"), (plan.get("primary") or {}).get("expect")
    if rule == "direction":
        out.append(
            f"- **Decision rule:** direction: the primary is confirmed when it comes out {_text(expect)} (its "
            f"{_level(alpha, 1)} interval excludes 0 on that side); its size against δ is reported apart."
        )
    elif rule == "minimum-effect":
        out.append(
            f"- **Decision rule:** minimum effect: the primary is confirmed only when it comes out "
            f"{_text(expect)} with its whole {_level(alpha, 1)} interval beyond δ (planned for a true delta "
            f"of {fmt_share(plan.get('expected_effect'))})."
        )
    beside = []
    if plan.get("rank_estimand"):
        beside.append("the Hodges–Lehmann shift of the per-seed deltas with its interval, and the sign test")
    if _num(plan.get("collapse_floor")) is not None:
        beside.append(
            f"each arm's collapse rate (runs below pass@1 {fmt(plan['collapse_floor'])}) with McNemar's exact test"
        )
    if beside:
        out.append(f"- **Estimands beside the mean:** {_join(beside)}.")
    return out


def realised_power(plan: dict[str, Any], cells: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The power the plan's test had with the spread its runs gave (``stats.realised_power``): the planned power's
    δ, level and seeds, the primary cell's per-seed pass@1, and the plan's collapse floor and expected effect where
    it states them. None without a recorded power or the primary's per-seed pass@1 in both arms."""
    power, primary = plan.get("power"), plan.get("primary") or {}
    if not isinstance(power, dict):
        return None
    delta, level = _num(power.get("smallest_effect")), _num(power.get("alpha_primary"))
    cell = next((c for c in cells if isinstance(c, dict) and c.get("name") == primary.get("cell")), {})
    arms = cell.get("arms") if isinstance(cell.get("arms"), dict) else {}
    values = [(arms.get(primary.get(k)) or {}).get("pass_at_1") for k in ("after", "before")]
    if delta is None or level is None or not all(isinstance(v, list) and len(v) >= 2 for v in values):
        return None
    after, before = ([_num(x) for x in v] for v in values)
    if len(after) != len(before) or None in after + before:
        return None
    rule = plan.get("decision_rule")
    return stats.realised_power(
        before,
        after,
        delta,
        level,
        collapse_floor=_num(plan.get("collapse_floor")),
        expected_effect=_num(plan.get("expected_effect")) if rule == "minimum-effect" else None,
    )


def _realised_line(plan: dict[str, Any], done: dict[str, Any], cells: list[dict[str, Any]]) -> list[str]:
    """The power the runs realised, beside the planned power: recorded in the confirmation, or for a results.json
    written before it was, computed the same way from the per-seed pass@1 it holds."""
    got = done.get("realised_power") if isinstance(done.get("realised_power"), dict) else realised_power(plan, cells)
    power, primary = plan.get("power") or {}, plan.get("primary") or {}
    if not isinstance(got, dict):
        return []
    after, before = _text(primary.get("after")), _text(primary.get("before"))
    planned_sd = f"{_num(power.get('sd')):.3g}" if _num(power.get("sd")) is not None else DASH
    planned = f"{_num(power.get('power')):.2f}" if _num(power.get("power")) is not None else DASH
    goal = (
        f"for a true delta of {got['effect']:.3g} to clear δ {got['smallest_effect']:.3g}"
        if _num(got.get("effect")) not in (None, _num(got.get("smallest_effect")))
        else f"for δ {got['smallest_effect']:.3g}"
    )
    text = (
        f"- **Power, realised (computed after the run):** the {got['seeds']} per-seed {after} − {before} deltas in "
        f"{_text(primary.get('cell'))} have sd {got['sd']:.3g} (the plan assumed {planned_sd}); with it the same "
        f"test at alpha {got['alpha']:.3g} has power {got['power']:.2f} {goal} (planned {planned})"
    )
    mixture = got.get("mixture")
    if isinstance(mixture, dict) and _num(got.get("mixture_power")) is not None:
        text += (
            f"; the mixture fitted to the runs ({after} collapsed in {mixture['collapse_after']:.0%} of runs, "
            f"{before} in {mixture['collapse_before']:.0%}, the rest differing with sd {mixture['sd']:.3g}) "
            f"gives {got['mixture_power']:.2f}"
        )
    return [text + ". Post hoc: how far the planning assumption was off, not what the result means."]


def _level(alpha: Any, tails: int) -> str:
    """The confidence level of an interval at ``alpha``: 1 − alpha (tails 1, the test of 0) or 1 − 2·alpha (tails
    2, the equivalence test), e.g. 95% and 90%; 95% where the alpha is not recorded."""
    a = _num(alpha, 0.05)
    return f"{100 * (1 - (a if tails == 1 else 2 * a)):.4g}%"


def _seed_span(seeds: list[Any]) -> str:
    ints = sorted(s for s in seeds if isinstance(s, int))
    if ints and ints == list(range(ints[0], ints[-1] + 1)) and len(ints) > 2:
        return f"seeds {ints[0]}–{ints[-1]}"
    return "seeds " + (", ".join(map(str, ints)) or DASH)


def _config(results: dict[str, Any]) -> dict[str, Any]:
    """The run's settings by flat name, from a results.json of this version (sectioned) or an earlier one (flat)."""
    config = results.get("config")
    return flat_view(config) if isinstance(config, dict) else {}


def render(
    results: dict[str, Any],
    log: list[dict[str, Any]] | None,
    kept: Iterable[str] = (),
    timelines: Iterable[str] = (),
    probe: dict[str, Any] | None = None,
) -> str:
    """The text of report.md (plots are linked, not embedded); malformed input is a ``DataError``. ``log`` None: no
    train_log.json, and of the plots drawn from it only those in ``kept`` (stems already in plots/) are linked.
    ``timelines``: the runs' timeline.json files, relative to the folder, to link. ``probe``: the folder's
    probe.json (``sao probe``), shown with the oracle ceiling."""
    _validate(results, log, "results.json", "train_log.json")
    kept = set(kept)
    arms, cells, config = _arms(results), results["cells"], _config(results)
    seeds = results.get("seeds") or []
    axes = [f"{k}s {', '.join(dict.fromkeys(fmt(c[k]) for c in cells))}" for k in ("lag", "lr", "band")]
    where = _text(config.get("data", DASH)) + (f", environment {_text(config['env'])}" if config.get("env") else "")
    lines = [
        f"# sao experiment: {_text(config.get('model', DASH))} on {where}",
        "",
        f"**Question.** {_text(results.get('question') or DASH)}",
        "",
        f"Grid: {'; '.join(axes)}: {_plural(len(cells), 'cell')}; in each, the arms {', '.join(arms)} train "
        f"{_plural(len(seeds), 'seed')} each (seeds {', '.join(map(fmt, seeds)) or DASH}). Every number below "
        "is read from results.json and train_log.json.",
        "",
    ]
    if results.get("command"):
        lines += ["Regenerate with:", "", "```", str(results["command"]), "```", ""]
    captions = [
        *PLOTS.items(),
        *([EVAL_CURVE] if _has_eval_curve(results) else []),
        *([MISMATCH_PLOT] if log is not None and _has_mismatch(log) else []),
        *([ESS_PLOT] if _has_ess(log) else []),
        *([PHASES_PLOT] if _has_phases(log) else []),
    ]
    if log is None:  # the log's plots where a run left them; the extras in the order the run drew them
        captions = [c for c in captions if c[0] not in LOG_PLOTS or c[0] in kept]
        captions += [c for c in (MISMATCH_PLOT, ESS_PLOT, PHASES_PLOT) if c[0] in kept]
    plots = ["## Plots", "", *(f"![{stem}](plots/{stem}.png)\n\n*{caption}*\n" for stem, caption in captions)]
    for section in (
        _plan_section(results),
        _verdict_section(results),
        _pass_section(results, arms),
        _vs_base_section(results, arms),
        _reach_section(results, arms),
        _off_policy_section(results, arms),
        _defined_section(results, arms),
        _ceiling_section(results, arms, probe),
        _checks_section(results, arms),
        _curves_section(results, arms),
        plots,
        _time_section(results, log, arms, list(timelines)),
        _examples_section(results, arms),
        _tail_sections(results),
    ):
        lines += section
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------
# A comparison of anyone's scores (`sao compare`): results.json alone, no plots.

COMPARISON = {
    "kind!": str,
    "verdict!": str,
    "reason": str,
    "tasks": NUMBER,
    "compare!": {"*": {}},
    "noise": {},
    "sides!": {"before!": {"runs!": [{}]}, "after!": {"runs!": [{}]}},
    "versions": {},
}
COMPARISON_KIND = "compare"


def comparison_results(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """results.json of a `sao compare` folder, checked; None when the folder holds another kind of results."""
    path = Path(out_dir) / "results.json"
    if not path.is_file():
        return None
    try:
        found = read_json_file(path, expect=(dict, list))
    except DataError as e:
        raise DataError(f"{path} is not readable JSON ({str(e).removeprefix(f'{path}: ')})") from None
    if not isinstance(found, dict) or found.get("kind") != COMPARISON_KIND:
        return None
    _check(found, COMPARISON, "", path)
    return found


def render_comparison(results: dict[str, Any]) -> str:
    """The text of a `sao compare` report.md: the verdict with the recipe's comparison table, each side's runs, the
    noise floor and the inputs. Everything is read from ``results``."""
    _check(results, COMPARISON, "", "results.json")
    sides, noise = results["sides"], results.get("noise") or {}
    before, after = sides["before"], sides["after"]
    scores = " ".join(str(x) for x in (before.get("benchmark"), before.get("metric")) if x)
    scores += f" ({before['filter']})" if before.get("filter") else ""
    lines = [
        f"# sao compare: {_text(after.get('name'))} against {_text(before.get('name'))}",
        "",
        f"**Question.** {_text(results.get('question') or DASH)}",
        "",
        f"{_plural(results.get('tasks'), 'task')} scored by every run; units: {_text(results.get('pairing'))}. "
        "Every number below is read from results.json.",
        "",
    ]
    if results.get("command"):
        lines += ["Regenerate with:", "", "```", str(results["command"]), "```", ""]
    found = [({"name": scores or DASH}, _name(k, c), c) for k, c in results["compare"].items()]
    main = next(iter(results["compare"].values()), None)
    head = (
        _verdict_words(main, bold=True)
        if isinstance(main, dict) and main.get("verdict") == results["verdict"] and main.get("magnitude")
        else f"**{_text(results['verdict'])}**"
    )
    lines += [f"## Verdict: {head}", "", _text(results.get("reason") or DASH), ""]
    lines += _comparison_table(found, "comparison", "before", first="scores")
    rows = [
        [
            side,
            _cell(run.get("label")),
            _cell(run.get("seed") if run.get("seed") is not None else DASH),
            fmt_count(run.get("tasks")),
            fmt_share(run.get("mean")),
        ]
        for side, block in (("before", before), ("after", after))
        for run in block["runs"]
    ]
    rows += [
        [
            f"**{side} mean**",
            "",
            "",
            "",
            f"**{fmt_share(block.get('mean'))}** [{', '.join(map(fmt_share, _pair(block.get('mean_ci'))))}]",
        ]
        for side, block in (("before", before), ("after", after))
    ]
    lines += [
        "## Runs",
        "",
        "Each run's mean score over the tasks; each side's mean over its runs with the 95% t interval over runs.",
        "",
    ]
    lines += _table(["side", "run", "seed", "tasks", "mean score"], rows, text=3)
    lines += ["## Noise floor", ""]
    source = noise.get("source") or {}
    if _num(noise.get("noise_floor")) is not None:
        lines += [
            f"{_plural(noise.get('runs'), 'repeated eval')} of one model ({_text(source.get('name'))}): "
            f"run_std {fmt(noise.get('run_std'))} gives the noise floor ±{fmt_share(noise.get('noise_floor'))}: "
            "a delta within it is indistinguishable from re-evaluating the same model.",
            "",
        ]
    else:
        lines += [
            "No repeated evals were given (`--noise`), so no noise floor: δ is the smallest effect given, if "
            "any, and without one nothing is called flat.",
            "",
        ]
    inputs = [
        [
            role,
            _cell(block.get("path")),
            _cell(block.get("format")),
            _cell(block.get("benchmark") or DASH),
            _cell(block.get("metric")),
            _cell(block.get("filter") or DASH),
            fmt_count(len(block.get("runs") or [])),
            _cell(", ".join(str(r.get("sha256", ""))[:12] for r in block.get("runs") or [])),
        ]
        for role, block in (("before", before), ("after", after), ("noise", source))
        if block
    ]
    lines += [
        "## Inputs",
        "",
        *_table(
            ["side", "path", "format", "lm-eval task", "metric", "filter", "runs", "sha256 (first 12)"], inputs, text=6
        ),
    ]
    versions = [[_cell(k), _cell(v)] for k, v in (results.get("versions") or {}).items()]
    lines += ["## Versions", "", *_table(["package", "version"], versions or [[DASH, DASH]], text=2)]
    return "\n".join(lines).rstrip() + "\n"


def write_text(out_dir: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as ``out_dir/report.md``, atomically; return its path."""
    atomic_write(Path(out_dir) / "report.md", text.encode("utf-8"))
    return Path(out_dir) / "report.md"


def write(out_dir: str | os.PathLike) -> Path:
    """Write ``out_dir/plots/*.png`` and ``out_dir/report.md`` from the folder's JSON (a `sao compare` folder: the
    report alone); return report.md's path."""
    compared = comparison_results(out_dir)
    if compared is not None:
        return write_text(out_dir, render_comparison(compared))
    results, log = load(out_dir)
    plots = Path(out_dir) / "plots"
    kept = {p.stem for p in plots.glob("*.png")} if log is None and plots.is_dir() else set()
    timelines = sorted(p.relative_to(out_dir).as_posix() for p in Path(out_dir).glob(f"cells/*/runs/*/{TIMELINE}"))
    probed = Path(out_dir) / "probe.json"
    probe = read_json_file(probed, expect=dict, error=DataError) if probed.is_file() else None
    text = render(results, log, kept, timelines, probe)  # before any plot: malformed input fails without touching it
    _write_plots(results, log, plots)
    atomic_write(Path(out_dir) / "report.md", text.encode("utf-8"))
    return Path(out_dir) / "report.md"
