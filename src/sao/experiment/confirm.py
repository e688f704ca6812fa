"""`sao confirm PLAN`: a confirmation planned before it runs — the primary endpoint, the family of comparisons and
its correction, and fresh seeds, all fixed in a file before the first step is trained.

The plan (YAML or JSON) names the question, preset, settings, grid, arms, the primary comparison, the secondary
comparisons made in every cell, the seeds, the exploratory runs it follows, the smallest effect of interest, the
correction (holm, after the primary when gatekeeping) and alpha, and its power is computed before anything trains.
Each comparison is ``sao.core.stats.compare`` over seeds; improved or regressed stands only when its adjusted p is
below alpha. The seeds must be disjoint from every cited exploratory run's. The run is one
``sao.experiment.runner.Experiment`` plus ``plan.<ext>`` (its sha256 guards --resume) and ``plan`` and
``confirmation`` blocks in results.json.

Deliberately left out: choosing the plan, testing schemes beyond fixed-sequence then Holm, and any comparison that
was not planned.
Design notes: docs/design/confirm.md (with an example plan).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sao.core import stats
from sao.core.config import CONFIG_LIMITS, MAX_TRAIN_RUNS, SEED_LIMIT, Config, canonical, flatten
from sao.core.errors import ConfigError
from sao.core.io import write_json
from sao.core.reading import parse_json, parse_yaml, read_json_file
from sao.core.registry import PRESETS
from sao.experiment import report, results
from sao.experiment.runner import Experiment, Grid, arm_settings, cell_name

CORRECTIONS = ("holm",)
EXPECT = ("improved", "regressed")
PLAN_SET = ("lag", "lr", "ratio", "correction", "seed", "train_runs")  # the plan sets these, not its settings
KEYS = {"question", "written", "preset", "settings", "grid", "arms", "primary", "secondary", "seeds", "exploratory",
        "correction", "alpha", "smallest_effect", "expected_sd", "gatekeeping"}  # fmt: skip
# The fields this module adds to a plan (docs/design/confirm.md has the whole plan):
#   smallest_effect: δ > 0, the smallest delta of pass@1 that would matter, fixed before the run. Every comparison of
#     the family uses it: improved/regressed need |delta| > δ, flat needs the 1 − 2·alpha interval inside ± δ. Absent:
#     the run's noise floor stands in for δ (and each reason says so); power then uses a cited run's noise floor.
#   expected_sd: the sd of the per-seed deltas of the primary comparison expected (> 0), for the power. Absent: the sd
#     of the per-seed deltas in the primary cell of the cited exploratory run with the most seeds; neither: refused.
#   gatekeeping: true: the primary is tested alone at the full alpha, and the secondary comparisons (the rest of the
#     family) are Holm-adjusted among themselves only if the primary came out as expected (fixed sequence); otherwise
#     they are reported but not claimed. false: Holm across the whole family, primary included. Default: true for a
#     plan that states smallest_effect (a plan written for these rules), false for one that does not.
POWER_TARGET = 0.8  # a plan whose power for δ is below this is warned about in words (not refused)


@dataclass(frozen=True)
class Plan:
    """A confirmation plan, read and checked. ``family`` lists (cell name, comparison) with the primary first."""

    path: Path
    sha256: str
    question: str
    written: str | None
    config: Config
    grid: Grid
    primary: dict[str, Any]  # cell, comparison, after, before, expect
    secondary: list[str]
    seeds: list[int]
    correction: str
    alpha: float
    exploratory: list[dict[str, Any]] = field(default_factory=list)  # path, seeds, weights_sha256
    smallest_effect: float | None = None  # δ; None: the run's noise floor stands in
    expected_sd: float | None = None  # the plan's own sd of per-seed primary deltas, for the power
    gatekeeping: bool = False  # the primary alone at full alpha, then Holm over the rest only if it succeeded
    power: dict[str, Any] | None = None  # ``plan_power``: the plan's power for δ, computed before the run

    @property
    def family(self) -> list[tuple[str, str]]:
        first = (self.primary["cell"], self.primary["comparison"])
        rest = [(c["name"], k) for c in self.grid.cells() for k in self.secondary if (c["name"], k) != first]
        return [first, *rest]

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.path.name,
            "sha256": self.sha256,
            "question": self.question,
            "written": self.written,
            "primary": self.primary,
            "secondary": self.secondary,
            "family": [{"cell": cell, "comparison": key} for cell, key in self.family],
            "arms": list(self.grid.arms),
            "grid": asdict(self.grid),
            "seeds": self.seeds,
            "correction": self.correction,
            "alpha": self.alpha,
            "exploratory": self.exploratory,
            "random_mask_share": self.config.algorithm.random_mask_share,
            "smallest_effect": self.smallest_effect,
            "expected_sd": self.expected_sd,
            "gatekeeping": self.gatekeeping,
            "power": self.power,
        }


def _fail(path: Path, message: str) -> ConfigError:
    return ConfigError(f"plan {path}: {message}")


def _comparison(path: Path, text: Any, arms: tuple[str, ...], where: str) -> tuple[str, str]:
    """AFTER_vs_BEFORE, split at ``_vs_``: no rule or baseline holds it, and the ``+`` of an arm like dis+batch-mean
    is not it, so ``dis_vs_dis+batch-mean`` is (dis, dis+batch-mean)."""
    parts = text.split("_vs_") if isinstance(text, str) else []
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise _fail(path, f"{where} must be a comparison like dis_vs_none (after_vs_before), got {text!r}")
    missing = [a for a in parts if a not in arms]
    if missing:
        raise _fail(path, f"{where} {text} compares arm(s) {missing} that the plan's arms {list(arms)} lack")
    return parts[0], parts[1]


def read_plan(path: str | Path) -> Plan:
    """The plan in ``path``, checked: every field present and of its kind, the primary cell in the grid, every
    compared arm trained, the seeds fresh against every exploratory run it cites. Any problem is a ConfigError
    naming the plan and the field."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise _fail(path, f"cannot be read ({error.strerror or error})") from None
    where = f"plan {path}"
    parse = parse_json if path.suffix.lower() == ".json" else parse_yaml
    data = parse(raw, where=where, limits=CONFIG_LIMITS, error=ConfigError)
    if not isinstance(data, dict):
        raise _fail(path, "must be a mapping (question, primary, seeds, ...)")
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise _fail(path, f"unknown field(s) {unknown}; a plan has {sorted(KEYS)}")
    for name in ("question", "primary", "seeds", "arms", "correction"):
        if data.get(name) in (None, "", [], {}):
            raise _fail(path, f"lacks '{name}': a confirmation states it before it runs")
    if not isinstance(data["question"], str):
        raise _fail(path, "'question' must be text")

    settings = data.get("settings") or {}
    if not isinstance(settings, dict):
        raise _fail(path, "'settings' must be a mapping of settings (name: value)")
    try:
        settings = canonical(flatten(settings, f"plan {path}: settings"))
    except ConfigError as error:
        raise _fail(path, f"settings: {error}") from None
    clash = sorted(set(settings) & set(PLAN_SET))
    if clash:
        raise _fail(path, f"settings {clash} are set by the plan's grid, primary and seeds, not by 'settings'")
    preset = data.get("preset", "protocol")
    if preset not in PRESETS:
        raise _fail(path, f"unknown preset {preset!r}; choose one of {PRESETS.names()}")

    seeds = _seeds(path, data["seeds"])
    try:
        config = Config.load(preset, **settings, seed=seeds[0], train_runs=len(seeds))
    except (ConfigError, TypeError) as error:
        raise _fail(path, f"settings: {error}") from None

    arms = data["arms"]
    if not (isinstance(arms, list) and all(isinstance(a, str) for a in arms)):
        raise _fail(path, "'arms' must be a list of arms: correction rules, or RULE+BASELINE (dis+batch-mean)")
    primary = data["primary"]
    if not isinstance(primary, dict) or not {"lag", "lr", "comparison"} <= set(primary):
        raise _fail(path, "'primary' must name lag, lr and comparison (and band, unless the config's)")
    band = tuple(primary.get("band") or config.algorithm.ratio)
    grid_spec = data.get("grid") or {}
    if not isinstance(grid_spec, dict) or set(grid_spec) - {"lags", "lrs", "bands"}:
        raise _fail(path, "'grid' must be a mapping with lags, lrs and bands")
    try:
        grid = Grid(
            lags=tuple(grid_spec.get("lags") or (primary["lag"],)),
            lrs=tuple(float(x) for x in grid_spec.get("lrs") or (primary["lr"],)),
            bands=tuple(tuple(b) for b in grid_spec.get("bands") or (band,)),
            arms=tuple(arms),
        )
        for arm in arms:
            Config.load(preset, **{**settings, **arm_settings(arm)},
                          random_mask_share=config.algorithm.random_mask_share or 0.0)  # fmt: skip
    except (ConfigError, TypeError, ValueError) as error:
        raise _fail(path, f"grid or arms: {error}") from None
    after, before = _comparison(path, primary["comparison"], grid.arms, "primary.comparison")
    expect = primary.get("expect", "improved")
    if expect not in EXPECT:
        raise _fail(path, f"primary.expect must be one of {list(EXPECT)}, got {expect!r}")
    try:
        name = cell_name(int(primary["lag"]), float(primary["lr"]), (float(band[0]), float(band[1])))
    except (TypeError, ValueError, IndexError):
        raise _fail(path, f"primary: lag, lr and band must be numbers, got {primary}") from None
    if name not in [c["name"] for c in grid.cells()]:
        raise _fail(path, f"the primary cell {name} is not a cell of the grid {[c['name'] for c in grid.cells()]}")
    secondary = data.get("secondary") or []
    if not isinstance(secondary, list):
        raise _fail(path, "'secondary' must be a list of comparisons like dis_vs_random")
    for key in secondary:
        _comparison(path, key, grid.arms, "secondary")

    correction = data["correction"]
    if correction not in CORRECTIONS:
        raise _fail(path, f"correction must be one of {list(CORRECTIONS)}, got {correction!r}")
    alpha = data.get("alpha", 0.05)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise _fail(path, f"alpha must be a number in (0, 1), got {alpha!r}")
    written = data.get("written")
    smallest_effect, expected_sd = (_positive(path, data, key) for key in ("smallest_effect", "expected_sd"))
    gatekeeping = data.get("gatekeeping", smallest_effect is not None)
    if not isinstance(gatekeeping, bool):
        raise _fail(path, f"gatekeeping must be true or false, got {gatekeeping!r}")

    cited = [_exploratory(path, item) for item in data.get("exploratory") or []]
    exploratory = [record for record, _ in cited]
    reused = {e["path"]: sorted(set(seeds) & set(e["seeds"])) for e in exploratory}
    reused = {k: v for k, v in reused.items() if v}
    if reused:
        listed = "; ".join(f"{k} used {v}" for k, v in reused.items())
        raise _fail(path, f"the seeds are not fresh: {listed}. Choose seeds no exploratory run has used")
    plan = Plan(
        path=path, sha256=hashlib.sha256(raw).hexdigest(), question=data["question"],
        written=None if written is None else str(written), config=config, grid=grid,
        primary={"cell": name, "comparison": f"{after}_vs_{before}", "after": after, "before": before,
                 "expect": expect},
        secondary=[str(k) for k in secondary], seeds=seeds, correction=correction, alpha=float(alpha),
        exploratory=exploratory, smallest_effect=smallest_effect, expected_sd=expected_sd, gatekeeping=gatekeeping,
    )  # fmt: skip
    return replace(plan, power=plan_power(plan, [(record["path"], got) for record, got in cited]))


