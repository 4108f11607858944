#!/bin/bash
# Nsight Compute on one launch of the 16-bit fingerprint kernel (3 x [8192, 7168] bf16, k = 32).
#   bash bench/ncu_fp.sh            (on the GPU machine; leaves the clocks alone)
cd "$(dirname "$0")/.." || exit 2
ncu --clock-control none -k regex:fp16_kernel -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 -c "
import torch, tpprobe.fingerprint.triton as tf
ts = [torch.randn(8192, 7168, device='cuda').bfloat16() for _ in range(3)]
tf.launch(ts, 0, 32)[0]()
torch.cuda.synchronize()
"
