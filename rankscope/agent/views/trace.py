"""A rank's trace capture as Chrome trace-event JSON (Kineto's layout): opens in Perfetto and chrome://tracing,
and HolisticTraceAnalysis loads a job's files (one per rank) as one job.

Tracks of a rank (its process; times in us from the capture's start, `baseTimeNanoseconds` its unix time):
- each thread's probed calls (CUDA driver/runtime, NCCL enqueues, gloo's blocking collectives, GC) as slices,
  kernel launches as instants (deep detail only: counted, not timed);
- collectives from enqueue to completion, on lanes of their own (NCCL's overlap: several complete at one host
  sync). They are also HTA's communication: HTA takes "kernel" events with an `args.stream` and classifies
  them by name (`^nccl.*Kernel`), hence their names `ncclKernel <op>`, gloo's too; `args.correlation` links
  each to its enqueue call;
- the main thread's scheduler state (running, runnable, asleep, blocked).
Events lost (the kernel's stream was full, or the capture kept its maximum) are counted in `rankscope` at the
top and, when there are any, an instant event at the capture's end.
"""
from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rankscope.agent.loader.program import (TRACE_CALL, TRACE_COLLECTIVE, TRACE_INSTANT, TRACE_RECORD,
                                            TRACE_SCHED, ProbeProgram)
from rankscope.agent.trace_capture import MAX_EVENTS, Captured
from rankscope.schema.patterns import RankPattern

CONTENT_TYPE = "application/json"
ZIP_CONTENT_TYPE = "application/zip"
# Tracks that are no thread of the process: above any Linux tid (pid_max <= 2^22).
SCHED_TID = 1 << 30
COLLECTIVE_TID = SCHED_TID + 1  # + the lane
COMM_STREAM = 1000  # HTA's stream of lane 0 (any number >= 0 is a GPU stream to it)
STATES = ("running", "runnable", "asleep", "blocked (I/O)")  # bpf/sched.bpf.c's ON_CPU, RUNNABLE, ...


@dataclass(frozen=True)
class RankInfo:
    """Who a traced process is."""

    job: str
    rank: int
    world_size: int
    pid: int
    host: str

    @classmethod
    def of(cls, pattern: RankPattern) -> RankInfo:
        """As a window's pattern names the process (NCCL's own rank where it told, else the launcher's)."""
        return cls(pattern.job, pattern.rank, pattern.world_size, pattern.pid, pattern.host)


@dataclass(frozen=True)
class Function:
    """How a probe's events read: its name and its category (Kineto's, where it has one)."""

    name: str
    category: str


def functions_of(program: ProbeProgram) -> dict[int, Function]:
    """The program's probe ids -> their names and categories."""
    return {program.ids[p.name]: Function(p.name, kind.category) for kind in program.kinds for p in kind.probes}


def file_name(rank: int) -> str:
    return f"rank{rank}.trace.json"


def _lanes(starts: np.ndarray, ends: np.ndarray) -> list[int]:
    """A lane per interval (in start order) such that a lane's intervals do not overlap: the fewest lanes."""
    free_at: list[int] = []
    lanes = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        lane = next((i for i, t in enumerate(free_at) if t <= s), len(free_at))
        if lane == len(free_at):
            free_at.append(e)
        free_at[lane] = e
        lanes.append(lane)
    return lanes


