"""What a probe kind declares: the library it recognizes, its BPF source and the functions it probes.

A kind without a library (the scheduler) is made of kernel tracepoints, on for every watched process."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rankscope.schema.patterns import Role


@dataclass(frozen=True)
class Probe:
    symbol: str  # exported function (its ELF name: mangled for C++)
    role: Role
    returns: bool = True  # also a uretprobe; False for hot calls that are only counted
    # On a per-call hot path (kernel launches: up to 100k calls/s at ~0.6 us per trap): attached only while
    # the agent records deep detail (agent/detail.py), never in the always-on mode.
    hot: bool = False
    # C identifier naming the probe: the BPF source defines enter_<name> (and return_<name>), the loader
    # FN_<name>, and patterns report the function under it. Defaults to the symbol, when that is one.
    name: str = ""

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.symbol)

    def resolve(self, functions: Mapping[str, int]) -> str | None:
        """The symbol to attach to among a library's defined functions (name -> address); None if absent."""
        return self.symbol if self.symbol in functions else None


class KindUnavailable(Exception):
    """The running kernel cannot host this kind (a tracepoint or structure it reads is missing)."""


@dataclass(frozen=True)
class ProbeKind:
    name: str
    library: re.Pattern[str] | None  # matches the basename of the mapped library; None: kernel tracepoints
    source: str  # file in bpf/; its TRACEPOINT_PROBEs attach when the program loads
    probes: tuple[Probe, ...] = ()
    maps: tuple[str, ...] = ()  # its per-process maps (keys with a `pid`), purged when a process is forgotten
    local_symbols: bool = False  # its functions may be static ones, found in .symtab (unstripped builds)
    identifies_job: bool = True  # mapping this library makes a process a training process (not libpython)
    # -D defines its source needs from the running kernel (structure offsets); raises KindUnavailable.
    kernel_defines: Callable[[], dict[str, int]] | None = None
