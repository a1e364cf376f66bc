"""Sparse FP8 decode on the Hopper kernels (on sm90 by default: at most 32 heads the small-heads
kernel, more the 64-head-tile kernel, including head counts that are not a multiple of 64) and,
for the same inputs, on the portable kernel forced through MLA_KERNELS_IMPL=portable: each against
the float64 reference, both formats, every feature (sink, topk_length, extra cache with its own
page size, extra_topk_length, invalid and duplicate indices, lonely rows, requests split across
parts)."""

import os
import sys

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R
from test_sparse_decode import build, check_sparse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import call_timeline as T  # noqa: E402

pytestmark = pytest.mark.cuda

IMPLS = ["default", "portable"]

# (fmt, b, s_q, h_q, s_k, topk, page, topk_length, extra, sink, dup, padded)
CASES = {
    "v32_h16_topk200_tl_extra": ("v32", 3, 2, 16, 400, 200, 64, True, (150, 70, 16, True), "mixed", 0.05, True),
    "v32_h32_topk2048": ("v32", 2, 1, 32, 4096, 2048, 64, False, None, "finite", 0.0, False),
    "v32_h5_pg1": ("v32", 2, 3, 5, 90, 65, 1, True, None, "none", 0.1, False),
    "model1_h16_extra_pg256": ("model1", 2, 2, 16, 300, 128, 256, True, (200, 1024, 64, True), "finite", 0.0, True),
    "model1_h32_pg16": ("model1", 3, 1, 32, 500, 300, 16, False, (64, 7, 2, False), "neginf", 0.1, False),
    "model1_h1_topk1": ("model1", 2, 1, 1, 100, 1, 64, False, None, "posinf", 0.0, False),
    # Page blocks of 3 x 584 and 5 x 584 bytes: every other one only 8-byte aligned, so the warps'
    # records mix the 16-byte and the 8-byte loads.
    "model1_h16_pg3_extra_pg5": ("model1", 2, 1, 16, 300, 128, 3, True, (100, 40, 5, True), "mixed", 0.05, False),
    "v32_h128_topk200_tl_extra": ("v32", 3, 2, 128, 400, 200, 64, True, (150, 70, 16, True), "mixed", 0.05, True),
    "v32_h64_topk2048": ("v32", 2, 1, 64, 4096, 2048, 64, False, None, "finite", 0.0, False),
    "v32_h64_pg1": ("v32", 2, 3, 64, 90, 65, 1, True, None, "none", 0.1, False),
    "model1_h96_extra_pg256": ("model1", 2, 2, 96, 300, 128, 256, True, (200, 1024, 64, True), "finite", 0.0, True),
    "model1_h48_pg16": ("model1", 3, 1, 48, 500, 300, 16, False, (64, 7, 2, False), "neginf", 0.1, False),
    "model1_h128_topk2048": ("model1", 1, 2, 128, 8192, 2048, 64, True, None, "mixed", 0.0, False),
    "v32_h100_sq2_extra": ("v32", 2, 2, 100, 600, 320, 16, True, (90, 64, 1, True), "finite", 0.05, False),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_sparse_few_heads(case, impl, monkeypatch):
    fmt, b, s_q, h_q, s_k, topk, page, tl, extra, sink_mode, dup, padded = CASES[case]
    if impl == "portable":
        monkeypatch.setenv("MLA_KERNELS_IMPL", "portable")
    else:
        monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    main, ex = build(fmt, b, s_q, s_k, topk, page, tl=tl, extra=extra, dup=dup, padded=padded, device="cuda",
                     all_invalid_rows=[(0, 0)])
    q = R.rand((b, s_q, h_q, R.FORMATS[fmt].d))
    check_sparse(q, main, ex, R.make_sink(h_q, sink_mode), 1.0, device="cuda")


# Sharp softmax: a softmax scale that spreads the scores over tens of binades, so that the running
# max keeps moving by more than the 64-head kernel's rescale slack (2^8) from block to block, and
# also moves by less (blocks whose P stays above 1 against a stale max). With FlashMLA's data
# (randn/10) at the usual scales the max settles in the first block and only the skip path runs.
SHARP = {
    "v32_h128_topk1024": ("v32", 2, 1, 128, 2048, 1024, 64, False, None, "finite", 60.0),
    "v32_h64_sq2_extra": ("v32", 2, 2, 64, 600, 320, 16, True, (90, 64, 1, True), "mixed", 25.0),
    "model1_h128_extra": ("model1", 2, 1, 128, 300, 128, 256, True, (200, 512, 64, True), "none", 60.0),
    "v32_h16_topk1024": ("v32", 2, 1, 16, 2048, 1024, 64, False, None, "finite", 60.0),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(SHARP), ids=list(SHARP))
def test_sparse_sharp_softmax(case, impl, monkeypatch):
    fmt, b, s_q, h_q, s_k, topk, page, tl, extra, sink_mode, scale = SHARP[case]
    if impl == "portable":
        monkeypatch.setenv("MLA_KERNELS_IMPL", "portable")
    else:
        monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    main, ex = build(fmt, b, s_q, s_k, topk, page, tl=tl, extra=extra, device="cuda")
    q = R.rand((b, s_q, h_q, R.FORMATS[fmt].d))
    check_sparse(q, main, ex, R.make_sink(h_q, sink_mode), scale, device="cuda")


@pytest.mark.parametrize("h_q,s_q,b", [(16, 1, 100), (32, 2, 37), (16, 1, 300), (64, 1, 50), (128, 2, 20),
                                       (16, 1, 500), (64, 1, 400)])
def test_hopper_kernels_make_the_planners_plan(h_q, s_q, b, monkeypatch):
    """With a fresh plan the Hopper kernels (small-heads, 64-head tiles, clusters of two at 128
    heads) plan inside their CTAs, with no planner kernel: the rows and num_splits they store are
    those the planner kernel makes for the portable path, with the same part count, and a later
    call reusing them gives the same bits. 500 and 400 requests take the in-kernel planner more
    than one round of its 384 threads."""
    main, ex = build("model1", b, s_q, 2000, 512, 64, tl=True, extra=(300, 256, 64, True), device="cuda")
    q = R.rand((b, s_q, h_q, 512)).cuda()
    args = dict(is_fp8_kvcache=True, indices=main.indices.cuda(), topk_length=main.topk_length.cuda(),
                extra_k_cache=ex.kv8.cuda(), extra_indices_in_kvcache=ex.indices.cuda(),
                extra_topk_length=ex.topk_length.cuda())
    kv8 = main.kv8.cuda()
    monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    own, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, kv8, None, None, 512, own, **args)
    monkeypatch.setenv("MLA_KERNELS_IMPL", "portable")
    planned, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(q, kv8, None, None, 512, planned, **args)
    assert torch.equal(own.tile_scheduler_metadata, planned.tile_scheduler_metadata)
    assert torch.equal(own.num_splits, planned.num_splits)
    monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    again = flash_mla.flash_mla_with_kvcache(q, kv8, None, None, 512, own, **args)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


