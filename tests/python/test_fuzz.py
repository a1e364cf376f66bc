"""Bad input at random (SPEC section 7): every torch op called with one or two arguments of a valid
call mutated (dtype, rank, a dimension's size, strides, a missing tensor, extreme integers in index,
length, table and plan tensors, NaN / inf in float tensors, out-of-range scalars). Each call must
either raise one of the documented exception types with a message that names the op and one of its
arguments, or return outputs of the documented shapes and dtypes on q's device. Where the data
stayed the same (see SAME below) the outputs hold no NaN; on CUDA, unless a value became non-finite
or was reinterpreted or the call brings its own plan, they match the CPU backend's for the same
mutated call, wherever that accepts it and has no NaN. The data-dependent checks are the
CPU's alone (a CUDA op cannot read device data without a host sync), so on CUDA this is where
garbage in lengths, tables and indices meets the kernels.

The trials run in a child process (`python test_fuzz.py DEVICE SEED TRIALS`), so that a crash (a
signal, or a CUDA error that poisons the context) fails the test with the trial that caused it
instead of ending the run, and a hang fails it after five minutes."""

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

ERRORS = (RuntimeError, ValueError, AssertionError)
INT_EXTREMES = (-1, -2**31, 2**31 - 1, 1 << 20)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int32, torch.int64, torch.uint8)


# ----------------------------------------------------------------------------- valid calls

class Call:
    """One op call: `args` in schema order (a dict), `kind` what it returns ("decode", "prefill",
    "metadata", "format"), `own_plan` whether the caller made its plan (tile_scheduler_metadata and
    num_splits). Such a call's outputs are neither checked for NaN nor compared: a mutation may leave
    its plan describing another call (shapes, lengths), which no GPU op can see without a host sync,
    and whose outputs may then be left unwritten."""

    def __init__(self, op, args, kind, own_plan=False):
        self.op, self.args, self.kind, self.own_plan = op, args, kind, own_plan


