#!/usr/bin/env bash
# Nsight Compute's warp-stall sampling per SASS instruction for sonic-7b's dW13 and dW2 (the
# service's configuration: block_n 256, slot-order operand by TMA), one launch each; torch after.
set -uo pipefail
B=.carry/lw
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
s="--section SourceCounters --section WarpStateStats --section SpeedOfLight"
for g in dW13:0 dW2:1; do
  name=${g%%:*}; args=${g#*:}
  WGRAD_ONLY=$name timeout 200 ncu --clock-control none --kernel-name-base demangled \
    -k "regex:sm90_weight_grad_kernel<\\(int\\)256, \\(int\\)64, \\(bool\\)$args, \\(bool\\)0, \\(int\\)1, \\(bool\\)1>" --launch-count 1 $s -o $OUT/sonic_$name -f \
    $B/sm90_weight_grad_bench sonic-7b > $OUT/sonic_$name.log 2>&1; echo "$name rc=$?"
  ncu -i $OUT/sonic_$name.ncu-rep --page source --csv --print-source sass > $OUT/sonic_${name}_sass.csv 2>/dev/null
  ncu -i $OUT/sonic_$name.ncu-rep --page details --print-details all 2>/dev/null | grep -E "sm90_weight|Duration|Stall (Wait|Barrier|Long|Short|Dispatch|GMMA|MIO|Math)" | head -12
done
rm -f $OUT/*.ncu-rep
PYTHONUNBUFFERED=1 timeout 100 python3 $B/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
