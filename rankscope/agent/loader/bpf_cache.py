"""Compiled BPF programs kept on the node, so that only the first process on a kernel compiles them.

bcc compiles C with clang/LLVM inside the process that loads it: ~1.5 s of CPU and ~100 MB of resident
memory for each of rankscope's programs, paid by every `diagnose` and every agent start before a window can
open (scripts/bench attach), and on a loaded node by the job. What a compile produces is fixed by its
source, its flags, the compiler and the kernel headers it reads: each function's instructions, which name
the maps they use by file descriptor, and the maps' definitions. An entry keeps exactly those, in one file
per program, named by a hash of everything that decides them. A later process creates the maps afresh,
writes their descriptors into the instructions and hands them to the kernel's verifier, as bcc would have:
no compiler is loaded.

What a hit costs: reading the file, one HMAC over it, and one bpf(2) call per map and per program loaded
(the verifier's pass stays). What it keeps: a kernel, kernel headers, bcc or LLVM build, program text or
flag that differs gives another key, so another entry; a program the kernel refuses from an entry is
reported as bcc reports a refused program, and the entry is deleted so that the next process compiles. A
program this cache cannot describe (a map type or attach style it does not know) is simply not kept.
Trust: an entry is code the kernel runs. host/node_cache.py reads entries only from a directory and a file
that only this user can write to, and writes them whole (a temporary file renamed into place); each is sealed with an HMAC-SHA256 over their
key and bytes; an entry whose seal does not match (changed, copied from another key, or written with
another secret) is compiled afresh and replaced. The secret is the file $RANKSCOPE_BPF_CACHE_KEY names (the
chart mounts it from its Secret); without one, a random key made once in the cache directory (readable by
this user only) seals the node's entries.
"""
from __future__ import annotations

import atexit
import base64
import ctypes
import hashlib
import hmac
import json
import logging
import os
import platform
import re
import secrets
import stat
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from bcc import BPF
from bcc import table as bcc_table
from bcc.libbcc import lib
from bcc.utils import get_possible_cpus
from bcc.version import __version__ as bcc_version

from rankscope.agent.host import node_cache
from rankscope.agent.host.node_cache import ENV, directory  # noqa: F401 - the cache's setting, named here too
from rankscope.agent.loader import bpf_syscall

log = logging.getLogger(__name__)

FORMAT = 2  # of an entry file; part of the key
KEY_ENV = "RANKSCOPE_BPF_CACHE_KEY"  # a file holding the secret that seals entries (the chart's Secret)
NODE_KEY = ".key"  # in the cache directory: the secret made on first use when KEY_ENV names no file
MIN_SECRET = 16  # bytes; a shorter secret is refused
SEAL = b"hmac-sha256:"  # an entry's first line: this, the HMAC's hex digest, a newline; then the entry's JSON
MAPS = "/proc/self/maps"
PT_NOTE, NT_GNU_BUILD_ID = 4, 3
# The libraries that compile: bcc's and the LLVM/clang it links (their ELF build ids go into the key).
COMPILER = re.compile(r"/lib(bcc|LLVM|clang)[^/]*\.so[^/]*$")
# What bcc reads of a kernel build tree (include/generated, the configuration): the headers' identity.
HEADER_FILES = ("include/generated/autoconf.h", "include/generated/utsrelease.h",
                "include/generated/uapi/linux/version.h", "include/config/kernel.release", ".config")
# Entries kept, the least recently used beyond it removed when one is written: a program's text changes with
# each rankscope version, its flags with each CPython version watched (layout offsets), so old entries pile up.
MAX_ENTRIES = 64

