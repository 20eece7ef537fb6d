#!/usr/bin/env bash
# One device call (engineer J, final GPU check): gpu-check, moe_bench keep-H and recompute on
# four presets, torch reference, largest-T searches. Each step time-boxed; logs to $OUT.
set -uo pipefail
C=.carry/j
export LD_LIBRARY_PATH=$PWD/$C/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/keep.log"
timeout 170 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; stamp gpu-check done
P="sonic-7b olmoe scale-128k scale-2m"
timeout 90 $C/moe_bench --preset $P --json "$OUT/keep.jsonl" >> "$OUT/keep.log" 2>&1; echo "rc=$?" >> "$OUT/keep.log"
stamp keep done
{ stamp recompute; timeout 90 $C/moe_bench --preset $P --recompute --json "$OUT/recompute.jsonl"; echo "rc=$?"; } > "$OUT/recompute.log" 2>&1
stamp recompute done
{ stamp torch; PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b olmoe scale-128k --json "$OUT/torch.jsonl"; echo "rc=$?"; } > "$OUT/torch.log" 2>&1
stamp torch done
{ stamp maxt-recompute; timeout 120 $C/moe_bench --max-t --recompute --max-t-seconds 90; echo "rc=$?";
  stamp maxt-keep; timeout 50 $C/moe_bench --max-t --max-t-seconds 30; echo "rc=$?"; stamp end; } > "$OUT/maxt.log" 2>&1
stamp all done
tail -n 4 "$OUT/maxt.log"
