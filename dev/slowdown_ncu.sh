#!/usr/bin/env bash
# The int4 slowdown of 2026-12-05 (dev/PERSISTENT.md): ncu on the lab's persistent launch built from an
# older tree and from this one, int4 g128 + zeros, Llama-3-8B, 16 layers; the warp-state, instruction and
# source-counter sections (the top stall locations) of one launch each, then the lab's timing of both.
#   bash dev/slowdown_ncu.sh export [REV]   # here: REV's csrc/ and lab sources into .peers/old (default 564d543)
#   bash dev/slowdown_ncu.sh device         # on the device (the export travels as untracked files)
#   bash dev/slowdown_ncu.sh sass           # on the device: both builds' SASS into $OUT (gzip), no runs
#   bash dev/slowdown_ncu.sh source         # on the device: ncu's per-instruction source page of both (csv, gzip)
#   bash dev/slowdown_ncu.sh time           # on the device: both builds' chains timed alternately (any REV's A/B)
#   bash dev/slowdown_ncu.sh flags          # on the device: this tree's lab under several ptxas settings (LAB_FLAGS)
set -o pipefail
OUT=${OUT:-runs/device}; mkdir -p "$OUT"
case "$1" in
  export)
    rev=${2:-564d543}
    rm -rf .peers/old && mkdir -p .peers/old
    git archive "$rev" csrc dev/persist_lab.cu dev/lab_common.cuh | tar -x -C .peers/old
    echo "$rev" > .peers/old/REV
    echo "exported $rev into .peers/old (untracked: delete before a commit)" ;;
  device|sass|source|time)
    [ -d .peers/old/csrc ] || { echo "no .peers/old: run 'bash dev/slowdown_ncu.sh export' first"; exit 2; }
    mkdir -p /tmp/slow
    for tree in old:.peers/old new:.; do
      name=${tree%%:*}; dir=${tree#*:}
      for f in "$dir"/dev/persist_lab.cu "$dir"/csrc/gemv_int4.cu "$dir"/csrc/gemv_int8.cu "$dir"/csrc/runtime.cpp; do
        nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$dir"/csrc -c "$f" \
          -o "/tmp/slow/${name}_$(basename "$f").o" > "/tmp/slow/${name}_$(basename "$f").log" 2>&1 &
      done
    done
    wait
    for name in old new; do
      nvcc -gencode=arch=compute_90a,code=sm_90a /tmp/slow/${name}_*.o -o /tmp/slow/lab_$name \
        || { tail -20 /tmp/slow/${name}_*.log; exit 1; }
    done
    args="--no-probe --model llama3-8b --layers 16 --formats int4g128a --warps 16 --stages 8"
    if [ "$1" = time ]; then  # the two builds' chains alternately, two rounds (an A/B of any exported REV)
      for round in 1 2; do
        for name in old new; do
          echo "== $name round $round"
          timeout 120 /tmp/slow/lab_$name --no-probe --model llama3-8b --layers 16 \
            --formats ${TIME_FORMATS:-int4g128a,int4g128,int4} --warps 16 --stages 8 2>&1 \
            | grep -E "persist w|FAIL|match" | head -8
        done
      done
      exit 0
    fi
    if [ "$1" = source ]; then  # ncu's source page: each SASS instruction's executions and stall samples, both builds
      for name in old new; do
        timeout 240 ncu --kernel-name regex:chain_kernel --launch-skip 2 --launch-count 1 --section SourceCounters \
          --section WarpStateStats --page source --print-source sass --csv /tmp/slow/lab_$name $args --no-ceiling \
          2> "$OUT/src_$name.err" | gzip > "$OUT/src_$name.csv.gz"
        echo "$name: exit $?, $(zcat "$OUT/src_$name.csv.gz" | wc -l) lines"; tail -3 "$OUT/src_$name.err"
      done
      exit 0
    fi
    if [ "$1" = sass ]; then  # both labs' SASS (every kernel), to diff the chain kernels here
      for name in old new; do
        cuobjdump -sass /tmp/slow/lab_$name | gzip > "$OUT/sass_$name.txt.gz"
      done
      ls -la "$OUT"; exit 0
    fi
    for name in old new; do
      echo "== $name ($( [ $name = old ] && cat .peers/old/REV || echo this tree )): timing"
      timeout 90 /tmp/slow/lab_$name $args 2>&1 | grep -E "persist w|per-op GEMVs alone" | head -4
    done
    for name in old new; do
      echo "== $name: ncu, one launch of the persistent kernel"
      timeout 240 ncu --kernel-name regex:chain_kernel --launch-skip 2 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters \
        --section SpeedOfLight /tmp/slow/lab_$name $args --no-ceiling > "$OUT/ncu_$name.txt" 2>&1
      grep -E "Duration|Executed Instructions |Issued Instructions |Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Stall|Warp Stall|Branch Instructions |Memory Throughput|^\s+[0-9a-f]{4,}|Location" \
        "$OUT/ncu_$name.txt" | head -60
    done ;;
  flags)
    # this tree's lab built with each ptxas setting of LAB_FLAGS ('|' between sets; the chain kernels' schedule
    # is what the slowdown changed), then each timed in turn, two rounds (no export needed)
    IFS='|' read -r -a sets <<< "${LAB_FLAGS:- |-Xptxas --register-usage-level=10|-Xptxas --register-usage-level=0|-Xptxas --allow-expensive-optimizations=true}"
    mkdir -p /tmp/flags
    for f in csrc/gemv_int4.cu csrc/gemv_int8.cu csrc/runtime.cpp; do
      nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc -c "$f" -o "/tmp/flags/$(basename "$f").o" &
    done
    for i in "${!sets[@]}"; do
      # shellcheck disable=SC2086  # (a set is several words)
      nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc ${sets[$i]} -Xptxas -v -c dev/persist_lab.cu \
        -o "/tmp/flags/lab$i.o" > "/tmp/flags/lab$i.log" 2>&1 &
    done
    wait
    for i in "${!sets[@]}"; do
      nvcc -gencode=arch=compute_90a,code=sm_90a "/tmp/flags/lab$i.o" /tmp/flags/*.cu.o /tmp/flags/runtime.cpp.o \
        -o "/tmp/flags/lab$i" || { tail -20 "/tmp/flags/lab$i.log"; exit 1; }
      echo "set $i: [${sets[$i]}] spills: $(grep -c '[1-9][0-9]* bytes spill stores' "/tmp/flags/lab$i.log") kernels"
    done
    for round in 1 2; do
      for i in "${!sets[@]}"; do
        echo "== set $i round $round"
        timeout 120 "/tmp/flags/lab$i" --no-probe --model llama3-8b --layers 16 \
          --formats ${TIME_FORMATS:-int4g128a,int4} --warps 16 --stages 8 2>&1 | grep -E "persist w|FAIL|match" | head -6
      done
    done ;;
  *) echo "usage: bash dev/slowdown_ncu.sh export [REV] | device | sass | source | time | flags"; exit 2 ;;
esac
