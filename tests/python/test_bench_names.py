"""The benchmark's case names: a dense or sparse shape spelled like the fixed cases names that shape."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import bench_decode as B  # noqa: E402


@pytest.mark.parametrize("name,args", [
    ("dense_b8_h16_sk1024", (8, 1, 16, 1024, False, True, False)),
    ("dense_b128_sq2_h128_sk8192_causal_varlen", (128, 2, 128, 8192, True, False, False)),
    ("dense_b1_h32_sk65536_varlen", (1, 1, 32, 65536, False, False, False)),
    ("dense_b3_sq4_h64_sk100_causal", (3, 4, 64, 100, True, True, False)),
    ("dense_b64_h128_sk2048_varlen_fp8", (64, 1, 128, 2048, False, False, True)),
    ("dense_b2_sq2_h16_sk300_causal_fp8", (2, 2, 16, 300, True, True, True)),
])
def test_dense_names_spell_the_shape(name, args, monkeypatch):
    seen = []
    monkeypatch.setattr(B, "dense_case", lambda b, s_q, h_q, s_k, causal, fixed=False, fp8=False, **kw:
                        seen.append((b, s_q, h_q, s_k, causal, fixed, fp8)))
    B.case_by_name(name)()
    assert seen == [args]


@pytest.mark.parametrize("name,args", [
    ("sparse_v32_b128_h32_topk2048", ("v32", 128, 1, 32, 2048)),
    ("sparse_v32_b64_sq2_h16_topk100", ("v32", 64, 2, 16, 100)),
    ("sparse_model1_b3_h64_topk512", ("model1", 3, 1, 64, 512)),
])
def test_sparse_names_spell_the_shape(name, args, monkeypatch):
    seen = []
    monkeypatch.setattr(B, "sparse_case", lambda fmt, b, s_q, h_q, topk, **kw: seen.append((fmt, b, s_q, h_q, topk)))
    B.case_by_name(name)()
    assert seen == [args]


def test_fixed_cases_keep_their_definitions():
    assert B.case_by_name("dense_b128_h128_sk4096_varlen") is B.CASES["dense_b128_h128_sk4096_varlen"]


@pytest.mark.parametrize("name", ["dense_b8_h16", "sparse_v32_b1_h16", "sparse_fp4_b1_h16_topk64",
                                  "dense_b8_h16_sk1024_extra", "dense_b8_h16_sk1024_fp8_varlen"])
def test_unknown_names_are_refused(name):
    with pytest.raises(SystemExit, match="unknown case"):
        B.case_by_name(name)


def test_variants_are_captured_under_their_settings_and_timed_in_one_alternation(monkeypatch, capsys):
    """--impls and --env: one graph per (implementation, value), each captured with its setting in
    the environment, all timed by one alternation (FlashMLA's first), the environment restored."""
    captured, timed = [], []
    monkeypatch.setattr(B, "case_by_name", lambda name: lambda api=None: ((lambda: None), None, 1e9, 1e9))
    monkeypatch.setattr(B, "load_flashmla", lambda path: object())

    def capture(fn, calls=10):
        captured.append((os.environ.get("MLA_KERNELS_IMPL"), os.environ.get("MLA_TEST_SWITCH")))
        return len(captured)
    monkeypatch.setattr(B, "capture", capture)
    monkeypatch.setattr(B, "time_graphs", lambda graphs, calls=10, replays=20: timed.append(list(graphs)) or
                        [100.0 + g for g in graphs])
    monkeypatch.setattr(B.torch.cuda, "get_device_name", lambda: "test")
    monkeypatch.setattr(B.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("MLA_TEST_SWITCH", "outside")
    monkeypatch.delenv("MLA_KERNELS_IMPL", raising=False)
    monkeypatch.setattr(B.sys, "argv", ["bench_decode.py", "--cases", "a", "--no-torch", "--impls", "default,portable",
                                        "--env", "MLA_TEST_SWITCH=0,1", "--flashmla", "dir"])
    B.main()
    assert captured == [(None, "outside"), (None, "0"), (None, "1"), ("portable", "0"), ("portable", "1")]
    assert timed == [[1, 2, 3, 4, 5]]
    assert os.environ["MLA_TEST_SWITCH"] == "outside" and "MLA_KERNELS_IMPL" not in os.environ
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("a ")]
    assert [line.split()[1:3] for line in lines] == [["[default", "MLA_TEST_SWITCH=0]"], ["[default", "MLA_TEST_SWITCH=1]"],
                                                     ["[portable", "MLA_TEST_SWITCH=0]"], ["[portable", "MLA_TEST_SWITCH=1]"]]
    assert [float(line.split()[3]) for line in lines] == [102.0, 103.0, 104.0, 105.0]
    assert all(line.split()[-2] == "101.0" for line in lines)  # FlashMLA's time beside each


@pytest.mark.parametrize("full,short", [
    ("void mla::cuda::sm90::dense_decode_kernel<__nv_bfloat16, 576>(mla::cuda::sm90::DenseArgs)", "dense_decode_kernel"),
    ("void mla::cuda::(anonymous namespace)::combine_kernel<__nv_bfloat16, 4>(mla::CombineParams)", "combine_kernel"),
    ("smxx::decode::get_mla_metadata_kernel(GetDecodeSchedMetaParams)", "get_mla_metadata_kernel"),
    ("void sm90::flash_fwd_splitkv_mla_kernel<Traits<cutlass::bfloat16_t>, TmaParams<(int)1>>(P)",
     "flash_fwd_splitkv_mla_kernel"),
    ("Memset (Device)", "Memset"),
])
def test_kernel_names_are_shortened(full, short):
    assert B.short_kernel_name(full) == short


def test_kernel_times_are_summed_per_kernel_and_divided_by_the_calls():
    events = [("void a::k1<int>(P)", 10.0), ("void a::k2(P)", 3.0), ("void a::k1<float>(P)", 30.0), ("void a::k2(P)", 1.0)]
    assert B.per_call_kernel_times(events, calls=4) == [("k1", 10.0), ("k2", 1.0)]


def test_kernels_flag_prints_each_graphs_kernels_after_the_case(monkeypatch, capsys):
    """--kernels: after a case's lines, one line per timed graph (FlashMLA's first, then each variant of
    ours) with its kernels' times per call."""
    monkeypatch.setattr(B, "case_by_name", lambda name: lambda api=None: ((lambda: None), None, 1e9, 1e9))
    monkeypatch.setattr(B, "load_flashmla", lambda path: object())
    graphs = iter(range(1, 10))
    monkeypatch.setattr(B, "capture", lambda fn, calls=10: next(graphs))
    monkeypatch.setattr(B, "time_graphs", lambda gs, calls=10, replays=20: [100.0 + g for g in gs])
    monkeypatch.setattr(B, "kernel_times", lambda g, calls=10, replays=5: [(f"attn{g}", 90.0 + g), ("combine", 9.0)])
    monkeypatch.setattr(B.torch.cuda, "get_device_name", lambda: "test")
    monkeypatch.setattr(B.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(B.sys, "argv", ["bench_decode.py", "--cases", "a", "--no-torch", "--env", "MLA_TEST_SWITCH=0,1",
                                        "--flashmla", "dir", "--kernels"])
    B.main()
    out = capsys.readouterr().out.splitlines()
    kernel_lines = [line for line in out if line.startswith("#   ")]
    assert kernel_lines == ["#   FlashMLA: attn1 91.0, combine 9.0 us per call",
                            "#   ours [MLA_TEST_SWITCH=0]: attn2 92.0, combine 9.0 us per call",
                            "#   ours [MLA_TEST_SWITCH=1]: attn3 93.0, combine 9.0 us per call"]
    assert out.index(kernel_lines[0]) > max(i for i, line in enumerate(out) if line.startswith("a "))


def test_sustained_summary_takes_the_second_half_and_divides_its_energy_by_its_calls():
    # The clocks fall as the card reaches its power limit: the first half (cold, fast) is left out,
    # its energy too (2800 mJ is the counter's rise over the last four replays of 10 calls).
    us = [800.0, 801.0, 802.0, 900.0, 980.0, 975.0, 990.0, 985.0]
    mhz = [1980, 1980, 1900, 1700, 1500, 1490, 1510, 1480]
    t, per_call, clock = B.sustained_summary(us, mhz, 4, 2800.0, calls=10)
    assert t == 982.5 and clock == 1495 and per_call == pytest.approx(70.0)
    with pytest.raises(ValueError):
        B.sustained_summary(us, mhz[:-1], 4, 2800.0, 10)
    for start in (0, 8):
        with pytest.raises(ValueError):
            B.sustained_summary(us, mhz, start, 2800.0, 10)
    with pytest.raises(ValueError):
        B.sustained_summary(us, mhz, 4, 2800.0, 0)


def test_time_sustained_reads_the_energy_halfway_and_at_the_end(monkeypatch):
    """The energy counter is read twice, halfway through the window and after its last replay, and
    the pause of the halfway reading is no replay's time (stand-ins: every replay takes 1 s of the
    clock and adds 700 mJ, a reading takes 8 s)."""
    now = [0.0]

    class Counter:
        def __init__(self):
            self.mj, self.reads = 0.0, 0
        def energy_mj(self):
            self.reads += 1
            now[0] += 8.0
            return self.mj
        def sm_clock_mhz(self):
            return 1500

    counter = Counter()

    class Graph:
        def replay(self):
            now[0] += 1.0
            counter.mj += 700.0

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None
        def record(self):
            self.at = now[0]
        def synchronize(self):
            pass
        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(B.time, "time", lambda: now[0])
    monkeypatch.setattr(B.time, "sleep", lambda s: None)
    monkeypatch.setattr(B.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(B.torch.cuda, "Event", Event)
    t, per_call, clock = B.time_sustained(Graph(), counter, seconds=20.5, calls=10)
    # Halfway (10.25 s) comes after the 11th replay, the reading ends at 19 s, two replays follow.
    assert counter.reads == 2
    assert t == pytest.approx(1e5) and per_call == pytest.approx(70.0) and clock == 1500


def test_sustained_flag_times_each_graph_alone_and_prints_both_libraries(monkeypatch, capsys):
    """--sustained: every graph (FlashMLA's, then each variant of ours) gets its own window after the
    alternation; the line of each variant gives its time, energy and clock beside FlashMLA's."""
    monkeypatch.setattr(B, "case_by_name", lambda name: lambda api=None: ((lambda: None), None, 1e9, 1e9))
    monkeypatch.setattr(B, "load_flashmla", lambda path: object())
    monkeypatch.setattr(B, "Nvml", lambda: "nvml")
    graphs = iter(range(1, 10))
    monkeypatch.setattr(B, "capture", lambda fn, calls=10: next(graphs))
    monkeypatch.setattr(B, "time_graphs", lambda gs, calls=10, replays=20: [100.0 + g for g in gs])
    alone = []
    monkeypatch.setattr(B, "time_sustained", lambda g, nvml, seconds: alone.append((g, nvml, seconds)) or
                        (1000.0 - 50 * g, 700.0 - 10 * g, 1500 + g))
    monkeypatch.setattr(B.torch.cuda, "get_device_name", lambda: "test")
    monkeypatch.setattr(B.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(B.sys, "argv", ["bench_decode.py", "--cases", "a", "--no-torch", "--impls", "default,portable",
                                        "--flashmla", "dir", "--sustained", "3"])
    B.main()
    assert alone == [(1, "nvml", 3.0), (2, "nvml", 3.0), (3, "nvml", 3.0)]
    lines = [line for line in capsys.readouterr().out.splitlines() if "alone" in line]
    assert lines == [
        "#   alone for 3 s: a [default] 900.0 us, 680.0 mJ, 1502 MHz; FlashMLA 950.0 us, 690.0 mJ, 1501 MHz; 1.06x",
        "#   alone for 3 s: a [portable] 850.0 us, 670.0 mJ, 1503 MHz; FlashMLA 950.0 us, 690.0 mJ, 1501 MHz; 1.12x",
    ]


def test_the_card_is_named_to_nvml_by_its_pci_address():
    """NVML counts every GPU and CUDA only the visible ones: the address, not an index, names the card."""
    props = type("Props", (), {"pci_domain_id": 0, "pci_bus_id": 0x19, "pci_device_id": 0})()
    assert B.pci_bus_id(props) == "00000000:19:00.0"
    props.pci_domain_id, props.pci_bus_id, props.pci_device_id = 1, 0xC5, 0x1F
    assert B.pci_bus_id(props) == "00000001:c5:1f.0"


@pytest.mark.parametrize("seconds", ["0", "-1", "nan"])
def test_sustained_windows_of_no_time_are_refused(seconds, monkeypatch, capsys):
    monkeypatch.setattr(B, "Nvml", lambda: pytest.fail("NVML opened for a refused window"))
    monkeypatch.setattr(B.sys, "argv", ["bench_decode.py", "--sustained", seconds])
    with pytest.raises(SystemExit):
        B.main()
    assert "--sustained" in capsys.readouterr().err
