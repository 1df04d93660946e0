#!/usr/bin/env bash
# A/B the GEMV kernels with dev/gemv_lab.cu.  Each variant is NAME=DIR:FLAGS,
# a copy of csrc/ (DIR, "csrc" for the working tree) built with extra nvcc
# flags; all are compiled in parallel, then run one after the other.  The
# product has no tuning macros: a variant is a copy of csrc/ with its
# tuning.h edited (e.g. kGemvStages = 8).
#   VARIANTS="base=lab_old: new=csrc: s8=lab_s8:" bash dev/lab_ab.sh [--quick]
# Results go to $OUT/lab_NAME.txt.
set -o pipefail
OUT=${OUT:-runs/lab}; mkdir -p "$OUT"
VARIANTS=${VARIANTS:-new=csrc:}
for v in $VARIANTS; do
  name=${v%%=*}; rest=${v#*=}; dir=${rest%%:*}; flags=${rest#*:}
  nvcc -O3 -std=c++17 -arch=sm_90 ${flags//,/ } -I"$dir" dev/gemv_lab.cu "$dir"/gemv_int4.cu "$dir"/gemv_int8.cu "$dir"/runtime.cpp \
    -o /tmp/lab_$name &
done
wait
for v in $VARIANTS; do
  name=${v%%=*}; echo "== $name ($v)"; /tmp/lab_$name "$@" 2>&1 | tee "$OUT/lab_$name.txt"
done
