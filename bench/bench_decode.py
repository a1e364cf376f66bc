"""Benchmark of whole API calls (planner + attention + combine) on the GPU, next to a plain PyTorch
implementation of the same call.

Timing as ANCHORS.md: each call captured 10 times in one CUDA graph, median of 20 replays. With
--flashmla both libraries' graphs are captured first and their replays alternate, so that the
card's clocks and temperature weigh on both alike.
FLOPs = 2 * h_q * s_q * sum(attended keys) * (d_qk + d_v); bytes = q + attended KV (each token once:
2*576 B dense, 576 B dense FP8, 656 B V3.2, 584 B MODEL1) + out. Fractions are of the card's
measured ceilings.

Usage: python3 bench/bench_decode.py [--cases NAME,...] [--no-torch] [--impls default,portable]
                                     [--env VAR=a,b] [--flashmla DIR] [--reuse-plan] [--kernels]
                                     [--between copy|gemm] [--sustained SECONDS]

NAME is a case of CASES, or any dense shape spelled the same way:
dense_b<b>[_sq<s_q>]_h<h_q>_sk<s_k>[_causal][_varlen][_fp8] (all lengths s_k unless _varlen; _fp8: q
and cache float8_e4m3fn; a name in CASES keeps its own definition, see case_by_name).

--reuse-plan times what every layer of a step after the first runs: the call with a plan made once
before the timing (FlashMLA's scheduler object, or ours, initialised by the warm-up call).
--impls and --env time variants of our call side by side, their graphs' replays alternated with one
another (and FlashMLA's): one per MLA_KERNELS_IMPL value, times one per value of the environment
variable VAR (read by the library when a call is made, so each graph keeps the setting it was
captured under), e.g. --env MLA_KERNELS_PDL=0,1.
--kernels adds, after each case, the GPU time per call of each kernel of every timed graph (planner,
attention, combine), from torch.profiler.
--between times each replay right after other work (a 1 GiB copy or a large matmul), as an attention
call runs between a layer's other kernels, rather than on a GPU whose caches still hold the previous
replay's data and whose clocks have idled.
--sustained SECONDS also times each graph alone, as an engine runs one library: after 2 s idle, its
replays back to back for SECONDS, and prints the median time per call over the window's second
half, the energy per call (NVML's energy counter over that half) and the median SM clock. Under a
sustained load the card holds its power limit (700 W on an H200) by lowering its clocks, so a call
that takes more energy runs at lower clocks: alternated replays share one clock between the
libraries and hide that.
"""

import argparse
import ctypes
import math
import os
import re
import statistics
import sys
import time
import warnings
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import reference as R  # noqa: E402

import mla_kernels.flash_mla as flash_mla  # noqa: E402

COPY_GBPS = 4274.0  # H200 device-to-device copy, bytes read + written (ANCHORS.md)
MATMUL_TFLOPS = 778.0  # H200 bf16 8192^3 through cuBLAS (ANCHORS.md)


def capture(fn, calls=10):
    """A CUDA graph of `calls` calls of fn, after one warm-up call on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


BETWEEN = None  # --between: a graph of other work replayed (untimed) before each timed replay


def time_graphs(graphs, calls=10, replays=20):
    """Median microseconds per call of each graph, the graphs' replays taken in turn (A B A B ...)
    so that clocks, power and temperature weigh on each alike; with --between each timed replay
    follows a replay of other work on the same stream, with no idle gap."""
    times = [[] for _ in graphs]
    for _ in range(replays):
        for graph, t in zip(graphs, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if BETWEEN is not None:
                BETWEEN.replay()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            t.append(start.elapsed_time(end) / calls * 1e3)
    return [statistics.median(t) for t in times]


def short_kernel_name(name):
    """A kernel's name without namespaces, template arguments and parameters, e.g.
    'void mla::cuda::(anonymous namespace)::combine_kernel<__nv_bfloat16, 4>(mla::CombineParams)' ->
    'combine_kernel'."""
    name = name.replace("(anonymous namespace)::", "")
    return re.split(r"[<(]", name, maxsplit=1)[0].split("::")[-1].split()[-1]


def per_call_kernel_times(events, calls):
    """[(kernel, microseconds per call)], longest first, from (kernel name, microseconds) events of
    `calls` calls."""
    totals = {}
    for name, us in events:
        key = short_kernel_name(name)
        totals[key] = totals.get(key, 0.0) + us
    return sorted(((k, v / calls) for k, v in totals.items()), key=lambda kv: -kv[1])


def kernel_times(graph, calls=10, replays=5):
    """GPU time per call of each kernel (and memset) a graph's replays run, by torch.profiler. A kernel
    launched early as a programmatic dependent counts from its launch, so its time can include a wait
    for the kernel before it."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with warnings.catch_warnings():
        # One profiling cycle, no schedule: its note that events are cleared per cycle says nothing here.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = ((e.name, getattr(e, "device_time", None) or e.device_time_total)
              for e in prof.events() if e.device_type == cuda)
    return per_call_kernel_times(events, calls * replays)


