#!/usr/bin/env bash
# The ws kernel's asynchronous (bulk-copy) epilogue: tests with it, memcheck, forward and
# backward kernel benches, torch on the same presets in the same call.
set -uo pipefail
B=.carry/asb; E=.carry/e
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 $E/sm90_expert_forward_test > $OUT/fwd_test.log 2>&1; echo "fwd test rc=$? PASS=$(grep -c ^PASS $OUT/fwd_test.log) as=1 PASS=$(grep ^PASS $OUT/fwd_test.log | grep -c 'as=1')"; grep -v "^PASS" $OUT/fwd_test.log | head -5
timeout 200 $B/sm90_expert_backward_test > $OUT/bwd_test.log 2>&1; echo "bwd test rc=$? PASS=$(grep -c ^PASS $OUT/bwd_test.log) as=1 PASS=$(grep ^PASS $OUT/bwd_test.log | grep -c 'as=1')"; grep -v "^PASS" $OUT/bwd_test.log | head -5
timeout 60 $B/sm90_expert_backward_test_swapped > $OUT/bwd_swapped.log 2>&1; echo "swapped rc=$? (want 1) as=1 FAIL=$(grep ^FAIL $OUT/bwd_swapped.log | grep -c 'as=1')"
timeout 200 compute-sanitizer --tool memcheck --print-limit 5 $E/sm90_expert_forward_test > $OUT/fwd_memcheck.log 2>&1; echo "fwd memcheck rc=$?"; grep "ERROR SUMMARY" $OUT/fwd_memcheck.log
for p in sonic-7b qwen3-a3b scale-8k olmoe; do
  $E/sm90_bench $p 2>&1 | python3 -c "
import json,sys
for l in sys.stdin:
  j=json.loads(l)
  if j['kind']=='tile' and j['ws']==1 and j['block_n']==256: print('$p','fwd ws256 as=%d'%j['as'],'down %.3f ms %.0f TF'%(j['down_ms'],j['down_tflops']))
  if j['kind']=='tile' and j['ws']==0 and j['pp']==0 and j['block_n']==256 and j['tma']==1 and j['group_m'][0]!=1: print('$p','fwd plain256  down %.3f ms'%j['down_ms'])
" | tee -a $OUT/fwd_bench.txt
done
timeout 240 $B/sm90_backward_bench > $OUT/bwd_bench.jsonl 2> $OUT/bwd_bench.err; echo "bwd bench rc=$?"
python3 - $OUT/bwd_bench.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    try: j=json.loads(l)
    except Exception: continue
    if 'da_ws256_as_ms' not in j: continue
    print(j['preset'], 'check',j['check'],j['as_check'], 'dA heur(bn%d) %.3f ws %.3f ws256 %.3f ws256+as %.3f'%(j['da_block_n'],j['da_ms'],j['da_ws_ms'],j['da_ws256_ms'],j['da_ws256_as_ms']),
          '| dX heur(bn%d) %.3f ws %.3f ws256 %.3f ws256+as %.3f'%(j['dx_block_n'],j['dx_ms'],j['dx_ws_ms'],j['dx_ws256_ms'],j['dx_ws256_as_ms']))
PY
PYTHONUNBUFFERED=1 timeout 200 python3 $E/torch_moe_reference.py --preset sonic-7b olmoe qwen3-a3b scale-8k deepseek-v3 --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
