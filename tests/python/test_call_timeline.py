"""bench/call_timeline.py's reading of a profiler trace (no GPU): the last replay's kernels in start
order, and the middle call's starts, lengths and gaps, negative where a dependent kernel launched
before the one it depends on ended."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import call_timeline as T  # noqa: E402


def kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def replay(t0, calls):
    """One replay: per call an attention kernel of 10 µs and a combine launched 1 µs before it ends,
    running 3 µs; calls 12 µs apart."""
    events = []
    for c in range(calls):
        base = t0 + 12.0 * c
        events += [kernel("attention", base, 10.0), kernel("combine", base + 9.0, 3.0)]
    return events


def test_spans_are_the_last_replay_in_start_order():
    events = replay(0.0, 4) + replay(1000.0, 4) + [{"cat": "cuda_runtime", "name": "launch", "ts": 5, "dur": 1}]
    events.reverse()  # the trace's order is not the start order
    spans = T.spans_of_events(events, replays=2)
    assert len(spans) == 8
    assert spans[0] == ("attention", 1000.0, 1010.0)
    assert spans[1] == ("combine", 1009.0, 1012.0)
    assert [s[1] for s in spans] == sorted(s[1] for s in spans)


def test_middle_call_starts_lengths_and_gaps():
    spans = T.spans_of_events(replay(0.0, 10), replays=1)
    rows, call_us, replay_us = T.middle_call(spans, 10)
    # The middle call is the sixth (index 5), starting at 60 µs; the call before ended at 60.
    assert rows == [("attention", 0.0, 10.0, 0.0), ("combine", 9.0, 3.0, -1.0)]
    assert call_us == 12.0
    assert replay_us == (9 * 12.0 + 12.0) / 10


def test_a_replay_of_uneven_calls_is_refused():
    spans = T.spans_of_events(replay(0.0, 10)[:-1], replays=1)
    assert T.middle_call(spans, 10) is None
    assert T.middle_call([], 10) is None
