#!/usr/bin/env bash
# The README's test command: installs what it needs (deploy/install.sh, with the test extra),
# then runs pytest. Extra arguments go to pytest. "No tests ran" fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh test
bash tests/install_browser.sh  # Debian's chromium for the dashboard test, when missing
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
"${RADIXSERVE_VENV:-.venv}/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
