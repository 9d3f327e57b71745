"""CPython's internals as the frame sampler needs them: every version-specific offset, in one place.

How a target is read (`inspect(pid)`):

1. Which ELF file runs the interpreter: the executable or a mapped `libpython3.X.so`, whichever defines
   `_PyRuntime` (a dynamic symbol in every build, Debian's stripped static one included), read with
   pyelftools through `/proc/PID/map_files` (the very file mapped; `/proc/PID/root/<path>` as a fallback),
   so processes in containers work.
2. Which version: `Py_Version` (3.11+, read from the file); 3.10 has none and is recognised by defining
   `_PyRuntime` and `PyAIter_Check` (new in 3.10) but not `Py_Version`, its patch level from the version
   string in `.rodata`. A file name that names another version (`libpython3.9.so`) is a contradiction
   and refused.
3. Which layout: 3.10-3.12 from `TABLE` (measured with `offsetof` on each version's internal headers);
   3.13+ from the interpreter's own `_Py_DebugOffsets` at the start of `_PyRuntime` (cookie `xdebugpy`),
   read from the live process, checked for plausibility and compared with the table where there is one.
4. Verification on the live process before anything is loaded into the kernel: the first interpreter's
   first thread state points back to it, every thread state's id is a thread of the process, and the
   code objects of a thread's frames are objects whose type is named "code".

Anything unknown or that does not verify raises `UnsupportedInterpreter`; nothing is guessed.
x86-64 Linux, default (GIL) builds only; free-threaded builds are refused.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass, fields

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from rankscope.agent.host import procfs
from rankscope.agent.host.procfs import Mapping, ProcessMemory
from rankscope.agent.host.symbols import loaded_offset
from rankscope.agent.interpreters import UNKNOWN_CODE, Frame

log = logging.getLogger(__name__)

SUPPORTED = ((3, 10), (3, 11), (3, 12), (3, 13), (3, 14))


class PythonAttachError(Exception):
    """A process cannot be sampled; the message is one line a user can act on."""


class UnsupportedInterpreter(PythonAttachError):
    """The process runs no CPython this module knows how to read (or whose layout does not verify)."""


class InterpreterNotReady(UnsupportedInterpreter):
    """A known CPython whose runtime has no interpreter or thread yet (starting up, or finalizing)."""


@dataclass(frozen=True)
class Layout:
    """Byte offsets into one CPython version's runtime structures (x86-64, GIL build)."""

    version: tuple[int, int]
    source: str  # "table" or "_Py_DebugOffsets"
    runtime_interp_head: int  # _PyRuntime.interpreters.head
    interp_next: int  # PyInterpreterState.next
    interp_tstate_head: int  # PyInterpreterState.threads.head (3.10: tstate_head)
    tstate_next: int
    tstate_interp: int
    tstate_thread_id: int  # pthread_self() of the thread
    tstate_native_thread_id: int | None  # gettid() in the process's pid namespace (3.11+)
    tstate_frame: int  # 3.10 frame; 3.11/3.12 cframe; 3.13+ current_frame
    cframe_current_frame: int | None  # 3.11/3.12: _PyCFrame.current_frame
    frame_previous: int  # PyFrameObject.f_back (3.10) / _PyInterpreterFrame.previous
    frame_code: int  # f_code / f_executable
    frame_owner: int | None  # owner byte, where frames owned by the C stack / interpreter must be skipped
    owner_skip_from: int  # owner values >= this are not Python functions (3.12/3.13 CSTACK=3; 3.14 3 and 4)
    code_tag_mask: int  # low bits of f_executable that tag a stack reference (3.14)
    code_filename: int
    code_name: int
    code_qualname: int | None  # 3.10 has no co_qualname: the name stands in
    code_firstlineno: int  # an int
    unicode_length: int
    unicode_state: int
    unicode_ascii_size: int  # sizeof(PyASCIIObject): where compact ASCII data starts
    unicode_compact_size: int  # sizeof(PyCompactUnicodeObject): where other compact data starts
    ob_type: int = 8
    type_tp_name: int = 24
    interp_runtime: int | None = None  # PyInterpreterState.runtime, a pointer back to _PyRuntime (checked)

    @property
    def match_pthread(self) -> bool:
        """Threads are found by pthread_self() (the TLS base) rather than their kernel id."""
        return self.tstate_native_thread_id is None

    def cflags(self) -> list[str]:
        """The -D macros bpf/python.bpf.c is compiled with."""
        d = {
            "PY_RUNTIME_INTERP_HEAD": self.runtime_interp_head,
            "PY_INTERP_NEXT": self.interp_next,
            "PY_INTERP_TSTATE_HEAD": self.interp_tstate_head,
            "PY_TSTATE_NEXT": self.tstate_next,
            "PY_TSTATE_THREAD_ID": self.tstate_thread_id if self.match_pthread else self.tstate_native_thread_id,
            "PY_TSTATE_FRAME": self.tstate_frame,
            "PY_FRAME_PREVIOUS": self.frame_previous,
            "PY_FRAME_CODE": self.frame_code,
            "PY_CODE_TAG_MASK": self.code_tag_mask,
            "PY_OWNER_SKIP_FROM": self.owner_skip_from,
        }
        if self.cframe_current_frame is not None:
            d["PY_CFRAME_CURRENT_FRAME"] = self.cframe_current_frame
        if self.frame_owner is not None:
            d["PY_FRAME_OWNER"] = self.frame_owner
        flags = [f"-D{k}={v}" for k, v in d.items()]
        if self.match_pthread:
            flags.append("-DPY_MATCH_PTHREAD=1")
        return flags

    def code_header_size(self) -> int:
        """Bytes of a code object that hold everything the resolver reads."""
        offs = [self.ob_type, self.code_filename, self.code_name, self.code_firstlineno]
        if self.code_qualname is not None:
            offs.append(self.code_qualname)
        return max(offs) + 8


