"""Every violated precondition raises a Python exception (RuntimeError from TORCH_CHECK, or
AssertionError / ValueError from Python) whose message names the offending argument and says what
was wrong (SPEC section 7). The data-dependent checks (negative lengths, block-table entries out of
range, ...) are CPU-only: the CUDA ops cannot see device data without a host sync. Arguments on
another device than q, and CUDA's 16-byte alignment of the caches, are tested at the end (marked
`cuda`, skipped without a GPU)."""

import re
import subprocess
import sys
import textwrap

import pytest
import torch

import mla_kernels.flash_mla as flash_mla
import reference as R

ERRORS = (RuntimeError, ValueError, AssertionError)


def raises_named(pattern):
    """Context manager: like pytest.raises(ERRORS, match=pattern); in addition, op-level
    (RuntimeError) messages must say what was given ("got ..." or the offending value)."""
    return _Raises(pattern)


class _Raises:
    def __init__(self, pattern):
        self.cm = pytest.raises(ERRORS, match=pattern)

    def __enter__(self):
        self.info = self.cm.__enter__()
        return self

    def __exit__(self, *exc):
        suppressed = self.cm.__exit__(*exc)
        if suppressed and self.info.type is RuntimeError:
            msg = str(self.info.value)
            assert re.search(r"\bgot\b|\(-?\d+\)", msg), f"message does not say what was given: {msg!r}"
        return suppressed


def _ids(cases):
    return [pytest.param(n, p, id=n) for n, p in cases]


def names(arg, what):
    """Regex: the message mentions the argument (`arg`, a regex of accepted spellings) and what
    was wrong (`what`), in either order."""
    return rf"(?is)((\b({arg})\b).*({what})|({what}).*(\b({arg})\b))"


# ----------------------------------------------------------------------------- dense decode

def dense_base(b=2, s_q=1, h_q=16, h_k=1, page=16, d=576, dtype=torch.bfloat16, seqlens=(20, 33)):
    p = R.make_dense_paged(list(seqlens)[:b] + [5] * max(0, b - len(seqlens)), page, h_k, d, dtype)
    q = R.rand((b, s_q, h_q, d), dtype)
    return dict(q=q, k_cache=p.k_cache, block_table=p.block_table, cache_seqlens=p.cache_seqlens, head_dim_v=512)


def call_dense(a, path="lazy", **kw):
    if path == "lazy":
        meta, _ = flash_mla.get_mla_metadata()
        return flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"],
                                                a["head_dim_v"], meta, **kw)
    tsm, ns = flash_mla.get_mla_metadata(torch.tensor([20, 33], dtype=torch.int32), 16, 1)
    return flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"],
                                            a["head_dim_v"], tsm, ns, **kw)


def _strided_last(t):
    big = torch.cat([t, t], dim=-1)
    v = big[..., ::2]
    assert v.stride(-1) == 2
    return v


def _mut_dense(name):
    a = dense_base()
    if name == "q_dtype":
        a["q"] = a["q"].float()
        return a, names("q|query", "dtype|float|bfloat16|bf16")
    if name == "k_cache_dtype":
        a["k_cache"] = a["k_cache"].half()
        return a, names("k_cache|kcache|kv_cache|key", "dtype|same|half|float16")
    if name == "block_table_dtype":
        a["block_table"] = a["block_table"].long()
        return a, names("block_table", "int32|dtype|int64|long")
    if name == "cache_seqlens_dtype":
        a["cache_seqlens"] = a["cache_seqlens"].long()
        return a, names("cache_seqlens|seqlens_k", "int32|dtype|int64|long")
    if name == "q_rank":
        a["q"] = a["q"][:, 0]
        return a, names("q|query", "dim|rank|4")
    if name == "k_cache_rank":
        a["k_cache"] = a["k_cache"][:, :, 0]
        return a, names("k_cache|kcache|kv_cache", "dim|rank|4")
    if name == "block_table_rank":
        a["block_table"] = a["block_table"][0]
        return a, names("block_table", "dim|rank|2")
    if name == "q_last_dim_strided":
        a["q"] = _strided_last(a["q"])
        return a, names("q|query", "contiguous|stride")
    if name == "k_cache_last_dim_strided":
        a["k_cache"] = _strided_last(a["k_cache"])
        return a, names("k_cache|kcache|kv_cache", "contiguous|stride")
    if name == "block_table_last_dim_strided":
        a["block_table"] = _strided_last(a["block_table"])
        return a, names("block_table", "contiguous|stride")
    if name == "k_cache_head_dim_mismatch":
        a["k_cache"] = a["k_cache"][..., :512].contiguous()
        return a, names("k_cache|kcache|kv_cache|d_qk|head_dim|head_size", "576|512|shape|size|match")
    if name == "block_table_batch_mismatch":
        a["block_table"] = torch.cat([a["block_table"], a["block_table"][:1]])
        return a, names("block_table", "shape|size|batch|\\bb\\b")
    if name == "cache_seqlens_batch_mismatch":
        a["cache_seqlens"] = torch.tensor([20, 33, 1], dtype=torch.int32)
        return a, names("cache_seqlens|seqlens_k", "shape|size|batch|\\bb\\b")
    if name == "h_q_not_multiple_of_h_k":
        a = dense_base(h_q=3, h_k=2)
        return a, names("h_q|h_k|num_heads|heads", "divis|multiple|%")
    if name == "negative_cache_seqlens":
        a["cache_seqlens"] = torch.tensor([20, -3], dtype=torch.int32)
        return a, names("cache_seqlens|seqlens_k", "negative|>= ?0|non-negative|nonnegative")
    if name == "head_dim_v_not_512":
        a["head_dim_v"] = 576
        return a, names("head_dim_v|head_size_v|d_v", "512")
    if name == "unsupported_d_qk":
        a = dense_base(d=128)
        return a, names("d_qk|head_dim|head_size|q", "576|512")
    if name == "head_dim_v_past_int32":  # 2^32 + 512 must not wrap to 512
        a["head_dim_v"] = 2**32 + 512
        return a, names("head_dim_v|head_size_v|d_v", "32 bits|512")
    if name == "q_batch_past_int32":  # an expanded dimension of 2^32 + 2 must not read as 2
        a["q"] = a["q"][:1].expand(2**32 + 2, -1, -1, -1)
        return a, names("q|query", "2\\^31")
    if name == "k_cache_page_past_int32":
        a["k_cache"] = a["k_cache"][:, :1].expand(-1, 2**32 + 16, -1, -1)
        return a, names("k_cache|kcache|kv_cache", "2\\^31")
    raise KeyError(name)


