#!/usr/bin/env bash
# The test suite: set-up, lint, then pytest (fast suite by default; pass -m slow for the long runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check posttrain tests bench recipes
.venv/bin/ruff format --check -q posttrain tests bench recipes
.venv/bin/mypy posttrain/trainers posttrain/controller  # strict on the driver side (pyproject.toml)
exec .venv/bin/python -m pytest "$@"
