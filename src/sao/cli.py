"""The `sao` command line: one subcommand per job, each a thin layer over ``sao.api`` and the experiment.

    sao selftest                        the two arms differ only in the mask (no model, a second)
    sao train  --preset tiny --out DIR  one arm, one seed: critic warmup, policy steps, train_log.jsonl
    sao eval   --preset tiny [--adapter DIR] [--out FILE]    pass@1 on the held-out tasks
    sao recipe --preset tiny --out DIR  the whole experiment: both arms, base evals, verdict, report
    sao sweep  --preset tiny --lags 1 4 8 16 --lrs 1e-3 3e-3 --train-runs 6 --out DIR   where the ratio breaks
    sao confirm PLAN --out DIR          a confirmation planned in a file before it runs: fresh seeds, Holm
    sao report DIR                      rebuild report.md (or sweep.md) and the plots from the JSON
    sao probe RUN                       does the trunk's hidden state carry the difficulty? (--ceiling-every)
    sao compare BEFORE AFTER --out DIR  sao's verdict on anyone's per-task scores (lm-eval samples, a CSV)
    sao export RUN --merge OUT          fold a run's adapter into its base: a plain HF model folder to serve
    sao serve  --preset tiny --traces LOG [--watch RUN | --adapter DIR]  OpenAI-style chat endpoint, every trace logged

Every setting of ``sao.core.config`` a command reads is a flag (``--batch-size`` sets ``training.batch_size``),
documented where it is defined; preset < ``--config FILE`` < flags. Every user mistake is one line on stderr and
exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from sao.core.errors import ConfigError, SaoError

# The settings each command reads, by section (a dotted name: one field of a section).
COMMAND_SETTINGS: dict[str, tuple[str, ...]] = {
    "train": ("model", "data", "algorithm", "rollout", "training", "eval"),
    "eval": (
        "model",
        "data",
        "eval",
        "rollout.decoder",
        "rollout.max_turns",
        "rollout.max_total_tokens",
        "rollout.env_concurrency",
        "rollout.env_rejoin",
        "training.seed",
    ),
    "recipe": ("model", "data", "algorithm", "rollout", "training", "eval"),
    "sweep": ("model", "data", "algorithm", "rollout", "training", "eval"),
    "serve": (
        "model.name",
        "model.lora_rank",
        "model.lora_alpha",
        "model.device",
        "model.threads",
        "data.dataset",
        "data.reward",
        "data.reward_timeout",
        "data.truncated_reward",
        "rollout.temperature",
        "rollout.max_new_tokens",
        "rollout.traces",
        "training.seed",
        "serve",
    ),
}


# Switches that read as plain flags (``--follow``) and still take a value (``--follow false``).
def _fields_for(command: str, skip: tuple[str, ...] = ()) -> list[tuple[str, dataclasses.Field, type]]:
    """(section, field, section class) of every setting ``command`` reads, in section order."""
    from sao.core.config import SECTIONS
    from sao.core.settings import flag_of

    wanted = COMMAND_SETTINGS[command]
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if (section in wanted or f"{section}.{f.name}" in wanted) and flag_of(f) not in skip:
                out.append((section, f, cls))
    return out


def _add_config_flags(parser: argparse.ArgumentParser, command: str, skip: tuple[str, ...] = ()) -> None:
    from sao.core.registry import PRESETS
    from sao.core.settings import field_type, flag_of, help_of

    parser.add_argument("--preset", default=None, choices=PRESETS.names(), help="defaults to start from (protocol)")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="settings from a YAML or JSON file: a mapping of the settings below (flat or in sections, a 'preset' "
        "allowed), or a run's config.json (or experiment.json) as it is, to replay it; the file overrides the "
        "preset, flags override the file",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, f, cls in _fields_for(command, skip):
        group = groups.get(section) or parser.add_argument_group(f"{section} settings (default: the preset's)")
        groups[section] = group
        name = flag_of(f)
        flags = ["--" + name.replace("_", "-")] + ["--" + a.replace("_", "-") for a in f.metadata.get("aliases", ())]
        kwargs: dict[str, Any] = {"default": None, "help": help_of(f).replace("%", "%%"), "dest": name}
        hint = field_type(cls, f.name)
        if name == "ratio":
            kwargs.update(nargs=2, type=float, metavar=("LO", "HI"))
        elif hint in (bool, "bool"):  # a switch: --follow alone is true, --follow false says so
            kwargs.update(nargs="?", const=True, type=_bool)
        elif hint in (int, int | None):
            kwargs["type"] = int
        elif hint == int | str:  # a count or a word (--critic-warmup 10 / auto)
            kwargs["type"] = _count_or_word
        elif hint in (float, float | None):
            kwargs["type"] = float
        elif hint == float | tuple[float, ...] | None:  # one number, or one per level: --random-mask-share 0 .1 .2
            kwargs.update(nargs="+", type=float, metavar="SHARE")
        group.add_argument(*flags, **kwargs)
    if "rollout" in COMMAND_SETTINGS[command]:  # each source's own settings, once per name
        _add_source_flags(parser.add_argument_group("each source's own settings (--rollout NAME)"), skip)


def _add_source_flags(group: argparse._ArgumentGroup, skip: tuple[str, ...] = ()) -> None:
    from sao.core.config import source_fields, sources
    from sao.core.settings import field_type, help_of

    taken: dict[str, list[str]] = {}
    first: dict[str, tuple[dataclasses.Field, type]] = {}
    for kind in sources():
        section = sources().get(kind)
        for name, f in source_fields(section).items():
            taken.setdefault(name, []).append(kind)
            first.setdefault(name, (f, section))
    for name, (f, section) in first.items():
        if name in skip:
            continue
        hint = field_type(section, f.name)
        kwargs: dict[str, Any] = {"default": None, "dest": name}
        kwargs["help"] = f"--rollout {', '.join(taken[name])}: {help_of(f)}".replace("%", "%%")
        if hint in (bool, "bool"):
            kwargs.update(nargs="?", const=True, type=_bool)
        elif hint in (int, int | None):
            kwargs["type"] = int
        elif hint in (float, float | None):
            kwargs["type"] = float
        group.add_argument("--" + name.replace("_", "-"), **kwargs)


def _count_or_word(text: str) -> int | str:
    return int(text) if text.strip().lstrip("+-").isdigit() else text


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def config_from_args(args: argparse.Namespace):
    """The run's Config: the preset's defaults, then --config FILE's settings, then the flags (``Config.load``)."""
    from sao.core.config import Config, setting_names
    from sao.core.machine import apply_threads

    names = set(setting_names())
    given = {name: value for name, value in vars(args).items() if name in names and value is not None}
    given = {name: value[0] if isinstance(value, list) and len(value) == 1 else value for name, value in given.items()}
    for alias in ("engine", "band", "arm"):  # an old spelling: argparse stores it under today's name
        if any(a == f"--{alias}" or a.startswith(f"--{alias}=") for a in getattr(args, "argv", ())):
            from sao.core.config import NOTICES

            print(f"notice: {NOTICES[alias]}", file=sys.stderr)
    config = Config.load(args.preset, getattr(args, "config", None), **given)
    apply_threads(config)
    return config


