"""CUDA runtime API probes (libcudart.so.12): the calls PyTorch and most frameworks make. BPF side:
bpf/cudart.bpf.c and a handler per probe below. The runtime does its work through the driver (cuda.py), so
these are the upper layer: while one runs on a thread, the driver calls it makes are its own and not accounted
again. Launches are left to the driver, where the runtime's and direct driver launches (Triton, NVRTC) all
arrive."""
import re

from rankscope.agent.sources.probes.base import UPPER_SYNC, UPPER_TIMED, Probe, ProbeKind
from rankscope.schema.patterns import Role

CUDART = ProbeKind(
    name="cudart",
    trace_category="cuda_runtime",
    library=re.compile(r"^libcudart\.so(\.\d+)*$"),
    source="cudart.bpf.c",
    probes=(
        *(Probe(s, Role.SYNC, UPPER_SYNC) for s in (
            "cudaStreamSynchronize", "cudaStreamSynchronize_ptsz", "cudaDeviceSynchronize", "cudaEventSynchronize")),
        # cudaMemcpy[Async](dst, src, count, kind[, stream])
        *(Probe(s, Role.COPY, UPPER_TIMED("PT_REGS_PARM3(ctx)"))
          for s in ("cudaMemcpy", "cudaMemcpy_ptds", "cudaMemcpyAsync", "cudaMemcpyAsync_ptsz")),
        # cudaMalloc(void **ptr, size_t size)
        Probe("cudaMalloc", Role.ALLOC, UPPER_TIMED("PT_REGS_PARM2(ctx)")),
        Probe("cudaFree", Role.ALLOC, UPPER_TIMED("0")),
    ),
)
