#!/usr/bin/env bash
# Device call 2 (lead): gpu-check at the commit in COMMIT (fused-dh path included), then the fused
# forward's tile sweep (plain vs warp-specialised) on the small-expert presets with the PyTorch
# reference on the same presets in the same call.
set -uo pipefail
C=.carry/L2
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/sweep.log"
timeout 230 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "^\[  FAILED|rc=[1-9]" "$OUT/gpu-check.log" | head -20; stamp gpu-check done
export LD_LIBRARY_PATH=$PWD/$C/lib
P="sonic-7b qwen3-a3b scale-8k olmoe"
timeout 150 $C/moe_sm90_bench --json "$OUT/sweep.jsonl" $P >> "$OUT/sweep.log" 2>&1; echo "sweep rc=$?" | tee -a "$OUT/sweep.log"
stamp sweep done | tee -a "$OUT/sweep.log"
PYTHONUNBUFFERED=1 timeout 120 python3 $C/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" | tee -a "$OUT/torch.log"
stamp all done | tee -a "$OUT/sweep.log"
