// CUDA runtime API (libcudart.so.12): the calls PyTorch and most frameworks make. The runtime does its
// work through the driver (cuda.bpf.c), so these are the upper layer: while one runs on a thread, the
// driver calls it makes are its own and not accounted again. Launches are left to the driver, where the
// runtime's and direct driver launches (Triton, NVRTC) all arrive.
#include "common.h"

UPPER_SYNC(cudaStreamSynchronize)
UPPER_SYNC(cudaStreamSynchronize_ptsz)
UPPER_SYNC(cudaDeviceSynchronize)
UPPER_SYNC(cudaEventSynchronize)

// cudaMemcpy[Async](dst, src, count, kind[, stream])
UPPER_TIMED(cudaMemcpy, PT_REGS_PARM3(ctx))
UPPER_TIMED(cudaMemcpy_ptds, PT_REGS_PARM3(ctx))
UPPER_TIMED(cudaMemcpyAsync, PT_REGS_PARM3(ctx))
UPPER_TIMED(cudaMemcpyAsync_ptsz, PT_REGS_PARM3(ctx))
// cudaMalloc(void **ptr, size_t size)
UPPER_TIMED(cudaMalloc, PT_REGS_PARM2(ctx))
UPPER_TIMED(cudaFree, 0)
