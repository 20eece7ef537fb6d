#!/usr/bin/env bash
# Ring depth of the ws kernel at block_n 256: 4 stages (base) vs 3 (s3), synchronous epilogue,
# interleaved; torch on the same presets in the same call.
set -uo pipefail
D=.carry/s3
for p in sonic-7b qwen3-a3b scale-8k olmoe; do
  for v in base s3 base s3; do
    $D/sm90_bench_$v $p 2>&1 | python3 -c "
import json,sys
for l in sys.stdin:
  j=json.loads(l)
  if j['kind']=='tile' and j['ws']==1 and j['block_n']==256: print('$p','$v'.ljust(4),'fwd ws256 up %.3f down %.3f'%(j['up_ms'],j['down_ms']))
"
  done
done | tee $OUT/fwd.txt
for v in base s3 base s3; do
  timeout 200 $D/sm90_backward_bench_$v sonic-7b > $OUT/bwd_$v.jsonl 2>/dev/null
  timeout 200 $D/sm90_backward_bench_$v qwen3-a3b >> $OUT/bwd_$v.jsonl 2>/dev/null
  timeout 200 $D/sm90_backward_bench_$v scale-8k >> $OUT/bwd_$v.jsonl 2>/dev/null
  python3 - $OUT/bwd_$v.jsonl $v <<'PY'
import json,sys
for l in open(sys.argv[1]):
    try: j=json.loads(l)
    except Exception: continue
    if 'da_ws_ms' in j: print(j['preset'], sys.argv[2].ljust(4), 'check', j['check'], j['ws_check'], 'dA ws(bn%d) %.3f dX ws(bn%d) %.3f'%(j['da_block_n'], j['da_ws_ms'], j['dx_block_n'], j['dx_ws_ms']))
PY
  rm -f $OUT/bwd_$v.jsonl
done | tee $OUT/bwd.txt
PYTHONUNBUFFERED=1 timeout 200 python3 .carry/e/torch_moe_reference.py --preset sonic-7b qwen3-a3b scale-8k olmoe --json $OUT/torch.jsonl > /dev/null 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