# Measured with offsetof() on each version's installed internal headers (Py_BUILD_CORE), x86-64, and
# checked against live processes. 3.13 is only a cross-check: the target's _Py_DebugOffsets win.
TABLE: dict[tuple[int, int], Layout] = {
    (3, 10): Layout(
        version=(3, 10), source="table",
        runtime_interp_head=32, interp_next=0, interp_tstate_head=8,
        tstate_next=8, tstate_interp=16, tstate_thread_id=176, tstate_native_thread_id=None,
        tstate_frame=24, cframe_current_frame=None,
        frame_previous=24, frame_code=32, frame_owner=None, owner_skip_from=3, code_tag_mask=0,
        code_filename=104, code_name=112, code_qualname=None, code_firstlineno=40,
        unicode_length=16, unicode_state=32, unicode_ascii_size=48, unicode_compact_size=72,
        interp_runtime=16,
    ),
    (3, 11): Layout(
        # 3.11 frames have an owner byte (69) but no frame owned by the C stack: nothing to skip.
        version=(3, 11), source="table",
        runtime_interp_head=40, interp_next=0, interp_tstate_head=16,
        tstate_next=8, tstate_interp=16, tstate_thread_id=152, tstate_native_thread_id=160,
        tstate_frame=56, cframe_current_frame=8,
        frame_previous=48, frame_code=32, frame_owner=None, owner_skip_from=3, code_tag_mask=0,
        code_filename=112, code_name=120, code_qualname=128, code_firstlineno=72,
        unicode_length=16, unicode_state=32, unicode_ascii_size=48, unicode_compact_size=72,
        interp_runtime=40,
    ),
    (3, 12): Layout(
        version=(3, 12), source="table",
        runtime_interp_head=40, interp_next=0, interp_tstate_head=72,
        tstate_next=8, tstate_interp=16, tstate_thread_id=136, tstate_native_thread_id=144,
        tstate_frame=56, cframe_current_frame=0,
        frame_previous=8, frame_code=0, frame_owner=70, owner_skip_from=3, code_tag_mask=0,
        code_filename=112, code_name=120, code_qualname=128, code_firstlineno=68,
        unicode_length=16, unicode_state=32, unicode_ascii_size=40, unicode_compact_size=56,
        interp_runtime=96,
    ),
    (3, 13): Layout(
        version=(3, 13), source="table",
        runtime_interp_head=632, interp_next=7264, interp_tstate_head=7344,
        tstate_next=8, tstate_interp=16, tstate_thread_id=152, tstate_native_thread_id=160,
        tstate_frame=72, cframe_current_frame=None,
        frame_previous=8, frame_code=0, frame_owner=70, owner_skip_from=3, code_tag_mask=0,
        code_filename=112, code_name=120, code_qualname=128, code_firstlineno=68,
        unicode_length=16, unicode_state=32, unicode_ascii_size=40, unicode_compact_size=56,
        interp_runtime=7376,
    ),
}

# What _Py_DebugOffsets does not say, per version that has it.
#   owner_skip_from: 3.13 FRAME_OWNED_BY_CSTACK = 3; 3.14 FRAME_OWNED_BY_INTERPRETER = 3, CSTACK = 4.
#   code_tag_mask: 3.14's f_executable is a _PyStackRef whose low bits are tags.
#   compact_extra: sizeof(PyCompactUnicodeObject) - sizeof(PyASCIIObject) (utf8_length, utf8).
_DEBUG_EXTRAS: dict[tuple[int, int], dict[str, int]] = {
    (3, 13): {"owner_skip_from": 3, "code_tag_mask": 0, "compact_extra": 16},
    (3, 14): {"owner_skip_from": 3, "code_tag_mask": 3, "compact_extra": 16},
}

# The layout of _Py_DebugOffsets itself: after char cookie[8], every field is a uint64_t, in this order.
# It changed within 3.14's pre-releases, so a version may have variants: the one whose values pass the
# invariants below is used, and it must be exactly one.
_COMMON_HEAD = [
    ("", ("version", "free_threaded")),
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
]
_THREAD_STATE = ("thread_state", ("size", "prev", "next", "interp", "current_frame", "thread_id",
                                  "native_thread_id", "datastack_chunk", "status"))