def _positive(path: Path, data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise _fail(path, f"{key} must be a number > 0 (a delta of pass@1), got {value!r}")
    return float(value)


def _primary_deltas(data: dict[str, Any], cell: str, after: str, before: str) -> list[float] | None:
    """The per-seed pass@1 deltas after − before (seeds paired by index) in ``cell`` of an exploratory
    results.json or sweep.json, or None when it does not hold both arms there with the same seeds (at least 2)."""
    for c in data.get("cells") or []:
        if not isinstance(c, dict) or c.get("name") != cell or not isinstance(c.get("arms"), dict):
            continue
        values = [(c["arms"].get(arm) or {}).get("pass_at_1") for arm in (after, before)]
        if all(isinstance(v, list) and all(map(_finite, v)) for v in values) and len(values[0]) == len(values[1]) >= 2:
            return [float(x) - float(y) for x, y in zip(values[0], values[1], strict=True)]
    return None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def plan_power(plan: Plan, cited: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The plan's power for its δ before the run: the paired t over its seeds at the level its primary is tested
    at (alpha under gatekeeping; under Holm across m comparisons at least the power at alpha / m, at most at alpha),
    with its ``expected_sd`` or the sd of the per-seed primary deltas of the cited run with the most seeds, and δ
    its ``smallest_effect`` or that run's noise floor. A plan with no sd (or no δ) to use is refused."""
    after, before, cell = plan.primary["after"], plan.primary["before"], plan.primary["cell"]
    found = [(where, d, data) for where, data in cited if (d := _primary_deltas(data, cell, after, before))]
    found = [(where, d, data) for where, d, data in found if statistics.stdev(d) > 0]
    best = max(found, key=lambda f: len(f[1]), default=None)  # the first cited among the largest
    if plan.expected_sd is not None:
        sd, sd_source = plan.expected_sd, "the plan's expected_sd"
    elif best is not None:
        sd = statistics.stdev(best[1])
        sd_source = f"the sd of the {len(best[1])} per-seed {after} − {before} deltas in {cell} of {best[0]}"
    else:
        raise _fail(plan.path, f"states no expected_sd, and no exploratory run it cites holds per-seed pass@1 of "
                               f"{after} and {before} in {cell}: add expected_sd (the sd of the per-seed {after} − "
                               f"{before} deltas expected) so that its power can be computed")  # fmt: skip
    first = [(best[0], best[2])] if best else []  # the run the sd came from, then every run in the plan's order
    floors = [(where, f) for where, data in first + cited
              if _finite(f := (data.get("base") or {}).get("noise_floor")) and f > 0]  # fmt: skip
    if plan.smallest_effect is not None:
        delta, delta_source = plan.smallest_effect, "the plan's smallest_effect"
    elif floors:
        delta, delta_source = floors[0][1], f"no smallest_effect: the noise floor of {floors[0][0]}"
    else:
        raise _fail(plan.path, "states no smallest_effect, and no exploratory run it cites records a noise floor: "
                               "add smallest_effect (the smallest delta of pass@1 that would matter)")  # fmt: skip
    n, m = len(plan.seeds), len(plan.family)
    level = plan.alpha if plan.gatekeeping or m == 1 else plan.alpha / m
    least = stats.least_exact_p(n)

    def at(alpha: float) -> float:
        return 0.0 if n < 2 or least >= alpha else stats.power(delta, sd, n, alpha)

    out = {"smallest_effect": delta, "smallest_effect_source": delta_source, "sd": sd, "sd_source": sd_source,
           "seeds": n, "alpha": plan.alpha, "alpha_primary": level, "test": "paired t over seeds, two-sided",
           "power": at(level), "power_at_alpha": at(plan.alpha), "least_exact_p": least, "target": POWER_TARGET,
           "seeds_for_power": stats.seeds_for_power(delta, sd, level, POWER_TARGET)}  # fmt: skip
    how = (f"the primary alone at alpha {plan.alpha:g} (gatekeeping)" if level == plan.alpha else
           f"alpha {plan.alpha:g} / {m} = {level:.3g}, the primary's level when its p is the family's smallest "
           f"under Holm (at full alpha it would be {out['power_at_alpha']:.2f})")  # fmt: skip
    out["summary"] = (f"power {out['power']:.2f} to detect δ {delta:.3g} ({delta_source}) with sd {sd:.3g} "
                      f"({sd_source}) over {n} paired seeds at {how}; {out['seeds_for_power']} seeds would give "
                      f"{POWER_TARGET:g}. It is the chance of p < alpha when the true delta is δ: improved also "
                      "needs the observed |delta| above δ, which a true effect of exactly δ shows about half the "
                      "time")  # fmt: skip
    out["warning"] = None
    if out["power"] < POWER_TARGET:
        missed = f"a true effect of δ would be missed {1 - out['power']:.0%} of the time"
        why = f"with {n} seeds the exact sign-flip p cannot go below {least:.3g}" if least >= level else missed
        out["warning"] = (f"the plan's power is {out['power']:.2f}, below {POWER_TARGET:g}: {why}; "
                          f"{out['seeds_for_power']} seeds would give {POWER_TARGET:g}")  # fmt: skip
    return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seeds(path: Path, spec: Any) -> list[int]:
    if isinstance(spec, dict) and set(spec) == {"first", "count"}:
        first, count = spec["first"], spec["count"]
        if not (_whole(first) and _whole(count)) or not 1 <= count <= MAX_TRAIN_RUNS:
            raise _fail(path, f"seeds: first and count must be whole numbers, 1 <= count <= {MAX_TRAIN_RUNS}")
        if not 0 <= first <= SEED_LIMIT - count:
            raise _fail(path, f"seeds: first must be from 0 to 2**63 - count (seeds are below 2**63), got {first}")
        return list(range(first, first + count))
    if isinstance(spec, list) and spec and all(_whole(s) for s in spec):
        if len(spec) > MAX_TRAIN_RUNS:
            raise _fail(path, f"seeds: {len(spec)} seeds, at most {MAX_TRAIN_RUNS}")
        if not all(0 <= s < SEED_LIMIT for s in spec):
            raise _fail(path, "seeds must be whole numbers from 0 to 2**63 - 1")
        if len(set(spec)) != len(spec):
            raise _fail(path, f"seeds must be distinct, got {spec}")
        return list(spec)
    raise _fail(path, f"seeds must be a list of integers or {{first: N, count: S}}, got {spec!r}")


def _exploratory(plan: Path, item: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """An exploratory run the plan cites: (its path as written, the training seeds it used and its model hash; the
    file's content)."""
    if not isinstance(item, str):
        raise _fail(plan, f"exploratory entries are paths to results.json files or experiment folders, got {item!r}")
    where = (plan.parent / item) if not Path(item).is_absolute() else Path(item)
    if where.is_dir():
        found = [where / name for name in ("results.json", "sweep.json", "experiment.json", "config.json")]
        where = next((f for f in found if f.is_file()), where)
    if not where.is_file():
        raise _fail(plan, f"exploratory {item}: no such file, or a folder without results.json, sweep.json, "
                          "experiment.json or config.json, so its seeds cannot be checked")  # fmt: skip
    try:
        data = read_json_file(where, expect=dict, error=ConfigError)
    except ConfigError as error:
        raise _fail(plan, f"exploratory {item}: {error}") from None
    seeds = seeds_of(data)
    if not seeds:
        raise _fail(plan, f"exploratory {item}: records no training seeds, so freshness cannot be checked")
    weights = ((data.get("provenance") or {}).get("model") or {}).get("weights_sha256")
    return {"path": item, "seeds": sorted(seeds), "weights_sha256": weights}, data


def seeds_of(data: Any) -> set[int]:
    """Every training seed a results.json, sweep.json, experiment.json or run config.json records."""
    seeds: set[int] = set()
    if not isinstance(data, dict):
        return seeds
    listed = data.get("seeds")
    seeds |= {s for s in listed if isinstance(s, int)} if isinstance(listed, list) else set()
    config = data.get("config") if isinstance(data.get("config"), dict) else None
    if config and any(isinstance(v, dict) for v in config.values()):  # sectioned settings: the flat names
        try:
            config = flatten(config)
        except ConfigError:
            config = None
    if config and isinstance(config.get("seed"), int):
        runs = config.get("train_runs") if isinstance(config.get("train_runs"), int) else 1
        if isinstance(listed, int) and not isinstance(listed, bool):  # an older sweep.json: the count of seeds
            runs = max(runs, listed)
        seeds |= set(range(config["seed"], config["seed"] + max(runs, 1)))
    for cell in data.get("cells") or []:
        for arm in (cell.get("arms") or {}).values() if isinstance(cell, dict) else []:
            for run in (arm.get("runs") or {}).values() if isinstance(arm, dict) else []:
                if isinstance(run, dict) and isinstance(run.get("seed"), int):
                    seeds.add(run["seed"])
    return seeds


def confirmation(summary: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """The planned family, compared and adjusted, from an experiment's results.json content."""
    return decide(family_rows(summary, plan), plan)


ROW_KEYS = ("after", "before", "delta", "ci_low", "ci_high", "p_value", "p_t", "p_exact", "p_rule", "unit", "n",
            "noise_floor", "smallest_effect", "smallest_effect_source", "equivalence_low", "equivalence_high",
            "p_equivalence", "sd_floored", "alpha")  # fmt: skip


def family_rows(summary: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """One row per comparison of the family, primary first: ``results.compare_arms`` in its cell under the plan's
    smallest effect and alpha, written back into the cell's ``compare`` so that every table shows the same."""
    cells = {c["name"]: c for c in summary["cells"]}
    rows = []
    for cell_name_, key in plan.family:
        cell = cells[cell_name_]
        after, before = key.split("_vs_")
        c = results.compare_arms(cell["arms"], after, before, summary["base"], smallest_effect=plan.smallest_effect,
                                 alpha=plan.alpha)  # fmt: skip
        cell["compare"][key] = c
        rows.append({"cell": cell_name_, "comparison": key, **{k: c.get(k) for k in ROW_KEYS},
                     "verdict_unadjusted": c["verdict"], "reason_unadjusted": c["reason"]})  # fmt: skip
    return rows


def decide(rows: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """The family's verdicts after the plan's correction. Holm across every row; or, under gatekeeping, the primary
    (row 0) alone at alpha, then Holm across the rest only if the primary came out as expected, and otherwise the
    rest reported but not claimed. Only improved/regressed are corrected: a flat verdict is each comparison's own
    equivalence test."""
    m = len(rows)
    if plan.gatekeeping:
        first, rest = rows[0], rows[1:]
        first.update(p_holm=first["p_value"], stage="primary", claimed=True)
        _adjust([first], [first["p_value"]], plan.alpha, "alone at the full alpha (gatekeeping)")
        gate = "open" if first["verdict"] == plan.primary["expect"] else "closed"
        for row, p in zip(rest, stats.holm([r["p_value"] for r in rest]), strict=True):
            row.update(p_holm=p, stage="secondary", claimed=gate == "open")
        if gate == "open":
            _adjust(rest, [r["p_holm"] for r in rest], plan.alpha, f"across the {len(rest)} secondary comparisons")
        else:
            for row in rest:
                alone = row["verdict_unadjusted"]
                row["verdict"] = "unresolved"
                row["reason"] = (f"not claimed: under gatekeeping the secondary comparisons are tested only once the "
                                 f"primary is {plan.primary['expect']}, and it is {first['verdict']}; alone this "
                                 f"would be {alone} (p = {row['p_value']:.3g}; Holm across the {len(rest)} secondary "
                                 f"comparisons {row['p_holm']:.3g}).")  # fmt: skip
    else:
        gate = None
        for row, p in zip(rows, stats.holm([r["p_value"] for r in rows]), strict=True):
            row.update(p_holm=p, stage="family", claimed=True)
        _adjust(rows, [r["p_holm"] for r in rows], plan.alpha, f"across the {m} planned comparisons")
    first = rows[0]
    outcome = ("confirmed" if first["verdict"] == plan.primary["expect"]
               else "contradicted" if first["verdict"] in EXPECT else "not confirmed")  # fmt: skip
    return {
        "correction": plan.correction,
        "alpha": plan.alpha,
        "gatekeeping": plan.gatekeeping,
        "gate": gate,  # under gatekeeping: "open" (the secondary family was tested) or "closed"; else None
        "smallest_effect": plan.smallest_effect,
        "family_size": m,
        "family": rows,
        "primary": first,
        "expect": plan.primary["expect"],
        "outcome": outcome,
    }


def _adjust(rows: list[dict[str, Any]], adjusted: list[float], alpha: float, where: str) -> None:
    """Each row's verdict after its adjusted p: improved or regressed stands only when it is below alpha."""
    name = "p" if where.startswith("alone") else "Holm-adjusted p"
    for row, p in zip(rows, adjusted, strict=True):
        verdict = row["verdict_unadjusted"]
        if verdict in EXPECT and p >= alpha:
            row["verdict"] = "unresolved"
            row["reason"] = (f"unresolved after Holm's correction: alone it would be {verdict} "
                             f"(p = {row['p_value']:.3g}), but {where} the adjusted p = {p:.3g} is not below alpha "
                             f"{alpha:g}.")  # fmt: skip
        else:
            row["verdict"] = verdict
            row["reason"] = row["reason_unadjusted"] + (f" {name} = {p:.3g}, {where}." if verdict in EXPECT else "")


def _exploratory_warnings(plan: Plan, weights: str | None) -> list[str]:
    out = []
    for e in plan.exploratory:
        if e["weights_sha256"] is None:
            out.append(f"the exploratory run {e['path']} records no model hash, so whether it ran on the model "
                       "confirmed here cannot be checked")  # fmt: skip
        elif weights is not None and e["weights_sha256"] != weights:
            out.append(f"the exploratory run {e['path']} ran on other model weights "
                       f"({e['weights_sha256'][:12]}) than this confirmation ({weights[:12]}): it is not a repeat of "
                       "that experiment")  # fmt: skip
    return out


def run(
    plan_path: str | Path, out_dir: str | Path, *, resume: bool = False, progress: bool = True,
    command: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the plan in ``plan_path`` into ``out_dir``; write and return results.json's content."""
    plan = read_plan(plan_path)
    out = Path(out_dir)
    copy = out / f"plan{plan.path.suffix.lower()}"
    if resume and copy.is_file() and hashlib.sha256(copy.read_bytes()).hexdigest() != plan.sha256:
        raise ConfigError(f"--resume: {plan.path} differs from the plan this confirmation started with ({copy})")
    experiment = Experiment(plan.config, plan.grid, out, resume=resume, progress=progress, command=command,
                            seeds=plan.seeds, record={"plan_sha256": plan.sha256})  # fmt: skip
    if not copy.exists():
        out.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(plan.path.read_bytes())  # the plan as given, before anything is trained
    summary = experiment.run()
    block = confirmation(summary, plan)
    summary["question"] = plan.question
    summary["plan"] = plan.to_dict()
    summary["confirmation"] = block
    summary["primary"] = {"cell": plan.primary["cell"], "comparison": plan.primary["comparison"]}
    summary["verdict"], summary["reason"] = block["primary"]["verdict"], block["primary"]["reason"]
    extra = _exploratory_warnings(plan, ((summary.get("provenance") or {}).get("model") or {}).get("weights_sha256"))
    for message in extra:
        print("warning: " + message, file=sys.stderr, flush=True)
    summary["provenance"]["warnings"] = [*summary["provenance"].get("warnings", []), *extra]
    write_json(out / "results.json", summary)
    report.write(out)
    return json.loads(json.dumps(summary, default=str))


__all__ = ["Plan", "confirmation", "decide", "family_rows", "plan_power", "read_plan", "run", "seeds_of"]
