"""A rank's trace capture as Chrome trace-event JSON (Kineto's layout): opens in Perfetto and chrome://tracing,
and HolisticTraceAnalysis loads a job's files (one per rank) as one job.

Tracks of a rank (its process; times in us from the capture's start, `baseTimeNanoseconds` its unix time):
- each thread's probed calls (CUDA driver/runtime, NCCL enqueues, gloo's blocking collectives, GC) as slices,
  kernel launches as instants (deep detail only: counted, not timed);
- collectives from enqueue to completion, on lanes of their own (NCCL's overlap: several complete at one host
  sync). They are also HTA's communication: HTA takes "kernel" events with an `args.stream` and classifies
  them by name (`^nccl.*Kernel`), hence their names `ncclKernel <op>`, gloo's too; `args.correlation` links
  each to its enqueue call;
- the main thread's scheduler state (running, runnable, asleep, blocked);
- exactly timed Python functions (forward, the loader's __next__, --trace-function's; GC collections timed
  through USDT) as slices on their thread, `python_function` as Kineto names them;
- sampled Python stacks (on CPU) as instant events on their thread: named by the innermost function, the stack
  in `args.stack` (Perfetto shows args) and as `sf` into the document's `stackFrames` (chrome://tracing);
- with the CUPTI shim, GPU kernels, copies and sets on a track per device and stream (Kineto's `kernel`,
  `gpu_memcpy`, `gpu_memset`, with `args.device/stream/correlation`). HTA then counts the GPU's own kernels
  (NCCL's among them, by name), so the host's collective spans are no `kernel` events there;
- with the NCCL profiler plugin, each collective's GPU span (the plugin gives its length; it is placed to end
  when the plugin handed it over) on a track of its own.
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

from rankscope.agent.interpreters import Frame
from rankscope.agent.loader.program import ProbeProgram
from rankscope.agent.loader.trace_stream import (TRACE_CALL, TRACE_COLLECTIVE, TRACE_GPU, TRACE_INSTANT, TRACE_NCCL,
                                                 TRACE_PY_CALL, TRACE_PY_SAMPLE, TRACE_RECORD, TRACE_SCHED)
from rankscope.agent.sources.probes.cupti import KERNEL_KINDS, KIND_MEMCPY, KIND_MEMSET
from rankscope.agent.sources.python_profile import function_name
from rankscope.agent.trace_capture import MAX_EVENTS, Captured
from rankscope.schema.patterns import RankPattern

CONTENT_TYPE = "application/json"
ZIP_CONTENT_TYPE = "application/zip"
# Tracks that are no thread of the process: above any Linux tid (pid_max <= 2^22).
SCHED_TID = 1 << 30
COLLECTIVE_TID = SCHED_TID + 1  # + the lane
NCCL_TID = 1 << 29  # NCCL's GPU spans from the profiler plugin
GPU_TID = NCCL_TID + (1 << 24)  # + device << 16 + stream: the CUPTI shim's records
COMM_STREAM = 1000  # HTA's stream of lane 0 (any number >= 0 is a GPU stream to it)
GPU_CATEGORY = {KIND_MEMCPY: ("gpu_memcpy", "Memcpy"), KIND_MEMSET: ("gpu_memset", "Memset")}  # Kineto's
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
    labels = cap.labels.get(pid, {})
    frames = _StackFrames()
    gpu_tracks: set[tuple[int, int]] = set()  # (device, stream)
    nccl = False
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
        elif kind == TRACE_PY_CALL and (kind, seq) in labels:
            events.append({"ph": "X", "cat": "python_function", "name": _name(labels[kind, seq]), "pid": pid,
                           "tid": tid, **span(start, end)})
            threads.add(tid)
        elif kind == TRACE_PY_SAMPLE and (kind, seq) in labels:
            stack = labels[kind, seq]
            events.append({"ph": "i", "s": "t", "cat": "python_sample", "name": _name(stack[-1]) if stack else "?",
                           "pid": pid, "tid": tid, "ts": ts(start), "sf": frames.leaf(stack),
                           "args": {"stack": ";".join(_name(f) for f in stack)}})
            threads.add(tid)
        elif kind == TRACE_GPU and end - cap.mono_to_unix_ns >= cap.start_ns:  # CUPTI's clock: unix ns
            events.append(_gpu(f, tid, labels.get((kind, seq), "?"), nbytes, pid,
                               span(start - cap.mono_to_unix_ns, end - cap.mono_to_unix_ns)))
            gpu_tracks.add((f >> 8, tid))
        elif kind == TRACE_NCCL:
            ev = {"ph": "X", "cat": "gpu_user_annotation", "name": f"nccl{labels.get((kind, seq), '?')}",
                  "pid": pid, "tid": NCCL_TID, **span(start, end)}
            ev["args"] = ev.get("args", {}) | {"bytes": nbytes}
            events.append(ev)
            nccl = True
    coll = recs[recs["kind"] == TRACE_COLLECTIVE]
    lanes = _lanes(np.maximum(coll["start_ns"], cap.start_ns), coll["end_ns"])
    # The shim's kernels are HTA's compute and communication: then the host's spans are no kernels to it.
    gpu_kernels = bool(np.isin(recs["fn"][recs["kind"] == TRACE_GPU] & 0xFF, KERNEL_KINDS).any())
    for (f, start, end, nbytes, seq), lane in zip(coll[["fn", "start_ns", "end_ns", "bytes", "seq"]].tolist(), lanes):
        ev = {"ph": "X", "cat": "collective" if gpu_kernels else "kernel", "name": f"ncclKernel {fn(f).name}",
              "pid": pid, "tid": COLLECTIVE_TID + lane, **span(start, end)}
        ev["args"] = ev.get("args", {}) | ({} if gpu_kernels else {"stream": COMM_STREAM + lane}) | {
            "correlation": seq, "bytes": nbytes, "timing": "host: enqueue to completion"}
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
            *(_meta("thread_name", pid, tid, name=names.get(tid, f"thread {tid}")) for tid in sorted(threads)),
            *(_meta("thread_name", pid, _gpu_tid(d, st), name=f"GPU {d} stream {st}") for d, st in sorted(gpu_tracks)),
            *([_meta("thread_name", pid, NCCL_TID, name="NCCL: GPU spans (profiler plugin)")] if nccl else [])]
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
        **({"stackFrames": frames.table} if frames.table else {}),
    }


def _name(label: Frame | str) -> str:
    return label if isinstance(label, str) else function_name(label)


class _StackFrames:
    """The document's `stackFrames`: each distinct (parent, function) once; a stack is its leaf's id."""

    def __init__(self) -> None:
        self.table: dict[str, dict] = {}
        self._ids: dict[tuple[str | None, str], str] = {}

    def leaf(self, stack: tuple[Frame, ...]) -> str | None:
        parent = None
        for frame in stack:
            key = (parent, _name(frame))
            if key not in self._ids:
                self._ids[key] = sid = str(len(self._ids) + 1)
                self.table[sid] = {"name": key[1], "category": "python"} | ({"parent": parent} if parent else {})
            parent = self._ids[key]
        return parent


def _gpu_tid(device: int, stream: int) -> int:
    return GPU_TID + ((device & 0xFF) << 16) + (stream & 0xFFFF)


def _gpu(f: int, stream: int, name: str, value: int, pid: int, when: dict) -> dict:
    """One CUPTI record (`f`: its kind | device << 8; `value`: a kernel's correlation id, else bytes) as
    Kineto writes it."""
    kind, device = f & 0xFF, f >> 8
    if kind in KERNEL_KINDS:
        cat, shown, extra = "kernel", name, {"correlation": value}
    else:
        (cat, shown), extra = GPU_CATEGORY.get(kind, ("gpu_activity", "?")), {"bytes": value}
    return {"ph": "X", "cat": cat, "name": shown, "pid": pid, "tid": _gpu_tid(device, stream), **when,
            "args": when.get("args", {}) | {"device": device, "stream": stream} | extra}


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
