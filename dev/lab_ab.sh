#!/usr/bin/env bash
# A/B the GEMV kernels with eval/gemv_lab.cu.  Each variant is NAME=DIR:FLAGS,
# a copy of csrc/ (DIR, "csrc" for the working tree) built with extra nvcc
# flags; all are compiled in parallel, then run one after the other.
#   VARIANTS="base=lab_old: new=csrc: b3=csrc:-DQGEMV_MIN_BLOCKS_PER_SM=3" \
#     bash eval/lab_ab.sh [--quick]
# Results go to $OUT/lab_NAME.txt.
set -o pipefail
OUT=${OUT:-runs/lab}; mkdir -p "$OUT"
VARIANTS=${VARIANTS:-new=csrc:}
for v in $VARIANTS; do
  name=${v%%=*}; rest=${v#*=}; dir=${rest%%:*}; flags=${rest#*:}
  nvcc -O3 -std=c++17 -arch=sm_90 ${flags//,/ } -I"$dir" eval/gemv_lab.cu "$dir"/gemv_int4.cu "$dir"/gemv_int8.cu \
    -o /tmp/lab_$name &
done
wait
for v in $VARIANTS; do
  name=${v%%=*}; echo "== $name ($v)"; /tmp/lab_$name "$@" 2>&1 | tee "$OUT/lab_$name.txt"
done
