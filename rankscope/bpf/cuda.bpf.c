// CUDA driver API (libcuda.so.1): launches are counted, host waits and copies are timed.
// Argument positions follow the driver API's C signatures (x86-64 SysV). The driver is the lower layer
// under the CUDA runtime (cudart.bpf.c): its waits and copies inside a runtime call are the runtime's.
#include "common.h"

// cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra)
COUNTED(cuLaunchKernel, 0)
COUNTED(cuLaunchKernel_ptsz, 0)
// cuLaunchKernelEx(const CUlaunchConfig *config, f, params, extra)
COUNTED(cuLaunchKernelEx, 0)
COUNTED(cuLaunchKernelEx_ptsz, 0)
COUNTED(cuGraphLaunch, 0)

LOWER_SYNC(cuStreamSynchronize)
LOWER_SYNC(cuStreamSynchronize_ptsz)
LOWER_SYNC(cuCtxSynchronize)
LOWER_SYNC(cuEventSynchronize)

// cuMemcpy{HtoD,DtoH}Async_v2(dst, src, bytes, stream)
LOWER_TIMED(cuMemcpyHtoDAsync_v2, PT_REGS_PARM3(ctx))
LOWER_TIMED(cuMemcpyDtoHAsync_v2, PT_REGS_PARM3(ctx))
LOWER_TIMED(cuMemcpyHtoDAsync_v2_ptsz, PT_REGS_PARM3(ctx))
LOWER_TIMED(cuMemcpyDtoHAsync_v2_ptsz, PT_REGS_PARM3(ctx))
// cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
LOWER_TIMED(cuMemAlloc_v2, PT_REGS_PARM2(ctx))
LOWER_TIMED(cuMemFree_v2, 0)

LOWER_TIMED(cuInit, 0)
LOWER_TIMED(cuCtxCreate_v2, 0)
