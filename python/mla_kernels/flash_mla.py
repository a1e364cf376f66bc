"""Drop-in replacement for sgl-kernel's ``flash_mla`` module (``import mla_kernels.flash_mla as
flash_mla``): same names, arguments, defaults, return values and errors, over the kernels of
mla-kernels. Both metadata conventions work: a lazily planned :class:`FlashMLASchedMeta`
(DeepSeek-V4 era) and explicit ``(tile_scheduler_metadata, num_splits)`` tensors (legacy).
"""

import dataclasses
import math
from typing import Optional, Tuple, Union

import torch

from . import _ops  # noqa: F401  (registers the fake kernels)
from .formats import dequantize_kv_fp8, quantize_kv_fp8

__all__ = [
    "FlashMLASchedMeta",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "quantize_kv_fp8",
    "dequantize_kv_fp8",
]

_ops_ns = torch.ops.mla_kernels
_LN2 = math.log(2.0)


@dataclasses.dataclass
class FlashMLASchedMeta:
    """A decode plan made on first use and reused by every later call with the same shapes (one
    per decoding step, shared by all layers). Planning runs on the device with no host
    synchronisation, so it may happen inside CUDA-graph capture."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None  # [num_sm_parts, 8] int32
    num_splits: Optional[torch.Tensor] = None  # [b + 1] int32


def get_mla_metadata(
    cache_seqlens: Optional[torch.Tensor] = None,
    num_q_tokens_per_head_k: Optional[int] = None,
    num_heads_k: Optional[int] = None,
    num_heads_q: Optional[int] = None,
    is_fp8_kvcache: bool = False,
    topk: Optional[int] = None,
) -> Tuple[Union[FlashMLASchedMeta, torch.Tensor], Optional[torch.Tensor]]:
    """Without ``cache_seqlens``: returns ``(FlashMLASchedMeta(), None)``, planned lazily by the
    first ``flash_mla_with_kvcache`` call. With it: plans now and returns
    ``(tile_scheduler_metadata [num_sm_parts, 8] int32, num_splits [b + 1] int32)``.

    ``num_q_tokens_per_head_k`` is ``s_q * h_q // h_k``; ``num_heads_q`` is needed for sparse
    (``topk`` given)."""
    if cache_seqlens is None:
        return FlashMLASchedMeta(), None
    assert num_q_tokens_per_head_k is not None, "get_mla_metadata: num_q_tokens_per_head_k is required with cache_seqlens"
    assert num_heads_k is not None, "get_mla_metadata: num_heads_k is required with cache_seqlens"
    if is_fp8_kvcache and topk is None:
        tsm, num_splits = _ops_ns.get_mla_decoding_metadata_dense_fp8(
            cache_seqlens, num_q_tokens_per_head_k, num_heads_k
        )
    else:
        tsm, num_splits = _ops_ns.get_mla_decoding_metadata(
            cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache, topk
        )
    return tsm, num_splits


# The shapes this module reads before the ops check them: a missing or wrong-rank tensor is an error
# naming it (ValueError), not an IndexError; the same check as the fake kernels'.
_check_tensor = _ops._check_rank


def _check_config(sched: FlashMLASchedMeta, config: FlashMLASchedMeta.Config) -> None:
    for field in dataclasses.fields(config):
        old, new = getattr(sched.config, field.name), getattr(config, field.name)
        assert old == new, (
            f"FlashMLASchedMeta.config.{field.name} is {old} but this call has {new}: "
            "reuse a FlashMLASchedMeta only for calls with the same shapes and sparse settings "
            "(make a new one with get_mla_metadata() for each decoding step)"
        )


def _with_sched_meta(
    sched, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, descale_q, descale_k,
    is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length,
):
    op = "flash_mla_with_kvcache"
    for name, value, ndim in (
        ("indices", indices, 3), ("extra_k_cache", extra_k_cache, 4),
        ("extra_indices_in_kvcache", extra_indices_in_kvcache, 3),
    ):
        if value is not None:
            _check_tensor(op, name, value, ndim)
    topk = indices.shape[-1] if indices is not None else None
    extra_page_block_size = extra_k_cache.shape[1] if extra_k_cache is not None else None
    extra_topk = extra_indices_in_kvcache.shape[-1] if extra_indices_in_kvcache is not None else None
    config = FlashMLASchedMeta.Config(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache,
        topk, extra_page_block_size, extra_topk,
    )
    if not sched.have_initialized:
        sched.have_initialized = True
        sched.config = config
    else:
        _check_config(sched, config)

    if topk is not None:
        assert not causal, "flash_mla_with_kvcache: sparse attention (indices given) does not take causal=True"
        assert is_fp8_kvcache, "flash_mla_with_kvcache: sparse attention (indices given) needs is_fp8_kvcache=True"
        assert descale_q is None and descale_k is None, (
            "flash_mla_with_kvcache: descale_q / descale_k apply to dense FP8 decode only"
        )
        out, lse, tsm, num_splits = _ops_ns.sparse_decode_fwd(
            q, k_cache, indices, topk_length, attn_sink, sched.tile_scheduler_metadata, sched.num_splits,
            extra_k_cache, extra_indices_in_kvcache, extra_topk_length, head_dim_v, softmax_scale,
        )
    else:
        for name, value in (
            ("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
            ("extra_indices_in_kvcache", extra_indices_in_kvcache), ("topk_length", topk_length),
            ("extra_topk_length", extra_topk_length),
        ):
            assert value is None, f"flash_mla_with_kvcache: {name} is only for sparse attention (indices given)"
        assert block_table is not None, "flash_mla_with_kvcache: block_table is required for dense attention"
        assert cache_seqlens is not None, "flash_mla_with_kvcache: cache_seqlens is required for dense attention"
        if q.element_size() == 1:
            # Dense FP8 decode plans through its own metadata op, once, like the lazy dense path.
            _ops._check(k_cache.shape[2] > 0, "flash_mla_with_kvcache",
                        f"k_cache h_k (dim 2) must be > 0, got {k_cache.shape[2]}")
            if sched.tile_scheduler_metadata is None:
                sched.tile_scheduler_metadata, sched.num_splits = _ops_ns.get_mla_decoding_metadata_dense_fp8(
                    cache_seqlens, q.shape[1] * q.shape[2] // k_cache.shape[2], k_cache.shape[2]
                )
            out, lse = _ops_ns.fwd_kvcache_mla_fp8(
                q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
                sched.tile_scheduler_metadata, sched.num_splits, descale_q, descale_k,
            )
            return out, lse
        assert descale_q is None and descale_k is None, (
            "flash_mla_with_kvcache: descale_q / descale_k need an FP8 (float8_e4m3fn) query and cache"
        )
        out, lse, tsm, num_splits = _ops_ns.dense_decode_fwd(
            q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
            sched.tile_scheduler_metadata, sched.num_splits,
        )
    if tsm is not None:
        sched.tile_scheduler_metadata = tsm
        sched.num_splits = num_splits
    return out, lse


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: Union[FlashMLASchedMeta, torch.Tensor],
    num_splits: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a paged KV cache. Returns ``(out [b, s_q, h_q, head_dim_v], lse [b, h_q, s_q])``,
    lse in natural log, ``+inf`` for a row with no valid key, not affected by ``attn_sink``.

    q: ``[b, s_q, h_q, d]``; k_cache: ``[num_blocks, page_block_size, h_k, d]`` (dense) or
    ``[num_blocks, page_block_size, 1, bytes_per_token]`` (FP8 sparse: 656 bytes for d = 576,
    584 for d = 512); block_table ``[b, max_blocks]`` int32 and cache_seqlens ``[b]`` int32 (dense);
    indices ``[b, s_q, topk]`` int32 flat token indices (``block * page_block_size + offset``;
    negative or out-of-range entries are ignored) select sparse attention. ``attn_sink [h_q]``
    float32, ``extra_k_cache`` (own page size) with ``extra_indices_in_kvcache [b, s_q, extra_topk]``,
    ``topk_length [b]`` and ``extra_topk_length [b]`` int32 are sparse-only. An FP8 query
    (float8_e4m3fn) with an FP8 cache and ``descale_q`` / ``descale_k`` (``[1]`` or ``[b]``
    float32) selects dense FP8 decode, output bf16.

    ``tile_scheduler_metadata`` is a :class:`FlashMLASchedMeta` (planned on first use, its
    ``Config`` checked on every reuse) or the tensor from :func:`get_mla_metadata` with
    ``num_splits``.
    """
    _check_tensor("flash_mla_with_kvcache", "q", q, 4)
    _check_tensor("flash_mla_with_kvcache", "k_cache", k_cache, 4)
    if softmax_scale is None:
        # (A q of head dim 0 gets the op's error naming its head dim, not a ZeroDivisionError here.)
        softmax_scale = q.shape[-1] ** (-0.5) if q.shape[-1] > 0 else 1.0
    if isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        assert num_splits is None, "flash_mla_with_kvcache: num_splits must be None with a FlashMLASchedMeta"
        return _with_sched_meta(
            tile_scheduler_metadata, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
            descale_q, descale_k, is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
            topk_length, extra_topk_length,
        )

    assert isinstance(tile_scheduler_metadata, torch.Tensor), (
        "flash_mla_with_kvcache: tile_scheduler_metadata must be a FlashMLASchedMeta or a tensor from "
        f"get_mla_metadata, got {type(tile_scheduler_metadata).__name__}"
    )
    assert num_splits is not None, "flash_mla_with_kvcache: num_splits is required with tensor metadata"
    assert block_table is not None, "flash_mla_with_kvcache: block_table is required with tensor metadata"
    assert cache_seqlens is not None, "flash_mla_with_kvcache: cache_seqlens is required with tensor metadata"
    for name, value in (
        ("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache),
        ("extra_indices_in_kvcache", extra_indices_in_kvcache), ("topk_length", topk_length),
        ("extra_topk_length", extra_topk_length),
    ):
        assert value is None, (
            f"flash_mla_with_kvcache: {name} needs a FlashMLASchedMeta (get_mla_metadata() with no arguments)"
        )
    if indices is not None:
        assert not causal, "flash_mla_with_kvcache: sparse attention (indices given) does not take causal=True"
    assert (descale_q is None) == (descale_k is None), (
        "flash_mla_with_kvcache: descale_q and descale_k must be given together"
    )
    if indices is None and q.element_size() == 1:
        out, lse = _ops_ns.fwd_kvcache_mla_fp8(
            q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
            tile_scheduler_metadata, num_splits, descale_q, descale_k,
        )
    else:
        assert descale_q is None, (
            "flash_mla_with_kvcache: descale_q / descale_k need an FP8 (float8_e4m3fn) query and dense cache"
        )
        out, lse = _ops_ns.fwd_kvcache_mla(
            q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
            tile_scheduler_metadata, num_splits, is_fp8_kvcache, indices,
        )
    return out, lse


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    *,
    lse_base: Union[int, str] = 2,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill. q ``[s_q, h_q, d_qk]`` bf16, kv ``[s_kv, 1, d_qk]`` bf16, indices
    ``[s_q, 1, topk]`` int32 (``< 0`` or ``>= s_kv`` is invalid), ``attn_sink [h_q]`` float32,
    ``topk_length [s_q]`` int32. Returns ``(out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q],
    lse [s_q, h_q])``: ``max_logits`` and ``lse`` in base 2 (sgl-kernel's convention) unless
    ``lse_base="e"`` (FlashMLA's natural log). A row with no valid key has out 0, max_logits -inf,
    lse +inf."""
    if lse_base not in (2, "e"):
        raise ValueError(f"flash_mla_sparse_fwd: lse_base must be 2 or 'e', got {lse_base!r}")
    out, max_logits, lse = _ops_ns.sparse_prefill_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    if lse_base == "e":
        max_logits = max_logits * _LN2
        lse = lse * _LN2
    return out, max_logits, lse
