#!/usr/bin/env bash
# The weight gradients on their own stream (ExpertShape::overlap_weight_grads): gpu-check on the
# prebuilt binaries (with the new bitwise serial-vs-overlapped test), then scripts/bench --all
# (moe_bench, whose bwd_ser / bwd_ovl columns are the A/B, + torch_moe_reference.py in the same
# call, every series started at or below 50 C).
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ovx/ov.tar.xz
C=.carry/ov
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 200 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 3 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20; stamp gpu-check done | tee -a "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 370 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|qwen|mixtral|deepseek|scale)" | cut -c1-150
tail -n 3 "$OUT/bench.log"
