// CPython's garbage collector (libpython3.X.so): every collection timed, on the thread it stops.
// gc_collect_main is a static function: found in the library's .symtab (CPython 3.10-3.13 builds that
// keep their symbols, as pyenv's do; a stripped interpreter goes without GC timing).
// Its handler is generated from agent/sources/probes/libpython.py.
#include "common.h"
