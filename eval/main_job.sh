#!/usr/bin/env bash
# Fresh machine -> the main job: install, then quantize SmolLM2 (int8 RTN and
# int4 g128 GPTQ), check both against the float model, benchmark if a GPU is
# present, and print one summary table.  Extra arguments go to eval/main_job.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
exec python3 -m eval.main_job "$@"