def valid_calls(rng, device):
    import reference as R
    ops = torch.ops.mla_kernels
    fmt = rng.choice(["v32", "model1"])
    b, s_q, h_q = rng.randint(1, 3), rng.randint(1, 2), rng.choice([1, 5, 16, 32, 64, 128])
    page, topk = rng.choice([16, 64]), rng.randint(1, 90)
    main = R.make_sparse_cache(fmt, b, s_q, 100, topk, page, with_topk_length=True)
    ex = R.make_sparse_cache(fmt, b, s_q, 40, rng.randint(1, 20), 4, with_topk_length=True)
    sparse = dict(q=R.rand((b, s_q, h_q, R.FORMATS[fmt].d)), kv=main.kv8, indices=main.indices,
                  topk_length=main.topk_length, attn_sink=torch.randn(h_q), tile_scheduler_metadata=None,
                  num_splits=None, extra_kv=ex.kv8, extra_indices=ex.indices, extra_topk_length=ex.topk_length,
                  d_v=512, sm_scale=0.1)

    d, h_k = rng.choice([576, 512]), rng.choice([1, 1, 2])
    seqlens = [rng.randint(0, 150) for _ in range(b)]
    paged = R.make_dense_paged(seqlens, rng.choice([1, 16, 64]), h_k, d, torch.bfloat16)
    dense = dict(q=R.rand((b, s_q, h_q * h_k, d)), kcache=paged.k_cache, head_size_v=512,
                 seqlens_k=paged.cache_seqlens, block_table=paged.block_table, softmax_scale=0.1,
                 is_causal=rng.random() < 0.5, tile_scheduler_metadata=None, num_splits=None)

    on = lambda a: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    sparse, dense = on(sparse), on(dense)
    sl = dense["seqlens_k"]
    tsm, ns = ops.get_mla_decoding_metadata(sl, s_q * h_q, h_k, None, False, None)
    legacy = dict(q=dense["q"], kv_cache=dense["kcache"], head_size_v=512, seqlens_k=sl,
                  block_table=dense["block_table"], softmax_scale=0.1, is_causal=dense["is_causal"],
                  tile_scheduler_metadata=tsm, num_splits=ns, is_fp8=False, indices=None, attn_sink=None,
                  extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None)
    sl_sparse = torch.full((b,), topk, dtype=torch.int32, device=device)
    tsm_s, ns_s = ops.get_mla_decoding_metadata(sl_sparse, s_q * h_q, 1, h_q, True, topk)
    legacy_sparse = dict(legacy, q=sparse["q"], kv_cache=sparse["kv"], seqlens_k=sl_sparse,
                         block_table=torch.zeros((b, 1), dtype=torch.int32, device=device), is_causal=False,
                         tile_scheduler_metadata=tsm_s, num_splits=ns_s, is_fp8=True, indices=sparse["indices"],
                         attn_sink=sparse["attn_sink"], extra_k_cache=sparse["extra_kv"],
                         extra_indices_in_kvcache=sparse["extra_indices"], topk_length=sparse["topk_length"],
                         extra_topk_length=sparse["extra_topk_length"])
    tsm8, ns8 = ops.get_mla_decoding_metadata_dense_fp8(sl, s_q * h_q, h_k)
    fp8 = dict(q=(dense["q"].float() * 4).to(torch.float8_e4m3fn), kcache=dense["kcache"].to(torch.float8_e4m3fn),
               head_size_v=512, seqlens_k=sl, block_table=dense["block_table"], softmax_scale=0.1,
               is_causal=dense["is_causal"], tile_scheduler_metadata=tsm8, num_splits=ns8,
               descale_q=torch.rand(b, device=device) + 0.5, descale_k=torch.rand(b, device=device) + 0.5)
    case = R.make_prefill_case(rng.randint(1, 5), 60, rng.choice([1, 16, 64, 128]), rng.choice([576, 512]),
                               rng.randint(1, 70), with_topk_length=True)
    prefill = on(dict(q=case.q, kv=case.kv, indices=case.indices, sm_scale=0.1, d_v=512,
                      attn_sink=torch.randn(case.q.shape[1]), topk_length=case.topk_length))
    calls = [
        Call("sparse_decode_fwd", sparse, "decode"),
        Call("dense_decode_fwd", dense, "decode"),
        Call("fwd_kvcache_mla", legacy, "decode", own_plan=True),
        Call("fwd_kvcache_mla", legacy_sparse, "decode", own_plan=True),
        Call("fwd_kvcache_mla_fp8", fp8, "decode", own_plan=True),
        Call("sparse_prefill_fwd", prefill, "prefill"),
        Call("get_mla_decoding_metadata", dict(seqlens_k=sl, num_q_tokens_per_head_k=s_q * h_q, h_k=h_k, h_q=h_q,
                                                is_fp8_kvcache=False, topk=None), "metadata"),
        Call("get_mla_decoding_metadata", dict(seqlens_k=sl_sparse, num_q_tokens_per_head_k=s_q * h_q, h_k=1,
                                                h_q=h_q, is_fp8_kvcache=True, topk=topk), "metadata"),
        Call("get_mla_decoding_metadata_dense_fp8", dict(seqlens_k=sl, num_heads_per_head_k=s_q * h_q,
                                                          num_heads_k=h_k), "metadata"),
    ]
    if device == "cpu":  # the format ops have a CPU kernel only
        calls += [Call("quantize_kv_fp8", dict(kv=R.rand((3, 16, 1, R.FORMATS[fmt].d)), fmt=fmt), "format"),
                  Call("dequantize_kv_fp8", dict(kv=main.kv8, fmt=fmt), "format")]
    return calls


# ----------------------------------------------------------------------------- mutations

def _resized(rng, t, dim):
    """t with dimension `dim` set to 0, shrunk, or grown by repeating its own entries (so that the
    values stay ones a valid call holds)."""
    n = t.shape[dim]
    choice = rng.choice(["zero", "shrink", "grow"])
    if choice == "zero" or n == 0:
        return t.narrow(dim, 0, 0), "dim0"
    if choice == "shrink" and n > 1:
        return t.narrow(dim, 0, rng.randint(1, n - 1)), "shrink"
    reps = rng.randint(1, 2 * n + 64)
    extra = t.index_select(dim, torch.arange(reps, device=t.device) % n)
    return torch.cat([t, extra], dim), "grow"


# What a mutation leaves of the data, from least to most changed: SAME values (or none at all, or
# values every op ignores or rejects); MOVED, still finite and deterministic, but other slots of the
# caches may now be attended, which hold NaN where nothing valid referenced them (so NaN may come
# out, the same on every backend); GARBAGE, non-finite or reinterpreted values, whose NaN and inf
# handling a kernel may round differently.
SAME, MOVED, GARBAGE = 0, 1, 2


