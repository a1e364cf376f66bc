"""torch.ops.mla_kernels.*: schemas (sgl-kernel's, argument for argument), return conventions
(newly planned metadata when None is passed, None when the caller passes it), results against the
reference, and torch.library.opcheck on every op with small inputs. The semantic tests and opcheck
run on "cpu" and "cuda" (opcheck of the CUDA kernels with CUDA inputs), except the format ops
quantize_kv_fp8 / dequantize_kv_fp8, which only have a CPU kernel (the Python helpers round-trip
through the CPU)."""

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


def on(device, *ts):
    """The tensors moved to `device` (strides kept); None and non-tensors pass through."""
    return tuple(R.to_device(t, device) if isinstance(t, torch.Tensor) else t for t in ts)


def back(device, *ts):
    """Results of an op: checked to be on `device`, returned on the CPU."""
    return tuple(R.to_cpu(t, device) for t in ts)


def sparse_inputs(fmt="model1", b=2, s_q=1, h_q=16, topk=32, extra=True, tl=True, device="cpu"):
    # CUDA kernels round P to bf16 (flashmla-semantics.md §4.7): FlashMLA's key distribution there.
    spread = device == "cpu"
    main = R.make_sparse_cache(fmt, b, s_q, 80, topk, 16, with_topk_length=tl, scale_spread=spread)
    ex = R.make_sparse_cache(fmt, b, s_q, 40, 8, 4, with_topk_length=True, scale_spread=spread) if extra else None
    q = R.rand((b, s_q, h_q, R.FORMATS[fmt].d))
    sink = R.make_sink(h_q, "finite")
    return q, main, ex, sink


# ----------------------------------------------------------------------------- semantics

def test_dense_decode_fwd_returns_plan_then_none(device):
    q, p = dense_inputs()
    q_d, kc, sl, bt = on(device, q, p.k_cache, p.cache_seqlens, p.block_table)
    out, lse, tsm, ns = ops.dense_decode_fwd(q_d, kc, 512, sl, bt, 1.0, True, None, None)
    assert tsm is not None and ns is not None
    assert tsm.dtype == torch.int32 and tsm.shape[1] == 8 and tuple(ns.shape) == (3,)
    assert tsm.device == ns.device == q_d.device
    out2, lse2, tsm2, ns2 = ops.dense_decode_fwd(q_d, kc, 512, sl, bt, 1.0, True, tsm, ns)
    assert tsm2 is None and ns2 is None
    out, lse, out2, lse2 = back(device, out, lse, out2, lse2)
    ref_out, ref_lse = R.ref_dense_decode(q, p.seqs, 1.0, True)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_sparse_decode_fwd_returns_plan_then_none(device):
    q, main, ex, sink = sparse_inputs(device=device)
    args = on(device, q, main.kv8, main.indices, main.topk_length, sink)
    extra = on(device, ex.kv8, ex.indices, ex.topk_length)
    res = ops.sparse_decode_fwd(*args, None, None, *extra, 512, 1.0)
    out, lse, tsm, ns = res
    assert tsm is not None and tsm.dtype == torch.int32 and tsm.shape[1] == 8 and tuple(ns.shape) == (3,)
    assert tsm.device == ns.device == args[0].device
    assert lse.stride() == (16, 1, 16)
    out2, lse2, tsm2, ns2 = ops.sparse_decode_fwd(*args, tsm, ns, *extra, 512, 1.0)
    assert tsm2 is None and ns2 is None
    out, lse, out2, lse2 = back(device, out, lse, out2, lse2)
    ref_out, ref_lse = R.ref_sparse_decode(q, main.tokens, main.indices, 1.0, main.topk_length, sink, ex.tokens,
                                           ex.indices, ex.topk_length)
    R.check_is_allclose("out", out, ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.SPARSE_LSE_TOL)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_fwd_kvcache_mla_dense_and_sparse(device):
    q, p = dense_inputs()
    q_d, kc, sl, bt = on(device, q, p.k_cache, p.cache_seqlens, p.block_table)
    tsm, ns = ops.get_mla_decoding_metadata(sl, 2 * 16, 1, None, False, None)
    res = ops.fwd_kvcache_mla(q_d, kc, 512, sl, bt, 1.0, True, tsm, ns, False, None, None, None, None, None, None)
    out, lse = back(device, res[0], res[1])
    ref_out, ref_lse = R.ref_dense_decode(q, p.seqs, 1.0, True)
    R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", lse, ref_lse, **R.DENSE_LSE_TOL)

    qs, main, _, _ = sparse_inputs(fmt="v32", h_q=64, topk=64, extra=False, tl=False, device=device)
    seqlens = torch.full((2,), 80, dtype=torch.int32, device=device)
    tsm, ns = ops.get_mla_decoding_metadata(seqlens, 64, 1, 64, True, 64)
    bt = torch.full((2, 5), R.GARBAGE_BLOCK_ID, dtype=torch.int32, device=device)
    qs_d, kv8, idx = on(device, qs, main.kv8, main.indices)
    res = ops.fwd_kvcache_mla(qs_d, kv8, 512, seqlens, bt, 1.0, False, tsm, ns, True, idx,
                              None, None, None, None, None)
    res = back(device, *res)
    ref_out, ref_lse = R.ref_sparse_decode(qs, main.tokens, main.indices, 1.0)
    R.check_is_allclose("sparse out", res[0], ref_out, **R.SPARSE_OUT_TOL)
    R.check_is_allclose("sparse lse", res[1], ref_lse, **R.SPARSE_LSE_TOL)