INSN_SIZE = 8
LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: a 64-bit constant over two instructions
PSEUDO_MAP_FD, PSEUDO_MAP_VALUE = 1, 2  # its source register when the constant is a map's fd
# Functions bcc attaches by their name's prefix through the kernel's BTF, which an entry does not keep
# (the other prefixes bcc attaches by name, kprobe__ and tracepoint__ ones, CachedBPF._autoload attaches).
NOT_KEPT = ("kfunc__", "kretfunc__", "lsm__")
# The map types rankscope's programs use, and bcc's Python class for each (bcc.table.Table chooses one by
# asking the compiled module, which a cached program does not have).
TABLES: dict[int, type] = {
    1: bcc_table.HashTable, 2: bcc_table.Array, 4: bcc_table.PerfEventArray, 5: bcc_table.PerCpuHash,
    6: bcc_table.PerCpuArray, 9: bcc_table.LruHash, 27: bcc_table.RingBuf,
}
NAMED_TABLES = (bcc_table.PerfEventArray, bcc_table.RingBuf)  # bcc passes these their name
REDUCED_TABLES = (bcc_table.PerCpuHash, bcc_table.PerCpuArray)  # and these a reducer


class CacheError(Exception):
    """An entry could not be used; the program is compiled instead."""


@dataclass(frozen=True)
class MapDef:
    """One map as the compile created it (the kernel's view of its fd) and bcc's type descriptions."""

    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: str  # JSON, as bcc's module gives it: the ctypes types of keys and values are built from these
    leaf_desc: str


