#!/usr/bin/env bash
# The seventh session's main run (code of 56ed2b1: the weight gradients on their own stream,
# the hybrid backward wherever h <= 4096 above the fused bound): gpu-check on the prebuilt
# binaries, then scripts/bench --all (moe_bench + torch_moe_reference.py, every series started
# at or below 50 C), then the recompute mode where the fused backward runs.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/fmx/fm.tar.xz
C=.carry/fm
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 200 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 3 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20; stamp gpu-check done | tee -a "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 330 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
{ stamp recompute; timeout 60 $C/moe_bench --preset sonic-7b qwen3-a3b scale-8k --recompute --json "$OUT/recompute.jsonl"; echo "recompute rc=$?"; } > "$OUT/recompute.log" 2>&1
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|qwen|mixtral|deepseek|scale)" | cut -c1-150
grep -E "^(sonic|qwen|scale)" "$OUT/recompute.log" | cut -c1-150; tail -n 2 "$OUT/recompute.log"
