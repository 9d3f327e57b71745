// CUDA driver API (libcuda.so.1): launches are counted, host waits and copies are timed.
// Argument positions follow the driver API's C signatures (x86-64 SysV).

// cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra)
COUNTED(cuLaunchKernel, 0)
COUNTED(cuLaunchKernel_ptsz, 0)
// cuLaunchKernelEx(const CUlaunchConfig *config, f, params, extra)
COUNTED(cuLaunchKernelEx, 0)
COUNTED(cuLaunchKernelEx_ptsz, 0)
COUNTED(cuGraphLaunch, 0)

SYNC(cuStreamSynchronize)
SYNC(cuStreamSynchronize_ptsz)
SYNC(cuCtxSynchronize)
SYNC(cuEventSynchronize)

// cuMemcpy{HtoD,DtoH}Async_v2(dst, src, bytes, stream)
TIMED(cuMemcpyHtoDAsync_v2, PT_REGS_PARM3(ctx))
TIMED(cuMemcpyDtoHAsync_v2, PT_REGS_PARM3(ctx))
TIMED(cuMemcpyHtoDAsync_v2_ptsz, PT_REGS_PARM3(ctx))
TIMED(cuMemcpyDtoHAsync_v2_ptsz, PT_REGS_PARM3(ctx))
// cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
TIMED(cuMemAlloc_v2, PT_REGS_PARM2(ctx))
TIMED(cuMemFree_v2, 0)

TIMED(cuInit, 0)
TIMED(cuCtxCreate_v2, 0)