def kernels_launched(call):
    """Names of the CUDA kernels `call()` launches, in start order, and its result."""
    result, events = T.profiled(call)
    return [name for name, _, _ in T.spans_of_events(events, replays=1)], result


@pytest.mark.parametrize("fmt,h_q", [("v32", 16), ("v32", 32), ("model1", 16), ("v32", 128)])
def test_whole_uniform_calls_skip_the_combine(fmt, h_q, monkeypatch):
    """A call without per-request lengths that plans for itself, with as many requests as parts
    (one whole request each): the attention kernel alone, right against the reference, the plan
    it stores with no split. Two requests (each split over the parts): the combine runs after it.
    A reused plan always gets the combine (the host cannot see what it holds)."""
    monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    parts = torch.cuda.get_device_properties(0).multi_processor_count // (1 if h_q <= 64 else 2)
    for b, whole in ((parts, True), (2, False)):
        main, _ = build(fmt, b, 1, 300, 128, 64, device="cuda")
        q = R.rand((b, 1, h_q, R.FORMATS[fmt].d))
        sink = R.make_sink(h_q, "finite")
        names, (out, lse) = kernels_launched(lambda: check_sparse(q, main, None, sink, 1.0, device="cuda"))
        attention = [n for n in names if "sparse_decode" in n]
        combine = [n for n in names if "combine" in n]
        assert len(attention) == 1, names
        assert len(combine) == (0 if whole else 1), f"b={b}: {names}"

        meta, _ = flash_mla.get_mla_metadata()
        args = dict(softmax_scale=1.0, is_fp8_kvcache=True, indices=main.indices.cuda(), attn_sink=sink.cuda())
        kv8, qd = main.kv8.cuda(), q.cuda()
        fresh = flash_mla.flash_mla_with_kvcache(qd, kv8, None, None, 512, meta, **args)
        splits = meta.num_splits.cpu()
        assert torch.equal(splits[1:] - splits[:-1] == 1, torch.full((b,), whole)), splits
        names, again = kernels_launched(lambda: flash_mla.flash_mla_with_kvcache(qd, kv8, None, None, 512, meta, **args))
        assert len([n for n in names if "combine" in n]) == 1, names
        assert torch.equal(fresh[0], again[0]) and torch.equal(fresh[1], again[1])
        assert torch.equal(fresh[0].cpu(), out) and torch.equal(fresh[1].cpu(), lse)


