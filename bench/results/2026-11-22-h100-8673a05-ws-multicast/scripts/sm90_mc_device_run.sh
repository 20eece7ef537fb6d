#!/usr/bin/env bash
# One device call for the warp-specialised grouped GEMM with the weight multicast, over the
# binaries that bench/sm90_mc_build_carry.sh put in DIR (run from the repository root that
# carries DIR). Steps, each time-boxed, logs to $OUT (8 files at most come back):
#   SASS check of the ws kernels (wgmma present, no local memory)           -> run.log
#   forward and backward tests                   -> forward_test.log, backward_test.log
#   the *_mcsame broken builds on case "medium" (multicast checks must FAIL) -> broken.log
#   sm90_mc_bench: default vs ws+mc, interleaved, on PRESETS                 -> mc.jsonl
#   torch_moe_reference.py on PRESETS (reported beside every timing)         -> torch.jsonl/.log
#   if time is left: the forward tile sweep on PRESETS (ws+mc rows, NOT interleaved) -> sweep.log
# Benches are skipped if a test hung. Usage: sm90_mc_device_run.sh DIR PRESET...
set -uo pipefail
C=$1; shift
P="$*"
export LD_LIBRARY_PATH=$PWD/$C/lib:${LD_LIBRARY_PATH:-}
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*" | tee -a "$OUT/run.log"; }
gpu() { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader | tee -a "$OUT/run.log"; }
stamp start; echo "commit $(cat $C/COMMIT)" | tee -a "$OUT/run.log"; gpu
{ echo "== SASS of the ws kernels: wgmma, multicast TMA, remote arrive, local memory"
  cuobjdump -sass $C/sm90_expert_forward_test | awk '/Function :/{f=($0 ~ /ws_kernel/)} f' |
    grep -oE "HGMMA\.[0-9A-Za-z.]+|UTMALDG[.0-9A-Z]*MULTICAST|UTMALDG\.[0-9A-Z]+|SYNCS\.ARRIVE[.A-Z0-9]*|\b(LDL|STL)\b" |
    sort | uniq -c; } >> "$OUT/run.log" 2>&1
hung=0
for t in forward backward; do
  lim=$([ $t = forward ] && echo 120 || echo 60)
  timeout $lim stdbuf -oL $C/sm90_expert_${t}_test > "$OUT/${t}_test.log" 2>&1
  rc=$?; [ $rc = 124 ] && hung=1
  echo "$t test rc=$rc pass=$(grep -c '^PASS' "$OUT/${t}_test.log") fail=$(grep -c '^FAIL' "$OUT/${t}_test.log")" | tee -a "$OUT/run.log"
  grep -E "^FAIL|ALL PASSED|SOME CHECKS" "$OUT/${t}_test.log" | head -5
  stamp $t test done
done
for t in forward backward; do
  log=$(mktemp)
  timeout 30 stdbuf -oL $C/sm90_expert_${t}_test_mcsame medium > "$log" 2>&1; rc=$?
  { echo "=== $t mcsame medium rc=$rc"; cat "$log"; } >> "$OUT/broken.log"
  echo "broken mcsame $t medium rc=$rc pass=$(grep -c '^PASS' "$log") fail=$(grep -c '^FAIL' "$log") fail_mc=$(grep '^FAIL' "$log" | grep -c 'mc=1') fail_nonmc=$(grep '^FAIL' "$log" | grep -vc 'mc=1') pass_mc=$(grep '^PASS' "$log" | grep -c 'mc=1')" | tee -a "$OUT/run.log"
done
stamp broken done
if [ $hung = 1 ]; then echo "skipping benches: a test hung" | tee -a "$OUT/run.log"; else
  gpu
  timeout 100 $C/sm90_mc_bench --rounds ${ROUNDS:-60} $P > "$OUT/mc.jsonl" 2>> "$OUT/run.log"
  echo "mc bench rc=$?" | tee -a "$OUT/run.log"; stamp mc bench done; gpu
fi
PYTHONUNBUFFERED=1 timeout 120 python3 $C/torch_moe_reference.py --preset $P \
  --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1
echo "torch rc=$?" | tee -a "$OUT/run.log"; stamp torch done
left=$(( ${BUDGET:-280} - $(date +%s) + S ))
if [ $hung = 0 ] && [ $left -gt 30 ]; then
  timeout $(( left - 10 )) $C/sm90_bench $P > "$OUT/sweep.log" 2>&1
  echo "fwd sweep rc=$? (limit $(( left - 10 ))s)" | tee -a "$OUT/run.log"; stamp sweep done
fi
python3 - "$OUT/mc.jsonl" <<'PY' | tee -a "$OUT/run.log"
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(f"{r['preset']:10s} {r['proj']:4s} {r['cand']:8s} {r['config']:10s} {r['ms']:.4f} ms {r['tflops']:6.1f} TF x{r['vs_default']:.3f} {r['check']}")
PY
stamp all done
