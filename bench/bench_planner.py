"""Times the decode planner alone, as bench_decode.py times whole calls (10 calls in one CUDA graph,
median of 20 replays): `get_mla_metadata` with the lengths given plans at once, on the device, and
launches nothing else. Next to `bench_decode.py` and `bench_decode.py --reuse-plan` it splits a
whole call's time into the planner, the gap it leaves, and the attention and combine kernels. The
first line is one tiny kernel (a 4-byte fill) timed the same way: what a launch alone costs there.

Usage: python3 bench/bench_planner.py [--b 128] [--h-q 16,128]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as B  # noqa: E402

import mla_kernels.flash_mla as flash_mla  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--b", type=int, default=128)
    parser.add_argument("--h-q", default="16,128", help="query heads of the planned calls")
    args = parser.parse_args()
    torch.manual_seed(0)
    lens = torch.normal(4096.0, 2048.0, (args.b,)).clamp(min=1).int().cuda()
    print(f"# {torch.cuda.get_device_name()}; planner alone, b={args.b}, CUDA graph of 10 calls, median of 20")
    print(f"{'plan':<40} {'us':>8}")
    tiny = torch.empty(1, dtype=torch.int32, device="cuda")
    print(f"{'one 4-byte fill kernel':<40} {B.time_call(lambda: tiny.fill_(1)):8.1f}")
    for h_q in (int(h) for h in args.h_q.split(",")):
        cases = {
            f"dense h_q={h_q}": lambda: flash_mla.get_mla_metadata(lens, h_q, 1),
            f"sparse V3.2 h_q={h_q} topk 2048": lambda: flash_mla.get_mla_metadata(
                lens, h_q, 1, num_heads_q=h_q, is_fp8_kvcache=True, topk=2048),
        }
        for name, fn in cases.items():
            print(f"{name:<40} {B.time_call(fn):8.1f}")


if __name__ == "__main__":
    main()