_OBJECTS_313 = [
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
]
_OBJECTS_TAIL = [
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
]
_INTERP_313 = ("size", "id", "next", "threads_head", "gc", "imports_modules", "sysdict", "builtins", "ceval_gil",
               "gil_runtime_state", "gil_runtime_state_enabled", "gil_runtime_state_locked",
               "gil_runtime_state_holder")
_INTERP_314_PRE = ("size", "id", "next", "threads_head", "threads_main", "gc", "imports_modules", "sysdict",
                   "builtins", "ceval_gil", "gil_runtime_state", "gil_runtime_state_enabled",
                   "gil_runtime_state_locked", "gil_runtime_state_holder")
_CODE_313 = ("size", "filename", "name", "qualname", "linetable", "firstlineno", "argcount", "localsplusnames",
             "localspluskinds", "co_code_adaptive")
_DEBUG_LAYOUTS: dict[tuple[int, int], dict[str, list[tuple[str, tuple[str, ...]]]]] = {
    # From 3.13.0's installed pycore_runtime.h; checked against the running 3.13.0 here.
    (3, 13): {
        "3.13": _COMMON_HEAD + [
            ("interpreter_state", _INTERP_313), _THREAD_STATE,
            ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus", "owner")),
            ("code_object", _CODE_313),
        ] + _OBJECTS_313 + _OBJECTS_TAIL,
    },
    # From 3.14's pycore_debug_offsets.h, in two revisions; no 3.14 binary was at hand to check them.
    (3, 14): {
        "3.14": _COMMON_HEAD + [
            ("interpreter_state", _INTERP_314_PRE + ("code_object_generation", "tlbc_generation")), _THREAD_STATE,
            ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus", "owner",
                                   "stackpointer", "tlbc_index")),
            ("code_object", _CODE_313 + ("co_tlbc",)),
        ] + _OBJECTS_313 + [("set_object", ("size", "used", "table", "mask"))] + _OBJECTS_TAIL,
        "3.14 (early)": _COMMON_HEAD + [
            ("interpreter_state", _INTERP_314_PRE), _THREAD_STATE,
            ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus", "owner",
                                   "stackpointer")),
            ("code_object", _CODE_313),
        ] + _OBJECTS_313 + [("set_object", ("size", "used", "table", "mask"))] + _OBJECTS_TAIL,
    },
}
DEBUG_COOKIE = b"xdebugpy"

# Facts of every 3.12+ x86-64 build that a misaligned reading of _Py_DebugOffsets would not reproduce.
_DEBUG_INVARIANTS = {
    "pyobject.size": 16, "pyobject.ob_type": 8, "type_object.tp_name": 24, "unicode_object.length": 16,
    "unicode_object.state": 32, "interpreter_frame.previous": 8,
}
_DEBUG_LIMITS = {
    "runtime_state": 4 << 20, "interpreter_state": 4 << 20, "thread_state": 64 << 10, "interpreter_frame": 1024,
    "code_object": 4096, "pyobject": 64, "type_object": 4096, "unicode_object": 256,
}


def debug_offsets_size(minor: int) -> int:
    """Bytes to read for any variant of this version's _Py_DebugOffsets."""
    return 8 + 8 * max(sum(len(fs) for _, fs in v) for v in _DEBUG_LAYOUTS[(3, minor)].values())


def _implausible(d: dict[str, int]) -> str | None:
    """Why these values cannot be a _Py_DebugOffsets, or None."""
    for key, want in _DEBUG_INVARIANTS.items():
        if d[key] != want:
            return f"{key} = {d[key]}, not {want}"
    for sec, limit in _DEBUG_LIMITS.items():
        size = d[f"{sec}.size"]
        if not 0 < size <= limit:
            return f"{sec}.size = {size}"
        for key, value in d.items():
            if key.startswith(sec + ".") and key != f"{sec}.size" and value >= size:
                return f"{key} = {value} >= {sec}.size {size}"
    return None


def parse_debug_offsets(raw: bytes, minor: int) -> dict[str, int]:
    """`section.field -> value` from the bytes at the start of _PyRuntime (3.13+), of the one variant of
    this version's layout that makes sense of them."""
    if raw[:8] != DEBUG_COOKIE:
        raise UnsupportedInterpreter(f"_PyRuntime does not start with the {DEBUG_COOKIE.decode()} cookie")
    variants = _DEBUG_LAYOUTS.get((3, minor))
    if variants is None:
        raise UnsupportedInterpreter(f"no known _Py_DebugOffsets layout for CPython 3.{minor}")
    fits, why = [], []
    for name, layout in variants.items():
        names = [f"{sec}.{f}" if sec else f for sec, fs in layout for f in fs]
        if len(raw) < 8 + 8 * len(names):
            why.append(f"{name}: cut short")
            continue
        d = dict(zip(names, struct.unpack_from(f"<{len(names)}Q", raw, 8), strict=True))
        problem = _implausible(d)
        if problem:
            why.append(f"{name}: {problem}")
        else:
            fits.append(d)
    if len(fits) != 1:
        detail = "; ".join(why) if not fits else "more than one layout fits"
        raise UnsupportedInterpreter(f"_Py_DebugOffsets of CPython 3.{minor} not understood ({detail})")
    return fits[0]


