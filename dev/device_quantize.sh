#!/usr/bin/env bash
# Issue 25's runs on the lent GPU: random-weight checkpoints of real shapes
# (dev/make_random_checkpoint.py), quantized by `qgemv-quantize --stream`,
# timed end to end (loading and writing included), with the report's peaks.
#   bash dev/device_quantize.sh STEP...
#   steps: rtn7b gptq7b gptq7b8 gptq70b rtn8b
# Needs the extension built and qgemv installed; TOK=dir of SmolLM2's tokenizer
# files (default .tok); WORK=scratch dir (default /tmp/q25).  Logs and each
# run's quantize_report.json go to $OUT.
set -o pipefail
OUT=${OUT:-runs/device}
W=${WORK:-/tmp/q25}
TOK=${TOK:-.tok}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1

make_ckpt() {  # make_ckpt NAME SHAPE [ARGS]: a random checkpoint, once
  local name=$1 shape=$2; shift 2
  [ -f "$W/$name/config.json" ] || python3 dev/make_random_checkpoint.py "$shape" "$W/$name" --tokenizer "$TOK" "$@" \
    2>&1 | grep -v -i warn | tail -2 | tee -a "$OUT/make.log"
}

quant() {  # quant NAME SRC ARGS: qgemv-quantize --stream, wall time, the report
  local name=$1 src=$2; shift 2
  local t0=$(date +%s.%N)
  timeout "${QTIMEOUT:-420}" python3 -m qgemv.calibration.cli "$W/$src" --stream --device "${QDEVICE:-cuda}" \
    --out "$W/$name" --overwrite "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, wall $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s"
  tail -1 "$OUT/$name.log"
  cp "$W/$name/quantize_report.json" "$OUT/$name.report.json" 2>/dev/null
}

GPTQ="--method gptq --act-order --bits 4 --group-size 128 --asym --samples 128 --seq-len 2048 --forward-dtype bfloat16"
for step in "$@"; do
  case "$step" in
    rtn7b) make_ckpt l2 llama2-7b; quant rtn7b l2 --method rtn --bits 4 --group-size 128 --asym; rm -rf "$W/rtn7b" ;;
    gptq7b) make_ckpt l2 llama2-7b; quant gptq7b l2 $GPTQ; rm -rf "$W/gptq7b" ;;
    gptq7b8) make_ckpt l2x8 llama2-7b --layers 8; quant gptq7b8 l2x8 $GPTQ; rm -rf "$W/gptq7b8" "$W/l2x8" ;;
    gptq70b) rm -rf "$W/l2"; make_ckpt l70x2 llama3-70b --layers 2; quant gptq70b l70x2 $GPTQ; rm -rf "$W/gptq70b" ;;
    rtn8b) make_ckpt l3 llama3-8b; quant rtn8b l3 --method rtn --bits 4 --group-size 128 --asym; rm -rf "$W/rtn8b" "$W/l3" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
df -h "$W" | tail -1