DENSE_ERRORS = ["q_dtype", "k_cache_dtype", "block_table_dtype", "cache_seqlens_dtype", "q_rank", "k_cache_rank",
                "block_table_rank", "q_last_dim_strided", "k_cache_last_dim_strided", "block_table_last_dim_strided",
                "k_cache_head_dim_mismatch", "block_table_batch_mismatch", "cache_seqlens_batch_mismatch",
                "h_q_not_multiple_of_h_k", "negative_cache_seqlens", "head_dim_v_not_512", "unsupported_d_qk",
                "head_dim_v_past_int32", "q_batch_past_int32", "k_cache_page_past_int32"]


def test_dense_baseline_is_valid():
    for path in ("lazy", "legacy"):
        out, lse = call_dense(dense_base(), path)
        assert torch.isfinite(lse).all()


@pytest.mark.parametrize("name", DENSE_ERRORS)
@pytest.mark.parametrize("path", ["lazy", "legacy"])
def test_dense_errors(name, path):
    a, pattern = _mut_dense(name)
    if path == "legacy":
        seqlens = a["cache_seqlens"]
        h_k = a["k_cache"].shape[2] if a["k_cache"].dim() == 4 else 1
        q = a["q"]
        nq = (q.shape[1] * q.shape[2] // max(h_k, 1)) if q.dim() == 4 else 16
        # plan for a valid batch of the same size: the decode op itself must catch the problem
        tsm, ns = flash_mla.get_mla_metadata(torch.tensor([20, 33], dtype=torch.int32), nq, h_k)
        with raises_named(pattern):
            flash_mla.flash_mla_with_kvcache(q, a["k_cache"], a["block_table"], seqlens, a["head_dim_v"], tsm, ns)
    else:
        with raises_named(pattern):
            call_dense(a, "lazy")


def run_isolated(body):
    """Run `body` (which sets q, kc, bt, sl) in a subprocess, so that a crash shows as a failure
    instead of killing the suite. Returns the exception message; fails if none was raised."""
    code = "import torch, mla_kernels.flash_mla as fm\n" + textwrap.dedent(body) + textwrap.dedent("""
        try:
            if PATH == "lazy":
                meta, _ = fm.get_mla_metadata()
                fm.flash_mla_with_kvcache(q, kc, bt, sl, 512, meta)
            else:
                tsm, ns = fm.get_mla_metadata(torch.tensor([10] * q.shape[0], dtype=torch.int32), q.shape[1] * q.shape[2], 1)
                fm.flash_mla_with_kvcache(q, kc, bt, sl, 512, tsm, ns)
        except (RuntimeError, ValueError, AssertionError) as e:
            print("RAISED:", e)
        else:
            print("NO ERROR")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"process died (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "RAISED:" in r.stdout, f"invalid input silently accepted: {r.stdout[-500:]}"
    return r.stdout


@pytest.mark.parametrize("path", ["lazy", "legacy"])
def test_dense_block_table_entry_out_of_range(path):
    """A used block-table entry >= num_blocks must raise (naming block_table), never crash."""
    msg = run_isolated(f"""
        PATH = "{path}"
        q = torch.randn(1, 1, 16, 576).bfloat16() / 10
        kc = torch.randn(4, 16, 1, 576).bfloat16() / 10
        bt = torch.tensor([[1, 2147480000]], dtype=torch.int32)
        sl = torch.tensor([30], dtype=torch.int32)
    """)
    assert re.search(names("block_table", "range|num_blocks|invalid|out of|outside|< ?\\d|>="), msg), msg


@pytest.mark.parametrize("path", ["lazy", "legacy"])
def test_dense_cache_seqlens_beyond_block_table(path):
    """cache_seqlens larger than the block table can hold must raise, never read past it."""
    msg = run_isolated(f"""
        PATH = "{path}"
        q = torch.randn(2, 1, 16, 576).bfloat16() / 10
        kc = torch.randn(8, 16, 1, 576).bfloat16() / 10
        bt = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
        sl = torch.tensor([20, 33], dtype=torch.int32)
    """)
    assert re.search(names("cache_seqlens|seqlens_k|block_table", "exceed|capacity|too|larger|at most|<=|max|beyond|needs|columns"),
                     msg), msg


@pytest.mark.parametrize("path", ["lazy", "legacy"])
def test_dense_cache_seqlens_near_int32_max(path):
    """A length whose page count overflows 32 bits (len + page - 1 past 2^31) must still be checked
    against the block table, never read past it."""
    msg = run_isolated(f"""
        PATH = "{path}"
        q = torch.randn(1, 1, 16, 576).bfloat16() / 10
        kc = torch.randn(4, 16, 1, 576).bfloat16() / 10
        bt = torch.tensor([[0, 1]], dtype=torch.int32)
        sl = torch.tensor([2147483640], dtype=torch.int32)
    """)
    assert re.search(names("cache_seqlens|seqlens_k", "needs|columns|block_table"), msg), msg


def test_dense_op_cache_seqlens_near_int32_max():
    """The same through the op with a one-column table of 64-token pages (no crash there before: the
    overflowing length silently attended the page)."""
    kc = R.rand((4, 64, 1, 576))
    with pytest.raises(RuntimeError, match=names("cache_seqlens|seqlens_k", "needs|columns|block_table")):
        torch.ops.mla_kernels.dense_decode_fwd(R.rand((1, 1, 16, 576)), kc, 512,
                                              torch.tensor([2147483637], dtype=torch.int32),
                                              torch.tensor([[0]], dtype=torch.int32), 0.04, False, None, None)


def test_dense_rows_past_int32():
    """s_q * h_q past 2^32 (an expanded query) is an error naming q, not a division by zero."""
    msg = run_isolated("""
        PATH = "lazy"
        q = torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16).expand(1, 65536, 65536, 576)
        kc = torch.zeros(1, 16, 1, 576, dtype=torch.bfloat16)
        bt = torch.zeros(1, 1, dtype=torch.int32)
        sl = torch.tensor([16], dtype=torch.int32)
    """)
    assert re.search(names("q", "2\\^31|rows"), msg), msg


@pytest.mark.parametrize("name,pattern", _ids([
    ("q_rank_2", names("q", "4-D")),
    ("q_none", names("q", "4-D|None|NoneType")),
    ("k_cache_rank_2", names("k_cache", "4-D")),
    ("k_cache_none", names("k_cache", "4-D|None|NoneType")),
    ("indices_rank_0", names("indices", "3-D")),
    ("extra_k_cache_rank_1", names("extra_k_cache", "4-D")),
]))
def test_lazy_path_reads_no_unchecked_shape(name, pattern):
    """The FlashMLASchedMeta path reads shapes for its Config before any op runs: a missing or
    wrong-rank tensor there is an error naming it, not an IndexError or AttributeError."""
    a = sparse_base() if name.startswith(("indices", "extra")) else dense_base()
    kv = a.get("k_cache", a.get("kv"))
    q = a["q"]
    kw = {}
    if name.startswith(("indices", "extra")):
        kw = dict(is_fp8_kvcache=True, indices=a["indices"], extra_k_cache=a["extra_kv"],
                  extra_indices_in_kvcache=a["extra_indices"])
        if name == "indices_rank_0":
            kw["indices"] = torch.tensor(3, dtype=torch.int32)
        else:
            kw["extra_k_cache"] = a["extra_kv"].flatten()
    elif name == "q_rank_2":
        q = q[0, 0]
    elif name == "q_none":
        q = None
    elif name == "k_cache_rank_2":
        kv = kv[:, :, 0, 0]
    elif name == "k_cache_none":
        kv = None
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ValueError, match=pattern):
        flash_mla.flash_mla_with_kvcache(q, kv, a.get("block_table"), a.get("cache_seqlens"), 512, meta, **kw)


@pytest.mark.parametrize("name,pattern", _ids([
    ("num_splits_with_sched_meta", names("num_splits", "None|must")),
    ("legacy_without_num_splits", names("num_splits", "None|must|required|given")),
    ("legacy_with_attn_sink", names("attn_sink", "None|legacy|not support|must|needs|FlashMLASchedMeta")),
    ("dense_with_attn_sink", names("attn_sink", "None|dense|sparse|must")),
    ("dense_without_block_table", names("block_table", "None|required|must|given")),
    ("descale_q_without_descale_k", names("descale_q|descale_k|descale", "both|None|together|must")),
]))
def test_api_argument_combinations(name, pattern):
    a = dense_base()
    q, kc, bt, sl = a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"]
    meta, _ = flash_mla.get_mla_metadata()
    tsm, ns = flash_mla.get_mla_metadata(sl, 16, 1)
    with pytest.raises(ERRORS, match=pattern):
        if name == "num_splits_with_sched_meta":
            flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, meta, ns)
        elif name == "legacy_without_num_splits":
            flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, tsm, None)
        elif name == "legacy_with_attn_sink":
            flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, tsm, ns, attn_sink=torch.zeros(16))
        elif name == "dense_with_attn_sink":
            flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, meta, attn_sink=torch.zeros(16))
        elif name == "dense_without_block_table":
            flash_mla.flash_mla_with_kvcache(q, kc, None, sl, 512, meta)
        elif name == "descale_q_without_descale_k":
            flash_mla.flash_mla_with_kvcache(q, kc, bt, sl, 512, tsm, ns, descale_q=torch.ones(1))


@pytest.mark.parametrize("name,pattern", _ids([
    ("tsm_wrong_shape", names("tile_scheduler_metadata", "shape|size|8|dim")),
    ("tsm_wrong_dtype", names("tile_scheduler_metadata", "int32|dtype")),
    ("num_splits_wrong_size", names("num_splits", "shape|size|b ?\\+ ?1")),
    ("num_splits_wrong_dtype", names("num_splits", "int32|dtype")),
]))
def test_legacy_metadata_tensor_checks(name, pattern):
    a = dense_base()
    tsm, ns = flash_mla.get_mla_metadata(a["cache_seqlens"], 16, 1)
    if name == "tsm_wrong_shape":
        tsm = tsm[:, :7].contiguous()
    elif name == "tsm_wrong_dtype":
        tsm = tsm.long()
    elif name == "num_splits_wrong_size":
        ns = torch.cat([ns, ns[-1:]])
    elif name == "num_splits_wrong_dtype":
        ns = ns.long()
    with pytest.raises(ERRORS, match=pattern):
        flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 512, tsm, ns)


# ----------------------------------------------------------------------------- dense fp8

def fp8_base():
    p = R.make_dense_paged([20, 33], 16, 1, 576, torch.float8_e4m3fn)
    q8 = (R.rand((2, 1, 16, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
    tsm, ns = flash_mla.get_mla_metadata(p.cache_seqlens, 16, 1, is_fp8_kvcache=True)
    return q8, p, tsm, ns


@pytest.mark.parametrize("name,pattern", _ids([
    ("descale_q_wrong_shape", names("descale_q", "shape|size|\\[1\\]|\\bb\\b|batch")),
    ("descale_k_wrong_dtype", names("descale_k", "float32|dtype")),
    ("k_cache_bf16_with_fp8_q", names("k_cache|kcache|kv_cache", "dtype|float8|fp8|e4m3|same")),
]))
def test_dense_fp8_errors(name, pattern):
    q8, p, tsm, ns = fp8_base()
    dq, dk, kc = torch.tensor([0.05]), torch.tensor([0.03]), p.k_cache
    if name == "descale_q_wrong_shape":
        dq = torch.full((3,), 0.05)
    elif name == "descale_k_wrong_dtype":
        dk = dk.half()
    elif name == "k_cache_bf16_with_fp8_q":
        kc = R.rand(tuple(p.k_cache.shape))
    # baseline valid
    flash_mla.flash_mla_with_kvcache(q8, p.k_cache, p.block_table, p.cache_seqlens, 512, tsm, ns,
                                     descale_q=torch.tensor([0.05]), descale_k=torch.tensor([0.03]))
    with pytest.raises(ERRORS, match=pattern):
        flash_mla.flash_mla_with_kvcache(q8, kc, p.block_table, p.cache_seqlens, 512, tsm, ns, descale_q=dq,
                                         descale_k=dk)


# ----------------------------------------------------------------------------- metadata

@pytest.mark.parametrize("name,pattern", _ids([
    ("missing_num_q_tokens", names("num_q_tokens_per_head_k", "None|must|required|given")),
    ("seqlens_dtype", names("seqlens|cache_seqlens|seqlens_k", "int32|dtype")),
    ("seqlens_negative", names("seqlens|cache_seqlens|seqlens_k", "negative|>= ?0|non-negative")),
    ("seqlens_rank", names("seqlens|cache_seqlens|seqlens_k", "dim|rank|1-?D|shape")),
    ("topk_without_h_q", names("h_q|num_heads_q", "None|must|required|topk|sparse")),
]))
def test_get_mla_metadata_errors(name, pattern):
    sl = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(ERRORS, match=pattern):
        if name == "missing_num_q_tokens":
            flash_mla.get_mla_metadata(sl)
        elif name == "seqlens_dtype":
            flash_mla.get_mla_metadata(sl.long(), 16, 1)
        elif name == "seqlens_negative":
            flash_mla.get_mla_metadata(torch.tensor([10, -1], dtype=torch.int32), 16, 1)
        elif name == "seqlens_rank":
            flash_mla.get_mla_metadata(sl.view(2, 1), 16, 1)
        elif name == "topk_without_h_q":
            flash_mla.get_mla_metadata(sl, 64, 1, None, True, 64)


def test_dense_fp8_metadata_op_names_itself_and_its_arguments():
    sl = torch.tensor([10, 20], dtype=torch.int32)
    op = torch.ops.mla_kernels.get_mla_decoding_metadata_dense_fp8
    with raises_named(r"^get_mla_decoding_metadata_dense_fp8: num_heads_k\b"):
        op(sl, 16, 0)
    with raises_named(r"^get_mla_decoding_metadata_dense_fp8: num_heads_per_head_k\b"):
        op(sl, -1, 1)


# ----------------------------------------------------------------------------- sparse decode

def sparse_base(fmt="model1", h_q=16, topk=32):
    main = R.make_sparse_cache(fmt, 2, 1, 80, topk, 16, with_topk_length=True)
    ex = R.make_sparse_cache(fmt, 2, 1, 40, 8, 16, with_topk_length=True)
    return dict(q=R.rand((2, 1, h_q, R.FORMATS[fmt].d)), kv=main.kv8, indices=main.indices,
                topk_length=main.topk_length, attn_sink=torch.zeros(h_q), extra_kv=ex.kv8,
                extra_indices=ex.indices, extra_topk_length=ex.topk_length, d_v=512, causal=False, is_fp8=True)


def call_sparse(a):
    meta, _ = flash_mla.get_mla_metadata()
    return flash_mla.flash_mla_with_kvcache(
        a["q"], a["kv"], None, None, a["d_v"], meta, softmax_scale=1.0, causal=a["causal"],
        is_fp8_kvcache=a["is_fp8"], indices=a["indices"], attn_sink=a["attn_sink"], extra_k_cache=a["extra_kv"],
        extra_indices_in_kvcache=a["extra_indices"], topk_length=a["topk_length"],
        extra_topk_length=a["extra_topk_length"])


SPARSE_ERRORS = {
    "h_kv_not_1": ("kv", lambda a: a["kv"].expand(-1, -1, 2, -1), names("h_kv|h_k|num_heads_k|MQA|kv|k_cache", "1|MQA")),
    "q_dtype": ("q", lambda a: a["q"].half(), names("q|query", "bfloat16|bf16|dtype")),
    "kv_dtype": ("kv", lambda a: a["kv"].to(torch.bfloat16), names("kv|k_cache|kv_cache", "uint8|int8|fp8|float8|dtype")),
    "indices_dtype": ("indices", lambda a: a["indices"].long(), names("indices", "int32|dtype")),
    "indices_rank": ("indices", lambda a: a["indices"][:, 0], names("indices", "dim|rank|3")),
    "indices_shape": ("indices", lambda a: torch.cat([a["indices"], a["indices"]], 1),
                      names("indices", "shape|size|s_q")),
    "indices_last_dim_strided": ("indices", lambda a: _strided_last(a["indices"]), names("indices", "contiguous|stride")),
    "q_last_dim_strided": ("q", lambda a: _strided_last(a["q"]), names("q|query", "contiguous|stride")),
    "bytes_per_token": ("kv", lambda a: a["kv"][..., :580], names("kv|k_cache|bytes|bytes_per_token", "584|656")),
    "kv_token_stride": ("kv", lambda a: torch.empty(a["kv"].shape[0], a["kv"].shape[1], 1, 600, dtype=torch.uint8)[..., :584],
                        names("kv|k_cache|stride", "stride|contiguous|584")),
    "topk_length_negative": ("topk_length", lambda a: torch.tensor([3, -1], dtype=torch.int32),
                             names("topk_length", "negative|>= ?0|non-negative")),
    "topk_length_shape": ("topk_length", lambda a: torch.tensor([3, 1, 2], dtype=torch.int32),
                          names("topk_length", "shape|size")),
    "topk_length_dtype": ("topk_length", lambda a: a["topk_length"].long(), names("topk_length", "int32|dtype")),
    "attn_sink_shape": ("attn_sink", lambda a: torch.zeros(17), names("attn_sink", "shape|size|h_q")),
    "attn_sink_dtype": ("attn_sink", lambda a: torch.zeros(16, dtype=torch.bfloat16), names("attn_sink", "float32|dtype")),
    "extra_indices_without_extra_kv": ("extra_kv", lambda a: None,
                                       names("extra_indices|extra_indices_in_kvcache|extra_k_cache|extra_kv|extra_topk_length", "extra|given|without|must|None")),
    "extra_topk_length_negative": ("extra_topk_length", lambda a: torch.tensor([-2, 1], dtype=torch.int32),
                                   names("extra_topk_length", "negative|>= ?0|non-negative")),
    "extra_kv_other_format": ("extra_kv", lambda a: R.make_sparse_cache("v32", 2, 1, 40, 8, 16).kv8,
                              names("extra_kv|extra_k_cache", "584|656|bytes|shape|size")),
    "extra_indices_dtype": ("extra_indices", lambda a: a["extra_indices"].long(), names("extra_indices|extra_indices_in_kvcache", "int32|dtype")),
    "d_v_not_512": ("d_v", lambda a: 576, names("d_v|head_dim_v|head_size_v", "512")),
    "causal": ("causal", lambda a: True, names("causal", "sparse|False|not|must|support")),
    "not_fp8": ("is_fp8", lambda a: False, names("is_fp8_kvcache|is_fp8|fp8", "sparse|True|must|require")),
    "topk_zero": ("indices", lambda a: a["indices"][..., :0], names("topk|indices", "> ?0|positive|empty|zero|at least")),
    # A fresh empty tensor has no data pointer: still the size error, not "indices must not be null".
    "topk_zero_fresh": ("indices", lambda a: torch.empty(2, 1, 0, dtype=torch.int32),
                        names("topk|indices", "> ?0|positive|empty|zero|at least")),
    # The same for the extra list over an extra cache that has page blocks.
    "extra_topk_zero_fresh": ("extra_indices", lambda a: torch.empty(2, 1, 0, dtype=torch.int32),
                              names("extra_topk|extra_indices", "> ?0|positive|empty|zero|at least")),
}


def test_sparse_baseline_is_valid():
    for fmt in ("model1", "v32"):
        out, lse = call_sparse(sparse_base(fmt))
        assert out.shape == (2, 1, 16, 512)


@pytest.mark.parametrize("name", list(SPARSE_ERRORS))
def test_sparse_decode_errors(name):
    key, mutate, pattern = SPARSE_ERRORS[name]
    a = sparse_base()
    a[key] = mutate(a)
    with raises_named(pattern):
        call_sparse(a)


@pytest.mark.parametrize("name,pattern", _ids([
    ("kv_cache_bytes", r"^fwd_kvcache_mla: kv_cache must have 584 bytes per token"),
    ("extra_k_cache_alone", r"^fwd_kvcache_mla: extra_k_cache and extra_indices_in_kvcache must be given together"),
    ("head_size_v", r"^fwd_kvcache_mla: head_size_v must be 512, got 576"),
    ("softmax_scale", r"^fwd_kvcache_mla: softmax_scale must be finite, got nan"),
    ("is_fp8_without_indices", r"^fwd_kvcache_mla: is_fp8 must be False without indices"),
]))
def test_legacy_sparse_route_names_the_op_and_its_arguments(name, pattern):
    """fwd_kvcache_mla runs a call with indices as sparse decode: its messages still name
    fwd_kvcache_mla and its own arguments (kv_cache, not sparse_decode_fwd's kv)."""
    a = sparse_base()
    b = a["q"].shape[0]
    seqlens = torch.full((b,), a["indices"].shape[-1], dtype=torch.int32)
    tsm, ns = torch.ops.mla_kernels.get_mla_decoding_metadata(seqlens, a["q"].shape[2], 1, a["q"].shape[2], True,
                                                              a["indices"].shape[-1])
    args = dict(q=a["q"], kv_cache=a["kv"], head_size_v=512, seqlens_k=seqlens,
                block_table=torch.zeros((b, 1), dtype=torch.int32), softmax_scale=0.5, is_causal=False,
                tile_scheduler_metadata=tsm, num_splits=ns, is_fp8=True, indices=a["indices"], attn_sink=None,
                extra_k_cache=a["extra_kv"], extra_indices_in_kvcache=a["extra_indices"],
                topk_length=a["topk_length"], extra_topk_length=a["extra_topk_length"])
    torch.ops.mla_kernels.fwd_kvcache_mla(**args)  # the baseline is valid
    if name == "kv_cache_bytes":
        args["kv_cache"] = args["kv_cache"][..., :580]
    elif name == "extra_k_cache_alone":
        args["extra_indices_in_kvcache"] = args["extra_topk_length"] = None
    elif name == "head_size_v":
        args["head_size_v"] = 576
    elif name == "softmax_scale":
        args["softmax_scale"] = float("nan")
    elif name == "is_fp8_without_indices":
        args.update(indices=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                    extra_topk_length=None)
    with raises_named(pattern):
        torch.ops.mla_kernels.fwd_kvcache_mla(**args)


def test_sparse_unsupported_d_qk():
    a = sparse_base()
    a["q"] = R.rand((2, 1, 16, 256))
    with pytest.raises(ERRORS, match=names("d_qk|head_dim|head_size|q", "576|512")):
        call_sparse(a)


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_q_of_head_dim_zero_with_the_default_scale(kind):
    """The default softmax scale is d_qk ** -0.5: a q of head dim 0 gets the op's error naming the
    head dim, not a ZeroDivisionError from that default."""
    meta, _ = flash_mla.get_mla_metadata()
    with raises_named(names("d_qk|head dim|head_dim|head_size", "576|512")):
        if kind == "dense":
            a = dense_base()
            flash_mla.flash_mla_with_kvcache(a["q"][..., :0], a["k_cache"], a["block_table"], a["cache_seqlens"], 512,
                                             meta)
        else:
            a = sparse_base()
            flash_mla.flash_mla_with_kvcache(a["q"][..., :0], a["kv"], None, None, 512, meta, is_fp8_kvcache=True,
                                             indices=a["indices"])


def test_sparse_q_dim_mismatches_kv_format():
    a = sparse_base("model1")
    a["q"] = R.rand((2, 1, 16, 576))   # V3.2 query against a MODEL1 cache
    with pytest.raises(ERRORS, match=names("kv|k_cache|bytes|bytes_per_token", "584|656|shape|size")):
        call_sparse(a)


# ----------------------------------------------------------------------------- sparse prefill

def prefill_base():
    c = R.make_prefill_case(4, 50, 16, 576, 24, with_topk_length=True, poison=False)
    return dict(q=c.q, kv=c.kv, indices=c.indices, sm_scale=1.0, d_v=512, attn_sink=torch.zeros(16),
                topk_length=c.topk_length)


def call_prefill(a, **kw):
    return flash_mla.flash_mla_sparse_fwd(a["q"], a["kv"], a["indices"], a["sm_scale"], a["d_v"],
                                          attn_sink=a["attn_sink"], topk_length=a["topk_length"], **kw)


PREFILL_ERRORS = {
    "h_kv_not_1": ("kv", lambda a: a["kv"].expand(-1, 2, -1), names("h_kv|kv", "1|MQA")),
    "d_v_not_512": ("d_v", lambda a: 256, names("d_v", "512")),
    "indices_rank": ("indices", lambda a: a["indices"][:, 0], names("indices", "dim|rank|3")),
    "indices_shape": ("indices", lambda a: a["indices"].expand(-1, 2, -1), names("indices", "shape|size|h_kv")),
    "indices_dtype": ("indices", lambda a: a["indices"].long(), names("indices", "int32|dtype")),
    "topk_length_negative": ("topk_length", lambda a: torch.tensor([1, 2, -3, 4], dtype=torch.int32),
                             names("topk_length", "negative|>= ?0|non-negative")),
    "topk_length_shape": ("topk_length", lambda a: torch.tensor([1, 2, 3], dtype=torch.int32),
                          names("topk_length", "shape|size|s_q")),
    "kv_dtype": ("kv", lambda a: a["kv"].float(), names("kv", "bfloat16|bf16|dtype")),
    "q_dtype": ("q", lambda a: a["q"].half(), names("q|query", "bfloat16|bf16|dtype")),
    "q_rank": ("q", lambda a: a["q"][None], names("q|query", "dim|rank|3")),
    "unsupported_d_qk": ("both", None, names("d_qk|head_dim|head_size|q", "576|512")),
    "kv_head_dim_mismatch": ("kv", lambda a: a["kv"][..., :512].contiguous(), names("kv|d_qk", "shape|size|576|512|match")),
    "attn_sink_shape": ("attn_sink", lambda a: torch.zeros(8), names("attn_sink", "shape|size|h_q")),
    "attn_sink_dtype": ("attn_sink", lambda a: torch.zeros(16, dtype=torch.float64), names("attn_sink", "float32|dtype")),
    "q_last_dim_strided": ("q", lambda a: _strided_last(a["q"]), names("q|query", "contiguous|stride")),
    "kv_last_dim_strided": ("kv", lambda a: _strided_last(a["kv"]), names("kv", "contiguous|stride")),
}


def test_prefill_baseline_is_valid():
    out, m, l = call_prefill(prefill_base())
    assert out.shape == (4, 16, 512)


@pytest.mark.parametrize("name", list(PREFILL_ERRORS))
def test_sparse_prefill_errors(name):
    key, mutate, pattern = PREFILL_ERRORS[name]
    a = prefill_base()
    if key == "both":
        a["q"] = R.rand((4, 16, 256))
        a["kv"] = R.rand((50, 1, 256))
    else:
        a[key] = mutate(a)
    with raises_named(pattern):
        call_prefill(a)


def test_prefill_q_none():
    a = prefill_base()
    with raises_named(names("q", "None")):
        flash_mla.flash_mla_sparse_fwd(None, a["kv"], a["indices"], 1.0)


@pytest.mark.parametrize("name", ["q_heads", "kv_tokens"])
def test_prefill_sizes_past_int32(name):
    """An expanded dimension of 2^32 + k is an error naming the tensor, never read as k."""
    a = prefill_base()
    if name == "q_heads":
        a["q"] = a["q"][:, :1].expand(-1, 2**32 + 16, -1)
        pattern = names("q", "2\\^31")
    else:
        a["kv"] = a["kv"][:1].expand(2**32 + 1, -1, -1)
        pattern = names("kv", "2\\^31")
    with raises_named(pattern):
        call_prefill(a)


def test_sparse_decode_sizes_past_int32():
    a = sparse_base()
    a["q"] = a["q"][:1].expand(2**32 + 2, -1, -1, -1)
    with raises_named(names("q", "2\\^31")):
        call_sparse(a)


def test_prefill_bad_lse_base():
    with pytest.raises(ERRORS, match=names("lse_base", "2|e")):
        call_prefill(prefill_base(), lse_base=10)


# ----------------------------------------------------------------------------- formats

@pytest.mark.parametrize("name,pattern", _ids([
    ("bad_fmt", names("fmt|format", "v32|model1")),
    ("v32_wrong_dim", names("kv|kv_bf16|d|dim|shape", "576")),
    ("model1_wrong_dim", names("kv|kv_bf16|d|dim|shape", "512")),
    ("wrong_rank", names("kv|kv_bf16|dim|rank|shape", "4|dim|rank")),
    ("h_not_1", names("kv|kv_bf16|h|heads|shape|dim", "1")),
    ("dequant_wrong_bytes", names("kv8|kv|bytes|shape", "584|656")),
    ("dequant_overlapping_blocks", names("kv", "overlap|stride")),
]))
def test_format_helper_errors(name, pattern):
    with pytest.raises(ERRORS, match=pattern):
        if name == "bad_fmt":
            flash_mla.quantize_kv_fp8(R.rand((1, 4, 1, 576)), "v4")
        elif name == "v32_wrong_dim":
            flash_mla.quantize_kv_fp8(R.rand((1, 4, 1, 512)), "v32")
        elif name == "model1_wrong_dim":
            flash_mla.quantize_kv_fp8(R.rand((1, 4, 1, 576)), "model1")
        elif name == "wrong_rank":
            flash_mla.quantize_kv_fp8(R.rand((4, 1, 576)), "v32")
        elif name == "h_not_1":
            flash_mla.quantize_kv_fp8(R.rand((1, 4, 2, 576)), "v32")
        elif name == "dequant_wrong_bytes":
            flash_mla.dequantize_kv_fp8(torch.zeros(1, 4, 1, 656, dtype=torch.uint8), "model1")
        elif name == "dequant_overlapping_blocks":  # block n + 1 starts inside block n
            base = torch.zeros(4 * 4 * 584, dtype=torch.uint8)
            flash_mla.dequantize_kv_fp8(base.as_strided((3, 4, 1, 584), (584, 584, 584, 1)), "model1")


@pytest.mark.parametrize("name,pattern", _ids([
    ("dense_h_k_zero", names("kcache", "h_k|> 0")),
    ("dense_q_rank_3", names("q", "4-D")),
    ("sparse_plan_without_h_q", names("num_heads_q|h_q", "> 0|None")),
    ("sparse_plan_heads_not_dividing", names("num_q_tokens_per_head_k", "num_heads_q")),
    ("dense_h_q_not_multiple_of_h_k", names("q", "multiple")),
    ("sparse_h_q_zero", names("q", "h_q > 0")),
    ("quantize_bad_fmt", names("fmt", "v32|model1")),
]))
def test_fake_kernels_check_arguments(name, pattern):
    """The fake (meta) kernels torch.compile traces with reject what the real ops reject, naming the
    argument, instead of a ZeroDivisionError or an unpacking error."""
    ops = torch.ops.mla_kernels
    meta = dict(device="meta")
    q = torch.empty(2, 1, 16, 576, dtype=torch.bfloat16, **meta)
    kc = torch.empty(4, 16, 1, 576, dtype=torch.bfloat16, **meta)
    sl = torch.empty(2, dtype=torch.int32, **meta)
    bt = torch.empty(2, 2, dtype=torch.int32, **meta)
    with pytest.raises(ValueError, match=pattern):
        if name == "dense_h_k_zero":
            ops.dense_decode_fwd(q, kc[:, :, :0], 512, sl, bt, 1.0, False, None, None)
        elif name == "dense_q_rank_3":
            ops.dense_decode_fwd(q[0], kc, 512, sl, bt, 1.0, False, None, None)
        elif name == "sparse_plan_without_h_q":
            ops.get_mla_decoding_metadata(sl, 16, 1, None, True, 64)
        elif name == "sparse_plan_heads_not_dividing":
            ops.get_mla_decoding_metadata(sl, 8, 1, 16, True, 64)
        elif name == "dense_h_q_not_multiple_of_h_k":
            ops.dense_decode_fwd(q[:, :, :1], kc.expand(-1, -1, 2, -1), 512, sl, bt, 1.0, False, None, None)
        elif name == "sparse_h_q_zero":
            kv8 = torch.empty(4, 16, 1, 656, dtype=torch.uint8, **meta)
            idx = torch.empty(2, 1, 8, dtype=torch.int32, **meta)
            ops.sparse_decode_fwd(q[:, :, :0], kv8, idx, None, None, None, None, None, None, None, 512, 1.0)
        else:
            ops.quantize_kv_fp8(torch.empty(1, 4, 1, 576, dtype=torch.bfloat16, **meta), "v4")


# ----------------------------------------------------------------------------- CUDA only

def _cuda(a):
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}


def _dense_cuda_plan(a, fp8=False):
    return flash_mla.get_mla_metadata(a["cache_seqlens"], 16, 1, is_fp8_kvcache=fp8)


def _fp8_cuda_base():
    p = R.make_dense_paged([20, 33], 16, 1, 576, torch.float8_e4m3fn)
    q8 = (R.rand((2, 1, 16, 576), torch.float32) * 20).to(torch.float8_e4m3fn)
    return _cuda(dict(q=q8, k_cache=p.k_cache, block_table=p.block_table, cache_seqlens=p.cache_seqlens,
                      descale_q=torch.tensor([0.05]), descale_k=torch.tensor([0.03])))


def _call_fp8(a, tsm, ns):
    return flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 512, tsm, ns,
                                            descale_q=a["descale_q"], descale_k=a["descale_k"])


