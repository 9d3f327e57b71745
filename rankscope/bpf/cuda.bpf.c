// CUDA driver API (libcuda.so.1). Its handlers, one macro line of common.h per probe, are generated from
// agent/sources/probes/cuda.py, the one list of its symbols.
#include "common.h"
