"""report.md and plots/ for one experiment folder, built from its results.json and train_log.json alone.

The recipe writes every number into JSON; this module only lays those numbers out for a reader: seven
plots (training reward, masked share by staleness, worst ratio against the band, critic explained variance,
response length, sampler–policy KL, and the evals with the paired delta) and a markdown page that states the
verdict in words and shows the tables behind it. Nothing is computed here that could disagree with
results.json: the verdict, the interval, the floor and every check are read, not recomputed; the only
arithmetic is averaging over seeds for display. Rebuilding from the same JSON gives the same report.md.

Deliberately left out: statistics (``sao.stats`` owns them), any judgement beyond the verdict the recipe
wrote, and HTML output. This module needs only matplotlib: it imports nothing from the training side (recipe,
trainer, io), so rebuilding a page never loads a model.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from sao.errors import DataError

ARMS = ("dis", "none")  # the recipe arm, then the baseline (delta = dis − none)
POLICY = "policy"  # the phase of a policy step; anything else is the critic-only warmup
COLORS = {"dis": "#1f6fb4", "none": "#e0700f", "base": "#808080"}
ARM_NAMES = {"dis": "dis (recipe: mask outside band)", "none": "none (baseline: plain ratio)"}
PLOTS = {  # file stem → caption in report.md
    "reward": "Training reward per step (thin: each seed; thick: mean over seeds; grey: critic warmup).",
    "masked_share": "Masked share by staleness (left) and per step (right): recipe masked vs baseline would-be.",
    "ratio_max": "Largest current/sampler probability ratio per step, log scale; dashed: the band edges.",
    "explained_variance": "Critic explained variance of the per-token return per step.",
    "response_length": "Mean response length (tokens) per step.",
    "kl": "KL(sampler ‖ policy) per step (k3 estimate over generated tokens).",
    "evals": "Held-out pass@1 (left) and the paired deltas with 95% intervals against the noise floor (right).",
}
KEY_SERIES = (
    "reward_mean",
    "masked_share",
    "would_be_masked_share",
    "ratio_max",
    "explained_variance",
    "response_length",
    "kl_sampler_policy",
)
SHARE_SERIES = {"reward_mean", "masked_share", "would_be_masked_share"}
CONFIG_KEYS = (
    "model", "data", "band", "lag", "lr", "critic_lr", "steps", "critic_warmup", "critic_steps", "batch_size",
    "train_runs", "seed", "base_evals", "eval_samples", "eval_temperature", "temperature", "max_new_tokens",
    "grad_clip", "lora_rank", "lora_alpha", "gae_alpha", "dead_band_share", "engine",
)  # fmt: skip
EXAMPLES_PER_MODEL = 3
DASH = "—"
DPI = 120


# ---------------------------------------------------------------------------------------------------------
# Formatting: every number in report.md goes through one of these.


def _num(x: Any) -> float | None:
    """A finite float, or None for anything else (None, NaN, bool, text)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


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


def _share_pct(x: Any) -> str:
    v = _num(x)
    return DASH if v is None else f"{fmt_share(v)} ({v:.2%})"


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


def _cell(x: Any) -> str:
    """Text made safe for one markdown table cell."""
    text = str(x).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def _table(header: list[str], rows: Iterable[list[str]], *, numeric: bool = True) -> list[str]:
    """A markdown table; after the first column, cells align right (``numeric``) or left (text)."""
    rule = [":---"] + ["---:" if numeric else ":---"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


# ---------------------------------------------------------------------------------------------------------
# Reading the experiment.


def _read(path: Path, kind: type) -> Any:
    if not path.is_file():
        raise DataError(f"{path} is missing: run `sao recipe` into this folder first")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e.__class__.__name__}: {e})".splitlines()[0]) from None
    if not isinstance(value, kind):
        raise DataError(f"{path} should hold a JSON {kind.__name__}, found {type(value).__name__}")
    return value


