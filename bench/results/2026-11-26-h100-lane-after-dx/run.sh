#!/usr/bin/env bash
# Fourteenth session, on the GPU machine: scripts/gpu-check on the prebuilt binaries (the lane
# test covers the default order), then scripts/bench beside torch_moe_reference.py on the presets
# whose backward runs a combine after dXg; moe_bench's A/B times the service's backward with its
# weight gradients serial, beside dXg, after dXg at the greatest stream priority, and beside
# again, checking that all four give the same bits.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/lax/la.tar.xz
C=.carry/la
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(head -1 $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 240 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20
stamp gpu-check done | tee -a "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
for round in 1 2; do
  MOE_COMMIT=$(head -1 $C/COMMIT) PYTHONUNBUFFERED=1 timeout 200 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT/r$round" --cool-to 50 --cool-timeout 5 sonic-7b olmoe qwen3-a3b scale-8k >> "$OUT/bench.log" 2>&1; echo "bench round $round rc=$?" >> "$OUT/bench.log"
done
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|qwen|scale|bench)" | cut -c1-160
for f in "$OUT"/r*/ours.jsonl; do python3 - "$f" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print("%-10s %-8s serial %.3f beside %.3f after %.3f beside %.3f same_bits %s fwdbwd %.3f" % (d["preset"], d["backward_path"], d["bwd_svc_serial_ms"], d["bwd_svc_overlap_ms"], d["bwd_svc_after_dx_ms"], d["bwd_svc_overlap_again_ms"], d["serial_same_bits"], d["fwdbwd_ms"]))
PY
done
