#!/usr/bin/env bash
# Smoke test of moe-service-bench (tests/bench/service/CMakeLists.txt runs it): a tiny shape
# through the bench's own loopback server, then through a separate moe-server process, then its
# own server in a child process (with JSON output), then through shared memory, then bad flags. The bench itself exits 1 on any RPC error, a service output that differs from the
# in-process one, or zero throughput; this script also checks the tables it prints.
# Usage: service_bench_smoke.sh MOE_SERVICE_BENCH MOE_SERVER
set -u
bench=$1
server=$2
work=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# shellcheck disable=SC2054  # the commas separate cases inside one flag value
tiny=(--cases=64x32x16x1,32x16x8x3 --steps=2 --inference_rounds=2 --chunk_bytes=1024)

# Rows: | T | d | h | N | mode | service tok/s | in-process tok/s | ... ; both must be > 0.
check_rows() {
  local out=$1 want=$2
  local rows
  rows=$(awk -F'|' '$6 ~ /train|infer/ && $7+0 > 0 && $8+0 > 0' "$out" | wc -l)
  [[ $rows -eq $want ]] || fail "expected $want rows with positive throughput, got $rows: $(cat "$out")"
}

# 1. The bench's own server (started in process on loopback).
"$bench" "${tiny[@]}" >"$work/own.txt" 2>&1 || fail "bench with its own server: $(cat "$work/own.txt")"
check_rows "$work/own.txt" 4
grep -q '| Forward |' "$work/own.txt" || fail "no server stage rows: $(cat "$work/own.txt")"
grep -q '| Backward |' "$work/own.txt" || fail "no Backward stage rows: $(cat "$work/own.txt")"

# 2. A separate moe-server process on free ports; its first line names them.
"$server" --host=127.0.0.1 --port=0 --metrics_port=0 --device=cpu >"$work/server.txt" 2>&1 &
server_pid=$!
for _ in $(seq 100); do
  grep -q 'gRPC on' "$work/server.txt" && break
  sleep 0.1
done
line=$(grep 'gRPC on' "$work/server.txt") || fail "moe-server did not start: $(cat "$work/server.txt")"
port=$(sed -E 's/.*gRPC on [^ ]*:([0-9]+),.*/\1/' <<<"$line")
metrics_port=$(sed -E 's/.*metrics on [^ ]*:([0-9]+).*/\1/' <<<"$line")
"$bench" "${tiny[@]}" --server="127.0.0.1:$port" --metrics="127.0.0.1:$metrics_port" \
  --dtype=bfloat16 --routing=server >"$work/remote.txt" 2>&1 ||
  fail "bench against moe-server: $(cat "$work/remote.txt")"
check_rows "$work/remote.txt" 4
grep -q "moe-server at 127.0.0.1:$port" "$work/remote.txt" || fail "not run against the process"
grep -q '| Forward |' "$work/remote.txt" || fail "no stage rows from --metrics"

# 3. The bench's own server in a child process (as --transport=cuda_ipc runs it), its results
# also appended as JSON Lines, one object per case and mode.
"$bench" "${tiny[@]}" --server_process --json="$work/out.jsonl" >"$work/child.txt" 2>&1 ||
  fail "bench with --server_process: $(cat "$work/child.txt")"
check_rows "$work/child.txt" 4
grep -q 'in child process' "$work/child.txt" || fail "no child process: $(cat "$work/child.txt")"
[[ $(grep -c '"transport":"tcp"' "$work/out.jsonl") -eq 4 ]] ||
  fail "expected 4 JSON objects: $(cat "$work/out.jsonl")"
grep -q '"service_tok_s":[1-9]' "$work/out.jsonl" || fail "no throughput in $(cat "$work/out.jsonl")"

# 4. Host tensors through shared memory regions, with the server in this process and in a child.
for where in "" --server_process; do
  "$bench" "${tiny[@]}" --transport=shm $where >"$work/shm.txt" 2>&1 ||
    fail "bench with --transport=shm $where: $(cat "$work/shm.txt")"
  check_rows "$work/shm.txt" 4
done

# 5. Bad input: exit 1 and a message naming the flag.
for bad in --cases=64x32x16 --dtype=float16 --routing=both --steps=0 --transport=udp \
    --client_device=gpu0 --servers=127.0.0.1 --servers=127.0.0.1:5,127.0.0.1:5; do
  if "$bench" "${tiny[@]}" "$bad" >"$work/bad.txt" 2>&1; then fail "$bad was accepted"; fi
  flag=${bad%%=*}
  grep -q "${flag#--}" "$work/bad.txt" || fail "$bad: message does not name the flag: $(cat "$work/bad.txt")"
done
# A server that is not there is an error, not a zero.
if "$bench" "${tiny[@]}" --server=127.0.0.1:1 --timeout_seconds=2 >"$work/none.txt" 2>&1; then
  fail "no server, yet the bench succeeded"
fi
echo "ServiceBenchSmoke: OK"
