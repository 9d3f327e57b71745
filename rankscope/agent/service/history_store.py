"""Every window of every job kept on the node in SQLite (history.py reads it): step time, baseline, and the
findings with their evidence as JSON, so that a restarted agent or cluster analyzer serves what it had and
the page's chart spans hours.

Writes go through a queue to one writer thread: a window never waits for the disk, a full queue drops the
window with one log line. The database is in WAL mode with one transaction per window, so a process killed
with SIGKILL loses at most the window being written. Kept bounded by age and by size: windows older than
`max_age_s` are deleted, and the oldest go while the live pages exceed `max_bytes` (incremental vacuum gives
the freed pages back to the file system). A directory that cannot be written, a full disk or a corrupt file
is one log line; the service goes on from memory (history.py)."""
from __future__ import annotations

import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rankscope.agent.service.history import Episodes, JobHistory, StepPoint, Window, thin

log = logging.getLogger(__name__)

ENV = "RANKSCOPE_HISTORY_DIR"  # the default of --history-dir; "off" (or empty) keeps nothing on disk
DEFAULT_DIR = "/var/cache/rankscope/history"  # beside the BPF cache, on the DaemonSet's hostPath
DEFAULT_MAX_AGE_S = 7 * 86400.0
DEFAULT_MAX_BYTES = 200 * 1024 * 1024
QUEUE_WINDOWS = 1024  # batches waiting for the writer (one batch a window): ~85 min of 5 s windows
PRUNE_EVERY = 60  # batches between two pruning passes (5 min of 5 s windows)
PRUNE_SHARE = 0.1  # of the rows, deleted at a time while the file is over its size
BUSY_TIMEOUT_MS = 5000

SCHEMA = """
CREATE TABLE IF NOT EXISTS windows (
    job TEXT NOT NULL,
    end_s REAL NOT NULL,            -- unix s of the window's end
    step_time_s REAL,               -- NULL: no step completed (a hang)
    baseline_s REAL,
    keys TEXT NOT NULL,             -- JSON [[kind, [ranks]], ...] of the window's findings, for episodes
    findings TEXT NOT NULL,         -- JSON list of the findings as the diagnosis document has them
    PRIMARY KEY (job, end_s)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS windows_end ON windows (end_s);
"""


def default_dir() -> str | None:
    """The history directory unless --history-dir says otherwise: $RANKSCOPE_HISTORY_DIR, "off" for none."""
    chosen = os.environ.get(ENV, DEFAULT_DIR)
    return None if chosen in ("", "off") else chosen


