#!/usr/bin/env bash
# Thirteenth session: the ws kernel with storing warps (Sm90GemmConfig::storer): the producer
# warpgroup's warps 2-3 write each finished tile from a whole-tile staging while the consumers
# multiply the next; checked by the fused forward and backward tests, then timed by the kernel
# benches beside torch_moe_reference.py in the same call.
set -uo pipefail
K=.carry/st
export LD_LIBRARY_PATH=$PWD/$K/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $K/COMMIT | tr '\n' ' ')"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.sm --format=csv,noheader; } 2>&1 | tee "$OUT/run.log"
(timeout 200 stdbuf -oL $K/sm90_expert_forward_test > "$OUT/forward_test.log" 2>&1; echo "forward_test rc=$?" >> "$OUT/run.log") &
(timeout 200 stdbuf -oL $K/sm90_expert_backward_test > "$OUT/backward_test.log" 2>&1; echo "backward_test rc=$?" >> "$OUT/run.log") &
wait
for f in forward_test backward_test; do echo "$f: $(grep -c '^PASS' $OUT/$f.log) PASS, $(grep -c '^FAIL' $OUT/$f.log) FAIL; st=1: $(grep '^PASS' $OUT/$f.log | grep -c 'st=1') PASS $(grep '^FAIL' $OUT/$f.log | grep -c 'st=1') FAIL" >> "$OUT/run.log"; done
stamp tests done >> "$OUT/run.log"
P="sonic-7b olmoe qwen3-a3b scale-8k"
for round in 1 2; do
  timeout 200 $K/sm90_bench --json "$OUT/kernels.jsonl" $P > /dev/null 2>> "$OUT/run.log"; echo "fwd bench round $round rc=$?" >> "$OUT/run.log"
  for p in $P; do timeout 60 $K/sm90_backward_bench $p >> "$OUT/kernels.jsonl" 2>> "$OUT/run.log"; echo "bwd bench $p rc=$?" >> "$OUT/run.log"; done
done
stamp benches done >> "$OUT/run.log"
PYTHONUNBUFFERED=1 timeout 150 python3 $K/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" >> "$OUT/run.log"
stamp all done >> "$OUT/run.log"
cat "$OUT/run.log" | cut -c1-250
grep FAIL "$OUT"/*_test.log | head -20
python3 - "$OUT/kernels.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    try: d = json.loads(l)
    except Exception: continue
    k = d.get("kind")
    if k == "tile" and d["block_n"] == 256 and d["tma"] == 1 and d["pp"] == 0 and d["group_m"][0] > 1:
        print("fwd", d["preset"], "ws", d["ws"], "st", d["st"], "up", d["up_ms"], "down", d["down_ms"])
    elif k == "fused":
        print("fwd", d["preset"], "chosen up", d["up_ms"], "down", d["down_ms"], "comb", d["combine_ms"])
    elif "da_ws256_storer_ms" in d:
        print("bwd", d["preset"], d["check"], d["ws_check"], "dA chosen", d["da_ms"], "ws256/st/again", d["da_ws256_ms"], d["da_ws256_storer_ms"], d["da_ws256_again_ms"], "| dX chosen", d["dx_ms"], "ws256/st/again", d["dx_ws256_ms"], d["dx_ws256_storer_ms"], d["dx_ws256_again_ms"])
PY
tail -n 4 "$OUT/torch.log"
