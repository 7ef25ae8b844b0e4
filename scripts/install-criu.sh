#!/usr/bin/env bash
# `make criu`: installs CRIU 4.x into <repo>/.cache/criu (or $CUINTERPOSE_CRIU_CACHE) with the
# one installer, agent/mech/criu_install.sh, that the package ships and that
# `cuinterpose-agent install-criu` runs too (docs/criu.md). Arguments pass through:
#   install-criu.sh                      install (idempotent)
#   install-criu.sh --pack FILE          tar+gzip the installed root into FILE
#   install-criu.sh --from-archive FILE  install from such a FILE (a machine without network)
#   install-criu.sh --print-sources      print the derived apt sources and exit
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
export CUINTERPOSE_CRIU_CACHE=${CUINTERPOSE_CRIU_CACHE:-$REPO/.cache/criu}
exec bash "$REPO/agent/mech/criu_install.sh" "$@"
