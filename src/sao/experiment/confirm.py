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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sao.core import stats
from sao.core.config import CONFIG_LIMITS, MAX_TRAIN_RUNS, SEED_LIMIT, Config, canonical, flatten
from sao.core.errors import ConfigError
from sao.core.io import write_json
from sao.core.reading import parse_json, parse_yaml, read_json_file
from sao.core.registry import PRESETS
from sao.experiment import report, results
from sao.experiment.runner import Experiment, Grid, cell_name

CORRECTIONS = ("holm",)
EXPECT = ("improved", "regressed")
CLAIMS = (*EXPECT, *stats.COLLAPSE_VERDICTS)  # what a row of the family can claim, and Holm's correction guards
DECISION_RULES = ("direction", "minimum-effect", "observed-above-delta")
OLD_RULE = "observed-above-delta"  # a plan that states no decision_rule: the rule it was written under
COLLAPSE = "collapse:"  # a secondary comparison of collapse rates: collapse:dis_vs_none
INTERACTION = "interaction:"  # a comparison's per-seed delta in the primary cell against the same in another cell
PLAN_SET = ("lag", "lr", "ratio", "correction", "seed", "train_runs")  # the plan sets these, not its settings
KEYS = {
    "question",
    "written",
    "preset",
    "settings",
    "grid",
    "arms",
    "primary",
    "secondary",
    "seeds",
    "exploratory",
    "correction",
    "alpha",
    "smallest_effect",
    "expected_sd",
    "gatekeeping",
    "decision_rule",
    "expected_effect",
    "rank_estimand",
    "collapse_floor",
    "power_model",
    "define",
    "power_fit",
}
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
#   decision_rule: what makes the primary come out as expected. "direction": its verdict (improved or regressed when
#     the interval excludes 0, whatever the size; the magnitude against δ is reported apart). "minimum-effect": its
#     verdict and the interval beyond δ (the minimum-effect test; needs expected_effect). Absent: the rule plans had
#     before it existed, "observed-above-delta" (improved only when also |delta| > δ), so they re-aggregate as they did.
#   expected_effect: the true delta the plan expects (> δ), for the power of the minimum-effect rule.
#   rank_estimand: true: beside every mean comparison, the Hodges–Lehmann shift of the per-seed deltas with its
#     interval and the sign test (reported, not corrected; robust to a few collapsed seeds).
#   collapse_floor: a run whose pass@1 is below it collapsed: every comparison reports both arms' collapse rates and
#     McNemar's exact test, and "collapse:A_vs_B" in secondary makes that test a member of the family (Holm).
#   power_model: the power from a mixture (stats.Mixture) instead of a normal sd: {collapse: P(a run collapses), one
#     number or [after, before], sd: the sd of the per-seed deltas where neither collapsed, healthy: a healthy run's
#     pass@1, collapsed: a collapsed run's}; any field left out is fitted (stats.fit_mixture, with collapse_floor) to
#     the primary cell of the cited exploratory run with the most seeds there. Needs collapse_floor.
#   power_fit: {cell: NAME, comparison: A_vs_B}: fit the mixture's missing fields to that comparison of the cited runs
#     instead of the primary (for a primary whose arms no cited run trained; the plan says why it stands in).
#   define: arms of the plan's own, name → settings over the preset's (a correction rule among them): ablations
#     (dis-lambda1: {correction: dis, gae_lambda: 1}) and doses (dis-bf16: {correction: dis, sampler_dtype: bfloat16})
POWER_TARGET = 0.8  # a plan whose power for δ is below this is refused unless accepted (check_power)


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
    decision_rule: str = OLD_RULE  # DECISION_RULES; the default is what a plan that states none was written under
    expected_effect: float | None = None  # the true delta expected, for the power of the minimum-effect rule
    rank_estimand: bool = False  # Hodges–Lehmann and the sign test beside every mean comparison
    collapse_floor: float | None = None  # a run below this pass@1 collapsed; collapse rates and McNemar
    power_model: dict[str, Any] | None = None  # the mixture's fields the plan gives (None: a normal sd)
    power_fit: dict[str, str] | None = None  # the cited runs' cell and comparison the mixture is fitted to

    @property
    def verdict_rule(self) -> str:
        """The rule ``stats.compare`` judges each comparison by: the old one for a plan written under it."""
        return OLD_RULE if self.decision_rule == OLD_RULE else "direction"

    @property
    def family(self) -> list[tuple[str, str]]:
        first = (self.primary["cell"], self.primary["comparison"])
        rest = [
            (c["name"], k)
            for c in self.grid.cells()
            for k in self.secondary
            if (c["name"], k) != first and not (k.startswith(INTERACTION) and c["name"] == first[0])
        ]
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
            "grid": self.grid.to_dict(),
            "seeds": self.seeds,
            "correction": self.correction,
            "alpha": self.alpha,
            "exploratory": self.exploratory,
            "random_mask_share": self.config.algorithm.random_mask_share,
            "smallest_effect": self.smallest_effect,
            "expected_sd": self.expected_sd,
            "gatekeeping": self.gatekeeping,
            "power": self.power,
            **self._stated(),
        }

    def _stated(self) -> dict[str, Any]:
        """The fields a plan written before them does not have, only where this plan states them (so an older plan's
        block reads as it did)."""
        out: dict[str, Any] = {}
        if self.decision_rule != OLD_RULE:
            out["decision_rule"] = self.decision_rule
        for key in ("expected_effect", "collapse_floor", "power_model", "power_fit"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.rank_estimand:
            out["rank_estimand"] = True
        return out


def _fail(path: Path, message: str) -> ConfigError:
    return ConfigError(f"plan {path}: {message}")


def _comparison(path: Path, text: Any, arms: tuple[str, ...], where: str) -> tuple[str, str]:
    """AFTER_vs_BEFORE, split at ``_vs_``: no rule or baseline holds it, and the ``+`` of an arm like dis+batch-mean
    is not it, so ``dis_vs_dis+batch-mean`` is (dis, dis+batch-mean). A ``collapse:`` in front (collapse rates, in
    secondary) is not part of the arms."""
    if where == "secondary" and isinstance(text, str):
        text = text.removeprefix(COLLAPSE).removeprefix(INTERACTION)
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
    seeds = _seeds(path, data["seeds"])
    config, grid, primary, secondary = _design(path, data, seeds)
    statistics = _statistics(path, data, secondary)
    cited = [_exploratory(path, item) for item in data.get("exploratory") or []]
    exploratory = [record for record, _ in cited]
    reused = {e["path"]: sorted(set(seeds) & set(e["seeds"])) for e in exploratory}
    reused = {k: v for k, v in reused.items() if v}
    if reused:
        listed = "; ".join(f"{k} used {v}" for k, v in reused.items())
        raise _fail(path, f"the seeds are not fresh: {listed}. Choose seeds no exploratory run has used")
    written = data.get("written")
    plan = Plan(
        path=path,
        sha256=hashlib.sha256(raw).hexdigest(),
        question=data["question"],
        written=None if written is None else str(written),
        config=config,
        grid=grid,
        primary=primary,
        secondary=secondary,
        seeds=seeds,
        exploratory=exploratory,
        **statistics,
    )
    return replace(plan, power=plan_power(plan, [(record["path"], got) for record, got in cited]))


def _design(path: Path, data: dict[str, Any], seeds: list[int]) -> tuple[Config, Grid, dict[str, Any], list[str]]:
    """What the plan trains and compares: the config (``preset`` and ``settings``, less what the grid sets), the
    grid of cells and arms (every arm's config checked), the primary comparison and the secondary ones."""
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
            define=data.get("define") or {},
        )
        for arm in arms:
            Config.load(
                preset,
                **{**settings, **grid.settings_of(arm)},
                random_mask_share=config.algorithm.random_mask_share or 0.0,
            )
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
        if str(key).startswith(INTERACTION) and len(grid.cells()) < 2:
            raise _fail(path, f"secondary {key} compares the primary cell with the others: the grid has one cell")
    compared = {"cell": name, "comparison": f"{after}_vs_{before}", "after": after, "before": before}
    return config, grid, {**compared, "expect": expect}, [str(k) for k in secondary]


