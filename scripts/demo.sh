#!/usr/bin/env bash
# The main job: set-up, then tiny model -> task data -> SFT warm start -> GRPO on 2 Ray workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/posttrain demo "$@"
