#!/usr/bin/env bash
# Thirteenth session: the ws kernel's gathered A (x for the up-projection, dout for dA and the
# SwiGLU-backward dA) as one 64 x 1 TMA box a row (Sm90GemmConfig::tma_gather) instead of
# cp.async, and the gathered tensor marked persisting in L2; checked by the fused forward and
# backward tests, then timed by the kernel benches beside torch_moe_reference.py in the same call.
set -uo pipefail
K=.carry/tg
export LD_LIBRARY_PATH=$PWD/$K/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $K/COMMIT | tr '\n' ' ')"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.sm --format=csv,noheader; } 2>&1 | tee "$OUT/run.log"
(timeout 200 stdbuf -oL $K/sm90_expert_forward_test > "$OUT/forward_test.log" 2>&1; echo "forward_test rc=$?" >> "$OUT/run.log") &
(timeout 200 stdbuf -oL $K/sm90_expert_backward_test > "$OUT/backward_test.log" 2>&1; echo "backward_test rc=$?" >> "$OUT/run.log") &
wait
for f in forward_test backward_test; do echo "$f: $(grep -c '^PASS' $OUT/$f.log) PASS, $(grep -c '^FAIL' $OUT/$f.log) FAIL; tg=1: $(grep '^PASS' $OUT/$f.log | grep -c 'tg=1') PASS $(grep '^FAIL' $OUT/$f.log | grep -c 'tg=1') FAIL" >> "$OUT/run.log"; done
stamp tests done >> "$OUT/run.log"
P="sonic-7b olmoe scale-8k qwen3-a3b"
timeout 200 $K/sm90_bench --json "$OUT/kernels.jsonl" $P > /dev/null 2>> "$OUT/run.log"; echo "fwd bench rc=$?" >> "$OUT/run.log"
for p in $P; do timeout 60 $K/sm90_backward_bench $p >> "$OUT/kernels.jsonl" 2>> "$OUT/run.log"; echo "bwd bench $p rc=$?" >> "$OUT/run.log"; done
for p in sonic-7b qwen3-a3b; do timeout 60 $K/sm90_backward_bench --dh $p >> "$OUT/kernels.jsonl" 2>> "$OUT/run.log"; echo "dh bench $p rc=$?" >> "$OUT/run.log"; done
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
    if k == "tile" and d["pp"] == 0 and d["mc"] == 0 and d["tma"] == 1 and d["group_m"][0] > 1:
        print("fwd", d["preset"], "bn", d["block_n"], "ws", d["ws"], "tg", d["tg"], "up", d["up_ms"], "down", d["down_ms"])
    elif k == "l2persist":
        print("l2 ", d["preset"], "up", d["up_ms"], "persist", d["up_persist_x_ms"], "again", d["up_again_ms"], "hit", d["hit_ratio"], "aside", d["set_aside_bytes"])
    elif k == "fused":
        print("fwd", d["preset"], "chosen up", d["up_ms"], "down", d["down_ms"], "comb", d["combine_ms"])
    elif "da_ws_tg_ms" in d:
        print("bwd", d["preset"], d["check"], d["ws_check"], "dA(chosen bn%d)" % d["da_block_n"], d["da_ms"], "ws", d["da_ws_ms"], "ws+tg", d["da_ws_tg_ms"], "ws again", d["da_ws_again_ms"], "persist", d["da_persist_dout_ms"], "again", d["da_again_ms"])
    elif "dh_ws_tg_ms" in d:
        print("dh ", d["preset"], d["check"], d["ws_check"], "dh(chosen)", d["dh_ms"], "ws", d["dh_ws_ms"], "ws+tg", d["dh_ws_tg_ms"])
PY
tail -n 6 "$OUT/torch.log"