def _statistics(path: Path, data: dict[str, Any], secondary: list[str]) -> dict[str, Any]:
    """How the plan judges its comparisons, as ``Plan``'s fields: the multiplicity correction and alpha, the decision
    rule, δ and the power's inputs, gatekeeping, the rank estimand and the collapse floor."""
    collapse_floor = data.get("collapse_floor")
    if collapse_floor is not None and (
        isinstance(collapse_floor, bool) or not isinstance(collapse_floor, (int, float)) or not 0 < collapse_floor <= 1
    ):
        raise _fail(path, f"collapse_floor must be a pass@1 in (0, 1], got {collapse_floor!r}")
    if collapse_floor is None and any(k.startswith(COLLAPSE) for k in secondary):
        raise _fail(path, "a collapse: comparison needs collapse_floor (the pass@1 below which a run collapsed)")
    decision_rule = data.get("decision_rule", OLD_RULE)
    if decision_rule not in DECISION_RULES:
        raise _fail(path, f"decision_rule must be one of {list(DECISION_RULES)}, got {decision_rule!r}")
    rank_estimand = data.get("rank_estimand", False)
    if not isinstance(rank_estimand, bool):
        raise _fail(path, f"rank_estimand must be true or false, got {rank_estimand!r}")
    power_model = _power_model(path, data.get("power_model"), collapse_floor)
    power_fit = data.get("power_fit")
    if power_fit is not None and (
        not isinstance(power_fit, dict)
        or set(power_fit) != {"cell", "comparison"}
        or not all(isinstance(v, str) for v in power_fit.values())
    ):
        raise _fail(path, f"power_fit must be {{cell: NAME, comparison: A_vs_B}} of a cited run, got {power_fit!r}")
    if power_fit is not None and power_model is None:
        raise _fail(path, "power_fit says what the power model is fitted to: it needs power_model")

    correction = data["correction"]
    if correction not in CORRECTIONS:
        raise _fail(path, f"correction must be one of {list(CORRECTIONS)}, got {correction!r}")
    alpha = data.get("alpha", 0.05)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise _fail(path, f"alpha must be a number in (0, 1), got {alpha!r}")
    smallest_effect, expected_sd, expected_effect = (
        _positive(path, data, key) for key in ("smallest_effect", "expected_sd", "expected_effect")
    )
    if decision_rule == "minimum-effect" and (
        smallest_effect is None or expected_effect is None or expected_effect <= smallest_effect
    ):
        raise _fail(
            path,
            "the minimum-effect rule needs smallest_effect (δ) and expected_effect, the true delta "
            "the plan expects, above δ: a true effect of δ itself is shown beyond δ at most alpha/2 "
            "of the time",
        )
    if power_model is not None and expected_sd is not None:
        raise _fail(path, "expected_sd and power_model both set the power's sd: give power_model.sd instead")
    gatekeeping = data.get("gatekeeping", smallest_effect is not None)
    if not isinstance(gatekeeping, bool):
        raise _fail(path, f"gatekeeping must be true or false, got {gatekeeping!r}")
    return {
        "correction": correction,
        "alpha": float(alpha),
        "smallest_effect": smallest_effect,
        "expected_sd": expected_sd,
        "gatekeeping": gatekeeping,
        "decision_rule": decision_rule,
        "expected_effect": expected_effect,
        "rank_estimand": rank_estimand,
        "collapse_floor": None if collapse_floor is None else float(collapse_floor),
        "power_model": power_model,
        "power_fit": power_fit,
    }