def load(out_dir: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(results, train_log) of an experiment folder, checked for the fields the report cannot do without."""
    out = Path(out_dir)
    results = _read(out / "results.json", dict)
    log = _read(out / "train_log.json", list)
    for key, kind in (("verdict", str), ("compare", dict), ("pass_at_1", dict), ("config", dict)):
        if not isinstance(results.get(key), kind):
            raise DataError(f"{out / 'results.json'} lacks '{key}' (a {kind.__name__}): not a sao results file")
    for i, r in enumerate(log):
        if not (isinstance(r, dict) and all(k in r for k in ("arm", "seed", "step", "phase"))):
            raise DataError(f"{out / 'train_log.json'} record {i} lacks arm/seed/step/phase: not a sao train log")
    return results, log


def _arms(names: Iterable[str]) -> list[str]:
    present = set(names)
    return [a for a in ARMS if a in present] + sorted(present - set(ARMS))


def _runs(log: list[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """arm → seed → that run's records in step order."""
    out: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for arm in _arms(r["arm"] for r in log):
        seeds = sorted({r["seed"] for r in log if r["arm"] == arm})
        out[arm] = {
            s: sorted((r for r in log if r["arm"] == arm and r["seed"] == s), key=lambda r: r["step"]) for s in seeds
        }
    return out


def _plural(n: Any, word: str) -> str:
    return f"{fmt_count(n)} {word}{'' if _num(n) == 1 else 's'}"


def _label(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def _mean(values: Iterable[Any]) -> float | None:
    vals = [v for v in map(_num, values) if v is not None]
    return statistics.fmean(vals) if vals else None


def _color(arm: str) -> str:
    return COLORS.get(arm, "#444444")


# ---------------------------------------------------------------------------------------------------------
# Plots.


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    ys = [_num(r.get(key)) for r in rows]
    return [r["step"] for r in rows], [math.nan if y is None else y for y in ys]


def _seed_mean(seeds: dict[int, list[dict[str, Any]]], key: str) -> tuple[list[int], list[float]]:
    by_step: dict[int, list[Any]] = {}
    for rows in seeds.values():
        for r in rows:
            by_step.setdefault(r["step"], []).append(r.get(key))
    steps = sorted(by_step)
    means = [_mean(by_step[s]) for s in steps]
    return steps, [math.nan if m is None else m for m in means]


def _shade_warmup(ax, log: list[dict[str, Any]]) -> None:
    steps = [r["step"] for r in log if r["phase"] != POLICY]
    if steps:
        ax.axvspan(min(steps) - 0.5, max(steps) + 0.5, color="0.88", zorder=0, label="critic warmup (no policy step)")


def _plot_steps(ax, runs, log, key: str | Callable[[str], str], *, name: Callable[[str], str] | None = None) -> None:
    """Each seed a thin line, each arm's mean over seeds a thick one; ``key`` may depend on the arm."""
    _shade_warmup(ax, log)
    for arm, seeds in runs.items():
        k = key(arm) if callable(key) else key
        label = name(arm) if name else ARM_NAMES.get(arm, arm)
        if len(seeds) > 1:
            for i, rows in enumerate(seeds.values()):
                xs, ys = _series(rows, k)
                ax.plot(xs, ys, color=_color(arm), lw=0.8, alpha=0.45, label=f"{arm}: each seed" if i == 0 else None)
            label += f", mean of {len(seeds)} seeds"
        else:
            label += f", seed {next(iter(seeds))}"
        xs, ys = _seed_mean(seeds, k)
        ax.plot(xs, ys, color=_color(arm), lw=2.2, label=label, marker="o" if len(xs) <= 12 else None, ms=3)
    ax.set_xlabel("step (critic warmup first, then policy steps)")
    ax.grid(alpha=0.3)


def _save(fig: Figure, path: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    _atomic_write(path, buffer.getvalue())


def _line_figure(path: Path, runs, log, key: str, title: str, ylabel: str, extra=None) -> None:
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.subplots()
    _plot_steps(ax, runs, log, key)
    if extra:
        extra(ax)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="best")
    _save(fig, path)


def _plot_ratio_max(path: Path, runs, log, band) -> None:
    lo, hi = (_num(b) for b in band) if isinstance(band, (list, tuple)) and len(band) == 2 else (None, None)

    def edges(ax) -> None:
        ax.set_yscale("log")
        ticks = {m * 10.0**e for m in (1, 2, 3, 5) for e in range(-3, 5)} | {e for e in (lo, hi) if e and e > 0}
        ax.yaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        for edge, which in ((hi, "upper"), (lo, "lower")):
            if edge is not None and edge > 0:
                ax.axhline(edge, color="#c0392b", ls="--", lw=1.2, label=f"band {which} edge {fmt(edge)}")
        if lo and lo > 0:
            bottom, top = ax.get_ylim()
            ax.set_ylim(min(bottom, lo / 1.3), max(top, (hi or top) * 1.3))

    title = "Worst token's ratio per step" + (f" against the band ({fmt(lo)}, {fmt(hi)})" if lo and hi else "")
    _line_figure(path, runs, log, "ratio_max", title, "max ratio π_policy / π_sampler (log)", edges)


def _plot_masked_share(path: Path, runs, log, checks: dict[str, Any], dead: Any) -> None:
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 1.3])
    key = {"dis": "masked_share"}  # the baseline masks nothing; show what the band would have masked on it
    names = {"dis": "dis: masked share", "none": "none: would-be masked share"}
    bars: dict[str, dict[int, float]] = {}
    steps: dict[int, list[Any]] = {}
    for arm, seeds in runs.items():
        k = key.get(arm, "would_be_masked_share")
        per: dict[int, list[Any]] = {}
        for seed in seeds:
            for s, row in (checks.get(_label(arm, seed), {}).get("masked_share_by_staleness") or {}).items():
                per.setdefault(int(s), []).append(row.get(k))
                steps.setdefault(int(s), []).append(row.get("steps"))
        bars[arm] = {s: m for s, vals in per.items() if (m := _mean(vals)) is not None}
    stale = sorted({s for b in bars.values() for s in b})
    width = 0.8 / max(len(bars), 1)
    for i, (arm, values) in enumerate(bars.items()):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j, s in enumerate(stale) if s in values]
        ys = [values[s] for s in stale if s in values]
        left.bar(xs, ys, width=width * 0.95, color=_color(arm), hatch="//" if arm != "dis" else None,
                 edgecolor="white", label=names.get(arm, arm))  # fmt: skip
        for x, y in zip(xs, ys, strict=True):
            text = fmt_share(y) if y else "0"
            left.annotate(text, (x, y), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    if _num(dead):
        left.axhline(dead, color="black", ls=":", lw=1, label=f"dead-band threshold {fmt(dead)}")
    left.set_xticks(range(len(stale)), [f"{s}\n({_plural(_mean(steps.get(s, [])), 'step')})" for s in stale])
    left.set_xlabel("staleness (policy updates since the sampler was refreshed)")
    left.set_ylabel("share of generated tokens (mean over seeds)")
    left.set_title("Masked share by staleness")
    left.legend(fontsize=8, loc="upper left")
    left.grid(axis="y", alpha=0.3)
    _plot_steps(right, runs, log, lambda arm: key.get(arm, "would_be_masked_share"), name=lambda a: names.get(a, a))
    right.set_ylabel("share of generated tokens")
    right.set_title("Masked share per step")
    right.legend(fontsize=8, loc="upper left")
    _save(fig, path)


def _plot_evals(path: Path, results: dict[str, Any]) -> None:
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1.2, 1])
    p1 = results["pass_at_1"]
    names = ["base", *_arms(k for k in p1 if k != "base")]
    groups = [(name, [v for v in map(_num, p1.get(name) or []) if v is not None]) for name in names]
    groups = [(n, v) for n, v in groups if n != "base" or v]
    for i, (name, vals) in enumerate(groups):
        if not vals:
            continue
        m = statistics.fmean(vals)
        left.bar(i, m, width=0.6, color=_color(name), alpha=0.8)
        offsets = [0.0] if len(vals) == 1 else [-0.15 + 0.3 * j / (len(vals) - 1) for j in range(len(vals))]
        left.scatter([i + o for o in offsets], vals, color="black", s=16, zorder=3)
        left.annotate(fmt_share(m), (i, max(vals)), xytext=(0, 4), textcoords="offset points", ha="center")
    ticks = [f"{n}\n({_plural(len(v), 'eval' if n == 'base' else 'seed')})" for n, v in groups]
    left.set_xticks(range(len(groups)), ticks)
    left.set_ylim(0, 1)
    left.set_ylabel("pass@1 on the held-out tasks")
    left.set_title("pass@1 (bar: mean; dots: each eval or seed)")
    left.grid(axis="y", alpha=0.3)

    cmp, vs_base = results["compare"], results.get("vs_base") or {}
    floor = _num(cmp.get("noise_floor"))
    if floor:
        right.axhspan(-floor, floor, color="0.88", label=f"noise floor ±{fmt_share(floor)}")
    right.axhline(0, color="black", lw=0.8)
    points = [(f"{cmp.get('after', 'dis')} − {cmp.get('before', 'none')}", cmp, "black")]
    points += [(f"{arm} − base", c, _color(arm)) for arm, c in vs_base.items() if isinstance(c, dict)]
    reach = [floor or 0.0]
    for i, (_, c, color) in enumerate(points):
        d, lo, hi = _num(c.get("delta")), _num(c.get("ci_low")), _num(c.get("ci_high"))
        if d is None:
            continue
        yerr = [[d - lo], [hi - d]] if lo is not None and hi is not None else None
        right.errorbar(
            [i], [d], yerr=yerr, fmt="o", color=color, capsize=6, ms=8 if i == 0 else 6, lw=2 if i == 0 else 1.2
        )
        right.annotate(fmt_signed(d), (i, d), xytext=(10, 0), textcoords="offset points", va="center", fontsize=9)
        reach += [abs(v) for v in (d, lo, hi) if v is not None]
    right.set_xticks(range(len(points)), [p[0] for p in points])
    right.set_xlim(-0.6, len(points) - 0.4)
    right.set_ylim(-1.25 * max(reach) - 1e-3, 1.25 * max(reach) + 1e-3)
    right.set_ylabel(f"delta pass@1 (95% interval over {cmp.get('n', '?')} {cmp.get('unit', '')}s)")
    main = f"{points[0][0]} {fmt_signed(cmp.get('delta'))} {fmt_interval(cmp.get('ci_low'), cmp.get('ci_high'))}"
    right.set_title(f"Verdict: {results.get('verdict', DASH)}\n{main} (95% interval)")
    if floor:
        right.legend(fontsize=8, loc="upper right")
    right.grid(axis="y", alpha=0.3)
    _save(fig, path)


