#!/usr/bin/env bash
# The eleventh session's third call: the gathered rows asked of L2 ahead of their cp.async
# (kGatherPrefetchSteps in kernels/cuda/sm90_grouped_gemm.cuh), built three ways (off, 4 and 8
# steps ahead), each kernel bench run for every build in turn, twice, on top-K routing and on
# balanced routing without locality (MOE_BENCH_ROUTING=balanced-random); torch_moe_reference.py
# on the same presets in the same call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/kpx/kp.tar.xz
K=.carry/kp
export LD_LIBRARY_PATH=$PWD/$K/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $K/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } 2>&1 | tee "$OUT/run.log"
for R in topk balanced-random; do
  export MOE_BENCH_ROUTING=$R
  for round in 1 2; do
    for P in 0 4 8; do
      f="$OUT/kernels_$R.jsonl"
      tag="{\"round\": $round, \"prefetch\": $P, \"routing\": \"$R\"}"
      echo "$tag" >> "$f"
      timeout 100 $K/p$P/sm90_bench --json "$f" sonic-7b scale-8k olmoe > /dev/null 2>> "$OUT/run.log"; echo "$R $round p$P fwd rc=$?" >> "$OUT/run.log"
      for p in sonic-7b scale-8k olmoe; do timeout 60 $K/p$P/sm90_backward_bench $p >> "$f" 2>> "$OUT/run.log"; echo "$R $round p$P bwd $p rc=$?" >> "$OUT/run.log"; done
      WGRAD_ONLY=none timeout 100 $K/p$P/sm90_weight_grad_bench sonic-7b scale-8k olmoe >> "$f" 2>> "$OUT/run.log"; echo "$R $round p$P wgrad rc=$?" >> "$OUT/run.log"
    done
    stamp $R round $round done >> "$OUT/run.log"
  done
done
unset MOE_BENCH_ROUTING
PYTHONUNBUFFERED=1 timeout 120 python3 $K/torch_moe_reference.py --preset sonic-7b olmoe scale-8k --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" >> "$OUT/run.log"
stamp all done >> "$OUT/run.log"
grep -v " rc=0$" "$OUT/run.log" | cut -c1-200
python3 bench/results/2026-11-22-h100-gather-prefetch/summarize.py "$OUT"/kernels_*.jsonl
tail -n 3 "$OUT/torch.log"
