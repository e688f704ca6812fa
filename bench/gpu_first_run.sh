#!/usr/bin/env bash
# The GPU path's first run on one lent GPU (an H200), as one script: about 7 minutes, under 9.5 with every timeout.
#   env       the machine, the libraries, and a check that sao and its tests import (torch, transformers, peft,
#             safetensors, numpy, scipy, yaml, pytest: nothing is installed, nothing downloaded)
#   tests     pytest -m gpu tests/  (every GPU-marked test; today tests/rollout/test_engine.py: CUDA graph = eager step,
#             lag-0 agreement on CUDA, the SDPA kernel the decode step takes, a failed capture that frees its memory,
#             the shared graph pool)
#   bench     python bench/bench.py --record BENCHMARKS.md --out bench.json  (decode, lag-0 |log ratio|, train step
#             and protocol rows, each beside the plain HF + PEFT path and the floor; BENCH_ARGS=--compile adds the
#             compiled engine when there is time to spare)
#   regimes   the sharded and full-weight rows, each only when this sao's `sao train` has the flag (else said and
#             skipped): LoRA, --finetune full, and torchrun --shard fsdp (one rank: the FSDP2 code path with its
#             CUDA mixed precision) alone and with --finetune full, each on CUDA beside the same run on the CPU
#             (tiny preset, 4 steps); the last step's reward, loss, gradient norm, critic loss and time side by side
# Why one script: device time is short and counted from the machine's start, so the first run goes in one call.
# STAGES="tests bench" (any of env tests bench regimes) reruns a part; env always runs.
#
# Outputs go under $OUT when it is set (the device machine's return folder: 8 files at most, and this writes 7),
# else under a new temporary folder (printed): env.txt, pytest-gpu.log, pytest-gpu.xml, bench.log, bench.json,
# regimes.log and BENCHMARKS.md: with $OUT, a copy of the repository's BENCHMARKS.md with this run's table appended
# (copy it back over the tracked file); without $OUT, the tracked BENCHMARKS.md itself gets the table.
#
#   bash bench/gpu_first_run.sh                 # run from anywhere; PYTHON=... to choose the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
STAGES=" ${STAGES:-tests bench regimes} "
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1  # the tiny model is built here, never fetched
if [ -n "${OUT:-}" ]; then
    out="$OUT"
    mkdir -p "$out"
    cp BENCHMARKS.md "$out/BENCHMARKS.md"
    record="$out/BENCHMARKS.md"
else
    out="$(mktemp -d -t sao-gpu-first-run.XXXXXX)"
    record="BENCHMARKS.md"
fi
work="$(mktemp -d -t sao-gpu-runs.XXXXXX)"  # run folders: never under $OUT (its file count is limited)
echo "outputs: $out"

status=0
{
    date -u
    git rev-parse HEAD 2>/dev/null || echo "commit: unknown (no .git here)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    "$PYTHON" - <<'EOF' 2>&1
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "| gpu", torch.cuda.is_available())
missing = []
for name in ("transformers", "peft", "safetensors", "numpy", "scipy", "yaml", "tqdm", "matplotlib", "pytest", "sao",
             "sao.rollout.engine", "sao.training.build", "sao.rollout.vllm_weights"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", ""))
    except Exception as error:
        missing.append(f"{name} ({type(error).__name__}: {error})")
print("cannot import:", "; ".join(missing) if missing else "nothing")
raise SystemExit(1 if missing else 0)
EOF
} | tee "$out/env.txt" || status=1

if [[ "$STAGES" == *" tests "* ]]; then
    echo "== tests: pytest -m gpu tests/"
    timeout 150 "$PYTHON" -m pytest -m gpu tests/ -p no:cacheprovider -rA --junitxml="$out/pytest-gpu.xml" 2>&1 \
        | tee "$out/pytest-gpu.log" || status=1
fi

if [[ "$STAGES" == *" bench "* ]]; then
    echo "== bench: python bench/bench.py --record BENCHMARKS.md --out bench.json ${BENCH_ARGS:-}"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    timeout 330 "$PYTHON" bench/bench.py --record "$record" --out "$out/bench.json" ${BENCH_ARGS:-} 2>&1 \
        | tee "$out/bench.log" || status=1
fi

# One `sao train --preset tiny` (4 steps) per device and regime; prints its last step's figures as one row.
regime() {  # regime NAME DEVICE [torchrun] FLAGS...
    local name="$1" device="$2"
    shift 2
    local launcher=("$PYTHON" -m sao)
    if [ "${1:-}" = torchrun ]; then
        launcher=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 -m sao)
        shift
    fi
    local folder="$work/$name-$device"
    if ! timeout 120 "${launcher[@]}" train --preset tiny --steps 4 --critic-warmup 1 --batch-size 16 \
        --train-prompts 64 --test-prompts 16 --device "$device" --quiet --out "$folder" "$@" >"$folder.log" 2>&1; then
        echo "| $name | $device | failed: $(tail -n 3 "$folder.log" | tr '\n' ' ') |"
        return 1
    fi
    "$PYTHON" - "$folder" "$name" "$device" <<'EOF'
import json, sys
from pathlib import Path
last = json.loads((Path(sys.argv[1]) / "train_log.jsonl").read_text().splitlines()[-1])
figures = [last.get(k) for k in ("reward_mean", "loss", "grad_norm", "critic_loss", "time")]
print("| " + " | ".join(sys.argv[2:4] + ["-" if v is None else f"{v:.6g}" for v in figures]) + " |")
EOF
}

if [[ "$STAGES" == *" regimes "* ]]; then
    echo "== regimes: --finetune full and --shard fsdp, CUDA beside the CPU (tiny preset, 4 steps)"
    help="$("$PYTHON" -m sao train --help 2>&1)"
    {
        echo "| regime | device | reward (last step) | loss | grad norm | critic loss | step s |"
        echo "|---|---|---|---|---|---|---|"
        regime lora cpu || status=1
        regime lora cuda || status=1
        if grep -q -- "--finetune" <<<"$help"; then
            regime full cpu --finetune full || status=1
            regime full cuda --finetune full || status=1
        else
            echo "| full | - | skipped: this sao train has no --finetune |"
        fi
        if grep -q -- "--shard" <<<"$help"; then
            regime fsdp cpu torchrun --shard fsdp || status=1
            regime fsdp cuda torchrun --shard fsdp || status=1
            if grep -q -- "--finetune" <<<"$help"; then
                regime fsdp-full cpu torchrun --shard fsdp --finetune full || status=1
                regime fsdp-full cuda torchrun --shard fsdp --finetune full || status=1
            fi
        else
            echo "| fsdp | - | skipped: this sao train has no --shard |"
        fi
    } >"$out/regimes.log" 2>&1  # not a pipe: the statuses set inside must survive
    cat "$out/regimes.log"
fi

rm -rf "$work"
echo "== done (status $status); outputs in $out"
exit "$status"
