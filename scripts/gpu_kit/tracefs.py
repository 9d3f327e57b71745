"""Uprobes through tracefs (uprobe_events): the kit's first check of a machine, with no compiler at all.

A uprobe event is written as text, fires into a ring buffer of a tracing instance of the kit's own, and is
read back as text. Function entries are counted; USDT sites (the CUPTI shim's and NCCL plugin's probes) get
their arguments fetched as the SDT note places them, and the site's semaphore offset is the event's
reference counter, so the kernel arms the shim exactly as the agent's BPF probes do (Linux 4.20+). Each event
costs a trap (~1 us) and a line of text: for seconds of a job, not for always-on use.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.agent.host import procfs
from rankscope.agent.host import tracefs as host_tracefs
from rankscope.agent.host.symbols import SdtProbe, file_offset

# x86-64 SDT operand registers -> the names uprobe_events fetches (regs_query_register_offset's).
_REGISTERS = {f"%{r}": f"%{r[1:]}" for r in ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "rip")}
_REGISTERS.update({f"%r{n}": f"%r{n}" for n in range(8, 16)})
_SIZES = {1: "8", 2: "16", 4: "32", 8: "64"}
# "comm-TID (TGID) [cpu] flags seconds: event: (address) field=value ..." (record-tgid on; TGID "-----" unknown)
_LINE = re.compile(r"^\s*(.+)-(\d+)\s+\(\s*([\d-]+)\)\s+\[\d+\]\s+\S+\s+([\d.]+): (\w+): \(0x[0-9a-f]+\)(.*)$")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def _append(path: Path, line: str) -> None:
    """One line written as the shell's >> does (Python's append mode seeks, which tracefs refuses)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class TracefsError(RuntimeError):
    """tracefs is missing, or the kernel refused an event (the message says which)."""


def root() -> Path:
    """The tracefs mount (rankscope's: mounted when nothing is), with uprobe events."""
    path = host_tracefs.root()
    if not (path / "uprobe_events").exists():
        raise TracefsError(f"{path} has no uprobe_events (a kernel without CONFIG_UPROBE_EVENTS)")
    return path


def fetch_arg(operand: str) -> str:
    """One SDT operand ('8@%rdx', '-4@16(%rax)', '8@(%r11)', '8@$0') as an uprobe_events fetch argument."""
    size, _, where = operand.partition("@")
    kind = ("s" if size.startswith("-") else "u") + _SIZES[abs(int(size))]
    if where.startswith("$"):
        return f"\\{int(where[1:], 0)}:{kind}"
    m = re.fullmatch(r"(-?\d*)\((%\w+)\)", where)
    if m:
        offset = int(m.group(1) or 0)
        return f"{'+' if offset >= 0 else '-'}{abs(offset)}({_REGISTERS[m.group(2)]}):{kind}"
    return f"{_REGISTERS[where]}:{kind}"


def string_arg(operand: str) -> str | None:
    """The C string an SDT pointer operand points to, as a fetch argument; None for a constant (NULL)."""
    where = operand.partition("@")[2]
    if where.startswith("$"):
        return None
    return f"+0({fetch_arg(operand).rsplit(':', 1)[0]}):string"


@dataclass
class Event:
    """One line of the trace: the thread and its process, the event's name and fields (numbers as int)."""

    comm: str
    tid: int
    pid: int  # the process (thread group): CUPTI hands records over on a thread of its own
    name: str
    fields: dict[str, int | str] = field(default_factory=dict)


def semaphore(pid: int, path: str, vaddr: int) -> int | None:
    """The value of the USDT semaphore at link-time address `vaddr` of `path` in process `pid` (None: the
    process does not map that part of the file): what the kernel's reference counter set there."""
    inode = os.stat(path).st_ino
    offset = file_offset(path, vaddr)
    for m in procfs.maps(pid):
        if m.inode == inode and m.offset <= offset < m.offset + (m.end - m.start):
            with procfs.ProcessMemory(pid) as mem:
                return int.from_bytes(mem.read(m.start + offset - m.offset, 2), "little")
    return None


