"""torch.compile(fullgraph=True) over the Python API: flash_mla_with_kvcache on the lazy
FlashMLASchedMeta path (planned inside the graph, and reused across "layers") and on the legacy
tensor path, and flash_mla_sparse_fwd in both lse conventions. aot_eager everywhere (same kernels:
results must be bitwise equal to eager), plus one case through the default inductor backend. The
aot_eager tests run on "cpu" and "cuda" (the `device` fixture); the inductor one is CPU-only."""

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
        assert x.device == y.device, (x.device, y.device)
        assert torch.equal(x, y)


def _on(device, *ts):
    """The tensors moved to `device` (strides kept); None stays None."""
    return tuple(R.to_device(t, device) for t in ts)


def test_dense_lazy_meta_planned_inside_graph(device):
    def f(q, k_cache, block_table, seqlens):
        meta, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, softmax_scale=1.0,
                                                causal=True)
    p = R.make_dense_paged([50, 3, 0], 16, 1, 576, torch.bfloat16)
    q = R.rand((3, 2, 16, 576))
    args = _on(device, q, p.k_cache, p.block_table, p.cache_seqlens)
    got = compiled(f)(*args)
    _equal(got, f(*args))
    ref_out, _ = R.ref_dense_decode(q, p.seqs, 1.0, True)
    R.check_is_allclose("out", R.to_cpu(got[0], device), ref_out, **R.DENSE_OUT_TOL)


def test_dense_lazy_meta_reused_across_layers(device):
    def layer(q, k_cache, block_table, seqlens, meta):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, softmax_scale=1.0,
                                                causal=True)
    p = R.make_dense_paged([33, 90], 16, 1, 576, torch.bfloat16)
    kc, bt, sl = _on(device, p.k_cache, p.block_table, p.cache_seqlens)
    cf = compiled(layer)
    meta, _ = flash_mla.get_mla_metadata()
    for i in range(3):
        q = R.to_device(R.rand((2, 2, 32, 576)), device)
        got = cf(q, kc, bt, sl, meta)
        assert meta.have_initialized and meta.tile_scheduler_metadata is not None
        assert meta.tile_scheduler_metadata.device == q.device
        eager_meta, _ = flash_mla.get_mla_metadata()
        _equal(got, layer(q, kc, bt, sl, eager_meta))
    assert meta.config == flash_mla.FlashMLASchedMeta.Config(2, 2, 32, 16, 1, True, False, None, None, None)


def test_dense_legacy_tensor_path(device):
    def f(q, k_cache, block_table, seqlens, tsm, ns):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, tsm, ns, softmax_scale=1.0,
                                                causal=True)

    def g(q, k_cache, block_table, seqlens):
        tsm, ns = flash_mla.get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1)
        return f(q, k_cache, block_table, seqlens, tsm, ns)

    p = R.make_dense_paged([70, 5], 64, 1, 576, torch.bfloat16)
    args = _on(device, R.rand((2, 2, 16, 576)), p.k_cache, p.block_table, p.cache_seqlens)
    tsm, ns = flash_mla.get_mla_metadata(args[3], 32, 1)
    eager = f(*args, tsm, ns)
    _equal(compiled(f)(*args, tsm, ns), eager)
    _equal(compiled(g)(*args), eager)


def test_dense_fp8_legacy_path(device):
    def f(q, k_cache, block_table, seqlens, tsm, ns, dq, dk):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, tsm, ns, softmax_scale=1.0,
                                                descale_q=dq, descale_k=dk)
    p = R.make_dense_paged([40, 9], 16, 1, 576, torch.float8_e4m3fn)
    q8 = (R.rand((2, 1, 16, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
    q8, kc, bt, sl, dq, dk = _on(device, q8, p.k_cache, p.block_table, p.cache_seqlens, torch.tensor([0.05]),
                                 torch.tensor([0.03]))
    tsm, ns = flash_mla.get_mla_metadata(sl, 16, 1, is_fp8_kvcache=True)
    args = (q8, kc, bt, sl, tsm, ns, dq, dk)
    _equal(compiled(f)(*args), f(*args))


@pytest.mark.parametrize("fmt", ["v32", "model1"])
def test_sparse_lazy_meta(fmt, device):
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
        args = _on(device, q, main.kv8, main.indices, sink, ex.kv8, ex.indices, main.topk_length, ex.topk_length)
        got = cf(*args, meta)
        eager_meta, _ = flash_mla.get_mla_metadata()
        _equal(got, layer(*args, eager_meta))
        assert got[1].stride() == (16, 1, 16)


def test_sparse_legacy_tensor_path(device):
    def f(q, kv, indices, seqlens, block_table):
        tsm, ns = flash_mla.get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1, q.shape[2], True, indices.shape[-1])
        return flash_mla.flash_mla_with_kvcache(q, kv, block_table, seqlens, 512, tsm, ns, softmax_scale=1.0,
                                                is_fp8_kvcache=True, indices=indices)
    main = R.make_sparse_cache("v32", 2, 2, 100, 64, 64)
    q = R.rand((2, 2, 64, 576))
    seqlens = torch.full((2,), 100, dtype=torch.int32)
    bt = torch.full((2, 2), R.GARBAGE_BLOCK_ID, dtype=torch.int32)
    args = _on(device, q, main.kv8, main.indices, seqlens, bt)
    _equal(compiled(f)(*args), f(*args))


@pytest.mark.parametrize("lse_base", [2, "e"])
def test_sparse_prefill(lse_base, device):
    def f(q, kv, indices, sink, tl):
        return flash_mla.flash_mla_sparse_fwd(q, kv, indices, 1.0, attn_sink=sink, topk_length=tl, lse_base=lse_base)
    c = R.make_prefill_case(8, 100, 16, 576, 40, with_topk_length=True, lonely_rows=(3,))
    sink = R.make_sink(16, "finite")
    args = _on(device, c.q, c.kv, c.indices, sink, c.topk_length)
    _equal(compiled(f)(*args), f(*args))


def test_sparse_prefill_dynamic_shapes(device):
    def f(q, kv, indices):
        return flash_mla.flash_mla_sparse_fwd(q, kv, indices, 0.5)
    cf = compiled(f, dynamic=True)
    for s_q, s_kv in ((5, 60), (9, 80)):
        c = R.make_prefill_case(s_q, s_kv, 16, 512, 24)
        args = _on(device, c.q, c.kv, c.indices)
        _equal(cf(*args), f(*args))


def test_inductor_backend():
    """Default backend (inductor): the API call plus surrounding pointwise work in one graph (CPU only)."""
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