@dataclass(frozen=True)
class FunctionDef:
    """One function's instructions, and where they name a map: (instruction index, index into the maps)."""

    name: str
    insns: bytes
    map_refs: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Entry:
    license: str
    kern_version: int
    maps: tuple[MapDef, ...]
    functions: tuple[FunctionDef, ...]

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "license": self.license, "kern_version": self.kern_version,
            "maps": [m.__dict__ for m in self.maps],
            "functions": [{"name": f.name, "insns": base64.b64encode(f.insns).decode(),
                           "map_refs": [list(r) for r in f.map_refs]} for f in self.functions]})

    @classmethod
    def from_json(cls, text: str) -> Entry:
        try:
            doc = json.loads(text)
            if doc["format"] != FORMAT:
                raise CacheError(f"format {doc['format']}")
            maps = tuple(MapDef(**m) for m in doc["maps"])
            functions = tuple(FunctionDef(f["name"], base64.b64decode(f["insns"], validate=True),
                                          tuple((int(i), int(m)) for i, m in f["map_refs"]))
                              for f in doc["functions"])
            entry = cls(str(doc["license"]), int(doc["kern_version"]), maps, functions)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CacheError(f"malformed entry: {e}") from e
        for f in functions:
            if len(f.insns) % INSN_SIZE or any(not (0 <= i < len(f.insns) // INSN_SIZE and 0 <= m < len(maps))
                                               for i, m in f.map_refs):
                raise CacheError(f"malformed entry: function {f.name}")
        return entry


def key(text: str, cflags: list[str]) -> str:
    """What decides a compile's output: the program, its flags, the compiler (bcc's version, the build ids
    of libbcc and the LLVM/clang it links), the kernel headers bcc reads, the running kernel (its release and
    build) and the number of possible CPUs (the size of per-CPU arrays)."""
    uname = platform.uname()
    h = hashlib.sha256()
    for part in (str(FORMAT), bcc_version, compiler_id(MAPS), headers_id(*kernel_headers()), uname.release,
                 uname.version, uname.machine, str(len(get_possible_cpus())), "\0".join(cflags), text):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()[:40]


@cache
def compiler_id(maps: str) -> str:
    """The ELF build ids of the compiling libraries this process maps (libbcc, libLLVM, libclang), read once
    a process: a rebuilt or upgraded LLVM gives another id even where its version string stays."""
    with open(maps) as f:
        mapped = {fields[5].strip() for fields in (line.split(None, 5) for line in f) if len(fields) == 6}
    paths = sorted(p for p in mapped if COMPILER.search(p))
    return ";".join(f"{os.path.basename(p)}={_build_id(p)}" for p in paths)


def _build_id(path: str) -> str:
    """The file's GNU build id (from its PT_NOTE segments: a few small reads, where parsing the whole ELF of
    libLLVM would cost ~0.1 s); where it has none, its size and modification time stand in."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] == b"\x7fELF" and head[4:6] == b"\x02\x01":  # 64-bit, little-endian
                phoff, = struct.unpack_from("<Q", head, 32)
                phentsize, phnum = struct.unpack_from("<HH", head, 54)
                f.seek(phoff)
                table = f.read(phentsize * phnum)
                for i in range(phnum):
                    p_type, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
                    if p_type == PT_NOTE:
                        f.seek(offset)
                        found = _gnu_build_id(f.read(min(filesz, 4096)))
                        if found:
                            return found
            st = os.fstat(f.fileno())
    except (OSError, struct.error) as e:
        return f"unreadable:{e}"
    return f"{st.st_size}:{st.st_mtime_ns}"


def _gnu_build_id(notes: bytes) -> str | None:
    at = 0
    while at + 12 <= len(notes):
        namesz, descsz, kind = struct.unpack_from("<III", notes, at)
        name_at = at + 12
        desc_at = name_at + (namesz + 3) // 4 * 4
        if kind == NT_GNU_BUILD_ID and notes[name_at:name_at + namesz] == b"GNU\0":
            return notes[desc_at:desc_at + descsz].hex()
        at = desc_at + (descsz + 3) // 4 * 4
    return None


def kernel_headers() -> tuple[str, str]:
    """The build and source trees bcc compiles against, as it picks them: $BCC_KERNEL_SOURCE for both, else
    /lib/modules/<release>/{build,source}; resolved, so that relinking them to other headers changes the key."""
    override = os.environ.get("BCC_KERNEL_SOURCE")
    if override:
        return os.path.realpath(override), os.path.realpath(override)
    base = f"/lib/modules/{platform.release()}"
    return os.path.realpath(f"{base}/build"), os.path.realpath(f"{base}/source")


@cache
def headers_id(build: str, source: str) -> str:
    """A hash of what tells kernel header trees apart: their paths, the build tree's generated headers and
    configuration, and the source tree's Makefile's size and time (hashing every header would cost more than
    a compile). Read once a process for a pair of trees; absent files count as absent (bcc then falls back on
    the kernel's own kheaders, which the kernel's release and build in the key name)."""
    h = hashlib.sha256(f"{build}\0{source}\0".encode())
    for name in HEADER_FILES:
        try:
            with open(os.path.join(build, name), "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        except OSError:
            h.update(name.encode() + b"\0absent")
    try:
        st = os.stat(os.path.join(source, "Makefile"))
        h.update(f"source {st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        h.update(b"source absent")
    return h.hexdigest()


def load(text: str, cflags: list[str]) -> CachedBPF | None:
    """The program from its entry, maps created; None when there is no usable entry."""
    if directory() is None:
        return None
    name = key(text, cflags)
    found = node_cache.read(f"{name}.json", touch=True)  # used now: what the pruning of old entries goes by
    if found is None:
        return None
    path, data = found
    try:
        sealing = secret(path.parent)
        if sealing is None:
            return None
        entry = Entry.from_json(unseal(sealing, name, data))
    except (OSError, CacheError) as e:
        log.warning("BPF cache entry %s unusable, compiling instead: %s", path, e)
        node_cache.remove(path)
        return None
    try:
        return CachedBPF(entry, path)
    except CacheError as e:  # the maps: what a compile would also need (memory, privileges)
        log.warning("BPF program from cache entry %s not loaded, compiling instead: %s", path, e)
        return None
    except Exception as e:  # noqa: BLE001 - bcc raises bare Exception; whatever an entry does, the compile decides
        log.warning("BPF program from cache entry %s not loaded, compiling instead: %s", path, e)
        node_cache.remove(path)
        return None


def store(text: str, cflags: list[str], bpf: Any) -> None:
    """Keeps bcc's freshly compiled `bpf` (no function loaded yet matters not: the bytes are the module's)."""
    if directory() is None:
        return
    try:
        entry = describe(bpf)
    except Exception as e:  # noqa: BLE001 - a program the cache cannot keep still loads, compiled
        log.debug("BPF program not cached: %s", e)
        return
    root = node_cache.ensure()
    sealing = secret(root) if root is not None else None
    if sealing is None:
        return
    name = key(text, cflags)
    if node_cache.write(f"{name}.json", seal(sealing, name, entry.to_json().encode())) is not None:
        _prune(root)


def seal(mac_key: bytes, name: str, body: bytes) -> bytes:
    """An entry's bytes: its seal line (HMAC-SHA256 of its key and body under `mac_key`), then the body."""
    return SEAL + _mac(mac_key, name, body).encode() + b"\n" + body


