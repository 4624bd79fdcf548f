#!/usr/bin/env bash
# Sets up .venv and runs the main job on its embedded default: the CPU precision comparison
# (fp32, fp16, bf16, bf16-sr and the off-grid bf16 control from 3 start checkpoints, 2 RL seeds
# each, fp16 one; 13-23 minutes on 2 cores after setup, by the CPU). Writes runs/compare/report.md and figure.png.
# Extra arguments go to `dist-sr compare` (e.g. configs/compare-lr-sweep.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh rl
exec .venv/bin/dist-sr compare "$@"
