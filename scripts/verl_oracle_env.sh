#!/usr/bin/env bash
# The separate virtual environment in which tests/algorithms/test_vs_verl.py runs verl's core_algos as an oracle.
#
# verl pins older transformers and tensordict than posttrain, so it never enters .venv: this script creates
# .venv-verl with PyTorch (the same CPU build as scripts/setup.sh), verl itself without its dependency list
# (which pulls in vLLM-era pins, datasets, wandb, ...), and only what `from verl.trainer.ppo import core_algos`
# imports (found by trying: verl/__init__ imports ray and tensordict, torch_functional imports transformers,
# the profiler codetiming). posttrain is installed editable without dependencies: posttrain.algorithms needs
# torch and numpy only. Cached: a marker named after the hash of the pins below skips the install when
# nothing changed, so a second run takes a second; any change to a pin rebuilds the environment from scratch.
#
# Usage: bash scripts/verl_oracle_env.sh && .venv-verl/bin/python -m pytest tests/algorithms/test_vs_verl.py -m verl_oracle
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv-verl

torch_pin="torch==${POSTTRAIN_CPU_TORCH:-2.13.0}"
verl_pin="verl==0.9.1"
# what core_algos imports, at versions verl 0.9.1 accepts (tensordict<=0.10.0, transformers<5.11)
deps=(
  "numpy==2.4.6"
  "omegaconf==2.3.1"
  "tensordict==0.10.0"
  "transformers==5.10.4"
  "ray==2.60.0"
  "codetiming==1.4.0"
  "packaging>=24"
  "pytest==9.2.0"
)

pins="$torch_pin ${POSTTRAIN_TORCH_INDEX:-} $verl_pin ${deps[*]} $("$python" --version 2>&1)"
hash=$(printf '%s' "$pins" | sha256sum | cut -c1-16)
marker="$venv/.ready-$hash"
if [ -f "$marker" ] && [ -x "$venv/bin/python" ]; then
  echo "verl oracle env: cached ($venv, $verl_pin)"
  exit 0
fi

start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
# pip install, quiet; this machine's pip.conf lists local index folders that lack most names, and pip warns
# once per package about each: those lines are dropped, everything else (errors) is kept
pip_install() {
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
pip=(pip_install)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" "$torch_pin"  # the oracle runs on CPU tensors; the default build serves them too
else
  "${pip[@]}" "$torch_pin" ${POSTTRAIN_TORCH_INDEX:+--index-url "$POSTTRAIN_TORCH_INDEX"}
fi
"${pip[@]}" "${deps[@]}"
"${pip[@]}" --no-deps "$verl_pin"
"${pip[@]}" --no-deps -e .
"$venv/bin/python" -c "from verl.trainer.ppo import core_algos, rollout_corr_helper; import posttrain.algorithms"
touch "$marker"
echo "verl oracle env: ready in $(($(date +%s) - start)) s ($("$venv/bin/python" -c 'import torch, verl; print("verl", verl.__version__, "torch", torch.__version__)'))"
