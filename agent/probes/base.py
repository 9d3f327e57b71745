"""What a probe kind declares: the library it recognizes, its BPF source and the functions it probes.

A kind without a library (the scheduler) is made of kernel tracepoints, on for every watched process."""
from __future__ import annotations

import re
from dataclasses import dataclass

from rankscope.analyzer.patterns import Role


@dataclass(frozen=True)
class Probe:
    symbol: str  # exported function; the BPF source defines enter_<symbol> (and return_<symbol>)
    role: Role
    returns: bool = True  # also a uretprobe; False for hot calls that are only counted


@dataclass(frozen=True)
class ProbeKind:
    name: str
    library: re.Pattern[str] | None  # matches the basename of the mapped library; None: kernel tracepoints
    source: str  # file in bpf/; its TRACEPOINT_PROBEs attach when the program loads
    probes: tuple[Probe, ...] = ()
    maps: tuple[str, ...] = ()  # its per-process maps (keys with a `pid`), purged when a process is forgotten
