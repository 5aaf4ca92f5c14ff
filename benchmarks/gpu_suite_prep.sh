#!/usr/bin/env bash
# Download, where there is network, the wheels benchmarks/gpu_suite.sh needs on a machine that has none: the
# lent GPU machine has Python 3.12 with torch 2.11, transformers, triton, numpy, typer, rich, tokenizers,
# safetensors, pyarrow and jinja2, but not these (../shared/FACTS.md, "The lent GPU machine"). cp312
# manylinux wheels, no dependencies resolved (the list is the whole closure the suite imports), into
# benchmarks/wheels/ (ignored by git); carry that folder with the working tree.
#
#   bash benchmarks/gpu_suite_prep.sh            # PIP picks the pip (default: the current python3 -m pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
PACKAGES=(
    pydantic pydantic_core annotated-types typing-inspection typing-extensions  # the config
    tomlkit                                                                      # config files
    torchao                                                                      # FP8
    torchtitan spmd_types tyro docstring_parser typeguard dill torch_checkpointing  # the race
)
mkdir -p benchmarks/wheels
# The versions of the project's lock (requirements/dev-constraints.txt: torchtitan 0.3.0, torchao 0.18, the
# pydantic_core that this pydantic pins), which the suite runs with here.
rm -f benchmarks/wheels/*.whl
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi none --abi abi3 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -c requirements/dev-constraints.txt --dest benchmarks/wheels "${PACKAGES[@]}"
ls -la benchmarks/wheels
