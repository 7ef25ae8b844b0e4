#!/usr/bin/env bash
# First contact with a real GPU: the shim, the phases and native checkpoint on the machine's
# own driver, in one call (docs/gpu-validation.md holds what a device run reported).
#
#   scripts/gpu-check.sh pack [--python-version 3.12]
#       Here, with network, after `make build criu`: fills the kit (default .gpu-kit/,
#       $GPU_CHECK_KIT), everything a machine without a registry needs: wheels/ (the
#       versions this .venv runs, for CPython X.Y on manylinux x86-64) and criu-root.tgz
#       (scripts/install-criu.sh --pack). About 30 MiB.
#   scripts/gpu-check.sh run [--driver real|fake] [--out DIR] [--budget-s S] [--only A,B]
#       [--skip A,B]
#       On the GPU machine (or here with --driver fake, to rehearse): installs from the kit
#       the Python dependencies the interpreter lacks (scripts/gpu_check_deps.py), builds the
#       C libraries with CMake into a private site directory, unpacks CRIU, then runs
#       scripts/gpu_check.py: one line per check, `gpu-check: NAME PASS|FAIL|SKIP (reason)
#       key=value...`, and OUT/gpu-check.json, OUT/gpu-check.log. --budget-s (default 420)
#       bounds the whole run, set-up included; each check has its own deadline too. The
#       checks, for --only and --skip: python3 scripts/gpu_check.py --help.
#
# The kit is ignored by git (.gitignore): carry .gpu-kit/ to the GPU machine with the
# checkout, packed for that machine's CPython (--python-version) and x86-64 (the only
# architecture pack fetches today). A real run needs about 20 GiB free under GPU_CHECK_WORK
# (8 GiB of carrier chunks, 4 GiB for the data-path bench, CRIU images), one at a time.
#
# Environment: GPU_CHECK_PYTHON (default python3: on the GPU machine the one with PyTorch),
# GPU_CHECK_KIT (default <repo>/.gpu-kit), GPU_CHECK_WORK (scratch, default /tmp/gpu-check;
# emptied first, and refused if it holds anything but an earlier run's files), OUT (the
# default --out, as the device tool sets it). Each set-up step has SETUP_TIMEOUT_S (300 s).
# Exit status: 0 when no check failed, 1 when one did, 2 on bad usage.
set -euo pipefail

REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
KIT=${GPU_CHECK_KIT:-$REPO/.gpu-kit}
PY=${GPU_CHECK_PYTHON:-python3}
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}
# The distributions the checks import (and their own needs), by the names pip knows them by.
DISTS=(cuda-bindings cuda-pathfinder nvidia-cuda-runtime click rich markdown-it-py mdurl
       pygments pyyaml protobuf grpcio-tools pytest pytest-timeout pluggy iniconfig packaging)

SETUP_TIMEOUT_S=300
MARK=.gpu-check-work  # in GPU_CHECK_WORK: what makes emptying it safe

say() { echo "gpu-check: $*" >&2; }
die() { say "error: $*"; exit 2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2; exit 2; }
value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }  # OPTION "$@": its value is there
now() { echo $(($(date +%s%N) / 1000000)); }  # ms
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", (b - a) / 1000 }'; }  # s

pack() {
  local pyver=3.12 venv=$REPO/.venv/bin/python
  while [ $# -gt 0 ]; do
    case $1 in
      --python-version) value "$@"; pyver=$2; shift 2 ;;
      *) die "pack: unknown option $1" ;;
    esac
  done
  [ -x "$venv" ] || die "pack needs the project's .venv: run make build criu first"
  local tag=${pyver/./} pins
  pins=$("$venv" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null)
  rm -rf "$KIT/wheels"
  mkdir -p "$KIT/wheels"
  for dist in "${DISTS[@]}"; do
    local pin
    pin=$(grep -i -m1 -E "^${dist//-/[-_.]}==" <<<"$pins") || die "pack: $dist is not in $venv"
    "$venv" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$pyver" --implementation cp --abi "cp$tag" --abi abi3 --abi none \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$KIT/wheels" "$pin" \
      || die "pack: pip download $pin failed"
  done
  bash "$REPO/scripts/install-criu.sh" --pack "$KIT/criu-root.tgz"
  say "kit $KIT ($(du -sh "$KIT" | cut -f1)): $(find "$KIT/wheels" -name "*.whl" | wc -l) wheels for CPython $pyver, criu-root.tgz"
}

# setup_result NAME STATUS REASON SECONDS [KEY=VALUE...]: one setup entry of the report (JSON)
setup_result() {
  "$PY" - "$@" <<'PY'
import json, sys
name, status, reason, seconds, *kv = sys.argv[1:]
keys = dict(x.split("=", 1) for x in kv)
print(json.dumps({"name": name, "status": status, "reason": reason, "seconds": float(seconds),
                  "keys": keys, "detail": {}}))
PY
}

