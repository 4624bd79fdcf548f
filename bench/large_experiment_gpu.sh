#!/usr/bin/env bash
# The larger experiment (configs/compare-large.yaml: ~11.5M-parameter Qwen2, 3-digit addition,
# fp32/fp16/bf16/bf16-sr from three start checkpoints) on a lent GPU machine, within 8 minutes;
# the report, figures and every run's metrics come back under $OUT. The machine's image holds
# torch, transformers, matplotlib and the rest; nothing is installed.
# Run from the repository root:  bash bench/large_experiment_gpu.sh
set -uo pipefail
out=${OUT:-runs}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
start=$(date +%s)
timeout 470 python3 -m dist_sr.launch.cli compare configs/compare-large.yaml --no-progress \
  --set "output_dir=$out/compare-large" 2>&1 | grep -v -E "Warning|warn\(" | tail -60
echo "wall: $(( $(date +%s) - start )) s"
