"""host_memory.keep_freed_blocks: a batch-sized tensor comes from glibc's heap and its memory stays there when it is
freed (for the next batch to reuse, without faulting its pages in again), where glibc's defaults map it afresh and
unmap it. Read in a child process (the setting is the process's) from glibc's own accounts (mallinfo2)."""

import json
import platform
import subprocess
import sys

import pytest

CHILD = """
import ctypes, json, sys, torch
from mobile_moe.training import host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2

if sys.argv[1] == "kept":
    assert host_memory.keep_freed_blocks(48 << 20)
before = mallinfo2()
batch = torch.empty(48 << 20, dtype=torch.uint8).fill_(1)  # 48 MiB: above glibc's largest automatic mmap threshold
held = mallinfo2()
del batch
freed = mallinfo2()
print(json.dumps({"mapped": held.hblkhd - before.hblkhd, "heap kept": freed.arena - before.arena}))
"""


def accounts(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_a_batch_sized_block_stays_in_the_heap_for_the_next_batch():
    block = 48 << 20
    default, kept = accounts("default"), accounts("kept")
    assert default["mapped"] >= block and default["heap kept"] < block  # mapped, then unmapped: faulted in anew
    assert kept["mapped"] < block and kept["heap kept"] >= block
