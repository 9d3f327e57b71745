"""Behavior patterns: the compact per-rank, per-window summary that travels from agents to analyzers.

A pattern says, for one rank and one observation window, how much time the rank spent in each probed
function and what role that function plays (launching work, waiting for its own GPU work, waiting for a
collective, ...), plus the timing of its last few collectives so that ranks can be lined up against each
other (who arrived last, who finished last).  Times are seconds; instants are unix seconds, so patterns
from different nodes compare.  Encoded with msgpack as plain lists and maps (no pickling, no classes).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import msgpack

SCHEMA_VERSION = 1


class Role(str, Enum):
    """What the time spent in a function means for the rank; the analyzer reasons on roles, not names."""

    LAUNCH = "launch"  # host enqueues GPU work (cuLaunchKernel): cheap unless the host is launch-bound
    SYNC = "sync"  # host blocks until its own GPU work is done: the GPU's compute time as the host sees it
    COMM = "comm"  # a collective from enqueue until the host sees it complete (waiting for peers + transfer)
    COPY = "copy"  # host <-> device copies
    ALLOC = "alloc"  # device memory management
    SETUP = "setup"  # one-off calls (init, communicator set-up)


@dataclass
class FunctionStats:
    """Time one rank spent in one probed function during the window."""

    name: str
    role: Role
    count: int
    total_s: float
    max_s: float
    p50_s: float
    p99_s: float
    bytes: int = 0  # payload of collectives and copies


@dataclass
class CollectiveRecord:
    """One collective as one rank saw it: when it was enqueued and when the host saw it complete."""

    op: str
    bytes: int
    enter: float  # unix s
    done: float  # unix s


@dataclass
class RankPattern:
    """Everything the analyzer knows about one rank for one window."""

    job: str
    rank: int
    world_size: int
    pid: int
    host: str
    window_start: float  # unix s
    window_end: float  # unix s
    state: str = "running"  # "running" | "exited"
    functions: dict[str, FunctionStats] = field(default_factory=dict)
    collectives: list[CollectiveRecord] = field(default_factory=list)  # oldest first, bounded
    identity_source: str = "env"  # where rank/world/job came from: "nccl" | "env" | "pid"

    @property
    def window_s(self) -> float:
        return max(self.window_end - self.window_start, 1e-9)

    def time_in(self, role: Role) -> float:
        return sum(f.total_s for f in self.functions.values() if f.role == role)


# --- wire format -------------------------------------------------------------------------------------
# Functions and collectives travel as positional lists: field names would triple the payload.
_FN_FIELDS = ("role", "count", "total_s", "max_s", "p50_s", "p99_s", "bytes")


def _pattern_to_wire(p: RankPattern) -> dict[str, Any]:
    return {
        "v": SCHEMA_VERSION,
        "job": p.job,
        "rank": p.rank,
        "world": p.world_size,
        "pid": p.pid,
        "host": p.host,
        # Instants as integer microseconds: floats travel as float32, too coarse for unix time.
        "start": round(p.window_start * 1e6),
        "end": round(p.window_end * 1e6),
        "state": p.state,
        "id": p.identity_source,
        "fn": {
            name: [f.role.value, f.count, f.total_s, f.max_s, f.p50_s, f.p99_s, f.bytes]
            for name, f in p.functions.items()
        },
        # Collective instants relative to the window end, in microseconds: small ints pack small.
        "coll": [
            [c.op, c.bytes, round((p.window_end - c.enter) * 1e6), round((p.window_end - c.done) * 1e6)]
            for c in p.collectives
        ],
    }


class PatternDecodeError(ValueError):
    """Raised for bytes that are not a well-formed pattern payload."""


def _pattern_from_wire(d: Any) -> RankPattern:
    try:
        if d["v"] != SCHEMA_VERSION:
            raise PatternDecodeError(f"unsupported pattern schema version {d['v']!r}")
        end = int(d["end"]) / 1e6
        functions = {}
        for name, row in d["fn"].items():
            fields = dict(zip(_FN_FIELDS, row, strict=True))
            functions[str(name)] = FunctionStats(
                name=str(name),
                role=Role(fields["role"]),
                count=int(fields["count"]),
                total_s=float(fields["total_s"]),
                max_s=float(fields["max_s"]),
                p50_s=float(fields["p50_s"]),
                p99_s=float(fields["p99_s"]),
                bytes=int(fields["bytes"]),
            )
        collectives = [
            CollectiveRecord(op=str(op), bytes=int(nbytes), enter=end - enter_us / 1e6, done=end - done_us / 1e6)
            for op, nbytes, enter_us, done_us in d["coll"]
        ]
        return RankPattern(
            job=str(d["job"]),
            rank=int(d["rank"]),
            world_size=int(d["world"]),
            pid=int(d["pid"]),
            host=str(d["host"]),
            window_start=int(d["start"]) / 1e6,
            window_end=end,
            state=str(d["state"]),
            identity_source=str(d["id"]),
            functions=functions,
            collectives=collectives,
        )
    except PatternDecodeError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PatternDecodeError(f"malformed pattern: {e!r}") from e


MAX_PAYLOAD_BYTES = 16 * 1024 * 1024


def encode_patterns(patterns: list[RankPattern]) -> bytes:
    # Durations need ~7 significant digits, not 17: float32 halves the payload.
    return msgpack.packb([_pattern_to_wire(p) for p in patterns], use_single_float=True)


def decode_patterns(data: bytes) -> list[RankPattern]:
    """Decode a payload of `encode_patterns`; raises PatternDecodeError for anything malformed."""
    if len(data) > MAX_PAYLOAD_BYTES:
        raise PatternDecodeError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_buffer_size=MAX_PAYLOAD_BYTES)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as e:
        raise PatternDecodeError(f"not msgpack: {e}") from e
    if not isinstance(raw, list):
        raise PatternDecodeError("payload is not a list of patterns")
    return [_pattern_from_wire(d) for d in raw]


def pattern_to_json(p: RankPattern) -> dict[str, Any]:
    """The JSON view served by /v1/patterns: field names spelled out for people and scripts."""
    d = asdict(p)
    for f in d["functions"].values():
        f["role"] = f["role"].value if isinstance(f["role"], Role) else f["role"]
    return d
