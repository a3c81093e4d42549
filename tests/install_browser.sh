#!/usr/bin/env bash
# Installs Debian's chromium for the dashboard test (tests/cluster/test_admin_dashboard.py) when
# /usr/bin/chromium is missing and apt-get exists. Never fails: without a browser the test itself
# fails with a clear message (RADIXSERVE_SKIP_BROWSER=1 skips it instead). Called by tests/run.sh.
set -uo pipefail
[ -x /usr/bin/chromium ] && exit 0
[ "${RADIXSERVE_SKIP_BROWSER:-0}" = 1 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser.sh: no apt-get here; install chromium yourself for the dashboard test" >&2
  exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
echo "install_browser.sh: installing Debian's chromium (dashboard test)" >&2
if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; }; then
  echo "install_browser.sh: could not install chromium; the dashboard test will fail" >&2
fi
exit 0
