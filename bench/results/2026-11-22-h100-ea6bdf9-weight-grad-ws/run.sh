#!/usr/bin/env bash
# Warp-specialised weight gradients: test (+ broken layouts, memcheck), bench on the five
# backward presets, torch on the same presets in the same call.
set -uo pipefail
D=.carry/wws
export LD_LIBRARY_PATH=$D/lib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 $D/sm90_weight_grad_test > $OUT/test.log 2>&1; echo "test rc=$?"; grep -c "^PASS" $OUT/test.log; grep -v "^PASS" $OUT/test.log | head -20
for b in swapped_offsets no_swizzle; do timeout 100 $D/sm90_weight_grad_test_$b > $OUT/test_$b.log 2>&1; echo "broken $b rc=$? (want 1) FAIL lines: $(grep -c FAIL $OUT/test_$b.log) ws FAIL lines: $(grep FAIL $OUT/test_$b.log | grep -c 'ws=1')"; done
WGRAD_SKIP=2cta timeout 200 $D/sm90_weight_grad_bench > $OUT/bench.jsonl 2> $OUT/bench.err; echo "bench rc=$?"
python3 - $OUT/bench.jsonl <<'PY'
import json,sys
rows={}
for l in open(sys.argv[1]):
    j=json.loads(l)
    if j.get('kind')!='wgrad': continue
    k=(j['preset'],j['grad'])
    if j['impl']=='cublas_per_expert': name='cublas'
    elif 'block_n' in j: name='n%d%s%s'%(j['block_n'],'_tma' if j['tma'] else '','_ws' if j.get('ws') else '')
    else: name=j.get('variant',j['impl'])
    rows.setdefault(k,[]).append('%s %.3f/%s%s'%(name,j['ms'],('%.3f'%j['accumulate_ms']) if 'accumulate_ms' in j else '-', '' if j.get('check','ok')=='ok' else ' '+j['check']))
for k,v in rows.items(): print(k[0],k[1],' | '.join(v))
PY
timeout 120 compute-sanitizer --tool memcheck --print-limit 5 $D/sm90_weight_grad_test > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?"; grep "ERROR SUMMARY" $OUT/memcheck.log
PYTHONUNBUFFERED=1 timeout 200 python3 $D/torch_moe_reference.py --preset sonic-7b olmoe qwen3-a3b scale-8k deepseek-v3 --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