def write_plots(results: dict[str, Any], log: list[dict[str, Any]], plots: Path) -> list[Path]:
    """The seven PNGs under ``plots``; returns their paths."""
    runs = _runs(log)
    config = results["config"]
    checks = results.get("checks") or {}
    p = {stem: plots / f"{stem}.png" for stem in PLOTS}
    _line_figure(p["reward"], runs, log, "reward_mean", "Training reward (mean over the batch) per step", "reward")
    _plot_masked_share(p["masked_share"], runs, log, checks, config.get("dead_band_share"))
    _plot_ratio_max(p["ratio_max"], runs, log, config.get("band"))
    _line_figure(p["explained_variance"], runs, log, "explained_variance", "Critic explained variance per step",
                 "explained variance (1 = perfect, 0 = batch mean)")  # fmt: skip
    _line_figure(p["response_length"], runs, log, "response_length", "Mean response length per step", "tokens")
    _line_figure(p["kl"], runs, log, "kl_sampler_policy", "Sampler–policy KL per step (how stale the rollouts are)",
                 "KL(sampler ‖ policy), nats per token")  # fmt: skip
    _plot_evals(p["evals"], results)
    return list(p.values())


# ---------------------------------------------------------------------------------------------------------
# report.md


def _verdict_section(results: dict[str, Any]) -> list[str]:
    out = [f"## Verdict: **{results['verdict']}**", "", str(results.get("reason") or DASH), ""]
    c = results["compare"]
    out.append(
        f"Recipe arm minus baseline: {fmt_signed(c.get('delta'))}, 95% interval "
        f"{fmt_interval(c.get('ci_low'), c.get('ci_high'))} over {fmt(c.get('n'))} {c.get('unit', '')}s; "
        f"noise floor ±{fmt_share(c.get('noise_floor'))}."
    )
    return [*out, ""]


