"""A trace capture: every probed call, collective and main-thread scheduler state of chosen processes for a
bounded time, and, where their sources watch the processes, exactly timed Python functions, sampled Python
stacks, GPU activity and NCCL's GPU spans: the trace streams of every BPF object involved
(loader/trace_stream.py), read every READ_EVERY_S.

The kernel emits these events only while a capture runs (one at a time), so the always-on agent pays nothing
for them. Memory is bounded twice: each kernel stream (2 MiB for the uprobe program, less for the others)
and MAX_EVENTS kept here (48 bytes each: 24 MB at most; sampled stacks are interned, a bounded number:
sources/python_sampler.py's MAX_TRACE_STACKS); events that found any of them full are counted, never
silently lost, and the trace shows them.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from rankscope.agent.loader.trace_stream import TRACE_RECORD, Labels, TraceStream

MAX_SECONDS = 60.0  # one capture's longest duration
MAX_EVENTS = 500_000  # kept per capture, all processes together
READ_EVERY_S = 0.05  # the kernel's stream holds ~43k events: ~860k/s between two reads


@dataclass
class Captured:
    """What one capture saw. Times are CLOCK_MONOTONIC ns (bpf_ktime_get_ns), like the events'."""

    start_ns: int
    end_ns: int
    mono_to_unix_ns: int  # add to a monotonic time: unix ns
    events: dict[int, np.ndarray]  # pid -> TRACE_RECORD rows, by start time
    threads: dict[int, dict[int, str]]  # pid -> tid -> thread name, read at the end
    labels: dict[int, Labels] = field(default_factory=dict)  # pid -> what its records point at, named
    dropped: int = 0  # events the kernel's streams had no room for
    truncated: int = 0  # events beyond MAX_EVENTS (or a sampled stack beyond MAX_STACKS)

    @property
    def lost(self) -> int:
        return self.dropped + self.truncated


@dataclass
class _Buffer:
    """The capture's events as they arrive: raw records between reads, numpy chunks after."""

    raw: list[bytes] = field(default_factory=list)
    chunks: list[np.ndarray] = field(default_factory=list)
    kept: int = 0
    truncated: int = 0
    # add() also runs on the agent's window thread (its consume() of the collectives' stream reads this one too).
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, rec: bytes) -> None:
        with self.lock:
            self.raw.append(rec)

    def flush(self) -> None:
        with self.lock:
            raw, self.raw = self.raw, []
        recs = np.frombuffer(b"".join(raw), TRACE_RECORD)
        room = max(MAX_EVENTS - self.kept, 0)
        self.truncated += max(len(recs) - room, 0)
        if room and len(recs):
            self.chunks.append(recs[:room])
            self.kept += min(len(recs), room)


def _thread_names(pid: int) -> dict[int, str]:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # exited
        return {}
    names = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except OSError:
            pass
    return names


def capture(streams: list[TraceStream], pids: list[int], seconds: float,
            stop: threading.Event | None = None) -> Captured:
    """The events of `pids` from `streams` (the session's: Session.trace_streams) over `seconds` (at most
    MAX_SECONDS; `stop` ends it early). CaptureBusy if another capture runs."""
    seconds = min(seconds, MAX_SECONDS)
    stop = stop or threading.Event()
    buf = _Buffer()
    lost_before = [s.lost for s in streams]
    started: list[TraceStream] = []
    start_ns = time.monotonic_ns()  # before the first stream emits: none of its events precede the capture
    try:
        for s in streams:
            s.start(pids, buf.add)
            started.append(s)
    except BaseException:
        for s in started:
            s.stop()
        raise
    try:
        deadline = time.monotonic() + seconds
        while not stop.wait(min(READ_EVERY_S, max(deadline - time.monotonic(), 0))) and time.monotonic() < deadline:
            for s in streams:
                s.consume()
            buf.flush()
    except KeyboardInterrupt:  # Ctrl-C ends it early: what it saw is the trace
        pass
    finally:
        end_ns = time.monotonic_ns()
        for s in streams:
            s.stop()
    buf.flush()
    recs = np.concatenate(buf.chunks) if buf.chunks else np.zeros(0, TRACE_RECORD)
    recs = recs[np.lexsort((recs["start_ns"], recs["pid"]))]
    pids_in, starts = np.unique(recs["pid"], return_index=True)
    events = {int(pid): part for pid, part in zip(pids_in, np.split(recs, starts[1:]))}
    events = {pid: events.get(pid, np.zeros(0, TRACE_RECORD)) for pid in pids}
    labels: dict[int, Labels] = {pid: {} for pid in pids}
    for s in streams:
        for pid, part in events.items():
            labels[pid].update(s.labels(pid, part))
    return Captured(start_ns=start_ns, end_ns=end_ns, mono_to_unix_ns=time.time_ns() - time.monotonic_ns(),
                    events=events, threads={pid: _thread_names(pid) for pid in pids}, labels=labels,
                    dropped=sum(s.lost for s in streams) - sum(lost_before),
                    truncated=buf.truncated + sum(s.refused for s in streams))
