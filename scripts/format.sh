#!/usr/bin/env bash
# Applies the project's formatting and safe lint fixes in place: ruff check --fix and ruff
# format over the Python code, clang-format -i over the C sources of interposer/, fakecuda/ and
# tests/*/c/; then prints what `make lint` still reports (to fix by hand). The tools come from
# the `lint` extra (run `make lint` once to install them). Same as scripts/lint.sh --fix.
set -euo pipefail
exec bash "$(dirname -- "${BASH_SOURCE[0]}")/lint.sh" --fix
