"""Runs benchmark cases once each, outside a CUDA graph, for a profiler to attach to:

    ncu --clock-control none -k regex:dense_decode_kernel -c 1 --set full --import-source yes \
        python3 bench/profile_case.py dense_b128_h16_sk8192

(tools/gpu.sh's `profile` step does this and writes the reports to $OUT.)"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as B  # noqa: E402

for name in sys.argv[1:]:
    call, _, _, _ = B.CASES[name]()
    call()
    torch.cuda.synchronize()
