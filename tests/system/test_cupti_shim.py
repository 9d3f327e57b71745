"""The CUPTI shim of each CUDA line without a GPU: built against the line's real CUPTI headers, loaded with its
real libcupti (.so.12, .so.13), its completed-buffer path fed real CUPTI record structs of that release; the
agent reads them through real USDT probes. Every test that takes `line` runs once per CUDA major."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import captured_while, wait_until
from nvml_replay import READINGS, ReplayNvml

from rankscope.agent.loader.histograms import percentile_s
from rankscope.agent.loader.program import ProbeError
from rankscope.agent.sources.gpu import GpuViews
from rankscope.agent.sources.nvml import GpuHealthReader
from rankscope.agent.sources.probes.cupti import (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET, CuptiReader,
                                                  LaunchStats, RawActivity, short_kernel_name)
from rankscope.agent.views.trace import RankInfo, chrome_trace
from rankscope.cupti_shim.build import build_shim
from rankscope.cupti_shim.cuda_lines import LINES, CudaLine
from rankscope.schema.patterns import KERNEL_NAME_CHARS, GpuActivity, GpuKernel, RankPattern

DRIVER_SOURCE = Path(__file__).parent.parent / "cupti_driver.c"
KERNEL = "_Z9gemm_tileILi128EEvPKfS1_Pf"
RECORDS_PER_BUFFER = 3
ACTIVITY_BATCH = 16  # records per trap of rankscope:activities (cupti_shim/shim.c)
MANY_NS = 500  # each kernel of the driver's "many" buffer (tests/cupti_driver.c)
# What each line's libcupti answers at InitializeInjection on a machine without NVIDIA's driver.
NO_DRIVER_ERROR = {12: "CUPTI_ERROR_NOT_INITIALIZED", 13: "CUPTI_ERROR_UNKNOWN"}


# tests/cupti_driver.c's launch buffers: 0 the kernel of launch 7001 (5 us after its launch call returned),
# 1 the API records (7001 as a runtime launch and its nested driver launch, a memcpy call, launch 7002), 2 the
# kernel of launch 7002 (2 ms after its launch).
KERNEL_FIRST, API_RECORDS, KERNEL_AFTER = 0, 1, 2
LAUNCH_RECORDS = 3  # launches in API_RECORDS: the memcpy call is not one
QUEUE_DELAYS_NS = (5_000, 2_000_000)


@dataclass(frozen=True)
class ShimStats:
    """The shim's counters (cupti_shim/shim.c struct rankscope_shim_stats)."""

    emitted: int
    dropped: int
    skipped: int
    launches: int
    launches_dropped: int
    api_wanted: bool  # the shim's decision: CUPTI's API records on (launch semaphore up)
    api_failures: int  # enable/disable calls CUPTI refused (all of them without a driver)
    handovers: int  # uprobe traps the shim fired: one per record, or one per batch


