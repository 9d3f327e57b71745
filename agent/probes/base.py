"""What a probe kind declares: the library it recognizes, its BPF source and the functions it probes."""
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
    library: re.Pattern[str]  # matches the basename of the mapped library
    source: str  # file in bpf/
    probes: tuple[Probe, ...]
