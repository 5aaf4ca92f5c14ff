#!/usr/bin/env bash
# The one-GPU suite: one command, at most 8 minutes on one GPU (an H100), writing
# benchmarks/results/gpu_suite.{json,md} (hardware, versions, commit, every measured value).
# What it runs and how it reads the results: benchmarks/gpu_suite.py.
#
#   bash benchmarks/gpu_suite.sh                 # on the GPU machine, from the repository root
#   bash benchmarks/gpu_suite.sh --toy --out /tmp/suite --work /tmp/suite-runs    # toy size on CPU
#
# A machine without network (the lent GPU machine: torch 2.11, no pydantic, tomlkit, torchao, torchtitan): run
# `bash benchmarks/gpu_suite_prep.sh` where there is network first. It downloads the missing packages' cp312
# wheels into benchmarks/wheels/ (ignored by git; carry that folder along). Where the interpreter lacks one of
# those packages, this script installs the wheels found there into $FORGE_SUITE_SITE (default
# /tmp/forge-suite-site) and puts that folder on PYTHONPATH. PYTHON picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS=benchmarks/wheels
SITE="${FORGE_SUITE_SITE:-/tmp/forge-suite-site}"
MISSING=$("$PYTHON" -c 'import importlib.util as u; print(" ".join(n for n in ("pydantic", "tomlkit", "torchao", "torchtitan") if u.find_spec(n) is None))')
if [ -n "$MISSING" ]; then
    if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
        echo "gpu_suite.sh: $PYTHON lacks $MISSING and $WHEELS/ holds no wheels: run benchmarks/gpu_suite_prep.sh where there is network" >&2
        exit 2
    fi
    if [ ! -f "$SITE/.installed" ]; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
        touch "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export FORGE_CACHE_DIR="${FORGE_CACHE_DIR:-/tmp/forge-cache}"
exec "$PYTHON" benchmarks/gpu_suite.py "$@"
