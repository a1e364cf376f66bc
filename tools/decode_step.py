"""One DeepSeek-shaped decode step through mla_kernels.flash_mla, checked against the float64
reference of the test suite, with its time.

Runs on the GPU when torch sees one and this build has CUDA kernels for the ops, else on the CPU
backend (smaller batch). Two layers' worth of work, as an engine would issue them:
  * DeepSeek-V3 dense MLA: bf16 paged cache (page 64), h_q 128, d_qk 576, s_q 1, varlen lengths;
  * DeepSeek-V3.2 sparse MLA: FP8 V3.2 cache (656 B/token), h_q 128, topk 2048.
Each uses one FlashMLASchedMeta per step, planned on the first call and reused by the next layer.
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import reference as ref  # noqa: E402

import mla_kernels.flash_mla as flash_mla  # noqa: E402


def has_cuda_kernels() -> bool:
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "mla_kernels::dense_decode_fwd", "CUDA"
    )


def timed(fn, device, repeats):
    fn()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, (time.perf_counter() - start) / repeats


def dense_step(device, b, mean_len, layers, repeats):
    h_q, d = 128, 576
    lens = [max(1, int(random_len)) for random_len in torch.normal(mean_len, mean_len / 2, (b,)).clamp_min(1).tolist()]
    paged = ref.make_dense_paged(lens, 64, 1, d, torch.bfloat16)
    q = ref.rand((b, 1, h_q, d))
    args = [t.to(device) for t in (q, paged.k_cache, paged.block_table, paged.cache_seqlens)]

    def step():
        sched, _ = flash_mla.get_mla_metadata()
        for _ in range(layers):
            out, lse = flash_mla.flash_mla_with_kvcache(*args[:2], args[2], args[3], 512, sched)
        return out, lse

    (out, lse), seconds = timed(step, device, repeats)
    # The float64 reference runs where the inputs are (on the GPU it takes a fraction of a second).
    with torch.device(device):
        want_out, want_lse = ref.ref_dense_decode(q.to(device), [s.to(device) for s in paged.seqs], d ** -0.5,
                                                  causal=False)
    ref.check_is_allclose("dense out", out, want_out, **ref.DENSE_OUT_TOL)
    ref.check_is_allclose("dense lse", lse, want_lse, **ref.DENSE_LSE_TOL)
    flops = 2 * h_q * sum(lens) * (d + 512) * layers
    return f"V3 dense   b={b:<3} h_q={h_q} s_q=1 mean s_k={mean_len}", seconds, flops


def sparse_step(device, b, topk, layers, repeats):
    h_q, d = 128, 576
    cache = ref.make_sparse_cache("v32", b, 1, topk + topk // 2, topk, 64, invalid_frac=0.02, scale_spread=False)
    q = ref.rand((b, 1, h_q, d))
    kv8, idx = cache.kv8.to(device), cache.indices.to(device)
    qd = q.to(device)

    def step():
        sched, _ = flash_mla.get_mla_metadata()
        for _ in range(layers):
            out, lse = flash_mla.flash_mla_with_kvcache(
                qd, kv8, None, None, 512, sched, softmax_scale=d ** -0.5, is_fp8_kvcache=True, indices=idx
            )
        return out, lse

    (out, lse), seconds = timed(step, device, repeats)
    with torch.device(device):
        want_out, want_lse = ref.ref_sparse_decode(qd, cache.tokens.to(device), idx, d ** -0.5)
    ref.check_is_allclose("sparse out", out, want_out, **ref.SPARSE_OUT_TOL)
    ref.check_is_allclose("sparse lse", lse, want_lse, **ref.SPARSE_LSE_TOL)
    flops = 2 * h_q * b * topk * (d + 512) * layers
    return f"V3.2 sparse b={b:<3} h_q={h_q} s_q=1 topk={topk}", seconds, flops


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--layers", type=int, default=2, help="layers sharing one plan per step")
    args = parser.parse_args()
    device = args.device if args.device != "auto" else ("cuda" if has_cuda_kernels() else "cpu")
    torch.manual_seed(0)
    if device == "cuda":
        runs = [dense_step(device, 128, 4096, args.layers, 20), sparse_step(device, 128, 2048, args.layers, 20)]
        where = torch.cuda.get_device_name()
    else:
        runs = [dense_step(device, 4, 1024, args.layers, 1), sparse_step(device, 4, 2048, args.layers, 1)]
        where = f"CPU backend, {os.cpu_count()} cores"
    print(f"mla-kernels decode step on {where} ({args.layers} layers per step, one plan per step)")
    for name, seconds, flops in runs:
        print(f"  {name:<44} matches the float64 reference   {seconds * 1e3:9.2f} ms/step  "
              f"{flops / seconds / 1e9:8.1f} GFLOP/s")


if __name__ == "__main__":
    main()
