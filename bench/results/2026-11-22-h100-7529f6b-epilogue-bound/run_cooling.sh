#!/usr/bin/env bash
# How fast the GPU heats under the kernel benches and cools when idle: nvidia-smi samples
# every 100 ms while sm90_bench runs four times back to back, then for 100 s of idle.
set -uo pipefail
B=.carry/ab
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=timestamp,temperature.gpu,clocks.sm,power.draw,clocks_throttle_reasons.active,fan.speed --format=csv,noheader -lms 100 > $OUT/cooling.csv &
smi=$!
sleep 2
echo "load start $(date -u +%T.%3N)"
for i in 1 2; do for p in sonic-7b olmoe; do timeout 100 $B/sm90_bench_base $p > /dev/null 2>&1; done; done
echo "load end $(date -u +%T.%3N)"
sleep 100
kill $smi
awk -F', ' 'NR%10==1{print $1, $2"C", $3, $4, $5}' $OUT/cooling.csv
PYTHONUNBUFFERED=1 timeout 100 python3 $B/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
