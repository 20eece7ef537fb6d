#!/usr/bin/env bash
# Thirteenth session: the forward GEMMs with and without their epilogue (build.sh: noepi keeps the
# wgmmas but never stores a tile), timed in turn, twice, beside torch_moe_reference.py in the same
# call. noepi's outputs are never written; only its time means anything.
set -uo pipefail
K=.carry/noepi
export LD_LIBRARY_PATH=$PWD/$K/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.sm --format=csv,noheader; } 2>&1 | tee "$OUT/run.log"
P="sonic-7b olmoe qwen3-a3b scale-8k"
for round in 1 2; do
  for v in base noepi; do
    timeout 120 $K/sm90_bench_$v --json "$OUT/$v.jsonl" $P > /dev/null 2>> "$OUT/run.log"; echo "round $round $v rc=$?" >> "$OUT/run.log"
  done
done
stamp benches done >> "$OUT/run.log"
PYTHONUNBUFFERED=1 timeout 150 python3 $K/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" >> "$OUT/run.log"
stamp all done >> "$OUT/run.log"
cat "$OUT/run.log"
python3 - "$OUT" <<'PY'
import json, sys, collections
out = sys.argv[1]
rows = collections.defaultdict(list)
for v in ["base", "noepi"]:
    for l in open(f"{out}/{v}.jsonl"):
        d = json.loads(l)
        if d.get("kind") == "tile" and d["block_n"] == 256 and d["tma"] == 1 and d["pp"] == 0 and d["group_m"][0] > 1:
            rows[(d["preset"], "ws" if d["ws"] else "plain", "up", v)].append(d["up_ms"])
            rows[(d["preset"], "ws" if d["ws"] else "plain", "down", v)].append(d["down_ms"])
for k in sorted(rows): print(k, rows[k])
PY
tail -n 4 "$OUT/torch.log"