def layout_from_debug_offsets(d: dict[str, int], minor: int) -> Layout:
    """A Layout from the interpreter's own description (already checked by parse_debug_offsets)."""
    if d["free_threaded"]:
        raise UnsupportedInterpreter(f"CPython 3.{minor} free-threaded build is not supported")
    extras = _DEBUG_EXTRAS[(3, minor)]
    lay = Layout(
        version=(3, minor), source="_Py_DebugOffsets",
        runtime_interp_head=d["runtime_state.interpreters_head"],
        interp_next=d["interpreter_state.next"],
        interp_tstate_head=d["interpreter_state.threads_head"],
        tstate_next=d["thread_state.next"],
        tstate_interp=d["thread_state.interp"],
        tstate_thread_id=d["thread_state.thread_id"],
        tstate_native_thread_id=d["thread_state.native_thread_id"],
        tstate_frame=d["thread_state.current_frame"],
        cframe_current_frame=None,
        frame_previous=d["interpreter_frame.previous"],
        frame_code=d["interpreter_frame.executable"],
        frame_owner=d["interpreter_frame.owner"],
        owner_skip_from=extras["owner_skip_from"],
        code_tag_mask=extras["code_tag_mask"],
        code_filename=d["code_object.filename"],
        code_name=d["code_object.name"],
        code_qualname=d["code_object.qualname"],
        code_firstlineno=d["code_object.firstlineno"],
        unicode_length=d["unicode_object.length"],
        unicode_state=d["unicode_object.state"],
        unicode_ascii_size=d["unicode_object.asciiobject_size"],
        unicode_compact_size=d["unicode_object.asciiobject_size"] + extras["compact_extra"],
        ob_type=d["pyobject.ob_type"],
        type_tp_name=d["type_object.tp_name"],
    )
    known = TABLE.get((3, minor))
    if known is not None:
        skip = ("source", "interp_runtime")
        diff = [f.name for f in fields(Layout) if f.name not in skip and getattr(known, f.name) != getattr(lay, f.name)]
        if diff:
            log.info("CPython 3.%d: _Py_DebugOffsets differ from the table in %s; using _Py_DebugOffsets", minor,
                     ", ".join(diff))
    return lay


# ---------------------------------------------------------------------------------------------------------
# The target process: its mapped ELF files and its memory.


def open_memory(pid: int) -> ProcessMemory:
    try:
        return ProcessMemory(pid)
    except FileNotFoundError:
        raise PythonAttachError(f"no such process: {pid}") from None
    except PermissionError:
        raise PythonAttachError(f"not permitted to read the memory of pid {pid}: run as root") from None


def read_maps(pid: int) -> list[Mapping]:
    try:
        return procfs.maps(pid)
    except (FileNotFoundError, ProcessLookupError):
        raise PythonAttachError(f"no such process: {pid}") from None
    except PermissionError:
        raise PythonAttachError(f"not permitted to read /proc/{pid}/maps: run as root") from None


@dataclass(frozen=True)
class ElfFacts:
    path: str  # where the host reads it
    runtime: int | None  # st_value of _PyRuntime (None: not defined here)
    py_version: int | None  # PY_VERSION_HEX from Py_Version (3.11+)
    has_aiter_check: bool  # PyAIter_Check, new in 3.10
    version_string: str | None  # "3.10.13" from .rodata, where Py_Version is absent
    first_load_vaddr: int  # page-aligned p_vaddr of the PT_LOAD at file offset 0
    is_pie: bool


_VERSION_IN_NAME = re.compile(r"(?:^|/)(?:lib)?python(\d+)\.(\d+)")


def _elf_facts(open_path: str, shown_path: str) -> ElfFacts:
    try:
        with open(open_path, "rb") as f:
            elf = ELFFile(f)
            runtime = py_version_addr = None
            has_aiter = False
            dynsym = elf.get_section_by_name(".dynsym")
            if isinstance(dynsym, SymbolTableSection):
                for name in ("_PyRuntime", "Py_Version", "PyAIter_Check"):
                    syms = dynsym.get_symbol_by_name(name) or []
                    sym = next((s for s in syms if s["st_shndx"] != "SHN_UNDEF"), None)
                    if sym is None:
                        continue
                    if name == "_PyRuntime":
                        runtime = sym["st_value"]
                    elif name == "Py_Version":
                        py_version_addr = sym["st_value"]
                    else:
                        has_aiter = True
            py_version = None
            if py_version_addr is not None:
                raw = _read_vaddr(elf, f, py_version_addr, 4)
                py_version = struct.unpack("<I", raw)[0] if raw else None
            version_string = None
            if runtime is not None and py_version is None:
                rodata = elf.get_section_by_name(".rodata")
                if rodata is not None:
                    # PY_VERSION, possibly tail-merged into a longer string ("/versions/3.10.13")
                    found = set(re.findall(rb"(?<![\d.])(3\.\d+\.\d+(?:(?:a|b|rc)\d+)?\+?)\x00", rodata.data()))
                    if len(found) == 1:
                        version_string = found.pop().decode()
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            first = min(loads, key=lambda s: s["p_offset"]) if loads else None
            first_vaddr = (first["p_vaddr"] - first["p_offset"]) & ~0xFFF if first is not None else 0
            return ElfFacts(shown_path, runtime, py_version, has_aiter, version_string, first_vaddr,
                            elf.header["e_type"] == "ET_DYN")
    except (OSError, ELFError) as e:
        raise PythonAttachError(f"cannot read {shown_path} as an ELF file: {e}") from e


