#!/usr/bin/env bash
# 937c78e: a micro-batch striped over several connections (moe.proto Stripe), its rows assembled
# in place on both ends. The pre-striping moe-server and moe-service-bench ("old": build-d's pair
# from the end of the eighth session) against 937c78e's pair unstriped (--stripe_bytes=0) and
# striped (default: 8 MiB, 4 connections), alternating, two rounds, sonic-7b's shape with 1 and 4
# micro-batches in flight; then olmoe's shape with one in flight, old against striped. A
# retaining trainer; torch on sonic-7b and olmoe in the call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/spx/sp.tar.xz
C=.carry/sp
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; } | tee "$OUT/bench.log"
PYTHONUNBUFFERED=1 timeout 150 python3 $C/torch_moe_reference.py --preset sonic-7b olmoe --json $OUT/torch.jsonl >> $OUT/bench.log 2>&1; echo "torch rc=$?" | tee -a $OUT/bench.log; cat $OUT/torch.jsonl
stamp torch done | tee -a "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
$C/old/moe-server --device=cuda --port=50300 --metrics_port=50301 > /tmp/server_old.log 2>&1 &
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > /tmp/server_new.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" /tmp/server_old.log && grep -q "gRPC on" /tmp/server_new.log && break; sleep 0.2; done
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name binary port round cases experts extra-flags...
  local name=$1 bin=$2 port=$3 round=$4 cases=$5 experts=$6; shift 6
  GLIBC_TUNABLES="$R" timeout 150 $bin --server=127.0.0.1:$port --metrics=127.0.0.1:$((port + 1)) \
    --device=cuda --dtype=bfloat16 --timeout_seconds=100 --experts=$experts --top_k=8 \
    --cases=$cases "$@" > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$name.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| (train|infer) \| [0-9]" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
  grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| train \| (Forward|Backward)" /tmp/bench.txt | cut -d'|' -f5,7-12
}
SONIC=24576x1536x256x1,24576x1536x256x4
for round in 1 2; do
  run old $C/old/moe-service-bench 50300 $round $SONIC 128
  run unstriped $C/moe-service-bench 50310 $round $SONIC 128 --stripe_bytes=0
  run striped $C/moe-service-bench 50310 $round $SONIC 128
done
run olmoe_old $C/old/moe-service-bench 50300 1 16384x2048x1024x1 64
run olmoe_striped $C/moe-service-bench 50310 1 16384x2048x1024x1 64
cat $OUT/bench_olmoe_striped.txt >> $OUT/bench_olmoe_old.txt && rm $OUT/bench_olmoe_striped.txt
curl -s 127.0.0.1:50311/metrics | grep -E "^moe_striped_micro_batches_total|^moe_requests_total" > $OUT/metrics_new.txt
kill %1 %2; wait
{ echo "--- old server"; cat /tmp/server_old.log; echo "--- new server"; cat /tmp/server_new.log; } > $OUT/servers.log
stamp all done | tee -a "$OUT/bench.log"
