"""One plan, reused: engines plan once per decoding step and reuse the plan for every layer, on the
portable kernel and (64-token pages, 128 heads) the Hopper one alike. If the
lengths change under a reused plan the result must still be exact (each request's first piece
starts at its first block, its last piece runs to its last block); a plan of another batch is an
error on the CPU and never an out-of-bounds access on the GPU; shapes the checks reject never
reach a division by zero."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R


def dense_case(lens, h_q=16, page=16):
    paged = R.make_dense_paged(lens, page, 1, 576, torch.bfloat16)
    return R.rand((len(lens), 1, h_q, 576)), paged


# 16-token pages take the portable kernel; 64-token pages with 128 heads the Hopper 64-row kernel on sm90.
PATHS = [(16, 16), (128, 64)]


@pytest.mark.parametrize("h_q,page", PATHS)
@pytest.mark.parametrize("new_lens", [[40, 900, 0, 300], [1, 1, 1, 1], [500, 2000, 64, 1]])
def test_lazy_plan_reused_after_lengths_changed(device, new_lens, h_q, page):
    # The cache holds 2000 tokens per request; the plan is made for other lengths.
    q, paged = dense_case([2000, 2000, 2000, 2000], h_q, page)
    args = [t.to(device) for t in (q, paged.k_cache, paged.block_table)]
    sched, _ = flash_mla.get_mla_metadata()
    first_lens = torch.tensor([700, 60, 1500, 3], dtype=torch.int32)
    flash_mla.flash_mla_with_kvcache(args[0], args[1], args[2], first_lens.to(device), 512, sched)
    lens = torch.tensor(new_lens, dtype=torch.int32)
    out, lse = flash_mla.flash_mla_with_kvcache(args[0], args[1], args[2], lens.to(device), 512, sched)
    seqs = [s[:n] for s, n in zip(paged.seqs, new_lens)]
    ref_out, ref_lse = R.ref_dense_decode(q, seqs, 576 ** -0.5, causal=False)
    R.check_is_allclose("out", out.cpu(), ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse.cpu(), ref_lse, **R.DENSE_LSE_TOL)


def test_sparse_plan_reused_after_topk_length_changed(device):
    main = R.make_sparse_cache("model1", 6, 1, 300, 256, 64, with_topk_length=True, scale_spread=device == "cpu")
    q = R.rand((6, 1, 32, 512))
    sched, _ = flash_mla.get_mla_metadata()
    dev = lambda t: t.to(device)  # noqa: E731
    short = (main.topk_length // 3).to(torch.int32)
    flash_mla.flash_mla_with_kvcache(dev(q), dev(main.kv8), None, None, 512, sched, is_fp8_kvcache=True,
                                     indices=dev(main.indices), topk_length=dev(short))
    out, lse = flash_mla.flash_mla_with_kvcache(dev(q), dev(main.kv8), None, None, 512, sched, is_fp8_kvcache=True,
                                                indices=dev(main.indices), topk_length=dev(main.topk_length))
    ref_out, ref_lse = R.ref_sparse_decode(q, main.tokens, main.indices, 512 ** -0.5, main.topk_length)
    R.check_is_allclose("out", out.cpu(), ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("lse", lse.cpu(), ref_lse, **R.SPARSE_LSE_TOL)


def test_plan_of_another_batch_is_rejected_on_cpu():
    # A plan for 8 requests records its batch size; it does not serve the batch of the first four.
    q, paged = dense_case([640] * 8, h_q=128)
    tsm, ns = flash_mla.get_mla_metadata(paged.cache_seqlens, 128, 1)
    assert (tsm[:, 7] == 8).all()
    with pytest.raises(RuntimeError,
                       match="planned for a batch of 8 requests, not 4; was the plan made for another batch"):
        flash_mla.flash_mla_with_kvcache(q[:4], paged.k_cache, paged.block_table[:4], paged.cache_seqlens[:4], 512,
                                         tsm, ns[:5].contiguous())


@pytest.mark.cuda
@pytest.mark.parametrize("page", [16, 64])
def test_plan_of_another_batch_never_reads_out_of_bounds_on_cuda(page):
    q, paged = dense_case([640] * 8, h_q=128, page=page)
    kc, bt, sl = paged.k_cache.cuda(), paged.block_table.cuda(), paged.cache_seqlens.cuda()
    tsm, ns = flash_mla.get_mla_metadata(sl, 128, 1)
    out, lse = flash_mla.flash_mla_with_kvcache(q[:4].cuda(), kc, bt[:4], sl[:4], 512, tsm, ns[:5].contiguous())
    # Garbage metadata too: no request, split row or combine read may leave its tensor.
    garbage = torch.randint(-5, 50, tsm.shape, dtype=torch.int32, device="cuda")
    flash_mla.flash_mla_with_kvcache(q[:4].cuda(), kc, bt[:4], sl[:4], 512, garbage, ns[:5].contiguous())
    # Rows of the call's batch size pass the batch check: any request or block they name is clamped.
    wild = torch.tensor([-2**31, -1, 0, 3, 4, 2**31 - 1, bt.shape[1] - 1, bt.shape[1]], dtype=torch.int32)
    rows = wild[torch.randint(0, len(wild), tsm.shape, generator=torch.Generator().manual_seed(5))]
    rows[:, 7] = 4
    flash_mla.flash_mla_with_kvcache(q[:4].cuda(), kc, bt[:4], sl[:4], 512, rows.cuda(), ns[:5].contiguous())
    torch.cuda.synchronize()  # an illegal access would raise here
    assert out.shape == (4, 1, 128, 512)


@pytest.mark.parametrize("shape", [(2, 0, 16, 576), (2, 1, 0, 576)])
def test_empty_query_dims_raise_instead_of_dividing_by_zero(device, shape):
    _, paged = dense_case([30, 30])
    q = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"q: (s_q|h_q) \(dim [12]\) must be > 0"):
        flash_mla.flash_mla_with_kvcache(q.to(device), paged.k_cache.to(device), paged.block_table.to(device),
                                         paged.cache_seqlens.to(device), 512, flash_mla.get_mla_metadata()[0])


def test_metadata_rejects_sizes_past_int32():
    sl = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"h_k must be in \[1, 2\^31\)"):
        torch.ops.mla_kernels.get_mla_decoding_metadata(sl, 16, 2**32, None, False, None)
    with pytest.raises(RuntimeError, match="num_q_tokens_per_head_k must be in"):
        torch.ops.mla_kernels.get_mla_decoding_metadata(sl, 2**33, 1, None, False, None)
