#!/usr/bin/env bash
# Mutation testing (scripts/mutation_check.py, mutmut) in its own virtual environment: a regular (non-editable)
# install of the package with the [test,server,dev] extras (dev: mutmut) (build directory build/mutmut-build, kept for
# incremental rebuilds), then each pure-Python module mutated alone against the tests that cover it.
#
#   scripts/mutation_check.sh [module ...] [--json OUT]      e.g. scripts/mutation_check.sh stats sampling
#
# Not part of CI (about half an hour on a 2-core machine): run it before resolving an issue that touches the
# listed modules (tests/README.md, "Mutation testing"). PYLLAMA_DSPARK_MUTMUT_REUSE=1 reuses .venv-mutmut.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PYLLAMA_DSPARK_MUTMUT_VENV:-.venv-mutmut}"
if [[ "${PYLLAMA_DSPARK_MUTMUT_REUSE:-0}" != 1 || ! -x "$venv/bin/python" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -C build-dir=build/mutmut-build '.[test,server,dev]'
fi
cd build 2>/dev/null || { mkdir -p build && cd build; }  # not the source tree: it would shadow the install
exec "../$venv/bin/python" ../scripts/mutation_check.py "$@"
