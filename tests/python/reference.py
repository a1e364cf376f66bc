"""Independent float64 reference for the mla-kernels test suite.

Written from SPEC.md and reference/flashmla-semantics.md (sections 3, 4, 7), not from the
library: nothing here imports mla_kernels. It provides

* the FP8 KV-cache codecs (V3.2 and MODEL1), decoded with plain torch byte views, and a quantiser
  that follows flashmla-semantics.md section 3.5 (power-of-two scales, e4m3 via torch's cast);
* reference attention for dense decode (also dense FP8), sparse decode and sparse prefill;
* test-data builders: shuffled paged caches, garbage block ids, NaN / 0xFF poison in every cache
  slot that must not be read;
* ``check_is_allclose`` -- FlashMLA's comparison helper (section 7.1) -- and SPEC section 8
  tolerances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

LOG2E = 1.0 / math.log(2.0)
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
GARBAGE_BLOCK_ID = 2147480000  # what FlashMLA's tests put in unused block-table entries

# Tolerances (SPEC section 8 / flashmla-semantics.md section 7.2).
DENSE_OUT_TOL = dict(abs_tol=8e-4, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
DENSE_LSE_TOL = dict(abs_tol=1e-6, rel_tol=8.01 / 65536, cos_diff_tol=1e-7)
SPARSE_OUT_TOL = dict(abs_tol=1e-3, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
SPARSE_LSE_TOL = dict(abs_tol=1e-6, rel_tol=8.01 / 65536, cos_diff_tol=1e-7)
PREFILL_OUT_TOL = dict(abs_tol=8e-4, rel_tol=3.01 / 128, cos_diff_tol=7e-6)
PREFILL_LSE_TOL = dict(abs_tol=1e-6, rel_tol=2.01 / 65536, cos_diff_tol=1e-7)
PREFILL_MAX_LOGITS_TOL = dict(abs_tol=1e-6, rel_tol=2.01 / 65536, cos_diff_tol=1e-7)

# Invalid sparse indices used by FlashMLA's tests (prefill), plus their out-of-range kin.
def invalid_index_values(num_tokens: int) -> list[int]:
    return [-1, -2, -123456, INT32_MIN, num_tokens, num_tokens + 17, 114514, 1919810,
            GARBAGE_BLOCK_ID, INT32_MAX]


# ------------------------------------------------------------------------------------------------
# Comparison helper (flashmla-semantics.md section 7.1)
# ------------------------------------------------------------------------------------------------

def check_is_allclose(name: str, ans: torch.Tensor, ref: torch.Tensor, abs_tol: float = 1e-5,
                      rel_tol: float = 1e-2, cos_diff_tol: float = 1e-7) -> None:
    """FlashMLA's check_is_allclose. `ans` may be low precision; it is compared in float64.

    Shapes must match; +inf / -inf / NaN must sit at identical positions; every other element must
    pass abs_err < abs_tol or rel_err < rel_tol; and the cosine difference must be <= cos_diff_tol.
    """
    assert tuple(ans.shape) == tuple(ref.shape), f"{name}: shape {tuple(ans.shape)} != reference {tuple(ref.shape)}"
    a = ans.detach().cpu().to(torch.float64).clone()
    r = ref.detach().cpu().to(torch.float64).clone()
    for label, fn in (("+inf", lambda t: torch.isposinf(t)), ("-inf", lambda t: torch.isneginf(t)),
                      ("nan", lambda t: torch.isnan(t))):
        ma, mr = fn(a), fn(r)
        if not torch.equal(ma, mr):
            diff = (ma != mr).nonzero()
            first = tuple(diff[0].tolist())
            raise AssertionError(
                f"{name}: {label} positions differ at {diff.shape[0]} places; first at {first}: "
                f"ans={ans[first].item()} ref={ref[first].item()}")
        a[ma] = 0
        r[mr] = 0
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + 1e-6)
    bad = ~((abs_err < abs_tol) | (rel_err < rel_tol))
    if bad.any():
        idx = bad.nonzero()
        first = tuple(idx[0].tolist())
        raise AssertionError(
            f"{name}: {idx.shape[0]} of {a.numel()} elements out of tolerance (abs {abs_tol}, rel {rel_tol}); "
            f"max abs err {abs_err.max().item():.3e}; first at {first}: ans={a[first].item():.6g} "
            f"ref={r[first].item():.6g}")
    denom = (a * a + r * r).sum().item()
    if (r * r).sum().item() < 1e-12:
        cos_diff = 0.0
    else:
        cos_diff = 1.0 - 2.0 * (a * r).sum().item() / denom
    assert abs(cos_diff) <= cos_diff_tol, f"{name}: cos diff {cos_diff:.3e} > {cos_diff_tol:.1e}"


# ------------------------------------------------------------------------------------------------
# Random inputs
# ------------------------------------------------------------------------------------------------

def rand(shape: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """randn/10 clamped to [-1, 1] (never exactly zero in practice)."""
    return (torch.randn(*shape, dtype=torch.float32) / 10).clamp(-1.0, 1.0).to(dtype)


def non_contiguous(t: torch.Tensor, pad_last: int = 16) -> torch.Tensor:
    """Same values, every dimension strided (last dim stays contiguous).

    Each dim is padded by one element, the last by `pad_last`; the padding holds NaN (or 0xFF bytes
    for integer/fp8 dtypes) so that reading it would show.
    """
    padded_shape = [s + 1 for s in t.shape[:-1]] + [t.shape[-1] + pad_last]
    big = torch.empty(padded_shape, dtype=t.dtype)
    if t.dtype.is_floating_point and t.element_size() >= 2:
        big.fill_(float("nan"))
    elif t.element_size() == 1:
        big.view(torch.uint8).fill_(0xFF)
    else:
        big.fill_(-1)
    view = big[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    assert view.stride(-1) == 1 and not view.is_contiguous()
    return view


# ------------------------------------------------------------------------------------------------
# Devices: inputs are built on the CPU (where the reference runs) and moved for the library
# ------------------------------------------------------------------------------------------------

def to_device(t: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """`t` on `device` ("cpu" or "cuda") with the same sizes, strides and storage offset, and the
    same bytes in the gaps between its elements (the NaN / 0xFF padding of `non_contiguous` views
    and padded cache blocks), so a strided input stays strided and its poison travels with it.
    Returns `t` itself when it is already on that kind of device; None stays None."""
    if t is None or t.device.type == torch.device(device).type:
        return t
    if t.numel() == 0 or (t.is_contiguous() and t.storage_offset() == 0):
        return t.to(device)
    span = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), 0).to(device)
    moved = flat.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())
    assert moved.stride() == t.stride() and moved.storage_offset() == t.storage_offset()
    return moved


def to_cpu(t: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """A result of the library: checks that it is on `device`, returns it on the CPU with the same
    strides (so layout assertions made on the copy hold for the original). None stays None."""
    if t is None:
        return None
    assert t.device.type == torch.device(device).type, f"result is on {t.device}, expected {device} (the device of q)"
    c = t.cpu()
    assert c.stride() == t.stride(), f"result strides {t.stride()} on {t.device} (not dense) became {c.stride()} on cpu"
    return c


# ------------------------------------------------------------------------------------------------
# FP8 KV-cache formats (flashmla-semantics.md sections 3.3 - 3.5)
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fp8Format:
    name: str
    d: int           # d_qk
    d_nope: int
    d_rope: int
    tile: int
    num_tiles: int
    bytes_per_token: int


V32 = Fp8Format("v32", 576, 512, 64, 128, 4, 656)
MODEL1 = Fp8Format("model1", 512, 448, 64, 64, 7, 584)
FORMATS = {"v32": V32, "model1": MODEL1}


def _pow2_scales(nope: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """nope: [..., d_nope] in the input dtype -> float32 power-of-two scales [..., num_tiles]."""
    tiles = nope.unflatten(-1, (fmt.num_tiles, fmt.tile))
    amax = tiles.abs().amax(dim=-1).float()
    s = amax / 448.0
    return torch.pow(2.0, torch.ceil(torch.log2(s.clamp_min(1e-4)))).float()


def quantize_ref(kv: torch.Tensor, fmt: Fp8Format | str, block_stride_bytes: Optional[int] = None,
                 pad_byte: int = 0xFF) -> torch.Tensor:
    """Independent quantiser: bf16 [nb, bs, 1, d] -> uint8 [nb, bs, 1, bytes_per_token].

    `block_stride_bytes` (>= bs * bytes_per_token) pads each page block; the padding and MODEL1's
    pad byte hold `pad_byte`.
    """
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    nb, bs, h, d = kv.shape
    assert h == 1 and d == fmt.d
    x = kv[:, :, 0, :]
    nope, rope = x[..., :fmt.d_nope], x[..., fmt.d_nope:]
    s = _pow2_scales(nope, fmt)                                           # [nb, bs, T]
    q = (nope.float().unflatten(-1, (fmt.num_tiles, fmt.tile)) / s[..., None]).to(torch.float8_e4m3fn)
    q_bytes = q.flatten(-2).view(torch.uint8)                             # [nb, bs, d_nope]
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)   # [nb, bs, 2*d_rope]
    block_bytes = bs * fmt.bytes_per_token
    stride0 = block_bytes if block_stride_bytes is None else block_stride_bytes
    assert stride0 >= block_bytes
    buf = torch.full((nb, stride0), pad_byte, dtype=torch.uint8)
    if fmt.name == "v32":
        scale_bytes = s.contiguous().view(torch.uint8)                    # [nb, bs, 16]
        rec = torch.cat([q_bytes, scale_bytes, rope_bytes], dim=-1)       # [nb, bs, 656]
        buf[:, :block_bytes] = rec.reshape(nb, block_bytes)
    else:
        exps = (torch.log2(s).round().to(torch.int32) + 127)              # ue8m0 exponent bytes
        assert bool(((exps >= 0) & (exps <= 254)).all())
        data = torch.cat([q_bytes, rope_bytes], dim=-1)                   # [nb, bs, 576]
        scales = torch.full((nb, bs, 8), pad_byte, dtype=torch.uint8)
        scales[..., :7] = exps.to(torch.uint8)
        buf[:, :bs * 576] = data.reshape(nb, bs * 576)
        buf[:, bs * 576:block_bytes] = scales.reshape(nb, bs * 8)
    return buf.as_strided((nb, bs, 1, fmt.bytes_per_token), (stride0, fmt.bytes_per_token, fmt.bytes_per_token, 1))


def block_bytes_view(kv8: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """uint8 [nb, bs*bytes_per_token]: each page block's bytes in memory order (any stride(0))."""
    nb, bs, h, bpt = kv8.shape
    assert h == 1 and bpt == fmt.bytes_per_token and kv8.stride(1) == bpt and kv8.stride(-1) == 1
    raw = kv8.view(torch.uint8) if kv8.dtype != torch.uint8 else kv8
    return raw[:, :, 0, :].reshape(nb, bs * bpt)


