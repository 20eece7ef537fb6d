#!/usr/bin/env bash
# The sixth session's main run: gpu-check on the prebuilt binaries, then scripts/bench --all
# (moe_bench + torch_moe_reference.py, the GPU's clocks recorded on both sides, every series
# started at or below 50 C), then the recompute mode where the fused backward runs.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/mainx/main.tar.xz
C=.carry/main
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 230 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 3 "$OUT/gpu-check.log"; grep -E "FAILED|error" "$OUT/gpu-check.log" | head -20; stamp gpu-check done
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 330 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
{ stamp recompute; timeout 90 $C/moe_bench --preset sonic-7b qwen3-a3b scale-8k --recompute --json "$OUT/recompute.jsonl"; echo "recompute rc=$?"; } > "$OUT/recompute.log" 2>&1
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | tail -n 32
