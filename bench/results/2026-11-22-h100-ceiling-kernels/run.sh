#!/usr/bin/env bash
# The eleventh session's second call: each fused kernel on top-K and on balanced routing
# (MOE_BENCH_ROUTING=balanced, bench/sm90_bench_util.h) beside the cuBLAS ceiling's GEMMs of the
# first call, and the names of the kernels cuBLAS picks for those GEMMs (ncu), with
# torch_moe_reference.py on the same presets in the same call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/kbx/kb.tar.xz
K=.carry/kb
export LD_LIBRARY_PATH=$PWD/$K/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $K/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } 2>&1 | tee "$OUT/run.log"
timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:'gemm|xmma|cutlass|sm90' $K/moe_bench --preset sonic-7b olmoe scale-8k deepseek-v3 --ceiling --reps 1 --warmup 0 > "$OUT/ncu_ceiling.csv" 2>> "$OUT/run.log"; echo "ncu rc=$?" >> "$OUT/run.log"
stamp ncu done >> "$OUT/run.log"
for R in topk balanced; do
  export MOE_BENCH_ROUTING=$R
  f="$OUT/kernels_$R.jsonl"
  timeout 100 $K/sm90_bench --json "$f" sonic-7b scale-8k olmoe > /dev/null 2>> "$OUT/run.log"; echo "$R fwd rc=$?" >> "$OUT/run.log"
  for p in sonic-7b scale-8k olmoe; do timeout 60 $K/sm90_backward_bench $p >> "$f" 2>> "$OUT/run.log"; echo "$R bwd $p rc=$?" >> "$OUT/run.log"; done
  WGRAD_ONLY=none timeout 100 $K/sm90_weight_grad_bench sonic-7b scale-8k olmoe >> "$f" 2>> "$OUT/run.log"; echo "$R wgrad rc=$?" >> "$OUT/run.log"
  stamp $R done >> "$OUT/run.log"
done
unset MOE_BENCH_ROUTING
PYTHONUNBUFFERED=1 timeout 120 python3 $K/torch_moe_reference.py --preset sonic-7b olmoe scale-8k --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" >> "$OUT/run.log"
stamp all done >> "$OUT/run.log"
cat "$OUT/run.log" | cut -c1-200
grep -o '"Kernel Name","[^"]*"\|sm90_xmma[^"]*\|nvjet[^"]*\|cutlass[^"]*' "$OUT/ncu_ceiling.csv" | sort | uniq -c | head -40
wc -l "$OUT"/*.jsonl
tail -n 4 "$OUT/torch.log"
