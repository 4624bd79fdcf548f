#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite (slow multi-process tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh rl deepspeed dev
exec .venv/bin/python -m pytest -q -ra "$@"
