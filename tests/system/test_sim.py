"""The simulated GPU job: stand-in libraries, their timing model, the rank processes and the launcher.

The stand-ins are only ever loaded in child processes: a test process that mapped libnccl.so.2 would look
like a training process to the agent's node-wide discovery in later tests.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from rankscope.sim import build
from rankscope.sim.bindings import shm_name
from rankscope.sim.faults import EVERY_RANK, Fault
from rankscope.sim.job import SimJob, parse_fault, start_job

CUDA_API = ("cuInit", "cuDeviceGet", "cuCtxCreate_v2", "cuStreamCreate", "cuModuleLoadData", "cuModuleGetFunction",
            "cuLaunchKernel", "cuLaunchKernelEx", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventCreate",
            "cuEventRecord", "cuEventSynchronize", "cuMemAlloc_v2", "cuMemFree_v2", "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2", "cuLaunchKernel_ptsz", "cuLaunchKernelEx_ptsz", "cuStreamSynchronize_ptsz",
            "cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2_ptsz", "cuGraphLaunch", "rsim_set_gpu_factor")
NCCL_API = ("ncclGetUniqueId", "ncclCommInitRank", "ncclCommDestroy", "ncclCommCount", "ncclCommUserRank",
            "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast", "ncclSend", "ncclRecv",
            "ncclGroupStart", "ncclGroupEnd")


@pytest.fixture(scope="module")
def lib_dir() -> Path:
    return build.build_libraries()


@pytest.fixture
def jobs():
    started: list[SimJob] = []

    def start(*args, **kwargs) -> SimJob:
        job = start_job(*args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        job.stop()


def dynamic_symbols(path: Path) -> dict[str, tuple[int, str, str]]:
    """name -> (address, binding, type) of the defined dynamic symbols."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return {s.name: (s["st_value"], s["st_info"]["bind"], s["st_info"]["type"])
                for s in elf.get_section_by_name(".dynsym").iter_symbols() if s["st_shndx"] != "SHN_UNDEF"}


def needed(path: Path) -> list[str]:
    with open(path, "rb") as f:
        dyn = ELFFile(f).get_section_by_name(".dynamic")
        return [t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED"]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- building

def test_build_exports_the_real_names(lib_dir):
    cuda = dynamic_symbols(lib_dir / "libcuda.so.1")
    nccl = dynamic_symbols(lib_dir / "libnccl.so.2")
    for name in CUDA_API:
        assert cuda.get(name, (0, "", ""))[2] == "STT_FUNC", name
    for name in NCCL_API:
        assert nccl.get(name, (0, "", ""))[2] == "STT_FUNC", name
        # as in the real library: ncclX is a weak alias of pncclX, at the same address
        assert nccl[name][1] == "STB_WEAK" and nccl["p" + name][0] == nccl[name][0], name
    assert "rsim_set_link_factor" in nccl and "rsim_set_link_factor" not in cuda
    assert "libcuda.so.1" in needed(lib_dir / "libnccl.so.2")


def test_build_is_cached_and_reports_compiler_errors(lib_dir, tmp_path, monkeypatch):
    assert build.build_libraries() == lib_dir  # nothing changed: no rebuild
    assert (lib_dir / "libcuda.so.1").stat().st_mtime_ns == (build.build_libraries() / "libcuda.so.1").stat().st_mtime_ns
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "CC", str(tmp_path / "no-such-gcc"))
    with pytest.raises(build.BuildError, match="not found"):
        build.build_libraries()
    monkeypatch.setattr(build, "CFLAGS", (*build.CFLAGS, "-include", "/no/such/header.h"))
    monkeypatch.setattr(build, "CC", "gcc")
    with pytest.raises(build.BuildError, match="header.h"):
        build.build_libraries()
    assert not [p for p in (tmp_path / "rankscope").iterdir()]  # no half-built folder left behind


# ---------------------------------------------------------------- the timing model, in one process