MODEL_KEYS = ("collapse", "sd", "healthy", "collapsed")


def _power_model(path: Path, spec: Any, floor: Any) -> dict[str, Any] | None:
    """The mixture's fields as the plan gives them (checked), or None for the normal model."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) - set(MODEL_KEYS):
        raise _fail(path, f"power_model must be a mapping with some of {list(MODEL_KEYS)}, got {spec!r}")
    if floor is None:
        raise _fail(path, "power_model needs collapse_floor: what counts as a collapsed run")
    out: dict[str, Any] = {}
    for key, value in spec.items():
        values = value if key == "collapse" and isinstance(value, list) and len(value) == 2 else [value]
        if not all(_finite(v) for v in values):
            raise _fail(
                path, f"power_model.{key} must be a number{' or [after, before]' * (key == 'collapse')}, got {value!r}"
            )
        out[key] = [float(v) for v in values] if len(values) == 2 else float(values[0])
    return out


def _positive(path: Path, data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise _fail(path, f"{key} must be a number > 0 (a delta of pass@1), got {value!r}")
    return float(value)


def _primary_pass(data: dict[str, Any], cell: str, after: str, before: str) -> tuple[list[float], list[float]] | None:
    """(after's, before's) per-seed pass@1 in ``cell`` of an exploratory results.json or sweep.json, seeds paired by
    index, or None when it does not hold both arms there with the same seeds (at least 2)."""
    for c in data.get("cells") or []:
        if not isinstance(c, dict) or c.get("name") != cell or not isinstance(c.get("arms"), dict):
            continue
        values = [(c["arms"].get(arm) or {}).get("pass_at_1") for arm in (after, before)]
        if all(isinstance(v, list) and all(map(_finite, v)) for v in values) and len(values[0]) == len(values[1]) >= 2:
            return [float(x) for x in values[0]], [float(x) for x in values[1]]
    return None


def _primary_deltas(data: dict[str, Any], cell: str, after: str, before: str) -> list[float] | None:
    """The per-seed pass@1 deltas after − before (seeds paired by index) in ``cell`` of an exploratory
    results.json or sweep.json, or None when it does not hold both arms there with the same seeds (at least 2)."""
    got = _primary_pass(data, cell, after, before)
    return None if got is None else [x - y for x, y in zip(*got, strict=True)]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mixture(plan: Plan, cited: list[tuple[str, dict[str, Any]]]) -> tuple[stats.Mixture, str]:
    """The plan's mixture: its ``power_model`` fields, the rest fitted to the primary cell of the cited run with the
    most seeds there; and where it came from, in words."""
    after, before, cell = plan.primary["after"], plan.primary["before"], plan.primary["cell"]
    if plan.power_fit is not None:  # another comparison of the cited runs stands in for the primary
        cell = plan.power_fit["cell"]
        after, before = _comparison(
            plan.path, plan.power_fit["comparison"], _arms_in(cited, cell), "power_fit.comparison"
        )
    given = plan.power_model or {}
    runs = [(where, got) for where, data in cited if (got := _primary_pass(data, cell, after, before))]
    where, got = max(runs, key=lambda r: len(r[1][0]), default=(None, None))
    fitted, fit_error = None, f"no exploratory run it cites holds both arms' per-seed pass@1 in {cell}"
    if got is not None and len(given) < len(MODEL_KEYS):
        try:
            fitted = stats.fit_mixture(got[1], got[0], plan.collapse_floor)
        except ConfigError as error:
            fit_error = f"{where}: {error}"
    q = given.get("collapse")
    q_after, q_before = q if isinstance(q, list) else (q, q)
    fields = {
        "collapse_after": q_after,
        "collapse_before": q_before,
        "sd": given.get("sd"),
        "healthy": given.get("healthy"),
        "collapsed": given.get("collapsed"),
    }
    missing = [k for k, v in fields.items() if v is None and k != "collapsed"]
    if missing and fitted is None:
        raise _fail(plan.path, f"power_model leaves {missing} to be fitted, but {fit_error}: state them")
    for key, value in list(fields.items()):
        if value is None:
            fields[key] = getattr(fitted, key) if fitted is not None else 0.0
    try:
        model = stats.Mixture(**fields)
    except ConfigError as error:
        raise _fail(plan.path, f"power_model: {error}") from None
    left = [k for k in MODEL_KEYS if k not in given]
    fit_to = f" ({after} − {before} in {cell})" if plan.power_fit is not None else ""
    source = (
        "the plan's power_model"
        if not left or fitted is None
        else f"{', '.join(left)} fitted to {len(got[0])} seeds of {where}{fit_to} (collapsed: pass@1 below "
        f"{plan.collapse_floor:g}){', the rest from the plan' if given else ''}"
    )
    return model, source


def _arms_in(cited: list[tuple[str, dict[str, Any]]], cell: str) -> tuple[str, ...]:
    """Every arm the cited runs trained in ``cell``."""
    arms: dict[str, None] = {}
    for _, data in cited:
        for c in data.get("cells") or []:
            if isinstance(c, dict) and c.get("name") == cell and isinstance(c.get("arms"), dict):
                arms.update(dict.fromkeys(c["arms"]))
    return tuple(arms)


MIXTURE_MOST_SEEDS = 1000  # the search for the seeds a mixture's power needs stops here (each step simulates)
SEARCH_DRAWS = 2000  # simulated experiments per step of that search (the power stated uses stats.MIXTURE_DRAWS)


def _fewest(enough: Any, most: int) -> int | None:
    """The fewest n >= 2 with ``enough(n)`` (doubling, then bisection; power grows with n), None past ``most``."""
    high = 2
    while not enough(high):
        if high >= most:
            return None
        high = min(2 * high, most)
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if mid >= 2 and enough(mid) else (mid, high)
    return max(high, 2)


def plan_power(plan: Plan, cited: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The plan's power for its δ before the run: the paired t over its seeds at the level its primary is tested
    at (alpha under gatekeeping; under Holm across m comparisons at least the power at alpha / m, at most at alpha),
    with its ``expected_sd`` or the sd of the per-seed primary deltas of the cited run with the most seeds, and δ
    its ``smallest_effect`` or that run's noise floor. A plan with no sd (or no δ) to use is refused. With a
    ``power_model`` the outcomes come from that mixture (simulated), under the minimum-effect rule the power is the
    chance of an interval beyond δ at ``expected_effect``, and with ``rank_estimand`` the rank interval's and the
    sign test's power are given beside it."""
    after, before, cell = plan.primary["after"], plan.primary["before"], plan.primary["cell"]
    found = [(where, d, data) for where, data in cited if (d := _primary_deltas(data, cell, after, before))]
    found = [(where, d, data) for where, d, data in found if statistics.stdev(d) > 0]
    best = max(found, key=lambda f: len(f[1]), default=None)  # the first cited among the largest
    model = model_source = None
    if plan.power_model is not None:
        model, model_source = _mixture(plan, cited)
        sd, sd_source = model.sd, "the mixture's sd of the rest"
    elif plan.expected_sd is not None:
        sd, sd_source = plan.expected_sd, "the plan's expected_sd"
    elif best is not None:
        sd = statistics.stdev(best[1])
        sd_source = f"the sd of the {len(best[1])} per-seed {after} − {before} deltas in {cell} of {best[0]}"
    else:
        raise _fail(
            plan.path,
            f"states no expected_sd, and no exploratory run it cites holds per-seed pass@1 of "
            f"{after} and {before} in {cell}: add expected_sd (the sd of the per-seed {after} − "
            f"{before} deltas expected) so that its power can be computed",
        )
    first = [(best[0], best[2])] if best else []  # the run the sd came from, then every run in the plan's order
    floors = [
        (where, f)
        for where, data in first + cited
        if _finite(f := (data.get("base") or {}).get("noise_floor")) and f > 0
    ]
    if plan.smallest_effect is not None:
        delta, delta_source = plan.smallest_effect, "the plan's smallest_effect"
    elif floors:
        delta, delta_source = floors[0][1], f"no smallest_effect: the noise floor of {floors[0][0]}"
    else:
        raise _fail(
            plan.path,
            "states no smallest_effect, and no exploratory run it cites records a noise floor: "
            "add smallest_effect (the smallest delta of pass@1 that would matter)",
        )
    n, m = len(plan.seeds), len(plan.family)
    level = plan.alpha if plan.gatekeeping or m == 1 else plan.alpha / m
    least = stats.least_exact_p(n)
    if model is not None or plan.decision_rule != OLD_RULE or plan.rank_estimand:
        return _power(plan, delta, delta_source, sd, sd_source, model, model_source, level)

    def at(alpha: float) -> float:
        return 0.0 if n < 2 or least >= alpha else stats.power(delta, sd, n, alpha)

    out = {
        "smallest_effect": delta,
        "smallest_effect_source": delta_source,
        "sd": sd,
        "sd_source": sd_source,
        "seeds": n,
        "alpha": plan.alpha,
        "alpha_primary": level,
        "test": "paired t over seeds, two-sided",
        "power": at(level),
        "power_at_alpha": at(plan.alpha),
        "least_exact_p": least,
        "target": POWER_TARGET,
        "seeds_for_power": stats.seeds_for_power(delta, sd, level, POWER_TARGET),
    }
    how = (
        f"the primary alone at alpha {plan.alpha:g} (gatekeeping)"
        if level == plan.alpha
        else f"alpha {plan.alpha:g} / {m} = {level:.3g}, the primary's level when its p is the family's smallest "
        f"under Holm (at full alpha it would be {out['power_at_alpha']:.2f})"
    )
    out["summary"] = (
        f"power {out['power']:.2f} to detect δ {delta:.3g} ({delta_source}) with sd {sd:.3g} "
        f"({sd_source}) over {n} paired seeds at {how}; {out['seeds_for_power']} seeds would give "
        f"{POWER_TARGET:g}. It is the chance of p < alpha when the true delta is δ: improved also "
        "needs the observed |delta| above δ, which a true effect of exactly δ shows about half the "
        "time"
    )
    out["warning"] = None
    if out["power"] < POWER_TARGET:
        missed = f"a true effect of δ would be missed {1 - out['power']:.0%} of the time"
        why = f"with {n} seeds the exact sign-flip p cannot go below {least:.3g}" if least >= level else missed
        out["warning"] = (
            f"the plan's power is {out['power']:.2f}, below {POWER_TARGET:g}: {why}; "
            f"{out['seeds_for_power']} seeds would give {POWER_TARGET:g}"
        )
    return out


