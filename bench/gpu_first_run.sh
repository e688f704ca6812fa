#!/usr/bin/env bash
# The GPU engine's first run on one lent H200, as one script (about 6 minutes, 9 at most):
#   1. the GPU tests: pytest -m gpu tests/rollout/test_engine.py  (CUDA graph = eager step, lag-0 agreement on CUDA,
#      the SDPA backend the decode step takes, a failed capture that frees its memory, the shared pool)
#   2. the bench: python bench/bench.py --record BENCHMARKS.md --out bench.json
# Why a script: device time is short and counted from the machine's start, so everything that belongs to the
# first run goes in one call. What it leaves out: installing anything (the machine has torch, transformers and
# peft, and no network), and bench.py --compile (add it with BENCH_ARGS=--compile when there is time to spare).
#
# Outputs go under $OUT when it is set (the device machine's return folder), else under a new temporary folder
# (printed): env.txt, pytest-gpu.log, pytest-gpu.xml, bench.log, bench.json, and BENCHMARKS.md — with $OUT,
# a copy of the repository's BENCHMARKS.md with this run's table appended (copy it back over the tracked
# file); without $OUT, the tracked BENCHMARKS.md itself gets the table.
#
#   bash bench/gpu_first_run.sh                 # run from anywhere; PYTHON=... to choose the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -n "${OUT:-}" ]; then
    out="$OUT"
    mkdir -p "$out"
    cp BENCHMARKS.md "$out/BENCHMARKS.md"
    record="$out/BENCHMARKS.md"
else
    out="$(mktemp -d -t sao-gpu-first-run.XXXXXX)"
    record="BENCHMARKS.md"
fi
echo "outputs: $out"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    "$PYTHON" -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"| transformers", transformers.__version__, "| peft", peft.__version__, "| gpu", torch.cuda.is_available())' 2>&1
} | tee "$out/env.txt"

status=0
echo "== 1/2 pytest -m gpu tests/rollout/test_engine.py"
timeout 150 "$PYTHON" -m pytest -m gpu tests/rollout/test_engine.py -p no:cacheprovider -rA \
    --junitxml="$out/pytest-gpu.xml" 2>&1 | tee "$out/pytest-gpu.log" || status=1

echo "== 2/2 python bench/bench.py --record BENCHMARKS.md --out bench.json ${BENCH_ARGS:-}"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout 390 "$PYTHON" bench/bench.py --record "$record" --out "$out/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$out/bench.log" || status=1

echo "== done (status $status); outputs in $out"
exit "$status"
