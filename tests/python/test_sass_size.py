"""bench/sass_size.py: each kernel's code size read from cuobjdump's SASS listing."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import sass_size as S  # noqa: E402


def listing(name, addresses):
    """A cuobjdump -sass section: an instruction line per address, each with its encoding lines."""
    lines = [f"\t\tFunction : {name}", "\t.headerflags\t@\"EF_CUDA_SM90\""]
    for address in addresses:
        lines.append(f"        /*{address:04x}*/                   FFMA R1, R1, R2, R3 ;   /* 0x000000000000 */")
        lines.append("                                                                   /* 0x000fe20000000000 */")
    return "\n".join(lines)


def test_each_kernel_ends_after_its_last_instruction():
    text = "\n".join(["Fatbin elf code:", listing("_Z3bigv", range(0, 0x2ff0 + 1, 16)),
                      listing("_Z5smallv", [0x0, 0x10, 0x20])])
    assert S.parse(text) == {"_Z3bigv": 0x3000, "_Z5smallv": 0x30}


def test_the_encoding_lines_are_not_instructions():
    # Five-digit addresses count; the encoding comments that follow each instruction do not.
    assert S.parse(listing("_Z1kv", [0x10, 0x1fff0])) == {"_Z1kv": 0x20000}


def test_a_listing_without_functions_has_no_kernels():
    assert S.parse("nothing here\n/*0000*/ NOP ;") == {}
