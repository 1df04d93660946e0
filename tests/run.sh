#!/usr/bin/env bash
# Fresh machine -> installed dependencies, built extension, full test run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install.sh
# vLLM's CPU build in its own venv, for tests/test_vllm.py (the plugin on a real vLLM)
bash .ci/install_vllm.sh > /dev/null
set +e
python3 -m pytest -q -rs tests
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "tests/run.sh: pytest collected no tests - treating that as a failure" >&2
  exit 1
fi
exit $rc
