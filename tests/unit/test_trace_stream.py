"""Trace streams and a capture over them without the kernel: a stand-in BPF object holds the flags, the pids
and the ring buffer's records. What is bounded (interned stacks, kept events) is counted, never silent."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from rankscope.agent import trace_capture
from rankscope.agent.interpreters import Frame
from rankscope.agent.loader.trace_stream import (TRACE_EVENTS, TRACE_LOST, TRACE_ON, TRACE_PIDS, TRACE_PY_SAMPLE,
                                                 TRACE_RECORD, CaptureBusy, TraceStream)
from rankscope.agent.sources import python_sampler
from rankscope.agent.sources.python_sampler import PY_STACKS

PID = 4242


class Table(dict):
    """A BPF map of the stand-in: keys and values by their ctypes value."""

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key.value, value.value)

    def __getitem__(self, key: Any) -> Any:
        return ctypes.c_uint64(self.get(key.value, 0))


class Ring:
    def open_ring_buffer(self, callback) -> None:
        self.callback = callback


class StackKey(ctypes.Structure):  # struct py_stack with a depth of 2
    _fields_ = [("pid", ctypes.c_uint32), ("kind", ctypes.c_uint16), ("flags", ctypes.c_uint16),
                ("depth", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("code", ctypes.c_uint64 * 2)]


class Stacks:
    Key = StackKey


class FakeBpf(dict):
    """The kernel side of a stream: what a consume() delivers is what emit() queued while tracing was on."""

    def __init__(self) -> None:
        super().__init__({TRACE_EVENTS: Ring(), TRACE_ON: Table(), TRACE_PIDS: Table(), TRACE_LOST: Table(),
                          PY_STACKS.format(0): Stacks()})
        self.queued: list[bytes] = []

    def emit(self, raw: bytes) -> None:
        pid = int.from_bytes(raw[4:8], "little")
        if self[TRACE_ON].get(0) and pid in self[TRACE_PIDS]:
            self.queued.append(raw)

    def ring_buffer_consume(self) -> None:
        queued, self.queued = self.queued, []
        for raw in queued:
            buf = ctypes.create_string_buffer(raw, len(raw))
            self[TRACE_EVENTS].callback(None, ctypes.addressof(buf), len(raw))


def record(kind: int, start: int, seq: int = 0, pid: int = PID) -> bytes:
    return np.array([(kind, pid, pid, 0, start, start, 0, seq)], TRACE_RECORD).tobytes()


def sample(start: int, *codes: int) -> bytes:
    key = StackKey(pid=PID, depth=len(codes))
    for i, c in enumerate(codes):
        key.code[i] = c
    return record(TRACE_PY_SAMPLE, start) + bytes(key)


def test_a_stream_emits_only_while_started_and_one_capture_at_a_time():
    bpf = FakeBpf()
    stream, got = TraceStream(bpf), []
    bpf.emit(record(1, 10))  # before: the kernel's flag is off
    stream.start([PID], got.append)
    assert stream.running and bpf[TRACE_ON][ctypes.c_int(0)].value == 1
    with pytest.raises(CaptureBusy):
        stream.start([PID], got.append)
    bpf.emit(record(1, 20))
    bpf.emit(record(1, 30, pid=PID + 1))  # another process
    stream.stop()  # what was emitted reaches the sink
    assert not stream.running and not bpf[TRACE_PIDS]
    assert [np.frombuffer(r, TRACE_RECORD)["start_ns"][0] for r in got] == [20]


def test_a_stream_closed_during_a_capture_keeps_what_it_read():
    """A shim reader's process leaves mid-capture: its object is unloaded, the capture goes on without it."""
    bpf = FakeBpf()
    stream, got = TraceStream(bpf), []
    stream.start([PID], got.append)
    bpf.emit(record(1, 20))
    stream.consume()
    bpf[TRACE_LOST][ctypes.c_int(0)] = ctypes.c_uint64(3)
    stream.close()
    stream.consume()
    stream.stop()
    assert len(got) == 1 and stream.lost == 3 and not stream.running


def test_sampled_stacks_are_interned_and_those_beyond_the_bound_counted(monkeypatch):
    monkeypatch.setattr(python_sampler, "MAX_TRACE_STACKS", 2)
    bpf = FakeBpf()
    stream = python_sampler._SampleStream(bpf, lambda key: tuple(Frame(f"f{c:x}", "m.py", 1) for c in key.code[:key.depth]))
    got: list[bytes] = []
    stream.start([PID], got.append)
    for t, codes in enumerate([(0xA, 0xB), (0xA,), (0xA, 0xB), (0xC,)]):  # the last is a third stack
        bpf.emit(sample(t, *codes))
    stream.stop()
    recs = np.frombuffer(b"".join(got), TRACE_RECORD)
    assert recs["seq"].tolist() == [1, 2, 1] and stream.refused == 1
    labels = stream.labels(PID, recs)
    assert labels[(TRACE_PY_SAMPLE, 1)] == (Frame("fa", "m.py", 1), Frame("fb", "m.py", 1))
    assert stream.labels(PID + 1, recs) == {}
    stream.start([PID], got.append)  # a new capture interns afresh
    assert stream.refused == 0


class Lossy(TraceStream):
    """A stream whose kernel side had no room for some events, and that refuses every other record."""

    def __init__(self, bpf, lost: int):
        super().__init__(bpf)
        self.seen = 0
        bpf[TRACE_LOST][ctypes.c_int(0)] = ctypes.c_uint64(lost)

    def intern(self, raw: bytes) -> bytes | None:
        self.seen += 1
        return raw if self.seen % 2 else None


def test_a_capture_counts_what_every_bound_left_out(monkeypatch):
    monkeypatch.setattr(trace_capture, "MAX_EVENTS", 3)
    plain, lossy = FakeBpf(), FakeBpf()
    streams = [TraceStream(plain), Lossy(lossy, lost=5)]

    original = TraceStream.start

    def start(self, pids, sink):  # each stream's kernel side has 4 events once started, and no room for 2 more
        original(self, pids, sink)
        for t in range(4):
            self.bpf.emit(record(1, 100 + t))
        self.bpf[TRACE_LOST][ctypes.c_int(0)] = ctypes.c_uint64(self.bpf[TRACE_LOST].get(0, 0) + 2)

    monkeypatch.setattr(TraceStream, "start", start)
    cap = trace_capture.capture(streams, [PID], 0.01)
    # 4 events from the plain stream, 2 of 4 from the lossy one: 6, of which MAX_EVENTS are kept.
    assert len(cap.events[PID]) == 3 and cap.truncated == 3 + 2
    assert cap.dropped == 2 + 2 and cap.lost == 9
    assert all(not s.running for s in streams)
