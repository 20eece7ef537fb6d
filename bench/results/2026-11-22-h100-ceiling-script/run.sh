#!/usr/bin/env bash
# The eleventh session's last call: scripts/bench --ceiling as committed (the service's paths,
# torch_moe_reference.py and the cuBLAS ceiling joined in one table) on the three presets whose
# targets are missed, each series started at or below 50 C.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/fbx/fb.tar.xz
C=.carry/fb
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } 2>&1 | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 400 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 --ceiling sonic-7b olmoe scale-8k deepseek-v3 >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -E "^(preset|sonic|olmoe|scale|deepseek)" "$OUT/bench.log" | cut -c1-160
grep -A8 "cuBLAS GEMMs ms" "$OUT/bench.log"
tail -n 2 "$OUT/bench.log"