def _read_vaddr(elf: ELFFile, f, vaddr: int, size: int) -> bytes | None:
    offset = loaded_offset(elf, vaddr, size)
    if offset is None:
        return None
    f.seek(offset)
    return f.read(size)


def _decode_hex(hexversion: int) -> tuple[tuple[int, int, int], str]:
    major, minor, micro = hexversion >> 24, (hexversion >> 16) & 0xFF, (hexversion >> 8) & 0xFF
    level, serial = (hexversion >> 4) & 0xF, hexversion & 0xF
    text = f"{major}.{minor}.{micro}" + {0xA: f"a{serial}", 0xB: f"b{serial}", 0xC: f"rc{serial}"}.get(level, "")
    return (major, minor, micro), text


@dataclass(frozen=True)
class Interpreter:
    """A CPython process, read and verified: what the sampler needs to watch it."""

    pid: int
    version: str  # "3.12.1"
    elf_path: str  # the file defining _PyRuntime, as the target names it
    runtime: int  # address of _PyRuntime in the target
    layout: Layout
    ns_dev: int  # the target's pid namespace: nsfs device (kernel encoding) and inode
    ns_ino: int
    load_bias: int = 0  # where elf_path is loaded, less its link-time addresses (0 for a non-PIE executable)

    @property
    def minor(self) -> tuple[int, int]:
        return self.layout.version


