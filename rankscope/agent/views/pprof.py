"""pprof's profile.proto (https://github.com/google/pprof/blob/main/proto/profile.proto), gzipped: `go tool
pprof -http=: FILE` or `pprof` opens it. Every sample carries three values, `samples/count`, `cpu/nanoseconds`
and `wall/nanoseconds` (on plus off CPU); `what` picks the one shown first (default_sample_type). Each rank's
samples carry the labels `rank` and `pid` (`-tagfocus rank=2` keeps one). A frame is one location with one
line, the function's first line (the sampler keeps code objects, not the line being run)."""
from __future__ import annotations

import gzip
from collections.abc import Sequence

from rankscope.agent.interpreters import Frame
from rankscope.agent.views.profile import WHATS, RankProfile
from rankscope.agent.views.protobuf import message, packed, uint

SAMPLE_TYPES = (("samples", "count"), ("cpu", "nanoseconds"), ("wall", "nanoseconds"))


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]  # index 0 is the empty string, by the format
        self.index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        if s not in self.index:
            self.index[s] = len(self.table)
            self.table.append(s)
        return self.index[s]


def pprof(profiles: Sequence[RankProfile], what: str) -> bytes:
    if what not in WHATS:
        raise ValueError(f"what must be one of {WHATS}, not {what!r}")
    s = _Strings()
    ids: dict[Frame, int] = {}  # one function and one location per frame, same id
    body = [message(1, uint(1, s(t)) + uint(2, s(u))) for t, u in SAMPLE_TYPES]
    for p in profiles:
        labels = message(3, uint(1, s("rank")) + uint(3, p.rank)) + message(3, uint(1, s("pid")) + uint(3, p.pid))
        for stack, t in p.stacks.items():
            locations = [ids.setdefault(f, len(ids) + 1) for f in reversed(stack)]  # leaf first, by the format
            cpu_ns = round(t.samples * 1e9 / p.frequency)
            body.append(message(2, packed(1, locations) + packed(2, (t.samples, cpu_ns, cpu_ns + round(t.off_cpu_s * 1e9)))
                                + labels))
    for f, i in ids.items():
        body.append(message(5, uint(1, i) + uint(2, s(f.qualname)) + uint(3, s(f.qualname)) + uint(4, s(f.filename))
                            + uint(5, f.firstlineno)))
        body.append(message(4, uint(1, i) + message(4, uint(1, i) + uint(2, f.firstlineno))))
    if profiles:
        start, end = min(p.start for p in profiles), max(p.end for p in profiles)
        body += [uint(9, round(start * 1e9)), uint(10, round((end - start) * 1e9)),
                 message(11, uint(1, s("cpu")) + uint(2, s("nanoseconds"))),
                 uint(12, round(1e9 / profiles[0].frequency))]
    body.append(uint(14, s(what)))
    body += [message(6, x.encode()) for x in s.table]
    return gzip.compress(b"".join(body))
