#!/usr/bin/env bash
# One device call: gpu-check on the prebuilt binaries, then scripts/bench --all (moe_bench with
# every backward path + torch_moe_reference.py in the same call), then the recompute mode on the
# presets where the fused backward runs. Logs to $OUT.
set -uo pipefail
C=.carry/L13
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 230 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 3 "$OUT/gpu-check.log"; grep -E "FAILED|error" "$OUT/gpu-check.log" | head -20; stamp gpu-check done
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 330 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
{ stamp recompute; timeout 90 $C/moe_bench --preset sonic-7b qwen3-a3b scale-8k --recompute --json "$OUT/recompute.jsonl"; echo "recompute rc=$?"; } > "$OUT/recompute.log" 2>&1
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | tail -n 40
