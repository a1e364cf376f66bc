"""Dense decode (bf16 / fp16 paged cache) through flash_mla.flash_mla_with_kvcache, lazy
FlashMLASchedMeta path and legacy tensor-metadata path, against the float64 reference.

Every case uses a shuffled block table, garbage ids in unused block-table entries and NaN in every
cache slot beyond the sequence lengths and in unused blocks. Every test runs on "cpu" and "cuda"
(the `device` fixture): inputs are built on the CPU, moved to the device for each library call
(strides and padding kept), and results come back to the CPU for the comparisons."""

import math

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R


def run_dense(q, paged, causal, scale, path, device):
    """The library on `device` (inputs moved there); returns (out, lse) on the CPU."""
    q_d, kc, bt, sl = (R.to_device(t, device) for t in (q, paged.k_cache, paged.block_table, paged.cache_seqlens))
    if path == "lazy":
        meta, none = flash_mla.get_mla_metadata()
        assert none is None
        out, lse = flash_mla.flash_mla_with_kvcache(q_d, kc, bt, sl, 512, meta, softmax_scale=scale, causal=causal)
    else:
        b, s_q, h_q, _ = q.shape
        h_k = paged.k_cache.shape[2]
        tsm, ns = flash_mla.get_mla_metadata(sl, s_q * h_q // h_k, h_k)
        out, lse = flash_mla.flash_mla_with_kvcache(q_d, kc, bt, sl, 512, tsm, ns, softmax_scale=scale, causal=causal)
    return R.to_cpu(out, device), R.to_cpu(lse, device)


def check_dense(q, paged, causal, scale, path, device):
    out, lse = run_dense(q, paged, causal, scale, path, device)
    b, s_q, h_q, d = q.shape
    assert out.dtype == q.dtype and tuple(out.shape) == (b, s_q, h_q, 512)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (b, h_q, s_q)
    assert lse.is_contiguous(), f"dense lse must be contiguous [b, h_q, s_q], strides {lse.stride()}"
    eff_scale = d ** -0.5 if scale is None else scale
    ref_out, ref_lse = R.ref_dense_decode(q, paged.seqs, eff_scale, causal)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)
    lonely = torch.isposinf(ref_lse).transpose(1, 2)          # [b, s_q, h_q]
    assert (out[lonely] == 0).all(), "lonely rows must have out == 0 exactly"
    return out, lse


# (b-seqlens, s_q, h_q, h_k, page, causal, dtype, d_qk, path, scale, noncontig)
CASES = [
    ([7, 0, 13], 1, 1, 1, 1, False, torch.bfloat16, 576, "lazy", None, False),
    ([1, 40, 17], 2, 3, 1, 16, True, torch.float16, 576, "lazy", 1.5, True),
    ([3, 130, 64], 4, 16, 1, 64, True, torch.bfloat16, 576, "legacy", 1.0, False),
    ([300, 257], 1, 63, 1, 256, False, torch.bfloat16, 576, "lazy", 2.0, False),
    ([65, 2, 0], 3, 64, 1, 64, True, torch.bfloat16, 576, "legacy", None, True),
    ([150, 33], 2, 128, 1, 16, True, torch.bfloat16, 576, "lazy", 1.0, False),
    ([200], 1, 128, 1, 64, False, torch.float16, 512, "lazy", None, False),
    ([50, 77], 2, 16, 2, 16, True, torch.bfloat16, 576, "lazy", 1.2, False),
    ([9, 2], 3, 6, 3, 1, True, torch.float16, 576, "legacy", 1.0, True),
    ([100, 5, 31], 1, 128, 8, 64, False, torch.bfloat16, 576, "legacy", 1.5, False),
    ([260, 3], 4, 3, 3, 256, False, torch.bfloat16, 512, "lazy", 1.0, False),
    ([19, 120], 2, 64, 4, 16, True, torch.float16, 512, "legacy", 0.8, False),
    ([0, 0], 2, 16, 1, 64, True, torch.bfloat16, 576, "lazy", None, False),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,h_k,page,causal,dtype,d,path,scale,noncontig", CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}_sq{c[1]}_hq{c[2]}_hk{c[3]}_pg{c[4]}_"
                              f"{'causal' if c[5] else 'full'}_{str(c[6])[6:]}_d{c[7]}_{c[8]}" for c in CASES])
def test_dense_decode(seqlens, s_q, h_q, h_k, page, causal, dtype, d, path, scale, noncontig, device):
    paged = R.make_dense_paged(seqlens, page, h_k, d, dtype)
    q = R.rand((len(seqlens), s_q, h_q, d), dtype)
    if noncontig:
        q = R.non_contiguous(q)
        paged.block_table = R.non_contiguous(paged.block_table, pad_last=3)
        paged.k_cache = R.non_contiguous(paged.k_cache)
    check_dense(q, paged, causal, scale, path, device)


