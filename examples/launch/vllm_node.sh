#!/usr/bin/env bash
# One vLLM server per GPU of this node, on ports PORT, PORT+1, ..., set up as sao's vLLM sources need them: runtime
# LoRA loading (adapters), log-probs after temperature (sao's ratio footing), and vLLM's development routes (full
# weights are reloaded in place through them). Runs until one server exits or the script is stopped.
#
#   examples/launch/vllm_node.sh MODEL GPUS PORT     # from the sao checkout; VLLM_PYTHON, LOGS, DTYPE optional
#
# The development routes let anyone who reaches a port call any worker method: keep the ports on the cluster's
# private network. The servers read every adapter and full-weight version the trainer publishes BY PATH, so the
# trainer's --out must be on a filesystem this node mounts at the same path.
set -euo pipefail
MODEL="$1" GPUS="$2" PORT="$3"
VLLM_PYTHON="${VLLM_PYTHON:-.venv-vllm/bin/python}"
LOGS="${LOGS:-.}"
DTYPE="${DTYPE:-bfloat16}"  # float32 agrees with a float32 trainer to ~3e-6 in |log r|; bfloat16 needs --sampler-tolerance 3e-2
mkdir -p "$LOGS"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for ((i = 0; i < GPUS; i++)); do
    CUDA_VISIBLE_DEVICES=$i VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_SERVER_DEV_MODE=1 \
        "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 0.0.0.0 --port $((PORT + i)) \
        --dtype "$DTYPE" --max-model-len 4096 --enable-lora --max-lora-rank 16 --max-loras 4 \
        --logprobs-mode processed_logprobs --seed "$i" >"$LOGS/vllm-$(hostname)-$i.log" 2>&1 &
    pids+=($!)
done
wait -n
