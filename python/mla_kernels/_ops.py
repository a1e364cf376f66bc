"""Fake (meta) kernels of torch.ops.mla_kernels.*, so torch.compile traces the ops without graph
breaks. Each returns tensors of the shapes, dtypes and strides the real kernel returns."""

import math

import torch

_lib = "mla_kernels::"
D_V = 512
PLAN_ROW_INTS = 8
# The CPU backend plans for a fixed number of "virtual SMs" (include/mla/reference.h: kVirtualSms).
CPU_VIRTUAL_SMS = 32
BYTES_PER_TOKEN = {576: 656, 512: 584}


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_VIRTUAL_SMS


def num_sm_parts_dense(device, s_q, h_q, h_k):
    if s_q <= 0 or h_q <= 0 or h_k <= 0 or h_q % h_k:  # shapes the checks reject (as in plan.h)
        return 1
    rows = s_q * (h_q // h_k)
    return max(num_sms(device) // h_k // math.ceil(rows / 64), 1)


def num_sm_parts_sparse(device, s_q, h_q):
    if s_q <= 0 or h_q <= 0:
        return 1
    return max(num_sms(device) // s_q // math.ceil(h_q / 64), 1)


def _check(cond, op, message):
    """What the real op rejects is an error naming the argument here too (tracing, meta tensors)."""
    if not cond:
        raise ValueError(f"{op}: {message}")


def _check_rank(op, name, t, ndim):
    """t must be a tensor of ndim dimensions (ValueError naming it otherwise)."""
    got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
    _check(isinstance(t, torch.Tensor) and t.dim() == ndim, op, f"{name} must be a {ndim}-D tensor, got {got}")


def _check_positive(op, name, v):
    _check(v is not None and v > 0, op, f"{name} must be > 0, got {v!r}")


def _check_fmt(op, fmt):
    _check(fmt in ("v32", "model1"), op, f'fmt must be "v32" or "model1", got {fmt!r}')


def _plan(device, b, parts):
    return (
        torch.empty((parts, PLAN_ROW_INTS), dtype=torch.int32, device=device),
        torch.empty((b + 1,), dtype=torch.int32, device=device),
    )


@torch.library.register_fake(_lib + "get_mla_decoding_metadata")
def _(seqlens_k, num_q_tokens_per_head_k, h_k, h_q=None, is_fp8_kvcache=False, topk=None):
    op = "get_mla_decoding_metadata"
    _check_rank(op, "seqlens_k", seqlens_k, 1)
    _check_positive(op, "num_q_tokens_per_head_k", num_q_tokens_per_head_k)
    _check_positive(op, "h_k", h_k)
    if topk is not None:
        _check_positive(op, "num_heads_q (h_q, required with topk)", h_q)
        _check(num_q_tokens_per_head_k % h_q == 0, op,
               f"num_q_tokens_per_head_k ({num_q_tokens_per_head_k}) must be s_q * num_heads_q (num_heads_q = {h_q})")
    b = seqlens_k.shape[0]
    if topk is not None:
        parts = num_sm_parts_sparse(seqlens_k.device, num_q_tokens_per_head_k // h_q, h_q)
    else:
        parts = max(num_sms(seqlens_k.device) // h_k // math.ceil(num_q_tokens_per_head_k / 64), 1)
    return list(_plan(seqlens_k.device, b, parts))


@torch.library.register_fake(_lib + "get_mla_decoding_metadata_dense_fp8")
def _(seqlens_k, num_heads_per_head_k, num_heads_k):
    op = "get_mla_decoding_metadata_dense_fp8"
    _check_rank(op, "seqlens_k", seqlens_k, 1)
    _check_positive(op, "num_heads_per_head_k", num_heads_per_head_k)
    _check_positive(op, "num_heads_k", num_heads_k)
    b = seqlens_k.shape[0]
    parts = max(num_sms(seqlens_k.device) // num_heads_k // math.ceil(num_heads_per_head_k / 64), 1)
    return list(_plan(seqlens_k.device, b, parts))


def _dense_outputs(q, out_dtype):
    b, s_q, h_q, _ = q.shape
    out = q.new_empty((b, s_q, h_q, D_V), dtype=out_dtype)
    lse = q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return out, lse


def _sparse_outputs(q):
    b, s_q, h_q, _ = q.shape
    out = q.new_empty((b, s_q, h_q, D_V))
    lse = q.new_empty((b, s_q, h_q), dtype=torch.float32).transpose(1, 2)
    return out, lse


@torch.library.register_fake(_lib + "dense_decode_fwd")
def _(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, tile_scheduler_metadata, num_splits):
    _check_rank("dense_decode_fwd", "q", q, 4)
    _check_rank("dense_decode_fwd", "kcache", kcache, 4)
    _check(kcache.shape[2] > 0, "dense_decode_fwd", f"kcache h_k (dim 2) must be > 0, got {kcache.shape[2]}")
    _check(q.shape[1] > 0 and q.shape[2] > 0 and q.shape[2] % kcache.shape[2] == 0, "dense_decode_fwd",
           f"q must have s_q > 0 and h_q a positive multiple of h_k ({kcache.shape[2]}), got shape {list(q.shape)}")
    out, lse = _dense_outputs(q, q.dtype)
    if tile_scheduler_metadata is not None:
        return out, lse, None, None
    b, s_q, h_q, _ = q.shape
    tsm, ns = _plan(q.device, b, num_sm_parts_dense(q.device, s_q, h_q, kcache.shape[2]))
    return out, lse, tsm, ns


@torch.library.register_fake(_lib + "sparse_decode_fwd")
def _(q, kv, indices, topk_length, attn_sink, tile_scheduler_metadata, num_splits, extra_kv, extra_indices,
      extra_topk_length, d_v, sm_scale):
    _check_rank("sparse_decode_fwd", "q", q, 4)
    _check(q.shape[1] > 0 and q.shape[2] > 0, "sparse_decode_fwd", f"q must have s_q, h_q > 0, got shape {list(q.shape)}")
    out, lse = _sparse_outputs(q)
    if tile_scheduler_metadata is not None:
        return out, lse, None, None
    b, s_q, h_q, _ = q.shape
    tsm, ns = _plan(q.device, b, num_sm_parts_sparse(q.device, s_q, h_q))
    return out, lse, tsm, ns


@torch.library.register_fake(_lib + "fwd_kvcache_mla")
def _(q, kv_cache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, tile_scheduler_metadata,
      num_splits, is_fp8, indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
      topk_length=None, extra_topk_length=None):
    _check_rank("fwd_kvcache_mla", "q", q, 4)
    if indices is not None:
        return list(_sparse_outputs(q))
    return list(_dense_outputs(q, q.dtype))


@torch.library.register_fake(_lib + "fwd_kvcache_mla_fp8")
def _(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal, tile_scheduler_metadata, num_splits,
      descale_q=None, descale_k=None):
    _check_rank("fwd_kvcache_mla_fp8", "q", q, 4)
    return list(_dense_outputs(q, torch.bfloat16))


@torch.library.register_fake(_lib + "sparse_prefill_fwd")
def _(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None):
    _check_rank("sparse_prefill_fwd", "q", q, 3)
    s_q, h_q, _ = q.shape
    return [
        q.new_empty((s_q, h_q, D_V)),
        q.new_empty((s_q, h_q), dtype=torch.float32),
        q.new_empty((s_q, h_q), dtype=torch.float32),
    ]


@torch.library.register_fake(_lib + "quantize_kv_fp8")
def _(kv, fmt):
    _check_rank("quantize_kv_fp8", "kv", kv, 4)
    _check_fmt("quantize_kv_fp8", fmt)
    n, page, h, _ = kv.shape
    return kv.new_empty((n, page, h, BYTES_PER_TOKEN[576 if fmt == "v32" else 512]), dtype=torch.uint8)


@torch.library.register_fake(_lib + "dequantize_kv_fp8")
def _(kv, fmt):
    _check_rank("dequantize_kv_fp8", "kv", kv, 4)
    _check_fmt("dequantize_kv_fp8", fmt)
    n, page, h, _ = kv.shape
    return kv.new_empty((n, page, h, 576 if fmt == "v32" else 512), dtype=torch.bfloat16)
