"""torch.ops.mla_kernels.*: schemas (sgl-kernel's, argument for argument), return conventions
(newly planned metadata when None is passed, None when the caller passes it), results against the
reference, and torch.library.opcheck on every op with small inputs."""

import pytest
import torch

import reference as R
import mla_kernels.flash_mla  # noqa: F401  (loads the ops)

ops = torch.ops.mla_kernels

SCHEMAS = {
    "get_mla_decoding_metadata":
        "(Tensor seqlens_k, int num_q_tokens_per_head_k, int h_k, int? h_q, bool is_fp8_kvcache, int? topk) -> Tensor[]",
    "get_mla_decoding_metadata_dense_fp8":
        "(Tensor seqlens_k, int num_heads_per_head_k, int num_heads_k) -> Tensor[]",
    "fwd_kvcache_mla":
        "(Tensor q, Tensor kv_cache, int head_size_v, Tensor seqlens_k, Tensor block_table, float softmax_scale, "
        "bool is_causal, Tensor tile_scheduler_metadata, Tensor num_splits, bool is_fp8, Tensor? indices, "
        "Tensor? attn_sink, Tensor? extra_k_cache, Tensor? extra_indices_in_kvcache, Tensor? topk_length, "
        "Tensor? extra_topk_length) -> Tensor[]",
    "fwd_kvcache_mla_fp8":
        "(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, Tensor block_table, float softmax_scale, "
        "bool is_causal, Tensor tile_scheduler_metadata, Tensor num_splits, Tensor? descale_q, Tensor? descale_k) "
        "-> Tensor[]",
    "dense_decode_fwd":
        "(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, Tensor block_table, float softmax_scale, "
        "bool is_causal, Tensor? tile_scheduler_metadata, Tensor? num_splits) -> (Tensor, Tensor, Tensor?, Tensor?)",
    "sparse_decode_fwd":
        "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
        "Tensor? tile_scheduler_metadata, Tensor? num_splits, Tensor? extra_kv, Tensor? extra_indices, "
        "Tensor? extra_topk_length, int d_v, float sm_scale) -> (Tensor, Tensor, Tensor?, Tensor?)",
    "sparse_prefill_fwd":
        "(Tensor q, Tensor kv, Tensor indices, float sm_scale, int d_v, Tensor? attn_sink=None, "
        "Tensor? topk_length=None) -> Tensor[]",
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_matches_sgl_kernel(name):
    got = getattr(ops, name).default._schema
    want = torch._C.parse_schema(f"mla_kernels::{name}{SCHEMAS[name]}")
    g_args = [(a.name, str(a.type)) for a in got.arguments]
    w_args = [(a.name, str(a.type)) for a in want.arguments]
    assert g_args == w_args, f"{name}: got {got}"
    assert [str(r.type) for r in got.returns] == [str(r.type) for r in want.returns], f"{name}: got {got}"
    if name == "sparse_prefill_fwd":
        assert [a.default_value for a in got.arguments[-2:]] == [None, None]
        assert all(a.has_default_value() for a in got.arguments[-2:])


# ----------------------------------------------------------------------------- inputs

def dense_inputs(causal=True, s_q=2, h_q=16, seqlens=(40, 7), page=16, d=576, dtype=torch.bfloat16):
    paged = R.make_dense_paged(list(seqlens), page, 1, d, dtype)
    q = R.rand((len(seqlens), s_q, h_q, d), dtype)
    return q, paged


def sparse_inputs(fmt="model1", b=2, s_q=1, h_q=16, topk=32, extra=True, tl=True):
    main = R.make_sparse_cache(fmt, b, s_q, 80, topk, 16, with_topk_length=tl)
    ex = R.make_sparse_cache(fmt, b, s_q, 40, 8, 4, with_topk_length=True) if extra else None
    q = R.rand((b, s_q, h_q, R.FORMATS[fmt].d))
    sink = R.make_sink(h_q, "finite")
    return q, main, ex, sink


# ----------------------------------------------------------------------------- semantics

def test_dense_decode_fwd_returns_plan_then_none():
    q, p = dense_inputs()
    out, lse, tsm, ns = ops.dense_decode_fwd(q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, True, None, None)
    assert tsm is not None and ns is not None
    assert tsm.dtype == torch.int32 and tsm.shape[1] == 8 and tuple(ns.shape) == (3,)
    ref_out, ref_lse = R.ref_dense_decode(q, p.seqs, 1.0, True)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)
    out2, lse2, tsm2, ns2 = ops.dense_decode_fwd(q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, True, tsm, ns)
    assert tsm2 is None and ns2 is None
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_sparse_decode_fwd_returns_plan_then_none():
    q, main, ex, sink = sparse_inputs()
    res = ops.sparse_decode_fwd(q, main.kv8, main.indices, main.topk_length, sink, None, None, ex.kv8, ex.indices,
                                ex.topk_length, 512, 1.0)
    out, lse, tsm, ns = res
    assert tsm is not None and tsm.dtype == torch.int32 and tsm.shape[1] == 8 and tuple(ns.shape) == (3,)
    assert lse.stride() == (16, 1, 16)
    ref_out, ref_lse = R.ref_sparse_decode(q, main.tokens, main.indices, 1.0, main.topk_length, sink, ex.tokens,
                                           ex.indices, ex.topk_length)
    R.check_is_allclose("out", out, ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.SPARSE_LSE_TOL)
    out2, lse2, tsm2, ns2 = ops.sparse_decode_fwd(q, main.kv8, main.indices, main.topk_length, sink, tsm, ns, ex.kv8,
                                                  ex.indices, ex.topk_length, 512, 1.0)
    assert tsm2 is None and ns2 is None
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_fwd_kvcache_mla_dense_and_sparse():
    q, p = dense_inputs()
    tsm, ns = ops.get_mla_decoding_metadata(p.cache_seqlens, 2 * 16, 1, None, False, None)
    res = ops.fwd_kvcache_mla(q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, True, tsm, ns, False,
                              None, None, None, None, None, None)
    out, lse = res[0], res[1]
    ref_out, ref_lse = R.ref_dense_decode(q, p.seqs, 1.0, True)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)

    qs, main, _, _ = sparse_inputs(fmt="v32", h_q=64, topk=64, extra=False, tl=False)
    seqlens = torch.full((2,), 80, dtype=torch.int32)
    tsm, ns = ops.get_mla_decoding_metadata(seqlens, 64, 1, 64, True, 64)
    bt = torch.full((2, 5), R.GARBAGE_BLOCK_ID, dtype=torch.int32)
    res = ops.fwd_kvcache_mla(qs, main.kv8, 512, seqlens, bt, 1.0, False, tsm, ns, True, main.indices,
                              None, None, None, None, None)
    ref_out, ref_lse = R.ref_sparse_decode(qs, main.tokens, main.indices, 1.0)
    R.check_is_allclose("sparse out", res[0], ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("sparse lse", res[1], ref_lse, **R.SPARSE_LSE_TOL)


def test_fwd_kvcache_mla_fp8():
    p = R.make_dense_paged([30, 66], 64, 1, 576, torch.float8_e4m3fn)
    q8 = (R.rand((2, 1, 16, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
    tsm, ns = ops.get_mla_decoding_metadata_dense_fp8(p.cache_seqlens, 16, 1)
    dq, dk = torch.tensor([0.04]), torch.tensor([0.03])
    res = ops.fwd_kvcache_mla_fp8(q8, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, False, tsm, ns, dq, dk)
    assert res[0].dtype == torch.bfloat16
    ref_out, ref_lse = R.ref_dense_decode(q8, p.seqs, 1.0, False, q_scale=dq.expand(2), k_scale=dk.expand(2))
    R.check_is_allclose("out", res[0], ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", res[1], ref_lse, **R.DENSE_LSE_TOL)


def test_sparse_prefill_fwd_is_base2():
    c = R.make_prefill_case(6, 100, 16, 576, 40, with_topk_length=True, lonely_rows=(2,))
    sink = R.make_sink(16, "finite")
    out, max_logits, lse = ops.sparse_prefill_fwd(c.q, c.kv, c.indices, 1.0, 512, sink, c.topk_length)
    ref_out, ref_max, ref_lse = R.ref_sparse_prefill(c.q, c.kv, c.indices, 1.0, sink, c.topk_length)
    R.check_is_allclose("out", out, ref_out, **R.PREFILL_OUT_TOL)
    R.check_is_allclose("max_logits", max_logits, ref_max * R.LOG2E, **R.PREFILL_MAX_LOGITS_TOL)
    R.check_is_allclose("lse", lse, ref_lse * R.LOG2E, **R.PREFILL_LSE_TOL)


# ----------------------------------------------------------------------------- opcheck

def _opcheck_cases():
    def dense():
        q, p = dense_inputs(seqlens=(20, 5), page=16, h_q=8)
        return ops.dense_decode_fwd, (q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, True, None, None)

    def dense_with_plan():
        q, p = dense_inputs(seqlens=(20, 5), page=16, h_q=8)
        _, _, tsm, ns = ops.dense_decode_fwd(q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, True, None, None)
        return ops.dense_decode_fwd, (q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, True, tsm, ns)

    def sparse():
        q, main, ex, sink = sparse_inputs(h_q=8, topk=16)
        return ops.sparse_decode_fwd, (q, main.kv8, main.indices, main.topk_length, sink, None, None, ex.kv8,
                                       ex.indices, ex.topk_length, 512, 1.0)

    def sparse_v32_plain():
        q, main, _, _ = sparse_inputs(fmt="v32", h_q=4, topk=16, extra=False, tl=False)
        return ops.sparse_decode_fwd, (q, main.kv8, main.indices, None, None, None, None, None, None, None, 512, 0.5)

    def prefill():
        c = R.make_prefill_case(4, 50, 8, 512, 16, with_topk_length=True, poison=False)
        return ops.sparse_prefill_fwd, (c.q, c.kv, c.indices, 1.0, 512, R.make_sink(8, "finite"), c.topk_length)

    def metadata():
        return ops.get_mla_decoding_metadata, (torch.tensor([10, 300, 0], dtype=torch.int32), 16, 1, None, False, None)

    def metadata_sparse():
        return ops.get_mla_decoding_metadata, (torch.tensor([10, 300], dtype=torch.int32), 64, 1, 64, True, 64)

    def metadata_fp8():
        return ops.get_mla_decoding_metadata_dense_fp8, (torch.tensor([10, 300], dtype=torch.int32), 16, 1)

    def legacy():
        q, p = dense_inputs(seqlens=(20, 5), page=16, h_q=8, s_q=1)
        tsm, ns = ops.get_mla_decoding_metadata(p.cache_seqlens, 8, 1, None, False, None)
        return ops.fwd_kvcache_mla, (q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, False, tsm, ns, False,
                                     None, None, None, None, None, None)

    def legacy_fp8():
        p = R.make_dense_paged([30, 6], 16, 1, 576, torch.float8_e4m3fn)
        q8 = (R.rand((2, 1, 8, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
        tsm, ns = ops.get_mla_decoding_metadata_dense_fp8(p.cache_seqlens, 8, 1)
        return ops.fwd_kvcache_mla_fp8, (q8, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, False, tsm, ns,
                                         torch.tensor([0.05, 0.04]), torch.tensor([0.02, 0.03]))

    def quantize():
        return ops.quantize_kv_fp8, (R.rand((2, 16, 1, 512)), "model1")

    def dequantize():
        return ops.dequantize_kv_fp8, (R.quantize_ref(R.rand((2, 16, 1, 576)), "v32"), "v32")

    return {"quantize_kv_fp8": quantize, "dequantize_kv_fp8": dequantize, "dense_decode_fwd": dense, "dense_decode_fwd_with_plan": dense_with_plan,
            "sparse_decode_fwd": sparse, "sparse_decode_fwd_v32": sparse_v32_plain,
            "sparse_prefill_fwd": prefill, "get_mla_decoding_metadata": metadata,
            "get_mla_decoding_metadata_sparse": metadata_sparse,
            "get_mla_decoding_metadata_dense_fp8": metadata_fp8, "fwd_kvcache_mla": legacy,
            "fwd_kvcache_mla_fp8": legacy_fp8}


OPCHECK = _opcheck_cases()


@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name):
    op, args = OPCHECK[name]()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
        # torch's SchemaCheckMode compares inputs with allclose, which has no float8 kernel on CPU;
        # check "no input is mutated" by hand instead.
        utils = utils[1:]
        before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.element_size() == 1
                  else (a.clone() if isinstance(a, torch.Tensor) else a) for a in args]
        op(*args)
        for a, b in zip(args, before):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b)
    torch.library.opcheck(op, args, test_utils=utils)

