"""Which Layout a CPython version has: the generated modules of versions/ (`TABLE`), and 3.13+'s own
_Py_DebugOffsets read from the process."""
from __future__ import annotations

import logging
import struct
from dataclasses import fields

from rankscope.agent.interpreters.cpython.errors import UnsupportedInterpreter
from rankscope.agent.interpreters.cpython.layout import Layout
from rankscope.agent.interpreters.cpython.versions import TABLE

log = logging.getLogger(__name__)

SUPPORTED = ((3, 10), (3, 11), (3, 12), (3, 13), (3, 14))

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