@pytest.mark.cuda
def test_cuda_baselines_are_valid():
    """Everything on the GPU: no error (so the failures below come from the one argument moved)."""
    for path in ("lazy", "legacy"):
        a = _cuda(dense_base())
        if path == "lazy":
            out, lse = call_dense(a, "lazy")
        else:
            tsm, ns = _dense_cuda_plan(a)
            out, lse = flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"],
                                                        512, tsm, ns)
        assert out.is_cuda and torch.isfinite(lse).all()
    a = _fp8_cuda_base()
    assert _call_fp8(a, *_dense_cuda_plan(a, fp8=True))[0].is_cuda
    for fmt in ("model1", "v32"):
        assert call_sparse(_cuda(sparse_base(fmt)))[0].is_cuda
    assert call_prefill(_cuda(prefill_base()))[0].is_cuda


ON_DEVICE_OF_Q = r"must be on\b.*\bdevice of q"

# name: (call, argument left on the CPU, accepted spellings of its name in the message)
DEVICE_MISMATCH = {
    "dense_k_cache": ("dense", "k_cache", "k_cache|kcache|kv_cache"),
    "dense_block_table": ("dense", "block_table", "block_table"),
    "dense_cache_seqlens": ("dense", "cache_seqlens", "cache_seqlens|seqlens_k"),
    "legacy_tile_scheduler_metadata": ("legacy", "tile_scheduler_metadata", "tile_scheduler_metadata"),
    "legacy_num_splits": ("legacy", "num_splits", "num_splits"),
    "fp8_descale_q": ("fp8", "descale_q", "descale_q"),
    "fp8_descale_k": ("fp8", "descale_k", "descale_k"),
    "sparse_kv": ("sparse", "kv", "kv|k_cache|kv_cache"),
    "sparse_indices": ("sparse", "indices", "indices"),
    "sparse_topk_length": ("sparse", "topk_length", "topk_length"),
    "sparse_attn_sink": ("sparse", "attn_sink", "attn_sink"),
    "sparse_extra_kv": ("sparse", "extra_kv", "extra_kv|extra_k_cache"),
    "sparse_extra_indices": ("sparse", "extra_indices", "extra_indices|extra_indices_in_kvcache"),
    "sparse_extra_topk_length": ("sparse", "extra_topk_length", "extra_topk_length"),
    "prefill_kv": ("prefill", "kv", "kv"),
    "prefill_indices": ("prefill", "indices", "indices"),
    "prefill_attn_sink": ("prefill", "attn_sink", "attn_sink"),
    "prefill_topk_length": ("prefill", "topk_length", "topk_length"),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(DEVICE_MISMATCH))
