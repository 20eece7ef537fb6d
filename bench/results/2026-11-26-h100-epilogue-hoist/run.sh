#!/usr/bin/env bash
# Fifteenth session, first call: gpu-check on the prebuilt binaries, then scripts/bench --all
# beside torch_moe_reference.py with the change, every timed series started at or below 50 C.
# run2.sh times the change against its base in a second call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/ehx/eh.tar.xz
C=.carry/eh
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(head -1 $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 200 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log" | tee -a "$OUT/bench.log"; grep -E "FAILED|DIFFERS" "$OUT/gpu-check.log" | head -10
stamp gpu-check done | tee -a "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(head -1 $C/COMMIT) PYTHONUNBUFFERED=1 timeout 300 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out /tmp/b --cool-to 50 --cool-timeout 5 --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
cp /tmp/b/ours.jsonl /tmp/b/torch.jsonl "$OUT/"
stamp bench done | tee -a "$OUT/bench.log"
grep -E "rc=" "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|qwen|mixtral|scale|deepseek)" | cut -c1-150