TIMELINE = textwrap.dedent("""
    import ctypes, json, sys, time
    from ctypes import byref, c_void_p, c_uint64, c_float
    from rankscope.sim.bindings import (load, CUlaunchConfig, NcclUniqueId, CUDA_ERROR_NOT_READY, NCCL_FLOAT32,
                                        NCCL_UINT8, NCCL_SUM, shm_name, unique_id_bytes)
    cuda, nccl = load(sys.argv[1])
    res = {}
    clock = time.perf_counter
    cuda.cuInit(0)
    dev, ctx, s, mod, f, ev = ctypes.c_int(), c_void_p(), c_void_p(), c_void_p(), c_void_p(), c_void_p()
    cuda.cuDeviceGet(byref(dev), 0)
    cuda.cuCtxCreate_v2(byref(ctx), 0, dev)
    cuda.cuStreamCreate(byref(s), 0)
    cuda.cuEventCreate(byref(ev), 0)
    cuda.cuModuleLoadData(byref(mod), b"image")
    cuda.cuModuleGetFunction(byref(f), mod, b"gemm")
    buf = c_uint64()
    cuda.cuMemAlloc_v2(byref(buf), 1 << 20)
    p = c_void_p(buf.value)

    def timed(fn):
        t = clock(); fn(); return clock() - t

    def kernel_ms(ms, stream=s):  # blocks of 250 threads: 0.25 us each
        cuda.cuLaunchKernel(f, int(ms * 4000), 1, 1, 250, 1, 1, 0, stream, None, None)

    t = clock()
    res["launch_s"] = timed(lambda: kernel_ms(20))
    cuda.cuStreamSynchronize(s)
    res["kernel_20ms_s"] = clock() - t
    cuda.rsim_set_gpu_factor(2.0)
    res["kernel_10ms_x2_s"] = timed(lambda: (kernel_ms(10), cuda.cuStreamSynchronize(s)))
    cuda.rsim_set_gpu_factor(1.0)
    cfg = CUlaunchConfig(500, 30, 1, 32, 32, 1, 0, s, None, 0)  # 15.36 M threads
    res["launch_ex_s"] = timed(lambda: (cuda.cuLaunchKernelEx(byref(cfg), f, None, None), cuda.cuCtxSynchronize()))
    res["copy_200MB_s"] = timed(lambda: (cuda.cuMemcpyHtoDAsync_v2(buf, None, 200_000_000, s),
                                         cuda.cuStreamSynchronize(s)))
    t = clock()
    kernel_ms(10)
    cuda.cuEventRecord(ev, s)
    kernel_ms(30)
    res["event_query_early"] = cuda.cuEventQuery(ev)
    cuda.cuEventSynchronize(ev)
    res["event_s"] = clock() - t
    res["stream_query_busy"] = cuda.cuStreamQuery(s)
    cuda.cuStreamSynchronize(s)
    res["stream_query_idle"] = cuda.cuStreamQuery(s)
    res["default_stream_s"] = timed(lambda: (kernel_ms(5, None), cuda.cuStreamSynchronize(None)))

    uid = NcclUniqueId()
    nccl.ncclGetUniqueId(byref(uid))
    name = ctypes.create_string_buffer(64)
    nccl.rsim_comm_shm_name(byref(uid), name, 64)
    res["shm_name_matches"] = name.value.decode() == shm_name(unique_id_bytes(uid))
    comm = c_void_p()
    nccl.ncclCommInitRank(byref(comm), 1, uid, 0)
    count, rank = ctypes.c_int(), ctypes.c_int()
    nccl.ncclCommCount(comm, byref(count)); nccl.ncclCommUserRank(comm, byref(rank))
    res["count_rank"] = [count.value, rank.value]
    # one rank: an all-reduce moves nothing (2(n-1)/n = 0); it starts after the kernel before it
    t = clock()
    kernel_ms(10)
    nccl.ncclAllReduce(p, p, 25_000_000, NCCL_FLOAT32, NCCL_SUM, comm, s)
    res["enqueue_s"] = clock() - t
    kernel_ms(5)  # behind the collective
    cuda.cuStreamSynchronize(s)
    res["kernel_allreduce_kernel_s"] = clock() - t
    res["broadcast_100MB_s"] = timed(lambda: (nccl.ncclBroadcast(p, p, 100_000_000, NCCL_UINT8, 0, comm, s),
                                              cuda.cuStreamSynchronize(s)))
    nccl.rsim_set_link_factor(2.0)
    res["broadcast_100MB_link2_s"] = timed(lambda: (nccl.ncclBroadcast(p, p, 100_000_000, NCCL_UINT8, 0, comm, s),
                                                    cuda.cuStreamSynchronize(s)))
    nccl.rsim_set_link_factor(1.0)

    def group():  # send to self and receive from self: one op, 2 x 5 ms of transfer
        nccl.ncclGroupStart()
        nccl.ncclSend(p, 50_000_000, NCCL_UINT8, 0, comm, s)
        nccl.ncclRecv(p, 50_000_000, NCCL_UINT8, 0, comm, s)
        nccl.ncclGroupEnd()
        cuda.cuStreamSynchronize(s)
    res["group_send_recv_s"] = timed(group)
    try:
        nccl.ncclAllReduce(p, p, 10, 42, NCCL_SUM, comm, s)
    except Exception as e:
        res["bad_dtype"] = e.code
    try:
        cuda.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, s, None, None)
    except Exception as e:
        res["bad_function"] = e.code
    nccl.ncclCommDestroy(comm)
    import os
    res["shm_left"] = os.path.exists("/dev/shm/" + shm_name(unique_id_bytes(uid)).lstrip("/"))
    print(json.dumps(res))
""")


