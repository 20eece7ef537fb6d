#!/usr/bin/env bash
# Fourteenth session, on the GPU machine: the ws kernel's overlapped epilogue
# (Sm90GemmConfig::overlap_epilogue) checked by the fused forward and backward tests (and their
# mutant, which must fail), then timed by the kernel benches (ws with and without it,
# interleaved, beside the plain and ping-pong kernels) and torch_moe_reference.py in one call.
set -uo pipefail
K=.carry/ov
export LD_LIBRARY_PATH=$PWD/$K/lib
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(head -1 $K/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.sm --format=csv,noheader; } 2>&1 | tee "$OUT/run.log"
(timeout 240 stdbuf -oL $K/sm90_expert_forward_test > "$OUT/forward_test.log" 2>&1; echo "forward_test rc=$?" >> "$OUT/run.log") &
(timeout 240 stdbuf -oL $K/sm90_expert_backward_test > "$OUT/backward_test.log" 2>&1; echo "backward_test rc=$?" >> "$OUT/run.log") &
wait
(timeout 60 $K/sm90_expert_forward_test_mutant medium > "$OUT/mutant.log" 2>&1; echo "forward_test_mutant rc=$?" >> "$OUT/run.log")
(timeout 60 $K/sm90_expert_backward_test_mutant medium >> "$OUT/mutant.log" 2>&1; echo "backward_test_mutant rc=$?" >> "$OUT/run.log")
for f in forward_test backward_test; do echo "$f: $(grep -c '^PASS' $OUT/$f.log) PASS, $(grep -c '^FAIL' $OUT/$f.log) FAIL; ov=1: $(grep '^PASS' $OUT/$f.log | grep -c 'ov=1') PASS $(grep '^FAIL' $OUT/$f.log | grep -c 'ov=1') FAIL; dr=1: $(grep '^PASS' $OUT/$f.log | grep -c 'dr=1') PASS $(grep '^FAIL' $OUT/$f.log | grep -c 'dr=1') FAIL" >> "$OUT/run.log"; done
for m in "ov=1 dr=0" "ov=0 dr=1" "ov=1 dr=1" "ov=0 dr=0"; do echo "mutant $m: $(grep '^FAIL' $OUT/mutant.log | grep -c "$m") FAIL $(grep '^PASS' $OUT/mutant.log | grep -c "$m") PASS" >> "$OUT/run.log"; done
stamp tests done >> "$OUT/run.log"
P="sonic-7b olmoe qwen3-a3b scale-8k"
for round in 1 2; do
  timeout 240 $K/sm90_bench --json "$OUT/kernels.jsonl" $P > /dev/null 2>> "$OUT/run.log"; echo "fwd bench round $round rc=$?" >> "$OUT/run.log"
  for p in $P; do timeout 90 $K/sm90_backward_bench $p >> "$OUT/kernels.jsonl" 2>> "$OUT/run.log"; echo "bwd bench $p rc=$?" >> "$OUT/run.log"; done
done
stamp benches done >> "$OUT/run.log"
PYTHONUNBUFFERED=1 timeout 200 python3 $K/torch_moe_reference.py --preset $P --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" >> "$OUT/run.log"
stamp all done >> "$OUT/run.log"
cut -c1-250 "$OUT/run.log"
grep FAIL "$OUT"/*_test.log | head -10
python3 - "$OUT/kernels.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    try: d = json.loads(l)
    except Exception: continue
    k = d.get("kind")
    if k == "tile" and d["tma"] == 1 and d["pp"] == 0 and d["group_m"][0] > 1:
        print("fwd %-11s bn %d ws %d ov %d dr %d up %.4f down %.4f" % (d["preset"], d["block_n"], d["ws"], d["ov"], d["dr"], d["up_ms"], d["down_ms"]))
    elif k == "fused":
        print("fwd %-11s chosen up %.4f down %.4f comb %.4f" % (d["preset"], d["up_ms"], d["down_ms"], d["combine_ms"]))
    elif "da_ov_ms" in d:
        print("bwd %-11s %s %s dA chosen %.4f ws %.4f ov %.4f ws %.4f ov %.4f dr %s ovdr %s" % (d["preset"], d["check"], d["ws_check"], d["da_ms"], d["da_ws_ms"], d["da_ov_ms"], d["da_ws_again_ms"], d["da_ov_again_ms"], d["da_dr_ms"], d["da_ovdr_ms"]))
        print("bwd %-11s %s %s dX chosen %.4f ws %.4f ov %.4f ws %.4f ov %.4f dr %s ovdr %s" % (d["preset"], d["check"], d["ws_check"], d["dx_ms"], d["dx_ws_ms"], d["dx_ov_ms"], d["dx_ws_again_ms"], d["dx_ov_again_ms"], d["dx_dr_ms"], d["dx_ovdr_ms"]))
PY
tail -n 6 "$OUT/torch.log"
