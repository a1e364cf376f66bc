"""Runs benchmark cases once each, outside a CUDA graph, for a profiler to attach to:

    ncu --clock-control none -k regex:dense_decode_kernel -c 1 --set full --import-source yes \
        python3 bench/profile_case.py dense_b128_h16_sk8192

For a warm launch (caches kept from the launches before it): --repeat 6 here, and ncu's
--cache-control none -s 4, which profiles the fifth.

With --flashmla DIR the cases call FlashMLA (the `flash_mla` package in DIR, built from source
outside this repository) instead, so that its kernels can be profiled on the same inputs.
(tools/gpu.sh's `profile` step does this and writes the reports to $OUT.)"""

import argparse
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as B  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("cases", nargs="+", help="bench_decode case names (or dense_b<b>[_sq<s_q>]_h<h>_sk<s_k>[_causal][_varlen])")
parser.add_argument("--flashmla", metavar="DIR", help="profile FlashMLA's kernels on the same inputs")
parser.add_argument("--reuse-plan", action="store_true",
                    help="call twice with one scheduler object: the second call runs on the first's plan")
parser.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="make the (last) call N times, for a warm profile: ncu -s skips the first ones")
args = parser.parse_args()
B.REUSE_PLAN = args.reuse_plan
api = B.load_flashmla(args.flashmla) if args.flashmla else B.flash_mla
for name in args.cases:
    torch.manual_seed(zlib.crc32(name.encode()))  # the benchmark's inputs, the same for both libraries
    call, _, _, _ = B.case_by_name(name)(api=api)
    for _ in range((1 if args.reuse_plan else 0) + max(args.repeat, 1)):
        call()
    torch.cuda.synchronize()
