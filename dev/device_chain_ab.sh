#!/usr/bin/env bash
# The kernel lab's chain mode (dev/gemv_lab.cu --chain) for several csrc/
# variants: each NAME=DIR is a copy of csrc/ (csrc for the working tree), all
# compiled in the background first (start this before the extension build),
# then run one after the other with the same arguments.
#   bash dev/device_chain_ab.sh compile "new=csrc s8=/tmp/lab_s8"
#   bash dev/device_chain_ab.sh run "new s8" --chain llama3-8b --pdl 0,7
# Output: $OUT/chain_ab.txt (appended).
set -o pipefail
OUT=${OUT:-runs/lab}; mkdir -p "$OUT"
what=$1; list=$2; shift 2
if [ "$what" = compile ]; then
  for v in $list; do
    name=${v%%=*}; dir=${v#*=}
    nvcc -O3 -std=c++17 -arch=sm_90 -I"$dir" dev/gemv_lab.cu "$dir"/gemv_int4.cu "$dir"/gemv_int8.cu \
      "$dir"/runtime.cpp -o /tmp/lab_$name > "/tmp/lab_$name.log" 2>&1 || echo "lab variant $name: build failed"
  done
else
  for name in $list; do
    echo "== $name $*" | tee -a "$OUT/chain_ab.txt"
    /tmp/lab_$name "$@" 2>&1 | tee -a "$OUT/chain_ab.txt"
  done
fi
