#!/usr/bin/env bash
# Fresh machine -> the main job: install, then quantize SmolLM2 (int8 RTN, int4 g128 and
# int4 per-channel GPTQ), check each against the float model, benchmark if a GPU is
# present, and print one summary table.  Extra arguments go to qgemv.eval.main_job (eval/main_job.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
exec python3 -m qgemv.eval.main_job "$@"
