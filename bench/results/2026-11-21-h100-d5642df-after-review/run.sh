#!/usr/bin/env bash
# gpu-check at the commit in COMMIT, then moe_bench and the PyTorch reference on the three
# fused-backward presets in the same call (a refactor of the launchers: times must not move).
set -uo pipefail
C=.carry/L6
{ echo "commit $(cat $C/COMMIT) $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 200 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "^\[  FAILED" "$OUT/gpu-check.log" | head
export LD_LIBRARY_PATH=$PWD/$C/lib
P="sonic-7b qwen3-a3b scale-8k"
timeout 120 $C/moe_bench --preset $P --json "$OUT/ours.jsonl" >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
PYTHONUNBUFFERED=1 timeout 120 python3 $C/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" >> "$OUT/torch.log"
grep -v "^{" "$OUT/bench.log" | tail -n 5; tail -n 1 "$OUT/torch.log"
