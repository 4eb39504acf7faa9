"""The ``q`` parameter of files.list: parsing the supported subset of Drive v2 query syntax, and matching it."""

from __future__ import annotations

import re
from collections.abc import Callable

from .replies import DriveError
from .store import StoredFile

_STR = r"'((?:[^'\\]|\\.)*)'"
_CLAUSES = [
    ("parent", re.compile(_STR + r"\s+in\s+parents", re.I)),
    ("trashed", re.compile(r"trashed\s*(=|!=)\s*(true|false)", re.I)),
    ("field", re.compile(r"(title|mimeType)\s*(=|!=|contains)\s*" + _STR)),
]
_AND = re.compile(r"\s+and\s+", re.I)


def parse_query(q: str) -> list[tuple[str, ...]]:
    """Split a Drive v2 ``q`` into clauses; unsupported syntax is a 400, so tests never silently match everything."""
    clauses: list[tuple[str, ...]] = []
    pos, q = 0, q.strip()
    while pos < len(q):
        for kind, pattern in _CLAUSES:
            m = pattern.match(q, pos)
            if m:
                groups = tuple(re.sub(r"\\(.)", r"\1", g) if g is not None else "" for g in m.groups())
                clauses.append((kind, *groups))
                pos = m.end()
                break
        else:
            raise DriveError(400, "invalid", f"Invalid query (fake supports a subset): {q[pos:]!r}")
        sep = _AND.match(q, pos)
        if sep:
            pos = sep.end()
        elif pos < len(q):
            raise DriveError(400, "invalid", f"Invalid query near: {q[pos:]!r}")
    return clauses


def matches(f: StoredFile, clauses: list[tuple[str, ...]], resolve: Callable[[str], StoredFile]) -> bool:
    """Whether ``f`` satisfies every clause; ``resolve`` maps a parent id (or the alias 'root') to its file."""
    for kind, *args in clauses:
        if kind == "parent":
            if resolve(args[0]).id not in f.parents:
                return False
        elif kind == "trashed":
            op, value = args
            if (f.trashed == (value.lower() == "true")) != (op == "="):
                return False
        else:
            name, op, value = args
            actual = f.title if name == "title" else f.mime_type
            ok = value in actual if op == "contains" else actual == value
            if ok != (op != "!="):
                return False
    return True