def _power(
    plan: Plan,
    delta: float,
    delta_source: str,
    sd: float,
    sd_source: str,
    model: stats.Mixture | None,
    model_source: str | None,
    level: float,
) -> dict[str, Any]:
    """``plan_power`` for a plan that states a decision rule, a rank estimand or a power model."""
    after, before = plan.primary["after"], plan.primary["before"]
    n, m = len(plan.seeds), len(plan.family)
    least = stats.least_exact_p(n)
    beyond = plan.decision_rule == "minimum-effect"
    effect = plan.expected_effect if beyond else delta  # the true delta the power is for

    def at(k: int, alpha: float, draws: int = stats.MIXTURE_DRAWS) -> float:
        if k < 2 or stats.least_exact_p(k) >= alpha:
            return 0.0
        if model is None:
            return stats.power_beyond(effect, delta, sd, k, alpha) if beyond else stats.power(delta, sd, k, alpha)
        got = stats.mixture_power(
            model, effect, k, alpha, smallest_effect=delta if beyond else None, ranks=False, draws=draws
        )
        return got["beyond" if beyond else "t"]

    most = MIXTURE_MOST_SEEDS if model is not None else 100_000
    out: dict[str, Any] = {
        "smallest_effect": delta,
        "smallest_effect_source": delta_source,
        "sd": sd,
        "sd_source": sd_source,
        "seeds": n,
        "alpha": plan.alpha,
        "alpha_primary": level,
        "decision_rule": plan.decision_rule,
        "effect": effect,
        "model": "normal" if model is None else "mixture",
        "mixture": None if model is None else model.to_dict(),
        "mixture_source": model_source,
        "test": "the interval beyond δ (minimum-effect test), paired t over seeds"
        if beyond
        else "paired t over seeds, two-sided",
        "power": at(n, level),
        "power_at_alpha": at(n, plan.alpha),
        "least_exact_p": least,
        "target": POWER_TARGET,
        "seeds_for_power": _fewest(lambda k: at(k, level, SEARCH_DRAWS) >= POWER_TARGET, most),
    }
    how = (
        f"the primary alone at alpha {plan.alpha:g} (gatekeeping)"
        if level == plan.alpha
        else f"alpha {plan.alpha:g} / {m} = {level:.3g}, the primary's level when its p is the family's smallest "
        f"under Holm (at full alpha it would be {out['power_at_alpha']:.2f})"
    )
    if model is None:
        outcomes = f"sd {sd:.3g} ({sd_source})"
    else:
        outcomes = (
            f"a mixture of collapsed and healthy runs ({after} collapses with probability "
            f"{model.collapse_after:.2f}, {before} with {model.collapse_before:.2f}; the rest differ with sd "
            f"{model.sd:.3g} around a healthy pass@1 of {model.healthy:.3f}; {model_source}; "
            f"{stats.MIXTURE_DRAWS} simulated experiments)"
        )
    goal = (
        f"show the interval beyond δ {delta:.3g} ({delta_source}) when the true delta is {effect:.3g}"
        if beyond
        else f"detect δ {delta:.3g} ({delta_source})"
    )
    needed = (
        f"{out['seeds_for_power']} seeds would give {POWER_TARGET:g}"
        if out["seeds_for_power"]
        else f"more than {most} seeds would be needed for {POWER_TARGET:g}"
    )
    meaning = (
        "It is the chance that the whole interval clears δ"
        if beyond
        else "It is the chance that the interval excludes 0 when the true delta is δ: the verdict's direction "
        "(its size against δ is reported apart)"
        if plan.decision_rule == "direction"
        else "It is the chance of p < alpha when the true delta is δ: improved also needs the observed |delta| "
        "above δ, which a true effect of exactly δ shows about half the time"
    )
    out["summary"] = f"power {out['power']:.2f} to {goal} with {outcomes} over {n} paired seeds at {how}; {needed}. "
    out["summary"] += meaning
    if plan.rank_estimand:
        ranks = model or stats.Mixture(collapse_after=0.0, collapse_before=0.0, sd=sd, healthy=0.5)
        got = stats.mixture_power(ranks, delta, n, level) if n >= 2 else {"rank": 0.0, "sign": 0.0}
        out["power_rank"], out["power_sign"] = got["rank"], got["sign"]
        out["summary"] += (
            f". Beside it, at a true δ on the healthy runs, the Hodges–Lehmann interval excludes 0 with "
            f"power {got['rank']:.2f} and the sign test rejects with {got['sign']:.2f}"
        )
    out["warning"] = None
    if out["power"] < POWER_TARGET:
        missed = (
            f"a true effect of {effect:.3g} would not be shown beyond δ {1 - out['power']:.0%} of the time"
            if beyond
            else f"a true effect of δ would be missed {1 - out['power']:.0%} of the time"
        )
        why = f"with {n} seeds the exact sign-flip p cannot go below {least:.3g}" if least >= level else missed
        out["warning"] = f"the plan's power is {out['power']:.2f}, below {POWER_TARGET:g}: {why}; {needed}"
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
        raise _fail(
            plan,
            f"exploratory {item}: no such file, or a folder without results.json, sweep.json, "
            "experiment.json or config.json, so its seeds cannot be checked",
        )
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
    """The planned family, compared and adjusted, from an experiment's results.json content, with the power the
    runs realised beside the planned one."""
    block = decide(family_rows(summary, plan), plan)
    block["realised_power"] = report.realised_power(plan.to_dict(), summary["cells"])
    return block