def test_argument_not_on_device_of_q(name):
    """q on CUDA, one argument on the CPU: a RuntimeError naming that argument and saying it must be
    on the device of q (never a crash or an illegal memory access)."""
    call, key, arg = DEVICE_MISMATCH[name]
    with raises_named(names(arg, ON_DEVICE_OF_Q)) as raised:
        if call == "dense":
            a = _cuda(dense_base())
            a[key] = a[key].cpu()
            call_dense(a, "lazy")
        elif call == "legacy":
            a = _cuda(dense_base())
            plan = dict(zip(("tile_scheduler_metadata", "num_splits"), _dense_cuda_plan(a)))
            plan[key] = plan[key].cpu()
            flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 512,
                                             plan["tile_scheduler_metadata"], plan["num_splits"])
        elif call == "fp8":
            a = _fp8_cuda_base()
            tsm, ns = _dense_cuda_plan(a, fp8=True)
            a[key] = a[key].cpu()
            _call_fp8(a, tsm, ns)
        elif call == "sparse":
            a = _cuda(sparse_base())
            a[key] = a[key].cpu()
            call_sparse(a)
        else:
            a = _cuda(prefill_base())
            a[key] = a[key].cpu()
            call_prefill(a)
    assert raised.info.type is RuntimeError, f"{raised.info.type.__name__}: {raised.info.value}"