def unseal(mac_key: bytes, name: str, data: bytes) -> str:
    """The body of a sealed entry kept under key `name`; CacheError when its seal is absent or wrong."""
    head, _, body = data.partition(b"\n")
    if not head.startswith(SEAL):
        raise CacheError("not sealed")
    if not hmac.compare_digest(head[len(SEAL):], _mac(mac_key, name, body).encode()):
        raise CacheError("its seal does not match its bytes (changed, or sealed with another secret)")
    return body.decode()


def _mac(mac_key: bytes, name: str, body: bytes) -> str:
    # The key is sealed with the body: an entry copied under another program's or toolchain's name fails.
    return hmac.new(mac_key, name.encode() + b"\0" + body, hashlib.sha256).hexdigest()


def secret(root: Path) -> bytes | None:
    """The secret that seals entries: the file $RANKSCOPE_BPF_CACHE_KEY names, else the node's own key in
    `root` (made on first use, 0600). None (with a warning) when neither is usable: nothing is cached."""
    configured = os.environ.get(KEY_ENV)
    if configured:
        try:
            with open(configured, "rb") as f:
                value = f.read().strip()
            if len(value) >= MIN_SECRET:
                return value
            log.warning("the BPF cache's key %s is shorter than %d bytes: using the node's own", configured,
                        MIN_SECRET)
        except OSError as e:
            log.debug("no BPF cache key at %s (%s): using the node's own", configured, e.strerror)
    return _node_secret(root / NODE_KEY)


def _node_secret(path: Path) -> bytes | None:
    """The node's random key at `path`, made when absent; used only when this user alone can read it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
    except FileExistsError:
        pass  # made by an earlier process
    except OSError as e:
        log.warning("not caching BPF programs: cannot make the key %s: %s", path, e.strerror)
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                log.warning("not caching BPF programs: the key %s is readable or writable by others", path)
                return None
            value = f.read().strip()
    except OSError as e:
        log.warning("not caching BPF programs: cannot read the key %s: %s", path, e.strerror)
        return None
    if len(value) < MIN_SECRET:  # another process between its create and its write: this one compiles
        return None
    return value


def _prune(root: Path) -> None:
    """Removes the least recently used entries beyond MAX_ENTRIES."""
    entries = []
    for p in root.glob("*.json"):
        try:
            entries.append((p.stat().st_mtime, p))
        except OSError:
            continue
    for _, p in sorted(entries, reverse=True)[MAX_ENTRIES:]:
        node_cache.remove(p)


def describe(bpf: Any) -> Entry:
    """The entry for bcc's compiled module of `bpf`; CacheError where it holds what an entry cannot."""
    mod, c = bpf.module, _libbcc()
    maps: list[MapDef] = []
    index_of_fd: dict[int, int] = {}
    for i in range(c.bpf_num_tables(mod)):
        name = c.bpf_table_name(mod, i).decode()
        fd = c.bpf_table_fd_id(mod, i)
        if fd < 0:
            raise CacheError(f"map {name} has no fd")
        info = _map_info(fd)
        if info.type not in TABLES:
            raise CacheError(f"map {name} is of type {info.type}")
        index_of_fd[fd] = len(maps)
        maps.append(MapDef(name, info.type, info.key_size, info.value_size, info.max_entries, info.map_flags,
                           (c.bpf_table_key_desc_id(mod, i) or b"").decode(),
                           (c.bpf_table_leaf_desc_id(mod, i) or b"").decode()))
    functions: list[FunctionDef] = []
    for i in range(lib.bpf_num_functions(mod)):
        name = lib.bpf_function_name(mod, i).decode()
        if name.startswith(NOT_KEPT):
            raise CacheError(f"function {name} attaches through BTF")
        insns = ctypes.string_at(c.bpf_function_start_id(mod, i), c.bpf_function_size_id(mod, i))
        refs = []
        for at in _map_constants(insns):
            fd = int.from_bytes(insns[at * INSN_SIZE + 4 : at * INSN_SIZE + 8], "little", signed=True)
            if fd not in index_of_fd:
                raise CacheError(f"function {name} names fd {fd}, not one of its maps")
            refs.append((at, index_of_fd[fd]))
        functions.append(FunctionDef(name, insns, tuple(refs)))
    return Entry(lib.bpf_module_license(mod).decode(), lib.bpf_module_kern_version(mod), tuple(maps),
                 tuple(functions))


