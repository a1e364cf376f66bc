"""Sparse prefill (flash_mla.flash_mla_sparse_fwd) against the float64 reference, in sgl-kernel's
base-2 convention (default) and FlashMLA's natural-log one (lse_base="e"): invalid indices of every
kind, topk_length (incl. 0), sink finite / +inf / -inf, duplicates, NaN in every kv row that is
not attended, head counts 1..128, any topk. Every test runs on "cpu" and "cuda" (the `device`
fixture): q, kv, indices, topk_length and the sink are moved to the device for each call (strides
kept); results come back to the CPU, where the reference runs."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R


def run_prefill(case, sm_scale, sink=None, lse_base=None, *, device):
    """The library on `device` (inputs moved there); returns (out, max_logits, lse) on the CPU."""
    def dev(t):
        return R.to_device(t, device)
    kwargs = {} if lse_base is None else {"lse_base": lse_base}
    res = flash_mla.flash_mla_sparse_fwd(dev(case.q), dev(case.kv), dev(case.indices), sm_scale, 512,
                                         attn_sink=dev(sink), topk_length=dev(case.topk_length), **kwargs)
    return tuple(R.to_cpu(t, device) for t in res)


def check_prefill(case, sm_scale, sink=None, lse_base=None, *, device):
    out, max_logits, lse = run_prefill(case, sm_scale, sink, lse_base, device=device)
    s_q, h_q, _ = case.q.shape
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (s_q, h_q, 512) and out.is_contiguous()
    assert max_logits.dtype == torch.float32 and tuple(max_logits.shape) == (s_q, h_q)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (s_q, h_q)
    ref_out, ref_max, ref_lse = R.ref_sparse_prefill(case.q, case.kv, case.indices, sm_scale, sink,
                                                     case.topk_length)
    if lse_base != "e":
        ref_max, ref_lse = ref_max * R.LOG2E, ref_lse * R.LOG2E
    R.check_is_allclose("out", out, ref_out, **R.PREFILL_OUT_TOL)
    R.check_is_allclose("max_logits", max_logits, ref_max, **R.PREFILL_MAX_LOGITS_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.PREFILL_LSE_TOL)
    lonely = torch.isposinf(ref_lse)
    assert (out[lonely] == 0).all()
    return out, max_logits, lse


# id: (s_q, s_kv, h_q, d, topk, topk_length, sink, dup, lonely_rows, noncontig, lse_base, sm_scale)
CASES = {
    "h1_d576_topk1": (5, 50, 1, 576, 1, False, "none", 0.0, (), False, None, 1.0),
    "h3_d512_tl": (17, 200, 3, 512, 64, True, "finite", 0.0, (), False, "e", 0.5),
    "h16_d576_tl_dup": (32, 300, 16, 576, 128, True, "mixed", 0.1, (3,), False, 2, 1.0),
    "h63_d512_topk_gt_skv": (9, 120, 63, 512, 200, False, "posinf", 0.0, (), False, None, 1.0),
    "h64_d576_lonely": (8, 256, 64, 576, 128, True, "neginf", 0.0, (0, 5), False, "e", 2.0),
    "h128_d512_all": (6, 300, 128, 512, 200, True, "mixed", 0.1, (2,), True, None, 1.0),
    "h128_d576_topk5": (4, 90, 128, 576, 5, False, "none", 0.0, (), False, "e", 1.5),
    "h64_d512_noncontig": (12, 64, 64, 512, 64, False, "finite", 0.0, (), True, None, None),
}


@pytest.mark.parametrize("case_id", list(CASES), ids=list(CASES))
def test_sparse_prefill(case_id, device):
    s_q, s_kv, h_q, d, topk, tl, sink_mode, dup, lonely, noncontig, base, scale = CASES[case_id]
    case = R.make_prefill_case(s_q, s_kv, h_q, d, topk, with_topk_length=tl, dup_frac=dup, lonely_rows=lonely)
    if noncontig:
        case.q = R.non_contiguous(case.q)
        case.kv = R.non_contiguous(case.kv)
        case.indices = R.non_contiguous(case.indices, pad_last=5)
    if scale is None:
        scale = d ** -0.5
    check_prefill(case, scale, R.make_sink(h_q, sink_mode), base, device=device)


@pytest.mark.parametrize("d", [576, 512])
def test_lse_conventions(d, device):
    """Default is base 2; lse_base=2 and "e" differ exactly by the factor log2(e); out is the same;
    lonely rows: max_logits -inf and lse +inf in both conventions."""
    case = R.make_prefill_case(10, 150, 16, d, 64, with_topk_length=True, lonely_rows=(4,))
    case.topk_length[7] = 0
    o_def, m_def, l_def = check_prefill(case, 1.0, device=device)
    o2, m2, l2 = check_prefill(case, 1.0, lse_base=2, device=device)
    oe, me, le = check_prefill(case, 1.0, lse_base="e", device=device)
    assert torch.equal(o_def, o2) and torch.equal(m_def, m2) and torch.equal(l_def, l2)
    assert torch.equal(o2, oe)
    for base2, nat in ((m2, me), (l2, le)):
        fin = torch.isfinite(nat)
        assert torch.equal(fin, torch.isfinite(base2))
        R.check_is_allclose("base2 vs e", base2[fin], nat[fin].double() * R.LOG2E, **R.PREFILL_LSE_TOL)
    for row in (4, 7):
        assert torch.isneginf(m2[row]).all() and torch.isneginf(me[row]).all()
        assert torch.isposinf(l2[row]).all() and torch.isposinf(le[row]).all()
        assert (o2[row] == 0).all()


def test_sink_semantics(device):
    h_q = 16
    case = R.make_prefill_case(8, 100, h_q, 512, 40, with_topk_length=True, lonely_rows=(1,))
    o0, m0, l0 = check_prefill(case, 1.0, device=device)
    op, mp, lp = check_prefill(case, 1.0, R.make_sink(h_q, "posinf"), device=device)
    on, mn, ln_ = check_prefill(case, 1.0, R.make_sink(h_q, "neginf"), device=device)
    of, mf, lf = check_prefill(case, 1.0, R.make_sink(h_q, "finite"), device=device)
    for m, l in ((mp, lp), (mn, ln_), (mf, lf)):
        assert torch.equal(m, m0) and torch.equal(l, l0)
    assert (op == 0).all()
    assert torch.equal(on, o0)
    assert (of.float() - o0.float()).abs().max() > 1e-4


def test_invalid_index_kinds_are_ignored(device):
    """Every invalid value (negative or >= s_kv, including INT_MIN / INT_MAX) behaves like -1."""
    s_kv = 77
    case = R.make_prefill_case(6, s_kv, 16, 576, 32, invalid_frac=0.4)
    out1, m1, l1 = check_prefill(case, 1.0, device=device)
    idx = case.indices
    assert ((idx < -1) | (idx >= s_kv)).any()
    case.indices = torch.where((idx < 0) | (idx >= s_kv), torch.full_like(idx, -1), idx)
    out2, m2, l2 = run_prefill(case, 1.0, device=device)
    assert torch.equal(out1, out2) and torch.equal(m1, m2) and torch.equal(l1, l2)


def test_duplicates_count_twice(device):
    case = R.make_prefill_case(2, 40, 8, 512, 6, invalid_frac=0.0, poison=False)
    case.indices[0, 0] = torch.tensor([3, 3, 3, 9, -1, 40], dtype=torch.int32)
    out, m, l = check_prefill(case, 1.0, lse_base="e", device=device)
    dedup = case.indices.clone()
    dedup[0, 0] = torch.tensor([3, 9, -1, -1, -1, -1], dtype=torch.int32)
    _, _, l_dedup = R.ref_sparse_prefill(case.q, case.kv, dedup, 1.0)
    assert (l[0].double() - l_dedup[0]).abs().max() > 0.05


def test_topk_length_positions_beyond_are_not_read(device):
    """Indices at positions >= topk_length point at NaN rows: results still finite and correct."""
    case = R.make_prefill_case(5, 60, 16, 576, 20, invalid_frac=0.0, with_topk_length=True, poison=False)
    case.topk_length[:] = torch.tensor([20, 0, 7, 1, 13], dtype=torch.int32)
    referenced = torch.zeros(60, dtype=torch.bool)
    for s in range(5):
        referenced[case.indices[s, 0, :int(case.topk_length[s])].long()] = True
    case.kv[~referenced] = float("nan")
    assert (~referenced).any()
    out, m, l = check_prefill(case, 1.0, device=device)
    assert not torch.isnan(out).any()


def test_deterministic(device):
    case = R.make_prefill_case(16, 200, 64, 576, 128, with_topk_length=True)
    sink = R.make_sink(64, "finite")
    a = run_prefill(case, 1.0, sink, device=device)
    b = run_prefill(case, 1.0, sink, device=device)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_large_logits_and_sinks(device):
    """Scores and sinks in the hundreds: exp overflows unless the max is subtracted."""
    case = R.make_prefill_case(32, 300, 128, 576, 256, with_topk_length=True, lonely_rows=(5,))
    case.q = case.q * 30
    sink = R.make_sink(128, "finite") * 50 + 50
    for base in (2, "e"):
        out, m, l = check_prefill(case, 3.0, sink, base, device=device)
    assert l[torch.isfinite(l)].max() > 50
