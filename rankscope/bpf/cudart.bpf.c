// CUDA runtime API (libcudart.so.12). Its handlers, one macro line of common.h per probe, are generated from
// agent/sources/probes/cudart.py, the one list of its symbols.
#include "common.h"