def test_fwd_kvcache_mla_fp8(device):
    p = R.make_dense_paged([30, 66], 64, 1, 576, torch.float8_e4m3fn)
    q8 = (R.rand((2, 1, 16, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
    dq, dk = torch.tensor([0.04]), torch.tensor([0.03])
    q8_d, kc, sl, bt, dq_d, dk_d = on(device, q8, p.k_cache, p.cache_seqlens, p.block_table, dq, dk)
    tsm, ns = ops.get_mla_decoding_metadata_dense_fp8(sl, 16, 1)
    res = ops.fwd_kvcache_mla_fp8(q8_d, kc, 512, sl, bt, 1.0, False, tsm, ns, dq_d, dk_d)
    res = back(device, *res)
    assert res[0].dtype == torch.bfloat16
    ref_out, ref_lse = R.ref_dense_decode(q8, p.seqs, 1.0, False, q_scale=dq.expand(2), k_scale=dk.expand(2))
    R.check_is_allclose("out", res[0], ref_out, **R.DENSE_OUT_TOL)
    R.check_is_allclose("lse", res[1], ref_lse, **R.DENSE_LSE_TOL)


def test_sparse_prefill_fwd_is_base2(device):
    c = R.make_prefill_case(6, 100, 16, 576, 40, with_topk_length=True, lonely_rows=(2,))
    sink = R.make_sink(16, "finite")
    q, kv, idx, sink_d, tl = on(device, c.q, c.kv, c.indices, sink, c.topk_length)
    out, max_logits, lse = back(device, *ops.sparse_prefill_fwd(q, kv, idx, 1.0, 512, sink_d, tl))
    ref_out, ref_max, ref_lse = R.ref_sparse_prefill(c.q, c.kv, c.indices, 1.0, sink, c.topk_length)
    R.check_is_allclose("out", out, ref_out, **R.PREFILL_OUT_TOL)
    R.check_is_allclose("max_logits", max_logits, ref_max * R.LOG2E, **R.PREFILL_MAX_LOGITS_TOL)
    R.check_is_allclose("lse", lse, ref_lse * R.LOG2E, **R.PREFILL_LSE_TOL)


# ----------------------------------------------------------------------------- opcheck

def _opcheck_cases():
    """name -> builder(device) -> (op, args): inputs made on the CPU and moved to `device`; plans
    (when the case takes one) are made on `device`."""
    def dense(dev):
        q, p = dense_inputs(seqlens=(20, 5), page=16, h_q=8)
        return ops.dense_decode_fwd, on(dev, q, p.k_cache, 512, p.cache_seqlens, p.block_table, 1.0, True, None, None)

    def dense_with_plan(dev):
        q, p = dense_inputs(seqlens=(20, 5), page=16, h_q=8)
        q, kc, sl, bt = on(dev, q, p.k_cache, p.cache_seqlens, p.block_table)
        _, _, tsm, ns = ops.dense_decode_fwd(q, kc, 512, sl, bt, 1.0, True, None, None)
        return ops.dense_decode_fwd, (q, kc, 512, sl, bt, 1.0, True, tsm, ns)

    def sparse(dev):
        q, main, ex, sink = sparse_inputs(h_q=8, topk=16)
        return ops.sparse_decode_fwd, on(dev, q, main.kv8, main.indices, main.topk_length, sink, None, None, ex.kv8,
                                         ex.indices, ex.topk_length, 512, 1.0)

    def sparse_v32_plain(dev):
        q, main, _, _ = sparse_inputs(fmt="v32", h_q=4, topk=16, extra=False, tl=False)
        return ops.sparse_decode_fwd, on(dev, q, main.kv8, main.indices, None, None, None, None, None, None, None,
                                         512, 0.5)

    def prefill(dev):
        c = R.make_prefill_case(4, 50, 8, 512, 16, with_topk_length=True, poison=False)
        return ops.sparse_prefill_fwd, on(dev, c.q, c.kv, c.indices, 1.0, 512, R.make_sink(8, "finite"),
                                          c.topk_length)

    def metadata(dev):
        return ops.get_mla_decoding_metadata, on(dev, torch.tensor([10, 300, 0], dtype=torch.int32), 16, 1, None,
                                                 False, None)

    def metadata_sparse(dev):
        return ops.get_mla_decoding_metadata, on(dev, torch.tensor([10, 300], dtype=torch.int32), 64, 1, 64, True, 64)

    def metadata_fp8(dev):
        return ops.get_mla_decoding_metadata_dense_fp8, on(dev, torch.tensor([10, 300], dtype=torch.int32), 16, 1)

    def legacy(dev):
        q, p = dense_inputs(seqlens=(20, 5), page=16, h_q=8, s_q=1)
        q, kc, sl, bt = on(dev, q, p.k_cache, p.cache_seqlens, p.block_table)
        tsm, ns = ops.get_mla_decoding_metadata(sl, 8, 1, None, False, None)
        return ops.fwd_kvcache_mla, (q, kc, 512, sl, bt, 1.0, False, tsm, ns, False, None, None, None, None, None, None)

    def legacy_fp8(dev):
        p = R.make_dense_paged([30, 6], 16, 1, 576, torch.float8_e4m3fn)
        q8 = (R.rand((2, 1, 8, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
        q8, kc, sl, bt, dq, dk = on(dev, q8, p.k_cache, p.cache_seqlens, p.block_table, torch.tensor([0.05, 0.04]),
                                    torch.tensor([0.02, 0.03]))
        tsm, ns = ops.get_mla_decoding_metadata_dense_fp8(sl, 8, 1)
        return ops.fwd_kvcache_mla_fp8, (q8, kc, 512, sl, bt, 1.0, False, tsm, ns, dq, dk)

    def quantize(dev):
        return ops.quantize_kv_fp8, on(dev, R.rand((2, 16, 1, 512)), "model1")

    def dequantize(dev):
        return ops.dequantize_kv_fp8, on(dev, R.quantize_ref(R.rand((2, 16, 1, 576)), "v32"), "v32")

    return {"quantize_kv_fp8": quantize, "dequantize_kv_fp8": dequantize, "dense_decode_fwd": dense, "dense_decode_fwd_with_plan": dense_with_plan,
            "sparse_decode_fwd": sparse, "sparse_decode_fwd_v32": sparse_v32_plain,
            "sparse_prefill_fwd": prefill, "get_mla_decoding_metadata": metadata,
            "get_mla_decoding_metadata_sparse": metadata_sparse,
            "get_mla_decoding_metadata_dense_fp8": metadata_fp8, "fwd_kvcache_mla": legacy,
            "fwd_kvcache_mla_fp8": legacy_fp8}


OPCHECK = _opcheck_cases()
# Ops with a CPU kernel only (the Python format helpers move CUDA tensors through the CPU).
CPU_ONLY_OPS = ("quantize_kv_fp8", "dequantize_kv_fp8")
OPCHECK_PARAMS = [pytest.param(n, "cpu", id=f"{n}-cpu") for n in OPCHECK] + [
    pytest.param(n, "cuda", id=f"{n}-cuda", marks=pytest.mark.cuda) for n in OPCHECK if n not in CPU_ONLY_OPS]


@pytest.mark.parametrize("name,device", OPCHECK_PARAMS)
def test_opcheck(name, device):
    op, args = OPCHECK[name](device)
    for a in args:
        if isinstance(a, torch.Tensor):
            assert a.device.type == device
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
        # torch's SchemaCheckMode compares inputs with allclose, which has no float8 kernel;
        # check "no input is mutated" by hand instead.
        utils = utils[1:]
        before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.element_size() == 1
                  else (a.clone() if isinstance(a, torch.Tensor) else a) for a in args]
        op(*args)
        for a, b in zip(args, before):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b)
    torch.library.opcheck(op, args, test_utils=utils)
