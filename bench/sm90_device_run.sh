#!/usr/bin/env bash
# One call on the GPU machine: SASS check, the correctness test (and a deliberately broken
# build of it, which must fail), then the fused benchmark and torch_moe_reference.py in the
# same run, joined by sm90_compare.py. Expects the binaries that bench/sm90_build_carry.sh put
# in .carry/e; writes logs to $OUT. Usage: bash bench/sm90_device_run.sh PRESET...
set -uo pipefail
dir=.carry/e
out=${OUT:-/tmp/sm90_out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$dir/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "== SASS: wgmma instructions per kernel"
cuobjdump -sass "$dir/sm90_expert_forward_test" | grep -oE "HGMMA\.[0-9A-Za-z.]+" | sort | uniq -c
cuobjdump -sass "$dir/sm90_expert_forward_test" | grep -cE "\b(LDL|STL)\b" | sed 's/^/local-memory instructions: /'
echo "== correctness"
timeout 300 "$dir/sm90_expert_forward_test" 2>&1 | tee "$out/test.log" | grep -vE "^PASS" ; echo "test rc=${PIPESTATUS[0]}"
echo "== broken on purpose (A swizzle removed): must FAIL"
timeout 120 "$dir/sm90_expert_forward_test_broken" > "$out/test_broken.log" 2>&1; echo "broken rc=$?"
grep -c "^FAIL" "$out/test_broken.log" | sed 's/^/broken FAIL lines: /'
echo "== bench"
rm -f "$out/fused.jsonl" "$out/torch.jsonl"
timeout 400 "$dir/sm90_bench" --json "$out/fused.jsonl" "$@" > "$out/bench.log" 2>&1; echo "bench rc=$?"
grep -E '"kind":"tile"' "$out/fused.jsonl" | cut -c1-200
PYTHONUNBUFFERED=1 timeout 400 python3 "$dir/torch_moe_reference.py" --preset "$@" --json "$out/torch.jsonl" > "$out/torch.log" 2>&1; echo "torch rc=$?"
tail -3 "$out/torch.log"
python3 bench/sm90_compare.py "$out/fused.jsonl" "$out/torch.jsonl" | tee "$out/compare.txt"
echo "== compute-sanitizer memcheck on the test"
timeout 240 compute-sanitizer --tool memcheck --print-limit 5 "$dir/sm90_expert_forward_test" > "$out/memcheck.log" 2>&1; echo "memcheck rc=$?"
grep -E "ERROR SUMMARY|ALL PASSED|FAILED" "$out/memcheck.log" | head -5
