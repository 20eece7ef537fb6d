#!/usr/bin/env bash
# Fourteenth session's last call: gpu-check on the prebuilt binaries; moe_sm90_bench on scale-8k
# twice (its sweep times the plain, ws and ping-pong up-projections, then the configuration
# Sm90ChooseConfig now picks); then scripts/bench --all beside torch_moe_reference.py, every
# timed series started at or below 50 C.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/wux/wu.tar.xz
C=.carry/wu
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(head -1 $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 240 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log" | tee -a "$OUT/bench.log"; grep -E "FAILED|DIFFERS" "$OUT/gpu-check.log" | head -10
stamp gpu-check done | tee -a "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
for round in 1 2; do timeout 60 $C/moe_sm90_bench --json "$OUT/kernels.jsonl" scale-8k > /dev/null 2>> "$OUT/bench.log"; echo "sm90_bench round $round rc=$?" >> "$OUT/bench.log"; done
stamp sm90_bench done | tee -a "$OUT/bench.log"
MOE_COMMIT=$(head -1 $C/COMMIT) PYTHONUNBUFFERED=1 timeout 330 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out /tmp/b --cool-to 50 --cool-timeout 5 --all >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
cp /tmp/b/ours.jsonl /tmp/b/torch.jsonl /tmp/b/torch_gpu.csv "$OUT/"
stamp all done | tee -a "$OUT/bench.log"
grep -E "rc=" "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|qwen|mixtral|scale|deepseek)" | cut -c1-150
python3 - "$OUT/kernels.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    if d.get("kind") == "tile" and d["tma"] == 1 and d["group_m"][0] > 1 and d["block_n"] == 256:
        print("tile ws %d pp %d mc %d up %.4f down %.4f" % (d["ws"], d["pp"], d["mc"], d["up_ms"], d["down_ms"]))
    elif d.get("kind") == "fused":
        print("CHOSEN up %.4f down %.4f fwd %.4f" % (d["up_ms"], d["down_ms"], d["fwd_ms"]))
PY
