"""What a probe kind declares: the library it recognizes, its BPF source and the functions it probes.

A probe's declaration is the one list of a kind's symbols: each names the macro of bpf/common.h that writes
its BPF entry points and that macro's arguments. The program's BPF text is each kind's `.bpf.c` (helpers,
and the few handlers written by hand) followed by one macro line per handler shape (a macro with its
arguments), generated here: the symbols of one shape share its programs, told apart by their BPF cookie.

A kind without a library (the scheduler) is made of kernel tracepoints, on for every watched process."""
from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from rankscope import bpf as bpf_sources
from rankscope.schema.patterns import Role


@dataclass(frozen=True)
class Handler:
    """How a probe's entry points come to be: `macro` of bpf/common.h, given the probe's name and `args`
    (C expressions over `ctx`, the probe's pt_regs), defines enter_<name> and, when it `returns`,
    return_<name>. Written as the C line reads: `LOWER_TIMED("PT_REGS_PARM3(ctx)")`."""

    macro: str | None  # None: the kind's .bpf.c defines the entry points itself
    returns: bool = True  # defines return_<name>: the probe is also a uretprobe
    args: tuple[str, ...] = ()

    def __call__(self, *args: str) -> Handler:
        return replace(self, args=args)

    @property
    def shape(self) -> str:
        """The C identifier of this macro with these arguments: its programs are enter_<shape> (and
        return_<shape>)."""
        digest = hashlib.sha1("\0".join(self.args).encode()).hexdigest()[:8]
        return f"{self.macro.lower()}_{digest}"

    @property
    def bpf_line(self) -> str:
        """The macro line defining its programs (`LOWER_TIMED(lower_timed_1a2b3c4d, PT_REGS_PARM2(ctx))`)."""
        return f"{self.macro}({', '.join((self.shape, *self.args))})"


# The macros of bpf/common.h, with their arguments after the probe's name.
COUNTED = Handler("COUNTED", returns=False)  # (bytes): counted, not timed (hot calls: no uretprobe)
TIMED = Handler("TIMED")  # (bytes)
UPPER_TIMED = Handler("UPPER_TIMED")  # (bytes): the upper layer of an API (CUDA runtime over the driver)
UPPER_SYNC = Handler("UPPER_SYNC")  # ()
LOWER_TIMED = Handler("LOWER_TIMED")  # (bytes): not accounted inside an upper layer's call
LOWER_SYNC = Handler("LOWER_SYNC")  # ()
COLLECTIVE = Handler("COLLECTIVE")  # (bytes, blocking: "true" complete on return, "false" at the next sync)
HAND_WRITTEN = Handler(None)  # enter_<name> and return_<name> are in the kind's .bpf.c


@dataclass(frozen=True)
class Probe:
    symbol: str  # exported function (its ELF name: mangled for C++)
    role: Role
    handler: Handler
    # On a per-call hot path (kernel launches: up to 100k calls/s at ~0.6 us per trap): attached only while
    # the agent records deep detail (agent/detail.py), never in the always-on mode.
    hot: bool = False
    # C identifier naming the probe: patterns report the function under it, and a hand-written handler is
    # enter_<name> (and return_<name>). Defaults to the symbol, when that is one.
    name: str = ""

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.symbol)

    @property
    def returns(self) -> bool:
        """Also a uretprobe; False for hot calls that are only counted."""
        return self.handler.returns

    @property
    def enter_program(self) -> str:
        """The BPF function attached to its entry."""
        return f"enter_{self.name if self.handler.macro is None else self.handler.shape}"

    @property
    def return_program(self) -> str:
        """The BPF function attached to its return (where it `returns`)."""
        return f"return_{self.name if self.handler.macro is None else self.handler.shape}"

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
    # Its calls' category in a trace (agent/views/trace.py): Kineto's name where it has one; default its name.
    trace_category: str = ""

    @property
    def category(self) -> str:
        return self.trace_category or self.name



def bpf_text(kinds: tuple[ProbeKind, ...]) -> str:
    """The kinds' BPF sources as one program, headers inlined: each kind's `source`, then one macro line per
    handler shape of their probes, in the order first declared."""
    lines = dict.fromkeys(p.handler.bpf_line for kind in kinds for p in kind.probes if p.handler.macro is not None)
    return bpf_sources.compose(*(bpf_sources.source(kind.source) for kind in kinds), "".join(f"{l}\n" for l in lines))
