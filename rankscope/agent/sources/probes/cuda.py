"""CUDA driver API probes (libcuda.so.1): launches are counted, host waits and copies are timed. BPF side:
bpf/cuda.bpf.c and a handler per probe below. Argument positions follow the driver API's C signatures (x86-64
SysV). The driver is the lower layer under the CUDA runtime (cudart.py): its waits and copies inside a
runtime call are the runtime's."""
import re

from rankscope.agent.sources.probes.base import COUNTED, LOWER_SYNC, LOWER_TIMED, Probe, ProbeKind
from rankscope.schema.patterns import Role

CUDA = ProbeKind(
    name="cuda",
    trace_category="cuda_driver",
    library=re.compile(r"^libcuda\.so(\.\d+)*$"),
    source="cuda.bpf.c",
    probes=(
        # cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra),
        # cuLaunchKernelEx(const CUlaunchConfig *config, f, params, extra)
        *(Probe(s, Role.LAUNCH, COUNTED("0"), hot=True) for s in (
            "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuGraphLaunch")),
        *(Probe(s, Role.SYNC, LOWER_SYNC) for s in (
            "cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize")),
        # cuMemcpy{HtoD,DtoH}Async_v2(dst, src, bytes, stream)
        *(Probe(s, Role.COPY, LOWER_TIMED("PT_REGS_PARM3(ctx)")) for s in (
            "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2_ptsz")),
        # cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
        Probe("cuMemAlloc_v2", Role.ALLOC, LOWER_TIMED("PT_REGS_PARM2(ctx)")),
        Probe("cuMemFree_v2", Role.ALLOC, LOWER_TIMED("0")),
        Probe("cuInit", Role.SETUP, LOWER_TIMED("0")),
        Probe("cuCtxCreate_v2", Role.SETUP, LOWER_TIMED("0")),
    ),
)
