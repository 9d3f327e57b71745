"""One BPF object's trace-capture stream (bpf/trace.h): its flag, the captured pids, its ring buffer and what
had no room there. Every object that includes trace.h has one (the uprobe program, the Python sampler's
programs and timer, each CUPTI shim reader); a capture (agent/trace_capture.py) starts, reads and stops them
all together.

Records are TRACE_RECORD; a stream whose records carry more (a sampled stack after the event) turns each into
a TRACE_RECORD in its intern() before it reaches the capture. Names of what records point at (code objects,
kernel names) are given after the capture by the stream's labels(), which reads the process.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

# Maps of bpf/trace.h.
TRACE_ON = "trace_on"  # [0]: nonzero while a trace capture runs
TRACE_PIDS = "trace_pids"  # pid -> 1: the processes it captures
TRACE_EVENTS = "trace_events"  # stream of events while it runs (TRACE_RECORD)
TRACE_LOST = "trace_lost"  # events the stream had no room for, ever

# One event of a trace capture (bpf/trace.h: struct trace_rec); times monotonic ns unless the kind says.
TRACE_RECORD = np.dtype([("kind", "<u4"), ("pid", "<u4"), ("tid", "<u4"), ("fn", "<u4"), ("start_ns", "<u8"),
                         ("end_ns", "<u8"), ("bytes", "<u8"), ("seq", "<u8")])
# TRACE_RECORD's kinds (bpf/trace.h).
TRACE_CALL, TRACE_COLLECTIVE, TRACE_INSTANT, TRACE_SCHED = 1, 2, 3, 4
TRACE_PY_CALL, TRACE_PY_SAMPLE, TRACE_GPU, TRACE_NCCL = 5, 6, 7, 8

# (kind, seq) -> what the record points at: a Python function (a Frame), a sampled stack (Frames, root first),
# a kernel's or NCCL function's name.
Labels = dict[tuple[int, int], Any]


class CaptureBusy(Exception):
    """A trace capture is already running (one at a time: the kernel's flags and streams are shared)."""


class TraceStream:
    """A BPF object's stream. Subclasses whose records carry more, or point at what the process names
    (code objects, kernel names), override intern() and labels()."""

    def __init__(self, bpf: Any, lock: threading.Lock | None = None):
        self.bpf = bpf  # a loaded bcc.BPF that includes bpf/trace.h; None once closed
        # Held while the object's ring buffers are consumed: libbpf's consume is not reentrant, and an object's
        # other streams (the uprobe program's completed collectives) are read by the window's thread.
        self.lock = lock or threading.Lock()
        self.refused = 0  # records of the running capture intern() had no room for
        self._sink: Callable[[bytes], None] | None = None
        self._on = False
        self._lost_at_close = 0
        bpf[TRACE_EVENTS].open_ring_buffer(self._on_event)

    def intern(self, raw: bytes) -> bytes | None:
        """A record as the kernel wrote it -> its TRACE_RECORD, or None when there is no room to keep it."""
        return raw

    def labels(self, pid: int, recs: np.ndarray) -> Labels:
        """What `pid`'s records of the capture (of every stream) point at, where this stream's kinds do."""
        return {}

    def _on_event(self, _ctx, data, size) -> None:
        if self._sink is None:
            return
        rec = self.intern(ctypes.string_at(data, size))
        if rec is None:
            self.refused += 1
        else:
            self._sink(rec)

    @property
    def running(self) -> bool:
        """Whether the kernel emits this stream's events now (a capture started it and has not stopped it)."""
        return self._on

    def consume(self) -> None:
        """Read the object's ring buffers (this stream's events into the sink)."""
        with self.lock:
            if self.bpf is not None:
                self.bpf.ring_buffer_consume()

    def start(self, pids: list[int], sink: Callable[[bytes], None]) -> None:
        """Stream the events of `pids` (TRACE_RECORD each) to `sink`, from the next consume(), until stop()."""
        with self.lock:
            if self._sink is not None:
                raise CaptureBusy("a trace capture is already running")
            self.bpf.ring_buffer_consume()  # what the streams held is not this capture's
            self._sink, self.refused = sink, 0
        for pid in pids:
            self.bpf[TRACE_PIDS][ctypes.c_uint32(pid)] = ctypes.c_uint32(1)
        self.bpf[TRACE_ON][ctypes.c_int(0)] = ctypes.c_uint32(1)
        self._on = True

    def stop(self) -> None:
        """The kernel stops emitting, and what it emitted so far reaches the sink."""
        if self._sink is None or self.bpf is None:
            self._sink, self._on = None, False
            return
        self.bpf[TRACE_ON][ctypes.c_int(0)] = ctypes.c_uint32(0)
        self._on = False
        self.bpf[TRACE_PIDS].clear()
        self.consume()
        self._sink = None

    @property
    def lost(self) -> int:
        """Events the kernel's stream had no room for, since the object loaded."""
        return self._lost_at_close if self.bpf is None else self.bpf[TRACE_LOST][ctypes.c_int(0)].value

    def close(self) -> None:
        """The object is about to be unloaded (a shim reader's process left): a capture running meanwhile
        keeps what it read and reads no more of it."""
        with self.lock:
            if self.bpf is not None:
                self._lost_at_close = self.lost
                self.bpf = None
