#!/usr/bin/env bash
# One device call for the ping-pong grouped GEMM, over the binaries that
# bench/sm90_pp_build_carry.sh put in DIR (run from the repository root that carries DIR):
#   tests  SASS check; the forward and backward tests; the broken builds on chosen cases
#   fwd    the forward tile sweep (sm90_bench) on PRESETS
#   bwd    sm90_backward_bench (dA/dX on its presets, then --dh)
#   torch  torch_moe_reference.py on PRESETS (the reference every timing is reported beside)
# Every step is time-boxed; logs go to $OUT (8 files at most come back: run.log,
# forward_test.log, backward_test.log, broken.log, fwd.log, bwd.jsonl, torch.jsonl, torch.log).
# Usage: sm90_pp_device_run.sh DIR STEP... -- PRESET...
set -uo pipefail
C=$1; shift
steps=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do steps+=("$1"); shift; done
[ $# -gt 0 ] && shift
P="$*"
export LD_LIBRARY_PATH=$PWD/$C/lib:${LD_LIBRARY_PATH:-}
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader; } | tee "$OUT/run.log"
torch() {
  PYTHONUNBUFFERED=1 timeout "$1" python3 $C/torch_moe_reference.py --preset $P \
    --json "$OUT/torch.jsonl" > "$OUT/torch.log" 2>&1; echo "torch rc=$?" | tee -a "$OUT/run.log"
  stamp torch done | tee -a "$OUT/run.log"
}
hung=0
for step in "${steps[@]}"; do
  if [ $hung = 1 ] && { [ $step = fwd ] || [ $step = bwd ]; }; then
    echo "skipping $step: a test hung" | tee -a "$OUT/run.log"; continue
  fi
  case $step in
    tests)
      { echo "== SASS of the ping-pong kernels: wgmma and local memory"
        cuobjdump -sass $C/sm90_expert_forward_test | awk '/Function :/{f=($0 ~ /pp_kernel/)} f' |
          grep -oE "HGMMA\.[0-9A-Za-z.]+|\b(LDL|STL)\b" | sort | uniq -c; } >> "$OUT/run.log" 2>&1
      for t in forward backward; do
        timeout 130 stdbuf -oL $C/sm90_expert_${t}_test > "$OUT/${t}_test.log" 2>&1
        rc=$?; [ $rc = 124 ] && hung=1  # a hang: the benches would hang too
        echo "$t test rc=$rc pass=$(grep -c '^PASS' "$OUT/${t}_test.log") fail=$(grep -c '^FAIL' "$OUT/${t}_test.log")" | tee -a "$OUT/run.log"
        grep -E "^FAIL|ALL PASSED|SOME CHECKS" "$OUT/${t}_test.log" | head -5
        stamp $t test done | tee -a "$OUT/run.log"
      done
      # adesc breaks every 128x128 ping-pong tile with more than 64 rows ("medium": 256 rows an
      # expert); noorder (no ordering barrier) needs several tiles per CTA ("many").
      for vct in ${BROKEN:-adesc:medium:forward adesc:medium:backward mchalf:medium:forward}; do
        v=${vct%%:*}; rest=${vct#*:}; case=${rest%%:*}; t=${rest#*:}
        log=$(mktemp)
        timeout 40 stdbuf -oL $C/sm90_expert_${t}_test_$v $case > "$log" 2>&1; rc=$?
        { echo "=== $t $v $case rc=$rc"; cat "$log"; } >> "$OUT/broken.log"
        echo "broken $v $t $case rc=$rc pass=$(grep -c '^PASS' "$log") fail=$(grep -c '^FAIL' "$log")" | tee -a "$OUT/run.log"
      done
      stamp broken done | tee -a "$OUT/run.log" ;;
    fwd)
      timeout 120 $C/sm90_bench $P > "$OUT/fwd.log" 2>&1
      echo "fwd bench rc=$?" | tee -a "$OUT/run.log"; stamp fwd done | tee -a "$OUT/run.log" ;;
    bwd)
      timeout 110 $C/sm90_backward_bench > "$OUT/bwd.jsonl" 2>> "$OUT/run.log"
      echo "bwd bench rc=$?" | tee -a "$OUT/run.log"; stamp bwd done | tee -a "$OUT/run.log"
      timeout 80 $C/sm90_backward_bench --dh >> "$OUT/bwd.jsonl" 2>> "$OUT/run.log"
      echo "bwd --dh rc=$?" | tee -a "$OUT/run.log"; stamp dh done | tee -a "$OUT/run.log" ;;
    torch) torch 90 ;;
  esac
done
stamp all done | tee -a "$OUT/run.log"
