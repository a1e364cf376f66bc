"""Per-CTA timelines of a dense decode kernel: where each CTA's time goes between its entry, the
dependency wait, and the start, pairs and epilogue of each piece. Needs a build that stamps them:
ours with MLA_DENSE_TIMELINE=1 (src/cuda/sm90/dense_decode.cu; e.g. `pip wheel . -C
cmake.define.CMAKE_CUDA_FLAGS=-DMLA_DENSE_TIMELINE=1`), or a FlashMLA copy given the same table and
`mla_kernels_dense_timeline` function (built outside this repository) with --flashmla DIR:

    python3 bench/dense_timeline.py dense_b128_h128_sk512 --reuse-plan [--flashmla DIR]

Each call runs the case `--calls` times (the stamps are the last launch's) and prints, over the
CTAs that ran a piece, the median and the 10th / 90th percentiles of each phase, in µs:
- entry: a CTA's entry after the launch's first;
- wait: from entry past the dependency wait (and the plan, with a fresh one);
- first stage: from there to the start of the first piece (its Q and first blocks staged, in ours;
  FlashMLA waits for its Q inside the piece);
- piece k, pairs: from the piece's start to the end of its pairs;
- piece k, epilogue: from the end of its pairs to the end of its epilogue;
- change k: from the end of piece k's epilogue to the start of piece k + 1;
- end: a CTA's last epilogue end after the launch's first entry.
With a fresh plan our build also stamps the in-kernel planner's phases (plan_block.cuh), printed
as "plan: ...": from the dependency wait to the planner, then each phase to its end, then the row
stored and the CTA synchronised (the main table's stamp [2])."""

import argparse
import ctypes
import glob
import os
import statistics
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as B  # noqa: E402

# A row of the table: [0] pieces, [1] entry, [2] past the wait, then (start, pairs end, epilogue end)
# per piece; kTimelineStamps in src/cuda/sm90/dense_decode.cu.
STAMPS = 21
MAX_PIECES = (STAMPS - 3) // 3
# The planner's table: the end of each phase of BlockPlanner::plan_line (plan_block.cuh's numbers).
PLAN_STAMPS = 6
PLAN_PHASES = ["costs summed", "part costs cleared", "part costs added", "widths ruled out", "rows made"]


def table(library, rows=2048, name="mla_kernels_dense_timeline", width=STAMPS):
    """The last launch's table from `library`'s export `name` (rows of `width` stamps), or None
    when the library has no such export."""
    lib = ctypes.CDLL(library)
    if not hasattr(lib, name):
        return None
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
    fn.restype = ctypes.c_int
    buf = (ctypes.c_ulonglong * (rows * width))()
    n = fn(buf, rows)
    if n < 0:
        raise SystemExit(f"{library}: {name} failed")
    return [list(buf[r * width:(r + 1) * width]) for r in range(n)]


def plan_phases(rows, plan_rows):
    """Planner phase name -> µs per CTA, over the CTAs that ran a piece and planned (every stamp of
    their planner row set); rows and plan_rows are the same launch's tables."""
    out = {}
    for r, pr in zip(rows, plan_rows):
        if r[0] <= 0 or not r[1] or not r[2] or not all(pr):
            continue
        us = lambda a, b: (b - a) / 1000.0  # noqa: E731
        out.setdefault("plan: to the planner", []).append(us(r[1], pr[0]))
        for k, name in enumerate(PLAN_PHASES):
            out.setdefault(f"plan: {name}", []).append(us(pr[k], pr[k + 1]))
        out.setdefault("plan: row stored, CTA synchronised", []).append(us(pr[-1], r[2]))
    return out


def phases(rows):
    """Phase name -> µs per CTA, over the CTAs that ran at least one piece."""
    live = [r for r in rows if r[0] > 0 and r[1] > 0]
    if not live:
        return {}
    t0 = min(r[1] for r in live)
    out = {"entry": [], "wait": [], "first stage": [], "end": []}
    for r in live:
        us = lambda a, b: (r[b] - r[a]) / 1000.0  # noqa: E731
        out["entry"].append((r[1] - t0) / 1000.0)
        out["wait"].append(us(1, 2))
        last = 2
        for k in range(min(int(r[0]), MAX_PIECES)):
            start, pairs, epi = 3 + 3 * k, 4 + 3 * k, 5 + 3 * k
            if not (r[start] and r[pairs] and r[epi]):
                break
            if k == 0:
                out["first stage"].append(us(2, start))
            out.setdefault(f"piece {k}, pairs", []).append(us(start, pairs))
            out.setdefault(f"piece {k}, epilogue", []).append(us(pairs, epi))
            if k > 0:
                out.setdefault(f"change {k - 1}", []).append(us(last, start))
            last = epi
        out["end"].append((r[last] - t0) / 1000.0)
    return out


def summary(name, rows, plan_rows=None):
    ph = phases(rows)
    if plan_rows:
        ph.update(plan_phases(rows, plan_rows))
    print(f"# {name}: {sum(1 for r in rows if r[0] > 0)} CTAs with pieces of {len(rows)}")
    for key, vals in ph.items():
        if not vals:
            continue
        vals = sorted(vals)
        q = lambda f: vals[min(len(vals) - 1, int(f * len(vals)))]  # noqa: E731
        print(f"{key:22s} median {statistics.median(vals):8.2f}   p10 {q(0.1):8.2f}   p90 {q(0.9):8.2f}   (n={len(vals)})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", help="a bench_decode dense case name (or dense_b<b>[_sq<s_q>]_h<h>_sk<s_k>...)")
    parser.add_argument("--flashmla", metavar="DIR", help="FlashMLA's package (with the stamping table) in DIR")
    parser.add_argument("--reuse-plan", action="store_true", help="plan once, then time calls on that plan")
    parser.add_argument("--calls", type=int, default=3, help="calls run; the stamps are the last one's")
    args = parser.parse_args()
    B.REUSE_PLAN = args.reuse_plan
    api = B.load_flashmla(args.flashmla) if args.flashmla else B.flash_mla
    torch.manual_seed(zlib.crc32(args.case.encode()))
    call, _, _, _ = B.case_by_name(args.case)(api=api)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    if args.flashmla:
        libs = glob.glob(os.path.join(args.flashmla, "flash_mla", "cuda*.so"))
    else:
        import mla_kernels
        libs = glob.glob(os.path.join(os.path.dirname(mla_kernels.__file__), "libmla_kernels_ops*.so"))
    if not libs:
        raise SystemExit("no library found")
    rows = table(libs[0])
    if rows is None:
        raise SystemExit(f"{libs[0]} has no timeline: build it with MLA_DENSE_TIMELINE=1")
    plan_rows = None if args.reuse_plan else table(libs[0], name="mla_kernels_dense_plan_timeline", width=PLAN_STAMPS)
    summary(("FlashMLA " if args.flashmla else "ours ") + args.case + (" reused" if args.reuse_plan else ""),
            rows, plan_rows)


if __name__ == "__main__":
    main()
