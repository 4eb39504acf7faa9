"""What a request handler answers: the ``Reply`` value, Drive v2 JSON error documents, and JSON body parsing."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

JSON_TYPE = "application/json; charset=UTF-8"


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def error_body(status: int, reason: str, message: str, domain: str = "global") -> bytes:
    """A Drive v2 JSON error document, the shape googleapiclient and pydrive2 parse."""
    error = {"errors": [{"domain": domain, "reason": reason, "message": message}], "code": status, "message": message}
    return json.dumps({"error": error}).encode()


def json_reply(obj: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(obj).encode(), {"Content-Type": JSON_TYPE})


def error_reply(status: int, reason: str, message: str) -> Reply:
    return Reply(status, error_body(status, reason, message), {"Content-Type": JSON_TYPE})


class DriveError(Exception):
    """Raised inside request handling to produce a Drive-style JSON error reply."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.reply = error_reply(status, reason, message)


def json_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object; an empty body is ``{}``, anything else unparsable is a 400."""
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except ValueError as e:
        raise DriveError(400, "parseError", f"Parse Error: {e}") from None
    if not isinstance(data, dict):
        raise DriveError(400, "parseError", "Body must be a JSON object")
    return data
