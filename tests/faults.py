"""The fault table (docs/faults.md), generated from the test suite: each fault test records its case once its
assertions have passed. When every kind below was exercised, ``make docs`` (``SAO_WRITE_DOCS=1``) rebuilds
the table between the markers in docs/faults.md, and any other full run fails if its table is not the
one the tests just proved. The test suite itself never writes a tracked file.

A kind's row says what every recorded case proved; the count is the number of cases that passed. Its text
is deterministic (no timings).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TABLE_FILE = Path(__file__).resolve().parents[1] / "docs" / "faults.md"
START, END = "<!-- fault-table:start -->", "<!-- fault-table:end -->"

# kind → (what was thrown at it, what happened in every passing case)
KINDS: dict[str, tuple[str, str]] = {
    "hostile replies": (
        "megabyte replies, power towers, huge exponents, deep or unclosed braces, unicode digits and look-alikes, "
        "NUL bytes, thousands of numbers, code in the reply",
        "no exception, every call under the grader's 50 ms bound, nothing evaluated",
    ),
    "bad data": (
        "missing, empty, truncated or malformed JSONL, a record with no gold answer, fewer prompts than asked",
        "one-line error naming the file and line, exit code 2, no traceback, output folder left empty",
    ),
    "bad configuration": (
        "unknown --arm, a band that does not bracket 1, lag below 0, a model path that does not exist, "
        "a tokenizer without a chat template, an output folder holding another run or other files",
        "one-line error saying what to change, exit code 2, no traceback, nothing written or overwritten",
    ),
    "non-finite values": (
        "NaN log-probabilities injected into a step; NaN/inf ratios, values and advantages in SAO.update",
        "the step is skipped and counted (skipped, nonfinite in the log); tokens get coefficient 0; the run goes on",
    ),
    "killed process": (
        "SIGKILL mid-training, between a step's log line and its checkpoint, inside a trained arm's eval, inside a "
        "base eval, "
        "in a multi-turn agent run",
        "--resume finishes with results.json and train_log.json identical to an uninterrupted run",
    ),
    "out of memory": (
        "an allocator failure in the training pass",
        "micro-batch halved and the step retried, logged (micro_batch, oom_retries); same update as without it",
    ),
    "full disk / unwritable output": (
        "ENOSPC during a JSON write and a binary write, an output path blocked by a file",
        "one-line error that says to rerun with --resume; the previous complete file is intact, no temp file left",
    ),
    "determinism": (
        "the same seed trained twice on the CPU",
        "identical train_log.jsonl (timings aside); another seed differs",
    ),
    "damaged run folders": (
        "--resume over a truncated, missing or foreign checkpoint or config.json, a truncated, missing or stale "
        "train_log.jsonl, truncated or foreign evals and a truncated experiment.json in a recipe folder; --resume of a "
        "missing or empty folder",
        "one-line error naming the file and what to do, exit code 2, nothing written or overwritten; a damaged "
        "train_log.jsonl is instead rebuilt exactly from the checkpoint's copy of the same records",
    ),
    "odd flags": (
        "--device cuda, cuda:N or tpu where there is none, a 20-digit or negative --seed or --data-seed, "
        "--lora-alpha 0 or -32, --lora-rank 1e20, --dead-band-share nan or -1, --lr 1e308, --critic-lr 5, --threads -1",
        "one-line error giving the allowed range, exit code 2, no traceback, nothing written",
    ),
    "malformed results.json": (
        "curves entries of the wrong shape (a list, a string, a number) for an arm or a run, then sao report",
        "one-line error naming results.json and the entry, exit code 2, report.md and plots/ untouched",
    ),
    "wrong output paths": (
        "--out that is a file, under a file, /dev/null or under /proc; sao eval --out on a folder, a pipe or a full "
        "disk",
        "one-line error naming the path and the fix that applies (another path, or free space and rerun; --resume "
        "only where the command has it), exit code 2, nothing written or replaced",
    ),
    "shared machines": (
        "a tiny-preset command on a busy 2-core machine with and without OMP_NUM_THREADS and --threads; starting "
        "the CLI",
        "one torch thread for the tiny model unless OMP_NUM_THREADS or --threads says otherwise; sao.cli starts "
        "without importing torch or scipy",
    ),
    "sampler servers": (
        "a vLLM server that never receives the adapter the trainer published, a full-weight version the server "
        "refuses or never receives, a full-weight folder it could not use (none, empty, a tied model without its "
        "output layer, torn shards), an unreachable vLLM address, a Python without vLLM, vLLM replies with "
        "missing, short, mismatched or impossible token ids and log-probs",
        "the run stops at its next fresh batch, or the call within its deadline, with a one-line error naming the "
        "server, the folder or the reply's field; a launched server is stopped with its run",
    ),
    "big inputs": (
        "a 50 MB single-line train.jsonl; 20,000 short records",
        "the long line refused in one line after reading 1 MiB; memory the tasks drawn plus 16 bytes a row, never "
        "a copy of the file",
    ),
    "failing early": (
        "a --reward that fails in the first step (--out absent or empty), --track wandb without the extra, the "
        "corrected command after either, a recipe whose first run fails; sao serve start-up errors: a port in "
        "use, a missing model, a bad --reward, a bad --host or --port",
        "one-line error, exit code 2, no traceback; --out left as it was found (absent or empty) so the corrected "
        "command runs, and no trace log or lock created",
    ),
    "trace log integrity": (
        "a second server on the log by a symlink, a hard link or its name; a short write on a full disk and a "
        "torn tail before the next append; sao train --traces on an empty log, /dev/null or a FIFO; sao serve "
        "--traces on /dev/null, a FIFO or a folder; --follow on a log replaced by a shorter or longer file; "
        "feedback for ids never logged",
        "the second server refused in one line (the lock is the file's, by device and inode); every line whole, "
        "the torn bytes cut, no record glued or lost; odd or empty logs one line, exit code 2, nothing written; "
        "a replaced log read from its start (said once), none skipped; unmatched feedback counted in traces.json",
    ),
    "server edges": (
        "more concurrent requests than the queue bound; the trace log failing while serving; clients hanging up "
        "mid-body; --watch on a half-written adapter",
        "a 503 (code overloaded) or a 500 in OpenAI's error shape with one line, one line on stderr (a hang-up "
        "too), no traceback; every answered reply logged and the server still up; the adapter waited for, served "
        "once whole, a broken one said once",
    ),
    "hostile documents": (
        "nesting 100,000 deep, 5,000-digit integers, NaN and 1e400, YAML alias bombs, in --config, --data, a trace "
        "line, a run's config.json, results.json under sao report, a plan's cited run and a request body",
        "one-line error naming the file, line and field (a 400 for a request), exit code 2, no traceback, nothing "
        "written; a damaged trace line is skipped and counted under --skip-bad-traces, on --resume too",
    ),
    "numbers from outside": (
        'rewards of "1", None, NaN, inf, 1e300 and 10**400 from a --reward function and an environment alike, '
        "trace and feedback rewards past 1e6, temperature 1e-300, a plan asking for 10**12 seeds",
        "refused by the one reward rule (a finite number, |r| <= 1e6) in one line naming the source and the row, a "
        "400 from the server, exit code 2 from a plan; nothing logged",
    ),
    "context limit": (
        "a request whose prompt and max_tokens pass the model's positions, a trace longer than them, an episode "
        "whose prompt leaves less room than max_total_tokens",
        "a 400 naming the context (context_length_exceeded), a counted drop (dropped_too_long), the episode cut at "
        "the context and counted (context_cuts)",
    ),
    "plug-ins": (
        "a reward or environment that raises, calls sys.exit(0), returns garbage or hangs; the same reward behind "
        "sao serve",
        "a reward: one line naming the plug-in and the row (exit code 2, never 0); an environment: that trajectory "
        "ends truncated and counted (env_fault_share), told in one log line naming it and the task; a call past "
        "--reward-timeout/--env-timeout ends its trajectory as cut and counted; the server answers an OpenAI-shaped "
        "5xx, logs nothing, stays up",
    ),
    "conventions": (
        "verl and SkyRL rows read by a dotted --answer-field path that is missing, goes through a string or names a "
        "column the file lacks; a --model hub id not in the cache with HF_HUB_OFFLINE set or the hub unreachable; "
        "the train summary on rank 1 of a torchrun",
        "one-line error naming the field path, the file and row and the flag, or the hub id and why, exit code 2, in "
        "seconds (no hub retries); nothing printed by any rank but 0",
    ),
    "run folders": (
        "two sao train on one --out at once; a full disk (a file-size limit) while safetensors are written; a run, "
        "an adapter and a merged export under umask 022; sao export and sao.evaluate of a truncated "
        "adapter_model.safetensors",
        "the second run refused in one line (the folder's lock), the first's files whole; one line, no staging "
        "folder left, the last checkpoint intact and --resume finishing the run; every file and folder with the "
        "umask's mode, safetensors too; one line naming the file, exit code 2, before any model loads",
    ),
    "rewards in parallel": (
        "a per-completion reward that hangs on every row of a batch, one that only returns when a whole batch calls "
        "it at once",
        "the batch scored concurrently, its timeout paid once, the rows scored 0 and counted as cut; no more hung "
        "calls left behind than --reward-concurrency",
    ),
    "log files": (
        "sao eval and sao export with stderr to a file (transformers' weight loading, sao's eval bar)",
        "no progress bar and no carriage return in the log; the result lines as on a terminal",
    ),
    "first hour": (
        "sao eval --samples, sao.evaluate with the arguments sao.train took, rows with chat messages under "
        "messages_field, a chat row without a prompt",
        "--eval-samples as train and recipe spell it (--samples still works, said in one line); the run's adapter "
        "evaluated; the messages read from the field named; one line saying chat messages go under 'prompt' or "
        "messages_field",
    ),
    "failing environments": (
        "an environment whose constructor, factory or init raises, hangs past --env-timeout or answers the wrong "
        "shape on every row; a factory returning None or 0; a factory that is not callable or is an environment; "
        'done given as the string "false"',
        "one line naming the environment and the first row's fault, exit code 2, --out left as found; a factory "
        'refused as a TypeError before anything loads; "false" a fault of that trajectory, never read as done',
    ),
    "hooks and sources": (
        "on_pass returning None, a list or an object JSON cannot hold, extras named like the record's own fields, a "
        "hook class or a function where an instance belongs, an object that is not a source, next_batch returning "
        "None, an on_close that raises after a failure, stateful hooks named alike or like a built-in",
        "a TypeError or ValueError naming the hook or source, --out left as found so the corrected call runs; the "
        "first error kept, the close error noted on it; each hook's own state back on --resume",
    ),
    "plug-in modules": (
        "a --reward, --env or --env skyrl: module that calls sys.exit(0) while imported; --env skyrl:module:id with "
        "the module in the working folder",
        "one line naming the flag and the module, exit code 2, never 0; the module found as --env module:Class "
        "finds its own",
    ),
    "the gate's live reader": (
        "a trace line nested 100,000 deep, a line longer than any record, rewards past 1e6, NaN and inf and a "
        "turn reward past 1e6, in the log the gate reads live",
        "the line skipped as the trace reader skips it, no exception; the refused rewards not counted in the live "
        "comparison",
    ),
    "vLLM behind sao": (
        "a server that accepts and never answers, one that answers a byte at a time, an endless reply, a server "
        "listing no model, a server restarted behind sao serve --upstream",
        "every call given up within --vllm-timeout (--upstream-timeout) in one line naming the server, not retried; "
        "a reply read to a bound on its size; one line for no model; the served adapter loaded again once and the "
        "request answered",
    ),
    "successes that are not": (
        "sao train --config on a run's config.json that was passed rows or a script's reward, and on one passed a "
        "dataset path, an importable reward, environment and hook; a tokenizer without EOS; traces all dropped "
        "(another temperature, a later policy version); every reply cut at the token limit; an environment whose "
        "step returns None, raises, answers a NaN or a string reward on every trajectory; sao serve --watch on a "
        "run that never published, --adapter on a finished run; bf16-like traces at staleness 0",
        "the replay reads what was passed, or is refused in one line with the run's reasons; every run that "
        "trained on nothing ends with one line and exit code 2 (its checkpoint kept for --resume, or the folder as "
        "found); the adapter served as given; the traces path stops at --sampler-tolerance",
    ),
    "waiting on a network": (
        "sao train with no --preset (GSM8K from an unreachable hub, or HF_HUB_OFFLINE), --model /no/such/dir, a "
        "--reward module:function typo, sao export RUN --merge from another folder",
        "one line naming the dataset, model or plug-in, exit code 2, before any data or model loads and without "
        "the hub client's retries; no line printed twice; adapters name their base by absolute path",
    ),
    "first-hour edges": (
        "--resume with another --lr, an unknown flag, sao confirm with power below its target, sao --version, the "
        "verdict's advice with one seed",
        "the settings that differ named; the command's usage with a did-you-mean; the plan refused unless "
        "--accept-low-power, nothing written; the commit, torch, transformers and the device; the seeds a verdict "
        "needs at alpha",
    ),
    "Python API inputs": (
        "sao.train('tiny', ...), config None or 5, an unhashable preset, a setting given twice (section and flat, "
        "in a mapping and a --config file), a run's own config.json as a mapping, a misspelled section, rows with "
        "a NaN answer or a non-string key, prompts longer than the model's context",
        "a preset name accepted; otherwise a ConfigError, TypeError or DataError naming the argument, the setting "
        "or the row, out_dir as it was found",
    ),
}

_recorded: dict[str, set[str]] = defaultdict(set)


def record(kind: str, case: str) -> None:
    """Call at the end of a passing fault test."""
    if kind not in KINDS:
        raise KeyError(f"unknown fault kind {kind!r}")
    _recorded[kind].add(case)


def cases() -> dict[str, list[str]]:
    """The cases recorded in this process, by kind (what a pytest-xdist worker sends its controller)."""
    return {kind: sorted(found) for kind, found in _recorded.items() if found}


def merge(recorded: dict[str, list[str]]) -> None:
    """Add the cases another process recorded (``cases``)."""
    for kind, found in recorded.items():
        _recorded[kind].update(found)


def table() -> str:
    lines = ["| fault class | cases | what was tried | what happened |", "| --- | ---: | --- | --- |"]
    for kind, (tried, happened) in KINDS.items():
        lines.append(f"| {kind} | {len(_recorded[kind])} | {tried} | {happened} |")
    return "\n".join(lines)


def complete() -> bool:
    """Whether every kind was exercised (a partial run such as ``pytest -k`` proves only some)."""
    return all(_recorded[k] for k in KINDS)


def _with_table(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def table_is_current() -> bool:
    text = TABLE_FILE.read_text()
    return _with_table(text) == text


def write_table() -> None:
    """Rewrite the table in docs/faults.md (``make docs``)."""
    text = TABLE_FILE.read_text()
    if _with_table(text) != text:
        TABLE_FILE.write_text(_with_table(text))