def settings_reference() -> str:
    """Every setting, section by section, each source's own after the rollout section, as a Markdown page
    (docs/settings.md is this, written by ``make docs``)."""
    from sao.core.config import SECTIONS, sources
    from sao.core.settings import flag_of, help_of

    lines = [
        "# Every setting",
        "",
        "Generated from the settings sections (`sao/core/config.py`, each source's in",
        "`sao/rollout/registry.py`) by `make docs`; `sao COMMAND --help` shows the settings that command reads.",
        "Flat name = the command-line flag (`--batch-size`) and the key in a flat settings file; a settings file",
        "may also give them in sections (`training: {lr: 1e-3}`, a source's inside `rollout: {ray: {...}}`).",
        "",
    ]
    tables = [(name, cls, "") for name, cls in SECTIONS.items()]
    at = [name for name, _, _ in tables].index("rollout") + 1
    own = [kind for kind in sources() if sources().get(kind).__module__.startswith("sao.")]  # not a plug-in's
    tables[at:at] = [(f"rollout.{kind}", sources().get(kind), sources().get(kind).__doc__) for kind in own]
    for name, cls, doc in tables:
        lines += [f"## {name}", ""] + ([" ".join(doc.replace("``", "`").split()), ""] if doc else [])
        lines += ["| flag | default | what it is |", "| --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            names = ", ".join(f"`--{n.replace('_', '-')}`" for n in (flag_of(f), *f.metadata.get("aliases", ())))
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            lines.append(f"| {names} | `{default!r}` | {help_of(f).replace('|', chr(92) + '|')} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Commands.


def _selftest(args: argparse.Namespace) -> int:
    from sao.algorithm import selftest

    return 0 if selftest.run() else 1


def _train(args: argparse.Namespace) -> int:
    from sao import api

    config = config_from_args(args)
    trainer = api.trainer(config, args.out, resume=args.resume, progress=not args.quiet)
    print_start(trainer, config)
    records = trainer.run()
    print_summary(trainer, config, Path(args.out), records)
    trainer.world.leave()  # under torchrun: the group it joined ends, as torch asks of a finished process
    return 0


def print_start(trainer: Any, config: Any) -> None:
    """What ``sao train`` is about to run, on rank 0 only (under torchrun every rank runs this command)."""
    if not trainer.world.is_main:
        return
    c = config
    print(
        f"sao train: {c.algorithm.correction} arm, seed {c.training.seed}, model {c.model.name}: {trainer.describe()}"
    )
    record = trainer.run_dir.record
    counts = record.get("data") or {}
    print(f"  data {record.get('source')}" + (f": {_counts(counts)}" if counts else ""))


def print_summary(trainer: Any, config: Any, out: Path, records: list[dict[str, Any]]) -> None:
    """What ``sao train`` did, on rank 0 only: the step summary, traces, an early stop, the files, warnings."""
    if not trainer.world.is_main:
        return
    print(summarize_training(records, trainer.source.max_staleness))
    if config.source.needs().get("summary"):  # a source that keeps totals (a trace log's: used, dropped, why)
        print(summarize_traces(trainer.source.summary()))
    if trainer.ended_early:
        print(f"  stopped after {len(records)} of {trainer.total_steps} steps: {trainer.ended_early}")
    from sao.training.trainer import CRITIC_DIR

    folder, what = ("model", "the model") if config.model.finetune == "full" else ("adapter", "the adapter")
    critic = f", the value model in {out / CRITIC_DIR}" if config.model.critic == "model" else ""
    print(f"  wrote {out / 'train_log.jsonl'}, {what} in {out / folder}{critic}")
    for message in trainer.warnings:
        print("  warning: " + message)


def summarize_traces(summary: dict[str, Any]) -> str:
    """One line on a trace log: used, dropped by reason, the staleness of what was used."""
    if not summary:
        return "  traces: none read"
    dropped = ", ".join(
        f"{k.removeprefix('traces_dropped_')} {v}" for k, v in summary.items() if k.startswith("traces_dropped_") and v
    )
    hist = " ".join(f"{s}:{n}" for s, n in summary["traces_staleness_hist"].items())
    unmatched = summary.get("traces_feedback_unmatched")
    foreign = ", ".join(f"{name} {n}" for name, n in (summary.get("traces_read_as") or {}).items())
    return (
        f"  traces: used {summary['traces_used']}, dropped {summary['traces_dropped']}"
        f"{f' ({dropped})' if dropped else ''}, waiting for feedback {summary['traces_waiting_for_feedback']}"
        f"{f', feedback for unknown ids {unmatched}' if unmatched else ''}; "
        f"staleness of those used {hist or '-'}"
        f"{f'; lines in other formats: {foreign}' if foreign else ''}"
    )


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def summarize_training(records: list[dict[str, Any]], lag: int) -> str:
    """A few lines on what happened: reward first vs last ten policy steps, the mask, lag-0 numerics."""
    import statistics

    policy = [r for r in records if r["phase"] == "policy"]
    if not policy:
        return "  no policy steps were run"
    head, tail = policy[: min(10, len(policy))], policy[-min(10, len(policy)) :]

    def mean(rows, key):
        values = [r[key] for r in rows if r[key] is not None and r[key] == r[key]]
        return statistics.fmean(values) if values else float("nan")

    fresh = [r for r in records if r["staleness"] == 0]
    stale = [r for r in policy if r["staleness"] > 0]
    lines = [
        f"  reward: first {len(head)} policy steps {mean(head, 'reward_mean'):.3f} -> "
        f"last {len(tail)} {mean(tail, 'reward_mean'):.3f}",
        f"  masked share {mean(policy, 'masked_share'):.4f} (would-be {mean(policy, 'would_be_masked_share'):.4f}), "
        f"max ratio {max(r['ratio_max'] for r in policy):.2f}, skipped steps {sum(r['skipped'] for r in policy)}",
        f"  lag-0 batches: |log ratio| mean {mean(fresh, 'abs_log_ratio_mean'):.2e}, "
        f"max {max((r['abs_log_ratio_max'] for r in fresh), default=float('nan')):.2e} over {len(fresh)} steps",
    ]
    if stale:
        lines.append(
            f"  stale batches (staleness up to {lag}): |log ratio| mean {mean(stale, 'abs_log_ratio_mean'):.2e}, "
            f"explained variance last 10 {mean(tail, 'explained_variance'):.3f}"
        )
    return "\n".join(lines)


def _eval(args: argparse.Namespace) -> int:
    from sao import api
    from sao.core.io import check_output_path, write_json

    if args.old_samples is not None:
        if args.eval_samples is not None:
            raise ConfigError("--samples and --eval-samples set the same setting; give one (--eval-samples)")
        print("notice: --samples is now --eval-samples (same values); --samples still works", file=sys.stderr)
        args.eval_samples = args.old_samples
    config = config_from_args(args)
    if args.out:
        check_output_path(args.out, folder=False)  # a folder or a device as --out fails now, not after the eval
    result = api.evaluate(config, adapter=args.adapter, seed=args.eval_seed, progress=not args.quiet)
    print(
        f"sao eval: pass@1 {result.pass_at_1:.4f} over {len(result.per_task)} tasks x {result.samples} samples "
        f"at temperature {result.temperature} ({result.seconds:.1f}s, mean reply {result.mean_reply_tokens:.1f} tokens)"
    )
    if args.out:
        write_json(args.out, result.to_dict())
        print(f"  wrote {args.out}")
    return 0


def _recipe(args: argparse.Namespace) -> int:
    """The one-cell experiment: the config's lag, lr and ratio band; the recipe arm dis against the baseline none."""
    from sao.experiment.runner import Grid

    config = config_from_args(args)
    return _experiment(args, config, Grid.recipe(config))


def _sweep(args: argparse.Namespace) -> int:
    """The grid from --lags/--lrs/--bands/--arms, else from a --config file's grid, else the defaults."""
    from sao.core.config import read_config_file
    from sao.experiment.runner import Grid

    config = config_from_args(args)
    saved = (read_config_file(args.config)[1] if args.config else None) or {}
    defaults = Grid()
    grid = Grid(
        lags=tuple(args.lags or saved.get("lags") or defaults.lags),
        lrs=tuple(args.lrs or saved.get("lrs") or defaults.lrs),
        bands=tuple(_band(t) for t in args.bands) if args.bands else tuple(saved.get("bands") or defaults.bands),
        arms=tuple(args.arms or saved.get("arms") or defaults.arms),
        define=saved.get("define") or {},
    )
    return _experiment(args, config, grid)


def _experiment(args: argparse.Namespace, config, grid) -> int:
    import shlex

    from sao.experiment.runner import Experiment

    started = time.perf_counter()
    command = "sao " + shlex.join(a for a in args.argv if a != "--resume")  # what regenerates it from scratch
    experiment = Experiment(config, grid, args.out, resume=args.resume, progress=not args.quiet, command=command)
    cells, counts, e = grid.cells(), experiment.split.counts, config.eval
    print(
        f"sao {args.command}: {len(cells)} cell(s) x arms {' '.join(grid.arms)} x {e.train_runs} seed(s) "
        f"= {len(cells) * len(grid.arms) * e.train_runs} runs, {e.base_evals} base evals; model {config.model.name}, "
        f"data {experiment.split.source} ({counts['train']} train prompts, {counts['test']} held out, "
        f"{counts['train_contaminated']} dropped as contaminated)"
    )
    results = experiment.run()
    out = Path(args.out)
    print(f"  base pass@1 {_fmt_list(results['base']['pass_at_1'])}")
    for cell in results["cells"]:
        where = f"{cell['name']}: " if len(cells) > 1 else ""
        passes = "; ".join(f"{arm} {_fmt_list(a['pass_at_1'])}" for arm, a in cell["arms"].items())
        print(f"  {where}pass@1 {passes}")
        for name, c in cell["compare"].items():
            print(f"  {where}{name} verdict: {c['reason']}")
    if results["base"]["noise_floor"] is not None:
        print(f"  noise floor {results['base']['noise_floor']:.4f} from {results['base']['runs']} base evals")
    for message in results["warnings"]:
        print("  warning: " + message)
    print(f"  {time.perf_counter() - started:.0f}s; report: {out / 'report.md'} (plots in {out / 'plots'})")
    return 0


def _band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--bands takes LO,HI pairs like 0.7,6.0; got {text!r}") from None
    return lo, hi


def _fmt_list(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values) if values else "—"


def _confirm(args: argparse.Namespace) -> int:
    """A planned confirmation: the plan file fixes the grid, arms, seeds, settings, primary endpoint and family."""
    import shlex

    from sao.core.machine import apply_threads
    from sao.experiment import confirm

    plan = confirm.read_plan(args.plan)
    confirm.check_power(plan, args.accept_low_power or args.resume)  # before a line is printed or a file written
    apply_threads(plan.config)
    print(
        f"sao confirm: {plan.path.name} (sha256 {plan.sha256[:12]}): primary {plan.primary['comparison']} at "
        f"{plan.primary['cell']} (expect {plan.primary['expect']}); {len(plan.family)} comparisons, "
        + ("the primary alone, then " if plan.gatekeeping else "")
        + f"{plan.correction} at alpha {plan.alpha:g}; {len(plan.grid.cells())} cell(s) x arms "
        f"{' '.join(plan.grid.arms)} x {len(plan.seeds)} fresh seeds ({plan.seeds[0]}..{plan.seeds[-1]})"
    )
    print(f"  {plan.power['summary']}")
    if plan.power["warning"]:
        print(f"warning: {plan.power['warning']}", file=sys.stderr, flush=True)
    command = "sao " + shlex.join(a for a in args.argv if a != "--resume")
    results = confirm.run(
        args.plan,
        args.out,
        resume=args.resume,
        progress=not args.quiet,
        command=command,
        accept_low_power=args.accept_low_power,
    )
    block = results["confirmation"]
    for row in block["family"]:
        interval = f" [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]" if row["ci_low"] is not None else ""
        print(
            f"  {row['cell']} {row['comparison']}: delta {row['delta']:+.4f}{interval}, p {row['p_value']:.3g} "
            f"({row['p_rule']}), adjusted {row['p_holm']:.3g}: {row.get('finding') or row['verdict']}"
        )
    print(f"  primary: {block['outcome']} ({results['reason']})")
    for message in [*results["warnings"], *results["provenance"]["warnings"]]:
        print("  warning: " + message)
    print(f"  report: {Path(args.out) / 'report.md'}")
    return 0


def _probe(args: argparse.Namespace) -> int:
    """A ridge probe from the snapshots' hidden states to the prompts' oracle rates (``sao.experiment.probe``)."""
    from sao.experiment import probe

    print(probe.probe(args.run)[1])
    return 0


def _report(args: argparse.Namespace) -> int:
    from sao.experiment import report

    path = report.write(args.dir)
    print(f"sao report: wrote {path} and plots in {Path(args.dir) / 'plots'}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    """sao's verdict on two arms' per-task scores that another tool wrote (``sao.experiment.compare``)."""
    import shlex

    from sao.experiment import compare

    found = compare.run(
        args.before,
        args.after,
        args.out,
        noise=args.noise,
        metric=args.metric,
        filter=args.filter,
        before_run=args.before_run,
        after_run=args.after_run,
        noise_run=args.noise_run,
        smallest_effect=args.smallest_effect,
        alpha=args.alpha,
        before_fixed=args.before_fixed,
        command="sao " + shlex.join(args.argv),
    )
    before, after = found["sides"]["before"], found["sides"]["after"]
    print(
        f"sao compare: {after['name']} ({len(after['runs'])} run(s)) against {before['name']} "
        f"({len(before['runs'])}) on {found['tasks']} tasks, {found['pairing']}"
    )
    print(f"  mean score: before {_fmt_list(before['means'])}; after {_fmt_list(after['means'])}")
    for name, c in found["compare"].items():
        print(f"  {name} verdict: {c['reason']}")
    if found["noise"]["noise_floor"] is not None:
        print(f"  noise floor {found['noise']['noise_floor']:.4f} from {found['noise']['runs']} repeated evals")
    print(f"  wrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'report.md'}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from sao.core.io import read_json
    from sao.model.artifacts import EXPORT_INFO, export_model, find_adapter_dir, find_model_dir, merge

    model_dir = find_model_dir(args.run)
    if model_dir is not None:  # --finetune full: every weight trained, nothing to merge
        if args.base_model:
            raise ConfigError(f"--base-model: {model_dir} holds every weight of a full fine-tuning run; leave it out")
        out = export_model(model_dir, args.merge)
        info = read_json(out / EXPORT_INFO)
        print(
            f"sao export: wrote the model ({info['dtype']}, {info['parameters'] / 1e6:.2f}M parameters, every weight "
            f"trained) and tokenizer to {out} from {model_dir}"
        )
        return 0
    adapter_dir = find_adapter_dir(args.run)
    out = merge(adapter_dir, args.merge, base_model_path=args.base_model)
    info = read_json(out / EXPORT_INFO)
    print(
        f"sao export: wrote the merged model ({info['dtype']}, {info['parameters'] / 1e6:.2f}M parameters) and "
        f"tokenizer to {out} from {adapter_dir} on {info['base_model']} "
        f"(merge relative error {info['merge_relative_error']:.1e}, see {EXPORT_INFO})"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from sao.serve.server import ensure_serve_extra, serve

    ensure_serve_extra()  # before loading anything: one line naming the extra to install
    _silence_library_progress_bars()  # the first line printed says where it serves
    config = config_from_args(args)  # --threads: torch's CPU threads (1 on the tiny model by default)
    if config.rollout.traces is None:
        raise ConfigError("sao serve needs --traces LOG: the JSONL trace log every completion is appended to")
    s = config.serve
    return serve(
        config,
        config.rollout.traces,
        host=s.host,
        host_given=args.host is not None,
        port=s.port,
        watch=s.watch,
        adapter=args.adapter,
        max_prompt_tokens=s.max_prompt_tokens,
    )


# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sao", description=(__doc__ or "sao").splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--version",
        action=_Version,
        nargs=0,
        help="sao's version and commit, torch's and transformers', and the device it would run on",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="how much sao's own log says on stderr (default warning; info adds the masking lines "
        "and notes that a progress bar would show)",
    )
    # allow_abbrev off: a flag's prefix (--lr) is never taken for another flag (--lrs, --lr-schedule)
    no_prefixes = functools.partial(argparse.ArgumentParser, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=no_prefixes)

    p = sub.add_parser("selftest", help="check that the two arms differ only in the mask")
    p.set_defaults(func=_selftest)

    p = sub.add_parser("train", help="train one arm with one seed")
    p.add_argument("--out", required=True, help="output folder (train_log.jsonl, checkpoints, adapter)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_flags(p, "train")
    p.set_defaults(func=_train)

    p = sub.add_parser("eval", help="pass@1 of the base model, or of a trained adapter, on the held-out tasks")
    p.add_argument("--adapter", help="a run's adapter/ folder (from sao train); default: the untrained base")
    p.add_argument("--out", help="write the result (pass@1, per-task scores, examples) to this JSON file")
    p.add_argument("--eval-seed", type=int, default=0, help="which sampling seed (repeat with 0, 1, 2 for a floor)")
    # --samples: the spelling before eval took --eval-samples as train, recipe and the settings page do
    p.add_argument("--samples", dest="old_samples", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--temperature", dest="eval_temperature", type=float, default=None, help="sampling temperature (default 0.7)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_flags(p, "eval", skip=("eval_temperature",))
    p.set_defaults(func=_eval)

    p = sub.add_parser("recipe", help="the experiment (a one-cell sweep): both arms, base evals, compare, report")
    p.add_argument("--out", required=True, help="output folder (results.json, train_log.json, report.md, plots/)")
    p.add_argument("--resume", action="store_true", help="continue the experiment in --out where it stopped")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_config_flags(p, "recipe", skip=("correction",))
    p.set_defaults(func=_recipe)

    p = sub.add_parser("sweep", help="a grid over lag x lr x band x arm, seeds per cell, shared base evals")
    p.add_argument("--out", required=True, help="output folder (results.json, report.md, plots/, cells/)")
    p.add_argument("--lags", type=int, nargs="+", help="sampler lags (default 1 4 8 16)")
    p.add_argument("--lrs", type=float, nargs="+", help="policy learning rates (default 1e-3 3e-3)")
    p.add_argument("--bands", nargs="+", help="ratio bands as LO,HI (default 0.7,6.0)")
    p.add_argument(
        "--arms",
        nargs="+",
        help="correction rules, or RULE+BASELINE (dis+batch-mean: that rule with "
        "that --baseline); 'none' is the arm every other is compared with (default dis none)",
    )
    p.add_argument("--resume", action="store_true", help="continue the sweep in --out where it stopped")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_config_flags(p, "sweep", skip=("correction", "lag", "lr", "ratio"))
    p.set_defaults(func=_sweep)

    p = sub.add_parser("confirm", help="run a confirmation planned in a YAML/JSON file (fresh seeds, Holm)")
    p.add_argument("plan", help="the plan: primary endpoint, family, arms, fresh seeds, exploratory runs cited")
    p.add_argument("--out", required=True, help="output folder (results.json with the plan, report.md, plots/)")
    p.add_argument("--resume", action="store_true", help="continue the confirmation in --out where it stopped")
    p.add_argument(
        "--accept-low-power",
        action="store_true",
        help="run a plan whose power for its δ is below 0.8 "
        "(refused otherwise, before anything trains: it would likely end without a verdict)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_confirm)

    p = sub.add_parser("probe", help="does the trunk's hidden state carry the difficulty? (runs with --ceiling-every)")
    p.add_argument("run", help="a run's folder (with oracle/ snapshots), or an experiment's: every run in it")
    p.set_defaults(func=_probe)

    p = sub.add_parser("report", help="rebuild report.md and plots/ from an experiment folder's JSON files")
    p.add_argument("dir", help="the experiment folder (holds results.json and train_log.json)")
    p.set_defaults(func=_report)

    p = sub.add_parser("compare", help="sao's verdict on two arms' per-task scores from any tool (lm-eval, a CSV)")
    p.add_argument(
        "before",
        help="the baseline's scores: an lm-eval samples_*.jsonl file, a folder of them (one run "
        "per seed), or a CSV/JSONL table of run, seed, task, score rows",
    )
    p.add_argument("after", help="the arm's scores, in the same form")
    p.add_argument("--out", required=True, help="output folder (results.json, report.md)")
    p.add_argument(
        "--noise",
        metavar="PATH",
        help="repeated evals of one model (2 or more runs, same form and tasks): "
        "the noise floor, as the recipe's base evals give it",
    )
    p.add_argument("--metric", help="the lm-eval metric to compare (e.g. exact_match); needed when a file has several")
    p.add_argument("--filter", help="the lm-eval filter (e.g. strict-match); needed when a file has several")
    p.add_argument("--before-run", metavar="RUN", help="a table's run on the BEFORE side, when it holds several")
    p.add_argument("--after-run", metavar="RUN", help="a table's run on the AFTER side, when it holds several")
    p.add_argument("--noise-run", metavar="RUN", help="a table's run in --noise, when it holds several")
    p.add_argument(
        "--smallest-effect",
        type=float,
        metavar="DELTA",
        help="δ > 0, the smallest delta that matters, "
        "fixed before looking (default: the noise floor; without either nothing is flat)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=0.05,
        help="level of the test (default 0.05: a 95%% interval, and the 90%% interval of the equivalence test)",
    )
    p.add_argument(
        "--before-fixed",
        action="store_true",
        help="BEFORE is one fixed model (a base checkpoint), not a training procedure: only AFTER needs seeds",
    )
    p.set_defaults(func=_compare)

    p = sub.add_parser("export", help="merge a trained adapter into its base model: a plain HF model folder")
    p.add_argument(
        "run",
        help="a sao train output folder (holding adapter/, or model/ after --finetune full), or an "
        "adapter folder itself",
    )
    p.add_argument("--merge", required=True, metavar="OUT", help="new or empty folder for the merged model")
    p.add_argument(
        "--base-model", metavar="PATH", help="the base model's hub id or folder (default: the one the adapter names)"
    )
    p.set_defaults(func=_export)

    p = sub.add_parser("serve", help="an OpenAI-compatible chat endpoint on the current adapter, logging traces")
    p.add_argument(
        "--adapter",
        metavar="DIR",
        help="serve this trained adapter: a sao train folder (its adapter/) or "
        "an adapter folder; default: the base model, or what --watch RUN publishes",
    )
    _add_config_flags(p, "serve")
    p.set_defaults(func=_serve)
    return parser


def _silence_library_progress_bars() -> None:
    """--quiet: no weight-loading or download bars from the Hugging Face libraries either."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class _Version(argparse.Action):
    """``sao --version``: what a bug report needs, read only when asked (torch loads here, not on every start)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def version_line() -> str:
    """``sao 0.2.0 (commit 1a2b3c4d5e6f, modified), torch 2.13.0, transformers 4.57.0, device cpu (x86_64)``."""
    import sao
    from sao.experiment.provenance import library_versions, sao_commit

    code, versions = sao_commit(), library_versions()
    commit = (
        "commit unknown (not a git checkout of sao)"
        if code["commit"] == "unknown"
        else (f"commit {code['commit'][:12]}" + (", modified" if code["dirty"] else ""))
    )
    return (
        f"sao {sao.__version__} ({commit}), torch {versions['torch']}, transformers {versions['transformers']}, "
        f"device {versions['device']}"
    )


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """Arguments the command does not take: its own usage and error (exit code 2), with the nearest flag it does
    take for a misspelled one, as argparse does for any other mistake in a command's arguments."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = [flag for action in sub._actions for flag in action.option_strings]
    hints = []
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
            hints += [f"{arg.split('=', 1)[0]}: did you mean {close[0]}?"] if close else []
    hint = f" ({'; '.join(hints)})" if hints else f"; sao {command} --help lists its flags"
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _not_shown_already(record: logging.LogRecord) -> bool:
    """Whether the root handler should show ``record``: not when a logger on its way up has a handler of its own
    (the hub client's), which has shown it already: a line is printed once."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger is not logging.getLogger():
        if any(not isinstance(handler, logging.NullHandler) for handler in logger.handlers):
            return False
        if not logger.propagate:
            break
        logger = logger.parent
    return True


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(format="sao: %(message)s", level=getattr(logging, args.log_level.upper()), force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_not_shown_already)
    if getattr(args, "quiet", False):
        _silence_library_progress_bars()
    try:
        return int(args.func(args))
    except SaoError as error:
        # A write that failed for lack of space says to rerun with --resume only where the command has one.
        message = error.message(resumable=hasattr(args, "resume")) if hasattr(error, "message") else str(error)
        print(f"sao {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sao {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["ConfigError", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
