"""One M × K × N W4A16 product by the configs named on the command line, and torch bf16, for Nsight Compute.

    ncu --clock-control none --section WarpStateStats --section SchedulerStats ... \
        python benchmarks/w4a16_ncu_probe.py 4096 4096 28672 "wgmma_smem,256,128,1,8,2" "wgmma,256,128,1,8,2,1"

Each config is kind,block_m,block_n,split_k,num_warps,num_stages[,is_stacked]; each kernel runs three
times (the first compiles), with bf16 F.linear last.
"""

import sys

import torch
import torch.nn.functional as F

from llmc.kernels.w4a16_gemm import pack_w4a16_for_gpu, run_w4a16_config
from w4a16_kind_sweep import parse_config  # (benchmarks/ is the script's folder)

m, k, n = (int(v) for v in sys.argv[1:4])
levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
params = pack_w4a16_for_gpu(levels, scales, None)
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
for spec in sys.argv[4:]:
    config = parse_config(spec)
    for _ in range(3):
        run_w4a16_config(x, params["qweight"], params["scales"], None, None, 128, config)
dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    F.linear(x, dense)
torch.cuda.synchronize()
