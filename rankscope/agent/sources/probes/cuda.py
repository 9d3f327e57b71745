"""CUDA driver API probes (libcuda.so.1). BPF side: bpf/cuda.bpf.c."""
import re

from rankscope.agent.sources.probes.base import Probe, ProbeKind
from rankscope.schema.patterns import Role

CUDA = ProbeKind(
    name="cuda",
    library=re.compile(r"^libcuda\.so(\.\d+)*$"),
    source="cuda.bpf.c",
    probes=(
        *(Probe(s, Role.LAUNCH, returns=False, hot=True) for s in (
            "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuGraphLaunch")),
        *(Probe(s, Role.SYNC) for s in (
            "cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize")),
        *(Probe(s, Role.COPY) for s in (
            "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2_ptsz")),
        Probe("cuMemAlloc_v2", Role.ALLOC),
        Probe("cuMemFree_v2", Role.ALLOC),
        Probe("cuInit", Role.SETUP),
        Probe("cuCtxCreate_v2", Role.SETUP),
    ),
)