def test_timeline_model(lib_dir):
    out = subprocess.run([sys.executable, "-c", TIMELINE, str(lib_dir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    slack = 0.015  # a loaded 2-core machine may wake late

    def near(value, expected):
        return expected * 0.97 <= value <= expected + slack

    # Asynchronous: the launch returns long before the 20 ms kernel it queued (a loaded machine may preempt it)
    assert r["launch_s"] < 0.5 * 0.020, r
    assert near(r["kernel_20ms_s"], 0.020), r
    assert near(r["kernel_10ms_x2_s"], 0.020), r
    assert near(r["launch_ex_s"], 0.01536), r  # grid and block read from the CUlaunchConfig
    assert near(r["copy_200MB_s"], 0.010), r  # 20 GB/s
    assert near(r["event_s"], 0.010), r  # the event completes before the kernel recorded after it
    assert r["event_query_early"] == 600 and r["stream_query_busy"] == 600 and r["stream_query_idle"] == 0, r
    assert near(r["default_stream_s"], 0.005), r
    assert r["shm_name_matches"] and r["count_rank"] == [1, 0], r
    assert r["enqueue_s"] < 0.5 * 0.010, r  # collectives only enqueue: back long before the 10 ms kernel ahead
    assert near(r["kernel_allreduce_kernel_s"], 0.015), r
    assert near(r["broadcast_100MB_s"], 0.010), r  # 10 GB/s
    assert near(r["broadcast_100MB_link2_s"], 0.020), r
    assert near(r["group_send_recv_s"], 0.010), r
    assert r["bad_dtype"] == 4 and r["bad_function"] == 400, r  # ncclInvalidArgument, CUDA_ERROR_INVALID_HANDLE
    assert r["shm_left"] is False, r


# ---------------------------------------------------------------- jobs

def test_healthy_job_runs_its_steps(jobs):
    job = jobs(2, steps=40)
    assert job.wait(timeout=30) == [0, 0], [job.errors(r) for r in range(2)]
    times = job.step_times()
    assert all(t is not None and 0.03 < t < 0.12 for t in times), times
    assert all(job.errors(r).count("\n") == 1 for r in range(2))  # one line at start, nothing per step
    assert not os.path.exists("/dev/shm/" + job.shm_name.lstrip("/"))


def test_slow_gpu_slows_every_rank_through_the_collective(jobs):
    job = jobs(2, faults=["slow-gpu:1:3"], steps=30)
    assert job.wait(timeout=30) == [0, 0], [job.errors(r) for r in range(2)]
    fast, slow = job.step_times()
    # forward + backward: ~24 ms of GPU time, 72 ms three times slower; rank 0 waits for rank 1 every step
    assert slow > 0.07 and fast > 0.07, (fast, slow)
    assert abs(fast - slow) < 0.1 * slow, (fast, slow)


def test_hang_blocks_the_peers_until_stopped(jobs):
    job = jobs(2, faults=["hang:1:2"], steps=40)
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=3)  # 40 healthy steps take ~2 s
    assert job.returncodes() == [None, None]
    before = [cpu_seconds(p) for p in job.pids]
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=1)
    used = [cpu_seconds(p) - b for p, b in zip(job.pids, before)]
    assert all(u < 0.1 for u in used), used  # blocked sleeping, not spinning
    t = time.monotonic()
    job.stop()
    assert time.monotonic() - t < 4  # SIGTERM suffices: the ranks exit cleanly from their waits
    assert job.returncodes() == [0, 0]
    assert not job.alive() and not os.path.exists("/dev/shm/" + job.shm_name.lstrip("/"))
    job.stop()  # idempotent


def test_hold_file_and_stale_shared_memory(jobs, tmp_path):
    nccl_id = os.urandom(128)
    segment = Path("/dev/shm") / shm_name(nccl_id).lstrip("/")
    # a job killed without clean-up leaves its segment, with ranks that are gone
    dead = jobs(2, nccl_id=nccl_id)
    deadline = time.monotonic() + 20
    while not segment.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert segment.exists()
    dead._signal(9)
    assert dead.wait(timeout=10) == [-9, -9]
    assert segment.exists()
    # a new job with the same id is not confused by it; with a hold file it waits before comm set-up
    hold = tmp_path / "go"
    job = jobs(2, steps=3, hold_file=hold, nccl_id=nccl_id)
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=1)
    hold.touch()
    assert job.wait(timeout=20) == [0, 0], [job.errors(r) for r in range(2)]
    assert all(t is not None for t in job.step_times())