def _pass_section(results: dict[str, Any]) -> list[str]:
    evals = results.get("evals") or {}
    rows = []
    for name in ["base", *_arms(k for k in results["pass_at_1"] if k != "base")]:
        values = results["pass_at_1"].get(name) or []
        for i, v in enumerate(values):
            e = (evals.get(name) or [])[i] if i < len(evals.get(name) or []) else {}
            label = e.get("label", f"{name}-{i}")
            rows.append([label, fmt_share(v), fmt(e.get("mean_reply_tokens")), fmt_share(e.get("truncation_share"))])
        if len(values) > 1:
            rows.append([f"**{name} mean**", f"**{fmt_share(_mean(values))}**", "", ""])
    header = ["eval", "pass@1", "mean reply tokens", "truncation share"]
    nf = results.get("noise_floor") or {}
    note = (
        f"Noise floor from {fmt(nf.get('runs'))} base evals: run_std {fmt(nf.get('run_std'))}, "
        f"floor {fmt_share(nf.get('floor'))}."
    )
    return ["## pass@1", "", *_table(header, rows), note, ""]


def _compare_section(results: dict[str, Any]) -> list[str]:
    c = results["compare"]
    before, after = c.get("before", "none"), c.get("after", "dis")
    rows = [
        ["delta", fmt_signed(c.get("delta"))],
        ["95% interval", fmt_interval(c.get("ci_low"), c.get("ci_high"))],
        ["noise floor", f"±{fmt_share(c.get('noise_floor'))}"],
        ["unit, n", f"{c.get('unit', DASH)}, {fmt(c.get('n'))}"],
        [f"{before} mean", fmt_share(c.get("before_mean"))],
        [f"{after} mean", fmt_share(c.get("after_mean"))],
    ]
    if "proxy_delta" in c:
        rows.append(["proxy delta (training reward, last 10 steps)", fmt_signed(c.get("proxy_delta"))])
        rows.append(["proxy rises while the target falls", fmt(c.get("proxy_diverges"))])
    out = [f"## Comparison: {after} − {before}", "", *_table(["", "value"], rows)]
    vs = results.get("vs_base") or {}
    if vs:
        rows = [
            [arm, fmt_share(v.get("before_mean")), fmt_share(v.get("after_mean")), fmt_signed(v.get("delta")),
             fmt_interval(v.get("ci_low"), v.get("ci_high")), str(v.get("verdict", DASH))]
            for arm, v in vs.items()
        ]  # fmt: skip
        out += ["## Each arm against the base", ""]
        out += _table(["arm", "base", "arm", "delta", "95% interval", "verdict"], rows)
        out += [f"- {arm}: {_cell(v.get('reason', DASH))}" for arm, v in vs.items()] + [""]
    return out


