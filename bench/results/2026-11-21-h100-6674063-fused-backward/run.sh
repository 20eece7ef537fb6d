#!/usr/bin/env bash
# One device call: gpu-check on the prebuilt binaries, then scripts/bench --all (moe_bench with
# both backward paths + torch_moe_reference.py in the same call). Logs to $OUT.
set -uo pipefail
C=.carry/L
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 230 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 3 "$OUT/gpu-check.log"; grep -E "FAILED|error" "$OUT/gpu-check.log" | head -20; stamp gpu-check done
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 330 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | tail -n 40
