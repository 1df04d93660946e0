#!/usr/bin/env bash
# One batched run on the lent GPU: build the extension for sm_90, run the
# tests, run the kernel benchmark.  Logs go to $OUT (or runs/device).
#   bash dev/device_run.sh [tests|bench|prefill|sanitize|decode|lab|labchain|linears|persist|oplayout|decomp|slices|b16|m16|e16|pdl16|octets|dchecks|pfgen|patchab|da|stage2|attn|attnncu|attnstages|diag|bf16|gen|gen70|chain|gptqab|genact|import|glue|overlap|tpbench|all]...
#   (DECODE_ARGS: extra arguments for qgemv.eval.bench_decode; PYTEST_K: a
#   pytest -k expression for the tests step)
set -o pipefail
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} QGEMV_CUDA_ARCHS=9.0 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
if [ -z "${NO_EXT:-}" ]; then  # NO_EXT=1: lab steps only (persist), no extension build
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  QGEMV_SKIP_CUDA_BUILD=1 python3 -m pip install -q --no-deps --no-build-isolation --use-pep517 -e . > "$OUT/pip.log" 2>&1 || exit 1
  echo "build: $(( $(date +%s) - start )) s"
  python3 -m qgemv info | tee "$OUT/info.txt"
fi
for step in "${@:-all}"; do
  case "$step" in
    tests|all)
      # 16 workers with 2 CPU threads each (16 x 16 threads oversubscribed the
      # 16 cores: the suite outran a 330 s limit), one line per test (-v), so
      # that a run cut by the call's limit still names what failed; the wheel
      # test needs PyPI; TESTS_LIMIT: seconds.
      OMP_NUM_THREADS=2 timeout "${TESTS_LIMIT:-420}" python3 -m pytest -n "${PYTEST_N:-16}" -v -rs -p no:cacheprovider \
        --ignore tests/test_wheel.py ${PYTEST_K:+-k "$PYTEST_K"} tests > "$OUT/tests.log" 2>&1
      echo "pytest: exit $?, $(grep -c ' PASSED ' "$OUT/tests.log") passed"
      grep -E ' (FAILED|ERROR) ' "$OUT/tests.log" | sort -u | head -40
      grep -E '^(FAILED|ERROR) |passed|failed' "$OUT/tests.log" | tail -5 ;;&
    bench|all)
      python3 -m qgemv.eval.bench_gemv --out "$OUT/bench_gemv" 2>&1 | tail -120 ;;&
    prefill)
      python3 -m qgemv.eval.bench_gemv --prefill-only --wgmma-shapes --out "$OUT/bench_prefill" 2>&1 | tail -120 ;;
    sanitize)
      # memcheck: everything; racecheck: the GEMV token counts on every shape,
      # then the tiled GEMM on the small set (M = 200 runs cuBLAS, whose
      # kernels racecheck flags; the full sweep at M > 16 takes over 10 min).
      # --wgmma adds the wgmma GEMM with each block shape forced at M > 16.
      for args in "memcheck --wgmma --ms 1,5,16,24,40,72,200" "racecheck --ms 1,5,16" \
                  "racecheck --small --wgmma --ms 24,40,72"; do
        set -- $args; tool=$1; shift
        log="$OUT/sanitize_${tool}$( [ "$1" = --small ] && echo _small ).log"
        compute-sanitizer --tool $tool --error-exitcode 9 python3 dev/sanitize_sweep.py "$@" > "$log" 2>&1
        echo "compute-sanitizer --tool $tool $*: exit $?"; tail -3 "$log"
      done ;;
    decode)
      python3 -m qgemv.eval.bench_decode --out "$OUT/bench_decode" ${DECODE_ARGS:-} 2>&1 | grep -v -i warn \
        | tee "$OUT/decode.log" | tail -40 ;;
    lab)
      VARIANTS="new=csrc:" OUT="$OUT" bash dev/lab_ab.sh 2>&1 | tail -100 ;;
    chain)
      for m in ${CHAIN_MODELS:-llama3-8b qwen2.5-7b llama3-70b}; do
        PYTHONPATH=".peers${PYTHONPATH:+:$PYTHONPATH}" python3 -m qgemv.eval.bench_chain --model "$m" \
          --out "$OUT/chain_$m" 2>&1 | grep -v -i warn | tail -60
      done ;;
    labchain)
      # the kernel lab's chain mode (dev/gemv_lab.cu --chain), every model; LABCHAIN_ARGS adds flags
      nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc dev/gemv_lab.cu csrc/gemv_int4.cu csrc/gemv_int8.cu csrc/runtime.cpp \
        -o /tmp/lab_chain || exit 1
      for m in ${CHAIN_MODELS:-llama3-8b qwen2.5-7b llama3-70b}; do
        /tmp/lab_chain --chain "$m" ${LABCHAIN_ARGS:-} 2>&1 | tee -a "$OUT/labchain.txt"
      done ;;
    gptqab)
      # GPTQ's column solve, the committed version against GPTQ_OLD (a saved earlier calibration/gptq.py)
      python3 dev/bench_gptq_step.py "${GPTQ_OLD:-.peers/gptq_old.py}" --act-order 2>&1 | grep -v -i warn \
        | tee "$OUT/gptqab.txt" ;;
    genact)
      # the engine on act-order int4 g128a (gathers in the norm glue, or separate) against plain int4 g128a
      python3 -m qgemv.eval.bench_generate --models llama2-7b --batches 1 --no-hf --no-breakdown \
        --variants int4g128a,int4g128a_act,int4g128a_act_first,int4g128a_act_sep ${GENACT_ARGS:-} --out "$OUT/genact" 2>&1 \
        | grep -v -i warn | tail -20 ;;
    import)
      python3 -m qgemv.eval.bench_import --out "$OUT/bench_import" 2>&1 | grep -v -i warn ;;
    glue)
      # the engine's norm glue with an act-order gather: gathered after the norm or before it
      timeout 200 python3 dev/glue_gather_probe.py 2>&1 | grep -v -i warn | tee "$OUT/glue.txt" ;;
    persist)
      # issue 35's lab: probes, then the persistent chain against per-op GEMVs (PERSIST_ARGS adds flags)
      # the four sources compile in parallel (about 40 s instead of 2 min)
      mkdir -p /tmp/persist_obj
      for f in dev/persist_lab.cu csrc/gemv_int4.cu csrc/gemv_int8.cu csrc/runtime.cpp; do
        nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc -c "$f" \
          -o "/tmp/persist_obj/$(basename "$f").o" > "/tmp/persist_obj/$(basename "$f").log" 2>&1 &
      done
      wait
      nvcc -gencode=arch=compute_90a,code=sm_90a /tmp/persist_obj/*.o -o /tmp/persist_lab \
        || { cat /tmp/persist_obj/*.log | tail -40; exit 1; }
      timeout 400 /tmp/persist_lab ${PERSIST_ARGS:-} 2>&1 | tee "$OUT/persist.txt" ;;
    decomp)
      # issue 35: the chain's parts taken away one at a time (dev/PERSISTENT.md's table; skip 4 no math, 1 no
      # waits, 2 no hand-offs, 8 weights from L2, 16 no copies past the ring's first fill: the tile math's own
      # rate), then each warp's ring depth (--stages); after the persist step, which builds the lab
      # (PERSIST_ARGS=--probe-only NO_EXT=1 bash dev/device_run.sh persist decomp)
      for m in ${DECOMP_MODELS:-llama2-7b llama3-8b llama3-70b}; do
        timeout 150 /tmp/persist_lab --no-probe --norm --model $m --formats int4g128a --skip 0,4,1,5,2,6,8,9,11,16,18,22,0 \
          > "$OUT/decomp_$m.txt" 2>&1
        grep -E "persist w|failures" "$OUT/decomp_$m.txt"
        timeout 150 /tmp/persist_lab --no-probe --norm --model $m --formats int4g128a --stages ${DECOMP_STAGES:-4,6,8,10,8} \
          2>&1 | grep -E "persist w|does not run"
      done ;;
    slices)
      # issue 35, M > 1's "k-slices in time" priced at M = 1: n block barriers inside every op at even shares of
      # each warp's run (skip 64 + (n << 16); results stay right and are checked), n = 4 / 8 / 14 against none,
      # two rounds; after the persist step (PERSIST_ARGS=--probe-only NO_EXT=1 bash dev/device_run.sh persist slices)
      for m in ${SLICES_MODELS:-llama2-7b llama3-8b}; do
        timeout 200 /tmp/persist_lab --no-probe --norm --model $m --formats int4g128a,int4 \
          --skip 0,$((64 + (4 << 16))),$((64 + (8 << 16))),$((64 + (14 << 16))),0,$((64 + (4 << 16))),$((64 + (8 << 16))),$((64 + (14 << 16))) \
          2>&1 | grep -E "persist w|failures" | sed "s/^/$m /"
      done ;;
    oplayout)
      # the int4 slowdown of 2026-12-05: the lab's chain with 128-byte op records (main), 112 (tpp and perm in
      # unused GemvParams fields) and 256 (padded), built in parallel, run alternately (two rounds)
      mkdir -p /tmp/opl
      for f in csrc/gemv_int4.cu csrc/gemv_int8.cu csrc/runtime.cpp; do
        nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc -c "$f" -o "/tmp/opl/$(basename "$f").o" &
      done
      for v in "b128:" "b112:-DQGEMV_CHAIN_OP112" "b256:-DQGEMV_CHAIN_OP_PAD=128"; do
        nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc ${v#*:} -c dev/persist_lab.cu \
          -o "/tmp/opl/lab_${v%%:*}.o" &
      done
      wait
      for v in b128 b112 b256; do
        nvcc -gencode=arch=compute_90a,code=sm_90a /tmp/opl/lab_$v.o /tmp/opl/gemv_int4.cu.o /tmp/opl/gemv_int8.cu.o \
          /tmp/opl/runtime.cpp.o -o /tmp/opl/$v || exit 1
      done
      for round in 1 2; do
        for v in b128 b112 b256; do
          echo "== $v round $round"
          timeout 90 /tmp/opl/$v --no-probe --model llama3-8b --layers 16 --formats ${OPL_FORMATS:-int4g128a,int4} --warps 16 \
            --stages 8 2>&1 | grep -E "^(int4|int8)|FAIL|fail|match" | grep -vE "skew|per layer|SM map|blocks |time|reference" | head -8
        done
      done 2>&1 | tee "$OUT/oplayout.txt" ;;
    stage2)
      # issue 35's queue in one call (dev/PERSISTENT.md "Next device calls"): the persistent
      # kernel's and the engine's megakernel tests, memcheck on the decode chain, bench_chain with and
      # without norms; STAGE2_GEN=1 adds the engine with and without the launch (bench_generate, up to 7 min:
      # beyond one call's 10 with the rest)
      OMP_NUM_THREADS=2 timeout 300 python3 -m pytest -n 16 -v -rs -p no:cacheprovider tests/test_persist.py \
        tests/test_engine.py -k "persist or megakernel or Persist" > "$OUT/stage2_tests.log" 2>&1
      echo "stage2 tests: exit $?, $(grep -c ' PASSED ' "$OUT/stage2_tests.log") passed"
      grep -E ' (FAILED|ERROR) ' "$OUT/stage2_tests.log" | sort -u | head -20
      PV=int4_deps,int4_persist,int4g128_deps,int4g128_persist,int4g128a_deps,int4g128a_persist,int8_deps,int8_persist,fp16_deps,fp16_persist
      for extra in "" "--norms"; do
        timeout 150 python3 -m qgemv.eval.bench_chain --model llama3-8b --ms 1 --variants "$PV" $extra \
          --out "$OUT/stage2_chain${extra:+_norms}" 2>&1 | grep -v -i warn | tail -12
      done
      # memcheck: the decode chain on one format of each kind, and act-order (every test under it: too slow)
      MK="(decode_chain_matches and (int4g128a or int8 or fp16 or int4g32a)) or (act_order and int4g128a)"
      timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_persist.py -k "$MK" > "$OUT/stage2_memcheck.log" 2>&1
      echo "memcheck (test_persist -k '$MK'): exit $?"; tail -3 "$OUT/stage2_memcheck.log"
      # racecheck: the GQA 5 decode chain (a warp without a query head; contexts of 5 chunks; the race of 2026-12-05)
      timeout 240 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_persist.py -k "decode_chain_matches and fp16 and cfg6" > "$OUT/stage2_racecheck.log" 2>&1
      echo "racecheck (GQA 5 decode chain): exit $?"; tail -3 "$OUT/stage2_racecheck.log"
      timeout 150 python3 dev/attn_probe.py 2>&1 | grep -v -i warn | tee "$OUT/stage2_attn_probe.txt"
      if [ "${STAGE2_GEN:-0}" != 0 ]; then
        timeout 420 python3 -m qgemv.eval.bench_generate --models llama2-7b,llama3-8b --batches 1 --no-hf \
          --variants int4g128a,int4g128a_mk,int4,int4_mk,int8,int8_mk,fp16,fp16_mk --out "$OUT/stage2_generate" 2>&1 | grep -v -i warn | tail -30
      fi ;;
    attn)
      # the launch's attention alone: its decode tests, memcheck on them, the probe for both models
      OMP_NUM_THREADS=2 timeout 240 python3 -m pytest -n 16 -v -rs -p no:cacheprovider tests/test_persist.py \
        tests/test_engine.py -k "persist or megakernel or Persist" > "$OUT/attn_tests.log" 2>&1
      echo "attn tests: exit $?, $(grep -c ' PASSED ' "$OUT/attn_tests.log") passed"
      grep -E ' (FAILED|ERROR) ' "$OUT/attn_tests.log" | sort -u | head -20
      grep -E '^E  ' "$OUT/attn_tests.log" | head -20
      timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_persist.py -k "decode_chain_matches and (int4g128a or fp16 or int4g32a)" > "$OUT/attn_memcheck.log" 2>&1
      echo "memcheck (decode chains): exit $?"; grep -E "Invalid|FAILED|^E  " "$OUT/attn_memcheck.log" | head -12
      tail -3 "$OUT/attn_memcheck.log"
      timeout 150 python3 dev/attn_probe.py 2>&1 | grep -v -i warn | tee "$OUT/attn_probe.txt"
      timeout 100 python3 dev/attn_probe.py --model llama2-7b --cases 640:4,640:4:4,640:4:2,2048:4,2048:4:4 2>&1 \
        | grep -v -i warn | tee -a "$OUT/attn_probe.txt" ;;
    attnncu)
      # ncu on one launch of the chain with attention at a context of 4096 (Llama-3-8B, 256 positions a unit)
      # beside one at a context of 1: where the ~1.6 us a 32-position chunk goes (warp states, top stall sites)
      for ctx in 4096 1; do
        timeout 200 ncu --kernel-name regex:chain --launch-skip 1 --launch-count 1 --section WarpStateStats \
          --section SchedulerStats --section InstructionStats --section SourceCounters --section SpeedOfLight \
          python3 dev/attn_probe.py --no-base --cases "$ctx:16:8" > "$OUT/attn_ncu_$ctx.txt" 2>&1
        echo "== context $ctx: ncu exit $?"
        grep -E "Duration|Executed Instructions |Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Stall|Location|^\s+[0-9a-f]{4,}" \
          "$OUT/attn_ncu_$ctx.txt" | head -40
      done ;;
    attnstages)
      # attention's cost a position at ring depths 4 / 6 / 8: if it falls with fewer weight bytes in flight
      # beside the K / V reads (the rings refill during attention), the two contend for HBM
      timeout 200 python3 dev/attn_probe.py --stages 4,6,8 --cases 1:16,768:16,4096:16 2>&1 | grep -v -i warn \
        | tee "$OUT/attn_stages.txt"
      timeout 120 python3 dev/attn_probe.py --model llama2-7b --stages 4,8 --cases 1:4,640:4,2048:4 2>&1 \
        | grep -v -i warn | tee -a "$OUT/attn_stages.txt" ;;
    diag)
      # where the engine's persistent launch and its per-op path part, six small shapes (dev/mk_diag.py)
      timeout 200 python3 dev/mk_diag.py 2>&1 | grep -v -i warn | tee "$OUT/mk_diag.txt" ;;
    bf16)
      # bf16 activations in the launch (built 2026-12-05 without a GPU; dev/PERSISTENT.md): its tests (the errors
      # they measure are in the log), memcheck on a bf16 decode chain of each kind, then the engine in bf16 with
      # and without the launch beside fp16's (Llama-3-8B)
      OMP_NUM_THREADS=2 timeout 300 python3 -m pytest -n 16 -v -rs -p no:cacheprovider tests/test_persist.py \
        tests/test_engine.py -k "bfloat16 or bf16" > "$OUT/bf16_tests.log" 2>&1
      echo "bf16 tests: exit $?, $(grep -c ' PASSED ' "$OUT/bf16_tests.log") passed"
      grep -E ' (FAILED|ERROR) ' "$OUT/bf16_tests.log" | sort -u | head -20
      grep -E "^E +(AssertionError|assert)" "$OUT/bf16_tests.log" | sort | uniq -c | sort -rn | head -12
      timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_persist.py -k "decode_chain_matches and bfloat16 and (int4g128a or int8 or bf16) and cfg6" \
        > "$OUT/bf16_memcheck.log" 2>&1
      echo "memcheck (bf16 decode chains): exit $?"; tail -3 "$OUT/bf16_memcheck.log"
      # the staging's cost: the stage-1 chain with norms, fp16 against bf16 activations, in one run
      timeout 150 python3 -m qgemv.eval.bench_chain --model llama3-8b --layers 16 --ms 1 --norms \
        --variants int4g128a_deps,int4g128a_persist,int4g128a_bf16_deps,int4g128a_bf16_persist \
        --out "$OUT/bf16_chain" 2>&1 | grep -v -i warn | tail -5
      if [ "${BF16_GEN:-1}" != 0 ]; then  # the engine, with each row's kernel breakdown (the launch's share)
        timeout 360 python3 -m qgemv.eval.bench_generate --models llama3-8b --batches 1 --no-hf \
          --variants int4g128a_mk,int4g128a_bf16,int4g128a_bf16_mk,bf16_mk --out "$OUT/bf16_generate" 2>&1 \
          | grep -v -i warn | tail -8
      fi ;;
    gen70)
      # issue 35's 70B row: Llama-3-70B shapes built quantized a layer at a time (bench_generate's build_streamed),
      # int4 g128 + zeros, per-op and the launch (whose weight copy needs an H200: on an H100 it falls back)
      timeout "${GEN_LIMIT:-540}" python3 -m qgemv.eval.bench_generate --models llama3-70b --batches 1 --no-hf \
        --no-breakdown --variants "${GEN_VARIANTS:-int4g128a,int4g128a_mk}" --out "$OUT/generate70" 2>&1 \
        | grep -v -i warn | tail -8 ;;
    gen)
      # the engine with and without the persistent launch, batch 1 (GEN_MODELS, GEN_VARIANTS override)
      timeout "${GEN_LIMIT:-420}" python3 -m qgemv.eval.bench_generate --models "${GEN_MODELS:-llama2-7b,llama3-8b}" --batches 1 \
        --no-hf --no-breakdown --variants "${GEN_VARIANTS:-int4g128a,int4g128a_mk,int4,int4_mk,int8,int8_mk,fp16,fp16_mk}" \
        --out "$OUT/generate" 2>&1 | grep -v -i warn | tail -30 ;;
    b16)
      # issue 35's batch-16 row: the per-op step with qgemv.ops.decode_attention against the SDPA step (variant
      # int4g128a_sdpa), then one layer's attention in CUDA graphs with forced split counts (dev/decode_attn_probe.py)
      timeout "${GEN_LIMIT:-400}" python3 -m qgemv.eval.bench_generate --models "${GEN_MODELS:-llama2-7b,llama3-8b}" \
        --batches 16 --no-hf --no-breakdown --variants int4g128a,int4g128a_sdpa,int4g128a,int4g128a_sdpa \
        --out "$OUT/generate16" 2>&1 | grep -v -i warn | grep "b=16"
      timeout 150 python3 dev/decode_attn_probe.py --splits 1,2,3,4,6 2>&1 | grep -v -i warn | tee "$OUT/decode_attn.txt" ;;
    m16)
      # batch 16's GEMVs: the per-op GEMV at M = 1 / 16 and the tiled GEMM forced at 17 on the models' decode
      # shapes (dev/m16_probe.py), then ncu's bytes of the M = 16 GEMV (DRAM, L2 -> L1, L1 hit rate) on Llama-2-7B's
      timeout 200 python3 dev/m16_probe.py --model llama2-7b --tiled --variants "${M16_VARIANTS:-int4g128a,int4,int8}" 2>&1 \
        | grep -v -i warn | tee "$OUT/m16.txt"
      [ -n "${M16_L3-1}" ] && timeout 120 python3 dev/m16_probe.py --model llama3-8b --tiled --variants int4g128a 2>&1 \
        | grep -v -i warn | tee -a "$OUT/m16.txt"
      [ -n "${M16_NCU-1}" ] && for nk in 12288:4096 4096:4096 22016:4096 4096:11008; do  # M16_NCU= skips ncu
        timeout 60 ncu --kernel-name regex:gemv_mma --launch-skip 2 --launch-count 1 --metrics \
gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__t_sector_hit_rate.pct,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,\
launch__registers_per_thread,launch__grid_size,launch__block_size \
          python3 dev/profile_one.py --variant int4g128a --n ${nk%:*} --k ${nk#*:} --m 16 > "$OUT/ncu_m16_$nk.txt" 2>&1
        echo "== $nk"; grep -E "^\s+(gpu__|dram__|lts__|l1tex__|sm__|smsp__|launch__)" "$OUT/ncu_m16_$nk.txt"
      done ;;
    e16)
      # batch 16 in the engine: decode_attention with 3 / 4 K / V tiles a block forced (int4g128a_da3 / _da4; the
      # rule picks one) and the glue's rotation and cache write before it (int4g128a_norope) against today's step
      timeout "${GEN_LIMIT:-300}" python3 -m qgemv.eval.bench_generate --models "${GEN_MODELS:-llama2-7b,llama3-8b}" --batches 16 \
        --no-hf --no-breakdown --variants "${E16_VARIANTS:-int4g128a,int4g128a_da3,int4g128a_da4,int4g128a_norope,int4g128a,int4g128a_da3,int4g128a_da4,int4g128a_norope}" \
        --out "$OUT/generate_e16" 2>&1 | grep -v -i warn | grep "b=16" ;;
    pdl16)
      # the per-op step's launch modes, two rounds: Engine.pdl's default (the GEMVs, decode_attention and the
      # compiled glue as programmatic launches) against ordinary launches (_nopdl), the glue's alone (_pdlg) and
      # our kernels at set_gemv_pdl mode 5 (_pdl5)
      timeout "${GEN_LIMIT:-300}" python3 -m qgemv.eval.bench_generate --models "${GEN_MODELS:-llama2-7b,llama3-8b}" \
        --batches ${PDL_BATCHES:-1,16} --no-hf --no-breakdown \
        --variants int4g128a,int4g128a_nopdl,int4g128a_pdlg,int4g128a_pdl5,int4g128a,int4g128a_nopdl,int4g128a_pdlg,int4g128a_pdl5 \
        --out "$OUT/generate_pdl" 2>&1 | grep -v -i warn | grep "b=" ;;
    octets)
      # the launch's attention by the rule (octets of lanes a cache position where a kv head has 4 query heads or
      # more and a unit 128 positions or more; 2026-12-07) against a warp a position everywhere (form 0), the engine
      # at batch 1 at a ~4000-token context (prompt 3832, 248 new: Llama-3-8B's max_seq 4096; its units of ~250
      # positions take octets), two rounds (its tests: DECODE_CFGS="cfg2 or cfg11 or cfg12" dchecks)
      timeout "${GEN_LIMIT:-200}" python3 -m qgemv.eval.bench_generate --models "${GEN_MODELS:-llama3-8b}" \
        --prompt 3832 --gen 248 --batches 1 --no-hf --no-breakdown \
        --variants int4g128a_mk_f0,int4g128a_mk,int4g128a_mk_f0,int4g128a_mk \
        --out "$OUT/generate_oct" 2>&1 | grep -v -i warn | grep "b=" ;;
    dchecks)
      # the launch's decode tests (test_persist, test_engine's launch tests), then racecheck and memcheck on the
      # decode chains DECODE_CFGS (default: cfg14 GQA 7 under the octet rule, cfg15 / cfg16 the attention's L2
      # prefetch forced before / after the units); racecheck also flags the reference's cuBLAS kernels (nvjet)
      cfgs=${DECODE_CFGS:-cfg14 or cfg15 or cfg16}
      OMP_NUM_THREADS=2 timeout 200 python3 -m pytest -n 16 -q -p no:cacheprovider tests/test_persist.py \
        tests/test_engine.py -k "persist or megakernel or Persist or plan or form or prefetch" > "$OUT/dchecks.log" 2>&1
      echo "tests: exit $?"; grep -E "passed|failed" "$OUT/dchecks.log" | tail -1
      grep -E "^(FAILED|ERROR)" "$OUT/dchecks.log" | head -10
      timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_persist.py -k "decode_chain_matches and fp16 and ($cfgs)" > "$OUT/dchecks_race.log" 2>&1
      echo "racecheck: exit $?"; grep -E "Race reported between" "$OUT/dchecks_race.log" | sort | uniq -c | head -5
      tail -1 "$OUT/dchecks_race.log"
      timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
        tests/test_persist.py -k "decode_chain_matches and int4g128a and ($cfgs)" > "$OUT/dchecks_mem.log" 2>&1
      echo "memcheck: exit $?"; tail -1 "$OUT/dchecks_mem.log" ;;
    patchab)
      # the engine against the tree before a patch: AB_PATCH (a unified diff from the repository root, already
      # applied here) is reversed in a copy of the tree (its build directory too, so only what the patch touched
      # recompiles), then bench_generate runs AB_VARIANTS on AB_MODELS from each tree in turn, two rounds each
      # (python -m takes the package from the working directory)
      # (a second patchab on the same machine with the same patch reuses the base: AB_ARGS may change between them;
      # AB_TAG prefixes its files)
      [ -f "${AB_PATCH:-}" ] || { echo "patchab: AB_PATCH must name a patch file, got '${AB_PATCH:-}'"; exit 2; }
      sum=$(sha1sum < "$AB_PATCH")
      if [ "$(cat /tmp/ab_base/.ab_patch 2>/dev/null)" != "$sum" ]; then
        rm -rf /tmp/ab_base && mkdir /tmp/ab_base && cp -a . /tmp/ab_base/ && rm -rf /tmp/ab_base/runs || exit 1
        (cd /tmp/ab_base && patch -s -R -p1 < "$OLDPWD/$AB_PATCH" && python3 setup.py build_ext --inplace \
          > "$OUT/ab_base_build.log" 2>&1) || { echo "patchab: the base tree did not build"; tail -20 "$OUT/ab_base_build.log"; exit 1; }
        echo "$sum" > /tmp/ab_base/.ab_patch
      fi
      out=$(cd "$OUT" && pwd)
      for round in 1 2; do
        for side in new base; do
          dir=.; [ "$side" = base ] && dir=/tmp/ab_base
          (cd "$dir" && timeout "${GEN_LIMIT:-200}" python3 -m qgemv.eval.bench_generate --models "${AB_MODELS:-llama2-7b}" \
            --batches 1 --no-hf --no-breakdown --variants "${AB_VARIANTS:-int4g128a_mk}" ${AB_ARGS:-} \
            --out "$out/ab_${AB_TAG:-}${side}_$round" 2>&1 | grep -v -i warn | grep "b=" | sed "s/^/$side $round /")
        done
      done ;;
    pfgen)
      # the attention's L2 prefetch (testing.set_chain_attention_prefetch): the probe (Llama-2-7B at 640 / 2048,
      # Llama-3-8B at 768; PF tiles a warp forced, > 0 before the block's units, < 0 after), then the engine at batch
      # 1 (prompt 512, 256 new; _mk_p0 none, _mk the rule), two rounds (against an earlier tree: patchab)
      timeout 150 python3 dev/attn_probe.py --model llama2-7b --cases \
        ${PF_CASES:-640:4:2:-1:0,640:4:2:-1:8,640:4:2:-1:16,640:4:2:-1:32,640:4:2:-1:-8,640:4:2:-1:-16,640:4:2:-1:-32,640:4:2:-1:0,2048:4:2:-1:0,2048:4:2:-1:16,2048:4:2:-1:-16} \
        2>&1 | grep -v -i warn | tee "$OUT/pf_probe.txt"
      timeout 100 python3 dev/attn_probe.py --cases 768:16:2:-1:0,768:16:2:-1:16,768:16:2:-1:-16,768:16:2:-1:0 2>&1 \
        | grep -v -i warn | tee -a "$OUT/pf_probe.txt"
      timeout "${GEN_LIMIT:-240}" python3 -m qgemv.eval.bench_generate --models "${GEN_MODELS:-llama2-7b}" --batches 1 \
        --no-hf --no-breakdown --variants "${PF_VARIANTS:-int4g128a_mk_p0,int4g128a_mk_p16,int4g128a_mk_pm16,int4g128a_mk_p0,int4g128a_mk_p16,int4g128a_mk_pm16}" \
        --out "$OUT/generate_pf" 2>&1 | grep -v -i warn | grep "b=" ;;
    da)
      # decode_attention's stage counts: one layer's call with 2 (today), 3 and 4 K / V tiles a block at the
      # chosen and forced split counts, outputs compared bit for bit (dev/decode_attn_probe.py --stages)
      timeout 150 python3 dev/decode_attn_probe.py --splits 1,2,3 --stages 3,4 2>&1 | grep -v -i warn \
        | tee "$OUT/decode_attn_stages.txt" ;;
    tpbench)
      # issue 36: the tensor-parallel shards of Llama-3-8B / 70B (TP 2 / 4 / 8) against fp16 cuBLAS
      python3 -m qgemv.eval.bench_gemv --tp-shapes --no-extras --ms ${TP_MS:-1,4,16} --out "$OUT/bench_tp" 2>&1 \
        | grep -v -i warn | tail -60 ;;
    linears)
      # the kernel lab's chain, one linear at a time (llama3-8b, M = 1 and 16)
      nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc dev/gemv_lab.cu csrc/gemv_int4.cu csrc/gemv_int8.cu csrc/runtime.cpp \
        -o /tmp/lab_chain || exit 1
      for i in 0 1 2 3; do
        timeout 60 /tmp/lab_chain --chain llama3-8b --chain-linears $i ${LABCHAIN_ARGS:-} 2>&1 | tee -a "$OUT/linears.txt"
      done ;;
    overlap)
      # prefill by dequantize + cuBLAS in row slices on two streams (issue 24 part 3; an experiment)
      python3 dev/prefill_overlap.py ${OVERLAP_ARGS:-} --out "$OUT/prefill_overlap" 2>&1 | grep -v -i warn \
        | tee "$OUT/prefill_overlap.txt" ;;
  esac
done
echo "total: $(( $(date +%s) - start )) s"
