#!/usr/bin/env bash
# Why the stores cost so much: Nsight Compute on one launch each of olmoe's dA (plain kernel) and
# sonic-7b's dXg (ws kernel), base and noepi: throughput, DRAM bytes, tensor-pipe activity and
# every warp-stall reason per issued instruction. torch on the same presets after.
set -uo pipefail
B=.carry/ab
export LD_LIBRARY_PATH=$B/lib
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
m="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,regex:sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed"
for v in base noepi; do
  timeout 150 ncu --clock-control none -k regex:sm90_grouped_gemm_kernel --launch-count 1 $m \
    $B/sm90_backward_bench_$v olmoe > $OUT/ncu_olmoe_dA_$v.log 2>&1; echo "olmoe dA $v rc=$?"
  timeout 150 ncu --clock-control none -k regex:sm90_grouped_gemm_ws_kernel --launch-count 1 $m \
    $B/sm90_backward_bench_$v sonic-7b > $OUT/ncu_sonic_dX_$v.log 2>&1; echo "sonic dX $v rc=$?"
done
for f in $OUT/ncu_*.log; do echo "== $f"; grep -E "sm90_grouped|duration|dram__bytes|hit_rate|pipe_tensor|stalled_(barrier|long_scoreboard|membar|lg_throttle|wait|math_pipe|drain|short_scoreboard|mio_throttle|dispatch|no_instruction|sleeping|selected|not_selected|branch|tex|misc|imc)_per|inst_executed|per_second|throughput" $f | sed 's/  */ /g' | head -40; done
PYTHONUNBUFFERED=1 timeout 100 python3 $B/torch_moe_reference.py --preset sonic-7b olmoe --json $OUT/torch.jsonl > $OUT/torch.log 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
