/* Prints one CPython version's Layout fields ("name value" lines) from its own headers: compiled against
 * them by scripts/gen_cpython_layouts.py. A field a version lacks is not printed (its Layout value is None).
 * A new version: a branch wherever a field moved or was renamed, then run the generator. */
#include <patchlevel.h>
#if PY_MAJOR_VERSION != 3 || PY_MINOR_VERSION < 10 || PY_MINOR_VERSION > 13
#error "rankscope: no layout template for this CPython version"
#endif

#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include "internal/pycore_interp.h"
#include "internal/pycore_runtime.h"
#if PY_MINOR_VERSION == 10
#include <frameobject.h>
#else
#include "internal/pycore_frame.h"
#endif

#define FIELD(name, value) printf(#name " %ld\n", (long)(value))

int main(void) {
    printf("py_version %s\n", PY_VERSION);

    /* _PyRuntime -> interpreters -> thread states */
    FIELD(runtime_interp_head, offsetof(_PyRuntimeState, interpreters.head));
    FIELD(interp_next, offsetof(PyInterpreterState, next));
#if PY_MINOR_VERSION == 10
    FIELD(interp_tstate_head, offsetof(PyInterpreterState, tstate_head));
#else
    FIELD(interp_tstate_head, offsetof(PyInterpreterState, threads.head));
#endif
    FIELD(interp_runtime, offsetof(PyInterpreterState, runtime));
    FIELD(tstate_next, offsetof(PyThreadState, next));
    FIELD(tstate_interp, offsetof(PyThreadState, interp));
    FIELD(tstate_thread_id, offsetof(PyThreadState, thread_id));
#if PY_MINOR_VERSION >= 11
    FIELD(tstate_native_thread_id, offsetof(PyThreadState, native_thread_id));
#endif

    /* The frame chain: 3.10 frame objects; 3.11/3.12 interpreter frames behind the thread's _PyCFrame;
     * 3.13 interpreter frames straight from the thread state. */
#if PY_MINOR_VERSION == 10
    FIELD(tstate_frame, offsetof(PyThreadState, frame));
    FIELD(frame_previous, offsetof(PyFrameObject, f_back));
    FIELD(frame_code, offsetof(PyFrameObject, f_code));
#elif PY_MINOR_VERSION <= 12
    FIELD(tstate_frame, offsetof(PyThreadState, cframe));
    FIELD(cframe_current_frame, offsetof(_PyCFrame, current_frame));
    FIELD(frame_previous, offsetof(_PyInterpreterFrame, previous));
    FIELD(frame_code, offsetof(_PyInterpreterFrame, f_code));
#else
    FIELD(tstate_frame, offsetof(PyThreadState, current_frame));
    FIELD(frame_previous, offsetof(_PyInterpreterFrame, previous));
    FIELD(frame_code, offsetof(_PyInterpreterFrame, f_executable));
#endif
#if PY_MINOR_VERSION >= 12
    FIELD(frame_owner, offsetof(_PyInterpreterFrame, owner));
    FIELD(owner_skip_from, FRAME_OWNED_BY_CSTACK);
#else
    /* 3.11 has an owner byte, but no owner means "the C stack": no frame to skip, so no frame_owner.
     * The sampler reads owner_skip_from only with frame_owner; 3 is the later versions' value. */
    FIELD(owner_skip_from, 3);
#endif
    FIELD(code_tag_mask, 0); /* up to 3.13 the frame's code is a plain pointer (3.14's is a tagged _PyStackRef) */

    /* What names a frame's function */
    FIELD(code_filename, offsetof(PyCodeObject, co_filename));
    FIELD(code_name, offsetof(PyCodeObject, co_name));
#if PY_MINOR_VERSION >= 11
    FIELD(code_qualname, offsetof(PyCodeObject, co_qualname));
#endif
    FIELD(code_firstlineno, offsetof(PyCodeObject, co_firstlineno));
    FIELD(unicode_length, offsetof(PyASCIIObject, length));
    FIELD(unicode_state, offsetof(PyASCIIObject, state));
    FIELD(unicode_ascii_size, sizeof(PyASCIIObject));
    FIELD(unicode_compact_size, sizeof(PyCompactUnicodeObject));
    FIELD(ob_type, offsetof(PyObject, ob_type));
    FIELD(type_tp_name, offsetof(PyTypeObject, tp_name));
    return 0;
}
