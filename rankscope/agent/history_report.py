"""`rankscope history`: what GET /v1/history answers, asked of a running agent (or cluster analyzer), or read
from the history database on this node when none runs (after a crash, say); as text or as JSON."""
from __future__ import annotations

import sqlite3
import statistics
import time
import urllib.parse
from pathlib import Path
from typing import Any

from rankscope.agent.ask_agent import AgentError, get_json
from rankscope.agent.service.history import StepHistory, history_answer
from rankscope.agent.service.history_store import DatabaseFile


def read_agent(url: str, query: dict[str, str], token: str | None) -> dict[str, Any]:
    try:
        return get_json(url.rstrip("/"), "/v1/history?" + urllib.parse.urlencode(query), token)
    except AgentError as e:
        raise ValueError(str(e)) from None


def read_local(directory: str, name: str, query: dict[str, str]) -> dict[str, Any]:
    path = Path(directory) / f"{name}.db"
    if not path.is_file():
        raise ValueError(f"no history database at {path}")
    try:
        return history_answer(StepHistory(store=DatabaseFile(path)), query, time.time())
    except sqlite3.Error as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f} ms"


def render_history(answer: dict[str, Any]) -> str:
    """Each job: its windows' span and step time, then its findings from onset to end."""
    jobs = answer["jobs"]
    if not jobs:  # (an agent older than `since` and `until` answers neither)
        return (f"no windows from {_clock(answer['since'])} to {_clock(answer['until'])}\n" if "since" in answer
                else "no windows\n")
    out: list[str] = []
    for job, points in jobs.items():
        steps = [p["step_time_s"] for p in points if p["step_time_s"] is not None]
        baselines = [p["baseline_s"] for p in points if p["baseline_s"] is not None]
        out.append(f"job {job}: {len(points)} windows from {_clock(points[0]['end'])} to {_clock(points[-1]['end'])}; "
                   f"step time median {_ms(statistics.median(steps) if steps else None)}"
                   + (f", last baseline {_ms(baselines[-1])}" if baselines else ""))
        episodes = answer.get("findings", {}).get(job, [])
        for e in episodes:
            f = e["finding"]
            out.append(f"  {_clock(e['start'])} .. {_clock(e['end'])} ({e['windows']} windows)  {e['kind']} "
                       f"ranks {','.join(map(str, e['ranks']))}, costs {f.get('cost', 0) * 100:.0f}%: "
                       f"{f.get('summary', '')}")
        if not episodes:
            out.append("  no findings")
    return "\n".join(out) + "\n"