run() {
  local driver=real out=${OUT:-} budget=420 pass=()
  while [ $# -gt 0 ]; do
    case $1 in
      --driver) value "$@"; driver=$2; shift 2 ;;
      --out) value "$@"; out=$2; shift 2 ;;
      --budget-s) value "$@"; budget=$2; shift 2 ;;
      --only|--skip) value "$@"; pass+=("$1" "$2"); shift 2 ;;
      *) die "run: unknown option $1 (see scripts/gpu-check.sh with no arguments)" ;;
    esac
  done
  [[ $driver == real || $driver == fake ]] || die "--driver is real or fake, not $driver"
  [ -d "$KIT/wheels" ] || die "no kit at $KIT: run scripts/gpu-check.sh pack here first"
  [[ $budget =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--budget-s is seconds, not '$budget'"
  if [ -e "$WORK" ] && [ -n "$(ls -A "$WORK")" ] && [ ! -e "$WORK/$MARK" ]; then
    die "GPU_CHECK_WORK=$WORK holds files of something else: not emptying it"
  fi
  local t0 site=$WORK/site setup=$WORK/setup.json entries=() t
  t0=$(now)
  rm -rf "$WORK"
  mkdir -p "$WORK" "$WORK/logs"
  : >"$WORK/$MARK"
  out=${out:-$WORK/out}
  mkdir -p "$out"
  out=$(cd "$out" && pwd -P)
  : >"$WORK/build.log"
  local commit
  commit=$(git -C "$REPO" describe --always --dirty 2>/dev/null || echo unknown)
  export GPU_CHECK_COMMIT=$commit
  say "python $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])'); kit $KIT; work $WORK"

  # 1. Python dependencies: only those this interpreter lacks or has at another version.
  t=$(now)
  timeout "$SETUP_TIMEOUT_S" "$PY" "$REPO/scripts/gpu_check_deps.py" "$KIT/wheels" "$site" \
    "$WORK/deps.json" || say "deps failed: the checks below may fail to import"
  if [ -s "$WORK/deps.json" ]; then
    entries+=("$(cat "$WORK/deps.json")")
  else
    entries+=("$(setup_result deps FAIL "gpu_check_deps.py wrote no result (timed out after \
${SETUP_TIMEOUT_S} s?)" "$(since "$t")")")
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}

  # 2. The C libraries, built here with CMake into the private site's package directory.
  t=$(now)
  local inc status=PASS reason="" jobs
  jobs=$(nproc)
  # The Python packages first, so that a failed build fails its checks, not the runner.
  mkdir -p "$site/cuinterpose"
  for pkg in agent coordinator workloads; do ln -sfn "$REPO/$pkg" "$site/cuinterpose/$pkg"; done
  local tmo=(timeout "$SETUP_TIMEOUT_S")
  if inc=$("$PY" "$REPO/scripts/cuda_include_dir.py" 2>"$WORK/build.log") \
     && "${tmo[@]}" cmake -S "$REPO" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
          -DCUINTERPOSE_CUDA_INCLUDE_DIR="$inc" -DPython_EXECUTABLE="$(command -v "$PY")" \
          >>"$WORK/build.log" 2>&1 \
     && "${tmo[@]}" cmake --build "$WORK/build" -j "$jobs" >>"$WORK/build.log" 2>&1 \
     && "${tmo[@]}" cmake --install "$WORK/build" --prefix "$site/cuinterpose" \
          >>"$WORK/build.log" 2>&1; then
    # these libraries, whatever else the interpreter has installed (agent/paths.py)
    export CUINTERPOSE_LIB_DIR=$site/cuinterpose/lib
  else
    status=FAIL
    reason=$(grep -m1 -iE "error[: ]" "$WORK/build.log" || tail -1 "$WORK/build.log")
  fi
  local cc_version cmake_version
  cc_version=$(cc --version 2>/dev/null | head -1 | tr ' ' '_' || echo none)
  cmake_version=$(cmake --version 2>/dev/null | head -1 | awk '{print $3}' || echo none)
  entries+=("$(setup_result build "$status" "$reason" "$(since "$t")" "cc=$cc_version" \
    "cmake=$cmake_version" "cuda_h=${inc:-none}")")
  echo "gpu-check: build $status${reason:+ ($reason)} cc=$cc_version cmake=$cmake_version t=$(since "$t")s"

  # 3. CRIU, carried: the criu check reports whether it works on this kernel.
  t=$(now)
  export CUINTERPOSE_CRIU_CACHE=$WORK/criu
  status=PASS reason=""
  if ! timeout "$SETUP_TIMEOUT_S" bash "$REPO/scripts/install-criu.sh" --from-archive \
       "$KIT/criu-root.tgz" >"$WORK/criu-install.log" 2>&1; then
    status=FAIL reason="$(tail -1 "$WORK/criu-install.log")"
  fi
  entries+=("$(setup_result criu-install "$status" "$reason" "$(since "$t")")")
  echo "gpu-check: criu-install $status${reason:+ ($reason)} t=$(since "$t")s"

  (IFS=,; echo "[${entries[*]}]") >"$setup"
  local left
  left=$(awk -v b="$budget" -v s="$(since "$t0")" 'BEGIN { print b - s }')
  cp "$WORK/build.log" "$WORK/criu-install.log" "$WORK/logs/" 2>/dev/null || true
  cd "$REPO"
  "$PY" "$REPO/scripts/gpu_check.py" --driver "$driver" --out "$out" --work "$WORK" \
    --budget-s "$left" --setup "$setup" "${pass[@]}"
}

case ${1:-} in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  *) usage ;;
esac
