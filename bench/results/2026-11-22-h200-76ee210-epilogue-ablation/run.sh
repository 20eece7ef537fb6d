#!/usr/bin/env bash
# Epilogue ablation on the forward kernels: base, fast silu (__fdividef), no epilogue at all.
set -uo pipefail
D=.carry/diag2
for p in sonic-7b 196608,1536,256,1,1 qwen3-a3b scale-8k olmoe; do
  for v in base fastsilu noepi base fastsilu noepi; do
    $D/sm90_bench_$v $p 2>&1 | python3 -c "
import json,sys
for l in sys.stdin:
  j=json.loads(l)
  if j['kind']=='tile' and j['ws']==1 and j['block_n']==256: print('$p','$v'.ljust(9),'ws256 up %.3f ms %.0f TF'%(j['up_ms'],j['up_tflops']),'down %.3f ms %.0f TF'%(j['down_ms'],j['down_tflops']))
  if j['kind']=='ceilings': cb=j['cublas_bf16_tflops']
  if j['kind']=='fused': print('$p','$v'.ljust(9),'chosen  up %.3f down %.3f (bn %d/%d) cublas %.0f'%(j['up_ms'],j['down_ms'],j['up_block_n'],j['down_block_n'],cb))
"
  done
done
PYTHONUNBUFFERED=1 timeout 300 python3 .carry/diag/torch_moe_reference.py --preset sonic-7b qwen3-a3b scale-8k olmoe --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
