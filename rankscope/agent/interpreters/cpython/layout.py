"""The byte offsets into one CPython version's runtime structures that the frame sampler and the user-space
readers use (the record; each version's values are in versions/ or the target's _Py_DebugOffsets)."""
from __future__ import annotations

from dataclasses import dataclass


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
