#!/usr/bin/env bash
# The same build as run.sh (.carry/wux), a second call: scripts/bench on scale-8k (the preset
# the change moves) and sonic-7b twice, torch_moe_reference.py in each round.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/wux/wu.tar.xz
C=.carry/wu
export LD_LIBRARY_PATH=$PWD/$C/lib
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench2.log"
for round in 1 2; do
  MOE_COMMIT=$(head -1 $C/COMMIT) PYTHONUNBUFFERED=1 timeout 120 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out /tmp/b$round --cool-to 50 --cool-timeout 5 scale-8k sonic-7b >> "$OUT/bench2.log" 2>&1; echo "bench round $round rc=$?" >> "$OUT/bench2.log"
  cp /tmp/b$round/ours.jsonl "$OUT/ours2_r$round.jsonl"; cp /tmp/b$round/torch.jsonl "$OUT/torch2_r$round.jsonl"
done
date -u +%FT%TZ >> "$OUT/bench2.log"
grep -v "^{" "$OUT/bench2.log" | grep -E "^(preset|sonic|scale|bench)" | cut -c1-150
