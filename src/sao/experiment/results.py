"""results.json: the logs and evals of an experiment folded into numbers, and the comparisons over them.

Curves (every numeric series folded per run, and averaged per arm), the page's checks computed, divergence per run,
the comparisons per cell (every rule against ``none`` and every arm against the base model, ``sao.core.stats.compare``
under the base evals' noise floor) and the eval curve over the ``--eval-every`` checkpoints. Everything is computed
from the files a run wrote, so a resumed experiment summarises the whole of it.

Deliberately left out: statistics beyond ``compare`` and any presentation (``sao.experiment.report``).
Design notes: docs/design/results.md.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from sao.core import stats
from sao.core.names import BASELINE, POLICY
from sao.experiment import provenance
from sao.experiment.evaluate import EvalResult

FOLDED_SKIP = {"seed", "step", "policy_step", "policy_version"}


def fold(series: list[Any]) -> dict[str, float | None]:
    """first / last / mean / max / min of a series, ignoring missing (None/NaN) entries."""
    values = [float(v) for v in series if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    if not values:
        return {"first": None, "last": None, "mean": None, "max": None, "min": None, "n": 0}
    return {
        "first": values[0],
        "last": values[-1],
        "mean": statistics.fmean(values),
        "max": max(values),
        "min": min(values),
        "n": len(values),
    }


def numeric_keys(records: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for r in records:
        for k, v in r.items():
            if k in FOLDED_SKIP or k in keys:
                continue
            if (isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None:
                keys.append(k)
    return [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records)]


def curves(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Every numeric series of the policy steps, folded. (Warmup steps take no policy step.)"""
    policy = [r for r in records if r["phase"] == POLICY]
    return {k: fold([r.get(k) for r in policy]) for k in numeric_keys(policy)}