ROW_KEYS = (
    "after",
    "before",
    "delta",
    "ci_low",
    "ci_high",
    "p_value",
    "p_t",
    "p_exact",
    "p_rule",
    "unit",
    "n",
    "noise_floor",
    "smallest_effect",
    "smallest_effect_source",
    "equivalence_low",
    "equivalence_high",
    "p_equivalence",
    "sd_floored",
    "alpha",
)
MAGNITUDE_KEYS = ("verdict_rule", "p_beyond")  # a row's fields under a plan that states its decision rule


def family_rows(summary: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    """One row per comparison of the family, primary first: ``results.compare_arms`` in its cell under the plan's
    smallest effect, alpha and verdict rule, written back into the cell's ``compare`` so that every table shows the
    same; beside it the rank estimand and the collapse rates where the plan asks for them. A ``collapse:`` row is
    McNemar's test of the two arms' collapse rates (``stats.collapse_compare``)."""
    cells = {c["name"]: c for c in summary["cells"]}
    rows = []
    for cell_name_, key in plan.family:
        cell = cells[cell_name_]
        if key.startswith(INTERACTION):
            rows.append(_interaction_row(cells[plan.primary["cell"]], cell, key, plan))
            continue
        after, before = key.removeprefix(COLLAPSE).split("_vs_")
        passes = [[float(x) for x in cell["arms"][arm]["pass_at_1"]] for arm in (after, before)]
        collapse = None
        if plan.collapse_floor is not None:
            collapse = stats.collapse_compare(passes[1], passes[0], plan.collapse_floor, plan.alpha, (after, before))
        if key.startswith(COLLAPSE):
            rows.append(
                {
                    "cell": cell_name_,
                    "comparison": key,
                    "kind": "collapse",
                    "after": after,
                    "before": before,
                    "delta": collapse.delta,
                    "ci_low": None,
                    "ci_high": None,
                    "p_value": collapse.p_value,
                    "p_rule": "exact McNemar",
                    "unit": "seed",
                    "n": collapse.n,
                    "smallest_effect": None,
                    "alpha": plan.alpha,
                    "collapse": collapse.to_dict(),
                    "magnitude_unadjusted": None,
                    "verdict_unadjusted": collapse.verdict,
                    "reason_unadjusted": collapse.reason,
                }
            )
            continue
        c = results.compare_arms(
            cell["arms"],
            after,
            before,
            summary["base"],
            smallest_effect=plan.smallest_effect,
            alpha=plan.alpha,
            verdict_rule=plan.verdict_rule,
        )
        cell["compare"][key] = c
        row = {
            "cell": cell_name_,
            "comparison": key,
            **{k: c.get(k) for k in ROW_KEYS},
            "verdict_unadjusted": c["verdict"],
            "reason_unadjusted": c["reason"],
        }
        if plan.verdict_rule != OLD_RULE:
            row.update({k: c.get(k) for k in MAGNITUDE_KEYS}, magnitude_unadjusted=c.get("magnitude"))
        if plan.rank_estimand:
            deltas = [x - y for x, y in zip(*passes, strict=True)]
            row["rank"] = stats.rank_estimate(deltas, plan.alpha).to_dict() if len(deltas) >= 2 else None
        if collapse is not None:
            row["collapse"] = collapse.to_dict()
        rows.append(row)
    return rows


def _interaction_row(home: dict[str, Any], cell: dict[str, Any], key: str, plan: Plan) -> dict[str, Any]:
    """``interaction:A_vs_B`` in ``cell``: the per-seed delta A − B in the primary cell (``home``) against the same in
    ``cell``, seeds paired by index (every cell trains the same seeds), as ``stats.compare`` over seeds under the
    plan's δ, alpha and verdict rule. Positive: A gains more over B in the primary cell than in this one."""
    after, before = key.removeprefix(INTERACTION).split("_vs_")

    def deltas(c: dict[str, Any]) -> list[list[float]]:
        a, b = (c["arms"][arm]["pass_at_1"] for arm in (after, before))
        return [[float(x) - float(y)] for x, y in zip(a, b, strict=True)]

    c = stats.compare(
        deltas(cell),
        deltas(home),
        smallest_effect=plan.smallest_effect,
        alpha=plan.alpha,
        verdict_rule=plan.verdict_rule,
    ).to_dict()
    row = {
        "cell": cell["name"],
        "comparison": key,
        "kind": "interaction",
        **{k: c.get(k) for k in ROW_KEYS},
        "after": f"{after} − {before} in {home['name']}",
        "before": f"{after} − {before} in {cell['name']}",
        "verdict_unadjusted": c["verdict"],
        "reason_unadjusted": c["reason"],
    }
    if plan.verdict_rule != OLD_RULE:
        row.update({k: c.get(k) for k in MAGNITUDE_KEYS}, magnitude_unadjusted=c.get("magnitude"))
    if plan.rank_estimand:
        d = [x[0] - y[0] for x, y in zip(deltas(home), deltas(cell), strict=True)]
        row["rank"] = stats.rank_estimate(d, plan.alpha).to_dict() if len(d) >= 2 else None
    return row


def _success(row: dict[str, Any], plan: Plan) -> bool:
    """Did the primary come out as the plan expected, under its decision rule?"""
    expected = row["verdict"] == plan.primary["expect"]
    return expected and (plan.decision_rule != "minimum-effect" or row.get("magnitude") == "beyond δ")


def decide(rows: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """The family's verdicts after the plan's correction. Holm across every row; or, under gatekeeping, the primary
    (row 0) alone at alpha, then Holm across the rest only if the primary came out as expected (under the plan's
    decision rule), and otherwise the rest reported but not claimed. Only the claims are corrected (improved,
    regressed, fewer or more collapses, and a magnitude beyond δ): a flat verdict, or a size within δ, is each
    comparison's own equivalence test."""
    m = len(rows)
    if plan.gatekeeping:
        first, rest = rows[0], rows[1:]
        first.update(p_holm=first["p_value"], stage="primary", claimed=True)
        _adjust([first], [first["p_value"]], plan.alpha, "alone at the full alpha (gatekeeping)")
        gate = "open" if _success(first, plan) else "closed"
        for row, p in zip(rest, stats.holm([r["p_value"] for r in rest]), strict=True):
            row.update(p_holm=p, stage="secondary", claimed=gate == "open")
        if gate == "open":
            _adjust(rest, [r["p_holm"] for r in rest], plan.alpha, f"across the {len(rest)} secondary comparisons")
        else:
            said = first.get("finding") or first["verdict"]
            for row in rest:
                alone = row["verdict_unadjusted"]
                row["verdict"] = "unresolved"
                row["reason"] = (
                    f"not claimed: under gatekeeping the secondary comparisons are tested only once the "
                    f"primary is {plan.primary['expect']}, and it is {said}; alone this "
                    f"would be {alone} (p = {row['p_value']:.3g}; Holm across the {len(rest)} secondary "
                    f"comparisons {row['p_holm']:.3g})."
                )
                if "magnitude_unadjusted" in row:
                    row.update(magnitude=None, finding="unresolved")
    else:
        gate = None
        for row, p in zip(rows, stats.holm([r["p_value"] for r in rows]), strict=True):
            row.update(p_holm=p, stage="family", claimed=True)
        _adjust(rows, [r["p_holm"] for r in rows], plan.alpha, f"across the {m} planned comparisons")
    first = rows[0]
    outcome = (
        "confirmed"
        if _success(first, plan)
        else "contradicted"
        if first["verdict"] in EXPECT and first["verdict"] != plan.primary["expect"]
        else "not confirmed"
    )
    block = {
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
    if plan.decision_rule != OLD_RULE:
        block["decision_rule"] = plan.decision_rule
    return block


def _adjust(rows: list[dict[str, Any]], adjusted: list[float], alpha: float, where: str) -> None:
    """Each row's verdict after its adjusted p: a claim (improved, regressed, fewer or more collapses) stands only
    when it is below alpha; without it a comparison shown within δ is flat. Where rows carry a magnitude, beyond δ
    stands only when its own p (the minimum-effect test), adjusted the same way among those rows, is below alpha."""
    name = "p" if where.startswith("alone") else "Holm-adjusted p"
    sized = [row for row in rows if row.get("magnitude_unadjusted") is not None]
    beyond = [row.get("p_beyond") if row.get("p_beyond") is not None else 1.0 for row in sized]
    for row, p in zip(sized, beyond if name == "p" else stats.holm(beyond), strict=True):
        row["p_beyond_holm"] = p
    for row, p in zip(rows, adjusted, strict=True):
        verdict, magnitude = row["verdict_unadjusted"], row.get("magnitude_unadjusted")
        if verdict in CLAIMS and p >= alpha:
            row["verdict"] = "flat" if magnitude == "within δ" else "unresolved"
            row["reason"] = (
                f"{row['verdict']} after Holm's correction: alone it would be {verdict} "
                f"(p = {row['p_value']:.3g}), but {where} the adjusted p = {p:.3g} is not below alpha "
                f"{alpha:g}."
            )
            if magnitude == "beyond δ":
                magnitude = "undetermined"
        else:
            row["verdict"] = verdict
            row["reason"] = row["reason_unadjusted"] + (f" {name} = {p:.3g}, {where}." if verdict in CLAIMS else "")
        if magnitude == "beyond δ" and row["p_beyond_holm"] >= alpha:
            magnitude = "undetermined"
            row["reason"] += (
                f" Beyond δ alone, but {where} the minimum-effect test's adjusted p = "
                f"{row['p_beyond_holm']:.3g} is not below alpha {alpha:g}: its size is "
                "undetermined."
            )
        if "magnitude_unadjusted" in row:
            row["magnitude"] = magnitude
            row["finding"] = stats.finding(row["verdict"], magnitude)


def _exploratory_warnings(plan: Plan, weights: str | None) -> list[str]:
    out = []
    for e in plan.exploratory:
        if e["weights_sha256"] is None:
            out.append(
                f"the exploratory run {e['path']} records no model hash, so whether it ran on the model "
                "confirmed here cannot be checked"
            )
        elif weights is not None and e["weights_sha256"] != weights:
            out.append(
                f"the exploratory run {e['path']} ran on other model weights "
                f"({e['weights_sha256'][:12]}) than this confirmation ({weights[:12]}): it is not a repeat of "
                "that experiment"
            )
    return out


def check_power(plan: Plan, accept_low_power: bool = False) -> None:
    """A plan whose power for its δ is below ``POWER_TARGET`` is refused before anything trains (a ConfigError
    saying how many seeds would reach it), unless ``accept_low_power``: spending a confirmation's compute on a test
    that cannot, or will most likely not, give a verdict is a choice to make knowingly."""
    warning = (plan.power or {}).get("warning")
    if warning and not accept_low_power:
        raise ConfigError(
            f"{plan.path.name}: {warning}: add fresh seeds to the plan, or pass --accept-low-power to run it as planned"
        )


def run(
    plan_path: str | Path,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
    accept_low_power: bool = False,
) -> dict[str, Any]:
    """Run the plan in ``plan_path`` into ``out_dir``; write and return results.json's content. A plan below its
    power target is refused (``check_power``) unless ``accept_low_power`` (or ``resume``: it was started)."""
    plan = read_plan(plan_path)
    check_power(plan, accept_low_power or resume)
    out = Path(out_dir)
    copy = out / f"plan{plan.path.suffix.lower()}"
    if resume and copy.is_file() and hashlib.sha256(copy.read_bytes()).hexdigest() != plan.sha256:
        raise ConfigError(f"--resume: {plan.path} differs from the plan this confirmation started with ({copy})")
    experiment = Experiment(
        plan.config,
        plan.grid,
        out,
        resume=resume,
        progress=progress,
        command=command,
        seeds=plan.seeds,
        record={"plan_sha256": plan.sha256},
    )
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


__all__ = ["Plan", "check_power", "confirmation", "decide", "family_rows", "plan_power", "read_plan", "run", "seeds_of"]
