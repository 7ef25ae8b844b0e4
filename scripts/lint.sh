#!/usr/bin/env bash
# The project's lint checks, run by `make lint` (which installs the tools first: the `lint`
# extra of pyproject.toml into .venv). Each check runs even when an earlier one fails; the exit
# status is 1 when any of them reports a finding.
#
#   Python  ruff check, ruff format --check ([tool.ruff] in pyproject.toml)
#   C       clang-format --dry-run --Werror over compat/, interposer/, fakecuda/, tests/*/c/
#           (.clang-format, fakecuda/.clang-format)
#   shell   shellcheck over scripts/*.sh, agent/mech/*.sh (the CRIU installer) and .ci/run
#   chart   helm lint --strict of charts/cuinterpose with its default values and with each
#           examples/*.yaml (the pinned helm of scripts/install-helm.sh)
#
# scripts/lint.sh --fix (what scripts/format.sh runs) applies what can be applied instead:
# ruff check --fix, ruff format, clang-format -i; then runs the checks again to show what is
# left to fix by hand.
#
# Environment: LINT_BIN, the folder holding ruff, clang-format and shellcheck (default
# <repo>/.venv/bin); CUINTERPOSE_HELM, the helm (default <repo>/.cache/helm/bin/helm).
set -euo pipefail

REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
cd "$REPO"
BIN=${LINT_BIN:-$REPO/.venv/bin}

for tool in ruff clang-format shellcheck; do
  [ -x "$BIN/$tool" ] || { echo "lint: $BIN/$tool not found; run 'make lint' (it installs the lint extra)" >&2; exit 2; }
done
HELM=${CUINTERPOSE_HELM:-$REPO/.cache/helm/bin/helm}
[ -x "$HELM" ] || { echo "lint: $HELM not found; run 'make lint' (it installs helm: scripts/install-helm.sh)" >&2; exit 2; }

# The C sources clang-format owns: *.c and *.h, tracked or new (not ignored). X-macro tables
# (*.def, *.inc) are not C statements and are left as written.
c_sources() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files --cached --others --exclude-standard -- \
      'compat/*.c' 'compat/*.h' 'interposer/*.c' 'interposer/*.h' 'fakecuda/*.c' 'fakecuda/*.h' \
      'tests/*/c/*.c' 'tests/*/c/*.h' \
      | while IFS= read -r f; do if [ -f "$f" ]; then printf '%s\n' "$f"; fi; done
  else   # an unpacked source tree without git
    find compat interposer fakecuda tests/*/c -type f \( -name '*.c' -o -name '*.h' \) | sort
  fi
}
shell_scripts() { printf '%s\n' scripts/*.sh agent/mech/*.sh .ci/run; }

if [ "${1:-}" = --fix ]; then
  echo "lint --fix: ruff check --fix"
  "$BIN/ruff" check --fix --quiet . || true      # what is left is reported by the checks below
  echo "lint --fix: ruff format"
  "$BIN/ruff" format --quiet .
  echo "lint --fix: clang-format -i"
  c_sources | xargs -r -d '\n' "$BIN/clang-format" -i
  echo "lint --fix: done; what is left:"
  exec bash "$REPO/scripts/lint.sh"
fi

failed=()
run() {  # NAME COMMAND...: runs the check, records NAME when it fails
  local name=$1; shift
  echo "lint: $name"
  if ! "$@"; then failed+=("$name"); fi
}
clang_format_check() { c_sources | xargs -r -d '\n' "$BIN/clang-format" --dry-run --Werror; }
shellcheck_check() { shell_scripts | xargs -r -d '\n' "$BIN/shellcheck"; }
helm_lint_check() {  # --quiet: only warnings and errors; --strict makes a warning fail
  local f rc=0
  "$HELM" lint --strict --quiet charts/cuinterpose || rc=1
  for f in charts/cuinterpose/examples/*.yaml; do
    "$HELM" lint --strict --quiet charts/cuinterpose -f "$f" || rc=1
  done
  return $rc
}

run "ruff check" "$BIN/ruff" check --quiet .
run "ruff format" "$BIN/ruff" format --check --quiet --output-format concise .
run "clang-format" clang_format_check
run "shellcheck" shellcheck_check
run "helm lint" helm_lint_check

if [ ${#failed[@]} -gt 0 ]; then
  echo "lint: FAILED: ${failed[*]} (scripts/format.sh applies what ruff and clang-format can fix)" >&2
  exit 1
fi
echo "lint: clean"