def between_graph(kind):
    """Other work of a decoding step, as a layer's attention finds the GPU after it: "copy" moves 1 GiB
    (caches and TLBs hold none of the attention's data afterwards), "gemm" multiplies 8192^3 in bf16
    (the card at its power limit, its clocks where the matmul leaves them)."""
    if kind == "copy":
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        operands = (src, torch.empty_like(src))
        graph = capture(lambda: operands[1].copy_(operands[0]), calls=1)
    else:
        operands = tuple(torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        graph = capture(lambda: operands[0] @ operands[1], calls=1)
    # The graph names its operands' memory but does not own it: they live as long as it does (else
    # the next capture's empty_cache would hand the memory back while the graph still uses it).
    graph.operands = operands
    return graph


class Nvml:
    """The driver's NVML library (libnvidia-ml, which every driver install ships) through ctypes:
    the card's energy counter and SM clock."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise SystemExit(f"--sustained needs the driver's NVML library (libnvidia-ml.so.1): {e}")
        if self.lib.nvmlInit_v2() != 0:
            raise SystemExit("--sustained: nvmlInit failed")
        # NVML numbers every GPU of the machine and CUDA only the visible ones
        # (CUDA_VISIBLE_DEVICES): the card is found by its PCI address.
        bus_id = pci_bus_id(torch.cuda.get_device_properties(torch.cuda.current_device()))
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(self.handle)) != 0:
            raise SystemExit(f"--sustained: NVML knows no device at PCI address {bus_id}")

    def energy_mj(self):
        """Energy used by the card since the driver loaded, millijoules."""
        value = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(value)) != 0:
            raise SystemExit("--sustained: the card reports no energy counter")
        return value.value

    def sm_clock_mhz(self):
        value = ctypes.c_uint()
        if self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(value)) != 0:  # NVML_CLOCK_SM
            raise SystemExit("--sustained: the card reports no SM clock")
        return value.value


def pci_bus_id(props):
    """A CUDA device's PCI address as NVML spells it ("domain:bus:device.0", hexadecimal)."""
    return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def sustained_summary(us_per_call, clocks_mhz, start, energy_mj, calls):
    """(median us per call, mJ per call, median MHz) of one sustained window's second half, once the
    clocks have settled: the time and SM clock of each replay in order, the first replay of the
    second half, the energy counter's rise over the second half and the calls a replay runs."""
    n = len(us_per_call)
    if len(clocks_mhz) != n or not 0 < start < n or calls <= 0:
        raise ValueError("a sustained window needs a time and a clock for each replay, a second half of "
                         "one or more replays after a first, and calls")
    return (statistics.median(us_per_call[start:]), energy_mj / ((n - start) * calls),
            statistics.median(clocks_mhz[start:]))


def time_sustained(graph, nvml, seconds, calls=10, idle=2.0):
    """One graph alone: idle, then replays back to back for `seconds` (sustained_summary). The
    energy counter is read once halfway and once at the end: a reading takes milliseconds, which
    the GPU would spend idle between replays."""
    torch.cuda.synchronize()
    time.sleep(idle)
    times, clocks = [], []
    t_mid = time.time() + seconds / 2
    t_end = t_mid + seconds / 2
    half, e_half = None, None
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    while time.time() < t_end or half is None or len(times) <= half:
        end = torch.cuda.Event(enable_timing=True)
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls * 1e3)
        clocks.append(nvml.sm_clock_mhz())
        if half is None and time.time() >= t_mid:
            half, e_half = len(times), nvml.energy_mj()
            # The reading's pause is not a replay's time: the next replay is timed from its start.
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        start = end
    return sustained_summary(times, clocks, half, nvml.energy_mj() - e_half, calls)


