"""The Hopper fragment kernel for V3.2 sparse decode (MLA_KERNELS_IMPL=sm90_frag: at most 16 heads,
keys dequantised into wgmma's register operands) against
the float64 reference: every feature, odd head counts, topk not a multiple of 64, pieces split
across parts, all-invalid rows, NaN in every unattended token, the kernel's own plan and a reused
one bit for bit."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R
from test_sparse_decode import build, check_sparse, run_sparse

pytestmark = pytest.mark.cuda

# (b, s_q, h_q, s_k, topk, page, topk_length, extra (s_k, topk, page, extra_topk_length), sink, dup, padded)
CASES = {
    "h16_topk2048": (4, 1, 16, 4096, 2048, 64, False, None, "none", 0.0, False),
    "h16_topk200_tl_extra": (3, 2, 16, 400, 200, 64, True, (150, 70, 16, True), "mixed", 0.05, True),
    "h16_pg1_sq3": (2, 3, 16, 90, 65, 1, True, None, "finite", 0.1, False),
    "h5_topk1": (2, 1, 5, 100, 1, 64, False, None, "posinf", 0.0, False),
    "h13_pg16_extra_pg1": (2, 2, 13, 300, 130, 16, True, (90, 64, 1, True), "neginf", 0.1, True),
    "h1_topk_gt_sk": (3, 1, 1, 70, 100, 16, True, None, "finite", 0.0, False),
    "h16_extra_only_len": (2, 1, 16, 256, 64, 256, True, (300, 1000, 64, True), "finite", 0.0, False),
}


@pytest.fixture
def frag(monkeypatch):
    monkeypatch.setenv("MLA_KERNELS_IMPL", "sm90_frag")


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_frag_kernel(case, frag):
    b, s_q, h_q, s_k, topk, page, tl, extra, sink_mode, dup, padded = CASES[case]
    main, ex = build("v32", b, s_q, s_k, topk, page, tl=tl, extra=extra, dup=dup, padded=padded, device="cuda",
                     all_invalid_rows=[(0, 0)])
    q = R.rand((b, s_q, h_q, 576))
    check_sparse(q, main, ex, R.make_sink(h_q, sink_mode), 1.0, device="cuda")


def test_frag_kernel_strided_query_and_sharp_softmax(frag):
    """Q rows not 16-byte aligned (a strided view), and scores over tens of binades, so that the two
    consumer warpgroups' running maxima differ by more than the rescale slack when they merge."""
    main, _ = build("v32", 2, 1, 2048, 1024, 64, device="cuda")
    q = R.non_contiguous(R.rand((2, 1, 16, 576)), pad_last=1)
    check_sparse(q, main, None, R.make_sink(16, "finite"), 60.0, device="cuda")


def test_frag_kernel_garbage_never_matters(frag):
    main, ex = build("v32", 2, 2, 300, 128, 16, tl=True, extra=(80, 16, 64, True), device="cuda")
    q = R.rand((2, 2, 16, 576))
    sink = R.make_sink(16, "finite")
    out1, lse1 = check_sparse(q, main, ex, sink, 1.0, device="cuda")
    for pattern in ("mixed", "random"):
        R.poison_tokens(main.kv8, main.fmt, main.poisoned, pattern)
        R.poison_tokens(ex.kv8, ex.fmt, ex.poisoned, pattern)
        out2, lse2 = run_sparse(q, main, ex, sink, 1.0, device="cuda")
        assert torch.equal(out1, out2) and torch.equal(lse1, lse2), pattern


@pytest.mark.parametrize("b", [100, 300])
def test_frag_kernel_plans_and_reuses(b, frag):
    """Many requests over 132-odd parts (pieces split across parts, several pieces per CTA): the
    kernel's own plan equals the planner kernel's, and a call reusing it gives the same bits."""
    main, _ = build("v32", b, 1, 2000, 512, 64, tl=True, device="cuda")
    q = R.rand((b, 1, 16, 576)).cuda()
    args = dict(is_fp8_kvcache=True, indices=main.indices.cuda(), topk_length=main.topk_length.cuda(),
                softmax_scale=1.0)
    kv8 = main.kv8.cuda()
    own, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(q, kv8, None, None, 512, own, **args)
    ref_out, ref_lse = R.ref_sparse_decode(q.cpu(), main.tokens, main.indices, 1.0, main.topk_length, None)
    R.check_is_allclose("out", out.cpu(), ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("lse", lse.cpu(), ref_lse, **R.SPARSE_LSE_TOL)
    again = flash_mla.flash_mla_with_kvcache(q, kv8, None, None, 512, own, **args)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.parametrize("fmt,h_q,lacks", [("model1", 16, "MODEL1"), ("v32", 17, "more than 16"),
                                           ("v32", 64, "more than 16")])
def test_frag_kernel_refuses_what_it_lacks(fmt, h_q, lacks, frag):
    """Forced onto a call it cannot run (the MODEL1 format, more than 16 heads), the dispatch says
    which feature the implementation lacks instead of launching it."""
    main, _ = build(fmt, 1, 1, 100, 64, 64, device="cuda")
    q = R.rand((1, 1, h_q, R.FORMATS[fmt].d))
    with pytest.raises(RuntimeError, match=f"sm90_frag lacks[^;]*{lacks}"):
        run_sparse(q, main, None, None, 1.0, device="cuda")
