"""The history kept on disk (history_store.py): what a restarted service reads back, episodes from onset to
end, the bounds by age and size, and the directories it cannot use (one log line, memory goes on)."""
from __future__ import annotations

import logging
import sqlite3
import time

import pytest

from rankscope.agent.service.history import MAX_POINTS, StepHistory, StepPoint, parse_time, thin
from rankscope.agent.service.history_store import HistoryStore

T0 = float(int(time.time()) - 3600)  # windows an hour old: within the age bound


def _finding(kind: str, ranks: list[int], cost: float = 0.2) -> dict:
    return {"kind": kind, "ranks": ranks, "function": "cuStreamSynchronize", "component": "gpu", "score": 9.0,
            "cost": cost, "summary": f"{kind} of {ranks}", "evidence": {"per_rank": [{"rank": r, "z": 8.0} for r in ranks]}}


def _doc(end: float, findings: list[dict], step: float | None = 0.1, job: str = "job-a") -> dict:
    return {"job": job, "window": {"start": end - 5, "end": end}, "step_time_s": step,
            "baseline": {"step_time_s": 0.09}, "ranks": [], "findings": findings}


def _store(tmp_path, **kwargs) -> HistoryStore:
    store = HistoryStore(str(tmp_path), "agent", **kwargs)
    assert store.ok
    return store


def _record(history: StepHistory, windows: list[tuple[float, list[dict]]]) -> None:
    for end, findings in windows:
        history.record({"job-a": _doc(end, findings)})


SLOW = _finding("compute_straggler", [1])
HANG = _finding("noncomm_hang", [2], cost=1.0)
# A straggler for three windows, gone one, back one; a hang from the fourth window on.
WINDOWS = [(T0 + 5 * i, f) for i, f in enumerate([[], [SLOW], [SLOW], [SLOW, HANG], [HANG], [SLOW, HANG]])]


def test_a_new_store_on_the_same_directory_reads_every_window_and_episode_back(tmp_path):
    first = StepHistory(store=_store(tmp_path))
    _record(first, WINDOWS)
    first.store.flush()  # what a killed process had committed; nothing closes it
    again = StepHistory(store=_store(tmp_path))  # a restarted service: nothing in memory
    (job,) = again.query(since=T0 - 1, until=T0 + 100).values()
    assert [p.end for p in job.points] == [end for end, _ in WINDOWS]
    assert job.points[1] == StepPoint(T0 + 5, 0.1, 0.09, ("compute_straggler",))
    assert [(e.kind, e.ranks, e.start, e.end, e.windows) for e in job.episodes] == [
        ("compute_straggler", [1], T0 + 5, T0 + 15, 3),
        ("noncomm_hang", [2], T0 + 15, T0 + 25, 3),
        ("compute_straggler", [1], T0 + 25, T0 + 25, 1)]
    assert job.episodes[0].finding == SLOW  # evidence included
    assert again.query(job="other", since=T0 - 1, until=T0 + 100) == {}
    (later,) = again.query(since=T0 + 12, until=T0 + 100).values()
    assert later.episodes[0].start == T0 + 15  # an episode begun before the span starts at its first window in it


def test_windows_not_yet_written_are_read_from_memory_and_continue_their_episode(tmp_path):
    store = _store(tmp_path)
    history = StepHistory(store=store)
    _record(history, WINDOWS[:3])
    store.flush()
    store.put = lambda windows: None  # the writer has not got to the next windows yet
    _record(history, WINDOWS[3:])
    (job,) = history.query(since=T0 - 1, until=T0 + 100).values()
    assert [p.end for p in job.points] == [end for end, _ in WINDOWS]
    assert [(e.kind, e.start, e.windows) for e in job.episodes] == [
        ("compute_straggler", T0 + 5, 3), ("noncomm_hang", T0 + 15, 3), ("compute_straggler", T0 + 25, 1)]


def test_windows_older_than_the_age_bound_are_deleted(tmp_path):
    now = [T0]
    store = _store(tmp_path, max_age_s=60.0, clock=lambda: now[0])
    history = StepHistory(store=store)
    _record(history, [(T0 - 120, []), (T0 - 30, []), (T0, [])])
    store.flush()
    store.prune()
    (job,) = history.query(since=0, until=T0 + 1).values()
    assert [p.end for p in job.points] == [T0 - 30, T0]