class HistoryStore:
    """One SQLite file, `directory/NAME.db`, written by a thread of its own; read by any thread (each read
    opens its own connection: WAL readers do not wait for the writer)."""

    def __init__(self, directory: str, name: str, max_age_s: float = DEFAULT_MAX_AGE_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, clock: Callable[[], float] = time.time):
        self.path = Path(directory) / f"{name}.db"
        self.max_age_s, self.max_bytes, self.clock = max_age_s, max_bytes, clock
        self.ok = False  # opened; reads fall back to memory otherwise
        self._failing = False  # the last write failed: said once until one succeeds
        self._queue: queue.Queue[list[Window] | None] = queue.Queue(QUEUE_WINDOWS)
        self._dropped = False
        self._batches = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = self._open()
        except (OSError, sqlite3.Error) as e:
            log.warning("history directory %s cannot be used (%s): history is kept in memory only", directory,
                        _reason(e))
            return
        self.ok = True
        self._thread = threading.Thread(target=self._write_loop, name="history-writer", daemon=True)
        self._thread.start()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False,
                             isolation_level=None)
        try:
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect on a new file only
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")  # WAL: a crash loses no committed window
            db.executescript(SCHEMA)
            db.execute("SELECT count(*) FROM windows WHERE end_s < 0").fetchone()  # a corrupt file fails here
        except sqlite3.Error:
            db.close()
            raise
        return db

    def put(self, windows: list[Window]) -> None:
        """Queues a window's rows for the writer; never blocks."""
        if not self.ok:
            return
        try:
            self._queue.put_nowait(windows)
            self._dropped = False
        except queue.Full:
            if not self._dropped:
                log.warning("history writer is behind by %d windows: windows are not kept on disk until it "
                            "catches up", QUEUE_WINDOWS)
            self._dropped = True

    def flush(self) -> None:
        """Waits until every queued window is written (or failed)."""
        if self.ok:
            self._queue.join()

    def close(self) -> None:
        if not self.ok:
            return
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _write_loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                self._write(batch)
            finally:
                self._queue.task_done()
        self._db.close()

    def _write(self, batch: list[Window]) -> None:
        rows = [(w.job, w.point.end, w.point.step_time_s, w.point.baseline_s,
                 json.dumps([[f["kind"], f["ranks"]] for f in w.findings]), json.dumps(list(w.findings)))
                for w in batch]
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("INSERT OR REPLACE INTO windows VALUES (?, ?, ?, ?, ?, ?)", rows)
            self._batches += 1
            if self._batches % PRUNE_EVERY == 1:
                self.prune()
        except sqlite3.Error as e:
            if not self._failing:
                log.warning("history cannot be written to %s (%s): recent windows are kept in memory only",
                            self.path, _reason(e))
            self._failing = True
            return
        if self._failing:
            log.warning("history is written to %s again", self.path)
        self._failing = False

    def prune(self) -> None:
        """Deletes windows older than max_age_s, then the oldest while the live pages exceed max_bytes."""
        db = self._db
        with db:
            db.execute("BEGIN")
            db.execute("DELETE FROM windows WHERE end_s < ?", (self.clock() - self.max_age_s,))
        while self._live_bytes() > self.max_bytes:
            (rows,) = db.execute("SELECT count(*) FROM windows").fetchone()
            if rows == 0:
                break
            with db:
                db.execute("BEGIN")
                db.execute("DELETE FROM windows WHERE end_s <= (SELECT end_s FROM windows ORDER BY end_s "
                           "LIMIT 1 OFFSET ?)", (max(0, int(rows * PRUNE_SHARE) - 1),))
        db.executescript("PRAGMA incremental_vacuum;")  # stepped to the end: execute() would free one page

    def _live_bytes(self) -> int:
        (pages,), (free,), (size,) = (self._db.execute(f"PRAGMA {p}").fetchone()
                                      for p in ("page_count", "freelist_count", "page_size"))
        return (pages - free) * size

    def read(self, job: str | None, since: float, until: float) -> dict[str, JobHistory] | None:
        """Job -> its windows ended in [since, until]; None when the database cannot be read."""
        if not self.ok:
            return None
        try:
            return read_db(self.path, job, since, until)
        except sqlite3.Error as e:
            log.warning("history cannot be read from %s (%s): answering from memory", self.path, _reason(e))
            return None


class DatabaseFile:
    """A history database read by another process (`rankscope history --history-dir`): errors are raised."""

    def __init__(self, path: Path):
        self.path = path

    def put(self, windows: list[Window]) -> None:
        raise NotImplementedError("read only")

    def read(self, job: str | None, since: float, until: float) -> dict[str, JobHistory]:
        return read_db(self.path, job, since, until)

    def close(self) -> None:
        pass


def read_db(path: Path, job: str | None, since: float, until: float) -> dict[str, JobHistory]:
    """Job -> its windows in the database at `path` ended in [since, until]; sqlite3.Error if unreadable."""
    db = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        return _read(db, job, since, until)
    finally:
        db.close()


def _read(db: sqlite3.Connection, job: str | None, since: float, until: float) -> dict[str, JobHistory]:
    where = "end_s BETWEEN ? AND ?" + (" AND job = ?" if job is not None else "")
    rows = db.execute(f"SELECT job, end_s, step_time_s, baseline_s, keys FROM windows WHERE {where} "
                      "ORDER BY job, end_s", (since, until, *([job] if job is not None else [])))
    points: dict[str, list[StepPoint]] = {}
    episodes: dict[str, Episodes] = {}
    for j, end, step, baseline, keys_json in rows:
        keys = [(kind, tuple(ranks)) for kind, ranks in json.loads(keys_json)]
        points.setdefault(j, []).append(StepPoint(end, step, baseline, tuple(k for k, _ in keys)))
        episodes.setdefault(j, Episodes()).add(end, keys, lambda i, j=j, end=end: _finding(db, j, end, i))
    return {j: JobHistory(thin(ps), episodes[j].all()) for j, ps in points.items()}


def _finding(db: sqlite3.Connection, job: str, end: float, i: int) -> dict:
    """The i-th finding of a job's window (read only at an episode's onset: evidence can be kilobytes)."""
    (text,) = db.execute("SELECT findings FROM windows WHERE job = ? AND end_s = ?", (job, end)).fetchone()
    return json.loads(text)[i]


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def open_store(directory: str | None, name: str, max_age_s: float, max_bytes: int) -> HistoryStore | None:
    """The store in `directory` (None: kept in memory only); one that cannot be opened is logged and None."""
    if directory is None:
        return None
    store = HistoryStore(directory, name, max_age_s, max_bytes)
    return store if store.ok else None
