#!/usr/bin/env bash
# The largest T of the scale-* shape whose forward+backward fits on the GPU, recompute mode and
# keep-H, with the code of 56ed2b1 (the weight gradients on their own stream: a chunk's
# gathered x, dXg and pA now live at once); torch on scale-128k in the same call.
set -uo pipefail
mkdir -p .carry && tar -C .carry -xJf .carry/fmx/fm.tar.xz
C=.carry/fm
export LD_LIBRARY_PATH=$PWD/$C/lib
echo "commit $(cat $C/COMMIT)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
{ timeout 130 $C/moe_bench --max-t --recompute --max-t-seconds 100; echo "rc=$?";
  timeout 60 $C/moe_bench --max-t --max-t-seconds 40; echo "rc=$?"; } 2>&1 | tee $OUT/maxt.log
PYTHONUNBUFFERED=1 timeout 120 python3 $C/torch_moe_reference.py --preset scale-128k --json $OUT/torch.jsonl > /dev/null 2>&1; echo "torch rc=$?"; cat $OUT/torch.jsonl