def _candidates(pid: int, maps: list[Mapping]) -> list[tuple[Mapping, str]]:
    """(first mapping, path as the target names it) of the executable and of every mapped libpython."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = None
    firsts: dict[str, Mapping] = {}
    for m in maps:
        if m.path not in firsts or m.offset < firsts[m.path].offset:
            firsts[m.path] = m
    out = []
    for path, m in firsts.items():
        clean = path.removesuffix(" (deleted)")
        if path == exe or clean == exe or re.search(r"/libpython[^/]*\.so", clean):
            out.append((m, clean))
    out.sort(key=lambda c: 0 if c[1] == exe else 1)
    return out


def _open_path(pid: int, m: Mapping, path: str) -> str:
    by_range = f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}"
    if os.path.exists(by_range):
        return by_range
    return f"/proc/{pid}/root{path}"


def inspect(pid: int) -> Interpreter:
    """Find, identify and verify the CPython interpreter of `pid`; UnsupportedInterpreter if there is none."""
    maps = read_maps(pid)
    facts: ElfFacts | None = None
    first: Mapping | None = None
    seen: list[str] = []
    for m, path in _candidates(pid, maps):
        f = _elf_facts(_open_path(pid, m, path), path)
        seen.append(path)
        if f.runtime is not None:
            facts, first = f, m
            break
    if facts is None or first is None:
        named = [(int(a), int(b)) for p in seen if (mm := _VERSION_IN_NAME.search(p)) for a, b in [mm.groups()]]
        if named:
            v = ".".join(map(str, named[-1]))
            raise UnsupportedInterpreter(
                f"pid {pid} runs CPython {v}, which is not supported (3.10 to 3.14 are)")
        raise UnsupportedInterpreter(
            f"pid {pid} runs no CPython interpreter: no _PyRuntime in {', '.join(seen) or 'its executable'}")

    # The version.
    if facts.py_version is not None:
        (major, minor, _), text = _decode_hex(facts.py_version)
        if (facts.py_version >> 4) & 0xF in (0xA, 0xB):  # internal layouts still move in alphas and betas
            raise UnsupportedInterpreter(f"pid {pid} runs CPython {text}, a pre-release, which is not supported")
    elif facts.has_aiter_check:  # _PyRuntime and PyAIter_Check but no Py_Version: 3.10
        major, minor = 3, 10
        text = facts.version_string or "3.10"
        if not text.startswith("3.10."):
            text = "3.10"
    else:  # 3.7-3.9 define _PyRuntime too
        mm = _VERSION_IN_NAME.search(facts.path)
        v = f"{mm.group(1)}.{mm.group(2)}" if mm else "3.9 or older"
        raise UnsupportedInterpreter(f"pid {pid} runs CPython {v}, which is not supported (3.10 to 3.14 are)")
    mm = _VERSION_IN_NAME.search(facts.path)
    if mm and (int(mm.group(1)), int(mm.group(2))) != (major, minor):
        raise UnsupportedInterpreter(
            f"pid {pid}: {facts.path} is named for CPython {mm.group(1)}.{mm.group(2)} but holds {text}")
    if (major, minor) not in SUPPORTED:
        raise UnsupportedInterpreter(f"pid {pid} runs CPython {text}, which is not supported (3.10 to 3.14 are)")

    # Where _PyRuntime is in the process.
    bias = first.start - first.offset - facts.first_load_vaddr if facts.is_pie else 0
    runtime = facts.runtime + bias

    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
        ns_dev, ns_ino = (os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino
    except OSError as e:
        raise PythonAttachError(f"cannot read the pid namespace of pid {pid}: {e.strerror}") from e

    mem = open_memory(pid)
    try:
        if minor >= 13:
            try:
                raw = mem.read(runtime, debug_offsets_size(minor))
            except OSError as e:
                raise UnsupportedInterpreter(f"pid {pid}: cannot read _PyRuntime at {runtime:#x}: {e}") from e
            d = parse_debug_offsets(raw, minor)
            if (d["version"] >> 24, (d["version"] >> 16) & 0xFF) != (major, minor):
                raise UnsupportedInterpreter(
                    f"pid {pid}: _Py_DebugOffsets says {_decode_hex(d['version'])[1]}, the binary says {text}")
            layout = layout_from_debug_offsets(d, minor)
        else:
            layout = TABLE[(major, minor)]
        for attempt in range(VERIFY_TRIES):
            try:
                verify(mem, pid, runtime, layout, text)
                break
            except InterpreterNotReady:
                raise
            except UnsupportedInterpreter:
                if attempt == VERIFY_TRIES - 1:
                    raise
    finally:
        mem.close()
    return Interpreter(pid, text, facts.path, runtime, layout, ns_dev, ns_ino, bias)


def _ns_tids(pid: int) -> set[int]:
    """The process's thread ids as its own pid namespace numbers them (NSpid's last field)."""
    out = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        out.add(int(line.split()[-1]))
                        break
        except OSError:
            continue
    return out


# The process runs while its frames are walked: a frame popped between two reads can fail a right layout
# once, a wrong layout fails every time.
VERIFY_TRIES = 3


def verify(mem: ProcessMemory, pid: int, runtime: int, layout: Layout, text: str) -> None:
    """Check `layout` against the live process; UnsupportedInterpreter (or InterpreterNotReady) if it fails."""
    where = f"pid {pid} (CPython {text}, offsets from {layout.source})"
    try:
        interp = mem.u64(runtime + layout.runtime_interp_head)
        if interp == 0:
            raise InterpreterNotReady(f"{where}: no interpreter yet (starting up or shutting down)")
        if layout.interp_runtime is not None and mem.u64(interp + layout.interp_runtime) != runtime:
            raise UnsupportedInterpreter(f"{where}: the layout does not verify (interpreter -> runtime)")
        ts = mem.u64(interp + layout.interp_tstate_head)
        if ts == 0:
            raise InterpreterNotReady(f"{where}: no Python thread yet (starting up or shutting down)")
        if mem.u64(ts + layout.tstate_interp) != interp:
            raise UnsupportedInterpreter(f"{where}: the layout does not verify (thread state -> interpreter)")
        tids = _ns_tids(pid) if not layout.match_pthread else set()
        code_type: int | None = None
        frames_seen = torn = 0
        for _ in range(256):  # thread states of the first interpreter
            if ts == 0:
                break
            if mem.u64(ts + layout.tstate_interp) != interp:
                raise UnsupportedInterpreter(f"{where}: the layout does not verify (thread list)")
            if layout.match_pthread:
                if mem.u64(ts + layout.tstate_thread_id) == 0:
                    raise UnsupportedInterpreter(f"{where}: the layout does not verify (thread id)")
            else:
                native = mem.u64(ts + layout.tstate_native_thread_id)
                if tids and native not in tids:
                    raise UnsupportedInterpreter(
                        f"{where}: the layout does not verify (native thread id {native} is no thread of it)")
            frame = mem.u64(ts + layout.tstate_frame)
            if frame and layout.cframe_current_frame is not None:
                frame = mem.u64(frame + layout.cframe_current_frame)
            for _ in range(64):
                if not frame:
                    break
                try:
                    skip = False
                    if layout.frame_owner is not None:
                        skip = mem.read(frame + layout.frame_owner, 1)[0] >= layout.owner_skip_from
                    if not skip:
                        code = mem.u64(frame + layout.frame_code) & ~layout.code_tag_mask
                        if code:
                            t = mem.u64(code + layout.ob_type)
                            if t != code_type:
                                if _type_name(mem, t, layout) != "code":
                                    raise UnsupportedInterpreter(
                                        f"{where}: the layout does not verify (a frame's code is no code object)")
                                code_type = t
                            frames_seen += 1
                    frame = mem.u64(frame + layout.frame_previous)
                except OSError:  # the frame was popped while read (the process runs): the next thread
                    torn += 1
                    break
            ts = mem.u64(ts + layout.tstate_next)
        if torn and not frames_seen:
            raise UnsupportedInterpreter(f"{where}: the layout does not verify (no frame could be read)")
        log.debug("%s verified: %d frames checked", where, frames_seen)
    except OSError as e:
        raise UnsupportedInterpreter(f"{where}: the layout does not verify (unreadable memory: {e})") from e


def _type_name(mem: ProcessMemory, type_addr: int, layout: Layout) -> str | None:
    try:
        name_addr = mem.u64(type_addr + layout.type_tp_name)
        raw = mem.read(name_addr, 32)
    except OSError:
        return None
    return raw.split(b"\x00", 1)[0].decode("ascii", "replace")


# ---------------------------------------------------------------------------------------------------------
# Code objects to names, in user space.


class CodeResolver:
    """Turns code-object addresses of one process into Frames, reading /proc/PID/mem.

    Cached per address; a cached entry is trusted only while the code object's header (type, name and
    file pointers, first line) still reads the same, so an address reused by another code object after
    the first was freed is resolved afresh.
    """

    MAX_STR = 4096

    def __init__(self, interp: Interpreter):
        self.interp = interp
        self.layout = interp.layout
        self.mem = open_memory(interp.pid)
        self._hdr = self.layout.code_header_size()
        self._frames: dict[int, tuple[bytes, Frame]] = {}
        self._type_names: dict[int, str | None] = {}

    def close(self) -> None:
        self.mem.close()

    def _type_is(self, type_addr: int, name: str) -> bool:
        if type_addr not in self._type_names:
            self._type_names[type_addr] = _type_name(self.mem, type_addr, self.layout)
        return self._type_names[type_addr] == name

    def resolve(self, code: int) -> Frame:
        lay = self.layout
        try:
            hdr = self.mem.read(code, self._hdr)
        except OSError:
            return UNKNOWN_CODE
        fp = self._fingerprint(hdr)
        cached = self._frames.get(code)
        if cached is not None and cached[0] == fp:
            return cached[1]
        ptr = lambda off: struct.unpack_from("<Q", hdr, off)[0]  # noqa: E731
        if not self._type_is(ptr(lay.ob_type), "code"):
            return UNKNOWN_CODE
        filename = self.string(ptr(lay.code_filename))
        name = self.string(ptr(lay.code_qualname if lay.code_qualname is not None else lay.code_name))
        firstlineno = struct.unpack_from("<i", hdr, lay.code_firstlineno)[0]
        if filename is None or name is None:
            return UNKNOWN_CODE
        frame = Frame(name, filename, firstlineno)
        self._frames[code] = (fp, frame)
        return frame

    def _fingerprint(self, hdr: bytes) -> bytes:
        lay = self.layout
        offs = [lay.ob_type, lay.code_filename, lay.code_name]
        if lay.code_qualname is not None:
            offs.append(lay.code_qualname)
        return b"".join(hdr[o : o + 8] for o in offs) + hdr[lay.code_firstlineno : lay.code_firstlineno + 4]

    def string(self, addr: int) -> str | None:
        """A str object's value (compact strings: every name and file name of a code object)."""
        lay = self.layout
        try:
            hdr = self.mem.read(addr, lay.unicode_compact_size + 8)
            if not self._type_is(struct.unpack_from("<Q", hdr, lay.ob_type)[0], "str"):
                return None
            length = struct.unpack_from("<q", hdr, lay.unicode_length)[0]
            state = struct.unpack_from("<I", hdr, lay.unicode_state)[0]
            kind, compact, ascii_ = (state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1
            if length < 0 or kind not in (1, 2, 4):
                return None
            n = min(length, self.MAX_STR)
            if compact and ascii_:
                return self.mem.read(addr + lay.unicode_ascii_size, n).decode("ascii", "replace")
            if compact:
                data = addr + lay.unicode_compact_size
            else:  # a legacy string (3.10/3.11): PyUnicodeObject.data.any follows the compact part
                data = struct.unpack_from("<Q", hdr, lay.unicode_compact_size)[0]
            raw = self.mem.read(data, n * kind)
            return raw.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], "replace")
        except OSError:
            return None



