#!/usr/bin/env bash
# The row-shifted TMA box must fail the ws checks on full tiles; then scripts/bench (moe_bench
# over 67c219d's kernels and torch_moe_reference.py, every series started at or below 50 C)
# on the presets that run the ws kernel's slot-order A (sonic-7b) and three that do not.
set -uo pipefail
C=.carry/te
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
for t in forward backward; do
  timeout 200 $C/sm90_expert_${t}_test_rowshift > $OUT/${t}_rowshift.log 2>&1
  echo "$t rowshift rc=$? (want 1): FAIL ws=1 $(grep ^FAIL $OUT/${t}_rowshift.log | grep -c 'ws=1'), FAIL ws=0 $(grep ^FAIL $OUT/${t}_rowshift.log | grep -c 'ws=0'), PASS $(grep -c ^PASS $OUT/${t}_rowshift.log)"
done
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 400 scripts/bench --bin $C/moe_bench \
  --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 \
  sonic-7b qwen3-a3b scale-8k olmoe > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v "^{" "$OUT/bench.log" | grep -E "^sonic|^qwen|^scale|^olmoe|^# cuBLAS|^\| (sonic|qwen|scale|olmoe)"