def time_call(fn, calls=10, replays=20):
    return time_graphs([capture(fn, calls)], calls, replays)[0]


REUSE_PLAN = False  # --reuse-plan


def scheduled(api):
    """A call's scheduler metadata: a fresh one per call (the whole API call, planner included), or
    with --reuse-plan one object made here, planned by the first call and reused by every later one."""
    if REUSE_PLAN:
        sched, _ = api.get_mla_metadata()
        return lambda: sched
    return lambda: api.get_mla_metadata()[0]


def varlen(b, mean, s_q):
    return torch.normal(float(mean), mean / 2, (b,)).clamp(min=s_q).int().tolist()


# ---- dense -----------------------------------------------------------------------------------

def torch_dense(q, kc, bt, seqlens, causal):
    b, s_q, h_q, d = q.shape
    page = kc.shape[1]
    max_len = int(bt.shape[1]) * page
    keys = kc[bt.clamp(0, kc.shape[0] - 1).long()].view(b, max_len, kc.shape[2], d)[:, :, 0]  # h_k = 1
    scores = torch.einsum("bshd,bld->bshl", q, keys).float() * d ** -0.5
    pos = torch.arange(max_len, device=q.device)
    limit = seqlens[:, None] - s_q + torch.arange(s_q, device=q.device)[None, :] if causal else seqlens[:, None] - 1
    mask = pos[None, None, :] <= (limit if causal else limit.expand(b, s_q))[..., None]
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("bshl,bld->bshd", torch.softmax(scores, -1).to(q.dtype), keys[..., :512])
    return out, lse


