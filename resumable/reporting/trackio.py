"""trackio: the records of ``metrics.jsonl`` in ONE trackio run across every session (extra ``trackio``).

trackio resumes a run by its name: the name is recorded in each checkpoint's manifest (``trackio_run``), and each
session that resumes calls ``trackio.init(project, name=..., resume="allow")``. The store is trackio's local
SQLite database, ``TRACKIO_DIR/<project>.db``: ``TRACKIO_DIR`` when set, else ``RUN_DIR/trackio`` (offline, and
on Drive when the run dir is). trackio reads ``TRACKIO_DIR`` once, when it is imported: when trackio was imported
before the run (a notebook that imported it), its own folder is used and said.

Each step once: trackio writes a ``log()`` call as one row of its ``metrics`` table, from a background thread,
so a killed session leaves the rows it had written (whole: SQLite transactions), maybe past the resumed step.
At each session start the run's rows after the resumed step are deleted (one SQL ``DELETE`` under trackio's own
process lock: trackio has no API for it, only ``delete_run``); then
:class:`~resumable.reporting.tracking.StoreReporter` sends the steps up to it that trackio lacks from
``metrics.jsonl``, and each later step as one row (its training and evaluation records together).
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import string
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import log
from .tracking import require, stored_name

TRACKIO_ID = "trackio_run"  # the manifest key: the run's name, by which trackio resumes it
_KIND = "trackio"


def require_trackio() -> None:
    require("trackio", "trackio", "trackio tracking (--trackio / tracker='trackio')")


def choose_name(manifest: Mapping[str, Any] | None, run_dir: Path) -> str:
    """The checkpoint's trackio run name, or a new one: the run dir's name and a random suffix (unique in a
    project that several runs share)."""
    stored = stored_name(manifest, TRACKIO_ID, _KIND)
    if stored is not None:
        return stored
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(run_dir).name)[:40] or "run"
    return f"{stem}-" + "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(6))


class TrackioStore:
    """One trackio run (see the module docstring)."""

    name = _KIND
    key = TRACKIO_ID
    unsent = frozenset({"time"})  # a reserved key of trackio's, which stamps each row with its own time

    def __init__(self, run_name: str, project: str | None, run_dir: Path,
                 config: Mapping[str, Any] | None = None) -> None:
        self.ident, self.run_dir = run_name, Path(run_dir)
        self.project = project or os.environ.get("TRACKIO_PROJECT") or "resumable"
        self.config = dict(config or {})
        self._run: Any = None

    def open(self) -> None:
        if "trackio" not in sys.modules:
            os.environ.setdefault("TRACKIO_DIR", str((self.run_dir / "trackio").absolute()))
        import trackio
        from trackio.utils import TRACKIO_DIR

        wanted = os.environ.get("TRACKIO_DIR")
        if wanted and Path(wanted).absolute() != Path(TRACKIO_DIR).absolute():
            log.warning(f"trackio was imported before TRACKIO_DIR={wanted} was set: it logs to {TRACKIO_DIR}")
        self._run = trackio.init(project=self.project, name=self.ident, resume="allow", config=self.config,
                                 embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def _db(self) -> tuple[Path, Any]:
        from trackio.sqlite_storage import SQLiteStorage

        return SQLiteStorage.get_project_db_path(self.project), SQLiteStorage

    def truncate(self, after: int) -> bool:
        path, storage = self._db()
        if not path.exists():
            return True
        with storage._get_process_lock(self.project):  # trackio's own cross-process lock of this database
            conn = sqlite3.connect(path, timeout=30)
            try:
                with conn:
                    conn.execute("DELETE FROM metrics WHERE run_name = ? AND step > ?", (self.ident, after))
            except sqlite3.OperationalError as e:
                if "no such table" not in str(e):
                    raise
            finally:
                conn.close()
        return True

    def history(self) -> dict[int, dict[str, Any]]:
        _, storage = self._db()
        rows: dict[int, dict[str, Any]] = {}
        for row in storage.get_logs(self.project, self.ident, run_id=getattr(self._run, "id", None)):
            step = row.get("step")
            if isinstance(step, int):  # trackio stores a reserved key (time, step...) or a "__" one as "__" + key
                rows.setdefault(step, {}).update({k[2:] if k.startswith("__") else k: v for k, v in row.items()
                                                  if k not in ("step", "timestamp")})
        return rows

    def log(self, step: int, row: dict[str, float | int]) -> None:
        self._run.log(row, step=step)

    def close(self, ended: str) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()  # waits for trackio's background writer: this session's rows are in the database