# ---------------------------------------------------------------------------------------------------------
# Stacks of threads read from user space: the frame sampler's walk, for threads that went to sleep before the
# process was watched (the kernel only sees a stack when a thread leaves a CPU).

MAX_TSTATES = 256  # thread states searched, over all interpreters (PY_MAX_TSTATES in python.bpf.c)


@dataclass(frozen=True)
class ThreadStack:
    """One thread state's stack, walked exactly as bpf/python.bpf.c walks it."""

    thread_id: int  # as the interpreter records it: native_thread_id (3.11+) or pthread_self() (3.10)
    codes: tuple[int, ...]  # code-object addresses, innermost first, at most max_depth
    truncated: bool  # more frames than max_depth (or than the walk's step bound)
    partial: bool  # a frame link could not be read: the outer part is missing


def thread_stacks(mem: ProcessMemory, runtime: int, layout: Layout, max_depth: int) -> list[ThreadStack] | None:
    """Every thread state's stack (at most MAX_TSTATES), or None if the interpreter list cannot be read.

    Meant for threads that are asleep: their frames do not move while they are read."""

    def ptr(addr: int) -> int:
        try:
            return mem.u64(addr)
        except OSError:
            return 0

    interp = ptr(runtime + layout.runtime_interp_head)
    if not interp:
        return None
    id_off = layout.tstate_thread_id if layout.match_pthread else layout.tstate_native_thread_id
    # One read per thread state and per frame, of the bytes spanning the fields, as the program reads them.
    ts_span = max(layout.tstate_next, id_off) + 8
    frame_span = max(layout.frame_previous, layout.frame_code) + 8
    if layout.frame_owner is not None:
        frame_span = max(frame_span, layout.frame_owner + 1)
    u64 = lambda raw, off: struct.unpack_from("<Q", raw, off)[0]  # noqa: E731
    out: list[ThreadStack] = []
    ts = ptr(interp + layout.interp_tstate_head)
    for _ in range(MAX_TSTATES):
        if not ts:
            interp = ptr(interp + layout.interp_next)
            if not interp:
                break
            ts = ptr(interp + layout.interp_tstate_head)
            continue
        try:
            ts_hdr = mem.read(ts, ts_span)
        except OSError:
            ts = 0
            continue
        frame = ptr(ts + layout.tstate_frame)
        if frame and layout.cframe_current_frame is not None:
            frame = ptr(frame + layout.cframe_current_frame)
        codes: list[int] = []
        truncated = partial = False
        for _ in range(max_depth + 32):
            if not frame:
                break
            try:
                hdr = mem.read(frame, frame_span)
            except OSError:
                partial = True
                break
            if layout.frame_owner is None or hdr[layout.frame_owner] < layout.owner_skip_from:
                code = u64(hdr, layout.frame_code) & ~layout.code_tag_mask
                if code:
                    if len(codes) >= max_depth:
                        truncated = True
                        break
                    codes.append(code)
            frame = u64(hdr, layout.frame_previous)
        if frame and not (truncated or partial):
            truncated = True
        out.append(ThreadStack(u64(ts_hdr, id_off), tuple(codes), truncated, partial))
        ts = u64(ts_hdr, layout.tstate_next)
    return out


