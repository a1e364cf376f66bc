"""Where a call's time goes between its kernels: the GPU timeline of one replay of a benchmark graph
(10 calls back to back, as bench_decode.py times them), ours and FlashMLA's.

    python3 bench/call_timeline.py [--reuse-plan] [--flashmla DIR] CASE...

For each case and library it prints every kernel of the middle call of a replay: its start after
the call's first kernel began, its length and the gap since the kernel before it ended (negative
where two overlap: a programmatic dependent launched before the kernel it depends on ended), then
the call's length, start to start, against the replay's time per call. Timestamps come from
torch.profiler's trace (CUPTI), so a kernel launched early counts from its launch, wait included.
"""

import argparse
import json
import os
import sys
import tempfile
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as B  # noqa: E402

CALLS = 10


def spans_of_events(events, replays):
    """[(name, start µs, end µs)] of the kernel events of a trace's last replay of `replays`, in start
    order: the trace holds whole replays, so the last len // replays spans are the last one's."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
                   for e in events if e.get("cat") == "kernel")
    per_replay = len(spans) // replays
    return [(name, t0, t1) for t0, t1, name in spans[len(spans) - per_replay:]]


def profiled(run):
    """run()'s result and the events of torch.profiler's trace of it (CUDA activity; the device is
    synchronised before the trace ends)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return result, json.load(f)["traceEvents"]


def kernel_spans(graph, replays=3):
    """The spans of the last of `replays` replays of `graph`, from torch.profiler's trace."""
    _, events = profiled(lambda: [graph.replay() for _ in range(replays)])
    return spans_of_events(events, replays)


def middle_call(spans, calls):
    """The middle call of a replay of `calls` calls: ([(name, start, length, gap)], call µs start to
    start, µs per call over the replay), times from the call's first kernel's start, gaps from the
    end of the kernel before (negative where they overlap). None where the replay's kernels are not
    the same number per call."""
    per_call = len(spans) // calls
    if per_call == 0 or per_call * calls != len(spans) or calls < 2:
        return None
    first = calls // 2 * per_call
    begin = spans[first][1]
    prev_end = spans[first - 1][2]
    rows = []
    for name, t0, t1 in spans[first:first + per_call]:
        rows.append((name, t0 - begin, t1 - t0, t0 - prev_end))
        prev_end = t1
    call_us = spans[first + per_call][1] - begin if first + per_call < len(spans) else spans[-1][2] - begin
    replay_us = (spans[-1][2] - spans[0][1]) / calls
    return rows, call_us, replay_us


def show(label, call):
    spans = kernel_spans(B.capture(call, CALLS))
    mid = middle_call(spans, CALLS)
    if mid is None:
        print(f"  {label}: {len(spans)} kernels in a replay of {CALLS} calls, not a whole number per call")
        return
    rows, call_us, replay_us = mid
    for name, start, length, gap in rows:
        print(f"  {label:9s} {B.short_kernel_name(name)[:48]:48s} start {start:7.2f}  length {length:7.2f}"
              f"  gap {gap:6.2f} µs")
    print(f"  {label:9s} call {call_us:.2f} µs start to start; {replay_us:.2f} µs per call over the replay")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="+", help="bench_decode case names")
    parser.add_argument("--flashmla", metavar="DIR", help="FlashMLA's package built outside the repository")
    parser.add_argument("--reuse-plan", action="store_true", help="time calls on a plan made before the capture")
    args = parser.parse_args()
    B.REUSE_PLAN = args.reuse_plan
    apis = [("ours", B.flash_mla)] + ([("FlashMLA", B.load_flashmla(args.flashmla))] if args.flashmla else [])
    for name in args.cases:
        print(f"{name}{' (plan reused)' if args.reuse_plan else ''}")
        for label, api in apis:
            torch.manual_seed(zlib.crc32(name.encode()))
            call, _, _, _ = B.case_by_name(name)(api=api)
            show(label, call)


if __name__ == "__main__":
    main()
