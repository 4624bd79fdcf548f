#!/usr/bin/env bash
# Fills .gpu-wheels/ (ignored) with what bench/gpu_check.sh needs on a lent GPU machine that has
# torch, Triton and transformers but no DeepSpeed and no network: DeepSpeed's pure-Python wheel
# (built here from its sdist) and the packages it needs that the machine's image lacks (hjson,
# pydantic and its parts), for that image's Python 3.12 on x86-64. Carry the folder with the call:
#   bash scripts/gpu_wheels.sh   # here, once
#   device run: carry [".gpu-wheels"], command "bash bench/gpu_check.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu-wheels
rm -rf "$out" && mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
ds=$("$py" -c "import importlib.metadata as m; print(m.version('deepspeed'))" 2>/dev/null || echo 0.19.8)
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "deepspeed==$ds" 2>/dev/null \
  || "$py" -m pip wheel -q --no-deps -w "$out" "deepspeed==$ds"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
pins=$("$py" -c "
import importlib.metadata as m
for n in ('hjson', 'pydantic', 'pydantic-core', 'annotated-types', 'typing-inspection'):
    try: print(f'{n}=={m.version(n)}')
    except m.PackageNotFoundError: print(n)
")
# shellcheck disable=SC2086
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$out" $pins
ls -1 "$out"
du -sh "$out"
