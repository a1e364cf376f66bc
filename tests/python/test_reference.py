"""Self-checks of the float64 reference (no library involved), so that a wrong reference cannot
silently agree with a wrong library: each reference is compared with a direct per-row loop."""

import math

import pytest
import torch

import reference as R


def _naive_row(q_row, keys, scale, d_v):
    """q_row [d], keys list of [d] -> (out [d_v], lse) by the textbook formula."""
    if not keys:
        return torch.zeros(d_v, dtype=torch.float64), math.inf
    z = torch.stack([scale * torch.dot(q_row, k) for k in keys])
    lse = torch.logsumexp(z, 0)
    w = torch.exp(z - lse)
    out = sum(w[j] * keys[j][:d_v] for j in range(len(keys)))
    return out, lse.item()


@pytest.mark.parametrize("s_q,causal,h_q,h_k", [(1, False, 2, 1), (3, True, 4, 2), (4, True, 3, 3)])
def test_ref_dense_decode_against_loops(s_q, causal, h_q, h_k):
    seqlens = [5, 2, 0]
    q = R.rand((3, s_q, h_q, 16), torch.float32).double()
    seqs = [R.rand((L, h_k, 16), torch.float32).double() for L in seqlens]
    out, lse = R.ref_dense_decode(q, seqs, 0.7, causal, d_v=12)
    for i, L in enumerate(seqlens):
        for r in range(s_q):
            last = L if not (causal and s_q > 1) else r + L - s_q + 1
            for h in range(h_q):
                keys = [seqs[i][j, h // (h_q // h_k)] for j in range(max(0, last))]
                o, l = _naive_row(q[i, r, h], keys, 0.7, 12)
                assert torch.allclose(out[i, r, h], o, atol=1e-12)
                assert (lse[i, h, r].item() == l) if math.isinf(l) else abs(lse[i, h, r].item() - l) < 1e-12


def test_ref_sparse_decode_against_loops():
    b, s_q, h_q, d = 2, 2, 3, 8
    tokens = R.rand((20, d), torch.float32).double()
    extra = R.rand((7, d), torch.float32).double()
    q = R.rand((b, s_q, h_q, d), torch.float32).double()
    idx = torch.tensor([[[0, 3, 3, -1, 25], [19, 20, 2, 2, 2]], [[-5, 1, 4, 6, 7], [8, 9, 10, 11, 12]]], dtype=torch.int32)
    eidx = torch.tensor([[[0, 6, 7], [1, 1, -1]], [[2, 3, 4], [5, 6, 0]]], dtype=torch.int32)
    tl = torch.tensor([5, 3], dtype=torch.int32)
    etl = torch.tensor([2, 0], dtype=torch.int32)
    sink = torch.tensor([0.3, float("inf"), float("-inf")])
    out, lse = R.ref_sparse_decode(q, tokens, idx, 0.9, tl, sink, extra, eidx, etl, d_v=6)
    assert lse.shape == (b, h_q, s_q)
    for i in range(b):
        for s in range(s_q):
            keys = [tokens[j] for k, j in enumerate(idx[i, s].tolist()) if 0 <= j < 20 and k < tl[i]]
            keys += [extra[j] for k, j in enumerate(eidx[i, s].tolist()) if 0 <= j < 7 and k < etl[i]]
            for h in range(h_q):
                o, l = _naive_row(q[i, s, h], keys, 0.9, 6)
                if not math.isinf(l):
                    o = o / (1 + math.exp(sink[h].item() - l)) if not math.isinf(sink[h].item()) else (o * 0 if sink[h] > 0 else o)
                assert torch.allclose(out[i, s, h], o, atol=1e-12)
                assert lse[i, h, s].item() == pytest.approx(l, abs=1e-12) if not math.isinf(l) else lse[i, h, s].item() == l


def test_ref_prefill_lonely_and_max():
    case = R.make_prefill_case(4, 10, 2, 8, 6, lonely_rows=[2], with_topk_length=True)
    out, mx, lse = R.ref_sparse_prefill(case.q, case.kv, case.indices, 0.5, topk_length=case.topk_length, d_v=8)
    assert torch.isposinf(lse[2]).all() and torch.isneginf(mx[2]).all() and (out[2] == 0).all()
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("fmt", ["v32", "model1"])
def test_quantiser_roundtrip_and_layout(fmt):
    f = R.FORMATS[fmt]
    kv = R.rand((3, 5, 1, f.d))
    kv[0, 0, 0, :f.tile] = 1e-7            # tiny tile: scale clamps to 2^-13
    kv8 = R.quantize_ref(kv, f, block_stride_bytes=5 * f.bytes_per_token + 64)
    assert kv8.shape == (3, 5, 1, f.bytes_per_token) and kv8.stride(1) == f.bytes_per_token
    dec = R.dequantize_ref(kv8, f).view(3, 5, f.d)
    x = kv[:, :, 0].double()
    assert torch.equal(dec[..., f.d_nope:], x[..., f.d_nope:])       # RoPE verbatim
    err = (dec[..., :f.d_nope] - x[..., :f.d_nope]).abs()
    tiles = x[..., :f.d_nope].unflatten(-1, (f.num_tiles, f.tile))
    s = torch.pow(2.0, torch.ceil(torch.log2((tiles.abs().amax(-1) / 448).clamp_min(1e-4))))
    bound = x[..., :f.d_nope].abs() * 2 ** -4 + s.repeat_interleave(f.tile, -1) * 2 ** -9
    assert (err <= bound).all()
    R.poison_tokens(kv8, f, torch.tensor([1, 7]))
    dec2 = R.dequantize_ref(kv8, f)
    assert torch.isnan(dec2[1]).all() and torch.isnan(dec2[7, :f.d_nope]).all()
    keep = torch.ones(15, dtype=torch.bool)
    keep[[1, 7]] = False
    assert torch.equal(dec2[keep], dec.view(15, f.d)[keep])
