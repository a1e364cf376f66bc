"""torch.compile(fullgraph=True) over the Python API: flash_mla_with_kvcache on the lazy
FlashMLASchedMeta path (planned inside the graph, and reused across "layers") and on the legacy
tensor path, and flash_mla_sparse_fwd in both lse conventions. aot_eager everywhere (same kernels:
results must be bitwise equal to eager), plus one case through the default inductor backend."""

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn, backend="aot_eager", **kw):
    return torch.compile(fn, fullgraph=True, backend=backend, **kw)


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_dense_lazy_meta_planned_inside_graph():
    def f(q, k_cache, block_table, seqlens):
        meta, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, softmax_scale=1.0,
                                                causal=True)
    p = R.make_dense_paged([50, 3, 0], 16, 1, 576, torch.bfloat16)
    q = R.rand((3, 2, 16, 576))
    got = compiled(f)(q, p.k_cache, p.block_table, p.cache_seqlens)
    _equal(got, f(q, p.k_cache, p.block_table, p.cache_seqlens))
    ref_out, _ = R.ref_dense_decode(q, p.seqs, 1.0, True)
    R.check_is_allclose("out", got[0], ref_out, **R.DENSE_OUT_TOL)


def test_dense_lazy_meta_reused_across_layers():
    def layer(q, k_cache, block_table, seqlens, meta):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, softmax_scale=1.0,
                                                causal=True)
    p = R.make_dense_paged([33, 90], 16, 1, 576, torch.bfloat16)
    cf = compiled(layer)
    meta, _ = flash_mla.get_mla_metadata()
    for i in range(3):
        q = R.rand((2, 2, 32, 576))
        got = cf(q, p.k_cache, p.block_table, p.cache_seqlens, meta)
        assert meta.have_initialized and meta.tile_scheduler_metadata is not None
        eager_meta, _ = flash_mla.get_mla_metadata()
        _equal(got, layer(q, p.k_cache, p.block_table, p.cache_seqlens, eager_meta))
    assert meta.config == flash_mla.FlashMLASchedMeta.Config(2, 2, 32, 16, 1, True, False, None, None, None)


def test_dense_legacy_tensor_path():
    def f(q, k_cache, block_table, seqlens, tsm, ns):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, tsm, ns, softmax_scale=1.0,
                                                causal=True)

    def g(q, k_cache, block_table, seqlens):
        tsm, ns = flash_mla.get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1)
        return f(q, k_cache, block_table, seqlens, tsm, ns)

    p = R.make_dense_paged([70, 5], 64, 1, 576, torch.bfloat16)
    q = R.rand((2, 2, 16, 576))
    tsm, ns = flash_mla.get_mla_metadata(p.cache_seqlens, 32, 1)
    eager = f(q, p.k_cache, p.block_table, p.cache_seqlens, tsm, ns)
    _equal(compiled(f)(q, p.k_cache, p.block_table, p.cache_seqlens, tsm, ns), eager)
    _equal(compiled(g)(q, p.k_cache, p.block_table, p.cache_seqlens), eager)


