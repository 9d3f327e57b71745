"""Code objects to names, in user space."""
from __future__ import annotations

import struct

from rankscope.agent.interpreters import TRUNCATED, UNKNOWN_CODE, UNREADABLE, Frame
from rankscope.agent.interpreters.cpython.process import Interpreter, open_memory, type_name


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
            self._type_names[type_addr] = type_name(self.mem, type_addr, self.layout)
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


def stack_frames(resolver: CodeResolver | None, codes: list[int] | tuple[int, ...], truncated: bool,
                 partial: bool) -> tuple[Frame, ...]:
    """A walked stack (code objects innermost first) as Frames root first; a stack whose outer part is
    missing starts with UNREADABLE (a link could not be read) or TRUNCATED (deeper than the walk keeps)."""
    frames = [resolver.resolve(c) if resolver else UNKNOWN_CODE for c in reversed(codes)]
    if partial:
        frames.insert(0, UNREADABLE)
    elif truncated:
        frames.insert(0, TRUNCATED)
    return tuple(frames)
