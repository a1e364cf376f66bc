"""Scheduling metadata: the lazy FlashMLASchedMeta object (Config recorded on first use, checked on
every reuse, one plan reused by several layers) and the legacy eager tensors of get_mla_metadata
([num_sm_parts, 8] int32, [b+1] int32, num_splits[0] == 0 and non-decreasing). Tests that call the
library run on "cpu" and "cuda" (the `device` fixture); the legacy tensors are made on the device of
cache_seqlens (on CUDA num_sm_parts follows the GPU's SM count)."""

import dataclasses

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R

Meta = flash_mla.FlashMLASchedMeta


def test_dataclass_fields():
    assert dataclasses.is_dataclass(Meta) and dataclasses.is_dataclass(Meta.Config)
    assert [f.name for f in dataclasses.fields(Meta)] == [
        "have_initialized", "config", "tile_scheduler_metadata", "num_splits"]
    assert [f.name for f in dataclasses.fields(Meta.Config)] == [
        "b", "s_q", "h_q", "page_block_size", "h_k", "causal", "is_fp8_kvcache", "topk",
        "extra_page_block_size", "extra_topk"]


@pytest.mark.parametrize("kwargs", [{}, {"num_q_tokens_per_head_k": 128, "num_heads_k": 1},
                                    {"num_heads_q": 64, "is_fp8_kvcache": True, "topk": 128}])
def test_lazy_metadata_without_cache_seqlens(kwargs):
    meta, none = flash_mla.get_mla_metadata(**kwargs)
    assert isinstance(meta, Meta) and none is None
    assert meta.have_initialized is False and meta.config is None
    assert meta.tile_scheduler_metadata is None and meta.num_splits is None
    meta2, _ = flash_mla.get_mla_metadata(**kwargs)
    assert meta2 is not meta


def _check_plan_tensors(tsm, ns, b, device):
    assert isinstance(tsm, torch.Tensor) and isinstance(ns, torch.Tensor)
    assert tsm.device.type == ns.device.type == torch.device(device).type, (tsm.device, ns.device)
    if tsm.is_cuda:
        # SPEC section 2: num_sm_parts <= the GPU's SM count
        assert tsm.shape[0] <= torch.cuda.get_device_properties(tsm.device).multi_processor_count, tsm.shape
    tsm, ns = tsm.cpu(), ns.cpu()
    assert tsm.dtype == torch.int32 and tsm.dim() == 2 and tsm.shape[1] == 8 and tsm.shape[0] >= 1
    assert tsm.is_contiguous() and ns.is_contiguous()
    assert ns.dtype == torch.int32 and tuple(ns.shape) == (b + 1,)
    assert int(ns[0]) == 0
    assert bool((ns[1:] >= ns[:-1]).all()), ns


# ----------------------------------------------------------------------------- lazy, dense

def _dense_call(meta, q, paged, causal, is_fp8=False, *, device):
    """The library on `device` (inputs moved there); returns (out, lse) on the CPU."""
    q, kc, bt, sl = (R.to_device(t, device) for t in (q, paged.k_cache, paged.block_table, paged.cache_seqlens))
    out, lse = flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, meta, softmax_scale=1.0, causal=causal,
                                                is_fp8_kvcache=is_fp8)
    return R.to_cpu(out, device), R.to_cpu(lse, device)


def test_lazy_dense_records_config_and_plan(device):
    paged = R.make_dense_paged([30, 0, 100], 16, 2, 576, torch.bfloat16)
    q = R.rand((3, 2, 16, 576))
    meta, _ = flash_mla.get_mla_metadata()
    _dense_call(meta, q, paged, True, device=device)
    assert meta.have_initialized is True
    assert meta.config == Meta.Config(3, 2, 16, 16, 2, True, False, None, None, None)
    _check_plan_tensors(meta.tile_scheduler_metadata, meta.num_splits, 3, device)


