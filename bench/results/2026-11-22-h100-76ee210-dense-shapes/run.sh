#!/usr/bin/env bash
# Diagnostic: our grouped-GEMM kernels on dense single-expert shapes vs cuBLAS, and ncu stall
# reasons on sonic-7b's up-projection, torch on sonic-7b in the same call.
set -uo pipefail
D=.carry/diag
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
$D/sm90_bench --json $OUT/bench.jsonl 8192,8192,4096,1,1 196608,1536,256,1,1 sonic-7b > $OUT/bench.log 2>&1
echo "bench rc=$?"
python3 - $OUT/bench.jsonl <<'PY'
import json,sys
for l in open(sys.argv[1]):
    j=json.loads(l)
    if j['kind']=='tile': print(j['preset'],'bn',j['block_n'],'tma',j['tma'],'ws',j['ws'],'pp',j['pp'],'mc',j['mc'],'g',j['group_m'],'up %.3f ms %.0f TF'%(j['up_ms'],j['up_tflops']),'down %.3f ms %.0f TF'%(j['down_ms'],j['down_tflops']))
    else: print(j)
PY
M="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_bytes.sum.per_second,dram__bytes_read.sum.per_second,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second"
for spec in "8192,8192,4096,1,1:4" "sonic-7b:4"; do
  name=${spec%%:*}; skip=${spec##*:}
  timeout 150 ncu --clock-control none -k regex:sm90_grouped_gemm_ws --launch-skip $skip --launch-count 1 --metrics "$M" $D/sm90_bench $name > $OUT/ncu_${name//,/_}.log 2>&1
  echo "== ncu $name rc=$?"; grep -vE "^==PROF==|^\[|WARN" $OUT/ncu_${name//,/_}.log | tail -40
done
PYTHONUNBUFFERED=1 timeout 200 python3 $D/torch_moe_reference.py --preset sonic-7b --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
