#!/usr/bin/env bash
# Sets up .venv and runs the main job on its embedded default: the CPU precision comparison
# (fp32, fp16, bf16, bf16-sr, bf16 at 4x lr, off-grid bf16 control, bf16-dither; 3 seeds each).
# Writes runs/compare/report.md and runs/compare/figure.png. Extra arguments go to `dist-sr compare`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh rl
exec .venv/bin/dist-sr compare "$@"