def test_the_database_stays_within_its_size_bound_keeping_the_newest_windows(tmp_path):
    bound = 256 * 1024
    store = _store(tmp_path, max_bytes=bound)
    big = _finding("compute_straggler", list(range(64)))  # ~5 KB of evidence a window
    for i in range(200):  # ~1 MB written in all
        store.put([StepHistory().record({"job-a": _doc(T0 + i, [big])})._jobs["job-a"][-1]])
    store.flush()
    store.prune()
    store.close()
    assert (tmp_path / "agent.db").stat().st_size <= bound * 1.2
    (job,) = StepHistory(store=_store(tmp_path)).query(since=0, until=T0 + 1000).values()
    assert job.points[-1].end == T0 + 199 and 10 < len(job.points) < 200


def test_a_window_never_waits_for_a_locked_database(tmp_path):
    store = _store(tmp_path)
    history = StepHistory(store=store)
    blocker = sqlite3.connect(tmp_path / "agent.db", isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")  # the writer waits up to its busy timeout for this
    started = time.perf_counter()
    _record(history, WINDOWS)
    assert time.perf_counter() - started < 0.5
    assert len(history.query(since=T0 - 1, until=T0 + 100)["job-a"].points) == len(WINDOWS)  # memory answers
    blocker.execute("COMMIT")
    store.flush()
    assert len(StepHistory(store=_store(tmp_path)).query(since=T0 - 1, until=T0 + 100)["job-a"].points) == len(WINDOWS)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_directory_that_cannot_be_used_is_one_log_line_and_memory_goes_on(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "agent.db").write_bytes(b"this is not a database" * 100)
    for directory in (tmp_path / "file" / "history", corrupt):
        caplog.clear()
        store = HistoryStore(str(directory), "agent")
        assert not store.ok
        (line,) = _warnings(caplog)
        assert str(directory) in line and "memory" in line
        history = StepHistory(store=store)
        _record(history, WINDOWS)
        assert len(history.query(since=T0 - 1, until=T0 + 100)["job-a"].points) == len(WINDOWS)


def test_a_full_disk_is_one_log_line_until_writes_succeed_again(tmp_path, caplog):
    store = _store(tmp_path)
    history = StepHistory(store=store)
    _record(history, WINDOWS[:1])
    store.flush()
    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's "database or disk is full"
    big = _finding("compute_straggler", list(range(512)))
    caplog.clear()
    for i in range(1, 4):
        history.record({"job-a": _doc(T0 + 5 * i, [big])})
    store.flush()
    (line,) = _warnings(caplog)
    assert "full" in line and "memory" in line
    assert len(history.query(since=T0 - 1, until=T0 + 100)["job-a"].points) == 4  # memory fills the gap
    store._db.execute("PRAGMA max_page_count = 1073741823")
    history.record({"job-a": _doc(T0 + 20, [])})
    store.flush()
    assert "again" in _warnings(caplog)[-1]


def test_thinning_keeps_the_onsets_and_the_last_window():
    points = [StepPoint(float(i), 0.1, None, ("regression",) if 5000 <= i < 5003 else ()) for i in range(9001)]
    kept = thin(points)
    assert len(kept) <= MAX_POINTS + 3
    ends = {p.end for p in kept}
    assert {5000.0, 5003.0, 9000.0} <= ends


@pytest.mark.parametrize("text,expected", [("90s", T0 - 90), ("30m", T0 - 1800), ("3h", T0 - 10800),
                                           ("7d", T0 - 604800), (str(T0 - 1), T0 - 1)])
def test_times_are_unix_seconds_or_a_duration_ago(text, expected):
    assert parse_time(text, T0) == expected


@pytest.mark.parametrize("text", ["", "h", "3x", "-1h", "400d", "nan", "inf", "-5"])
def test_a_time_out_of_bounds_is_refused(text):
    with pytest.raises(ValueError):
        parse_time(text, T0)


def test_the_history_command_reads_the_database_of_a_stopped_agent(tmp_path, capsys):
    from rankscope.agent.cli import main

    store = _store(tmp_path)
    _record(StepHistory(store=store), WINDOWS)
    store.close()
    assert main(["history", "--history-dir", str(tmp_path), "--since", "2h"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"job job-a: {len(WINDOWS)} windows from ")
    assert [line.split("  ")[2].split(",")[0] for line in lines[1:]] == [
        "compute_straggler ranks 1", "noncomm_hang ranks 2", "compute_straggler ranks 1"]
    assert "(3 windows)" in lines[1] and "costs 20%: compute_straggler of [1]" in lines[1]
    assert main(["history", "--history-dir", str(tmp_path / "none")]) == 2
    assert "no history database" in capsys.readouterr().err