class Driver:
    """tests/cupti_driver.c in a child process: it holds the shim and processes its record buffers on command."""

    def __init__(self, binary: Path, shim: Path, env: dict[str, str]):
        self.proc = subprocess.Popen([str(binary), str(shim)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
        words = self.proc.stdout.readline().split()
        assert words[:2] == ["init", "1"], words  # InitializeInjection returns 1 without a driver
        self.pid = self.proc.pid

    def emit(self, buffers: int) -> tuple[int, int, int]:
        """Processes the activity buffer `buffers` times; returns the shim's (emitted, dropped, skipped buffers)."""
        st = self.command(f"emit {buffers}")
        return st.emitted, st.dropped, st.skipped

    def launch(self, buffer: int) -> ShimStats:
        """Processes launch buffer `buffer` (KERNEL_FIRST, API_RECORDS, KERNEL_AFTER)."""
        return self.command(f"launch {buffer}")

    def command(self, line: str) -> ShimStats:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        words = self.proc.stdout.readline().split()
        assert words[0] == "stats" and len(words) == 9, words
        n = [int(w) for w in words[1:]]
        return ShimStats(n[0], n[1], n[2], n[3], n[4], bool(n[5]), n[6], n[7])

    def close(self) -> str:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        return self.proc.stderr.read()


@pytest.fixture(scope="module", params=LINES, ids=lambda line: f"cuda{line.major}")
def line(request) -> CudaLine:
    return request.param


@pytest.fixture(scope="module")
def driver_binary(line, tmp_path_factory) -> Path:
    """The driver compiled against the line's headers: it writes that CUPTI release's record structs."""
    out = tmp_path_factory.mktemp("cupti") / f"cupti_driver{line.major}"
    subprocess.run(["gcc", "-O1", "-Wall", "-o", str(out), str(DRIVER_SOURCE),
                    *(f"-I{d}" for d in line.include_dirs()), "-ldl"], check=True)
    return out


@pytest.fixture
def start_driver(line, driver_binary) -> Iterator:
    started: list[Driver] = []

    def start(libcupti: Path | None = None, **env: str) -> Driver:
        """The driver with the line's shim and libcupti (or `libcupti`, another line's)."""
        d = Driver(driver_binary, build_shim(line.major),
                   {**os.environ, "RANKSCOPE_CUPTI_LIB": str(libcupti or line.libcupti()), **env})
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def test_shim_exports_injection_entry_and_semaphore_probe(line):
    shim = build_shim(line.major)
    assert shim.name == f"librankscope_cupti{line.major}.so"
    notes = subprocess.run(["readelf", "-n", str(shim)], capture_output=True, text=True, check=True).stdout
    assert "Provider: rankscope" in notes and "Name: activity" in notes and "Name: launch" in notes
    assert "Name: activities" in notes
    assert "Semaphore: 0x0000000000000000" not in notes  # the probe is guarded by a semaphore
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(shim)], capture_output=True, text=True,
                             check=True).stdout
    assert " T InitializeInjection" in symbols
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(shim)], capture_output=True, text=True,
                               check=True).stdout
    assert "cupti" not in undefined  # libcupti is opened at run time, by the line's soname


def test_shim_refuses_the_other_lines_cupti(line, start_driver):
    """Another major's CUPTI writes records in another release's layout: the shim says so and reads none."""
    other = next(o for o in LINES if o.major != line.major)
    driver = start_driver(libcupti=other.libcupti())
    reader = CuptiReader(driver.pid)
    try:
        assert driver.emit(1) == (0, 0, 1)  # attached, yet the buffer goes back unread
    finally:
        reader.close()
    assert "is not one this shim reads" in driver.close()


@pytest.fixture(params=["batches", "per-record"])
def hand_over(request) -> str:
    """Each hand-over of the shim (the reader's `batches`): the figures the agent derives are the same."""
    return request.param


def test_records_reach_agent_through_usdt(line, start_driver, hand_over):
    driver = start_driver()
    # No agent attached: the semaphore is off and the buffer goes back unread.
    assert driver.emit(1) == (0, 0, 1)

    reader = CuptiReader(driver.pid, batches=hand_over == "batches")
    try:
        reader.set_raw(True)
        st = driver.command("emit 2")
        assert (st.emitted, st.dropped, st.skipped) == (2 * RECORDS_PER_BUFFER, 0, 1)
        assert st.handovers == (2 if hand_over == "batches" else 2 * RECORDS_PER_BUFFER)  # traps
        raw: list[RawActivity] = []
        wait_until(lambda: raw.extend(reader.poll_raw(50)) or len(raw) >= 6, 10, "raw records from the ring")
        assert len(raw) == 6
        kernel = RawActivity(driver.pid, KIND_CONCURRENT_KERNEL, 1000000000123, 1000000250456, 3, 17, 4242,
                             KERNEL, 0)
        memcpy = RawActivity(driver.pid, KIND_MEMCPY, 1000000300000, 1000000340000, 3, 18, 4243, "", 1 << 20)
        memset = RawActivity(driver.pid, KIND_MEMSET, 1000000400000, 1000000401000, 3, 17, 4244, "", 4096)
        assert raw == [kernel, memcpy, memset] * 2

        by_kind = {a.kind: a for a in reader.activity()}
        assert set(by_kind) == {KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET}
        k = by_kind[KIND_CONCURRENT_KERNEL]
        assert (k.name, k.count, k.total_ns) == (KERNEL, 2, 2 * 250333)
        assert sum(k.hist) == 2 and k.hist[(250333).bit_length()] == 2  # bpf_log2l slot of 250 us
        assert (by_kind[KIND_MEMCPY].count, by_kind[KIND_MEMCPY].bytes) == (2, 2 << 20)
        assert by_kind[KIND_MEMSET].total_ns == 2 * 1000
        # The second pass repeats intervals already covered: busy time is their union.
        assert reader.busy_ns() == {3: 250333 + 40000 + 1000}

        reader.set_raw(False)
        assert driver.emit(1)[0] == 3 * RECORDS_PER_BUFFER
        assert reader.poll_raw(0) == []  # aggregated only
        wait_until(lambda: {a.kind: a.count for a in reader.activity()}[KIND_MEMSET] == 3, 5, "aggregate")
    finally:
        reader.close()
    # Detached: the semaphore is off again and the shim skips its buffers.
    assert driver.emit(1) == (3 * RECORDS_PER_BUFFER, 0, 2)
    assert NO_DRIVER_ERROR[line.major] in driver.close()  # said once, and the process went on


