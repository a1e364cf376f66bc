"""bench/dense_timeline.py's reading of a stamp table (no GPU): phases per CTA from the stamps, CTAs
without a piece left out, a piece's phases only once all three of its stamps are there; the
planner's phases from its own table, for the CTAs that planned."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import dense_timeline as T  # noqa: E402


def row(pieces, entry, wait, *stamps):
    r = [pieces, entry, wait] + list(stamps)
    return r + [0] * (T.STAMPS - len(r))


def test_phases_of_two_ctas():
    rows = [
        # two pieces: start, pairs end, epilogue end each (ns)
        row(2, 1_000, 3_000, 5_000, 25_000, 27_000, 28_000, 48_000, 49_000),
        # entered 2 us after the first, one piece
        row(1, 3_000, 4_000, 6_000, 46_000, 50_000),
        # an idle part: no pieces, ignored
        row(0, 500, 700),
    ]
    ph = T.phases(rows)
    assert ph["entry"] == [0.0, 2.0]
    assert ph["wait"] == [2.0, 1.0]
    assert ph["first stage"] == [2.0, 2.0]
    assert ph["piece 0, pairs"] == [20.0, 40.0]
    assert ph["piece 0, epilogue"] == [2.0, 4.0]
    assert ph["change 0"] == [1.0]
    assert ph["piece 1, pairs"] == [20.0]
    assert ph["piece 1, epilogue"] == [1.0]
    assert ph["end"] == [48.0, 49.0]


def test_a_piece_missing_a_stamp_ends_the_ctas_phases():
    # More pieces than the table holds stamps for, or a launch cut short: phases stop at the last
    # complete piece, and the CTA's end is that piece's epilogue end.
    ph = T.phases([row(3, 100, 1_000, 2_000, 12_000, 13_000, 14_000, 0, 0)])
    assert ph["first stage"] == [1.0]
    assert ph["piece 0, pairs"] == [10.0]
    assert "piece 1, pairs" not in ph and "change 0" not in ph
    assert ph["end"] == [12.9]


def test_no_cta_with_a_piece():
    assert T.phases([row(0, 5, 6)]) == {}


def test_planner_phases_of_the_ctas_that_planned():
    rows = [row(1, 1_000, 9_000, 10_000, 20_000, 21_000), row(1, 2_000, 9_500, 11_000, 30_000, 31_000),
            row(0, 500, 700)]
    plan_rows = [
        [1_500, 2_500, 3_000, 5_000, 5_500, 8_000],
        [0] * T.PLAN_STAMPS,  # a CTA whose planner row was not written: left out
        [600, 610, 620, 630, 640, 650],  # no piece: left out
    ]
    ph = T.plan_phases(rows, plan_rows)
    assert ph["plan: to the planner"] == [0.5]
    assert [ph[f"plan: {n}"] for n in T.PLAN_PHASES] == [[1.0], [0.5], [2.0], [0.5], [2.5]]
    assert ph["plan: row stored, CTA synchronised"] == [1.0]
    assert len(T.PLAN_PHASES) == T.PLAN_STAMPS - 1
