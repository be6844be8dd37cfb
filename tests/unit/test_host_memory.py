"""The host allocator keeps freed large buffers: a forward's big temporaries reuse pages
instead of faulting in fresh ones every step; weights can be put on huge pages. Checked in a
fresh process: the heap of a
suite's process after a thousand tests (threads, arenas, what earlier tests left) says little
about a serving engine's."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import resource
import torch
from kdaserve.kernels.host_memory import keep_freed_memory

def faults_of_a_fresh_64mb_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 * 2**20).fill_(1.0)  # 64 MB, every page written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

assert keep_freed_memory()  # glibc here
for _ in range(4):  # the heap grows to its working size
    faults_of_a_fresh_64mb_buffer()
print(sum(faults_of_a_fresh_64mb_buffer() for _ in range(8)))
"""


def test_freed_large_buffers_are_reused() -> None:
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    # each 4 KB page of a newly mapped 64 MB buffer faults once (16,384 pages; measured the
    # same on every call without this setting): the reused buffers are already mapped
    assert int(run.stdout.split()[-1]) < 16384


HUGE = """
from pathlib import Path

import torch
from kdaserve.kernels.host_memory import advise_huge_pages, keep_freed_memory

keep_freed_memory()
t = torch.empty(16 * 2**20)  # 64 MB, not yet written
small = torch.empty(1000)
assert advise_huge_pages(t) and not advise_huge_pages(small)  # no whole 2 MB page in small
t.copy_(torch.arange(t.numel(), dtype=torch.float32))
assert torch.equal(t[::4097], torch.arange(0, t.numel(), 4097, dtype=torch.float32))
middle = t.data_ptr() + 32 * 2**20  # the advice splits off a mapping of t's whole 2 MB pages
flags, inside = "", False
for line in Path("/proc/self/smaps").read_text().splitlines():
    if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
        lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
        inside = lo <= middle < hi
    elif inside and line.startswith("VmFlags:"):
        flags = line.split()[1:]
print(" ".join(flags))
"""


def test_weights_can_sit_on_huge_pages() -> None:
    """A buffer advised before it is written has its mapping marked for huge pages (`hg` in
    the kernel's VmFlags: THP in `madvise` mode then backs its 2 MB pages with huge pages as
    they are first written, where free 2 MB pages are there to take, which depends on the
    host), and its values are what was written."""
    run = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "hg" in run.stdout.split()
