"""sweep.md and plots/ for a `sao sweep` folder, built from its sweep.json alone.

The sweep asks where the unmasked importance ratio breaks (training collapses) over lag × learning rate × band,
and whether a correction rule helps there. ``sao.sweep.summarize`` writes every number into sweep.json; this
module only lays them out: five plots (held-out pass@1 against lag, the worst ratio and the masked share against
lag, the sampler–trainer KL and the training reward per step, and the diverged seeds per arm and cell) and a
markdown page with one row per cell × arm, one row per comparison against ``none`` and a summary paragraph
that code writes from the verdicts and divergence counts. Nothing is recomputed that sweep.json already holds:
intervals, verdicts and divergence are read; the only arithmetic is averaging over seeds for display and
counting. Rebuilding from the same sweep.json gives the same sweep.md and the same PNGs.

Deliberately left out: statistics (``sao.stats`` owns them), multiple-comparison correction (each cell's
interval is its own 95% interval, and the page says so) and any judgement beyond the recorded verdicts. Like
``sao.report`` it needs only matplotlib, so rebuilding a page never loads a model; the formatting helpers,
colours and the atomic write are ``sao.report``'s, so both pages read alike.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullFormatter

from sao.errors import DataError
from sao.report import (
    COLORS,
    CONFIG_KEYS,
    DASH,
    _atomic_write,
    _cell,
    _label,
    _mean,
    _num,
    _plots_section,
    _plural,
    _read,
    _save,
    _table,
    fmt,
    fmt_interval,
    fmt_seconds,
    fmt_share,
    fmt_signed,
)

BASELINE = "none"
EXTRA_COLORS = {"tis": "#2a9d3f", "seqmask": "#8e44ad"}  # the two other rules; dis/none/base as in sao.report
SPARE_COLORS = ("#17becf", "#bcbd22", "#e377c2", "#8c564b", "#7f7f7f")  # any further arm, in grid order
LAG_CMAP = "viridis"  # lines coloured by lag: dark = short lag, light = long lag
SEPARATED = ("improved", "regressed")
PLOTS = {  # file stem → caption in sweep.md
    "sweep_pass_at_1": "Held-out pass@1 after training, against lag, one panel per learning rate and band: each arm's "
    "mean with its 95% interval (clipped to the axis), each seed a small dot, a diverged seed an ×; grey line and "
    "band: the base model's mean pass@1 ± the noise floor.",
    "sweep_ratio": "Largest trainer/sampler probability ratio (upper panel, log scale; solid: worst step, dotted: "
    "median step; dashed red: the band edges) and the share of generated tokens masked (lower panel; for the "
    "baseline, the share the band would have masked) against lag, per learning rate and band.",
    "sweep_kl": "KL(sampler ‖ trainer) per policy step, mean over seeds; one panel per arm (columns) and learning "
    "rate and band (rows), one line per lag.",
    "sweep_reward": "Training reward per policy step, mean over seeds, laid out as the KL plot; a collapse is a line "
    "that falls. The legend gives each lag's diverged seeds.",
    "sweep_divergence": "Diverged seeds out of the seeds run, for every arm (rows) and cell (columns: lags; one "
    "panel per learning rate and band).",
}


# ---------------------------------------------------------------------------------------------------------
# Reading the sweep.


def load(out_dir: str | os.PathLike) -> dict[str, Any]:
    """sweep.json of a sweep folder, checked for the fields the page cannot do without."""
    path = Path(out_dir) / "sweep.json"
    if not path.is_file():
        raise DataError(f"{path} is missing: run `sao sweep --out {Path(out_dir)}` first")
    sweep = _read(path, dict)
    cells = sweep.get("cells")
    if not isinstance(cells, list) or not cells:
        raise DataError(f"{path} lacks 'cells' (a non-empty list): not a sao sweep file")
    for i, cell in enumerate(cells):
        if not (isinstance(cell, dict) and all(k in cell for k in ("lag", "lr", "band", "arms"))):
            raise DataError(f"{path} cell {i} lacks lag/lr/band/arms: not a sao sweep file")
        band = cell["band"]
        if not (isinstance(cell["arms"], dict) and all(isinstance(a, dict) for a in cell["arms"].values())):
            raise DataError(f"{path} cell {i} 'arms' should map each arm to a JSON object")
        if not (isinstance(band, list) and len(band) == 2 and _num(cell["lag"]) is not None and _num(cell["lr"])):
            raise DataError(f"{path} cell {i} needs a numeric lag and lr and a two-number band")
        if not isinstance(cell.get("compare", {}), dict):
            raise DataError(f"{path} cell {i} 'compare' should be a JSON object")
    return sweep


def _arms(sweep: dict[str, Any]) -> list[str]:
    """The arms in the grid's order, then any other arm a cell holds."""
    grid = (sweep.get("grid") or {}).get("arms") or []
    seen = [a for a in grid if isinstance(a, str)]
    for cell in sweep["cells"]:
        seen += [a for a in cell["arms"] if a not in seen]
    return list(dict.fromkeys(seen))


