"""The benchmark's case names: a dense shape spelled like the fixed cases names that shape."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import bench_decode as B  # noqa: E402


@pytest.mark.parametrize("name,args", [
    ("dense_b8_h16_sk1024", (8, 1, 16, 1024, False, True)),
    ("dense_b128_sq2_h128_sk8192_causal_varlen", (128, 2, 128, 8192, True, False)),
    ("dense_b1_h32_sk65536_varlen", (1, 1, 32, 65536, False, False)),
    ("dense_b3_sq4_h64_sk100_causal", (3, 4, 64, 100, True, True)),
])
def test_dense_names_spell_the_shape(name, args, monkeypatch):
    seen = []
    monkeypatch.setattr(B, "dense_case", lambda b, s_q, h_q, s_k, causal, fixed=False, **kw:
                        seen.append((b, s_q, h_q, s_k, causal, fixed)))
    B.case_by_name(name)()
    assert seen == [args]


def test_fixed_cases_keep_their_definitions():
    assert B.case_by_name("dense_b128_h128_sk4096_varlen") is B.CASES["dense_b128_h128_sk4096_varlen"]


@pytest.mark.parametrize("name", ["dense_b8_h16", "sparse_v32_b1_h16_topk64", "dense_b8_h16_sk1024_extra"])
def test_unknown_names_are_refused(name):
    with pytest.raises(SystemExit, match="unknown case"):
        B.case_by_name(name)