def mutate_tensor(rng, t):
    """(new value, what was done, what it leaves of the data)."""
    if t is None:
        return torch.zeros(2, dtype=torch.int32), "given", MOVED
    kinds = ["dtype", "rank", "size", "layout", "none"]
    if t.dtype in (torch.int32, torch.int64):
        kinds += ["extreme"] * 3
    elif t.is_floating_point() and t.element_size() > 1:
        kinds += ["nonfinite"]
    kind = rng.choice(kinds)
    if kind == "dtype":
        dt = rng.choice([d for d in DTYPES if d != t.dtype])
        return t.to(dt), f"dtype {dt}", GARBAGE
    if kind == "rank":
        if t.dim() > 0 and rng.random() < 0.5:
            return t.select(rng.randrange(t.dim()), 0), "rank-1", MOVED
        return t.unsqueeze(rng.randrange(t.dim() + 1)), "rank+1", SAME
    if kind == "size" and t.dim() > 0:
        v, what = _resized(rng, t, rng.randrange(t.dim()))
        return v, what, SAME if what == "dim0" else MOVED
    if kind == "layout" and t.dim() > 0:
        if rng.random() < 0.5:
            return torch.stack([t, t], -1).select(-1, 0), "strided last dim", SAME
        return t.transpose(0, -1), "transposed", MOVED
    if kind == "extreme" and t.numel() > 0:
        # A length past the sequence or a table entry past the cache: clamped or invalid on the GPU,
        # where the cache slots it may reach are unattended ones.
        v = t.clone()
        v.view(-1)[rng.randrange(v.numel())] = rng.choice(INT_EXTREMES)
        return v, "extreme", MOVED
    if kind == "nonfinite" and t.numel() > 0:
        v = t.clone()
        v.view(-1)[rng.randrange(v.numel())] = rng.choice([math.nan, math.inf, -math.inf])
        return v, "nonfinite", GARBAGE
    return None, "none", SAME


def mutate_scalar(rng, kind, v):
    """kind: the schema's type without "?" (bool, int, float or str)."""
    if kind == "bool":
        return not v, "flipped", SAME
    if kind == "int":
        return rng.choice([0, -1, 1, 511, 513, 2**31 - 1, -2**31]), "int", SAME
    if kind == "float":
        f = rng.choice([0.0, -1.0, math.nan, math.inf, 1e30])
        return f, "float", MOVED if math.isfinite(f) and abs(f) < 1e3 else GARBAGE
    return rng.choice(["", "v31", "MODEL1"]), "str", SAME


# ----------------------------------------------------------------------------- checks

# Spellings a message may use for an op's argument: the op's own, the Python API's (flash_mla) and
# the C++ params field's, which the core's messages use.
SYNONYMS = {"kcache": ("k_cache",), "kv_cache": ("k_cache",), "seqlens_k": ("cache_seqlens",),
            "head_size_v": ("head_dim_v",), "d_v": ("head_dim_v",), "sm_scale": ("softmax_scale",)}
# The dispatcher's own message when a call's only tensor is None: no kernel of ours runs, so it
# cannot name the op (torch's wording).
NO_TENSOR_ARGUMENTS = "There were no tensor arguments to this function"


def _names_op_and_argument(msg, call):
    if msg.startswith(NO_TENSOR_ARGUMENTS):
        return sum(isinstance(v, torch.Tensor) for v in call.args.values()) == 0
    spellings = [s for name in call.args for s in (name,) + SYNONYMS.get(name, ())]
    return call.op in msg and any(s in msg for s in spellings)


def _outputs_ok(call, res, device):
    """None if the outputs have the documented shapes, dtypes and device, else what is wrong."""
    q = call.args.get("q")
    if call.kind in ("metadata", "format"):
        ts = [t for t in res if isinstance(t, torch.Tensor)]
        return None if all(t.device.type == device for t in ts) else "an output on another device"
    out, lse = res[0], res[1]
    if out.device != q.device or lse.device != q.device:
        return "an output on another device than q"
    if out.shape[:-1] != q.shape[:-1] or out.shape[-1] != 512:
        return f"out shape {tuple(out.shape)} for q {tuple(q.shape)}"
    want = torch.bfloat16 if call.op == "fwd_kvcache_mla_fp8" else q.dtype
    if out.dtype != want or lse.dtype != torch.float32:
        return f"out dtype {out.dtype} (q {q.dtype}), lse dtype {lse.dtype}"
    return None


