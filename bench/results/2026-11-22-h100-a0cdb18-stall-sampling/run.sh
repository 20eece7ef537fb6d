#!/usr/bin/env bash
# Nsight Compute's warp-stall sampling per SASS instruction for sonic-7b's dXg (ws kernel) and
# olmoe's dA (plain kernel), one launch each, exported as CSV; torch on the presets after.
set -uo pipefail
B=.carry/ls
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
s="--section SourceCounters --section WarpStateStats --section SpeedOfLight"
timeout 200 ncu --clock-control none -k regex:sm90_grouped_gemm_ws_kernel --launch-count 1 $s \
  -o $OUT/sonic_dX -f $B/sm90_backward_bench sonic-7b > $OUT/sonic_dX.log 2>&1; echo "sonic dX rc=$?"
timeout 200 ncu --clock-control none -k regex:sm90_grouped_gemm_kernel --launch-count 1 $s \
  -o $OUT/olmoe_dA -f $B/sm90_backward_bench olmoe > $OUT/olmoe_dA.log 2>&1; echo "olmoe dA rc=$?"
for r in sonic_dX olmoe_dA; do
  ncu -i $OUT/$r.ncu-rep --page source --csv --print-source sass > $OUT/${r}_sass.csv 2> $OUT/${r}_sass.err
  echo "$r: $(wc -l < $OUT/${r}_sass.csv) sass lines"; head -c 600 $OUT/${r}_sass.csv; echo
  ncu -i $OUT/$r.ncu-rep --page details --print-details all 2>/dev/null | grep -iE "stall|Duration|Warp Cycles" | head -30
done
rm -f $OUT/*.ncu-rep
PYTHONUNBUFFERED=1 timeout 100 python3 $B/torch_moe_reference.py --preset sonic-7b olmoe --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