def _misaligned_blocks(t):
    """Same values, but stride(0) = (elements of one block) + 1, so the blocks after the first no
    longer start on a 16-byte boundary; the other strides are unchanged."""
    nb, per = t.shape[0], t[0].numel()
    big = torch.zeros((nb, per + 1), dtype=t.dtype, device=t.device)
    big[:, :per].copy_(t.reshape(nb, per))
    v = big[:, :per].view(t.shape)
    assert v.stride()[1:] == t.contiguous().stride()[1:]
    assert torch.equal(v.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
    assert (v.stride(0) * v.element_size()) % 16 != 0
    return v


# name: (call, cache argument, accepted spellings of its name in the message)
MISALIGNED = {
    "dense_kcache": ("dense", "k_cache", "k_cache|kcache|kv_cache"),
    "sparse_kv": ("sparse", "kv", "kv|k_cache|kv_cache"),
    "sparse_extra_kv": ("sparse", "extra_kv", "extra_kv|extra_k_cache"),
    "prefill_kv": ("prefill", "kv", "kv"),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(MISALIGNED))
def test_cuda_cache_not_16_byte_aligned(name):
    """On CUDA a cache whose block stride is not a multiple of 16 bytes raises an error naming the
    argument and the 16-byte alignment (the same layout is fine on the CPU). The sparse caches use
    the V3.2 format: 656 bytes per token, so only stride(0) is off (stride(1) == bytes_per_token)."""
    call, key, arg = MISALIGNED[name]
    if call == "dense":
        a, run = dense_base(), lambda a: call_dense(a, "lazy")
    elif call == "sparse":
        a, run = sparse_base("v32"), call_sparse
    else:
        a, run = prefill_base(), call_prefill
    a[key] = _misaligned_blocks(a[key])
    strides = a[key].stride()
    run(a)  # CPU: any block stride
    a = {k: R.to_device(v, "cuda") if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    assert a[key].is_cuda and a[key].stride() == strides
    with raises_named(names(arg, r"16[- ]?bytes?\b.*align|align.*\b16[- ]?bytes?")):
        run(a)