def token_byte_ranges(fmt: Fp8Format, bs: int, t: int) -> list[tuple[int, int]]:
    """Byte ranges (within a page block) that belong to token t."""
    if fmt.name == "v32":
        return [(t * 656, (t + 1) * 656)]
    return [(t * 576, (t + 1) * 576), (bs * 576 + t * 8, bs * 576 + (t + 1) * 8)]


def v32_record_parts(kv8: torch.Tensor):
    """A V3.2 cache's records as they are, float64: e4m3 values [nb, bs, 512], scales [nb, bs, 4],
    RoPE dims [nb, bs, 64]."""
    nb, bs = kv8.shape[:2]
    rec = block_bytes_view(kv8, V32).reshape(nb, bs, 656)
    nope = rec[..., :512].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    scales = rec[..., 512:528].contiguous().view(torch.float32).to(torch.float64)
    rope = rec[..., 528:656].contiguous().view(torch.bfloat16).to(torch.float64)
    return nope, scales, rope


def dequantize_ref(kv8: torch.Tensor, fmt: Fp8Format | str) -> torch.Tensor:
    """Independent decoder: FP8 cache [nb, bs, 1, bpt] -> float64 tokens [nb*bs, d]."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    nb, bs = kv8.shape[:2]
    flat = block_bytes_view(kv8, fmt)
    if fmt.name == "v32":
        nope, scales, rope = v32_record_parts(kv8)
    else:
        data = flat[:, :bs * 576].reshape(nb, bs, 576)
        nope = data[..., :448].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
        rope = data[..., 448:576].contiguous().view(torch.bfloat16).to(torch.float64)
        e = flat[:, bs * 576:bs * 584].reshape(nb, bs, 8)[..., :7].to(torch.float64)
        scales = torch.where(e == 255, torch.full_like(e, float("nan")), torch.pow(2.0, e - 127))
    k_nope = nope * scales.repeat_interleave(fmt.tile, dim=-1)
    return torch.cat([k_nope, rope], dim=-1).reshape(nb * bs, fmt.d)


def poison_tokens(kv8: torch.Tensor, fmt: Fp8Format, flat_tokens: torch.Tensor,
                  pattern: str = "nan") -> None:
    """Overwrite every byte of the given flat tokens (in place).

    pattern "nan": 0xFF everywhere (NaN as e4m3, bf16, fp32 and ue8m0); "mixed": alternate tokens
    get 0xFF and 0x7F (e4m3 NaN, huge finite bf16/fp32, scale 1); "random": random bytes.
    """
    nb, bs = kv8.shape[:2]
    raw = kv8.view(torch.uint8) if kv8.dtype != torch.uint8 else kv8
    base = raw.as_strided((nb, bs * fmt.bytes_per_token), (kv8.stride(0), 1))
    for n, tok in enumerate(flat_tokens.tolist()):
        blk, t = divmod(int(tok), bs)
        for lo, hi in token_byte_ranges(fmt, bs, t):
            if pattern == "nan":
                base[blk, lo:hi] = 0xFF
            elif pattern == "mixed":
                base[blk, lo:hi] = 0xFF if n % 2 == 0 else 0x7F
            elif pattern == "random":
                base[blk, lo:hi] = torch.randint(0, 256, (hi - lo,), dtype=torch.uint8)
            else:
                raise ValueError(pattern)


# ------------------------------------------------------------------------------------------------
# Reference attention
# ------------------------------------------------------------------------------------------------

def _softmax_probs(scores: torch.Tensor, valid: torch.Tensor):
    """scores [..., n] float64, valid [..., n] bool.

    Returns (p [..., n], lse [...], max [...]): lonely rows (no valid key) get p = 0, lse = +inf,
    max = -inf."""
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if scores.shape[-1] > 0:
        mx = scores.amax(dim=-1)
    else:
        mx = torch.full(scores.shape[:-1], float("-inf"), dtype=scores.dtype)
    lonely = torch.isneginf(lse)
    p = torch.exp(scores - torch.where(lonely, torch.zeros_like(lse), lse)[..., None])
    p = p.masked_fill(~valid, 0.0)
    lse = torch.where(lonely, torch.full_like(lse, float("inf")), lse)
    return p, lse, mx


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: Optional[torch.Tensor]) -> torch.Tensor:
    """out [..., h, d_v], lse [..., h] (natural, +inf lonely), sink [h] -> out * e^lse/(e^lse+e^sink)."""
    if sink is None:
        return out
    sink = sink.to(torch.float64)
    factor = 1.0 / (1.0 + torch.exp(sink - lse))   # lse=+inf -> 1 (out is 0 anyway); sink=+inf -> 0
    factor = torch.where(torch.isinf(lse), torch.ones_like(factor), factor)
    return out * factor[..., None]


def ref_dense_decode(q: torch.Tensor, seqs: Sequence[torch.Tensor], softmax_scale: float, causal: bool,
                     d_v: int = 512, q_scale: Optional[torch.Tensor] = None,
                     k_scale: Optional[torch.Tensor] = None):
    """Dense decode on logical (unpaged) sequences.

    q [b, s_q, h_q, d]; seqs[i] [L_i, h_k, d]; head h uses KV head h // (h_q/h_k); bottom-right
    causal for s_q > 1. q_scale / k_scale: optional per-request float multipliers (dense FP8
    descales). Returns out [b, s_q, h_q, d_v] float64, lse [b, h_q, s_q] float64.
    """
    b, s_q, h_q, d = q.shape
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), float("inf"), dtype=torch.float64)
    for i in range(b):
        k = seqs[i].to(torch.float64)
        L, h_k = k.shape[0], k.shape[1]
        g = h_q // h_k
        qi = q[i].to(torch.float64)
        if q_scale is not None:
            qi = qi * float(q_scale[i])
        if k_scale is not None:
            k = k * float(k_scale[i])
        # Head h = kv * g + j reads KV head kv; the heads sharing one are grouped rather than
        # the keys repeated per head (at h_q 128 and 128 K keys that copy alone is 77 GB).
        qg = qi.view(s_q, h_k, g, d)
        scores = torch.einsum("skgd,lkd->kgsl", qg, k).reshape(h_q, s_q, L) * softmax_scale
        valid = torch.ones(s_q, L, dtype=torch.bool)
        if causal and s_q > 1:
            r = torch.arange(s_q)[:, None]
            j = torch.arange(L)[None, :]
            valid = j <= r + L - s_q
        p, l, _ = _softmax_probs(scores, valid.expand(h_q, s_q, L))
        out[i] = torch.einsum("kgsl,lkd->skgd", p.view(h_k, g, s_q, L), k[:, :, :d_v]).reshape(s_q, h_q, d_v)
        lse[i] = l
    return out, lse


def _gather_valid(tokens: torch.Tensor, idx: torch.Tensor, length: Optional[torch.Tensor]):
    """tokens [N, d] float64, idx [..., T] int, length broadcastable to idx[..., 0] or None.

    Returns (keys [..., T, d] with invalid rows zero, valid [..., T])."""
    n = tokens.shape[0]
    idx = idx.to(torch.int64)
    valid = (idx >= 0) & (idx < n)
    if length is not None:
        pos = torch.arange(idx.shape[-1])
        valid = valid & (pos < length.to(torch.int64)[..., None])
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    keys = tokens[safe.flatten()].reshape(*idx.shape, tokens.shape[-1])
    keys = torch.where(valid[..., None], keys, torch.zeros_like(keys))
    return keys, valid


def ref_sparse_decode(q: torch.Tensor, tokens: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                      topk_length: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None,
                      extra_tokens: Optional[torch.Tensor] = None, extra_indices: Optional[torch.Tensor] = None,
                      extra_topk_length: Optional[torch.Tensor] = None, d_v: int = 512):
    """Sparse decode. q [b, s_q, h_q, d]; tokens [N, d] float64 (decoded cache, flat token index);
    indices [b, s_q, topk]; lengths per request [b]. Main and extra tokens share one softmax;
    duplicates count; negative or >= N indices are invalid.
    Returns out [b, s_q, h_q, d_v] float64, lse [b, h_q, s_q] float64 (natural log)."""
    b = q.shape[0]
    keys, valid = _gather_valid(tokens, indices, None if topk_length is None else topk_length.view(b, 1))
    if extra_tokens is not None:
        ek, ev = _gather_valid(extra_tokens, extra_indices,
                               None if extra_topk_length is None else extra_topk_length.view(b, 1))
        keys = torch.cat([keys, ek], dim=2)
        valid = torch.cat([valid, ev], dim=2)
    qd = q.to(torch.float64)                                          # [b, s_q, h_q, d]
    scores = torch.einsum("bshd,bstd->bsht", qd, keys) * softmax_scale  # [b, s_q, h_q, n]
    p, lse, _ = _softmax_probs(scores, valid[:, :, None, :].expand_as(scores))
    out = torch.einsum("bshn,bsnd->bshd", p, keys[..., :d_v])
    out = _apply_sink(out, lse, attn_sink)
    return out, lse.transpose(1, 2)


def ref_sparse_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                       attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                       d_v: int = 512):
    """Sparse prefill. q [s_q, h_q, d]; kv [s_kv, 1, d]; indices [s_q, 1, topk]; topk_length [s_q].
    Returns (out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q]) float64, natural log;
    lonely rows: out 0, max_logits -inf, lse +inf."""
    tokens = kv[:, 0, :].to(torch.float64)
    keys, valid = _gather_valid(tokens, indices[:, 0, :], topk_length)   # [s_q, T, d], [s_q, T]
    scores = torch.einsum("shd,std->sht", q.to(torch.float64), keys) * sm_scale
    p, lse, mx = _softmax_probs(scores, valid[:, None, :].expand_as(scores))
    out = torch.einsum("sht,std->shd", p, keys[..., :d_v])
    out = _apply_sink(out, lse, attn_sink)
    return out, mx, lse


# ------------------------------------------------------------------------------------------------
# Test data: dense paged caches
# ------------------------------------------------------------------------------------------------

@dataclass
class DensePaged:
    k_cache: torch.Tensor        # [num_blocks, page, h_k, d]
    block_table: torch.Tensor    # [b, max_blocks] int32, garbage beyond each request's blocks
    cache_seqlens: torch.Tensor  # [b] int32
    seqs: list                   # logical keys per request, [L_i, h_k, d]


def make_dense_paged(seqlens: Sequence[int], page: int, h_k: int, d: int, dtype: torch.dtype,
                     spare_blocks: int = 2, garbage_cols: int = 1, poison: str = "nan") -> DensePaged:
    """Shuffled paged cache. Unused block-table entries hold garbage ids; every slot that is not
    part of a sequence (tail of a last block, unused blocks) holds NaN (poison="nan"), huge finite
    garbage ("huge") or random garbage ("random"). For float8 dtypes NaN is the byte 0x7F/0xFF."""
    b = len(seqlens)
    nblk = [math.ceil(L / page) for L in seqlens]
    max_blocks = max(nblk + [0]) + garbage_cols
    num_blocks = sum(nblk) + spare_blocks
    perm = torch.randperm(num_blocks).to(torch.int32)
    block_table = torch.full((b, max(max_blocks, 1)), GARBAGE_BLOCK_ID, dtype=torch.int32)
    # mix in another kind of garbage in unused entries
    k_cache = torch.empty(num_blocks, page, h_k, d, dtype=dtype)
    _fill_garbage(k_cache, poison)
    seqs = []
    cursor = 0
    for i, L in enumerate(seqlens):
        ids = perm[cursor:cursor + nblk[i]]
        cursor += nblk[i]
        block_table[i, :nblk[i]] = ids
        if nblk[i] + 1 < block_table.shape[1]:
            block_table[i, nblk[i] + 1:] = -7 if i % 2 else INT32_MAX
        k = rand((L, h_k, d), torch.float32)
        if dtype in (torch.float8_e4m3fn,):
            k = (k * 20).to(dtype)
        else:
            k = k.to(dtype)
        for j in range(nblk[i]):
            chunk = k[j * page:(j + 1) * page]
            k_cache[int(ids[j]), :chunk.shape[0]] = chunk
        seqs.append(k)
    return DensePaged(k_cache, block_table, torch.tensor(list(seqlens), dtype=torch.int32), seqs)


def _fill_garbage(t: torch.Tensor, poison: str) -> None:
    if t.element_size() == 1:
        raw = t.view(torch.uint8)
        if poison == "nan":
            raw.copy_(torch.where(torch.rand(raw.shape) < 0.5, 0x7F, 0xFF).to(torch.uint8))
        else:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        return
    if poison == "nan":
        t.fill_(float("nan"))
    elif poison == "huge":
        t.copy_(torch.where(torch.rand(t.shape) < 0.5, -1e4, 3e4).to(t.dtype))
    elif poison == "random":
        t.copy_((torch.randn(t.shape) * 100).to(t.dtype))
    else:
        raise ValueError(poison)


# ------------------------------------------------------------------------------------------------
# Test data: FP8 sparse caches
# ------------------------------------------------------------------------------------------------

@dataclass
class SparseCache:
    kv8: torch.Tensor            # uint8 [num_blocks, page, 1, bytes_per_token]
    tokens: torch.Tensor         # float64 [num_blocks*page, d]: decoded before poisoning
    indices: torch.Tensor        # int32 [b, s_q, topk] flat token indices
    topk_length: Optional[torch.Tensor]  # int32 [b] or None
    fmt: Fp8Format
    page: int
    poisoned: torch.Tensor       # flat tokens overwritten with poison


def make_sparse_cache(fmt: Fp8Format | str, b: int, s_q: int, s_k: int, topk: int, page: int, *,
                      invalid_frac: float = 0.1, dup_frac: float = 0.0, with_topk_length: bool = False,
                      zero_length_req: Optional[int] = None, padded_stride: bool = False,
                      poison: str = "nan", all_invalid_rows: Sequence[tuple[int, int]] = (),
                      scale_spread: bool = True) -> SparseCache:
    """Per request: s_k tokens in a shuffled paged layout; each query token picks `topk` positions
    (distinct where possible), converted to flat indices `block*page + offset`. A fraction of
    positions is set to -1 or another out-of-range value; `dup_frac` of positions repeat another
    position of the same row. Every token not referenced at a valid position (i.e. < topk_length and
    in range) is poisoned after quantisation."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    nblk = math.ceil(s_k / page)
    num_blocks = b * nblk + 2
    perm = torch.randperm(num_blocks)
    table = perm[:b * nblk].view(b, nblk)
    kv = rand((num_blocks, page, 1, fmt.d), torch.float32)
    if scale_spread:
        # per-token magnitudes spanning several binades, so the scales differ between tiles/tokens
        kv = kv * torch.pow(2.0, torch.randint(-3, 4, (num_blocks, page, 1, 1)).float())
    kv = kv.to(torch.bfloat16)
    stride = None
    if padded_stride:
        stride = page * fmt.bytes_per_token + (fmt.bytes_per_token if fmt.name == "v32" else 64)
    kv8 = quantize_ref(kv, fmt, block_stride_bytes=stride)
    tokens = dequantize_ref(kv8, fmt)
    num_tokens = num_blocks * page
    invalid_vals = invalid_index_values(num_tokens)

    idx = torch.empty(b, s_q, topk, dtype=torch.int64)
    for i in range(b):
        for s in range(s_q):
            if topk <= s_k:
                pos = torch.randperm(s_k)[:topk]
            else:
                pos = torch.cat([torch.randperm(s_k), torch.full((topk - s_k,), -1, dtype=torch.int64)])
                pos = pos[torch.randperm(topk)]
            flat = torch.where(pos >= 0, table[i, (pos.clamp_min(0) // page)] * page + pos.clamp_min(0) % page,
                               torch.full_like(pos, -1))
            if dup_frac > 0 and topk > 1:
                ndup = max(1, int(dup_frac * topk))
                dst = torch.randperm(topk)[:ndup]
                src = torch.randint(0, topk, (ndup,))
                flat[dst] = flat[src]
            if invalid_frac > 0:
                mask = torch.rand(topk) < invalid_frac
                choice = torch.tensor(invalid_vals)[torch.randint(0, len(invalid_vals), (topk,))]
                flat = torch.where(mask, choice, flat)
            idx[i, s] = flat
    for (i, s) in all_invalid_rows:
        idx[i, s] = torch.tensor(invalid_vals)[torch.randint(0, len(invalid_vals), (topk,))]
    topk_length = None
    if with_topk_length:
        # mostly partial lengths (so that ignoring them would show), one full length when b >= 3
        if topk == 1:
            topk_length = torch.randint(0, 2, (b,), dtype=torch.int32)
        else:
            topk_length = torch.randint(1, topk, (b,), dtype=torch.int32)
        if b >= 3:
            topk_length[torch.randint(0, b, (1,))] = topk
    if zero_length_req is not None:
        assert topk_length is not None
        topk_length[zero_length_req] = 0
    valid = (idx >= 0) & (idx < num_tokens)
    if topk_length is not None:
        valid &= torch.arange(topk)[None, None, :] < topk_length.to(torch.int64)[:, None, None]
    referenced = torch.zeros(num_tokens, dtype=torch.bool)
    referenced[idx[valid]] = True
    poisoned = (~referenced).nonzero().flatten()
    poison_tokens(kv8, fmt, poisoned, poison)
    return SparseCache(kv8, tokens, idx.to(torch.int32), topk_length, fmt, page, poisoned)


def make_sink(h_q: int, mode: str) -> Optional[torch.Tensor]:
    """mode: none | finite | posinf | neginf | mixed (finite, +inf and -inf heads)."""
    if mode == "none":
        return None
    if mode == "finite":
        return torch.randn(h_q, dtype=torch.float32)
    if mode == "posinf":
        return torch.full((h_q,), float("inf"), dtype=torch.float32)
    if mode == "neginf":
        return torch.full((h_q,), float("-inf"), dtype=torch.float32)
    if mode == "mixed":
        s = torch.randn(h_q, dtype=torch.float32)
        r = torch.rand(h_q)
        s[r < 0.25] = float("-inf")
        s[r > 0.75] = float("inf")
        return s
    raise ValueError(mode)


# ------------------------------------------------------------------------------------------------
# Test data: sparse prefill
# ------------------------------------------------------------------------------------------------

@dataclass
class PrefillCase:
    q: torch.Tensor              # [s_q, h_q, d] bf16
    kv: torch.Tensor             # [s_kv, 1, d] bf16, NaN in unreferenced rows
    indices: torch.Tensor        # [s_q, 1, topk] int32
    topk_length: Optional[torch.Tensor]
    kv_clean: torch.Tensor       # kv before poisoning


def make_prefill_case(s_q: int, s_kv: int, h_q: int, d: int, topk: int, *, invalid_frac: float = 0.1,
                      dup_frac: float = 0.0, with_topk_length: bool = False,
                      lonely_rows: Sequence[int] = (), poison: bool = True) -> PrefillCase:
    q = rand((s_q, h_q, d))
    kv = rand((s_kv, 1, d))
    invalid_vals = invalid_index_values(s_kv)
    idx = torch.empty(s_q, topk, dtype=torch.int64)
    for s in range(s_q):
        if topk <= s_kv:
            pos = torch.randperm(s_kv)[:topk]
        else:
            pos = torch.cat([torch.randperm(s_kv), torch.full((topk - s_kv,), -1, dtype=torch.int64)])
            pos = pos[torch.randperm(topk)]
            fill = torch.tensor(invalid_vals)[torch.randint(0, len(invalid_vals), (topk,))]
            pos = torch.where(pos < 0, fill, pos)
        if dup_frac > 0 and topk > 1:
            ndup = max(1, int(dup_frac * topk))
            pos[torch.randperm(topk)[:ndup]] = pos[torch.randint(0, topk, (ndup,))]
        if invalid_frac > 0:
            mask = torch.rand(topk) < invalid_frac
            choice = torch.tensor(invalid_vals)[torch.randint(0, len(invalid_vals), (topk,))]
            pos = torch.where(mask, choice, pos)
        idx[s] = pos
    for s in lonely_rows:
        idx[s] = torch.tensor(invalid_vals)[torch.randint(0, len(invalid_vals), (topk,))]
    topk_length = None
    if with_topk_length:
        topk_length = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32)
        topk_length[0] = topk
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk)[None, :] < topk_length.to(torch.int64)[:, None]
    kv_clean = kv.clone()
    if poison:
        referenced = torch.zeros(s_kv, dtype=torch.bool)
        referenced[idx[valid]] = True
        kv[~referenced] = float("nan")
    return PrefillCase(q, kv, idx.to(torch.int32).view(s_q, 1, topk), topk_length, kv_clean)
