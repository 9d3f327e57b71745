"""What every source of data about watched processes does, so the session can drive them alike.

The session starts each window's pattern of every watched process (who it is, the window's bounds); every
Source then fills its own part: the BPF program's calls, collectives and scheduler times, Python frames,
exact Python timing, the GPU's own view, the host's facts. The session attaches each source to every
process it watches, in the order the sources are listed, and tells each when a process leaves. Adding a
source is one module with a Source subclass and one line in Session.__init__.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from rankscope.agent.detail import Detail
from rankscope.agent.host.targets import Target
from rankscope.agent.loader.trace_stream import TraceStream
from rankscope.schema.patterns import RankPattern


class Source(ABC):
    def attach(self, target: Target) -> None:
        """Start watching `target`'s process. Every source but the BPF program's is optional: one that
        cannot watch a process logs why and leaves that part of its pattern empty; it never raises. (The
        program's raises ProbeError: without it a process has no pattern worth the name.)"""

    def set_detail(self, detail: Detail) -> None:
        """What the next windows record (called right after a window)."""

    @abstractmethod
    def fill(self, patterns: list[RankPattern]) -> None:
        """Add this window's part to each pattern of a process this source watches (or watched until the
        window's processes exited)."""

    def trace_streams(self) -> list[TraceStream]:
        """The streams a trace capture reads from this source's BPF objects (none by default)."""
        return []

    def detach(self, pid: int) -> None:
        """Stop watching `pid` (exited, or no longer wanted); what it did until now still reaches the next
        fill."""

    def forget(self, pid: int) -> None:
        """`pid`'s last pattern is out: drop what was kept for it."""

    def close(self) -> None:
        """Release the source's probes and readers."""
