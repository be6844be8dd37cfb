"""Checks of ours for `schemathesis run --checks all` (loaded by SCHEMATHESIS_HOOKS in
test_openapi.py), in place of two built-in ones whose rules this server states differently:

- `documented_acceptance` for `positive_data_acceptance`: a request the schema admits is
  accepted, or refused (400) with one of the messages its route lists under
  `x-kdaserve-refusals` (what a schema cannot say: tokens against the context, weights against
  the model). Any other refusal of a schema-valid request fails.
- `documented_server_errors` for `not_a_server_error`: 5xx only as documented, 503 (engine down)
  or 504 (our request timeout), each an OpenAI error object.

Every status seen is appended to $KDASERVE_STATUS_LOG, so the test can tell the run did call
the server, and answered both ways."""

from __future__ import annotations

import os
import re
from typing import Any

import schemathesis
from schemathesis.core.failures import Failure
from schemathesis.specs.openapi.checks import is_unexpected_http_status_case

ACCEPTED = {401, 403, 404, 409, 429}  # as positive_data_acceptance's defaults, plus 2xx/3xx


class UndocumentedRefusal(Failure):
    def __init__(self, operation: str, status: int, message: str) -> None:
        super().__init__(operation=operation, title="Schema-valid request refused",
                         message=f"[{status}] {message[:400]}")


def _message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - not an error object: the raw text is the message
        return response.text[:400]


@schemathesis.check
def documented_acceptance(ctx: Any, response: Any, case: Any) -> bool | None:
    if case.meta is None or is_unexpected_http_status_case(case) \
            or not case.meta.generation.mode.is_positive:
        return None
    status = response.status_code
    if status < 400 or status in ACCEPTED or status >= 500:  # 5xx: the check below
        return None
    message = _message(response)
    refusals = case.operation.definition.raw.get("x-kdaserve-refusals", [])
    if status == 400 and any(re.search(r["message"], message) for r in refusals):
        return None
    raise UndocumentedRefusal(case.operation.label, status, message)


@schemathesis.check
def documented_server_errors(ctx: Any, response: Any, case: Any) -> bool | None:
    path = os.environ.get("KDASERVE_STATUS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{response.status_code}\n")
    if response.status_code >= 500:
        body = response.json() if "json" in response.headers.get("content-type", "") else None
        assert response.status_code in (503, 504) and body and "error" in body, \
            f"server error {response.status_code}: {response.text[:500]}"
    return None
