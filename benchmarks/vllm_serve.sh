#!/usr/bin/env bash
# Start vLLM's OpenAI server on dummy weights, wait until it answers /health: bench_online.py's peer.
#   bash benchmarks/vllm_serve.sh MODEL_DIR [PORT] [extra vLLM server flags...]
# MODEL_DIR: a config.json + tokenizer folder (weights are dummy). Served model name: "m".
# vLLM runs from /tmp with PYTHONPATH=$VLLM_PYTHONPATH and nothing else ($VLLM_PYTHON, default python3):
# this repository's root on PYTHONPATH would shadow Hugging Face's `kernels` package with ours.
# Prints "pid N" once ready; the server's log goes to $OUT/vllm_server.log (or /tmp). Stop it: kill N.
set -uo pipefail
model=$(cd "$1" && pwd); port=${2:-8100}; shift; [ $# -gt 0 ] && shift
log=${OUT:-/tmp}/vllm_server.log
( cd /tmp && exec env -u PYTHONPATH PYTHONPATH="${VLLM_PYTHONPATH:-}" "${VLLM_PYTHON:-python3}" \
    -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name m --load-format dummy \
    --port "$port" --gpu-memory-utilization 0.85 "$@" ) >"$log" 2>&1 &
pid=$!
t0=$(date +%s)
for _ in $(seq 1 300); do
  curl -sf "localhost:$port/health" >/dev/null 2>&1 && { echo "vllm serve ready: pid $pid, port $port, $(( $(date +%s) - t0 )) s"; exit 0; }
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
echo "vllm serve did not come up; last lines of $log:" >&2; tail -20 "$log" >&2; kill $pid 2>/dev/null; exit 1
