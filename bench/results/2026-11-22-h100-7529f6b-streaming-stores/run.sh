#!/usr/bin/env bash
# The streaming-store experiment: each kernel bench over base and cs,
# alternated per preset, then torch_moe_reference.py on the same presets in the same call.
set -uo pipefail
B=.carry/cs
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
date -u
for p in sonic-7b olmoe sonic-7b olmoe qwen3-a3b scale-8k; do
  for v in base cs base cs; do
    timeout 100 $B/sm90_bench_$v $p 2>/dev/null | sed "s/^/fwd $v /" >> $OUT/fwd.txt
    timeout 100 $B/sm90_backward_bench_$v $p 2>/dev/null | sed "s/^/bwd $v /" >> $OUT/bwd.txt
    timeout 100 $B/sm90_weight_grad_bench_$v $p 2>/dev/null | sed "s/^/wg $v /" >> $OUT/wg.txt
  done
  echo "$p done $(date -u +%T)"
done
PYTHONUNBUFFERED=1 timeout 200 python3 $B/torch_moe_reference.py --preset sonic-7b olmoe qwen3-a3b scale-8k --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
