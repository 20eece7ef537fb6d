#!/usr/bin/env bash
# e285595, the session's last engine change (out of memory for the lane itself also falls back
# to the serial order) and the last moe_bench change (one lambda times a backward): gpu-check on
# the prebuilt binaries; the lane test against the two broken engines; scripts/bench on three
# presets, torch in the same call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/fhx/fh.tar.xz && tar -C .carry -xJf .carry/mut3x/mut3.tar.xz
C=.carry/fh
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
timeout 200 scripts/gpu-check --prebuilt $C > "$OUT/gpu-check.log" 2>&1; echo "gpu-check rc=$?" >> "$OUT/gpu-check.log"
tail -n 2 "$OUT/gpu-check.log"; grep -E "FAILED|error|DIFFERS" "$OUT/gpu-check.log" | head -20
export LD_LIBRARY_PATH=$PWD/$C/lib
for m in no_start no_join; do
  timeout 60 .carry/mut3/$m --gtest_filter='*WeightGradOverlap*' > "$OUT/mutant.log" 2>&1
  echo "mutant $m rc=$? failed cases: $(grep -cE '^\[  FAILED  \] Paths.* \([0-9]+ ms\)$' "$OUT/mutant.log") of $(grep -cE '^\[ RUN' "$OUT/mutant.log")" | tee -a "$OUT/bench.log"
done
rm -f "$OUT/mutant.log"
MOE_COMMIT=$(cat $C/COMMIT) PYTHONUNBUFFERED=1 timeout 150 scripts/bench --bin $C/moe_bench --torch $C/torch_moe_reference.py --out "$OUT" --cool-to 50 --cool-timeout 5 sonic-7b olmoe scale-8k >> "$OUT/bench.log" 2>&1; echo "bench rc=$?" >> "$OUT/bench.log"
stamp all done | tee -a "$OUT/bench.log"
grep -v "^{" "$OUT/bench.log" | grep -E "^(preset|sonic|olmoe|scale)" | cut -c1-150