def test_dense_fp8_legacy_path():
    def f(q, k_cache, block_table, seqlens, tsm, ns, dq, dk):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, tsm, ns, softmax_scale=1.0,
                                                descale_q=dq, descale_k=dk)
    p = R.make_dense_paged([40, 9], 16, 1, 576, torch.float8_e4m3fn)
    q8 = (R.rand((2, 1, 16, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
    tsm, ns = flash_mla.get_mla_metadata(p.cache_seqlens, 16, 1, is_fp8_kvcache=True)
    args = (q8, p.k_cache, p.block_table, p.cache_seqlens, tsm, ns, torch.tensor([0.05]), torch.tensor([0.03]))
    _equal(compiled(f)(*args), f(*args))


@pytest.mark.parametrize("fmt", ["v32", "model1"])
def test_sparse_lazy_meta(fmt):
    def layer(q, kv, indices, sink, ekv, eidx, tl, etl, meta):
        return flash_mla.flash_mla_with_kvcache(q, kv, None, None, 512, meta, softmax_scale=1.0, is_fp8_kvcache=True,
                                                indices=indices, attn_sink=sink, extra_k_cache=ekv,
                                                extra_indices_in_kvcache=eidx, topk_length=tl, extra_topk_length=etl)
    d = R.FORMATS[fmt].d
    main = R.make_sparse_cache(fmt, 2, 1, 100, 32, 16, with_topk_length=True)
    ex = R.make_sparse_cache(fmt, 2, 1, 40, 8, 64, with_topk_length=True)
    sink = R.make_sink(16, "mixed")
    cf = compiled(layer)
    meta, _ = flash_mla.get_mla_metadata()
    for _ in range(2):
        q = R.rand((2, 1, 16, d))
        args = (q, main.kv8, main.indices, sink, ex.kv8, ex.indices, main.topk_length, ex.topk_length)
        got = cf(*args, meta)
        eager_meta, _ = flash_mla.get_mla_metadata()
        _equal(got, layer(*args, eager_meta))
        assert got[1].stride() == (16, 1, 16)


def test_sparse_legacy_tensor_path():
    def f(q, kv, indices, seqlens, block_table):
        tsm, ns = flash_mla.get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1, q.shape[2], True, indices.shape[-1])
        return flash_mla.flash_mla_with_kvcache(q, kv, block_table, seqlens, 512, tsm, ns, softmax_scale=1.0,
                                                is_fp8_kvcache=True, indices=indices)
    main = R.make_sparse_cache("v32", 2, 2, 100, 64, 64)
    q = R.rand((2, 2, 64, 576))
    seqlens = torch.full((2,), 100, dtype=torch.int32)
    bt = torch.full((2, 2), R.GARBAGE_BLOCK_ID, dtype=torch.int32)
    _equal(compiled(f)(q, main.kv8, main.indices, seqlens, bt), f(q, main.kv8, main.indices, seqlens, bt))


@pytest.mark.parametrize("lse_base", [2, "e"])
def test_sparse_prefill(lse_base):
    def f(q, kv, indices, sink, tl):
        return flash_mla.flash_mla_sparse_fwd(q, kv, indices, 1.0, attn_sink=sink, topk_length=tl, lse_base=lse_base)
    c = R.make_prefill_case(8, 100, 16, 576, 40, with_topk_length=True, lonely_rows=(3,))
    sink = R.make_sink(16, "finite")
    _equal(compiled(f)(c.q, c.kv, c.indices, sink, c.topk_length), f(c.q, c.kv, c.indices, sink, c.topk_length))


def test_sparse_prefill_dynamic_shapes():
    def f(q, kv, indices):
        return flash_mla.flash_mla_sparse_fwd(q, kv, indices, 0.5)
    cf = compiled(f, dynamic=True)
    for s_q, s_kv in ((5, 60), (9, 80)):
        c = R.make_prefill_case(s_q, s_kv, 16, 512, 24)
        _equal(cf(c.q, c.kv, c.indices), f(c.q, c.kv, c.indices))


def test_inductor_backend():
    """Default backend (inductor): the API call plus surrounding pointwise work in one graph."""
    def f(q, kv, indices, k_cache, block_table, seqlens, q_dec):
        out, max_logits, lse = flash_mla.flash_mla_sparse_fwd(q * 2, kv, indices, 0.5, lse_base="e")
        meta, _ = flash_mla.get_mla_metadata()
        dout, dlse = flash_mla.flash_mla_with_kvcache(q_dec, k_cache, block_table, seqlens, 512, meta,
                                                      softmax_scale=1.0, causal=True)
        return out.float() + 1, lse * 2, dout, dlse
    c = R.make_prefill_case(6, 70, 16, 576, 24)
    p = R.make_dense_paged([20, 45], 16, 1, 576, torch.bfloat16)
    q_dec = R.rand((2, 2, 16, 576))
    args = (c.q, c.kv, c.indices, p.k_cache, p.block_table, p.cache_seqlens, q_dec)
    got = torch.compile(f, fullgraph=True)(*args)
    ref_out, _, ref_lse = R.ref_sparse_prefill(c.q * 2, c.kv, c.indices, 0.5)
    R.check_is_allclose("out", got[0] - 1, ref_out, **R.PREFILL_OUT_TOL)
    R.check_is_allclose("lse", got[1] / 2, ref_lse, **R.PREFILL_LSE_TOL)
    dref, dlse_ref = R.ref_dense_decode(q_dec, p.seqs, 1.0, True)
    R.check_is_allclose("dense out", got[2], dref, **R.DENSE_OUT_TOL)
    R.check_is_allclose("dense lse", got[3], dlse_ref, **R.DENSE_LSE_TOL)