class Uprobes:
    """A tracing instance of the kit's own and the uprobe events it defined; close() removes them all."""

    def __init__(self, buffer_kb: int = 16384):
        self.root = root()
        self.group = f"rankscope_kit_{os.getpid()}"  # its own: two kits at once do not collide
        self.instance = self.root / "instances" / self.group
        self.events: list[str] = []
        self.unparsed: list[str] = []  # trace lines read() could not parse (it says so rather than drop them)
        try:
            self.instance.mkdir()
            (self.instance / "buffer_size_kb").write_text(str(buffer_kb))
            (self.instance / "options" / "record-tgid").write_text("1")
        except OSError as e:
            raise TracefsError(f"cannot create the tracing instance {self.instance}: {e}") from e

    def _define(self, name: str, location: str, args: list[str]) -> str:
        line = f"p:{self.group}/{name} {location} {' '.join(args)}".rstrip()
        try:
            _append(self.root / "uprobe_events", line)
        except OSError as e:
            raise TracefsError(f"the kernel refused {line!r}: {e.strerror}") from e
        self.events.append(name)
        (self.instance / "events" / self.group / name / "enable").write_text("1")
        return name

    def function(self, name: str, path: str, vaddr: int) -> str:
        """Counts entries of the function at link-time address `vaddr` of `path` (every process mapping it)."""
        return self._define(name, f"{path}:{file_offset(path, vaddr):#x}", [])

    def usdt(self, name: str, path: str, site: SdtProbe, fields: tuple[str, ...],
             strings: tuple[str, ...] = ()) -> str:
        """An event at one USDT site, its semaphore raised by the kernel while defined; `fields` name the
        probe's arguments in order, those in `strings` read as the C strings they point to."""
        operands = site.args.split()
        if len(operands) != len(fields):
            raise TracefsError(f"{path}: {name} has {len(operands)} arguments, expected {len(fields)}")
        args = []
        for label, operand in zip(fields, operands):
            fetch = string_arg(operand) if label in strings else fetch_arg(operand)
            if fetch is not None:
                args.append(f"{label}={fetch}")
        location = f"{path}:{file_offset(path, site.address):#x}"
        if site.semaphore:
            location += f"({file_offset(path, site.semaphore):#x})"
        return self._define(name, location, args)

    def enable(self, on: bool) -> None:
        """Registers (on) or unregisters every event's uprobe: off, the traced code runs without a trap and a
        USDT semaphore is down again, while the definitions stay for the next `enable(True)`."""
        for name in self.events:
            (self.instance / "events" / self.group / name / "enable").write_text("1" if on else "0")

    def stop(self) -> None:
        """Stops recording (the events stay defined, their semaphores up, until close)."""
        (self.instance / "tracing_on").write_text("0")

    def overruns(self) -> int:
        """Events lost because the instance's buffer was full."""
        total = 0
        for stats in (self.instance / "per_cpu").glob("cpu*/stats"):
            m = re.search(r"^overrun: (\d+)", stats.read_text(), re.M)
            total += int(m.group(1)) if m else 0
        return total

    def read(self) -> list[Event]:
        """Every event recorded so far (not consumed)."""
        out = []
        with open(self.instance / "trace", errors="replace") as f:
            for line in f:
                m = _LINE.match(line)
                if not m:
                    if not line.startswith("#"):
                        self.unparsed.append(line.rstrip()[:200])
                    continue
                comm, tid, tgid, _, name, rest = m.groups()
                fields: dict[str, int | str] = {}
                for key, value in _FIELD.findall(rest):
                    if value == "(fault)":  # a string argument whose pointer is null (a copy's kernel name)
                        continue
                    fields[key] = value[1:-1] if value.startswith('"') else int(value, 0)
                out.append(Event(comm.strip(), int(tid), int(tgid) if tgid.isdigit() else -1, name, fields))
        return out

    def close(self) -> None:
        for name in self.events:
            try:
                (self.instance / "events" / self.group / name / "enable").write_text("0")
            except OSError:
                pass
        try:
            os.rmdir(self.instance)  # tracefs removes an instance with its buffers
        except OSError:
            pass
        for name in self.events:
            try:
                _append(self.root / "uprobe_events", f"-:{self.group}/{name}")
            except OSError:
                pass  # still enabled elsewhere: removed with the next kit's run at the latest
        self.events = []

    def __enter__(self) -> Uprobes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