def _reach_section(results: dict[str, Any], runs) -> list[str]:
    checks = results.get("checks") or {}
    curves = results.get("curves") or {}
    band = results["config"].get("band")
    out = ["## Reachability", ""]
    dis, none = (curves.get("dis") or {}), (curves.get("none") or {})
    masked, would = dis.get("masked_share") or {}, none.get("would_be_masked_share") or {}
    out.append(
        f"The band {fmt(band)} masked {_share_pct(masked.get('mean'))} of the recipe arm's tokens per policy step "
        f"on average (worst step {fmt_share(masked.get('max'))}); on the baseline it would have masked "
        f"{_share_pct(would.get('mean'))} (worst step {fmt_share(would.get('max'))})."
    )
    out.append("")
    cols = {"dis": ("masked_share", "ratio_max_median"), "none": ("would_be_masked_share", "ratio_max_median")}
    table: dict[int, dict[str, list[Any]]] = {}
    for arm, seeds in runs.items():
        share_key, ratio_key = cols.get(arm, ("would_be_masked_share", "ratio_max_median"))
        for seed in seeds:
            for s, row in (checks.get(_label(arm, seed), {}).get("masked_share_by_staleness") or {}).items():
                cell = table.setdefault(int(s), {})
                cell.setdefault("steps", []).append(row.get("steps"))
                cell.setdefault(f"{arm} share", []).append(row.get(share_key))
                cell.setdefault(f"{arm} ratio", []).append(row.get(ratio_key))
    if table:
        header = ["staleness", "steps per run"]
        for arm in runs:
            header += [f"{arm}: {'masked' if arm == 'dis' else 'would-be masked'} share", f"{arm}: median max ratio"]
        rows = []
        for s in sorted(table):
            row = [str(s), fmt_count(_mean(table[s]["steps"]))]
            for arm in runs:
                row += [
                    fmt_share(_mean(table[s].get(f"{arm} share", []))),
                    fmt(_mean(table[s].get(f"{arm} ratio", []))),
                ]
            rows.append(row)
        seeds_n = max((len(s) for s in runs.values()), default=0)
        out += [f"Masked share by staleness (policy steps; mean over {_plural(seeds_n, 'seed')}):", ""]
        out += _table(header, rows)
    warnings = results.get("warnings") or []
    if warnings:
        out.append(f"Training raised {_plural(len(warnings), 'reachability warning')}:")
        out += [""] + [f"> {_cell(w)}" for w in warnings] + [""]
    else:
        out += ["No reachability warning was raised during training.", ""]
    return out


