#!/usr/bin/env bash
# One lease of a CUDA machine: set up jaxattn without network access, then run what is asked.
#   bash benchmarks/gpu_session.sh tests  [pytest args...]   # GPU test files
#   bash benchmarks/gpu_session.sh bench  [jaxattn bench args...]
#   bash benchmarks/gpu_session.sh py     benchmarks/<script>.py [args...]   # benchmarks/README.md
#   Several workers on one GPU: at most three (`-n 3`, XLA_PYTHON_CLIENT_MEM_FRACTION=.2); with four the
#   Hopper test files run the GPU's memory out (BENCHMARKS.md, twentieth pass).
# Needs the jax-triton wheel in .whl/ (pip download jax-triton==0.3.1 for Python 3.12).
set -uo pipefail
export HOME=/tmp TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/site "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# The installed layout (jaxattn.jax_core, .bridge, .torch_api) without pip's build step; `python3 -P`
# keeps the checkout's own jaxattn/ folder (which lacks the three layers) from shadowing it.
rm -rf /tmp/site/jaxattn && cp -r jaxattn /tmp/site/ && cp -r jax_core bridge torch_api /tmp/site/jaxattn/
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, jax, triton, transformers; print('torch', torch.__version__, 'jax', jax.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
what=$1; shift
case $what in
  tests) python3 -P -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log" ;;
  bench) python3 -P -m jaxattn bench "$@" 2>&1 | tee "$OUT/bench.log" ;;
  py) python3 "$@" 2>&1 | tee "$OUT/$(basename "$1" .py).log" ;;
esac
