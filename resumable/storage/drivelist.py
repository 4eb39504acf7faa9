"""Reading Drive folder listings: every page, and one deterministic answer when a title is there twice.

Drive lists at most ``maxResults`` items per page (often fewer) and hands out a ``nextPageToken`` for the rest;
pydrive2's ``GetList()`` stops after the first page when ``maxResults`` is given, so a folder of more files than
one page (a sharded checkpoint, or any folder when Drive shortens pages) would lose files.

Drive titles are not unique: a retried create whose answer was lost, another client, or a race leaves two files
(or folders) of one title. Every reader and writer must pick the same one, or a writer updates one copy while
readers keep reading the other (a stale ``metrics.jsonl``, a ``lease.json`` that never changes):

* files: the newest ``modifiedDate`` wins (ties: the larger id). That is the copy written last, so it is what a
  writer meant; the writer then deletes the older copies (gdrive.GDriveStore.put_file).
* folders: the oldest ``createdDate`` wins (ties: the smaller id). A folder is created once and then filled, so
  the first one holds the run; a later duplicate (a racing create, a copy made in the web UI) must never move a
  run to an empty folder, which would look like a run with no checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from ..checkpoint import paths

_EPOCH = datetime.min.replace(tzinfo=timezone.utc)


def every_page(drive: Any, query: dict[str, Any]) -> list[Any]:
    """Every item of a files.list query, following each nextPageToken (pydrive2 iterates pages this way)."""
    items: list[Any] = []
    for page in drive.ListFile(dict(query)):
        items.extend(page)
    return items


def _when(item: Any, key: str) -> datetime:
    """An RFC 3339 date of a listed item; a missing or malformed one sorts as the oldest possible."""
    text = item.get(key)
    try:
        when = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return _EPOCH
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def newest_key(item: Any) -> tuple[datetime, str]:
    """Sort key of a file: the last one in this order is the one read and written."""
    return _when(item, "modifiedDate"), str(item.get("id", ""))


def newest(items: Iterable[Any]) -> Any | None:
    """The file of a title that readers read and writers update (see the module docstring); None for none."""
    return max(items, key=newest_key, default=None)


def oldest_folder(items: list[Any], where: str) -> Any | None:
    """The folder of a title a run lives in (see the module docstring); warns once when there are several."""
    if not items:
        return None
    chosen = min(items, key=lambda f: (_when(f, "createdDate"), str(f.get("id", ""))))
    if len(items) > 1:
        paths.warn_once(f"drive-dup-folder:{chosen.get('id')}",
                        f"{len(items)} folders are named {chosen.get('title')!r} in {where}; using the oldest "
                        f"(id {chosen.get('id')}, created {chosen.get('createdDate')}). Move or delete the others "
                        f"in Drive if they hold anything you need")
    return chosen
