#!/usr/bin/env bash
# The epilogue bound: each kernel bench over the kernels as they are (base) and over kernels
# whose GEMM epilogues store nothing (noepi), alternated, then torch_moe_reference.py on the
# same presets in the same call.
set -uo pipefail
B=.carry/ab
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
date -u
for p in sonic-7b olmoe sonic-7b olmoe qwen3-a3b scale-8k; do
  for v in base noepi; do
    timeout 100 $B/sm90_bench_$v $p 2>/dev/null | sed "s/^/fwd $v /" >> $OUT/fwd.txt
    timeout 100 $B/sm90_backward_bench_$v $p 2>/dev/null | sed "s/^/bwd $v /" >> $OUT/bwd.txt
    timeout 100 $B/sm90_weight_grad_bench_$v $p 2>/dev/null | sed "s/^/wg $v /" >> $OUT/wg.txt
    echo "$p $v done $(date -u +%T)"
  done
done
PYTHONUNBUFFERED=1 timeout 200 python3 $B/torch_moe_reference.py --preset sonic-7b olmoe qwen3-a3b scale-8k --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