def test_cli_prints_pids_and_waits(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rankscope.sim.job", "--ranks", "2", "--steps", "3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pids = out.stdout.strip().split(",")
    assert len(pids) == 2 and all(p.isdigit() for p in pids), out.stdout
    bad = subprocess.run([sys.executable, "-m", "rankscope.sim.job", "--ranks", "2", "--fault", "slow-gpu:5:2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "rank 5" in bad.stderr, bad


# ---------------------------------------------------------------- fault specs

@pytest.mark.parametrize("spec, fault", [
    ("slow-gpu:2:2.5", Fault("slow-gpu", 2, 2.5)),
    ("slow-link:1:4", Fault("slow-link", 1, 4.0)),
    ("input-stall:0:0.05", Fault("input-stall", 0, 0.05)),
    ("gc:3", Fault("gc", 3)),
    ("gc:1@5", Fault("gc", 1, None, 5.0)),
    ("hang:0:100@1.5", Fault("hang", 0, 100, 1.5)),
    ("slow-gpu:*:1.5@3", Fault("slow-gpu", EVERY_RANK, 1.5, 3.0)),
])
def test_fault_specs_parse(spec, fault):
    assert parse_fault(spec) == fault
    assert parse_fault(fault.spec()) == fault


@pytest.mark.parametrize("spec", [
    "", "slow-gpu", "slow-gpu:", "slow-gpu:1", "slow-gpu:x:2", "slow-gpu:-1:2", "slow-gpu:1:0", "slow-gpu:1:fast",
    "slow-gpu:1:2:3", "gc:1:2", "hang:1", "hang:1:2.5", "input-stall:0:-1", "melt:0", "slow-gpu:1:2@soon",
    "slow-gpu:1:2@-1", "slow-gpu:1:nan", "slow-gpu:**:2",
])
def test_malformed_fault_specs_are_rejected(spec):
    with pytest.raises(ValueError, match="fault|KIND"):
        parse_fault(spec)


def test_start_job_rejects_faults_for_missing_ranks():
    with pytest.raises(ValueError, match="rank 4"):
        start_job(4, faults=["slow-gpu:4:2"])
    with pytest.raises(ValueError):
        start_job(2, faults=["slow-gpu:1"])
