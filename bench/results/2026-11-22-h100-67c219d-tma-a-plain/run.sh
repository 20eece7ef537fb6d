#!/usr/bin/env bash
# TMA for a slot-order A in the plain kernel too: gpu-check over the new kernels, the row-shifted
# builds (must fail, ws=0 and ws=1), the kernel benches (base = 7529f6b's kernels, tp = these)
# alternated, then scripts/bench (moe_bench over these kernels + torch, every series started at
# or below 50 C) on the same presets.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/tpx/tp.tar.xz
B=.carry/tp
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
timeout 280 scripts/gpu-check --prebuilt $B > $OUT/gpu-check.log 2>&1; echo "gpu-check rc=$?"
tail -n 1 $OUT/gpu-check.log; grep -E "^FAIL|FAILED" $OUT/gpu-check.log | head -10
export LD_LIBRARY_PATH=$PWD/$B/lib
for t in forward backward; do
  timeout 200 $B/sm90_expert_${t}_test_rowshift > $OUT/${t}_rowshift.log 2>&1
  echo "$t rowshift rc=$? (want 1): FAIL ws=1 $(grep ^FAIL $OUT/${t}_rowshift.log | grep -c 'ws=1'), FAIL ws=0 $(grep ^FAIL $OUT/${t}_rowshift.log | grep -c 'ws=0'), PASS $(grep -c ^PASS $OUT/${t}_rowshift.log)"
done
for p in sonic-7b qwen3-a3b scale-8k olmoe qwen3-a3b scale-8k; do
  for v in base tp; do
    timeout 100 $B/sm90_bench_$v $p 2>/dev/null | sed "s/^/fwd $v /" >> $OUT/fwd.txt
    timeout 100 $B/sm90_backward_bench_$v $p 2>/dev/null | sed "s/^/bwd $v /" >> $OUT/bwd.txt
  done
done
echo "bwd checks PASS $(grep -c '"check":"PASS"' $OUT/bwd.txt) FAIL $(grep -c '"check":"FAIL"' $OUT/bwd.txt)"
MOE_COMMIT=$(cat $B/COMMIT) PYTHONUNBUFFERED=1 timeout 300 scripts/bench --bin $B/moe_bench \
  --torch $B/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 \
  sonic-7b qwen3-a3b scale-8k olmoe > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v "^{" "$OUT/bench.log" | grep -E "^sonic|^qwen|^scale|^olmoe|^# cuBLAS"
