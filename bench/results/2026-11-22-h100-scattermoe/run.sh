#!/usr/bin/env bash
# The tenth session's first call: ScatterMoE's Triton kernels (bench/scattermoe_reference.py,
# kernels from scripts/fetch-scattermoe) beside moe_bench and torch_moe_reference.py, every
# preset, one call: scripts/bench --all --scattermoe, every series started at or below 50 C.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/smx/sm.tar.xz
C=.carry/sm
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 560 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --scattermoe $C/scattermoe --out "$OUT" --cool-to 50 --cool-timeout 5 --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -E "scattermoe-check|Error|error|Traceback" "$OUT/bench.log" | cut -c1-240 | head -20
grep -A12 "ScatterMoE fwd ms" "$OUT/bench.log" | cut -c1-260
tail -n 3 "$OUT/bench.log"