@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
def test_causal_bottom_right_alignment(s_q, device):
    """Row r sees key j iff j <= r + L - s_q; rows with r + L - s_q < 0 are lonely (out 0, lse +inf)."""
    seqlens = [0, 1, max(s_q - 1, 0), s_q, s_q + 1, 70]
    h_q = 16
    paged = R.make_dense_paged(seqlens, 16, 1, 576, torch.bfloat16)
    q = R.rand((len(seqlens), s_q, h_q, 576))
    out, lse = check_dense(q, paged, True, 2.0, "lazy", device)
    for i, L in enumerate(seqlens):
        for r in range(s_q):
            row_lonely = r + L - s_q < 0
            assert bool(torch.isposinf(lse[i, :, r]).all()) == row_lonely, (i, L, r)
            assert bool(torch.isfinite(lse[i, :, r]).all()) == (not row_lonely), (i, L, r)
    # the last query row sees the whole sequence: same as non-causal for that row
    out_full, lse_full = run_dense(q, paged, False, 2.0, "lazy", device)
    nz = [i for i, L in enumerate(seqlens) if L > 0]
    R.check_is_allclose("last row", out[nz, -1], out_full[nz, -1].double(), **R.DENSE_OUT_TOL)
    R.check_is_allclose("last row lse", lse[nz, :, -1], lse_full[nz, :, -1].double(), **R.DENSE_LSE_TOL)


def test_causal_is_ignored_for_single_query(device):
    paged = R.make_dense_paged([33, 70], 16, 1, 576, torch.bfloat16)
    q = R.rand((2, 1, 16, 576))
    a = run_dense(q, paged, True, 1.0, "lazy", device)
    b = run_dense(q, paged, False, 1.0, "lazy", device)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_unattended_slots_never_matter(page, device):
    """NaN, huge or random garbage in unused slots and any value in unused block-table entries
    (even ids of real blocks) gives bitwise identical results."""
    seqlens = [5, 0, 77, 130]
    paged = R.make_dense_paged(seqlens, page, 1, 576, torch.bfloat16, spare_blocks=3, garbage_cols=2)
    q = R.rand((4, 2, 16, 576))
    out1, lse1 = check_dense(q, paged, True, 1.0, "lazy", device)
    garbage = torch.isnan(paged.k_cache)
    assert garbage.any()
    paged.k_cache = torch.where(garbage, (torch.randn(paged.k_cache.shape) * 1e3).to(torch.bfloat16), paged.k_cache)
    nblk = [math.ceil(L / page) for L in seqlens]
    for i, n in enumerate(nblk):
        paged.block_table[i, n:] = torch.randint(0, paged.k_cache.shape[0], (paged.block_table.shape[1] - n,),
                                                 dtype=torch.int32)
    out2, lse2 = run_dense(q, paged, True, 1.0, "lazy", device)
    assert torch.equal(out1, out2)
    assert torch.equal(lse1, lse2)


def test_default_softmax_scale(device):
    for d in (576, 512):
        paged = R.make_dense_paged([40, 9], 16, 1, d, torch.bfloat16)
        q = R.rand((2, 1, 8, d)) * 8
        out_none, lse_none = check_dense(q, paged, False, None, "lazy", device)
        out_expl, lse_expl = run_dense(q, paged, False, d ** -0.5, "lazy", device)
        assert torch.equal(out_none, out_expl) and torch.equal(lse_none, lse_expl)


def test_deterministic(device):
    paged = R.make_dense_paged([123, 301, 7], 16, 1, 576, torch.bfloat16)
    q = R.rand((3, 2, 64, 576))
    a = run_dense(q, paged, True, 1.0, "lazy", device)
    b = run_dense(q, paged, True, 1.0, "lazy", device)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_lazy_and_legacy_paths_agree(device):
    paged = R.make_dense_paged([90, 3], 64, 1, 576, torch.bfloat16)
    q = R.rand((2, 2, 16, 576))
    a = check_dense(q, paged, True, 1.0, "lazy", device)
    b = check_dense(q, paged, True, 1.0, "legacy", device)
    R.check_is_allclose("out lazy vs legacy", a[0], b[0].double(), **R.DENSE_OUT_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_logits(dtype, device):
    """Scores in the hundreds: exp overflows unless the running max is subtracted."""
    paged = R.make_dense_paged([300, 1, 77], 16, 2, 576, dtype)
    q = R.rand((3, 2, 64, 576), dtype) * 30
    out, lse = check_dense(q, paged, True, 5.0, "lazy", device)
    assert lse[torch.isfinite(lse)].max() > 50
