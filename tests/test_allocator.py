"""The allocator setting every torch process of fedpriv makes (tasks/allocator.py): a
block of a few MiB, as an evaluation's activations are, comes from the heap and stays
with the process, instead of a fresh ``mmap`` faulted in page by page at every pass."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="not glibc: the allocator is left as it is")

MAPPED = """
import ctypes, json, sys
from tasks.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else None
before = libc.mallinfo2().hblkhd
block = libc.malloc(6 << 20)
print(json.dumps({"tuned": tuned, "mapped": libc.mallinfo2().hblkhd - before}))
libc.free(block)
"""

EVALUATE = """
import json, resource, sys, torch
from tasks.allocator import keep_freed_memory
from tasks.models import small_cnn
from tasks.training import logits_of
torch.set_num_threads(1)
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else None
torch.manual_seed(0)
model = small_cnn((1, 28, 28), 10)
x = torch.randn(1000, 1, 28, 28)
first = logits_of(model, x, 512, torch.device("cpu"))
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logits = logits_of(model, x, 512, torch.device("cpu"))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tuned": tuned, "faults": faults, "same": bool(torch.equal(first, logits)),
                  "sum": float(logits.double().sum())}))
"""


def _child(script: str, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script, mode], cwd=REPO, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_block_of_a_few_mib_comes_from_the_heap_not_a_fresh_mapping():
    # glibc's default maps any block of 128 KiB or more on its own (until a larger one
    # has been freed), and unmaps it at free: the pages are faulted in at every use
    assert _child(MAPPED, "default")["mapped"] >= 6 << 20
    tuned = _child(MAPPED, "tuned")
    assert tuned == {"tuned": True, "mapped": 0}


def test_the_servers_evaluation_keeps_its_pages_and_gives_the_same_logits():
    tuned, default = _child(EVALUATE, "tuned"), _child(EVALUATE, "default")
    assert tuned["tuned"] is True and tuned["same"] and default["same"]
    assert tuned["sum"] == default["sum"]
    # a pass of 1,000 images in batches of 512 touches about 14,000 pages of
    # activations; once the heap has grown they stay with the process (a few hundred
    # faults a pass at most; glibc's default, until its threshold happens to catch up,
    # takes all 14,000 again at every pass)
    assert sum(tuned["faults"][1:]) < 5000, tuned


def test_the_setting_is_made_once_per_process():
    from tasks.allocator import keep_freed_memory

    assert keep_freed_memory() is keep_freed_memory() is True
