#!/usr/bin/env bash
# The GPU check, one prepared script for a lent GPU machine (about 6 minutes on an H200 before the
# training-step and delta-codec stages were added; those are new and not yet timed there): the
# launch-shape sweep, the optimizer-step and kernels benchmarks with the chosen shapes, one whole
# training step (bench/train_step.py; its DeepSpeed rows need .gpu-wheels/ from
# scripts/gpu_wheels.sh, carried with the call), the delta codec's speed, a colocated sync over
# CUDA IPC (bench/ipc_sync.py), then the CUDA tests
# (bitwise against the CPU reference, no host synchronisation in a step, steps replayed from a
# CUDA graph); every stage has its own time limit; logs and JSON under $OUT.
# Run from the repository root:  bash bench/gpu_check.sh
# GPU_CHECK_QUICK=1 (about 4 minutes, for a short device budget): the optimizer step, one FSDP2
# training step (torch's policy vs dist-sr), the SR cast at 2^26 and 2^28, and the CUDA tests
# (Triton, the offload modes), most important first, with the committed launch shapes.
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# the CPU side of the CUDA-vs-CPU tests uses the pure-torch reference (same bits) instead of
# compiling the C++ kernel on this machine
export DIST_SR_DISABLE_CPU_KERNEL=1
if [ -d .gpu-wheels ]; then  # DeepSpeed and what it needs, carried (scripts/gpu_wheels.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu-wheels/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.mem,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
if [ -n "${GPU_CHECK_QUICK:-}" ]; then
  timeout 100 python3 bench/optimizer_step.py --device cuda --json "$out/optimizer-step-cuda.json" 2>&1 \
    | grep -v Warning | tee "$out/gpu-optimizer-step.md"
  timeout 60 python3 bench/train_step.py --device cuda --engines fsdp2 --hidden 1024 --layers 24 --batch 8 \
    --seq 512 --steps 5 --json "$out/train_step-cuda.json" 2>&1 | grep -v Warning | tee "$out/gpu-train-step.md" \
    | grep -E "^#|^\|"
  timeout 45 python3 bench/kernel_speed.py --device cuda --sizes 26 28 --rounds 5 --json "$out/kernels-cuda.json" 2>&1 \
    | tee "$out/gpu-kernels.md" | grep -E "^#|SR cast bandwidth|dist-sr"
  timeout 40 python3 bench/host_cost.py --device cuda 2>&1 | tee "$out/gpu-host-cost.md"
  timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -k cuda tests/numerics/test_triton.py \
    tests/numerics/test_digest.py tests/numerics/test_delta.py tests/weightsync/test_ipc.py \
    tests/engines/test_fsdp2_gather.py tests/engines/test_offload_cuda.py 2>&1 \
    | tee "$out/gpu-tests.log" | tail -25
  exit 0
fi
timeout 75 python3 bench/triton_tune.py --env "$out/tuned.env" 2>&1 | tee "$out/gpu-tune.md"
[ -f "$out/tuned.env" ] && source "$out/tuned.env"
timeout 100 python3 bench/optimizer_step.py --device cuda --json "$out/optimizer-step-cuda.json" 2>&1 \
  | grep -v Warning | tee "$out/gpu-optimizer-step.md"
timeout 70 python3 bench/kernel_speed.py --device cuda --sizes 20 24 26 28 --rounds 7 --json "$out/kernels-cuda.json" 2>&1 \
  | tee "$out/gpu-kernels.md" | grep -E "^#|SR cast bandwidth|dist-sr"
timeout 40 python3 bench/host_cost.py --device cuda 2>&1 | tee "$out/gpu-host-cost.md"
# one whole training step (~320M params): ZeRO-2/3 SR off vs on, FSDP2 torch MPP vs dist-sr
timeout 240 python3 bench/train_step.py --device cuda --hidden 1024 --layers 24 --batch 8 --seq 512 2>&1 \
  | grep -v Warning | tee "$out/gpu-train-step.md" | grep -E "^#|^\|"
# what SR adds in device bytes per parameter, every memory mode (docs/performance.md's table)
timeout 420 python3 bench/memory.py --device cuda --hidden 1024 --layers 4 --json "$out/memory-cuda.json" 2>&1 \
  | grep -v Warning | tee "$out/gpu-memory.md" | grep -E "^memory:|^\|"
# the grid-step delta codec's Triton passes at 2^26 and 2^28 elements, beside a device copy
timeout 60 python3 bench/delta_sync.py --device cuda 2>&1 | grep -v Warning | tee "$out/gpu-delta-codec.md"
# the costs at the sizes users run (bench/scale.py), in device memory: digest, read-back on the device,
# IPC and gloo sync, the optimizer step, at 0.5B and 1.5B (NCCL needs a GPU per rank: not on one GPU)
timeout 420 python3 bench/scale.py --device cuda --components digest readback sync optimizer --sizes 0.5B 1.5B \
  --json "$out/scale-cuda.json" 2>&1 | grep -v Warning | tee "$out/gpu-scale.md" | grep -E "^scale:|^\|"
# a colocated engine on the same GPU: sync over CUDA IPC and over gloo beside a device copy
timeout 90 python3 bench/ipc_sync.py --mb 1024 --bucket-mb 256 2>&1 | grep -v Warning | tee "$out/gpu-ipc-sync.md"
timeout 320 python3 -m pytest -q -rs -p no:cacheprovider -k cuda tests/numerics/test_triton.py \
  tests/numerics/test_digest.py tests/numerics/test_delta.py tests/weightsync/test_ipc.py \
  tests/engines/test_fsdp2_gather.py tests/engines/test_offload_cuda.py 2>&1 \
  | tee "$out/gpu-tests.log" | tail -25