def _colors(arms: list[str]) -> dict[str, str]:
    out, spare = {}, iter(SPARE_COLORS * (1 + len(arms) // len(SPARE_COLORS)))
    for arm in arms:
        out[arm] = COLORS.get(arm) or EXTRA_COLORS.get(arm) or next(spare)
    return out


def _band(cell: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(cell["band"])


def _lags(sweep: dict[str, Any]) -> list[Any]:
    return sorted({cell["lag"] for cell in sweep["cells"]})


def _combos(sweep: dict[str, Any]) -> list[tuple[Any, tuple[Any, ...]]]:
    """The (lr, band) pairs in the order the cells come (the sweep nests lag innermost)."""
    return list(dict.fromkeys((cell["lr"], _band(cell)) for cell in sweep["cells"]))


def _cells_of(sweep: dict[str, Any], lr: Any, band: tuple[Any, ...]) -> dict[Any, dict[str, Any]]:
    return {c["lag"]: c for c in sweep["cells"] if c["lr"] == lr and _band(c) == band}


def _where(cell: dict[str, Any]) -> str:
    return f"lag {fmt(cell['lag'])}, lr {fmt(cell['lr'])}, band {fmt(_band(cell))}"


def _combo_title(lr: Any, band: tuple[Any, ...]) -> str:
    return f"lr {fmt(lr)}, band {fmt(band)}"


def _seeds(sweep: dict[str, Any], arm: dict[str, Any]) -> int:
    """S: how many seeds the arm ran (its pass@1 list), else the sweep's seed count."""
    values = _values(arm, "pass_at_1")
    if values:
        return len(values)
    return int(_num(sweep.get("seeds")) or 0)


def _values(arm: dict[str, Any], key: str) -> list[Any]:
    """A per-seed list field, or [] when it is missing or not a list."""
    value = arm.get(key)
    return value if isinstance(value, list) else []


def _diverged(arm: dict[str, Any]) -> dict[str, list[str]]:
    d = arm.get("diverged") or {}
    if not isinstance(d, dict):
        return {}
    return {str(k): [str(r) for r in v] if isinstance(v, list) else [str(v)] for k, v in d.items() if v}


def _seed_flags(sweep: dict[str, Any], name: str, arm: dict[str, Any]) -> list[bool]:
    """For each pass@1 value (seed order), whether that seed's run diverged."""
    first = int(_num((sweep.get("config") or {}).get("seed")) or 0)
    diverged = _diverged(arm)
    return [_label(name, first + i) in diverged for i in range(len(_values(arm, "pass_at_1")))]


def _step_mean(runs: Any) -> list[float]:
    """The step-wise mean over seeds of ragged per-seed series (None and NaN skipped; NaN where none is left)."""
    if not isinstance(runs, list):
        return []
    runs = [r for r in runs if isinstance(r, list)]
    length = max((len(r) for r in runs), default=0)
    means = [_mean(r[i] for r in runs if i < len(r)) for i in range(length)]
    return [math.nan if m is None else m for m in means]


def _nan(x: Any) -> float:
    v = _num(x)
    return math.nan if v is None else v


def _comparisons(sweep: dict[str, Any]) -> list[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(cell, arm, comparison) for every arm-vs-baseline comparison, in cell then grid-arm order."""
    out = []
    for cell in sweep["cells"]:
        compare = cell.get("compare") or {}
        names = [a for a in _arms(sweep) if f"{a}_vs_{BASELINE}" in compare]
        names += [k.removesuffix(f"_vs_{BASELINE}") for k in compare if k.removesuffix(f"_vs_{BASELINE}") not in names]
        for arm in names:
            c = compare.get(f"{arm}_vs_{BASELINE}")
            if isinstance(c, dict):
                out.append((cell, arm, c))
    return out


# ---------------------------------------------------------------------------------------------------------
# Plots.


def _grid(n: int, most: int = 3) -> tuple[int, int]:
    cols = min(n, most)
    return math.ceil(n / cols), cols


def _legend_below(fig: Figure, handles: list, ncol: int) -> None:
    fig.legend(handles=handles, loc="outside lower center", ncol=max(1, min(ncol, len(handles))), fontsize=9)


def _plot_pass_at_1(path: Path, sweep: dict[str, Any], arms: list[str], colors: dict[str, str]) -> None:
    lags, combos = _lags(sweep), _combos(sweep)
    base = sweep.get("base") or {}
    base_mean = _mean(base.get("pass_at_1") or [])
    floor = _num(base.get("noise_floor"))
    panel = max(6.5, 0.5 * len(lags) * len(arms) + 1.5)
    rows, cols = _grid(len(combos), 2 if panel > 8 else 3)
    fig = Figure(figsize=(max(10.0, panel * cols + 0.5), 4.6 * rows + 1.3), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    slot = 0.76 / len(arms)
    top = max(0.1, (base_mean or 0) + (floor or 0))
    for k, (lr, band) in enumerate(combos):
        ax = axes[k // cols][k % cols]
        cells = _cells_of(sweep, lr, band)
        if base_mean is not None:
            if floor:
                ax.axhspan(base_mean - floor, base_mean + floor, color=COLORS["base"], alpha=0.15, lw=0)
            ax.axhline(base_mean, color=COLORS["base"], lw=1.5, ls="--")
        for j, lag in enumerate(lags):
            for i, name in enumerate(arms):
                arm = (cells.get(lag) or {}).get("arms", {}).get(name)
                if not arm:
                    continue
                x = j + (i - (len(arms) - 1) / 2) * slot
                values = [_num(v) for v in _values(arm, "pass_at_1")]
                flags = _seed_flags(sweep, name, arm)
                for s, (v, bad) in enumerate(zip(values, flags, strict=True)):
                    if v is None:
                        continue
                    dx = x + slot * 0.22 + (s - (len(values) - 1) / 2) * slot * 0.12
                    if bad:
                        ax.scatter([dx], [v], marker="x", s=42, color=colors[name], linewidths=1.8, zorder=4)
                    else:
                        ax.scatter([dx], [v], marker="o", s=14, color=colors[name], alpha=0.75, lw=0, zorder=3)
                    top = max(top, v)
                mean = _num(arm.get("pass_at_1_mean"))
                if mean is None:
                    continue
                ci = arm.get("pass_at_1_ci") or [None, None]
                lo, hi = (_num(v) for v in ci[:2]) if len(ci) >= 2 else (None, None)
                yerr = None
                if lo is not None and hi is not None:
                    yerr = [[mean - max(lo, -1.0)], [min(hi, 2.0) - mean]]
                    top = max(top, min(hi, 1.0))
                ax.errorbar([x - slot * 0.12], [mean], yerr=yerr, fmt="o", ms=7, color=colors[name], mec="black",
                            mew=0.6, capsize=4, lw=1.6, zorder=5)  # fmt: skip
                top = max(top, mean)
        for j in range(len(lags) - 1):
            ax.axvline(j + 0.5, color="0.85", lw=0.8, zorder=0)
        ax.set_xticks(range(len(lags)), [f"lag {fmt(lag)}" for lag in lags])
        ax.set_xlim(-0.5, len(lags) - 0.5)
        ax.set_xlabel("lag (policy updates between sampler refreshes)")
        ax.set_ylabel("pass@1 on the held-out tasks")
        ax.set_title(_combo_title(lr, band))
        ax.grid(axis="y", alpha=0.3)
    for k in range(len(combos), rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    axes[0][0].set_ylim(-0.02, min(1.02, top * 1.15 + 0.02))
    seeds = int(_num(sweep.get("seeds")) or 0)
    handles = [Line2D([], [], color=colors[a], marker="o", mec="black", mew=0.6, lw=1.6, label=f"{a}: mean, 95% CI")
               for a in arms]  # fmt: skip
    handles += [
        Line2D([], [], color="0.3", marker="o", ms=4, lw=0, label="one seed"),
        Line2D([], [], color="0.3", marker="x", ms=7, mew=1.8, lw=0, label="diverged seed"),
    ]
    if base_mean is not None:
        handles.append(Line2D([], [], color=COLORS["base"], ls="--", label=f"base model mean {fmt_share(base_mean)}"))
    if floor:
        handles.append(Patch(color=COLORS["base"], alpha=0.3, label=f"± noise floor {fmt_share(floor)}"))
    _legend_below(fig, handles, 4)
    fig.suptitle(f"Held-out pass@1 after training, by lag ({_plural(seeds, 'seed')} per arm)")
    _save(fig, path)


def _log_ratio_axis(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _plot_ratio(path: Path, sweep: dict[str, Any], arms: list[str], colors: dict[str, str]) -> None:
    lags, combos = _lags(sweep), _combos(sweep)
    rows, cols = _grid(len(combos), 2)
    panel = max(6.0, 1.1 * len(lags) + 3.0)
    fig = Figure(figsize=(max(11.0, panel * cols + 0.5), 7.6 * rows + 1.2), layout="constrained")
    axes = fig.subplots(2 * rows, cols, squeeze=False, sharex=True)
    xs = list(range(len(lags)))
    for k, (lr, band) in enumerate(combos):
        cells = _cells_of(sweep, lr, band)
        up, down = axes[2 * (k // cols)][k % cols], axes[2 * (k // cols) + 1][k % cols]
        for name in arms:
            got = [(cells.get(lag) or {}).get("arms", {}).get(name) or {} for lag in lags]
            worst = [_nan(a.get("ratio_max")) for a in got]
            median = [_nan(a.get("ratio_max_median")) for a in got]
            up.plot(xs, worst, color=colors[name], marker="o", lw=2)
            up.plot(xs, median, color=colors[name], marker=".", lw=1.2, ls=":")
            key = "would_be_masked_share_mean" if name == BASELINE else "masked_share_mean"
            share = [_nan(a.get(key)) for a in got]
            down.plot(xs, share, color=colors[name], lw=2, marker="o", ls="--" if name == BASELINE else "-",
                      mfc="white" if name == BASELINE else colors[name])  # fmt: skip
        _log_ratio_axis(up)
        for edge in band:
            if _num(edge) and edge > 0:
                up.axhline(edge, color="#c0392b", ls="--", lw=1.1)
        up.set_title(f"max ratio · {_combo_title(lr, band)}")
        up.tick_params(labelbottom=True)
        up.set_ylabel("max ratio π_trainer / π_sampler (log)")
        up.grid(alpha=0.3, which="both")
        down.set_ylabel("share of generated tokens")
        down.set_ylim(bottom=0)
        down.set_xticks(xs, [f"lag {fmt(lag)}" for lag in lags])
        down.set_xlim(-0.45, len(lags) - 0.55)
        down.set_xlabel("lag (policy updates between sampler refreshes)")
        down.set_title(f"masked share ({BASELINE}: would-be) · {_combo_title(lr, band)}")
        down.grid(alpha=0.3)
    for k in range(len(combos), rows * cols):
        axes[2 * (k // cols)][k % cols].set_visible(False)
        axes[2 * (k // cols) + 1][k % cols].set_visible(False)
    handles = [Line2D([], [], color=colors[a], lw=2, label=a) for a in arms]
    handles += [
        Line2D([], [], color="0.3", lw=2, marker="o", label="max ratio: worst step"),
        Line2D([], [], color="0.3", lw=1.2, ls=":", marker=".", label="max ratio: median step"),
        Line2D([], [], color="0.3", lw=2, marker="o", label="masked share"),
        Line2D([], [], color=colors.get(BASELINE, "0.3"), lw=2, ls="--", marker="o", mfc="white",
               label=f"{BASELINE}: would-be masked share"),
        Line2D([], [], color="#c0392b", lw=1.1, ls="--", label="band edges (see panel title)"),
    ]  # fmt: skip
    _legend_below(fig, handles, math.ceil(len(handles) / 2))
    fig.suptitle("Worst ratio and masked share by lag (over all policy steps of all seeds)")
    _save(fig, path)


def _lag_colors(lags: list[Any]) -> dict[Any, Any]:
    cmap = colormaps[LAG_CMAP]
    n = len(lags)
    return {lag: cmap(0.05 + 0.8 * (i / (n - 1) if n > 1 else 0.0)) for i, lag in enumerate(lags)}


def _plot_per_step(
    path: Path, sweep: dict[str, Any], arms: list[str], key: str, title: str, ylabel: str, *, log_if_wide: bool
) -> None:
    lags, combos = _lags(sweep), _combos(sweep)
    shades = _lag_colors(lags)
    fig = Figure(figsize=(max(8.0, 3.6 * len(arms) + 1), 3.4 * len(combos) + 1.4), layout="constrained")
    axes = fig.subplots(len(combos), len(arms), squeeze=False, sharey=True, sharex=True)
    everything: list[float] = []
    for r, (lr, band) in enumerate(combos):
        cells = _cells_of(sweep, lr, band)
        for c, name in enumerate(arms):
            ax = axes[r][c]
            for lag in lags:
                arm = (cells.get(lag) or {}).get("arms", {}).get(name)
                if not arm:
                    continue
                ys = _step_mean(arm.get(key))
                everything += [y for y in ys if math.isfinite(y)]
                seeds = _seeds(sweep, arm)
                label = f"lag {fmt(lag)}"
                if key == "reward_per_step":
                    label += f" ({len(_diverged(arm))}/{seeds} diverged)"
                ax.plot(range(len(ys)), ys, color=shades[lag], lw=1.8, marker="o" if len(ys) <= 12 else None,
                        ms=3, label=label)  # fmt: skip
            ax.set_title(f"{name} · {_combo_title(lr, band)}", fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=8, loc="best")
            if r == len(combos) - 1:
                ax.set_xlabel("policy step")
            if c == 0:
                ax.set_ylabel(ylabel)
    positive = sorted(y for y in everything if y > 0)
    if log_if_wide and positive:
        top = positive[-1]
        bottom = max(positive[0], top * 1e-4)
        if top / bottom > 100:
            _log_ratio_axis(axes[0][0])  # shared y: every panel follows
            axes[0][0].set_ylim(bottom / 1.5, top * 1.5)
            title += " (log scale; values near 0, such as the first step's, fall below the axis)"
    fig.suptitle(title)
    _save(fig, path)


def _divergence_matrix(
    sweep: dict[str, Any], arms: list[str], cells: list[dict[str, Any]] | None = None
) -> list[list[tuple[int, int] | None]]:
    """arms × cells: (diverged seeds, seeds run), or None where the cell lacks the arm."""
    out = []
    for name in arms:
        row: list[tuple[int, int] | None] = []
        for cell in sweep["cells"] if cells is None else cells:
            arm = cell["arms"].get(name)
            row.append(None if arm is None else (len(_diverged(arm)), _seeds(sweep, arm)))
        out.append(row)
    return out


def _plot_divergence(path: Path, sweep: dict[str, Any], arms: list[str]) -> None:
    """One heat-map panel per learning rate and band: rows arms, columns the cells (lags)."""
    combos = _combos(sweep)
    groups = [list(_cells_of(sweep, lr, band).items()) for lr, band in combos]
    most = max((v[1] for row in _divergence_matrix(sweep, arms) for v in row if v), default=1) or 1
    width = max(len(g) for g in groups)
    rows, cols = _grid(len(combos), 2)
    fig = Figure(figsize=(max(7.0, (1.1 * width + 2.2) * cols + 1.2), (0.62 * len(arms) + 1.5) * rows + 1.0),
                 layout="constrained")  # fmt: skip
    axes = fig.subplots(rows, cols, squeeze=False)
    cmap = colormaps["Reds"].with_extremes(bad="0.9")
    image = None
    for k, ((lr, band), group) in enumerate(zip(combos, groups, strict=True)):
        ax = axes[k // cols][k % cols]
        matrix = _divergence_matrix(sweep, arms, [cell for _, cell in sorted(group, key=lambda t: t[0])])
        values = [[math.nan if v is None else v[0] for v in row] for row in matrix]
        image = ax.imshow(values, cmap=cmap, vmin=0, vmax=most, aspect="auto")
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                text = DASH if v is None else f"{v[0]}/{v[1]}"
                dark = v is not None and v[0] > most / 2
                ax.text(j, i, text, ha="center", va="center", fontsize=11, color="white" if dark else "black")
        ax.set_yticks(range(len(arms)), arms)
        ax.set_xticks(range(len(group)), [f"lag {fmt(lag)}" for lag, _ in sorted(group, key=lambda t: t[0])])
        ax.set_xticks([j + 0.5 for j in range(len(group) - 1)], minor=True)
        ax.set_yticks([i + 0.5 for i in range(len(arms) - 1)], minor=True)
        ax.grid(which="minor", color="white", lw=2)
        ax.tick_params(which="minor", length=0)
        ax.set_title(_combo_title(lr, band), fontsize=10)
        ax.set_xlabel("cell: lag")
    for k in range(len(combos), rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    if image is not None:
        bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, ticks=range(most + 1))
        bar.set_label("diverged seeds")
    rule = sweep.get("divergence_rule") or DASH
    fig.suptitle(f"Diverged seeds per arm and cell (out of the seeds run)\nrule: {rule}", fontsize=11)
    _save(fig, path)


def write_plots(sweep: dict[str, Any], plots: Path) -> list[Path]:
    """The five PNGs under ``plots``; returns their paths."""
    arms = _arms(sweep)
    colors = _colors(arms)
    p = {stem: plots / f"{stem}.png" for stem in PLOTS}
    _plot_pass_at_1(p["sweep_pass_at_1"], sweep, arms, colors)
    _plot_ratio(p["sweep_ratio"], sweep, arms, colors)
    _plot_per_step(p["sweep_kl"], sweep, arms, "kl_per_step", "Sampler–trainer KL per policy step (mean over seeds)",
                   "KL(sampler ‖ trainer), nats/token", log_if_wide=True)  # fmt: skip
    _plot_per_step(p["sweep_reward"], sweep, arms, "reward_per_step", "Training reward per policy step (mean over "
                   "seeds): a collapse is a falling line", "training reward", log_if_wide=False)  # fmt: skip
    _plot_divergence(p["sweep_divergence"], sweep, arms)
    return list(p.values())


# ---------------------------------------------------------------------------------------------------------
# sweep.md


def _pass_ci(arm: dict[str, Any]) -> str:
    ci = arm.get("pass_at_1_ci")
    lo, hi = (ci[0], ci[1]) if isinstance(ci, list) and len(ci) == 2 else (None, None)
    return f"{fmt_share(arm.get('pass_at_1_mean'))} [{fmt_share(lo)}, {fmt_share(hi)}]"


def _seed_values(sweep: dict[str, Any], name: str, arm: dict[str, Any]) -> str:
    values = _values(arm, "pass_at_1")
    flags = _seed_flags(sweep, name, arm)
    return ", ".join(fmt_share(v) + ("†" if bad else "") for v, bad in zip(values, flags, strict=True)) or DASH


def _reward(arm: dict[str, Any]) -> str:
    first, last = (_mean(_values(arm, k)) for k in ("reward_first10", "reward_last10"))
    return f"{fmt_share(first)} → {fmt_share(last)}"


def _arm_section(sweep: dict[str, Any], arms: list[str]) -> list[str]:
    header = ["lag", "lr", "band", "arm", "pass@1 mean [95% CI]", "pass@1 per seed", "reward first 10 → last 10",
              "max ratio", "median step's max ratio", "masked share", "would-be masked share", "KL mean",
              "diverged"]  # fmt: skip
    rows, notes = [], []
    for cell in sweep["cells"]:
        for name in [a for a in arms if a in cell["arms"]]:
            arm = cell["arms"][name]
            diverged = _diverged(arm)
            count = f"{len(diverged)}/{_seeds(sweep, arm)}"
            if diverged:
                notes.append(
                    f"- [d{len(notes) + 1}] {_where(cell)}, {name}: "
                    + "; ".join(f"{_text(label)}: {_text(', '.join(why))}" for label, why in diverged.items())
                )
                count += f" [d{len(notes)}]"
            rows.append([
                fmt(cell["lag"]), fmt(cell["lr"]), fmt(_band(cell)), name, _pass_ci(arm),
                _seed_values(sweep, name, arm), _reward(arm), fmt(arm.get("ratio_max")),
                fmt(arm.get("ratio_max_median")), fmt_share(arm.get("masked_share_mean")),
                fmt_share(arm.get("would_be_masked_share_mean")), fmt(arm.get("kl_mean")), count,
            ])  # fmt: skip
    out = ["## Every cell and arm", ""]
    out.append(
        "pass@1 on the held-out tasks: the mean over seeds with its 95% t interval over seeds (it can reach below 0 "
        "with few seeds), then each seed's value († a diverged seed). Training reward, ratios, shares and KL are over "
        "all policy steps of all seeds; the masked share is what the arm's rule masked, the would-be share what the "
        "band would have masked on that arm."
    )
    out += ["", *_table(header, rows)]
    if notes:
        out += ["Diverged runs, with the reasons recorded:", "", *notes, ""]
    else:
        out += ["No run diverged.", ""]
    return out


def _compare_section(sweep: dict[str, Any]) -> list[str]:
    comparisons = _comparisons(sweep)
    out = [f"## Each arm against {BASELINE}", ""]
    if not comparisons:
        return [*out, "sweep.json holds no comparison.", ""]
    header = ["lag", "lr", "band", "comparison", f"{BASELINE} mean", "arm mean", "delta", "95% interval",
              "noise floor", "unit (n)", "verdict"]  # fmt: skip
    rows = []
    for cell, arm, c in comparisons:
        verdict = str(c.get("verdict") or DASH)
        rows.append([
            fmt(cell["lag"]), fmt(cell["lr"]), fmt(_band(cell)), f"{arm} − {BASELINE}",
            fmt_share(c.get("before_mean")), fmt_share(c.get("after_mean")), fmt_signed(c.get("delta")),
            fmt_interval(c.get("ci_low"), c.get("ci_high")), f"±{fmt_share(c.get('noise_floor'))}",
            f"{c.get('unit', DASH)} ({fmt(c.get('n'))})", f"**{verdict}**" if verdict in SEPARATED else verdict,
        ])  # fmt: skip
    out += _table(header, rows)
    out.append(
        f"Each cell's interval is its own 95% interval, with no correction for multiple comparisons across the "
        f"{_plural(len(comparisons), 'comparison')} of this sweep: by chance alone about 1 in 20 such intervals misses "
        "the true delta. A verdict is `improved` or `regressed` only when the interval excludes 0 and |delta| "
        "exceeds the noise floor (`sao.stats`)."
    )
    return [*out, ""]


def _list(values: Any) -> str:
    return ", ".join(fmt(tuple(v) if isinstance(v, list) else v) for v in values) if isinstance(values, list) else DASH


def _text(x: Any) -> str:
    """Text made safe for a markdown list item (no HTML, one line)."""
    return " ".join(str(x).replace("&", "&amp;").replace("<", "&lt;").split())


def _join(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return "; ".join(items[:-1]) + "; and " + items[-1]


def _summary_section(sweep: dict[str, Any], arms: list[str]) -> list[str]:
    cells = sweep["cells"]
    out = ["## Summary", "", "Written by code from the verdicts and divergence counts in sweep.json.", ""]

    broke = [
        (cell, len(_diverged(cell["arms"][BASELINE])), _seeds(sweep, cell["arms"][BASELINE]))
        for cell in cells
        if BASELINE in cell["arms"]
    ]
    broken = [f"{_where(c)} ({n}/{s})" for c, n, s in broke if n]
    if broken:
        out.append(
            f"**Where the baseline breaks.** `{BASELINE}` diverged in at least one seed in {len(broken)} of "
            f"{_plural(len(broke), 'cell')}: {_join(broken)}."
        )
    else:
        out.append(f"**Where the baseline breaks.** `{BASELINE}` diverged in no seed of {_plural(len(broke), 'cell')}.")

    comparisons = _comparisons(sweep)
    separated = [(cell, arm, c) for cell, arm, c in comparisons if c.get("verdict") in SEPARATED]
    if separated:
        parts = [
            f"{arm} {c['verdict']} at {_where(cell)} (delta {fmt_signed(c.get('delta'))}, "
            f"{fmt_interval(c.get('ci_low'), c.get('ci_high'))})"
            for cell, arm, c in separated
        ]
        out.append(
            f"**Separations.** {len(separated)} of {_plural(len(comparisons), 'comparison')} against `{BASELINE}` "
            f"separated: {_join(parts)}."
        )
    elif comparisons:
        counts: dict[str, int] = {}
        for _, _, c in comparisons:
            counts[str(c.get("verdict") or DASH)] = counts.get(str(c.get("verdict") or DASH), 0) + 1
        tally = ", ".join(f"{v} {n}" for v, n in sorted(counts.items()))
        text = (
            f"**Separations.** No arm separated from `{BASELINE}`: no comparison is `improved` or `regressed` "
            f"(verdicts: {tally})."
        )
        deltas = [(d, cell, arm, c) for cell, arm, c in comparisons if (d := _num(c.get("delta"))) is not None]
        if deltas:
            d, cell, arm, c = max(deltas, key=lambda t: t[0])
            what = "widest positive delta" if d > 0 else "no delta was positive; the largest"
            text += (
                f" The {what} was {fmt_signed(d)} {fmt_interval(c.get('ci_low'), c.get('ci_high'))}, {arm} at "
                f"{_where(cell)} (verdict {c.get('verdict', DASH)})."
            )
        out.append(text)
    else:
        out.append("**Separations.** sweep.json holds no comparison.")

    helped, hurt = [], []
    for cell in cells:
        if BASELINE not in cell["arms"]:
            continue
        base = cell["arms"][BASELINE]
        nb, sb = len(_diverged(base)), _seeds(sweep, base)
        for name in [a for a in arms if a != BASELINE and a in cell["arms"]]:
            arm = cell["arms"][name]
            na, sa = len(_diverged(arm)), _seeds(sweep, arm)
            pair = f"{name} at {_where(cell)} ({BASELINE} {nb}/{sb}, {name} {na}/{sa})"
            if nb and not na:
                helped.append(pair)
            elif na and not nb:
                hurt.append(pair)
    out.append(
        "**Divergence against the baseline.** "
        + (f"`{BASELINE}` diverged but the arm did not: {_join(helped)}. " if helped else
           f"No cell has `{BASELINE}` diverging where an arm did not. ")
        + (f"The arm diverged but `{BASELINE}` did not: {_join(hurt)}." if hurt else
           f"No cell has an arm diverging where `{BASELINE}` did not.")
    )  # fmt: skip
    return [*out[:4], *_paragraphs(out[4:])]


def _paragraphs(texts: list[str]) -> list[str]:
    out = []
    for t in texts:
        out += [t, ""]
    return out


def _base_section(sweep: dict[str, Any]) -> list[str]:
    base = sweep.get("base") or {}
    values = base.get("pass_at_1") or []
    return [
        "## Base model and noise floor",
        "",
        f"The untrained model's pass@1 over {_plural(len(values), 'repeated eval')}: "
        f"{', '.join(fmt_share(v) for v in values) or DASH} (mean {fmt_share(_mean(values))}). "
        f"run_std {fmt(base.get('run_std'))} over {fmt(base.get('runs'))} runs gives the noise floor "
        f"±{fmt_share(base.get('noise_floor'))}, shared by every cell: a delta within it is indistinguishable from "
        "re-evaluating the same model.",
        "",
    ]


def _config_section(sweep: dict[str, Any]) -> list[str]:
    out = []
    config = sweep.get("config") or {}
    keys = [k for k in (*CONFIG_KEYS, "tis_cap") if k in config and k not in ("band", "lag", "lr")]
    if keys:
        out += ["## Configuration", "", "Shared by every cell; lag, lr, band and arm are set per cell and run.", ""]
        out += _table(["setting", "value"], [[k, _cell(fmt(config[k]))] for k in keys], numeric=False)
    versions = sweep.get("versions") or {}
    out += ["## Versions", ""]
    if versions:
        out += _table(["package", "version"], [[k, _cell(v)] for k, v in versions.items()], numeric=False)
    else:
        out += ["sweep.json records no versions.", ""]
    if "wall_time_s" in sweep:
        out += [f"Time spent training and evaluating, summed over runs: {fmt_seconds(sweep.get('wall_time_s'))}.", ""]
    return out


def render(sweep: dict[str, Any]) -> str:
    """The text of sweep.md (plots are linked, not embedded)."""
    arms = _arms(sweep)
    grid = sweep.get("grid") or {}
    cells = sweep["cells"]
    config = sweep.get("config") or {}
    seeds = int(_num(sweep.get("seeds")) or 0)
    lrs, bands = list(dict.fromkeys(c[0] for c in _combos(sweep))), list(dict.fromkeys(c[1] for c in _combos(sweep)))
    lines = [
        f"# sao sweep: {config.get('model', DASH)} on {config.get('data', DASH)}",
        "",
        f"**Question.** {sweep.get('question') or DASH}",
        "",
        f"Grid: lags {_list(grid.get('lags') or _lags(sweep))}; lrs {_list(grid.get('lrs') or lrs)}; bands "
        f"{_list(grid.get('bands') or bands)}: {_plural(len(cells), 'cell')}; in each, the arms {', '.join(arms)} "
        f"train {_plural(seeds, 'seed')} each. Every number below is read from sweep.json.",
        "",
        "Regenerate with:",
        "",
    ]
    command = sweep.get("command")
    if command:
        lines += ["```", str(command), "```", ""]
    else:
        lines += ["*(sweep.json records no command: it was written by code, not by `sao sweep`.)*", ""]
    lines += [f"**Divergence rule.** A run has diverged on: {sweep.get('divergence_rule') or DASH}.", ""]
    for section in (
        _base_section(sweep),
        _summary_section(sweep, arms),
        _arm_section(sweep, arms),
        _compare_section(sweep),
        _plots_section(PLOTS),
        _config_section(sweep),
    ):
        lines += section
    return "\n".join(lines).rstrip() + "\n"


def write(out_dir: str | os.PathLike) -> Path:
    """Write ``out_dir/plots/sweep_*.png`` and ``out_dir/sweep.md`` from sweep.json; return sweep.md's path."""
    out = Path(out_dir)
    sweep = load(out)
    write_plots(sweep, out / "plots")
    path = out / "sweep.md"
    _atomic_write(path, render(sweep).encode("utf-8"))
    return path