def _no_nan(res):
    return all(not torch.isnan(t.float()).any() for t in res if isinstance(t, torch.Tensor) and t.is_floating_point())


def _close(got, ref):
    """Loose: it tells results from garbage, not one rounding from another. Where the CPU backend has
    NaN (an attended slot that held NaN), the result is the input's garbage and is not compared."""
    got, ref = got.float().cpu(), ref.float().cpu()
    known = ~torch.isnan(ref)
    got, ref = got[known], ref[known]
    inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(got), inf) or not torch.equal(got[inf], ref[inf]):
        return False
    return torch.allclose(got[~inf], ref[~inf], atol=3e-2, rtol=3e-2)


def run_trials(device, seed, trials):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mla_kernels.flash_mla  # noqa: F401  (loads the ops)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ops = torch.ops.mla_kernels
    counts = {"raised": 0, "returned": 0, "compared": 0}
    problems = []
    for trial in range(trials):
        if problems and problems[-1].endswith("(the CUDA context is lost)"):
            break
        for call in valid_calls(rng, device):
            args, what, left = dict(call.args), [], SAME
            types = {a.name: str(a.type).rstrip("?") for a in getattr(ops, call.op).default._schema.arguments}
            for name in rng.sample(sorted(args), rng.randint(1, 2)):
                if types[name] == "Tensor":
                    args[name], how, change = mutate_tensor(rng, args[name])
                    if isinstance(args[name], torch.Tensor):
                        args[name] = args[name].to(device)
                else:
                    args[name], how, change = mutate_scalar(rng, types[name], args[name])
                left = max(left, change)
                what.append(f"{name}: {how}")
            label = f"trial {trial} {call.op} {what}"
            print(label, flush=True)  # the last line names the trial if the process dies
            mutated = Call(call.op, args, call.kind, call.own_plan)
            try:
                res = getattr(ops, call.op)(**args)
                if device == "cuda":
                    torch.cuda.synchronize()
            except ERRORS as e:
                msg = str(e)
                if "CUDA error" in msg:
                    problems.append(f"{label}: {msg[:300]} (the CUDA context is lost)")
                    break
                if not _names_op_and_argument(msg, mutated):
                    problems.append(f"{label}: the message names no argument: {msg[:300]}")
                counts["raised"] += 1
                continue
            counts["returned"] += 1
            bad = _outputs_ok(mutated, res, device)
            if bad is None and not call.own_plan and call.kind in ("decode", "prefill"):
                if left == SAME and not _no_nan(res):
                    bad = "NaN in the outputs of a call whose data stayed the same"
                elif left < GARBAGE and device == "cuda":
                    cpu_args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
                    try:
                        ref = getattr(ops, call.op)(**cpu_args)
                    except ERRORS:
                        ref = None  # a data-dependent check the CUDA op does not make
                    if ref is not None:
                        counts["compared"] += 1
                        n = 3 if call.kind == "prefill" else 2
                        if not all(_close(a, b) for a, b in zip(res[:n], ref[:n])):
                            bad = "differs from the CPU backend"
            if bad is not None:
                problems.append(f"{label}: {bad}")
    print(json.dumps({"counts": counts, "problems": problems}))


# ----------------------------------------------------------------------------- tests

def _run_child(device, seed, trials):
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), device, str(seed), str(trials)],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines = out.strip().splitlines()
        pytest.fail(f"the child hung at: {lines[-1] if lines else '?'}")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, (f"the child died (code {proc.returncode}) at: {lines[-1] if lines else '?'}\n"
                                  f"{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_mutated_calls_raise_or_return_sound_outputs(device):
    report = _run_child(device, seed=20261208, trials=40)
    assert not report["problems"], "\n".join(report["problems"][:20])
    counts = report["counts"]
    # Both outcomes occur: the mutations reach the kernels as well as the checks.
    assert counts["raised"] > 0 and counts["returned"] > 0, counts
    if device == "cuda":
        assert counts["compared"] > 0, counts


if __name__ == "__main__":
    run_trials(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