def _checks_section(results: dict[str, Any]) -> list[str]:
    checks = results.get("checks") or {}
    if not checks:
        return []
    clip = results["config"].get("grad_clip")

    def bound(c: dict[str, Any]) -> str:
        if c.get("clip_ever_bound") is None:
            return DASH
        return f"{fmt(c.get('clip_ever_bound'))} ({fmt(c.get('clip_bound_steps'))} steps)"

    rows_spec: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("critic EV at warmup end", lambda c: fmt(c.get("critic_ev_warmup_end"))),
        ("critic EV, last 10 steps", lambda c: fmt(c.get("critic_ev_last10"))),
        ("critic loss, warmup end → last 10",
         lambda c: f"{fmt(c.get('critic_loss_warmup_end'))} → {fmt(c.get('critic_loss_last10'))}"),
        ("grad norm mean", lambda c: fmt(c.get("grad_norm_mean"))),
        ("grad norm max", lambda c: fmt(c.get("grad_norm_max"))),
        (f"clip at {fmt(clip)} ever bound", bound),
        ("non-finite tokens", lambda c: fmt_count(c.get("nonfinite_tokens"))),
        ("skipped steps", lambda c: fmt(c.get("skipped_steps"))),
        ("lag-0 \\|log ratio\\| mean", lambda c: fmt(c.get("lag0_abs_log_ratio_mean"))),
        ("lag-0 \\|log ratio\\| max", lambda c: fmt(c.get("lag0_abs_log_ratio_max"))),
        ("masked share, worst step", lambda c: fmt_share(c.get("masked_share_max"))),
        ("reward first 10 → last 10",
         lambda c: f"{fmt_share(c.get('reward_first10'))} → {fmt_share(c.get('reward_last10'))}"),
        ("response length, last 10", lambda c: fmt(c.get("response_length_last10"))),
        ("truncation share, last 10", lambda c: fmt_share(c.get("truncation_share_last10"))),
    ]  # fmt: skip
    labels = list(checks)
    rows = [[name, *(get(checks[label] or {}) for label in labels)] for name, get in rows_spec]
    return ["## Checks", "", *_table(["check", *labels], rows)]


def _curves_section(results: dict[str, Any]) -> list[str]:
    curves = results.get("curves") or {}
    rows = []
    for key in KEY_SERIES:
        for arm in _arms(curves):
            c = (curves.get(arm) or {}).get(key)
            if c is None:
                continue
            f = fmt_share if key in SHARE_SERIES else fmt
            rows.append(
                [f"{key}", arm, *(f(c.get(k)) for k in ("first", "last", "mean", "max", "min")), fmt(c.get("n"))]
            )
    if not rows:
        return []
    out = ["## Training curves", "", "Policy steps only; for several seeds, the step-wise mean over seeds.", ""]
    return out + _table(["series", "arm", "first", "last", "mean", "max", "min", "steps"], rows)


