"""Stored responses of /v1/responses: what `previous_response_id` continues, and what
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}` and `GET .../input_items` read.

A stored response keeps the Response object as it was returned, its input context as
Responses items (the items and outputs of the responses it continues, then its own input, as
OpenAI lists them) and the same conversation as chat messages for the next turn. The store is
in memory and bounded, oldest dropped first; `store: false` responses never enter it.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kdaserve.server.protocol import error_body

STORE_SIZE = 1024
MAX_PAGE = 100  # OpenAI's largest `limit`


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as returned
    items: list[dict[str, Any]]  # its input context as Responses items, oldest first
    messages: list[dict[str, Any]]  # the conversation as chat messages, with its output


class ResponseStore:
    """response id -> StoredResponse (bounded, oldest dropped)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size, self.items = size, OrderedDict[str, StoredResponse]()

    def find(self, rid: str) -> StoredResponse | None:
        return self.items.get(rid)

    def previous(self, rid: str) -> StoredResponse:
        """The response a `previous_response_id` names; a ValueError (400) when absent."""
        stored = self.items.get(rid)
        if stored is None:
            raise ValueError(f"previous_response_id {rid!r} is not stored here ({WHY_ABSENT}: "
                             f"the store keeps the last {self.size})")
        return stored

    def put(self, rid: str, stored: StoredResponse) -> None:
        self.items[rid] = stored
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def delete(self, rid: str) -> bool:
        return self.items.pop(rid, None) is not None


WHY_ABSENT = "unknown, stored with store: false, deleted, or dropped"


def _texts(content: Any) -> list[str]:
    """The texts of a message's content (already checked by `to_messages`)."""
    if isinstance(content, str):
        return [content]
    return [p.get("text", "") for p in content or [] if isinstance(p, dict)]


def _parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as parts (already checked by `to_messages`)."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    return [p for p in content or [] if isinstance(p, dict)]


def _input_part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") == "input_image":
        return {"type": "input_image", "image_url": part["image_url"],
                "detail": part.get("detail") or "auto"}
    return {"type": "input_text", "text": part.get("text", "")}


def _id(item: dict[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else f"{prefix}_{uuid.uuid4().hex}"


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as the items OpenAI lists: every item with an id and a status,
    message text as input_text parts (output_text for the assistant's), after `to_messages`
    has checked it."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            if role == "assistant":
                parts = [{"type": "output_text", "text": t, "annotations": []}
                         for t in _texts(item.get("content"))]
            else:
                parts = [_input_part(p) for p in _parts(item.get("content"))]
            out.append({"id": _id(item, "msg"), "type": "message", "role": role,
                        "content": parts, "status": "completed"})
        elif kind == "function_call":
            out.append({"id": _id(item, "fc"), "type": "function_call",
                        "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"id": _id(item, "fco"), "type": "function_call_output",
                        "call_id": item["call_id"],
                        "output": output if isinstance(output, str) else "".join(_texts(output)),
                        "status": "completed"})
        else:  # reasoning
            item_out: dict[str, Any] = {
                "id": _id(item, "rs"), "type": "reasoning",
                "summary": [{"type": "summary_text", "text": t}
                            for t in _texts(item.get("summary"))]}
            if item.get("content"):
                item_out["content"] = [{"type": "reasoning_text", "text": t}
                                       for t in _texts(item["content"])]
            out.append(item_out)
    return out


def not_found(rid: str) -> JSONResponse:
    return JSONResponse(error_body(f"response {rid!r} is not stored here ({WHY_ABSENT})", 404,
                                   "response_id"), status_code=404)


def _find(store: ResponseStore | None, rid: str) -> StoredResponse | None:
    return None if store is None else store.find(rid)


def unknown_query(request: Request, documented: set[str]) -> JSONResponse | None:
    """A 400 naming the query parameters a GET route does not document (FastAPI drops them
    unread): OpenAI's stream, starting_after and include ask for a replay or extra data that
    stored responses here do not have."""
    unknown = sorted(set(request.query_params) - documented)
    if not unknown:
        return None
    return JSONResponse(error_body(
        f"query parameter(s) {', '.join(unknown)} not supported here (stored responses are "
        "complete: no stream replay, nothing extra to include)", 400, unknown[0]),
        status_code=400)


def retrieve(store: ResponseStore | None, rid: str) -> Response:
    stored = _find(store, rid)
    return not_found(rid) if stored is None else JSONResponse(stored.response)


def delete(store: ResponseStore | None, rid: str) -> Response:
    if store is None or not store.delete(rid):
        return not_found(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


def list_input_items(store: ResponseStore | None, rid: str, limit: int = 20,
                     order: Literal["asc", "desc"] = "desc", after: str | None = None
                     ) -> Response:
    """OpenAI's cursor page: `limit` items after the item `after`, newest first by default."""
    stored = _find(store, rid)
    if stored is None:
        return not_found(rid)
    items = stored.items if order == "asc" else stored.items[::-1]
    start = 0
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            return JSONResponse(error_body(f"after {after!r} is no input item of {rid!r}", 400,
                                           "after"), status_code=400)
        start = ids.index(after) + 1
    page = items[start:start + limit]
    # an empty page has no first or last item: null, as OpenAI's other list endpoints say
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": start + limit < len(items)})