_PTHREAD_TID_OFFSETS: dict[tuple[str, int], int | None] = {}  # (libc path, inode) -> offset


def pthread_tid_offset(pid: int) -> int | None:
    """Where glibc keeps a thread's id in its `struct pthread` (pthread_self() points to it), as the target's
    own glibc tells its debuggers (`_thread_db_pthread_tid`: bits, count, offset); None where there is no
    such glibc (musl, a static binary)."""
    try:
        maps = read_maps(pid)
    except PythonAttachError:
        return None
    firsts: dict[str, Mapping] = {}
    for m in maps:
        if m.path not in firsts or m.offset < firsts[m.path].offset:
            firsts[m.path] = m
    for path, m in firsts.items():
        clean = path.removesuffix(" (deleted)")
        if not re.search(r"/lib(c|pthread)\.so(\.\d+)*$", clean):
            continue
        key = (clean, m.inode)
        if key not in _PTHREAD_TID_OFFSETS:
            try:
                _PTHREAD_TID_OFFSETS[key] = _thread_db_tid_offset(_open_path(pid, m, clean))
            except (OSError, ELFError):
                continue
        if _PTHREAD_TID_OFFSETS[key] is not None:
            return _PTHREAD_TID_OFFSETS[key]
    return None


def _thread_db_tid_offset(path: str) -> int | None:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        dynsym = elf.get_section_by_name(".dynsym")
        if not isinstance(dynsym, SymbolTableSection):
            return None
        syms = dynsym.get_symbol_by_name("_thread_db_pthread_tid") or []
        sym = next((s for s in syms if s["st_shndx"] != "SHN_UNDEF"), None)
        raw = _read_vaddr(elf, f, sym["st_value"], 12) if sym is not None else None
    if not raw:
        return None
    bits, count, offset = struct.unpack("<3I", raw)
    return offset if bits == 32 and count == 1 and offset < 4096 else None


def task_status(pid: int) -> dict[int, dict[str, str]]:
    """tid -> the fields of /proc/PID/task/TID/status, for every thread still there."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                out[int(tid)] = dict((k, v.strip()) for k, v in (line.split(":", 1) for line in f if ":" in line))
        except OSError:
            continue
    return out


def ns_tid_map(pid: int) -> dict[int, int]:
    """The process's threads: id in its own pid namespace -> id on the host (NSpid's last and first fields)."""
    out = {}
    for status in task_status(pid).values():
        ids = status.get("NSpid", "").split()
        if ids:
            out[int(ids[-1])] = int(ids[0])
    return out
