#!/usr/bin/env bash
# TLS with the certificate watcher (--tls_reload_seconds at its default, 300; the first TLS run,
# bench/results/2026-11-22-h100-tls, read the files once) against plaintext: two moe-servers of
# the same build on the H100, one with the test PKI's certificate (tests/testdata/tls), driven
# alternately by one moe-service-bench binary (--tls_ca_file for the TLS one), two rounds
# (plain tls | tls plain), a retaining trainer whose process keeps pageable tensors, sonic-7b's
# shape with 1 and 4 micro-batches in flight at the client's defaults; torch on sonic-7b in the
# call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/tlx/tl.tar.xz
C=.carry/tl
S=$(date +%s)
stamp() { echo "## +$(( $(date +%s) - S ))s $(date -u +%FT%TZ) $*"; }
{ stamp start; echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu --format=csv,noheader; nproc; } | tee "$OUT/bench.log"
export LD_LIBRARY_PATH=$PWD/$C/lib
PYTHONUNBUFFERED=1 timeout 100 python3 $C/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl >> $OUT/bench.log 2>&1; echo "torch rc=$?" | tee -a $OUT/bench.log; cat $OUT/torch.jsonl
P=tests/testdata/tls
$C/moe-server --device=cuda --port=50310 --metrics_port=50311 > /tmp/plain.log 2>&1 &
$C/moe-server --device=cuda --port=50320 --metrics_port=50321 --tls_cert_file=$P/server.pem --tls_key_file=$P/server-key.pem > /tmp/tls.log 2>&1 &
for i in $(seq 1 150); do grep -q "gRPC on" /tmp/plain.log && grep -q "gRPC on" /tmp/tls.log && break; sleep 0.2; done
cat /tmp/plain.log /tmp/tls.log | tee -a $OUT/bench.log
R=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647:glibc.malloc.arena_max=1
run() {  # name round port flags...
  local name=$1 round=$2 port=$3; shift 3
  MOE_PINNED_TENSOR_BYTES=0 GLIBC_TUNABLES="$R" timeout 130 $C/moe-service-bench --server=127.0.0.1:$port \
    --metrics=127.0.0.1:$((port + 1)) --device=cuda --dtype=bfloat16 --timeout_seconds=100 \
    --experts=128 --top_k=8 --warmup=2 --cases=24576x1536x256x1,24576x1536x256x4 "$@" > /tmp/bench.txt 2>&1
  local rc=$?
  { echo "=== $name round $round rc=$rc $(date -u +%H:%M:%S)"; cat /tmp/bench.txt; } >> $OUT/bench_$name.txt
  echo "== $name round $round rc=$rc"; grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| (train|infer) \| [0-9]" /tmp/bench.txt | head -4 | cut -d'|' -f2-8,12
  grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]+ \| [14] \| train \| (Forward|Backward)" /tmp/bench.txt | cut -d'|' -f5,7-12
}
run plain 1 50310; run tls 1 50320 --tls_ca_file=$P/ca.pem
run tls 2 50320 --tls_ca_file=$P/ca.pem; run plain 2 50310
kill %1 %2; wait
cat /tmp/plain.log /tmp/tls.log > $OUT/servers.log
stamp all done | tee -a "$OUT/bench.log"