def _plots_section(captions: dict[str, str] = PLOTS) -> list[str]:
    """The plots embedded with relative links, each with its caption (shared with the sweep report)."""
    out = ["## Plots", ""]
    for stem, caption in captions.items():
        out += [f"![{stem}](plots/{stem}.png)", "", f"*{caption}*", ""]
    return out


def _examples_section(results: dict[str, Any]) -> list[str]:
    evals = results.get("evals") or {}
    rows = []
    for name in ["base", *_arms(k for k in evals if k != "base")]:
        first = (evals.get(name) or [{}])[0] or {}
        for ex in (first.get("examples") or [])[:EXAMPLES_PER_MODEL]:
            rows.append([_cell(first.get("label", name)), _cell(ex.get("question", DASH)), _cell(ex.get("reply", DASH)),
                         _cell(ex.get("gold", DASH)), fmt(ex.get("correct"))])  # fmt: skip
    if not rows:
        return []
    return [
        "## Example eval replies",
        "",
        *_table(["eval", "question", "reply", "gold", "correct"], rows, numeric=False),
    ]


def _wall_section(results: dict[str, Any]) -> list[str]:
    wall = results.get("wall_time") or {}
    rows = [[f"train {label}", fmt_seconds(s)] for label, s in (wall.get("train") or {}).items()]
    rows += [[f"eval {label}", fmt_seconds(s)] for label, s in (wall.get("eval") or {}).items()]
    names = {"train_total": "**train, total**", "eval_total": "**eval, total**", "this_invocation": "this invocation"}
    rows += [[label, fmt_seconds(wall[k])] for k, label in names.items() if k in wall]
    return ["## Wall time", "", *_table(["phase", "time"], rows)] if rows else []


def _config_section(results: dict[str, Any]) -> list[str]:
    config = results["config"]
    out = ["## Configuration", ""]
    out += _table(["setting", "value"], [[k, _cell(fmt(config[k]))] for k in CONFIG_KEYS if k in config], numeric=False)
    data = results.get("data") or {}
    if data:
        out += ["Data: " + ", ".join(f"{k} {_cell(fmt(v))}" for k, v in data.items()) + ".", ""]
    versions = results.get("versions") or {}
    if versions:
        out += [
            "## Versions",
            "",
            *_table(["package", "version"], [[k, _cell(v)] for k, v in versions.items()], numeric=False),
        ]
    return out


def render(results: dict[str, Any], log: list[dict[str, Any]]) -> str:
    """The text of report.md (plots are linked, not embedded)."""
    runs = _runs(log)
    arms = ", ".join(f"{a} × {_plural(len(s), 'seed')}" for a, s in runs.items())
    config = results["config"]
    lines = [
        f"# sao experiment: {config.get('model', DASH)} on {config.get('data', DASH)}",
        "",
        f"**Question.** {results.get('question', DASH)}",
        "",
        f"Arms: {arms or DASH}; band {fmt(config.get('band'))}, lag {fmt(config.get('lag'))}, "
        f"lr {fmt(config.get('lr'))}. Every number below is read from results.json and train_log.json.",
        "",
    ]
    for section in (
        _verdict_section(results),
        _pass_section(results),
        _compare_section(results),
        _reach_section(results, runs),
        _checks_section(results),
        _curves_section(results),
        _plots_section(),
        _examples_section(results),
        _wall_section(results),
        _config_section(results),
    ):
        lines += section
    return "\n".join(lines).rstrip() + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    """Write beside, fsync, rename (as ``sao.io`` does, without importing torch)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_report(out_dir: str | os.PathLike) -> Path:
    """Write ``out_dir/plots/*.png`` and ``out_dir/report.md`` from the folder's JSON; return the report's path."""
    out = Path(out_dir)
    results, log = load(out)
    write_plots(results, log, out / "plots")
    path = out / "report.md"
    _atomic_write(path, render(results, log).encode("utf-8"))
    return path
