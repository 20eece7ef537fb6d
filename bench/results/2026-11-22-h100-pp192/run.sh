#!/usr/bin/env bash
# Twelfth session: the ping-pong kernel's 128 x 192 consumer tiles (block_n 192) checked by the
# fused forward and backward tests, then timed in the kernel benches' sweeps beside the
# configurations Sm90ChooseConfig picks, on sonic-7b and olmoe; torch_moe_reference.py in the same call.
set -uo pipefail
K=.carry/pp
export LD_LIBRARY_PATH=$PWD/$K/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $K/COMMIT | tr '\n' ' ')"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.sm --format=csv,noheader; } 2>&1 | tee "$OUT/run.log"
# Both tests at once (line-buffered, so a hang shows where); the first call's 48/232 register
# budget hung both.
(timeout 240 stdbuf -oL $K/sm90_expert_forward_test > "$OUT/forward_test.log" 2>&1; echo "forward_test rc=$?" >> "$OUT/run.log") &
(timeout 240 stdbuf -oL $K/sm90_expert_backward_test > "$OUT/backward_test.log" 2>&1; echo "backward_test rc=$?" >> "$OUT/run.log") &
wait
for f in forward_test backward_test; do echo "$f: $(grep -c '^PASS' $OUT/$f.log) PASS, $(grep -c '^FAIL' $OUT/$f.log) FAIL, 192: $(grep '^PASS' $OUT/$f.log | grep -c 'block_n=192') PASS $(grep '^FAIL' $OUT/$f.log | grep -c 'block_n=192') FAIL" >> "$OUT/run.log"; done
stamp tests done >> "$OUT/run.log"
P="sonic-7b olmoe"
timeout 150 $K/sm90_bench --json "$OUT/kernels.jsonl" $P > /dev/null 2>> "$OUT/run.log"; echo "fwd bench rc=$?" >> "$OUT/run.log"
for p in $P; do timeout 60 $K/sm90_backward_bench $p >> "$OUT/kernels.jsonl" 2>> "$OUT/run.log"; echo "bwd bench $p rc=$?" >> "$OUT/run.log"; done
stamp benches done >> "$OUT/run.log"
PYTHONUNBUFFERED=1 timeout 120 python3 $K/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" >> "$OUT/run.log"
stamp all done >> "$OUT/run.log"
cat "$OUT/run.log" | cut -c1-250
grep FAIL "$OUT"/*_test.log | head -20
python3 - "$OUT/kernels.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    try: d = json.loads(l)
    except Exception: continue
    if d.get("kind") == "tile" and (d["block_n"] == 192 or (d["pp"] == 0 and d["mc"] == 0 and d["block_n"] == 256 and d["group_m"][0] > 1)):
        print("fwd", d["preset"], "bn", d["block_n"], "tma", d["tma"], "ws", d["ws"], "pp", d["pp"], "up", d["up_ms"], "down", d["down_ms"])
    if "dx_pp192_ms" in d:
        print("bwd", d["preset"], "dx(chosen)", d["dx_ms"], "dx_ws", d["dx_ws_ms"], "dx_pp256", d["dx_pp256_ms"], "dx_pp128", d["dx_pp128_ms"], "dx_pp192", d["dx_pp192_ms"], "check", d["check"], d["pp_check"])
PY
tail -n 5 "$OUT/torch.log"
