"""bench/compare_builds.sh on the CPU: each build's wheel is installed on its own and imported by the
runs of that build, the builds take turns round after round, the benchmark's arguments reach it,
and a run that hangs is cut off and reported without stopping the others. Stand-in wheels (an
mla_kernels package naming its build) and a stand-in benchmark (printing what it imported) take
the places of the real ones."""

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "compare_builds.sh")


def stand_in_wheel(directory, build):
    """A wheel of an mla_kernels package whose BUILD is `build`, in `directory`."""
    os.makedirs(directory)
    info = "mla_kernels-0.1.0.dist-info"
    files = {
        "mla_kernels/__init__.py": f"BUILD = {build!r}\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: mla-kernels\nVersion: 0.1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(os.path.join(directory, "mla_kernels-0.1.0-py3-none-any.whl"), "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


BENCH = """import sys, time
import mla_kernels
print("ran", mla_kernels.BUILD, " ".join(sys.argv[1:]), flush=True)
if mla_kernels.BUILD == "hangs":
    time.sleep(60)
"""


def compare(tmp_path, builds, *bench_args, rounds=2, timeout=30):
    bench = tmp_path / "bench.py"
    bench.write_text(BENCH)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), ROUNDS=str(rounds), RUN_TIMEOUT=str(timeout), PYTHON=sys.executable,
               BENCH=str(bench))
    dirs = []
    for build in builds:
        d = tmp_path / "wheels" / build
        stand_in_wheel(str(d), build)
        dirs.append(str(d))
    run = subprocess.run(["bash", SCRIPT, *dirs, "--", *bench_args], env=env, capture_output=True, text=True,
                         timeout=300)
    log = (out / "compare.log").read_text() if (out / "compare.log").exists() else ""
    return run, log


def ran_lines(log):
    return [line for line in log.splitlines() if line.startswith("ran ")]


def test_builds_take_turns_with_their_own_wheel_and_the_arguments(tmp_path):
    run, log = compare(tmp_path, ["a", "b"], "--cases", "x,y", rounds=2)
    assert run.returncode == 0, run.stderr
    assert ran_lines(log) == ["ran a --cases x,y", "ran b --cases x,y"] * 2
    headers = [line for line in log.splitlines() if line.startswith("== ")]
    assert headers == ["== a, round 1", "== b, round 1", "== a, round 2", "== b, round 2"]


def test_a_hanging_run_is_cut_off_and_reported(tmp_path):
    run, log = compare(tmp_path, ["hangs", "b"], rounds=1, timeout=2)
    assert run.returncode == 1
    assert "== hangs, round 1: exit status 124 (timed out)" in log
    assert ran_lines(log) == ["ran hangs ", "ran b "]


@pytest.mark.parametrize("case", ["no builds", "same name", "no wheel"])
def test_bad_invocations_are_refused(tmp_path, case):
    if case == "no builds":
        run = subprocess.run(["bash", SCRIPT], capture_output=True, text=True)
        assert run.returncode == 2 and "usage" in run.stderr
        return
    if case == "same name":
        for parent in ("x", "y"):
            stand_in_wheel(str(tmp_path / parent / "main"), parent)
        run = subprocess.run(["bash", SCRIPT, str(tmp_path / "x" / "main"), str(tmp_path / "y" / "main")],
                             capture_output=True, text=True)
        assert run.returncode == 2 and "distinct directory names" in run.stderr
        return
    (tmp_path / "empty").mkdir()
    run = subprocess.run(["bash", SCRIPT, str(tmp_path / "empty")], capture_output=True, text=True)
    assert run.returncode == 2 and "expected one wheel, found 0" in run.stderr
