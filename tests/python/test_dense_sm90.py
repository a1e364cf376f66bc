"""Dense decode on the Hopper kernels (64-token pages, BF16/FP16) and, for the same inputs, on the
others forced through MLA_KERNELS_IMPL: each against the float64 reference.

On an sm90 GPU the default dispatch runs the two-warpgroup 64-row kernel for every row count
(tests/cpp test_cuda_common.cu checks the choice); "sm90_small" forces the small-rows kernel, which
takes at most 32 query rows per KV head (for more, the test asserts that forcing it is refused with
an error naming it), and "portable" the portable one. On other GPUs only the default and portable
runs exist (both portable). The cases
cover odd head counts, h_k > 1, s_q > 1 with causal masks, odd and even numbers of key blocks (the
kernel takes blocks in pairs), pieces split across parts, zero lengths, NaN in every unused slot
and invalid block-table entries inside a sequence."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R

pytestmark = pytest.mark.cuda

def _impls():
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return ["default", "sm90_small", "portable"] if hopper else ["default", "portable"]


IMPLS = _impls()


def run(q, paged, causal, scale, impl, monkeypatch, lazy=True):
    if impl != "default":
        monkeypatch.setenv("MLA_KERNELS_IMPL", impl)
    else:
        monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    q_d, kc, bt, sl = (R.to_device(t, "cuda") for t in (q, paged.k_cache, paged.block_table, paged.cache_seqlens))
    if lazy:
        meta, _ = flash_mla.get_mla_metadata()
        out, lse = flash_mla.flash_mla_with_kvcache(q_d, kc, bt, sl, 512, meta, softmax_scale=scale, causal=causal)
    else:
        b, s_q, h_q, _ = q.shape
        tsm, ns = flash_mla.get_mla_metadata(sl, s_q * h_q // kc.shape[2], kc.shape[2])
        out, lse = flash_mla.flash_mla_with_kvcache(q_d, kc, bt, sl, 512, tsm, ns, softmax_scale=scale, causal=causal)
    return R.to_cpu(out, "cuda"), R.to_cpu(lse, "cuda")


def refused(q, paged, causal, scale, impl, monkeypatch, lazy=True):
    """The small-rows kernel forced on more than 32 query rows per KV head: asserts the call is
    refused with an error naming it, and says so (the caller then has nothing to compare)."""
    b, s_q, h_q, _ = q.shape
    if impl != "sm90_small" or s_q * h_q // paged.k_cache.shape[2] <= 32:
        return False
    with pytest.raises(RuntimeError, match="sm90_small lacks"):
        run(q, paged, causal, scale, impl, monkeypatch, lazy)
    return True


def check(q, paged, causal, scale, impl, monkeypatch, lazy=True):
    if refused(q, paged, causal, scale, impl, monkeypatch, lazy):
        return None
    out, lse = run(q, paged, causal, scale, impl, monkeypatch, lazy)
    ref_out, ref_lse = R.ref_dense_decode(q, paged.seqs, scale, causal)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)
    lonely = torch.isposinf(ref_lse).transpose(1, 2)
    assert (out[lonely] == 0).all(), "lonely rows must have out == 0 exactly"
    return out, lse


# (seqlens, s_q, h_q, h_k, causal, dtype, d_qk)
CASES = [
    ([64, 1, 200], 1, 1, 1, False, torch.bfloat16, 576),
    ([130, 0, 63], 2, 3, 1, True, torch.float16, 576),
    ([257, 64, 129], 1, 16, 1, False, torch.bfloat16, 576),
    ([191, 320], 2, 63, 1, True, torch.bfloat16, 576),
    ([65, 2, 0, 384], 1, 64, 1, False, torch.float16, 512),
    ([700, 33], 1, 126, 1, False, torch.bfloat16, 576),
    ([128, 513], 2, 128, 1, True, torch.bfloat16, 576),
    ([300, 77], 4, 32, 1, True, torch.float16, 576),
    ([90, 450], 1, 128, 2, False, torch.bfloat16, 512),
    ([0, 0], 1, 16, 1, False, torch.bfloat16, 576),
    # at most 32 rows per KV head (the small-rows kernel by default)
    ([520, 64, 1], 2, 16, 1, True, torch.bfloat16, 576),
    ([333, 129], 1, 32, 1, False, torch.float16, 576),
    ([200, 75], 1, 64, 4, False, torch.bfloat16, 576),
    ([96, 300], 4, 8, 1, True, torch.bfloat16, 512),
    ([1, 2, 3], 3, 5, 1, True, torch.float16, 512),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seqlens,s_q,h_q,h_k,causal,dtype,d", CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}_sq{c[1]}_hq{c[2]}_hk{c[3]}_"
                              f"{'causal' if c[4] else 'full'}_{str(c[5])[6:]}_d{c[6]}" for c in CASES])
def test_page64(seqlens, s_q, h_q, h_k, causal, dtype, d, impl, monkeypatch):
    paged = R.make_dense_paged(seqlens, 64, h_k, d, dtype)
    q = R.rand((len(seqlens), s_q, h_q, d), dtype)
    check(q, paged, causal, d ** -0.5, impl, monkeypatch)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("h_q", [16, 128])
def test_long_sequences_split_across_parts(h_q, impl, monkeypatch):
    """Few requests with thousands of keys: the plan splits them, the combine merges the pieces."""
    seqlens = [4096 + 37, 64 * 45, 3000, 1]
    paged = R.make_dense_paged(seqlens, 64, 1, 576, torch.bfloat16)
    q = R.rand((len(seqlens), 1, h_q, 576), torch.bfloat16)
    check(q, paged, False, 576 ** -0.5, impl, monkeypatch, lazy=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("h_q,s_q,causal,aligned_q", [(128, 1, False, True), (64, 2, True, True),
                                                      (128, 1, False, False), (16, 1, False, True)])
def test_many_pieces_per_part(h_q, s_q, causal, aligned_q, impl, monkeypatch):
    """Many short requests: each plan part runs several pieces back to back, so a CTA reuses its
    buffers and barriers across pieces. Pieces of 0, 1, 2 and more blocks, whole and partial last
    pages, in many orders; query rows 577 elements apart (not 16-byte aligned) take the element-wise
    staging."""
    cycle = [0, 1, 37, 64, 65, 100, 128, 129, 190, 256, 300, 700]
    seqlens = [cycle[(7 * i + i // 12) % len(cycle)] for i in range(300)]
    paged = R.make_dense_paged(seqlens, 64, 1, 576, torch.bfloat16)
    shape = (len(seqlens), s_q, h_q, 576)
    q = R.rand(shape, torch.bfloat16)
    if not aligned_q:
        wide = torch.full(shape[:-1] + (577,), float("nan"), dtype=torch.bfloat16)
        wide[..., :576] = q
        q = wide[..., :576]
    check(q, paged, causal, 576 ** -0.5, impl, monkeypatch)


def strided_query(values, row, token, batch, offset):
    """`values` [b, s_q, h_q, d] as a view with the given element strides and storage offset into a
    NaN-filled buffer, so that a row read from the wrong place shows."""
    b, s_q, h_q, d = values.shape
    span = offset + (b - 1) * batch + (s_q - 1) * token + (h_q - 1) * row + d
    big = torch.full((span,), float("nan"), dtype=values.dtype)
    q = big.as_strided(values.shape, (batch, token, row, 1), offset)
    q.copy_(values)
    return q


# (s_q, h_q, h_k, causal, layout). "rows": rows 584 elements apart, batches 64 more than their
# rows, 16 bytes into the buffer. Where a KV head's rows are then one stride apart (s_q = 1, or
# h_k = 1) the 64-row kernel loads them through a tensor map with Q's own strides; s_q = 1, h_q = 64,
# h_k = 2 has 32 rows per KV head, so a box reaches past the head group's rows, which load as zeros.
# With s_q = 2 and h_k = 2 the next token's rows of a KV head are h_q rows on, not h_q / h_k: the
# kernel copies them one by one, as it does for "tokens", where each token's heads end 8 rows short
# of the next token's.
QUERY_LAYOUTS = [(1, 128, 1, False, "rows"), (2, 64, 1, True, "rows"), (1, 64, 2, False, "rows"),
                 (2, 32, 2, True, "rows"), (1, 16, 1, False, "rows"), (2, 128, 1, True, "tokens"),
                 (2, 48, 2, False, "tokens")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("s_q,h_q,h_k,causal,layout", QUERY_LAYOUTS,
                         ids=[f"sq{c[0]}_hq{c[1]}_hk{c[2]}_{c[4]}" for c in QUERY_LAYOUTS])
def test_query_layouts(s_q, h_q, h_k, causal, layout, impl, monkeypatch):
    """Strided queries, across many pieces per part (each CTA loads Q again at every change of
    piece) and a request split across parts."""
    cycle = [0, 1, 64, 65, 129, 200, 300]
    seqlens = [cycle[(3 * i) % len(cycle)] for i in range(40)] + [3000]
    paged = R.make_dense_paged(seqlens, 64, h_k, 576, torch.bfloat16)
    values = R.rand((len(seqlens), s_q, h_q, 576), torch.bfloat16)
    if layout == "rows":
        q = strided_query(values, 584, h_q * 584, s_q * h_q * 584 + 64, 8)
    else:
        q = strided_query(values, 576, (h_q + 8) * 576, s_q * (h_q + 8) * 576, 0)
    check(q, paged, causal, 576 ** -0.5, impl, monkeypatch)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("h_q", [16, 64])
def test_invalid_block_table_entries_are_masked(h_q, impl, monkeypatch):
    """A block-table entry inside a sequence that names no page of the cache (negative or past the
    end) contributes nothing: its keys are masked, never read."""
    # The third request's first page is invalid: a whole block of -inf scores before any valid one,
    # in the pair loop's unmasked steady part.
    seqlens = [64 * 5, 64 * 3 + 10, 64 * 6]
    paged = R.make_dense_paged(seqlens, 64, 1, 576, torch.bfloat16)
    paged.block_table[0, 1] = -1
    paged.block_table[1, 2] = paged.k_cache.shape[0] + 5
    paged.block_table[2, 0] = -7
    q = R.rand((3, 1, h_q, 576), torch.bfloat16)
    if refused(q, paged, False, 0.05, impl, monkeypatch):
        return
    out, lse = run(q, paged, False, 0.05, impl, monkeypatch)
    keep0 = torch.cat([torch.arange(0, 64), torch.arange(128, 320)])
    keep1 = torch.cat([torch.arange(0, 128), torch.arange(192, 202)])
    seqs = [paged.seqs[0][keep0], paged.seqs[1][keep1], paged.seqs[2][64:]]
    ref_out, ref_lse = R.ref_dense_decode(q, seqs, 0.05, False)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)


@pytest.mark.parametrize("h_q", [16, 128])
def test_hopper_and_portable_agree_closely(h_q, monkeypatch):
    """Both kernels round P to 16 bits before P V: their outputs agree far inside the reference
    tolerance."""
    seqlens = [1000, 517, 64]
    paged = R.make_dense_paged(seqlens, 64, 1, 576, torch.bfloat16)
    q = R.rand((3, 2, h_q, 576), torch.bfloat16)
    a, la = run(q, paged, True, 576 ** -0.5, "default", monkeypatch)
    b, lb = run(q, paged, True, 576 ** -0.5, "portable", monkeypatch)
    assert torch.isfinite(a.float()).all() and torch.isfinite(la).all()
    assert (a.float() - b.float()).abs().max() < 2e-2
    assert (la - lb).abs().max() < 1e-3


# Sharp softmax: scales that spread the scores over tens of binades, so that the running max moves
# by large steps from block to block (and by small ones), on both Hopper kernels: the rescale
# factors of O, of the sums and of P0 for the other warpgroup all differ from 1.
SHARP = [
    ([700, 300, 1000], 1, 128, False, torch.bfloat16, 576, 40.0),
    ([520, 1100], 2, 128, True, torch.float16, 576, 25.0),
    ([900, 257], 1, 16, False, torch.bfloat16, 576, 60.0),
    ([640, 333], 2, 32, True, torch.bfloat16, 512, 40.0),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seqlens,s_q,h_q,causal,dtype,d,scale", SHARP,
                         ids=[f"L{'-'.join(map(str, c[0]))}_sq{c[1]}_hq{c[2]}_scale{int(c[6])}" for c in SHARP])
def test_sharp_softmax(seqlens, s_q, h_q, causal, dtype, d, scale, impl, monkeypatch):
    paged = R.make_dense_paged(seqlens, 64, 1, d, dtype)
    q = R.rand((len(seqlens), s_q, h_q, d), dtype)
    check(q, paged, causal, scale, impl, monkeypatch)


@pytest.mark.parametrize("h_q,s_q,b,impl", [(16, 1, 90, "default"), (32, 1, 90, "default"), (128, 1, 90, "default"),
                                            (64, 2, 90, "default"), (16, 1, 300, "default"), (128, 1, 300, "default"),
                                            (16, 1, 90, "sm90_small"), (32, 1, 300, "sm90_small")])
def test_hopper_kernels_make_the_planners_plan(h_q, s_q, b, impl, monkeypatch):
    """With a fresh plan the Hopper kernels plan inside their CTAs, with no planner kernel: the rows
    and num_splits they store are those the planner kernel makes for the portable path, and a later
    call reusing them gives the same bits. 300 requests take the in-kernel planner more than one
    round of its threads (128 in the small-rows kernel, 256 in the 64-row one)."""
    if impl not in IMPLS:
        pytest.skip(f"{impl} runs on sm90 GPUs only")
    def use_own():
        if impl == "default":
            monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
        else:
            monkeypatch.setenv("MLA_KERNELS_IMPL", impl)
    seqlens = [(i * 977) % 5000 for i in range(b)]
    paged = R.make_dense_paged(seqlens, 64, 1, 576, torch.bfloat16)
    q = R.rand((len(seqlens), s_q, h_q, 576), torch.bfloat16).cuda()
    kc, bt, sl = paged.k_cache.cuda(), paged.block_table.cuda(), paged.cache_seqlens.cuda()
    use_own()
    own, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, own, causal=s_q > 1)
    monkeypatch.setenv("MLA_KERNELS_IMPL", "portable")
    planned, _ = flash_mla.get_mla_metadata()
    flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, planned, causal=s_q > 1)
    assert torch.equal(own.tile_scheduler_metadata, planned.tile_scheduler_metadata)
    assert torch.equal(own.num_splits, planned.num_splits)
    use_own()
    again = flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, own, causal=s_q > 1)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])

