"""Dense FP8 decode (sgl-kernel's fwd_kvcache_mla_fp8 route): q and k_cache float8_e4m3fn,
per-tensor [1] or per-request [b] float32 descales; scores use scale*descale_q*descale_k,
V = k[:512]*descale_k, output bf16 (SPEC section 4). Every test runs on "cpu" and "cuda" (the
`device` fixture); the reference stays on the CPU."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R

FP8 = torch.float8_e4m3fn


def run_fp8(q8, paged, dq, dk, causal, scale, device):
    """The library on `device` (inputs moved there); returns (out, lse) on the CPU."""
    q8, kc, bt, sl, dq, dk = (R.to_device(t, device)
                              for t in (q8, paged.k_cache, paged.block_table, paged.cache_seqlens, dq, dk))
    b, s_q, h_q, _ = q8.shape
    h_k = kc.shape[2]
    tsm, ns = flash_mla.get_mla_metadata(sl, s_q * h_q // h_k, h_k, is_fp8_kvcache=True)
    assert tsm.dtype == torch.int32 and tsm.dim() == 2 and tsm.shape[1] == 8
    assert ns.dtype == torch.int32 and tuple(ns.shape) == (b + 1,)
    assert tsm.device.type == ns.device.type == torch.device(device).type
    out, lse = flash_mla.flash_mla_with_kvcache(q8, kc, bt, sl, 512, tsm, ns, softmax_scale=scale, causal=causal,
                                                descale_q=dq, descale_k=dk)
    return R.to_cpu(out, device), R.to_cpu(lse, device)


def _per_request(t, b):
    return t.expand(b) if t.numel() == 1 else t


# (seqlens, s_q, h_q, h_k, page, causal, per_request_descale, scale)
CASES = [
    ([70, 3], 1, 16, 1, 64, False, False, 1.0),
    ([130, 0, 64], 2, 128, 1, 64, True, True, 1.0),
    ([17, 200], 2, 3, 1, 16, True, False, None),
    ([45], 1, 64, 1, 1, False, True, 2.0),
    ([260, 31], 1, 63, 1, 256, False, True, 1.0),
    ([33, 90], 2, 32, 2, 16, True, True, 1.0),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,h_k,page,causal,per_request,scale", CASES,
                         ids=[f"L{'-'.join(map(str, c[0]))}_sq{c[1]}_hq{c[2]}_hk{c[3]}_pg{c[4]}_"
                              f"{'causal' if c[5] else 'full'}_{'perreq' if c[6] else 'pertensor'}" for c in CASES])
def test_dense_fp8(seqlens, s_q, h_q, h_k, page, causal, per_request, scale, device):
    b = len(seqlens)
    paged = R.make_dense_paged(seqlens, page, h_k, 576, FP8)      # unattended bytes: 0x7F / 0xFF (NaN)
    q8 = (R.rand((b, s_q, h_q, 576), torch.float32) * 20).to(FP8)
    n = b if per_request else 1
    dq = (torch.rand(n) * 0.05 + 0.02).float()
    dk = (torch.rand(n) * 0.05 + 0.02).float()
    out, lse = run_fp8(q8, paged, dq, dk, causal, scale, device)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (b, s_q, h_q, 512)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (b, h_q, s_q)
    eff = 576 ** -0.5 if scale is None else scale
    ref_out, ref_lse = R.ref_dense_decode(q8, paged.seqs, eff, causal, q_scale=_per_request(dq, b),
                                          k_scale=_per_request(dk, b))
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)


def test_descales_really_apply(device):
    """Doubling descale_k doubles the scores' scale and V: compare with the reference, and make
    sure the two results differ (the descales are not ignored)."""
    b = 2
    paged = R.make_dense_paged([50, 20], 64, 1, 576, FP8)
    q8 = (R.rand((b, 1, 16, 576), torch.float32) * 20).to(FP8)
    dq = torch.tensor([0.05, 0.03])
    out1, _ = run_fp8(q8, paged, dq, torch.tensor([0.04, 0.02]), False, 1.0, device)
    out2, _ = run_fp8(q8, paged, dq, torch.tensor([0.08, 0.02]), False, 1.0, device)
    ref2, _ = R.ref_dense_decode(q8, paged.seqs, 1.0, False, q_scale=dq, k_scale=torch.tensor([0.08, 0.02]))
    R.check_is_allclose("out", out2, ref2, **R.DENSE_OUT_TOL)
    assert torch.equal(out1[1], out2[1])                 # request 1 unchanged
    assert (out1[0].float() - out2[0].float()).abs().max() > 1e-2


def test_dense_fp8_metadata_op(device):
    seqlens = torch.tensor([10, 0, 300], dtype=torch.int32, device=device)
    tsm, ns = torch.ops.mla_kernels.get_mla_decoding_metadata_dense_fp8(seqlens, 128, 1)
    assert tsm.device == seqlens.device and ns.device == seqlens.device
    tsm, ns = tsm.cpu(), ns.cpu()
    assert tsm.dtype == torch.int32 and tsm.dim() == 2 and tsm.shape[1] == 8 and tsm.shape[0] >= 1
    assert ns.dtype == torch.int32 and tuple(ns.shape) == (4,)
    assert ns[0] == 0 and bool((ns[1:] >= ns[:-1]).all())


def test_lazy_sched_meta_path_matches_legacy(device):
    """mla-kernels also routes an FP8 query through a FlashMLASchedMeta (planned once, reused)."""
    paged = R.make_dense_paged([60, 7, 130], 16, 1, 576, FP8)
    dq, dk = torch.tensor([0.05, 0.03, 0.04]), torch.tensor([0.02, 0.03, 0.05])
    meta, _ = flash_mla.get_mla_metadata()
    for _ in range(2):
        q8 = (R.rand((3, 2, 16, 576), torch.float32) * 20).to(FP8)
        out, lse = flash_mla.flash_mla_with_kvcache(
            *(R.to_device(t, device) for t in (q8, paged.k_cache, paged.block_table, paged.cache_seqlens)), 512,
            meta, softmax_scale=1.0, causal=True, descale_q=R.to_device(dq, device),
            descale_k=R.to_device(dk, device))
        out, lse = R.to_cpu(out, device), R.to_cpu(lse, device)
        legacy = run_fp8(q8, paged, dq, dk, True, 1.0, device)
        ref_out, ref_lse = R.ref_dense_decode(q8, paged.seqs, 1.0, True, q_scale=dq, k_scale=dk)
        R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
        R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)
        assert torch.equal(out, legacy[0]) and torch.equal(lse, legacy[1])
