#!/usr/bin/env bash
# Installs the Debian packages the build, the demo and the tests need, only if missing.
# Safe to run again; does nothing when everything is present. Needs root for apt-get.
set -euo pipefail
need=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
have_cmd cc     || need+=(gcc)
have_cmd make   || need+=(make)
have_cmd cmake  || need+=(cmake)
have_cmd objdump || need+=(binutils)   # tests/shim/test_glibc.py reads objdump -T
have_cmd ninja  || need+=(ninja-build)
have_pkg libc6-dev || need+=(libc6-dev)
have_cmd python3 || need+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
have_cmd ip     || need+=(iproute2)
have_cmd nsenter || need+=(util-linux)   # unshare, nsenter: the placement tests' namespaces
have_cmd useradd || need+=(passwd)      # useradd, userdel: tests/cases/test_case_016.py adds a user
have_cmd npm    || need+=(npm)           # npm pack: scripts/install-helm.sh's pinned helm
have_cmd apt-get >/dev/null
# libasan/libubsan come with gcc on Debian; CRIU 4.x is fetched by scripts/install-criu.sh.
if [ ${#need[@]} -gt 0 ]; then
  echo "bootstrap: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