def pad_heads(t, heads):
    """t [.., h, ...] (heads on dim 2, or dim 0 for a sink) zero-padded to `heads`: FlashMLA's sparse
    decode on sm90 runs 64 or 128 heads, so smaller head counts are padded by its callers."""
    dim = 2 if t.dim() == 4 else 0
    if t.shape[dim] == heads:
        return t
    shape = list(t.shape)
    shape[dim] = heads
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def sparse_heads(api, h_q):
    """Heads the call runs with: ours natively; FlashMLA padded to a multiple of 64."""
    return h_q if api is flash_mla else -(-h_q // 64) * 64


def dense_case(b, s_q, h_q, s_k, causal, fixed=False, fp8=False, api=flash_mla):
    """fp8: q and cache float8_e4m3fn with their descales (`fwd_kvcache_mla_fp8`, which FlashMLA does
    not offer), through the same scheduler object as the BF16 call (planned per call, or once with
    --reuse-plan)."""
    lens = [s_k] * b if fixed else varlen(b, s_k, s_q)
    paged = R.make_dense_paged(lens, 64, 1, 576, torch.bfloat16, poison="random", garbage_cols=0)
    q = R.rand((b, s_q, h_q, 576)).cuda()
    kc, bt, sl = paged.k_cache.cuda(), paged.block_table.cuda(), paged.cache_seqlens.cuda()
    bt = bt.clamp(0, kc.shape[0] - 1)
    attended = sum(lens) * s_q  # each row of each query token (causal trims a few)
    flops = 2 * h_q * attended * (576 + 512)

    plan = scheduled(api)
    if fp8:
        if api is not flash_mla:
            raise AttributeError("dense FP8 decode (fwd_kvcache_mla_fp8) is not in FlashMLA")
        # One scale for q and the cache, as SGLang passes its k_scale as both descales.
        scale = torch.full((1,), 0.02, device="cuda")
        q8 = (q.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        kc8 = (kc.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)

        def ours():
            return api.flash_mla_with_kvcache(q8, kc8, bt, sl, 512, plan(), causal=causal, descale_q=scale,
                                              descale_k=scale)

        def plain():  # dequantised to bf16 first, as a plain implementation would
            return torch_dense((q8.float() * scale).bfloat16(), (kc8.float() * scale).bfloat16(), bt, sl, causal)

        bytes_ = q8.numel() + sum(lens) * 576 + b * s_q * h_q * 512 * 2
        return ours, plain, flops, bytes_

    def ours():
        sched = plan()
        return api.flash_mla_with_kvcache(q, kc, bt, sl, 512, sched, causal=causal)

    bytes_ = q.numel() * 2 + sum(lens) * 576 * 2 + b * s_q * h_q * 512 * 2
    return ours, (lambda: torch_dense(q, kc, bt, sl, causal)), flops, bytes_


# ---- sparse decode ---------------------------------------------------------------------------

def torch_sparse(q, kv8, idx, fmt, sink=None):
    tokens = dequant_tokens(kv8, fmt)
    n = tokens.shape[0]
    valid = (idx >= 0) & (idx < n)
    keys = tokens[idx.clamp(0, n - 1).long()]  # [b, s_q, topk, d]
    d = q.shape[-1]
    scores = torch.einsum("bshd,bstd->bsht", q, keys).float() * d ** -0.5
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    out = torch.einsum("bsht,bstd->bshd", torch.softmax(scores, -1).to(q.dtype), keys[..., :512])
    return out


def dequant_tokens(kv8, fmt):
    """Whole-cache dequantisation in PyTorch (what a plain implementation has to do)."""
    nb, page = kv8.shape[:2]
    if fmt == "v32":
        raw = kv8.view(nb * page, 656)
        nope = raw[:, :512].view(torch.float8_e4m3fn).float()
        scales = raw[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
        rope = raw[:, 528:].contiguous().view(torch.bfloat16)
        return torch.cat([(nope * scales).bfloat16(), rope], 1)
    blocks = kv8.reshape(nb, page * 584)
    rec = blocks[:, : page * 576].reshape(nb * page, 576)
    sc = blocks[:, page * 576:].reshape(nb * page, 8)[:, :7]
    scales = torch.pow(2.0, sc.float() - 127).repeat_interleave(64, dim=1)
    nope = rec[:, :448].contiguous().view(torch.float8_e4m3fn).float()
    return torch.cat([(nope * scales).bfloat16(), rec[:, 448:].contiguous().view(torch.bfloat16)], 1)


def sparse_case(fmt, b, s_q, h_q, topk, s_k=4096, api=flash_mla):
    d = 576 if fmt == "v32" else 512
    main = R.make_sparse_cache(fmt, b, s_q, max(s_k, topk), topk, 64, invalid_frac=0.0, poison="random",
                               scale_spread=False)
    q = R.rand((b, s_q, h_q, d)).cuda()
    kv8, idx = main.kv8.cuda(), main.indices.cuda()
    q_run = pad_heads(q, sparse_heads(api, h_q))

    plan = scheduled(api)

    def ours():
        sched = plan()
        return api.flash_mla_with_kvcache(q_run, kv8, None, None, 512, sched, is_fp8_kvcache=True, indices=idx)

    attended = b * s_q * topk
    flops = 2 * h_q * attended * (d + 512)
    unique = int(torch.unique(main.indices).numel())
    bytes_ = q.numel() * 2 + unique * (656 if fmt == "v32" else 584) + b * s_q * h_q * 512 * 2
    return ours, (lambda: torch_sparse(q, kv8, idx, fmt)), flops, bytes_


def model1_mixed_case(b=128, h_q=128, api=flash_mla):
    """MODEL1: topk 128 over a page-256 cache with topk_length, plus extra topk 1024 over a page-64
    cache with extra_topk_length, attention sink (DeepSeek-V4 decode)."""
    main = R.make_sparse_cache("model1", b, 1, 4096, 128, 256, invalid_frac=0.0, with_topk_length=True,
                               poison="random", scale_spread=False)
    extra = R.make_sparse_cache("model1", b, 1, 4096, 1024, 64, invalid_frac=0.0, with_topk_length=True,
                                poison="random", scale_spread=False)
    q = R.rand((b, 1, h_q, 512)).cuda()
    sink = torch.randn(h_q).cuda()
    args = [t.cuda() for t in (main.kv8, main.indices, main.topk_length, extra.kv8, extra.indices, extra.topk_length)]

    heads = sparse_heads(api, h_q)
    q_run, sink_run = pad_heads(q, heads), pad_heads(sink, heads)

    plan = scheduled(api)

    def ours():
        sched = plan()
        return api.flash_mla_with_kvcache(q_run, args[0], None, None, 512, sched, is_fp8_kvcache=True,
                                          indices=args[1], topk_length=args[2], attn_sink=sink_run,
                                          extra_k_cache=args[3], extra_indices_in_kvcache=args[4],
                                          extra_topk_length=args[5])

    attended = int(main.topk_length.sum() + extra.topk_length.sum())
    flops = 2 * h_q * attended * (512 + 512)
    bytes_ = q.numel() * 2 + attended * 584 + b * h_q * 512 * 2
    return ours, None, flops, bytes_


def prefill_case(s_q=4096, s_kv=32768, h_q=128, topk=2048, api=flash_mla):
    case = R.make_prefill_case(s_q, s_kv, h_q, 576, topk, invalid_frac=0.0, poison=False)
    q, kv, idx = case.q.cuda(), case.kv.cuda(), case.indices.cuda()

    def ours():
        return api.flash_mla_sparse_fwd(q, kv, idx, 576 ** -0.5)

    flops = 2 * h_q * s_q * topk * (576 + 512)
    bytes_ = s_q * topk * 576 * 2 + s_q * h_q * (576 + 512) * 2
    return ours, None, flops, bytes_


CASES = {
    "dense_b128_h128_sk4096_varlen": lambda **kw: dense_case(128, 1, 128, 4096, False, **kw),
    "dense_b128_h16_sk8192": lambda **kw: dense_case(128, 1, 16, 8192, False, fixed=True, **kw),
    "dense_b128_sq2_h128_sk8192_causal_varlen": lambda **kw: dense_case(128, 2, 128, 8192, True, **kw),
    "dense_b2_h128_sk65536": lambda **kw: dense_case(2, 1, 128, 65536, False, fixed=True, **kw),
    "dense_b8_h128_sk1024": lambda **kw: dense_case(8, 1, 128, 1024, False, **kw),
    # short sequences at a large batch: each CTA runs two 8-block pieces, so what a change of piece
    # costs beyond the blocks shows
    "dense_b128_h128_sk512": lambda **kw: dense_case(128, 1, 128, 512, False, fixed=True, **kw),
    # small batches, short and long sequences (the plan splits long ones across many parts)
    "dense_b1_h128_sk512": lambda **kw: dense_case(1, 1, 128, 512, False, fixed=True, **kw),
    "dense_b1_h128_sk65536": lambda **kw: dense_case(1, 1, 128, 65536, False, fixed=True, **kw),
    "dense_b4_h128_sk8192": lambda **kw: dense_case(4, 1, 128, 8192, False, **kw),
    "dense_b8_h128_sk32768": lambda **kw: dense_case(8, 1, 128, 32768, False, **kw),
    # FP8 caches (fwd_kvcache_mla_fp8; not in FlashMLA): half the bytes of the BF16 cases above
    "dense_b128_h128_sk4096_varlen_fp8": lambda **kw: dense_case(128, 1, 128, 4096, False, fp8=True, **kw),
    "dense_b128_h16_sk8192_fp8": lambda **kw: dense_case(128, 1, 16, 8192, False, fixed=True, fp8=True, **kw),
    "sparse_v32_b128_h128_topk2048": lambda **kw: sparse_case("v32", 128, 1, 128, 2048, **kw),
    "sparse_v32_b128_h16_topk2048": lambda **kw: sparse_case("v32", 128, 1, 16, 2048, **kw),
    "sparse_v32_b64_h32_topk2048": lambda **kw: sparse_case("v32", 64, 1, 32, 2048, **kw),
    "sparse_v32_b128_sq2_h128_topk2048": lambda **kw: sparse_case("v32", 128, 2, 128, 2048, **kw),
    "sparse_v32_b32_sq2_h128_topk2048": lambda **kw: sparse_case("v32", 32, 2, 128, 2048, **kw),
    "sparse_model1_b128_h128_mixed_sink": lambda **kw: model1_mixed_case(**kw),
    "sparse_model1_b128_h16_mixed_sink": lambda **kw: model1_mixed_case(h_q=16, **kw),
    "prefill_v32_sq4096_skv32768_h128_topk2048": lambda **kw: prefill_case(**kw),
}


DENSE_NAME = re.compile(r"dense_b(\d+)(?:_sq(\d+))?_h(\d+)_sk(\d+)(_causal)?(_varlen)?(_fp8)?")
SPARSE_NAME = re.compile(r"sparse_(v32|model1)_b(\d+)(?:_sq(\d+))?_h(\d+)_topk(\d+)")


def case_by_name(name):
    """A named case, or any dense shape spelled like the named ones: dense_b<b>[_sq<s_q>]_h<h_q>_sk<s_k>
    [_causal][_varlen][_fp8] (lengths all s_k unless _varlen; _fp8: q and cache float8_e4m3fn), or
    any sparse one: sparse_<v32|model1>_b<b>
    [_sq<s_q>]_h<h_q>_topk<topk> (one cache of page 64, no lengths), for sweeps beyond the fixed list. A name in
    CASES keeps its definition: dense_b4_h128_sk8192, dense_b8_h128_sk1024 and dense_b8_h128_sk32768
    are varlen there, as in every earlier RESULTS table, although their names lack _varlen."""
    if name in CASES:
        return CASES[name]
    m = SPARSE_NAME.fullmatch(name)
    if m:
        fmt, b, s_q, h_q, topk = m[1], int(m[2]), int(m[3] or 1), int(m[4]), int(m[5])
        return lambda **kw: sparse_case(fmt, b, s_q, h_q, topk, **kw)
    m = DENSE_NAME.fullmatch(name)
    if not m:
        raise SystemExit(f"unknown case {name!r}: one of {', '.join(CASES)}, dense_b<b>[_sq<s_q>]_h<h>_sk<s_k>"
                         "[_causal][_varlen][_fp8] or sparse_<v32|model1>_b<b>[_sq<s_q>]_h<h>_topk<topk>")
    b, s_q, h_q, s_k = int(m[1]), int(m[2] or 1), int(m[3]), int(m[4])
    return lambda **kw: dense_case(b, s_q, h_q, s_k, bool(m[5]), fixed=not m[6], fp8=bool(m[7]), **kw)


def load_flashmla(path):
    """FlashMLA's Python package built from source outside this repository (`path` holds the
    `flash_mla` package with its compiled extension); its API is the one ours mirrors."""
    sys.path.insert(0, path)
    import flash_mla as fm  # noqa: E402
    return fm


def set_env(values):
    """Sets each variable of `values` (a value of None unsets it)."""
    for key, val in values.items():
        if val is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = val


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--no-torch", action="store_true", help="skip the plain PyTorch implementations")
    parser.add_argument("--impls", default="default",
                        help="comma-separated MLA_KERNELS_IMPL values to time side by side ('default': the "
                             "dispatch's choice), e.g. default,portable")
    parser.add_argument("--env", metavar="VAR=a,b",
                        help="also time our call captured under each of these values of the environment "
                             "variable VAR (replays alternated)")
    parser.add_argument("--flashmla", metavar="DIR",
                        help="also time FlashMLA (the `flash_mla` package in DIR) on the same inputs; "
                             "sparse calls with h_q not a multiple of 64 are padded to it, as FlashMLA needs")
    parser.add_argument("--reuse-plan", action="store_true",
                        help="plan once before timing (what layers after a step's first run)")
    parser.add_argument("--kernels", action="store_true",
                        help="after each case, the GPU time per call of each kernel of every timed graph "
                             "(torch.profiler over 5 more replays)")
    parser.add_argument("--between", choices=["copy", "gemm"],
                        help="replay other work (a 1 GiB copy, or an 8192^3 bf16 matmul) before each timed "
                             "replay, as the layers around an attention call leave the GPU")
    parser.add_argument("--sustained", type=float, metavar="SECONDS",
                        help="also time each graph alone, its replays back to back for SECONDS after 2 s "
                             "idle: time per call, energy per call and SM clock under the card's power limit")
    args = parser.parse_args()
    if args.sustained is not None and not args.sustained > 0:
        parser.error(f"--sustained {args.sustained:g}: the window must last more than 0 seconds")
    nvml = Nvml() if args.sustained else None
    global REUSE_PLAN, BETWEEN
    REUSE_PLAN = args.reuse_plan
    BETWEEN = between_graph(args.between) if args.between else None
    impls = args.impls.split(",")
    env_var, env_values = None, [None]
    if args.env:
        env_var, _, values = args.env.partition("=")
        if not env_var or not values:
            raise SystemExit(f"--env {args.env!r}: expected VAR=value[,value...]")
        env_values = values.split(",")
    # (label, MLA_KERNELS_IMPL or None, value of env_var or None) per variant of our call.
    variants = [(" ".join(x for x in (impl if len(impls) > 1 else "", f"{env_var}={v}" if env_var else "") if x),
                 None if impl == "default" else impl, v) for impl in impls for v in env_values]
    fm = load_flashmla(args.flashmla) if args.flashmla else None
    how = "; plan reused" if REUSE_PLAN else ""
    if args.between:
        how += f"; each replay after a {args.between} graph"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; whole API call, CUDA graph of 10 calls, "
          f"median of 20 replays{how}; ceilings {COPY_GBPS:.0f} GB/s copy, {MATMUL_TFLOPS:.0f} TFLOPS bf16")
    header = f"{'case':<44} {'us':>9} {'TFLOPS':>8} {'GB/s':>8} {'%mm':>6} {'%copy':>6} {'torch us':>10} {'speedup':>8}"
    if fm:
        header += f" {'FlashMLA us':>12} {'vs FlashMLA':>12}"
    print(header)
    for name in args.cases.split(","):
        seed = zlib.crc32(name.encode())
        torch.manual_seed(seed)  # both libraries get the same inputs
        case = case_by_name(name)
        ours, plain, flops, bytes_ = case()
        t_fm, g_fm, theirs = float("nan"), None, None
        if fm:
            torch.manual_seed(seed)
            try:
                theirs, _, _, _ = case(api=fm)
                g_fm = capture(theirs)
            except (AttributeError, RuntimeError, AssertionError) as e:  # a call FlashMLA does not offer
                print(f"# FlashMLA {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        saved = {k: os.environ.get(k) for k in ("MLA_KERNELS_IMPL", env_var) if k}
        graphs = [] if g_fm is None else [g_fm]
        for _, impl, value in variants:  # each graph keeps the setting it was captured under
            set_env({"MLA_KERNELS_IMPL": impl, **({env_var: value} if env_var else {})})
            graphs.append(capture(ours))
        set_env(saved)
        times = time_graphs(graphs)
        alone = [time_sustained(g, nvml, args.sustained) for g in graphs] if nvml else []
        breakdown = []
        if args.kernels:
            labels = ([] if g_fm is None else ["FlashMLA"]) + [f"ours [{v}]" if v else "ours" for v, _, _ in variants]
            breakdown = [(label, kernel_times(g)) for label, g in zip(labels, graphs)]
        fm_alone = alone.pop(0) if alone and g_fm is not None else None
        if g_fm is not None:
            t_fm = times.pop(0)
        del graphs, g_fm, theirs
        torch.cuda.empty_cache()
        t_torch = float("nan")
        if plain is not None and not args.no_torch:
            try:
                t_torch = time_call(plain, calls=2, replays=5)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
        for (variant, _, _), t in zip(variants, times):
            tflops, gbps = flops / t / 1e6, bytes_ / t / 1e3
            label = f"{name} [{variant}]" if variant else name
            line = (f"{label:<44} {t:9.1f} {tflops:8.1f} {gbps:8.0f} {100 * tflops / MATMUL_TFLOPS:5.1f}% "
                    f"{100 * gbps / COPY_GBPS:5.1f}% {t_torch:10.1f} {t_torch / t:7.2f}x")
            if fm:
                line += f" {t_fm:12.1f} {t_fm / t:11.2f}x"
            print(line, flush=True)
        for (variant, _, _), (us, mj, mhz) in zip(variants, alone):
            line = f"#   alone for {args.sustained:g} s: {name}{f' [{variant}]' if variant else ''} {us:.1f} us, {mj:.1f} mJ, {mhz:.0f} MHz"
            if fm_alone:
                line += f"; FlashMLA {fm_alone[0]:.1f} us, {fm_alone[1]:.1f} mJ, {fm_alone[2]:.0f} MHz; {fm_alone[0] / us:.2f}x"
            print(line, flush=True)
        for label, kernels in breakdown:
            print(f"#   {label}: " + ", ".join(f"{k} {us:.1f}" for k, us in kernels) + " us per call", flush=True)
        del ours, plain
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
