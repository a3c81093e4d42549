#!/usr/bin/env bash
# The README's test command: installs what it needs (deploy/install.sh, with the test extra),
# then checks lint, format and import layering and runs pytest. Extra arguments go to pytest. "No tests ran" fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh test
bash tests/install_browser.sh  # Debian's chromium for the dashboard test, when missing
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
VENV=${RADIXSERVE_VENV:-.venv}
# Lint, format and the package layering (pyproject.toml: [tool.ruff], [tool.importlinter]) first.
"$VENV/bin/ruff" check --quiet .
"$VENV/bin/ruff" format --check --quiet .
"$VENV/bin/lint-imports" --no-cache > /dev/null || "$VENV/bin/lint-imports" --no-cache
set +e
# Two workers (pytest-xdist): the tests that start Ray run one after another on one of them (tests/conftest.py,
# RAY_PATHS), the rest on the other; `-n 0` among the arguments runs everything in this process.
# One compute thread per process (torch's intra-op pool, inherited by the processes tests start): the two workers
# keep both CPUs busy, and a second thread per process only adds OpenMP's spinning and synchronisation.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$VENV/bin/python" -m pytest -n 2 --dist loadscope "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
