#!/usr/bin/env bash
# DeployStageRuntime: runs the Dockerfile's build-stage steps on CI's build tree and checks what
# the runtime image would hold. scripts/build must succeed (on an up-to-date tree it only
# confirms nothing is stale); scripts/stage-runtime must lay out moe-server with every library
# it needs beyond what the CUDA runtime image provides; and the staged server, started with
# nothing but the staged library directory and the image's default arguments (ports moved to
# free loopback ones, device cpu, a temporary tokens file), must answer its health check without
# a token and serve /metrics, refuse an ExpertService call without a token and answer it with
# one (authentication is on), then exit cleanly on SIGTERM.
#
# Usage: stage_runtime_test.sh REPO_ROOT BUILD_DIR HEALTH_PROBE PYTHON_WITH_YAML
set -euo pipefail
repo=$1
build=$2
probe=$3
py=$4
tmp=$(mktemp -d)
server_pid=""
cleanup() {
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAILED: $*" >&2; exit 1; }

MOE_BUILD_DIR="$build" bash "$repo/scripts/build" >"$tmp/build.log" 2>&1 ||
  { tail -30 "$tmp/build.log" >&2; fail "scripts/build failed"; }
bash "$repo/scripts/stage-runtime" "$build" "$tmp/stage" || fail "scripts/stage-runtime failed"

bin=$tmp/stage/opt/moe/bin
lib=$tmp/stage/opt/moe/lib
[[ -x "$bin/moe-server" ]] || fail "moe-server was not staged"
[[ -d "$tmp/stage/var/lib/moe/checkpoints" ]] || fail "the checkpoint directory was not staged"
[[ -n "$(ls "$lib")" ]] || fail "no libraries were staged (gRPC at least should be)"

# Every library a staged program loads resolves either into the staged lib/ or to one the
# runtime image provides (the same list stage-runtime leaves out).
base='^(linux-vdso|ld-linux[^ ]*|libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvrtc|libnvJitLink|libcurand|libcufft|libcusparse|libcusolver)\.so'
for program in "$bin"/*; do
  while read -r soname arrow path _; do
    [[ "$arrow" == "=>" ]] || continue
    [[ "$soname" =~ $base ]] && continue
    [[ "$path" == "$lib/$soname" ]] ||
      fail "$(basename "$program") loads $soname from $path, not from the staged $lib"
  done < <(LD_LIBRARY_PATH=$lib ldd "$program")
done
echo "ok: $(ls "$bin" | tr '\n' ' ')load only staged or base-image libraries ($(ls "$lib" | wc -l) staged)"

# The image's CMD, with its ports and device moved, from a bare environment.
# Two distinct free ports: both sockets stay bound until both are known (one bound and closed
# at a time can hand out the same port twice, and the metrics port then fails to listen).
read -r grpc_port metrics_port < <("$py" -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
mapfile -t cmd < <("$py" -c '
import json, re, sys
text = open(sys.argv[1]).read()
for a in json.loads(re.search(r"^CMD\s+(\[.*\])", text, re.M).group(1)):
    if a.split("=")[0] not in ("--host", "--metrics_host", "--port", "--metrics_port", "--device",
                               "--checkpoint_dir", "--tokens_file"):
        print(a)' "$repo/docker/Dockerfile")
grep -q -- '--tokens_file=' "$repo/docker/Dockerfile" || fail "the image's CMD has no --tokens_file"
token=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
echo "moe-admin $token" >"$tmp/tokens"
echo "$token" >"$tmp/token"
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$lib" "$bin/moe-server" "${cmd[@]}" \
  --host=127.0.0.1 --metrics_host=127.0.0.1 --port="$grpc_port" --metrics_port="$metrics_port" \
  --device=cpu --checkpoint_dir="$tmp/stage/var/lib/moe/checkpoints" --tokens_file="$tmp/tokens" \
  >"$tmp/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 120); do
  "$probe" "127.0.0.1:$grpc_port" moe.v1.ExpertService >/dev/null 2>&1 && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$tmp/server.log" >&2; fail "staged moe-server exited"; }
  sleep 0.25
done
"$probe" "127.0.0.1:$grpc_port" moe.v1.ExpertService || { cat "$tmp/server.log" >&2; fail "staged moe-server is not SERVING"; }
"$py" - "$metrics_port" <<'PY' || fail "staged moe-server does not serve /metrics"
import sys, urllib.request
body = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
assert "moe_device_memory_total_bytes" in body, body[:500]
PY
# The compose healthcheck, run as compose would run it in the container, on this port.
mapfile -t check < <("$py" -c '
import sys, yaml
test = yaml.safe_load(open(sys.argv[1]))["services"]["moe-server"]["healthcheck"]["test"]
assert test[0] == "CMD", test
for a in test[1:]:
    print(a.replace("localhost:50051", "127.0.0.1:" + sys.argv[2]))' "$repo/docker/compose.yaml" "$grpc_port")
[[ -x "$bin/${check[0]}" ]] || fail "the compose healthcheck runs ${check[0]}, which is not staged"
env -i PATH="$bin:/usr/bin:/bin" LD_LIBRARY_PATH="$lib" "${check[@]}" ||
  fail "the compose healthcheck (${check[*]}) fails against the staged server"
echo "ok: the compose healthcheck passes: ${check[*]}"

# Authentication is on: without a token an ExpertService call is refused, with one it runs.
if out=$(env -i PATH="$bin:/usr/bin:/bin" LD_LIBRARY_PATH="$lib" moe-cli \
    --server="127.0.0.1:$grpc_port" --timeout_seconds=5 list 2>&1); then
  fail "moe-cli list without a token succeeded against the image's default command: $out"
fi
[[ "$out" == *UNAUTHENTICATED* ]] || fail "moe-cli list without a token: $out (not UNAUTHENTICATED)"
env -i PATH="$bin:/usr/bin:/bin" LD_LIBRARY_PATH="$lib" moe-cli --server="127.0.0.1:$grpc_port" \
  --timeout_seconds=5 --token_file="$tmp/token" list >/dev/null ||
  fail "moe-cli list with the admin's token fails against the staged server"
echo "ok: without a token ExpertService calls are UNAUTHENTICATED, with one they run"

kill -TERM "$server_pid"
rc=0
wait "$server_pid" || rc=$?
server_pid=""
[[ $rc -eq 0 ]] || { cat "$tmp/server.log" >&2; fail "staged moe-server exited with $rc on SIGTERM"; }
echo "ok: the staged moe-server serves health and metrics, and exits 0 on SIGTERM"
