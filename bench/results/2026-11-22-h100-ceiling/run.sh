#!/usr/bin/env bash
# The eleventh session's first call: how far issue 5's targets are from what cuBLAS-grade GEMMs
# allow. moe_bench --ceiling (the six expert GEMMs as cuBLAS strided-batched GEMMs over balanced
# experts, plus both combines at copy bandwidth) on every preset; the service's paths on the same
# balanced routing (--routing balanced) where the targets are missed; then scripts/bench --all
# (the service's paths on top-K routing beside torch_moe_reference.py), every series of the last
# started at or below 50 C.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/clx/cl.tar.xz
C=.carry/cl
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } 2>&1 | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
{ timeout 170 $C/moe_bench --all --ceiling --json "$OUT/ceiling.jsonl"; echo "ceiling rc=$?"; stamp ceiling done; } > "$OUT/ceiling.log" 2>&1
{ timeout 120 $C/moe_bench --preset sonic-7b olmoe qwen3-a3b scale-8k deepseek-v3 --routing balanced --json "$OUT/balanced.jsonl"; echo "balanced rc=$?"; stamp balanced done; } >> "$OUT/ceiling.log" 2>&1
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 260 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -vE "^# (fwd_|bwd_|floors|GPU read)" "$OUT/ceiling.log" | cut -c1-200
true
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|qwen|mixtral|deepseek|scale)" | cut -c1-150
tail -n 2 "$OUT/bench.log"