def chrome_trace(info: RankInfo, cap: Captured, functions: Mapping[int, Function],
                 summary: Mapping[str, Any] | None = None) -> dict:
    """The trace document of one rank. Events that began before the capture start at its start
    (`args.clipped`). `summary`: the rank's row of the diagnosis over the capture's window (its step split),
    kept in the `rankscope` metadata."""
    recs = cap.events.get(info.pid, np.zeros(0, TRACE_RECORD))
    pid = info.pid

    def ts(ns: int) -> float:
        return round((max(ns, cap.start_ns) - cap.start_ns) / 1e3, 3)

    def span(start: int, end: int) -> dict:
        out = {"ts": ts(start), "dur": round(max(end - max(start, cap.start_ns), 0) / 1e3, 3)}
        return out | ({"args": {"clipped": True}} if start < cap.start_ns else {})

    def fn(i: int) -> Function:
        return functions.get(i, Function(f"fn{i}", "unknown"))

    events: list[dict] = []
    threads: set[int] = set()
    for kind, tid, f, start, end, nbytes, seq in recs[["kind", "tid", "fn", "start_ns", "end_ns", "bytes",
                                                       "seq"]].tolist():
        if kind == TRACE_CALL:
            ev = {"ph": "X", "cat": fn(f).category, "name": fn(f).name, "pid": pid, "tid": tid, **span(start, end)}
            args = ev.setdefault("args", {})
            args.update({"bytes": nbytes} if nbytes else {})
            args.update({"correlation": seq} if seq else {})
            events.append(ev if args else {k: v for k, v in ev.items() if k != "args"})
            threads.add(tid)
        elif kind == TRACE_INSTANT:
            events.append({"ph": "i", "s": "t", "cat": fn(f).category, "name": fn(f).name, "pid": pid, "tid": tid,
                           "ts": ts(start)})
            threads.add(tid)
        elif kind == TRACE_SCHED and f < len(STATES):
            events.append({"ph": "X", "cat": "sched", "name": STATES[f], "pid": pid, "tid": SCHED_TID,
                           **span(start, end)})
    coll = recs[recs["kind"] == TRACE_COLLECTIVE]
    lanes = _lanes(np.maximum(coll["start_ns"], cap.start_ns), coll["end_ns"])
    for (f, start, end, nbytes, seq), lane in zip(coll[["fn", "start_ns", "end_ns", "bytes", "seq"]].tolist(), lanes):
        ev = {"ph": "X", "cat": "kernel", "name": f"ncclKernel {fn(f).name}", "pid": pid,
              "tid": COLLECTIVE_TID + lane, **span(start, end)}
        ev["args"] = ev.get("args", {}) | {"stream": COMM_STREAM + lane, "correlation": seq, "bytes": nbytes,
                                           "timing": "host: enqueue to completion"}
        events.append(ev)
    events.sort(key=lambda e: e["ts"])
    if cap.lost:
        events.append({"ph": "i", "s": "p", "cat": "rankscope", "name": f"rankscope: {cap.lost} events lost",
                       "pid": pid, "tid": 0, "ts": ts(cap.end_ns),
                       "args": {"dropped": cap.dropped, "truncated": cap.truncated}})
    backends = {fn(f).category for f in coll["fn"].tolist()}
    names = cap.threads.get(pid, {})
    meta = [_meta("process_name", pid, 0, name=f"rank {info.rank}"),
            _meta("process_labels", pid, 0, labels=f"job {info.job}, pid {pid}, host {info.host}"),
            _meta("process_sort_index", pid, 0, sort_index=info.rank),
            _meta("thread_name", pid, SCHED_TID, name="main thread: scheduler state"),
            *(_meta("thread_name", pid, COLLECTIVE_TID + lane, name="collectives" + (f" ({lane + 1})" if lane else ""))
              for lane in sorted(set(lanes))),
            *(_meta("thread_name", pid, tid, name=names.get(tid, f"thread {tid}")) for tid in sorted(threads))]
    return {
        # First: HTA takes a file's rank from the first `"rank": N` in it.
        "distributedInfo": {"rank": info.rank, "world_size": info.world_size,
                            **({"backend": next(iter(backends))} if len(backends) == 1 else {})},
        "schemaVersion": 1,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": cap.start_ns + cap.mono_to_unix_ns,
        "rankscope": {"job": info.job, "rank": info.rank, "pid": pid, "host": info.host,
                      "seconds": round((cap.end_ns - cap.start_ns) / 1e9, 3),
                      "dropped_events": cap.dropped, "truncated_events": cap.truncated, "max_events": MAX_EVENTS,
                      **({"summary": dict(summary)} if summary else {})},
        "traceEvents": meta + events,
    }


def _meta(what: str, pid: int, tid: int, **args) -> dict:
    return {"ph": "M", "name": what, "pid": pid, "tid": tid, "ts": 0, "args": args}


def encode(doc: dict) -> bytes:
    return json.dumps(doc).encode()  # default separators: HTA's rank pattern wants `"rank": N`


def zipped(docs: list[dict]) -> bytes:
    """Several ranks' traces as one zip of their files (unpacked, a directory HTA loads)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for doc in docs:
            z.writestr(file_name(doc["distributedInfo"]["rank"]), encode(doc))
    return out.getvalue()
