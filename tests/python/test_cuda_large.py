"""Large CUDA cases against the float64 reference (computed on the GPU in float64): b = 128,
sequences up to 32768 tokens, topk 2048, NaN in every cache slot that is not attended, shuffled
block tables with garbage past each sequence."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R

pytestmark = pytest.mark.cuda


def on_gpu(ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("b,s_q,h_q,mean_len,causal", [
    (128, 1, 16, 4096, False),
    (128, 2, 128, 1024, True),
    (16, 1, 128, 32768, False),
    (2, 1, 128, 65536, False),
])
def test_dense_large(b, s_q, h_q, mean_len, causal):
    lens = torch.normal(float(mean_len), mean_len / 2, (b,)).clamp(s_q, 2 * mean_len).int().tolist()
    paged = R.make_dense_paged(lens, 64, 1, 576, torch.bfloat16)
    q = R.rand((b, s_q, h_q, 576))
    sched, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(*on_gpu([q, paged.k_cache, paged.block_table, paged.cache_seqlens]),
                                                512, sched, causal=causal)
    with torch.device("cuda"):
        ref_out, ref_lse = R.ref_dense_decode(q.cuda(), [s.cuda() for s in paged.seqs], 576 ** -0.5, causal)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)


@pytest.mark.parametrize("fmt,b,s_q,h_q,topk", [("v32", 128, 1, 128, 2048), ("model1", 64, 2, 32, 2048),
                                                 ("v32", 128, 1, 16, 2048)])
def test_sparse_large(fmt, b, s_q, h_q, topk):
    main = R.make_sparse_cache(fmt, b, s_q, 4096, topk, 64, with_topk_length=True, invalid_frac=0.02,
                               scale_spread=False)
    d = 576 if fmt == "v32" else 512
    q = R.rand((b, s_q, h_q, d))
    sink = torch.randn(h_q)
    sched, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q.cuda(), main.kv8.cuda(), None, None, 512, sched, is_fp8_kvcache=True,
                                                indices=main.indices.cuda(), topk_length=main.topk_length.cuda(),
                                                attn_sink=sink.cuda())
    with torch.device("cuda"):
        ref_out, ref_lse = R.ref_sparse_decode(q.cuda(), main.tokens.cuda(), main.indices.cuda(), d ** -0.5,
                                               main.topk_length.cuda(), sink.cuda())
    R.check_is_allclose("out", out, ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.SPARSE_LSE_TOL)


def test_sparse_prefill_large():
    case = R.make_prefill_case(512, 8192, 128, 576, 2048, with_topk_length=True)
    sink = torch.randn(128)
    out, ml, lse = flash_mla.flash_mla_sparse_fwd(case.q.cuda(), case.kv.cuda(), case.indices.cuda(), 576 ** -0.5,
                                                  attn_sink=sink.cuda(), topk_length=case.topk_length.cuda(),
                                                  lse_base="e")
    with torch.device("cuda"):
        ref_out, ref_ml, ref_lse = R.ref_sparse_prefill(case.q.cuda(), case.kv_clean.cuda(), case.indices.cuda(),
                                                        576 ** -0.5, sink.cuda(), case.topk_length.cuda())
    R.check_is_allclose("out", out, ref_out, **R.PREFILL_OUT_TOL)
    R.check_is_allclose("max_logits", ml, ref_ml, **R.PREFILL_MAX_LOGITS_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.PREFILL_LSE_TOL)