def _map_constants(insns: bytes) -> list[int]:
    """Indexes of the 64-bit constants that are map fds (ld_imm64 with a pseudo map source register)."""
    out, at, n = [], 0, len(insns) // INSN_SIZE
    while at < n:
        code, regs = insns[at * INSN_SIZE], insns[at * INSN_SIZE + 1]
        if code == LD_IMM64:
            if regs >> 4 in (PSEUDO_MAP_FD, PSEUDO_MAP_VALUE):
                out.append(at)
            at += 2
        else:
            at += 1
    return out


class CachedBPF(BPF):
    """bcc's BPF object for a program from an entry: the same tables, attach and detach methods (bcc's own,
    which reach the program through load_func and get_table, both answered here), without a module."""

    def __init__(self, entry: Entry, path: Path):  # pylint: disable=super-init-not-called
        # What BPF.__init__ sets up besides the module, which a cached program does not have.
        self.kprobe_fds, self.uprobe_fds, self.tracepoint_fds, self.raw_tracepoint_fds = {}, {}, {}, {}
        self.kfunc_entry_fds, self.kfunc_exit_fds, self.lsm_fds = {}, {}, {}
        self.perf_buffers, self.open_perf_events = {}, {}
        self._ringbuf_manager = None
        self.tracefile = None
        self.debug = 0
        self.funcs, self.tables = {}, {}
        self.module = None
        self._entry, self._path = entry, path
        self._functions = {f.name.encode(): f for f in entry.functions}
        self._map_index = {m.name.encode(): i for i, m in enumerate(entry.maps)}
        self._map_fds: list[int] = []
        try:
            for m in entry.maps:
                self._map_fds.append(_create_map(m))
        except OSError as e:
            self._close_maps()
            raise CacheError(f"cannot create its maps: {e.strerror}") from e
        atexit.register(self.cleanup)
        self._autoload()

    def _autoload(self) -> None:
        """Attaches what bcc attaches by name right after its compile (BPF._trace_autoload)."""
        for name in self._functions:
            if name.startswith(b"kprobe__"):
                self.attach_kprobe(event=self.fix_syscall_fnname(name[8:]), fn_name=name)
            elif name.startswith(b"kretprobe__"):
                self.attach_kretprobe(event=self.fix_syscall_fnname(name[11:]), fn_name=name)
            elif name.startswith(b"tracepoint__"):
                self.attach_tracepoint(tp=name[len(b"tracepoint__"):].replace(b"__", b":"), fn_name=name)
            elif name.startswith(b"raw_tracepoint__"):
                self.attach_raw_tracepoint(tp=name[len(b"raw_tracepoint__"):], fn_name=name)

    def load_func(self, func_name, prog_type, device=None, attach_type=-1):
        func_name = func_name.encode() if isinstance(func_name, str) else func_name
        if func_name in self.funcs:
            return self.funcs[func_name]
        f = self._functions.get(func_name)
        if f is None:
            raise Exception(f"Unknown program {func_name.decode()}")  # as bcc words it
        try:
            fd = _load_program(f, [self._map_fds[m] for _, m in f.map_refs], prog_type, self._entry,
                               0 if attach_type == -1 else attach_type)
        except OSError as e:
            log.warning("the kernel refused %s from BPF cache entry %s (%s); the next start compiles it",
                        func_name.decode(), self._path, e.strerror)
            node_cache.remove(self._path)
            raise Exception(f"Failed to load BPF program {func_name.decode()}: {e.strerror}") from e
        fn = BPF.Function(self, func_name, fd)
        self.funcs[func_name] = fn
        return fn

    def get_table(self, name, keytype=None, leaftype=None, reducer=None):
        name = name.encode() if isinstance(name, str) else name
        if name not in self._map_index:
            raise KeyError(name)
        i = self._map_index[name]
        m = self._entry.maps[i]
        keytype = keytype or BPF._decode_table_type(json.loads(m.key_desc))
        leaftype = leaftype or BPF._decode_table_type(json.loads(m.leaf_desc))
        cls = TABLES[m.type]
        kwargs: dict[str, Any] = {"reducer": reducer} if issubclass(cls, REDUCED_TABLES) else {}
        args = (self, i, self._map_fds[i], keytype, leaftype) + ((name,) if issubclass(cls, NAMED_TABLES) else ())
        t = cls(*args, **kwargs)
        # TableBase asked the (absent) module for these.
        t.ttype, t.flags, t.max_entries = m.type, m.flags, m.max_entries
        return t

    def close(self):
        super().close()
        self._close_maps()

    def _close_maps(self) -> None:
        for fd in self._map_fds:
            os.close(fd)
        self._map_fds = []


