"""`schemathesis run --checks all` over the server's own OpenAPI document, against a real
server whose context is small (so any generated request is cheap) and whose requests time
out. Every phase (examples, coverage, fuzzing, stateful), valid and invalid requests. The
document must be the truth:

- a request the schema refuses is refused (negative_data_rejection);
- a request the schema admits is accepted, or refused with one of the messages its route
  lists under `x-kdaserve-refusals` (schemathesis_checks.documented_acceptance, in place of
  positive_data_acceptance: a schema cannot say how many tokens a text is);
- no server error but the documented 503 / 504 (documented_server_errors);
- every status, header, media type and body as documented.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ServerProc, start_server, stop_server

pytest.importorskip("schemathesis")

# these change how the server serves (pause, sleep, a rendezvous that waits for a trainer):
# fuzzed, they would stall every later case; tests/server/test_rl_server.py drives them
STATEFUL = ("/pause_generation", "/continue_generation", "/release_memory_occupation",
            "/resume_memory_occupation", "/init_weights_update_group")


@pytest.fixture(scope="module")
def fuzzed(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("openapi-logs"),
                     "--context-length", "48", "--request-timeout", "20",
                     "--max-total-tokens", "4096")
    yield s
    stop_server(s)


def test_openapi_document_is_the_truth(fuzzed: ServerProc, tmp_path: Path) -> None:
    statuses = tmp_path / "statuses"
    cli = Path(sys.executable).with_name("schemathesis")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent),
           "SCHEMATHESIS_HOOKS": "schemathesis_checks", "KDASERVE_STATUS_LOG": str(statuses)}
    out = subprocess.run(
        [str(cli), "run", f"{fuzzed.url}/openapi.json", "--checks", "all",
         "--exclude-checks", "positive_data_acceptance,not_a_server_error",
         "--max-examples", "40", "--seed", "7", "--no-color",
         *(a for path in STATEFUL for a in ("--exclude-path", path))],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-12000:]
    tested = re.search(r"Tested: (\d+)", report)
    assert tested and int(tested.group(1)) >= 20, report[-3000:]
    seen = Counter(int(line) for line in statuses.read_text().split())
    # the run did call the server, and it answered both ways
    assert sum(seen.values()) >= 1000 and seen[200] > 0 and seen[400] > 0, seen
    print(f"schemathesis: {sum(seen.values())} requests, statuses {dict(seen)}")
