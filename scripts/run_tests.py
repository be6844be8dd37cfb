"""`make test`: the whole suite at this host's instruction-set level, then the tests whose code
depends on the level (the native kernels, the one-call decode forward, weight-only bf16 and int8
models) again at every lower level the host supports (KDASERVE_ISA, kernels/native/isa.py), so
that one machine checks the code of every CPU kind below it, and with the BF16 dots switched the
other way where the host has them. Prints each run's time and a total.

    python scripts/run_tests.py [pytest args...]   # extra args go to every run
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdaserve.kernels.native import isa  # noqa: E402

# what runs again at each lower level: everything whose result may depend on the level
LEVEL_TESTS = ["tests/kernels", "tests/model/test_native_decode.py", "tests/model/test_int8.py",
               "tests/model/test_weight_only_bf16.py"]
# these never reach the native kernels (CUDA, or Triton's interpreter)
LEVEL_IGNORE = ["tests/kernels/test_triton.py", "tests/kernels/test_triton_interpreted.py"]
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?)\b")


def run(label: str, args: list[str], env: dict[str, str]) -> tuple[int, dict[str, int], float]:
    print(f"\n=== {label}: pytest {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if line.strip():
            last = line
    rc = proc.wait()
    took = time.monotonic() - t0
    counts = {m.group(2).rstrip("s") if m.group(2).startswith("error") else m.group(2):
              int(m.group(1)) for m in COUNT.finditer(last)}
    print(f"=== {label}: exit {rc} in {took:.0f} s", flush=True)
    return rc, counts, took


def main() -> int:
    extra = sys.argv[1:]
    env = dict(os.environ)
    top = isa.level()  # the host's, or KDASERVE_ISA's cap
    levels = isa.supported()
    below = [lv for lv in reversed(levels) if top is not None
             and isa.LEVELS.index(lv) < isa.LEVELS.index(top)]
    print(f"instruction-set levels: this host {levels[-1] if levels else 'below avx2'}; "
          f"whole suite at {top or 'native'}, kernel tests again at {', '.join(below) or 'none'}",
          flush=True)
    t0 = time.monotonic()
    results = [run(f"all tests at {top or 'native'}", ["tests", *extra], env)]
    ignore = [f"--ignore={p}" for p in LEVEL_IGNORE]
    for lv in below:
        results.append(run(f"level tests at {lv}", [*LEVEL_TESTS, *ignore, *extra],
                           {**env, isa.ENV: lv}))
    if top is not None and isa.LEVELS.index(top) >= isa.LEVELS.index("avx512_bf16"):
        # the BF16 dots are on by default on AMD only (isa.bf16_dots): the other way too
        flip = "0" if isa.bf16_dots() else "1"
        results.append(run(f"level tests at {top} with {isa.BF16_DOTS_ENV}={flip}",
                           [*LEVEL_TESTS, *ignore, *extra], {**env, isa.BF16_DOTS_ENV: flip}))
    total = {k: sum(r[1].get(k, 0) for r in results) for k in ("passed", "failed", "skipped",
                                                                  "error")}
    failed = total["failed"] + total["error"]
    rc = next((r[0] for r in results if r[0] != 0), 0)
    print(f"\nmake test took {time.monotonic() - t0:.0f} s "
          f"({', '.join(f'{r[2]:.0f} s' for r in results)})")
    print(f"total: {total['passed']} passed, {failed} failed, {total['skipped']} skipped")
    return rc


if __name__ == "__main__":
    sys.exit(main())