# -- the kernel's side ------------------------------------------------------------------------------------------

class _MapInfo(ctypes.Structure):
    """struct bpf_map_info's first fields (the kernel fills what fits)."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32), ("key_size", ctypes.c_uint32),
                ("value_size", ctypes.c_uint32), ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("name", ctypes.c_char * 16)]


class _InfoByFd(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class _MapCreate(ctypes.Structure):
    """union bpf_attr for BPF_MAP_CREATE, up to the map's name."""

    _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32), ("inner_map_fd", ctypes.c_uint32),
                ("numa_node", ctypes.c_uint32), ("map_name", ctypes.c_char * 16)]


class _ProgLoad(ctypes.Structure):
    """union bpf_attr for BPF_PROG_LOAD, up to expected_attach_type."""

    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32),
                ("prog_name", ctypes.c_char * 16), ("prog_ifindex", ctypes.c_uint32),
                ("expected_attach_type", ctypes.c_uint32)]


def _map_info(fd: int) -> _MapInfo:
    info = _MapInfo()
    bpf_syscall.bpf(bpf_syscall.BPF_OBJ_GET_INFO_BY_FD,
                    _InfoByFd(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info)))
    return info


def _create_map(m: MapDef) -> int:
    attr = _MapCreate(map_type=m.type, key_size=m.key_size, value_size=m.value_size, max_entries=m.max_entries,
                      map_flags=m.flags, map_name=m.name.encode()[:15])
    return bpf_syscall.bpf(bpf_syscall.BPF_MAP_CREATE, attr)


def _load_program(f: FunctionDef, map_fds: list[int], prog_type: int, entry: Entry, attach_type: int) -> int:
    insns = bytearray(f.insns)
    for (at, _), fd in zip(f.map_refs, map_fds):
        insns[at * INSN_SIZE + 4 : at * INSN_SIZE + 8] = fd.to_bytes(4, "little", signed=True)
    buf = (ctypes.c_char * len(insns)).from_buffer(insns)
    license = ctypes.create_string_buffer(entry.license.encode())
    attr = _ProgLoad(prog_type=prog_type, insn_cnt=len(insns) // INSN_SIZE, insns=ctypes.addressof(buf),
                     license=ctypes.addressof(license), kern_version=entry.kern_version,
                     prog_name=f.name.encode()[:15], expected_attach_type=attach_type)
    return bpf_syscall.bpf(bpf_syscall.BPF_PROG_LOAD, attr)


@cache
def _libbcc() -> ctypes.CDLL:
    """libbcc's module accessors by index, which bcc's Python leaves untyped. A separate handle, so bcc's
    own argtypes stay as they are."""
    c = ctypes.CDLL(lib._name)
    for name, restype, argtypes in (
            ("bpf_num_tables", ctypes.c_size_t, [ctypes.c_void_p]),
            ("bpf_table_name", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
            ("bpf_table_fd_id", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
            ("bpf_table_key_desc_id", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
            ("bpf_table_leaf_desc_id", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
            ("bpf_function_start_id", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
            ("bpf_function_size_id", ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_size_t])):
        fn = getattr(c, name)
        fn.restype, fn.argtypes = restype, argtypes
    return c
