#!/usr/bin/env bash
# TMA for the ws kernel's slot-order A: scripts/gpu-check over the new kernels, then the forward
# and backward kernel benches, base (7529f6b's kernels) and tma alternated, then torch.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/tmax/tma.tar.xz
B=.carry/tma
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
timeout 280 scripts/gpu-check --prebuilt $B > $OUT/gpu-check.log 2>&1; echo "gpu-check rc=$?"
tail -n 2 $OUT/gpu-check.log; grep -E "^FAIL|FAILED|error" $OUT/gpu-check.log | head -10
export LD_LIBRARY_PATH=$B/lib
for p in sonic-7b sonic-7b qwen3-a3b scale-8k olmoe; do
  for v in base tma; do
    timeout 100 $B/sm90_bench_$v $p 2>/dev/null | sed "s/^/fwd $v /" >> $OUT/fwd.txt
    timeout 100 $B/sm90_backward_bench_$v $p 2>/dev/null | sed "s/^/bwd $v /" >> $OUT/bwd.txt
  done
  echo "$p done $(date -u +%T)"
done
grep -c '"check":"PASS"' $OUT/bwd.txt; grep -c '"check":"FAIL"' $OUT/bwd.txt
PYTHONUNBUFFERED=1 timeout 150 python3 $B/torch_moe_reference.py --preset sonic-7b qwen3-a3b scale-8k olmoe --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
