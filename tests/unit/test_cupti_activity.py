"""One window's GpuActivity from the shim's cumulative kernel totals: NCCL's kernels counted apart, since where
collectives run on the GPU a rank waiting for its peers waits inside them."""
import pytest

from rankscope.agent.sources.probes.cupti import KIND_CONCURRENT_KERNEL, KIND_MEMCPY, ActivityStats, ActivityWindow

GEMM = "_ZN7cutlass7Kernel2I6ParamsEEvT_"


def stats(name: str, count: int, ms: float, kind: int = KIND_CONCURRENT_KERNEL) -> ActivityStats:
    return ActivityStats(kind=kind, name=name, count=count, total_ns=int(ms * 1e6), bytes=0, hist=())


def test_nccls_kernels_are_counted_apart_per_window():
    window = ActivityWindow()
    first = [stats(GEMM, 10, 20.0), stats("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 300.0),
             stats("ncclKernel_SendRecv", 5, 10.0), stats("", 2, 1.0, KIND_MEMCPY)]
    g = window.next(first, {0: int(320e6)})
    assert g.kernel_s == pytest.approx(0.330) and g.comm_kernel_s == pytest.approx(0.310)
    assert g.copy_s == pytest.approx(0.001) and g.kernels == 55
    # The totals only grow: the next window is the difference.
    later = [stats(GEMM, 30, 80.0), stats("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 50, 350.0),
             stats("ncclKernel_SendRecv", 5, 10.0), stats("", 2, 1.0, KIND_MEMCPY)]
    g = window.next(later, {0: int(440e6)})
    assert g.kernel_s == pytest.approx(0.110) and g.comm_kernel_s == pytest.approx(0.050)
    assert [k.name for k in g.top] == ["Kernel2", "ncclDevKernel_AllReduce_Sum_f3"]


def test_a_job_without_nccl_has_no_nccl_kernel_time():
    g = ActivityWindow().next([stats(GEMM, 10, 20.0)], {0: int(20e6)})
    assert g.comm_kernel_s == 0.0
