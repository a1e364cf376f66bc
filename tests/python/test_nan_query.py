"""A NaN in one head of q: that row comes out as a row with no valid key (out 0, lse +inf) on every
backend and kernel, and every other row is what the reference gives for them. The row's scores are
all NaN; the running maximum skips them (fmax), so no key is counted and the row is empty. The
README states this; the CPU backend, the portable CUDA kernels and the Hopper kernels must agree."""

import pytest
import torch

import reference as R
from test_dense_decode import run_dense
from test_sparse_decode import reference as sparse_reference
from test_sparse_decode import run_sparse

NAN_ROW = (0, 0, 3)  # (request, query token, head)


def poison(q, col):
    q = q.clone()
    q[NAN_ROW][col] = float("nan")
    return q


def check_nan_row(out, lse, ref_out, ref_lse):
    """Asserts the NaN row and that no NaN spread; returns the reference with that row made empty."""
    b, s, h = NAN_ROW
    assert (out[b, s, h] == 0).all(), "the NaN row's out must be 0 exactly"
    assert torch.isposinf(lse[b, h, s]), f"the NaN row's lse must be +inf, got {float(lse[b, h, s])}"
    assert out.isfinite().all() and not lse.isnan().any(), "a NaN in one row must not reach another"
    ref_out, ref_lse = ref_out.clone(), ref_lse.clone()
    ref_out[b, s, h], ref_lse[b, h, s] = 0, float("inf")
    return ref_out, ref_lse


# (seqlens, s_q, h_q, page, causal, column of the NaN): page 64 takes the Hopper kernels on sm90
# (h_q 128: the 64-row kernel; h_q 16: few rows), page 16 the portable kernel; columns in the
# latent part and in the RoPE part.
DENSE = [
    ([300, 500], 1, 128, 64, False, 7),
    ([300, 500], 1, 16, 64, False, 560),
    ([130, 64], 2, 64, 64, True, 100),
    ([300, 500], 1, 16, 16, False, 7),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,page,causal,col", DENSE)
def test_dense_nan_in_q(seqlens, s_q, h_q, page, causal, col, device):
    paged = R.make_dense_paged(seqlens, page, 1, 576, torch.bfloat16)
    q = R.rand((len(seqlens), s_q, h_q, 576))
    out, lse = run_dense(poison(q, col), paged, causal, 0.06, "lazy", device)
    ref_out, ref_lse = check_nan_row(out, lse, *R.ref_dense_decode(q, paged.seqs, 0.06, causal))
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)


# (format, h_q, column of the NaN): h_q 16 takes the small-heads kernel on sm90, 64 and 128 the
# 64-head kernel.
SPARSE = [("v32", 16, 7), ("v32", 128, 570), ("model1", 64, 7), ("model1", 16, 500)]


@pytest.mark.parametrize("fmt,h_q,col", SPARSE)
def test_sparse_nan_in_q(fmt, h_q, col, device):
    main = R.make_sparse_cache(fmt, 2, 1, 256, 128, 64)
    q = R.rand((2, 1, h_q, R.FORMATS[fmt].d))
    out, lse = run_sparse(poison(q, col), main, scale=0.05, device=device)
    ref_out, ref_lse = check_nan_row(out, lse, *sparse_reference(q, main, scale=0.05))
    R.check_is_allclose("out", out, ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.SPARSE_LSE_TOL)