def mean_over_seeds(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Step-wise mean of several seeds' policy records (one seed: the records themselves)."""
    if len(runs) == 1:
        return [r for r in runs[0] if r["phase"] == POLICY]
    policy = [[r for r in run if r["phase"] == POLICY] for run in runs]
    out = []
    for rows in zip(*policy, strict=False):
        merged: dict[str, Any] = {"phase": POLICY}
        for k in numeric_keys(list(rows)):
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            merged[k] = statistics.fmean(vals) if vals else None
        out.append(merged)
    return out


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return statistics.fmean(vals) if vals else None


OUTSIDE_TOKENS = 10  # the token strings a run's checks keep outside the band: its most frequent ones


def outside_band(policy: list[dict[str, Any]]) -> dict[str, Any]:
    """Which tokens fell outside the band over a run's policy steps (from records that logged them; empty when none
    did): the ``OUTSIDE_TOKENS`` most frequent as [text, below, above, seen], summed over the steps' lists (each
    step keeps its own most frequent, so a token rare in every step can be missed), and the counts per tenth of the
    reply, outside and in all."""
    logged = [r for r in policy if isinstance(r.get("outside_band_tokens"), list)]
    if not logged:
        return {}
    totals: dict[str, list[int]] = {}
    for r in logged:
        for text, below, above, seen in r["outside_band_tokens"]:
            got = totals.setdefault(str(text), [0, 0, 0])
            got[0], got[1], got[2] = got[0] + below, got[1] + above, got[2] + seen
    top = sorted(totals.items(), key=lambda kv: (-(kv[1][0] + kv[1][1]), kv[0]))[:OUTSIDE_TOKENS]

    def summed(key: str) -> list[int]:
        rows = [r[key] for r in logged if isinstance(r.get(key), list)]
        return [sum(col) for col in zip(*rows, strict=True)] if rows else []

    return {
        "outside_band_tokens": [[text, *counts] for text, counts in top],
        "outside_band_by_position": summed("outside_band_by_position"),
        "tokens_by_position": summed("tokens_by_position"),
    }


def checks(records: list[dict[str, Any]], grad_clip: float) -> dict[str, Any]:
    """The page's checks, computed: critic, gradient, non-finite, the mask by staleness, lag-0 numerics, and (from
    logs that hold them) the tokens outside the band."""
    warm = [r for r in records if r["phase"] != POLICY]
    policy = [r for r in records if r["phase"] == POLICY]
    last10 = policy[-10:]
    grad = [r["grad_norm"] for r in policy if r["grad_norm"] is not None and math.isfinite(r["grad_norm"])]
    by_staleness: dict[str, dict[str, float]] = {}
    for s in sorted({r["staleness"] for r in policy}):
        rows = [r for r in policy if r["staleness"] == s]
        by_staleness[str(s)] = {
            "steps": len(rows),
            "masked_share": statistics.fmean(r["masked_share"] for r in rows),
            "would_be_masked_share": statistics.fmean(r["would_be_masked_share"] for r in rows),
            "ratio_max_median": statistics.median(r["ratio_max"] for r in rows),
        }
    fresh = [r for r in records if r["staleness"] == 0]
    # the critic's own EV: beside a fixed baseline (--baseline batch-mean) the update's EV is the baseline's
    ev = "critic_explained_variance" if any("critic_explained_variance" in r for r in records) else "explained_variance"
    return {
        "critic_ev_warmup_end": warm[-1][ev] if warm else None,
        "critic_ev_last10": _mean(last10, ev),
        "critic_loss_warmup_end": warm[-1]["critic_loss"] if warm else None,
        "critic_loss_last10": _mean(last10, "critic_loss"),
        "grad_norm_mean": statistics.fmean(grad) if grad else None,
        "grad_norm_max": max(grad) if grad else None,
        "clip_bound_steps": sum(g > grad_clip for g in grad),
        "clip_ever_bound": any(g > grad_clip for g in grad),
        "nonfinite_tokens": sum(r["nonfinite"] for r in records),
        "skipped_steps": sum(bool(r["skipped"]) for r in records),
        "masked_share_by_staleness": by_staleness,
        "masked_share_max": max((r["masked_share"] for r in policy), default=None),
        "lag0_abs_log_ratio_mean": _mean(fresh, "abs_log_ratio_mean"),
        "lag0_abs_log_ratio_max": max((r["abs_log_ratio_max"] for r in fresh), default=None),
        "reward_first10": _mean(policy[:10], "reward_mean"),
        "reward_last10": _mean(last10, "reward_mean"),
        "response_length_last10": _mean(last10, "response_length"),
        "truncation_share_last10": _mean(last10, "truncation_share"),
        **outside_band(policy),
        **oracle_checks(records, policy),
    }


CEILING_KEYS = (
    "prompt_level",
    "token_level",
    "in_sample",
    "mean",
    "var_prompt",
    "critic_ev",
    "critic_share",
    "prompts",
    "samples",
    "seconds",
)


def oracle_checks(records: list[dict[str, Any]], policy: list[dict[str, Any]]) -> dict[str, Any]:
    """From logs that hold them: the oracle ceiling's snapshots (``--ceiling-every``), each with its step, and the
    oracle baseline's per-step draws (its shrinkage, its rates' mean, the ceiling of each batch's prompts, and the
    explained variance it reached over the last ten policy steps). Nothing for a log without either."""
    out: dict[str, Any] = {}
    snapshots = [r for r in records if "ceiling_snapshot" in r]
    if snapshots:
        out["ceiling"] = [
            {"snapshot": r["ceiling_snapshot"], "step": r["step"], **{k: r.get(f"ceiling_{k}") for k in CEILING_KEYS}}
            for r in snapshots
        ]
    drawn = [r for r in policy if "oracle_shrinkage" in r]
    if drawn:
        out["oracle_baseline"] = {
            "samples": drawn[-1]["oracle_samples"],
            "shrinkage_mean": _mean(drawn, "oracle_shrinkage"),
            "batch_ceiling_mean": _mean(drawn, "oracle_batch_ceiling"),
            "rate_mean": _mean(drawn, "oracle_rate_mean"),
            "ev_last10": _mean(drawn[-10:], "explained_variance"),
        }
    return out


def divergence(records: list[dict[str, Any]]) -> list[str]:
    """Why a run counts as diverged (empty: it did not). The rule: docs/design/results.md."""
    policy = [r for r in records if r["phase"] == POLICY]
    reasons = []
    skipped = sum(bool(r["skipped"]) for r in policy)
    if skipped:
        reasons.append(f"{skipped} step(s) skipped for a non-finite loss or gradient")
    nonfinite = sum(r["nonfinite"] or 0 for r in records)
    if nonfinite:
        reasons.append(f"{int(nonfinite)} non-finite token(s)")
    if len(policy) >= 20:
        first = statistics.fmean(r["reward_mean"] for r in policy[:10])
        last = statistics.fmean(r["reward_mean"] for r in policy[-10:])
        if last < 0.5 * first:
            reasons.append(f"training reward collapsed {first:.3f} -> {last:.3f}")
    return reasons


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% t interval of a mean (a single value has a zero-width interval)."""
    from scipy import stats as sps

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = sps.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def versions() -> dict[str, str]:
    return provenance.library_versions()


def summarize_arm(
    runs: list[tuple[int, EvalResult, list[dict[str, Any]]]],
    arm: str,
    grad_clip: float,
    eval_curve: dict[int, dict[int, float]] | None = None,
) -> dict:
    """One arm of one cell over its seeds: pass@1 with its interval, the evals, the curves, each run's checks,
    and (with ``eval_curve``: seed → policy step → pass@1) pass@1 over the policy steps."""
    passes = [result.pass_at_1 for _, result, _ in runs]
    mean, lo, hi = interval(passes)
    out = {
        "pass_at_1": passes,
        "pass_at_1_mean": mean,
        "pass_at_1_ci": [lo, hi],
        "evals": [result.to_dict() for _, result, _ in runs],
        "curves": curves(mean_over_seeds([log for _, _, log in runs])),
        "runs": {f"{arm}-s{seed}": run_summary(seed, log, grad_clip) for seed, _, log in runs},
    }
    if eval_curve:
        out["eval_curve"] = fold_eval_curve(eval_curve)
    return out


def fold_eval_curve(points: dict[int, dict[int, float]]) -> dict[str, Any]:
    """seed → {policy step: pass@1} as ``{"policy_steps": [...], "per_seed": {seed: [...]}, "mean": [...]}``;
    a step some seed lacks is None in its list and left out of that step's mean."""
    steps = sorted({k for by_step in points.values() for k in by_step})
    per_seed = {str(seed): [by_step.get(k) for k in steps] for seed, by_step in points.items()}
    means = [_mean_present([values[i] for values in per_seed.values()]) for i in range(len(steps))]
    return {"policy_steps": steps, "per_seed": per_seed, "mean": means}


def _mean_present(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def run_summary(seed: int, log: list[dict[str, Any]], grad_clip: float) -> dict[str, Any]:
    return {"seed": seed, "checks": checks(log, grad_clip), "curves": curves(log), "diverged": divergence(log)}


def compare_cell(arms: dict[str, dict[str, Any]], base_per_task: list[float] | None, floor: dict) -> tuple[dict, dict]:
    """(every rule against ``none``, every arm against the base model) for one cell."""
    run_std, runs = floor["run_std"], floor["runs"]

    def scores(arm: str) -> list[list[float]]:
        return [e["per_task"] for e in arms[arm]["evals"]]

    def reward_last10(arm: str) -> list[float]:
        return [run["checks"]["reward_last10"] for run in arms[arm]["runs"].values()]

    comparisons = {}
    for arm in arms:
        if arm == BASELINE:
            continue
        c = stats.compare(
            scores(BASELINE),
            scores(arm),
            run_std=run_std,
            run_std_runs=runs,
            proxy=(reward_last10(BASELINE), reward_last10(arm)),
        )
        comparisons[f"{arm}_vs_{BASELINE}"] = {"before": BASELINE, "after": arm, **c.to_dict()}
    vs_base = {}
    if base_per_task is not None:
        for arm in arms:
            c = stats.compare(base_per_task, scores(arm), run_std=run_std, run_std_runs=runs, before_fixed=True)
            vs_base[arm] = {"before": "base", "after": arm, **c.to_dict()}
    return comparisons, vs_base


def compare_arms(
    arms: dict[str, dict[str, Any]],
    after: str,
    before: str,
    floor: dict,
    *,
    smallest_effect: float | None = None,
    alpha: float = stats.ALPHA,
    verdict_rule: str = "direction",
) -> dict[str, Any]:
    """``after`` against ``before`` in one cell (seeds paired by index), as ``compare_cell`` writes each entry:
    for comparisons other than rule-vs-none, such as a planned ``dis_vs_random``, and for a plan's family (its
    smallest effect of interest, alpha and verdict rule; without them the noise floor stands in for δ, at alpha 0.05,
    under the direction rule)."""
    for arm in (after, before):
        if arm not in arms:
            raise KeyError(f"the cell has no arm {arm!r} (it has {sorted(arms)})")
    scores, last10 = (
        [[e["per_task"] for e in arms[arm]["evals"]] for arm in (before, after)],
        [[run["checks"]["reward_last10"] for run in arms[arm]["runs"].values()] for arm in (before, after)],
    )
    c = stats.compare(
        scores[0],
        scores[1],
        run_std=floor.get("run_std"),
        run_std_runs=floor.get("runs"),
        proxy=(last10[0], last10[1]),
        smallest_effect=smallest_effect,
        alpha=alpha,
        verdict_rule=verdict_rule,
    )
    return {"before": before, "after": after, **c.to_dict()}


def base_block(base: list[EvalResult]) -> dict[str, Any]:
    """The base evals and the noise floor they give (none with fewer than two evals)."""
    return {"evals": [e.to_dict() for e in base], **noise_block([e.pass_at_1 for e in base])}


def noise_block(passes: list[float]) -> dict[str, Any]:
    """Repeated evals of one model (their pass@1) and the noise floor they give (none with fewer than two)."""
    run_std = runs = floor = None
    if len(passes) >= 2:
        run_std, runs = stats.run_std_of(passes)
        floor = stats.noise_floor(run_std, runs)
    return {"pass_at_1": list(passes), "run_std": run_std, "runs": runs, "noise_floor": floor}


def base_per_task(base: list[EvalResult]) -> list[float] | None:
    if not base:
        return None
    return [statistics.fmean(col) for col in zip(*(e.per_task for e in base), strict=True)]


def primary(cells: list[dict[str, Any]]) -> tuple[str, str]:
    """The comparison the experiment is about: the first cell's first rule against ``none``."""
    cell = cells[0]
    return cell["name"], next(iter(cell["compare"]))


def question(arms: list[str], cells: int) -> str:
    rules = ", ".join(a for a in arms if a != BASELINE)
    if cells == 1 and arms == ["dis", BASELINE]:
        return "Does masking tokens outside the IS band (dis) beat the plain ratio (none) on held-out pass@1?"
    where = f"over {cells} cells of lag x lr x band" if cells > 1 else "in this cell"
    return f"Does each correction rule ({rules}) beat the plain ratio (none) on held-out pass@1, {where}?"
