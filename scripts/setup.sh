#!/usr/bin/env bash
# Set-up on a fresh machine: creates .venv and installs posttrain with its test extras, the optional
# trackers the tests read back (wandb, mlflow: about 35 s more on a fresh venv) and the docs extra whose strict
# build is a test (mkdocs, mkdocs-material: about 25 s more).
# PyTorch: where no NVIDIA GPU is visible the CPU build is installed (POSTTRAIN_CPU_TORCH, default 2.13.0;
# set POSTTRAIN_TORCH_INDEX to PyTorch's CPU wheel index where plain PyPI serves CUDA builds); with a GPU,
# the default (CUDA) build from PyPI. An existing torch in .venv is kept. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing the default (CUDA) PyTorch build"
    "${pip[@]}" torch
  else
    echo "setup: no GPU, installing the CPU PyTorch build torch==${POSTTRAIN_CPU_TORCH:-2.13.0}"
    "${pip[@]}" "torch==${POSTTRAIN_CPU_TORCH:-2.13.0}" ${POSTTRAIN_TORCH_INDEX:+--index-url "$POSTTRAIN_TORCH_INDEX"}
  fi
fi
# POSTTRAIN_CONSTRAINTS (CI: .ci/constraints.txt): pins for this install only, not for torch's above
"${pip[@]}" -e ".[test,wandb,mlflow,docs]" ${POSTTRAIN_CONSTRAINTS:+-c "$POSTTRAIN_CONSTRAINTS"}
# tinker-cookbook for tests/serve/test_cookbook.py, without its pins: the test extra above has its requirements
# but tml-renderers (its Inkling/Kimi tokenizers, never imported by the loops the test runs)
"${pip[@]}" --no-deps "tinker-cookbook==0.6.1"
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
