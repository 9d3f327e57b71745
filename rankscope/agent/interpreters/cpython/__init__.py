"""CPython's internals as the frame sampler and timer need them, one module per concept: errors.py, layout.py
(the offsets record), versions/ (each version's offsets, generated from its headers), layouts.py (which
offsets a process uses), process.py (finding and verifying the interpreter of a live process), code.py (code
objects to names), threads.py (thread states and their stacks from user space).

How a target is read (`inspect(pid)`):

1. Which ELF file runs the interpreter: the executable or a mapped `libpython3.X.so`, whichever defines
   `_PyRuntime` (a dynamic symbol in every build, Debian's stripped static one included), read with
   pyelftools through `/proc/PID/map_files` (the very file mapped; `/proc/PID/root/<path>` as a fallback),
   so processes in containers work.
2. Which version: `Py_Version` (3.11+, read from the file); 3.10 has none and is recognised by defining
   `_PyRuntime` and `PyAIter_Check` (new in 3.10) but not `Py_Version`, its patch level from the version
   string in `.rodata`. A file name that names another version (`libpython3.9.so`) is a contradiction
   and refused.
3. Which layout: 3.10-3.12 from `TABLE` (versions/, generated with `offsetof` from each version's internal
   headers);
   3.13+ from the interpreter's own `_Py_DebugOffsets` at the start of `_PyRuntime` (cookie `xdebugpy`),
   read from the live process, checked for plausibility and compared with the table where there is one.
4. Verification on the live process before anything is loaded into the kernel: the first interpreter's
   first thread state points back to it, every thread state's id is a thread of the process, and the
   code objects of a thread's frames are objects whose type is named "code".

Anything unknown or that does not verify raises `UnsupportedInterpreter`; nothing is guessed.
x86-64 Linux, default (GIL) builds only; free-threaded builds are refused.
"""
