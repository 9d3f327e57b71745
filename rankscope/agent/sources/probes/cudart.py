"""CUDA runtime API probes (libcudart.so.12), the layer above the driver's. BPF side: bpf/cudart.bpf.c."""
import re

from rankscope.agent.sources.probes.base import Probe, ProbeKind
from rankscope.schema.patterns import Role

CUDART = ProbeKind(
    name="cudart",
    library=re.compile(r"^libcudart\.so(\.\d+)*$"),
    source="cudart.bpf.c",
    probes=(
        *(Probe(s, Role.SYNC) for s in (
            "cudaStreamSynchronize", "cudaStreamSynchronize_ptsz", "cudaDeviceSynchronize", "cudaEventSynchronize")),
        *(Probe(s, Role.COPY) for s in ("cudaMemcpy", "cudaMemcpy_ptds", "cudaMemcpyAsync", "cudaMemcpyAsync_ptsz")),
        Probe("cudaMalloc", Role.ALLOC),
        Probe("cudaFree", Role.ALLOC),
    ),
)
