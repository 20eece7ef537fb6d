#!/usr/bin/env bash
# Second call of the epilogue bound: the same base and noepi benches with nvidia-smi sampling
# the SM clock, power and throttle reasons every 50 ms, to see whether the GPU runs the GEMMs
# at a lower clock when they write their outputs (power) or not. Then torch on the presets.
set -uo pipefail
B=.carry/ab
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 50 > $OUT/clocks.csv &
smi=$!
sleep 1
for p in sonic-7b olmoe sonic-7b olmoe; do
  for v in base noepi; do
    for b in sm90_bench sm90_backward_bench sm90_weight_grad_bench; do
      echo "BEGIN $p $v $b $(date -u +%Y/%m/%d\ %H:%M:%S.%3N)" >> $OUT/marks.txt
      timeout 100 $B/${b}_$v $p 2>/dev/null | sed "s/^/$b $v /" >> $OUT/bench.txt
      echo "END $p $v $b $(date -u +%Y/%m/%d\ %H:%M:%S.%3N)" >> $OUT/marks.txt
    done
  done
done
sleep 1
kill $smi
PYTHONUNBUFFERED=1 timeout 200 python3 $B/torch_moe_reference.py --preset sonic-7b olmoe --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
wc -l $OUT/clocks.csv $OUT/marks.txt; head -3 $OUT/clocks.csv
