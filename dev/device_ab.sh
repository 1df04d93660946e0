#!/usr/bin/env bash
# One device call for a before/after check of a change: build the old tree
# (.ab_old, e.g. `git archive BASE | tar -x -C .ab_old`) and this one in
# parallel, A/B the kernel benchmark at M = 1 and 16 (REPEAT interleaved runs
# each, default 2), then the fuzz and (SUITE=1) the test suite on the new build.  Logs and JSON go to $OUT.
set -o pipefail
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} QGEMV_CUDA_ARCHS=9.0 TORCH_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
t0=$(date +%s)
mkdir -p "$OUT/ab"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
(cd .ab_old && MAX_JOBS=8 python3 setup.py build_ext --inplace > "$OUT/build_old.log" 2>&1) &
MAX_JOBS=8 python3 setup.py build_ext --inplace > "$OUT/build_new.log" 2>&1 || { tail -20 "$OUT/build_new.log"; exit 1; }
wait || { tail -20 "$OUT/build_old.log"; exit 1; }
QGEMV_SKIP_CUDA_BUILD=1 python3 -m pip install -q --no-deps --no-build-isolation --use-pep517 -e . > "$OUT/pip.log" 2>&1 \
  || { tail -20 "$OUT/pip.log"; exit 1; }
echo "builds: $(( $(date +%s) - t0 )) s"
# REPEAT interleaved runs of each tree (old, new, old, new, ...): ab_compare takes each row's fastest
# run and prints how far two runs of the same tree differ (the noise floor the tolerance meets)
olds=() news=()
for r in $(seq 1 "${REPEAT:-2}"); do
  (cd .ab_old && timeout 150 python3 eval/bench_gemv.py --ms 1,16 --no-extras --out "$OUT/ab/old$r" > "$OUT/ab/old$r.log" 2>&1)
  timeout 150 python3 -m qgemv.eval.bench_gemv --ms 1,16 --no-extras --out "$OUT/ab/new$r" > "$OUT/ab/new$r.log" 2>&1
  olds+=("$OUT/ab/old$r.json") news+=("$OUT/ab/new$r.json")
done
python3 dev/ab_compare.py "$(IFS=,; echo "${olds[*]}")" "$(IFS=,; echo "${news[*]}")" > "$OUT/ab.txt" 2>&1
tail -3 "$OUT/ab.txt"
echo "bench: $(( $(date +%s) - t0 )) s"
QGEMV_FUZZ_CASES=${FUZZ_CASES:-4000} timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fuzz_cuda.py 2>&1 \
  | tee "$OUT/fuzz.log" | tail -1
if [ "${SUITE:-1}" = 1 ]; then  # SUITE=0: the A/B and the fuzz only (the suite in a call of its own)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n 8 --ignore tests/test_wheel.py \
    --deselect tests/test_fuzz_cuda.py tests 2>&1 | tee "$OUT/tests.log" | tail -4
fi
echo "total: $(( $(date +%s) - t0 )) s"
