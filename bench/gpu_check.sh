#!/usr/bin/env bash
# The GPU check, one prepared script for a lent GPU machine (< 8 minutes): the Triton tests
# (bitwise against the CPU reference) and the kernels benchmark on CUDA, logs under $OUT.
# Run from the repository root:  bash bench/gpu_check.sh
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
timeout 240 python3 -m pytest -q -x tests/numerics/test_triton.py tests/numerics/test_fused.py \
  tests/rollout/test_plan.py 2>&1 | tee "$out/gpu-tests.log"
timeout 200 python3 bench/kernels.py --device cuda --sizes 20 24 26 28 --json "$out/kernels-cuda.json" 2>&1 \
  | tee "$out/gpu-bench.md"