def test_lazy_dense_plan_reused_across_layers(device):
    """One plan for several layers (same lengths, different data) == a fresh plan per layer."""
    seqlens = [45, 130, 0, 7]
    layers = [(R.make_dense_paged(seqlens, 16, 1, 576, torch.bfloat16), R.rand((4, 2, 64, 576))) for _ in range(3)]
    # same block table / lengths for all layers, as in a real step
    for paged, _ in layers[1:]:
        paged.block_table = layers[0][0].block_table
        paged.k_cache = torch.full_like(layers[0][0].k_cache, float("nan"))
        for i, L in enumerate(seqlens):
            for t in range(L):
                blk = int(paged.block_table[i, t // 16])
                paged.k_cache[blk, t % 16] = paged.seqs[i][t]
    shared, _ = flash_mla.get_mla_metadata()
    results = []
    for idx, (paged, q) in enumerate(layers):
        out, lse = _dense_call(shared, q, paged, True, device=device)
        if idx == 0:
            tsm0, ns0 = shared.tile_scheduler_metadata.clone(), shared.num_splits.clone()
        fresh, _ = flash_mla.get_mla_metadata()
        out_f, lse_f = _dense_call(fresh, q, paged, True, device=device)
        assert torch.equal(out, out_f) and torch.equal(lse, lse_f), f"layer {idx}"
        ref_out, ref_lse = R.ref_dense_decode(q, paged.seqs, 1.0, True)
        R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
        results.append(out)
    assert torch.equal(shared.tile_scheduler_metadata, tsm0) and torch.equal(shared.num_splits, ns0)
    assert not torch.equal(results[0], results[1])


# ----------------------------------------------------------------------------- lazy, sparse

def _sparse_call(meta, q, main, extra=None, *, device):
    """The library on `device` (inputs moved there); returns (out, lse) on the CPU."""
    def dev(t):
        return R.to_device(t, device)
    out, lse = flash_mla.flash_mla_with_kvcache(
        dev(q), dev(main.kv8), None, None, 512, meta, softmax_scale=1.0, is_fp8_kvcache=True,
        indices=dev(main.indices),
        extra_k_cache=None if extra is None else dev(extra.kv8),
        extra_indices_in_kvcache=None if extra is None else dev(extra.indices),
        topk_length=dev(main.topk_length), extra_topk_length=None if extra is None else dev(extra.topk_length))
    return R.to_cpu(out, device), R.to_cpu(lse, device)


def test_lazy_sparse_records_config_and_plan(device):
    main = R.make_sparse_cache("model1", 2, 1, 100, 32, 16, with_topk_length=True)
    extra = R.make_sparse_cache("model1", 2, 1, 50, 8, 64, with_topk_length=True)
    meta, _ = flash_mla.get_mla_metadata()
    _sparse_call(meta, R.rand((2, 1, 16, 512)), main, extra, device=device)
    assert meta.have_initialized is True
    assert meta.config == Meta.Config(2, 1, 16, 16, 1, False, True, 32, 64, 8)
    _check_plan_tensors(meta.tile_scheduler_metadata, meta.num_splits, 2, device)


@pytest.mark.parametrize("fmt", ["v32", "model1"])
def test_lazy_sparse_plan_reused_across_layers(fmt, device):
    d = R.FORMATS[fmt].d
    main = R.make_sparse_cache(fmt, 2, 2, 150, 64, 16, with_topk_length=True)
    extra = R.make_sparse_cache(fmt, 2, 2, 60, 16, 4, with_topk_length=True)
    shared, _ = flash_mla.get_mla_metadata()
    outs = []
    for layer in range(3):
        q = R.rand((2, 2, 32, d))
        out, lse = _sparse_call(shared, q, main, extra, device=device)
        fresh, _ = flash_mla.get_mla_metadata()
        out_f, lse_f = _sparse_call(fresh, q, main, extra, device=device)
        assert torch.equal(out, out_f) and torch.equal(lse, lse_f), f"layer {layer}"
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------------------- config mismatch

def _dense_variant(field):
    b, s_q, h_q, page, h_k, causal, fp8 = 2, 2, 16, 16, 1, True, False
    if field == "b":
        b = 3
    elif field == "s_q":
        s_q = 1
    elif field == "h_q":
        h_q = 32
    elif field == "page_block_size":
        page = 64
    elif field == "h_k":
        h_k = 2
    elif field == "causal":
        causal = False
    elif field == "is_fp8_kvcache":
        fp8 = True
    paged = R.make_dense_paged([20, 41, 5][:b], page, h_k, 576, torch.bfloat16)
    return R.rand((b, s_q, h_q, 576)), paged, causal, fp8


@pytest.mark.parametrize("field", ["b", "s_q", "h_q", "page_block_size", "h_k", "causal", "is_fp8_kvcache"])
def test_dense_config_mismatch_names_field(field, device):
    meta, _ = flash_mla.get_mla_metadata()
    q0, paged0, causal0, fp80 = _dense_variant(None)
    out0, _ = _dense_call(meta, q0, paged0, causal0, fp80, device=device)
    q1, paged1, causal1, fp81 = _dense_variant(field)
    with pytest.raises(AssertionError, match=rf"\b{field}\b"):
        _dense_call(meta, q1, paged1, causal1, fp81, device=device)
    # the plan is still intact for the shapes it was made for
    out_again, _ = _dense_call(meta, q0, paged0, causal0, fp80, device=device)
    assert torch.equal(out0, out_again)


@pytest.mark.parametrize("field", ["topk", "extra_page_block_size", "extra_topk", "h_q", "b"])
def test_sparse_config_mismatch_names_field(field, device):
    b, h_q, topk, e_page, e_topk = 2, 16, 32, 16, 8
    if field == "topk":
        topk = 16
    elif field == "extra_page_block_size":
        e_page = 64
    elif field == "extra_topk":
        e_topk = 16
    elif field == "h_q":
        h_q = 64
    elif field == "b":
        b = 1
    main0 = R.make_sparse_cache("model1", 2, 1, 100, 32, 16)
    extra0 = R.make_sparse_cache("model1", 2, 1, 50, 8, 16)
    main1 = R.make_sparse_cache("model1", b, 1, 100, topk, 16)
    extra1 = R.make_sparse_cache("model1", b, 1, 50, e_topk, e_page)
    meta, _ = flash_mla.get_mla_metadata()
    _sparse_call(meta, R.rand((2, 1, 16, 512)), main0, extra0, device=device)
    with pytest.raises(AssertionError, match=rf"\b{field}\b"):
        _sparse_call(meta, R.rand((b, 1, h_q, 512)), main1, extra1, device=device)


def test_sparse_then_no_extra_mismatch(device):
    """A plan made with an extra cache cannot be reused without one."""
    main = R.make_sparse_cache("model1", 2, 1, 100, 32, 16)
    extra = R.make_sparse_cache("model1", 2, 1, 50, 8, 16)
    meta, _ = flash_mla.get_mla_metadata()
    _sparse_call(meta, R.rand((2, 1, 16, 512)), main, extra, device=device)
    with pytest.raises(AssertionError, match=r"\bextra_(page_block_size|topk)\b"):
        _sparse_call(meta, R.rand((2, 1, 16, 512)), main, None, device=device)


# ----------------------------------------------------------------------------- legacy tensors

@pytest.mark.parametrize("seqlens,s_q,h_q,h_k", [([5], 1, 1, 1), ([0, 0, 0], 2, 16, 1), ([4096, 1, 300, 64], 1, 128, 1),
                                                 ([17, 230], 4, 64, 8), (None, 1, 128, 1)])
def test_legacy_dense_metadata(seqlens, s_q, h_q, h_k, device):
    if seqlens is None:
        seqlens = torch.randint(0, 5000, (300,)).tolist()
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    tsm, ns = flash_mla.get_mla_metadata(cache_seqlens, s_q * h_q // h_k, h_k)
    _check_plan_tensors(tsm, ns, len(seqlens), device)
    tsm2, ns2 = flash_mla.get_mla_metadata(cache_seqlens, s_q * h_q // h_k, h_k)
    assert torch.equal(tsm, tsm2) and torch.equal(ns, ns2)
    tsm3, ns3 = torch.ops.mla_kernels.get_mla_decoding_metadata(cache_seqlens, s_q * h_q // h_k, h_k, None, False, None)
    assert torch.equal(tsm, tsm3) and torch.equal(ns, ns3)


@pytest.mark.parametrize("b,s_q,h_q,topk", [(1, 1, 64, 64), (4, 2, 128, 2048), (3, 1, 16, 7)])
def test_legacy_sparse_metadata(b, s_q, h_q, topk, device):
    cache_seqlens = torch.randint(1, 4000, (b,), dtype=torch.int32).to(device)
    tsm, ns = flash_mla.get_mla_metadata(cache_seqlens, s_q * h_q, 1, h_q, True, topk)
    _check_plan_tensors(tsm, ns, b, device)


@pytest.mark.parametrize("b,s_q,h_q", [(2, 1, 128), (5, 2, 16)])
def test_legacy_dense_fp8_metadata(b, s_q, h_q, device):
    cache_seqlens = torch.randint(0, 3000, (b,), dtype=torch.int32).to(device)
    tsm, ns = flash_mla.get_mla_metadata(cache_seqlens, s_q * h_q, 1, is_fp8_kvcache=True)
    _check_plan_tensors(tsm, ns, b, device)


def test_legacy_plan_reused_across_layers(device):
    seqlens = [70, 3, 199]
    paged = R.make_dense_paged(seqlens, 64, 1, 576, torch.bfloat16)
    kc, bt, sl = (R.to_device(t, device) for t in (paged.k_cache, paged.block_table, paged.cache_seqlens))
    tsm, ns = flash_mla.get_mla_metadata(sl, 2 * 32, 1)
    tsm0, ns0 = tsm.clone(), ns.clone()
    for layer in range(3):
        q = R.rand((3, 2, 32, 576))
        q_d = R.to_device(q, device)
        out, lse = flash_mla.flash_mla_with_kvcache(q_d, kc, bt, sl, 512, tsm, ns, softmax_scale=1.0, causal=True)
        t2, n2 = flash_mla.get_mla_metadata(sl, 2 * 32, 1)
        out2, lse2 = flash_mla.flash_mla_with_kvcache(q_d, kc, bt, sl, 512, t2, n2, softmax_scale=1.0, causal=True)
        out, lse, out2, lse2 = (R.to_cpu(t, device) for t in (out, lse, out2, lse2))
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        ref_out, _ = R.ref_dense_decode(q, paged.seqs, 1.0, True)
        R.check_is_allclose("out", out, ref_out, **R.DENSE_OUT_TOL)
    assert torch.equal(tsm, tsm0) and torch.equal(ns, ns0), "the plan must not be modified by decoding"


# ----------------------------------------------------------------------------- fake kernels agree

# The fake kernels (python/mla_kernels/_ops.py) size the plan tensors with their own copy of the
# planner's part count (include/mla/plan.h: num_sm_parts_dense / num_sm_parts_sparse); under
# torch.compile a wrong copy gives graphs whose plan shapes differ from the real op's. Each shape
# here is planned by the real op and by its fake kernel in FakeTensorMode, and the shapes compared.
DENSE_SHAPES = [(s_q, h_q, h_k) for s_q in (1, 2, 3, 7) for h_q, h_k in
                ((1, 1), (16, 1), (63, 1), (64, 1), (65, 1), (128, 1), (128, 2), (128, 8), (24, 3), (256, 2))]
SPARSE_SHAPES = [(s_q, h_q) for s_q in (1, 2, 5) for h_q in (1, 16, 32, 64, 65, 100, 128)]


def _real_and_fake(op, *args):
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    return real, fake


def test_fake_metadata_shapes_match_the_planner(device):
    ops = torch.ops.mla_kernels
    sl = R.to_device(torch.tensor([100, 7, 300], dtype=torch.int32), device)
    for s_q, h_q, h_k in DENSE_SHAPES:
        real, fake = _real_and_fake(ops.get_mla_decoding_metadata, sl, s_q * h_q // h_k, h_k)
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], ("dense", s_q, h_q, h_k)
        real, fake = _real_and_fake(ops.get_mla_decoding_metadata_dense_fp8, sl, s_q * h_q // h_k, h_k)
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], ("dense fp8", s_q, h_q, h_k)
    for s_q, h_q in SPARSE_SHAPES:
        real, fake = _real_and_fake(ops.get_mla_decoding_metadata, sl, s_q * h_q, 1, h_q, True, 128)
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], ("sparse", s_q, h_q)


@pytest.mark.parametrize("s_q,h_q,h_k", [(1, 128, 1), (2, 16, 1), (3, 64, 2), (1, 6, 3)])
def test_fake_dense_decode_plan_shape_matches(s_q, h_q, h_k, device):
    paged = R.make_dense_paged([40, 9], 16, h_k, 576, torch.bfloat16)
    q = R.rand((2, s_q, h_q, 576))
    args = [R.to_device(t, device) for t in (q, paged.k_cache)] + [512] + \
        [R.to_device(t, device) for t in (paged.cache_seqlens, paged.block_table)] + [1.0, False, None, None]
    real, fake = _real_and_fake(torch.ops.mla_kernels.dense_decode_fwd, *args)
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]


@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_fake_sparse_decode_plan_shape_matches(h_q, device):
    c = R.make_sparse_cache("v32", 2, 1, 256, 64, 64)
    q = R.rand((2, 1, h_q, 576))
    d = lambda t: R.to_device(t, device)
    real, fake = _real_and_fake(torch.ops.mla_kernels.sparse_decode_fwd, d(q), d(c.kv8), d(c.indices), None, None,
                                None, None, None, None, None, 512, 0.05)
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]