def test_a_trace_capture_shows_the_shims_records_on_their_gpu_stream(start_driver):
    """A capture reads the shim's records through the reader's stream: kernels, copies and sets on a track per
    device and stream, in Kineto's categories, placed by CUPTI's clock (unix ns) in the capture's time."""
    driver = start_driver()
    views = GpuViews(health=GpuHealthReader(ReplayNvml(READINGS)))
    try:
        assert views.watch(driver.pid)
        ran = []

        def emit_inside() -> None:
            # The driver's records end up to 400 us before its "now": emitted within 400 us of the capture's
            # start (an idle machine starts streams that fast), the kernel would precede the capture and be
            # left out. A millisecond of the clock after the streams run puts every record inside.
            running_at = time.monotonic_ns()
            wait_until(lambda: time.monotonic_ns() - running_at >= 1_000_000, 5, "a millisecond to pass")
            ran.append(driver.command("now"))

        cap = captured_while(views.trace_streams(), driver.pid, emit_inside)
    finally:
        views.close()
    assert ran[0].emitted == RECORDS_PER_BUFFER
    recs = cap.events[driver.pid]
    assert sorted((recs["end_ns"] - recs["start_ns"]).tolist()) == [1000, 40000, 250333]  # CUPTI's own times
    doc = chrome_trace(RankInfo("j", 0, 1, driver.pid, "h"), cap, {})
    gpu = {e["cat"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert set(gpu) == {"kernel", "gpu_memcpy", "gpu_memset"}
    kernel, memcpy, memset = gpu["kernel"], gpu["gpu_memcpy"], gpu["gpu_memset"]
    unclipped = lambda e: {k: v for k, v in e["args"].items() if k != "clipped"}  # noqa: E731
    assert (kernel["name"], unclipped(kernel)) == (KERNEL, {"device": 3, "stream": 17, "correlation": 4242})
    assert (memcpy["name"], unclipped(memcpy)) == ("Memcpy", {"device": 3, "stream": 18, "bytes": 1 << 20})
    # The set ended when the driver ran the command, inside the capture; the kernel 150.544 us before it (the
    # buffer's gaps), on CUPTI's clock placed in the capture's time.
    end = lambda e: e["ts"] + e["dur"]  # noqa: E731
    assert 1000 <= end(memset) <= (cap.end_ns - cap.start_ns) / 1e3
    assert end(memset) - end(kernel) == pytest.approx(150.544, abs=0.002)
    assert kernel["dur"] == 250.333 and "clipped" not in kernel["args"]
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"GPU 3 stream 17", "GPU 3 stream 18"} <= tracks
    assert doc["rankscope"]["dropped_events"] == 0


def test_batches_hand_over_every_record_in_few_traps(start_driver):
    """A buffer of many kernels reaches the agent whole, ACTIVITY_BATCH records a trap, at any rate."""
    records = 1000
    driver = start_driver(RANKSCOPE_SHIM_MAX_RATE="4")
    reader = CuptiReader(driver.pid)
    try:
        st = driver.command(f"many {records}")
        assert (st.emitted, st.dropped, st.handovers) == (records, 0, -(-records // ACTIVITY_BATCH))
        kernels = [a for a in reader.activity() if a.kind == KIND_CONCURRENT_KERNEL]
        assert [(a.name, a.count, a.total_ns) for a in kernels] == [(KERNEL, records, records * MANY_NS)]
        assert reader.busy_ns() == {0: records * MANY_NS}  # disjoint intervals: busy is their sum
        assert reader.lost() == 0
    finally:
        reader.close()


def test_rate_limit_drops_records_over_budget(start_driver):
    """One trap per record costs ~1.5 us each: that hand-over is rate-limited, its drops counted."""
    driver = start_driver(RANKSCOPE_SHIM_MAX_RATE="4")
    reader = CuptiReader(driver.pid, batches=False)
    try:
        emitted, dropped, _ = driver.emit(3)
    finally:
        reader.close()
    assert emitted + dropped == 3 * RECORDS_PER_BUFFER
    # 4 per second; a second boundary during the call may allow one more budget.
    assert 4 <= emitted <= 8 and dropped >= 1
    # The records lost so far ride along with the next batch, for /metrics.
    reader = CuptiReader(driver.pid)
    try:
        assert driver.emit(1)[1] == dropped  # batches: none dropped
        assert reader.lost() == dropped
    finally:
        reader.close()


def test_gpu_views_fill_patterns_from_shim_and_nvml(start_driver):
    """Window by window: the shim's records become the pattern's GPU activity, NVML the rank's GPU health."""
    driver = start_driver()
    nvml = ReplayNvml(READINGS)
    nvml.data["devices"][2]["pids"] = [driver.pid]  # the driver "computes" on the hot GPU
    views = GpuViews(GpuHealthReader(nvml))
    pattern = RankPattern(job="j", rank=0, world_size=1, pid=driver.pid, host="h", window_start=0, window_end=1)
    try:
        assert views.watch(driver.pid)
        assert driver.emit(4)[0] == 4 * RECORDS_PER_BUFFER
        wait_until(lambda: sum(a.count for a in views._shim[driver.pid][0].activity()) == 12, 5, "records")
        views.fill([pattern])
        assert pattern.gpu == GpuActivity(busy_s=291333e-9, kernel_s=4 * 250333e-9, copy_s=4 * 41000e-9, kernels=4,
                                          top=[GpuKernel("gemm_tile", 4, 4 * 250333e-9)],
                                          comm_kernel_s=0.0)  # no NCCL kernel among them
        assert pattern.gpu_health.index == 2 and pattern.gpu_health.throttle_reasons == 0x20

        nvml.advance()
        assert driver.emit(1)[0] == 5 * RECORDS_PER_BUFFER
        wait_until(lambda: sum(a.count for a in views._shim[driver.pid][0].activity()) == 15, 5, "records")
        views.fill([pattern])
        assert (pattern.gpu.kernels, pattern.gpu.busy_s) == (1, 0.0)  # this window only; intervals seen before
    finally:
        views.close()


@pytest.mark.parametrize("mangled,short", [
    ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEviT0_T1_",
     "vectorized_elementwise_kernel"),
    ("_Z9gemm_tileILi128EEvPKfS1_Pf", "gemm_tile"),
    ("_ZN7cutlass6KernelINS_4gemm6kernel13GemmUniversalE", "cutlass::Kernel"),
    ("ampere_sgemm_128x64_nn", "ampere_sgemm_128x64_nn"),
    ("_Zbad", "_Zbad"),
    ("x" * 100, "x" * KERNEL_NAME_CHARS),
])
def test_short_kernel_names(mangled, short):
    assert short_kernel_name(mangled) == short


def test_sigkilled_agent_leaves_the_shim_idle(start_driver):
    """The semaphore is the kernel's uprobe reference counter: a killed agent's probes and semaphore go."""
    driver = start_driver()
    agent = subprocess.Popen([sys.executable, "-c", "import sys; from rankscope.agent.sources.probes.cupti import "
                              f"CuptiReader; CuptiReader({driver.pid}); print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "up"
        assert driver.emit(1) == (RECORDS_PER_BUFFER, 0, 0)
    finally:
        agent.kill()
        agent.wait()
    assert driver.emit(1) == (RECORDS_PER_BUFFER, 0, 1)  # skipped: nothing attached any more


def test_launches_join_their_kernels_by_correlation_id(start_driver, hand_over):
    """Kernel before its launch, kernel after it; a runtime launch and its nested driver launch join once; a
    memcpy call is no launch. The queue delay (kernel start - launch end) lands in its log2 slot."""
    driver = start_driver()
    reader = CuptiReader(driver.pid, batches=hand_over == "batches")
    try:
        # Without the launch probe the shim leaves CUPTI's API records off and hands over no launch.
        st = driver.launch(API_RECORDS)
        assert (st.api_wanted, st.launches) == (False, 0)

        reader.set_launches(True)
        st = driver.launch(KERNEL_FIRST)
        assert st.api_wanted and st.emitted == 1
        assert reader.launches() == LaunchStats(0, 0, ())  # the kernel waits for its launch
        assert driver.launch(API_RECORDS).launches == LAUNCH_RECORDS
        assert driver.launch(KERNEL_AFTER).emitted == 2
        # The probes run in the driver's thread before it answers: the aggregates are final.
        joined = reader.launches()
        assert (joined.joined, joined.total_ns) == (2, sum(QUEUE_DELAYS_NS))
        assert sum(joined.hist) == 2
        assert [joined.hist[d.bit_length()] for d in QUEUE_DELAYS_NS] == [1, 1]  # bpf_log2l slots

        # Records seen again (a twin, a graph's later kernel) find their correlation ids taken.
        for buffer in (KERNEL_FIRST, API_RECORDS, KERNEL_AFTER):
            driver.launch(buffer)
        assert reader.launches() == joined

        reader.set_launches(False)
        st = driver.launch(API_RECORDS)
        assert (st.api_wanted, st.launches) == (False, 2 * LAUNCH_RECORDS)
        reader.set_launches(True)  # the next deep episode attaches again
        st = driver.launch(API_RECORDS)
        assert (st.api_wanted, st.launches) == (True, 3 * LAUNCH_RECORDS)
        reader.set_launches(False)
    finally:
        reader.close()
    # Without a driver CUPTI refuses every enable and disable; the shim counts it and goes on.
    assert driver.launch(API_RECORDS).api_failures == 8  # two kinds, two episodes, on and off


def test_gpu_views_join_launches_in_deep_mode_only(start_driver):
    driver = start_driver()
    views = GpuViews(GpuHealthReader(ReplayNvml(READINGS)))
    pattern = RankPattern(job="j", rank=0, world_size=1, pid=driver.pid, host="h", window_start=0, window_end=1)
    try:
        assert views.watch(driver.pid)
        assert not driver.launch(KERNEL_FIRST).api_wanted
        views.fill([pattern])
        assert (pattern.gpu.kernels, pattern.gpu.launches) == (1, None)  # light mode: not measured

        views.set_launches(True)
        for buffer in (KERNEL_FIRST, API_RECORDS, KERNEL_AFTER):
            assert driver.launch(buffer).api_wanted
        views.fill([pattern])
        slots = [0] * 22
        for d in QUEUE_DELAYS_NS:
            slots[d.bit_length()] += 1
        assert (pattern.gpu.launches, pattern.gpu.queue_p50_s, pattern.gpu.queue_p99_s) == (
            2, percentile_s(slots, 0.5), percentile_s(slots, 0.99))
        assert pattern.gpu.queue_p50_s == 2 ** 12.5 / 1e9 and pattern.gpu.queue_p99_s == 2 ** 20.5 / 1e9

        views.fill([pattern])
        assert (pattern.gpu.launches, pattern.gpu.queue_p99_s) == (0, 0.0)  # this window only
        views.set_launches(False)
        assert not driver.launch(API_RECORDS).api_wanted
    finally:
        views.close()


def test_sigkilled_agent_leaves_the_launch_records_off(start_driver):
    """The launch semaphore is a kernel-kept uprobe counter too: a killed agent in deep mode leaves CUPTI's
    API records to be turned off at the watcher's next look."""
    driver = start_driver()
    agent = subprocess.Popen([sys.executable, "-c", "import sys; from rankscope.agent.sources.probes.cupti import "
                              f"CuptiReader; CuptiReader({driver.pid}).set_launches(True); print('up', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout.readline().strip() == "up"
        st = driver.launch(API_RECORDS)
        assert (st.api_wanted, st.launches) == (True, LAUNCH_RECORDS)
    finally:
        agent.kill()
        agent.wait()
    st = driver.launch(API_RECORDS)
    assert (st.api_wanted, st.launches, st.skipped) == (False, LAUNCH_RECORDS, 1)


def test_process_without_the_shim_is_refused_clearly():
    with pytest.raises(ProbeError, match="does not load the rankscope CUPTI shim"):
        CuptiReader(os.getpid())
    views = GpuViews(GpuHealthReader(ReplayNvml(READINGS)))
    assert not views.watch(os.getpid())
