"""Schemathesis over the server's own OpenAPI document: generated requests for every operation
(valid and not), against a real server whose context is small (so any generated request is
cheap) and whose requests time out. The document must be the truth: no server error (5xx
other than the documented 503/504 ones), every status documented, every JSON body matching
its documented schema, every media type documented."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ServerProc, start_server, stop_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)


@pytest.fixture(scope="module")
def fuzzed(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tiny_ckpt, tmp_path_factory.mktemp("openapi-logs"),
                     "--context-length", "48", "--request-timeout", "20",
                     "--max-total-tokens", "4096")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def api_schema(fuzzed: ServerProc):  # noqa: ANN201 - a schemathesis schema
    return schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")


STATUSES: dict[int, int] = {}  # of every response seen: the run did call the server


def not_a_server_error(ctx, response, case) -> None:  # noqa: ANN001
    """5xx only as documented: 503 (engine down), 504 (our own request timeout), each as an
    OpenAI error object; anything else fails."""
    STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
    body = response.json() if "json" in response.headers.get("content-type", "") else None
    if response.status_code >= 500:
        assert response.status_code in (503, 504) and body and "error" in body, \
            f"server error {response.status_code}: {response.text[:500]}"


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def test_openapi_document_is_the_truth(api_schema) -> None:  # noqa: ANN001
    failures: list[str] = []
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert len(operations) >= 16, [op.label for op in operations]
    # these change how the server serves (pause, sleep, a rendezvous that waits for a
    # trainer): fuzzed, they would stall every later case; tests/server/test_rl_server.py
    # drives them instead
    stateful = {"/pause_generation", "/continue_generation", "/release_memory_occupation",
                "/resume_memory_occupation", "/init_weights_update_group"}
    for op in operations:
        if op.path in stateful:
            continue
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:  # noqa: ANN001
            case.call_and_validate(checks=CHECKS)

        try:
            run()
        except Exception as e:  # noqa: BLE001 - collected: every operation gets its run
            failures.append(f"{op.label}: {str(e)[:600]}")
    assert not failures, "\n\n".join(failures)
    assert sum(STATUSES.values()) >= 3 * len(operations), STATUSES
    assert STATUSES.get(200, 0) > 0 and STATUSES.get(400, 0) > 0, STATUSES
    print(f"schemathesis: {sum(STATUSES.values())} requests, statuses {STATUSES}")
