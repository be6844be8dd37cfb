"""The host allocator keeps freed large buffers: a forward's big temporaries reuse pages
instead of faulting in fresh ones every step; weights can be put on huge pages. Checked in a
fresh process: the heap of a
suite's process after a thousand tests (threads, arenas, what earlier tests left) says little
about a serving engine's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = """
import resource
import torch
from kdaserve.kernels.host_memory import keep_freed_memory

def faults_of_a_fresh_64mb_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(16 * 2**20).fill_(1.0)  # 64 MB, every page written, then freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

assert keep_freed_memory()  # glibc here
print(*(faults_of_a_fresh_64mb_buffer() for _ in range(16)))
"""


def test_freed_large_buffers_are_reused() -> None:
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    # each 4 KB page of a newly mapped 64 MB buffer faults once (16,384 pages; measured the
    # same on every call without this setting): the reused buffers are already mapped, once
    # the heap has grown to its working size. That takes a few calls, more on a busy machine
    # (idle: from the 2nd; with both cores loaded the first 5-7 faulted, then none), so the
    # last 8 of 16 calls are the ones that must reuse
    faults = [int(f) for f in run.stdout.strip().splitlines()[-1].split()]
    assert all(f < 16384 // 2 for f in faults[8:]), faults


HUGE = """
from pathlib import Path

import torch
from kdaserve.checkpoint import preset_config
from kdaserve.kernels import resolve_kernels
from kdaserve.kernels.host_memory import advise_huge_pages, keep_freed_memory
from kdaserve.models.loader import build_model

def flags_at(address):  # the kernel's VmFlags of the mapping holding address
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]

keep_freed_memory()
t = torch.empty(16 * 2**20)  # 64 MB, not yet written
small = torch.empty(1000)
assert advise_huge_pages(t) and not advise_huge_pages(small)  # no whole 2 MB page in small
t.copy_(torch.arange(t.numel(), dtype=torch.float32))
assert torch.equal(t[::4097], torch.arange(0, t.numel(), 4097, dtype=torch.float32))
# the advice splits off a mapping of t's whole 2 MB pages: asked in their middle
print("buffer", " ".join(flags_at(t.data_ptr() + 32 * 2**20)))
cpu = torch.device("cpu")
for quantization in (None, "int8"):  # a 20 MB lm_head as loaded, 5 MB once quantized
    model = build_model(preset_config("tiny", vocab_size=80000), resolve_kernels(cpu),
                        torch.float32, cpu, None, load_format="dummy",
                        quantization=quantization)
    w = model.lm_head.weight
    print(quantization, " ".join(flags_at(w.data_ptr() + w.numel() * w.element_size() // 2)))
"""


def test_weights_sit_on_huge_pages() -> None:
    """A buffer advised before it is written, and the loader's weights (fp32 as loaded,
    int8 once quantized), have their mappings marked for huge pages (`hg` in the kernel's
    VmFlags: THP in `madvise` mode then backs their 2 MB pages with huge pages as they are
    first written, where free 2 MB pages are there to take, which depends on the host); the
    buffer's values are what was written. Needs a kernel built with THP."""
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("this kernel has no transparent huge pages")
    run = subprocess.run([sys.executable, "-c", HUGE], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    flags = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert {k: "hg" in v.split() for k, v in flags.items()} == \
        {"buffer": True, "None": True, "int8": True}, flags
