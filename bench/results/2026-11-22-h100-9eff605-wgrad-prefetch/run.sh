#!/usr/bin/env bash
# Index entries two slabs ahead in the weight-gradient kernel: gpu-check over the new kernels,
# the weight-gradient bench (base = 7529f6b's kernels, pf = these) alternated, then scripts/bench
# (moe_bench over these kernels + torch, every series started at or below 50 C).
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/wpx/wp.tar.xz
B=.carry/wp
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
timeout 280 scripts/gpu-check --prebuilt $B > $OUT/gpu-check.log 2>&1; echo "gpu-check rc=$?"
tail -n 1 $OUT/gpu-check.log; grep -E "^FAIL|FAILED" $OUT/gpu-check.log | head -10
export LD_LIBRARY_PATH=$PWD/$B/lib
for p in sonic-7b olmoe qwen3-a3b scale-8k sonic-7b olmoe qwen3-a3b scale-8k; do
  for v in base pf; do
    WGRAD_ONLY=none timeout 100 $B/sm90_weight_grad_bench_$v $p 2>/dev/null | sed "s/^/wg $v /" >> $OUT/wg.txt
  done
done
grep -c MISMATCH $OUT/wg.txt
MOE_COMMIT=$(cat $B/COMMIT) PYTHONUNBUFFERED=1 timeout 300 scripts/bench --bin $B/moe_bench \
  --torch $B/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 \
  sonic-7b qwen3-a3b scale-8k olmoe > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -v "^{" "$OUT/bench.log" | grep -E "^sonic|^qwen|^scale|^olmoe|^# cuBLAS"
rm -f $OUT/torch_gpu.csv $OUT/torch_marks.txt