# (fmt, h_q, s_q, topk, extra (s_k, topk, page, extra_topk_length), sink)
EVEN_PAIRS = {
    "v32_h16_topk2048": ("v32", 16, 1, 2048, None, "finite"),
    "v32_h16": ("v32", 16, 1, 320, None, "mixed"),
    "model1_h12_extra": ("model1", 12, 1, 320, (100, 64, 64, False), "mixed"),
    "v32_h5_sq2_extra_pg16": ("v32", 5, 2, 320, (100, 64, 16, False), "none"),
    "model1_h16_sq2_extra": ("model1", 16, 2, 128, (64, 64, 16, False), "neginf"),
    "v32_h32": ("v32", 32, 1, 320, None, "finite"),
}


@pytest.mark.parametrize("case", list(EVEN_PAIRS), ids=list(EVEN_PAIRS))
def test_even_split_merges_in_its_cluster(case, monkeypatch):
    """A uniform call (no per-request lengths) of half as many requests as parts, planning for
    itself, gets the even split of two pieces a request. At most 16 heads the small-heads kernel
    merges each request's two pieces in a cluster of two: the attention kernel alone, no combine,
    right against the reference, with heads past h_q and the sink's infinite cases; at 32 heads the
    combine merges them. The same plan reused (which the host cannot see into, so the combine merges
    the partials from the workspace) and the call with MLA_KERNELS_CLUSTER_MERGE=0 give the same
    bits."""
    fmt, h_q, s_q, topk, extra, sink_mode = EVEN_PAIRS[case]
    monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    monkeypatch.delenv("MLA_KERNELS_CLUSTER_MERGE", raising=False)
    parts = torch.cuda.get_device_properties(0).multi_processor_count // s_q
    if parts % 2:
        pytest.skip(f"{parts} parts: no clusters of two over them")
    b = parts // 2
    merged = h_q <= 16
    main, ex = build(fmt, b, s_q, max(600, topk + 100), topk, 64, extra=extra, device="cuda")
    q = R.rand((b, s_q, h_q, R.FORMATS[fmt].d))
    sink = R.make_sink(h_q, sink_mode)
    names, (out, lse) = kernels_launched(lambda: check_sparse(q, main, ex, sink, 1.0, device="cuda"))
    assert len([n for n in names if "sparse_decode" in n]) == 1, names
    assert len([n for n in names if "combine" in n]) == (0 if merged else 1), names

    args = dict(softmax_scale=1.0, is_fp8_kvcache=True, indices=main.indices.cuda(),
                attn_sink=None if sink is None else sink.cuda(),
                extra_k_cache=None if ex is None else ex.kv8.cuda(),
                extra_indices_in_kvcache=None if ex is None else ex.indices.cuda())
    kv8, qd = main.kv8.cuda(), q.cuda()

    def call(meta):
        return kernels_launched(lambda: flash_mla.flash_mla_with_kvcache(qd, kv8, None, None, 512, meta, **args))

    meta, _ = flash_mla.get_mla_metadata()
    names, fresh = call(meta)
    assert len([n for n in names if "combine" in n]) == (0 if merged else 1), names
    assert torch.equal(meta.num_splits.cpu(), 2 * torch.arange(b + 1, dtype=torch.int32)), meta.num_splits
    assert torch.equal(fresh[0].cpu(), out) and torch.equal(fresh[1].cpu(), lse)
    names, reused = call(meta)
    assert len([n for n in names if "combine" in n]) == 1, names
    monkeypatch.setenv("MLA_KERNELS_CLUSTER_MERGE", "0")
    unmerged_meta, _ = flash_mla.get_mla_metadata()
    names, unmerged = call(unmerged_meta)
    assert len([n for n in names if "combine" in n]) == 1, names
    for other in (reused, unmerged):
        assert torch.equal(fresh[0], other[0]), (fresh[0].float() - other[0].float()).abs().max()
        assert torch.equal(fresh[1], other[1]), (fresh[1] - other[1]).abs().max()
