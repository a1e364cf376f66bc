"""CUDA behaviour beyond single calls: a whole decode step (planner included) captured in a CUDA
graph and replayed after the lengths changed, bitwise determinism run to run and with stream-ordered
launches, and tensors on a device that is not the current one."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R

pytestmark = pytest.mark.cuda


def dense_inputs(b, max_len, h_q=16, page=64):
    lens = torch.randint(max_len // 2, max_len + 1, (b,)).tolist()
    lens[0] = max_len  # the block table is sized for max_len
    paged = R.make_dense_paged(lens, page, 1, 576, torch.bfloat16, spare_blocks=8)
    q = R.rand((b, 1, h_q, 576))
    return q.cuda(), paged.k_cache.cuda(), paged.block_table.cuda(), paged.cache_seqlens.cuda(), paged


def dense_step(q, kc, bt, seqlens, layers=2):
    """One decoding step: a fresh lazy plan, reused by every layer."""
    sched, _ = flash_mla.get_mla_metadata()
    outs = []
    for layer in range(layers):
        outs += flash_mla.flash_mla_with_kvcache(q * (layer + 1), kc, bt, seqlens, 512, sched)
    return outs


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def test_dense_step_graph_replans_on_replay():
    b = 24
    q, kc, bt, seqlens, paged = dense_inputs(b, 700)
    graph, outs = capture(lambda: dense_step(q, kc, bt, seqlens))
    for trial in range(3):
        # New lengths within each request's pages: the captured planner must see them.
        new = (paged.cache_seqlens * torch.rand(b) * 1.2).clamp(max=paged.cache_seqlens).to(torch.int32)
        new[trial] = 0
        seqlens.copy_(new)
        graph.replay()
        eager = dense_step(q, kc, bt, seqlens)
        for got, want in zip(outs, eager):
            assert torch.equal(got, want), "graph replay differs from the eager step"
        seqs = [s[: int(n)] for s, n in zip(paged.seqs, new)]
        ref_out, ref_lse = R.ref_dense_decode(q.cpu(), seqs, 576 ** -0.5, causal=False)
        R.check_is_allclose("out", outs[0].cpu(), ref_out, **R.DENSE_OUT_TOL)
        R.check_is_allclose("lse", outs[1].cpu(), ref_lse, **R.DENSE_LSE_TOL)


# 16 heads: the small-heads kernel; 64: one 64-head CTA per token; 128: a cluster of two (launched
# with a cluster dimension and programmatic dependent launch inside the graph).
@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_sparse_step_graph_replans_on_replay(h_q):
    b, topk = 16, 200
    # FlashMLA's data distribution (randn/10 keys): the GPU rounds P to bf16 before P.V, which the
    # SPEC tolerances allow for values of that size.
    main = R.make_sparse_cache("model1", b, 1, 300, topk, 64, with_topk_length=True, invalid_frac=0.05,
                               scale_spread=False)
    q = R.rand((b, 1, h_q, 512)).cuda()
    kv8, idx, lens = main.kv8.cuda(), main.indices.cuda(), main.topk_length.cuda()
    sink = torch.randn(h_q).cuda()

    def step():
        sched, _ = flash_mla.get_mla_metadata()
        return list(flash_mla.flash_mla_with_kvcache(q, kv8, None, None, 512, sched, is_fp8_kvcache=True,
                                                     indices=idx, attn_sink=sink, topk_length=lens))

    graph, outs = capture(step)
    # Shorter lengths only: every token they reference is still a clean (unpoisoned) one.
    new = (main.topk_length * torch.rand(b)).to(torch.int32)
    lens.copy_(new)
    graph.replay()
    eager = step()
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])
    ref_out, ref_lse = R.ref_sparse_decode(q.cpu(), main.tokens, main.indices, 512 ** -0.5, new, sink.cpu())
    R.check_is_allclose("out", outs[0].cpu(), ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("lse", outs[1].cpu(), ref_lse, **R.SPARSE_LSE_TOL)


def test_bitwise_deterministic_run_to_run():
    q, kc, bt, seqlens, _ = dense_inputs(64, 2000, h_q=128)
    first = dense_step(q, kc, bt, seqlens)
    for _ in range(3):
        again = dense_step(q, kc, bt, seqlens)
        assert all(torch.equal(a, b) for a, b in zip(first, again))

    main = R.make_sparse_cache("v32", 32, 2, 3000, 2048, 64, invalid_frac=0.05)
    qs = R.rand((32, 2, 128, 576)).cuda()
    args = (main.kv8.cuda(), None, None, 512)
    runs = []
    for _ in range(3):
        sched, _ = flash_mla.get_mla_metadata()
        runs.append(flash_mla.flash_mla_with_kvcache(qs, *args, sched, is_fp8_kvcache=True, indices=main.indices.cuda()))
    assert all(torch.equal(runs[0][0], r[0]) and torch.equal(runs[0][1], r[1]) for r in runs[1:])


@pytest.mark.parametrize("h_q", [16, 128])
def test_stream_ordered_launch_gives_the_same_bits(h_q, monkeypatch):
    """MLA_KERNELS_PDL=0 launches every kernel after the one before it ends: the planner, attention
    and combine kernels then never overlap, and the results are bit for bit those of the
    overlapped launch (which reads nothing before its predecessor is done)."""
    q, kc, bt, seqlens, _ = dense_inputs(48, 3000, h_q=h_q)
    main = R.make_sparse_cache("v32", 24, 1, 3000, 2048, 64, invalid_frac=0.05)
    qs = R.rand((24, 1, h_q, 576)).cuda()

    def both():
        dense = dense_step(q, kc, bt, seqlens)
        sched, _ = flash_mla.get_mla_metadata()
        sparse = flash_mla.flash_mla_with_kvcache(qs, main.kv8.cuda(), None, None, 512, sched, is_fp8_kvcache=True,
                                                  indices=main.indices.cuda())
        torch.cuda.synchronize()
        return list(dense) + list(sparse)

    overlapped = both()
    monkeypatch.setenv("MLA_KERNELS_PDL", "0")
    ordered = both()
    assert all(torch.isfinite(t.float()).all() for t in overlapped)
    assert all(torch.equal(a, b) for a, b in zip(overlapped, ordered))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: tensors on cuda:1 while cuda:0 is current")
def test_runs_on_the_device_of_q_not_the_current_one():
    torch.cuda.set_device(0)
    q, kc, bt, seqlens, paged = dense_inputs(8, 300)
    dev = torch.device("cuda:1")
    sched, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q.to(dev), kc.to(dev), bt.to(dev), seqlens.to(dev), 512, sched)
    assert out.device == dev and sched.tile_scheduler_metadata.device == dev
    assert torch.cuda.current_device() == 0
    ref_out, ref_lse = R.ref_dense_decode(q.cpu(), paged.seqs, 576 ** -0.5, causal=False)
    R.check_is_allclose("out", out.cpu(), ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse.cpu(), ref_lse, **R.DENSE_LSE_TOL)
