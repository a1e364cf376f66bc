"""Code size of each kernel in a compiled object, shared library or executable, from its SASS:

    python3 bench/sass_size.py /work/wbuild/<name>/CMakeFiles/.../dense_decode.cu.o [--filter NAME]

Prints each kernel's bytes (the end of its last instruction) and instruction count. A warm call
runs each piece's code again from the instruction caches, so this is the number to watch when a
change adds code (bench/RESULTS.md, twenty-seventh session: the dense kernel's 229 KB against
FlashMLA's 117 KB). It reads SASS with cuobjdump: $CUOBJDUMP, else cuobjdump on PATH or in the
CUDA toolkit (the triton wheel bundles one where the toolkit has none).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"^\s*Function : (\S+)")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+\S")


def parse(sass):
    """{kernel: bytes} from cuobjdump -sass text: each function's last instruction address + 16."""
    kernels, name = {}, None
    for line in sass.splitlines():
        m = FUNCTION.match(line)
        if m:
            name = m.group(1)
            kernels[name] = 0
            continue
        m = INSTRUCTION.match(line)
        if m and name is not None:
            kernels[name] = max(kernels[name], int(m.group(1), 16) + 16)
    return kernels


def cuobjdump():
    path = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not path:
        candidate = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")
        path = candidate if os.path.exists(candidate) else None
    if not path:
        raise SystemExit("cuobjdump not found: set CUOBJDUMP")
    return path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file", help="an object, shared library or executable with device code")
    parser.add_argument("--filter", default="", help="only kernels whose mangled name contains this")
    args = parser.parse_args()
    sass = subprocess.run([cuobjdump(), "-sass", args.file], check=True, capture_output=True, text=True).stdout
    kernels = parse(sass)
    if not kernels:
        raise SystemExit(f"{args.file}: no SASS found")
    for name, size in sorted(kernels.items()):
        if args.filter in name:
            print(f"{size / 1024:8.1f} KB {size // 16:7d} instructions  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
