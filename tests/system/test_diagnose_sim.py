"""End to end on the simulated GPU job: real uprobes on the stand-in libcuda/libnccl, real analysis."""
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import diagnose_json, wait_until

from rankscope.agent.session import Session
from rankscope.analyzer.diagnosis import diagnose
from rankscope.schema.wire import decode_patterns

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jobs"))
import launch  # noqa: E402

OBSERVE_S = 4.0
STEP_TOLERANCE = 0.10  # the accuracy tests' margin (test_accuracy.py)


def _named(doc: dict, kind: str) -> list[list[int]]:
    return [f["ranks"] for f in doc["findings"] if f["kind"] == kind]


def test_healthy_job_has_no_finding(sim_job):
    job = sim_job(4)
    doc = diagnose_json(job.pids, OBSERVE_S)
    assert doc["findings"] == []
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 2, 3]
    assert all(0.03 < r["step_time_s"] < 0.12 for r in doc["ranks"]), doc["ranks"]


@dataclass(frozen=True)
class Diagnosed:
    """A diagnosed window of a job: its ranks' pids, the document, the saved patterns, and the job's own step
    time over the document's window, from its ranks' step logs (rankscope.sim.steplog)."""

    pids: list[int]
    doc: dict
    saved: bytes
    own_step_s: float


@pytest.fixture(scope="module")
def slow_gpu(tmp_path_factory) -> Diagnosed:
    """One diagnosed window of a 4-rank job whose rank 2's GPU is twice as slow (the job stopped after: it would
    load the machine under the module's other tests)."""
    workdir = tmp_path_factory.mktemp("slow-gpu")
    job = launch.start_sim(4, ["slow-gpu:2:2"], workdir, steady_steps=1)  # the window opens later, on attach
    try:
        saved = workdir / "window.msgpack"
        doc = diagnose_json(list(job.pids.values()), OBSERVE_S, "--save-patterns", str(saved))
        job.wait_written(doc["window"]["end"])
        own = job.step_time(doc["window"]["start"], doc["window"]["end"])
        return Diagnosed(list(job.pids.values()), doc, saved.read_bytes(), own)
    finally:
        job.kill()


def test_slow_gpu_is_a_compute_straggler(slow_gpu):
    doc = slow_gpu.doc
    top = doc["findings"][0]
    assert (top["kind"], top["ranks"], top["component"]) == ("compute_straggler", [2], "gpu"), doc["findings"]
    assert top["function"] == "cuStreamSynchronize"
    # forward+backward take ~24 ms of GPU time; twice as slow costs ~24 ms of a ~70 ms step
    assert 0.2 < top["cost"] < 0.5, top
    assert _named(doc, "slow_link") == []


def test_the_step_time_is_the_one_the_ranks_logged(slow_gpu):
    """The simulated ranks log their steps as the torch jobs do (rankscope.sim.steplog): the document's step,
    one for the synchronous job, is theirs over the same window."""
    doc = slow_gpu.doc
    assert doc["step_time_s"] == pytest.approx(slow_gpu.own_step_s, rel=STEP_TOLERANCE), doc["step_time_s"]
    assert len({r["step_time_s"] for r in doc["ranks"]}) == 1, doc["ranks"]


def test_saved_patterns_are_the_window_behind_the_verdict(slow_gpu):
    """--save-patterns keeps the raw data: read back, it holds every rank and gives the same verdict."""
    pids, doc, saved = slow_gpu.pids, slow_gpu.doc, slow_gpu.saved
    patterns = decode_patterns(saved)
    assert sorted(p.pid for p in patterns) == sorted(pids)
    # One window for all: it opens once every rank is watched (the first attached is not watched longer).
    assert len({(p.window_start, p.window_end) for p in patterns}) == 1
    assert doc["window"]["end"] - doc["window"]["start"] == pytest.approx(OBSERVE_S, abs=1.0)
    assert all(len(p.collectives) > 48 for p in patterns), [len(p.collectives) for p in patterns]  # the window's
    again = diagnose(patterns)[doc["job"]]
    assert [(f["kind"], f["ranks"]) for f in again["findings"]] == [(f["kind"], f["ranks"]) for f in doc["findings"]]
    assert again["findings"][0]["ranks"] == [2]


def test_slow_link_is_named(sim_job):
    job = sim_job(4, faults=("slow-link:1:4",))
    doc = diagnose_json(job.pids, OBSERVE_S)
    top = doc["findings"][0]
    assert (top["kind"], top["ranks"], top["component"]) == ("slow_link", [1], "link"), doc["findings"]
    assert top["function"] == "ncclAllReduce"
    assert _named(doc, "compute_straggler") == []


def test_rank_and_world_come_from_the_communicator(sim_job, tmp_path):
    """Attached before ncclCommInitRank, the agent reads rank, size and the shared id from its arguments."""
    hold = tmp_path / "go"
    job = sim_job(2, hold_file=hold)

    session = Session()
    try:
        for pid in job.pids:
            session.add(pid)
        hold.touch()
        by_pid: dict = {}

        def every_rank_reduced() -> bool:
            by_pid.update((p.pid, p) for p in session.window() if "ncclAllReduce" in p.functions)
            return len(by_pid) == 2

        wait_until(every_rank_reduced, 20, "all-reduces after comm init", interval=0.2)
        patterns = list(by_pid.values())
        assert {p.identity_source for p in patterns} == {"nccl"}
        assert sorted(p.rank for p in patterns) == [0, 1] and {p.world_size for p in patterns} == {2}
        assert len({p.job for p in patterns}) == 1
        allreduce = by_pid[job.pids[0]].functions["ncclAllReduce"]
        assert allreduce.bytes == allreduce.count * 25_000_000 * 4  # count x sizeof(float32)
    finally:
        session.close()


def test_kernel_launches_are_probed_in_deep_detail_only(sim_job):
    """Launches are the hottest path (up to 100k calls/s): light detail leaves them alone."""
    from rankscope.agent.detail import DEEP, LIGHT
    from rankscope.agent.host.symbols import code_byte

    job = sim_job(2)
    pid = job.pids[0]
    armed = lambda symbol: code_byte(pid, "libcuda.so.1", symbol) == 0xCC  # noqa: E731
    session = Session()
    try:
        session.add(pid)
        assert armed("cuStreamSynchronize") and not armed("cuLaunchKernel")
        session.set_detail(DEEP)
        assert armed("cuLaunchKernel") and armed("cuLaunchKernelEx")
        launched = wait_until(lambda: next((p.functions.get("cuLaunchKernel") for p in session.window()), None), 10,
                              "counted launches")
        assert launched.count > 0
        session.set_detail(LIGHT)
        assert not armed("cuLaunchKernel") and armed("cuStreamSynchronize")
    finally:
        session.close()


def test_rank_that_never_reaches_the_collective_is_a_noncomm_hang(sim_job):
    job = sim_job(4, faults=("hang:1:5",))
    wait_until(lambda: _in_sleep(job.pids[1]) and all(_in_futex(p) for p in job.pids if p != job.pids[1]),
               30, "rank 1 to stop in wait_forever and the others to wait for it")
    doc = diagnose_json(job.pids, 2.5, "--hang-timeout", "2")
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("noncomm_hang", [1])], \
        [(f["kind"], f["ranks"], f["evidence"].get("per_rank")) for f in doc["findings"]]
    f = doc["findings"][0]
    assert f["cost"] == 1.0 and "rank 1 sleeps in rank.py:wait_forever (clock_nanosleep)" in f["summary"]
    assert f["function"] == "rank.py:wait_forever"


def test_collective_that_never_completes_is_a_comm_hang(sim_job):
    """Links so slow that the all-reduce never ends: every rank entered it, none completes. The links slow
    down from the first step on every rank: a later onset is per rank clock, so one rank could finish the
    last fast all-reduce and wait alone in the next one (then it is the odd one out)."""
    job = sim_job(4, faults=("slow-link:*:1e9",))
    wait_until(lambda: len({_syscall(p) for p in job.pids}) == 1 and _syscall(job.pids[0]) != "running", 30,
               "every rank to block alike, waiting for the transfer")
    doc = diagnose_json(job.pids, 2.5, "--hang-timeout", "2")
    assert [(f["kind"], f["ranks"]) for f in doc["findings"]] == [("comm_hang", [0, 1, 2, 3])], doc["findings"]


def _syscall(pid: int) -> str:
    with open(f"/proc/{pid}/syscall") as f:
        return f.read().split()[0]


def _in_sleep(pid: int) -> bool:
    return _syscall(pid) == "230"  # clock_nanosleep


def _in_futex(pid: int) -> bool:
    return _syscall(pid) == "202"


def test_input_stall_is_an_input_straggler_naming_the_loader(sim_job):
    job = sim_job(4, faults=("input-stall:3:0.02",))
    doc = diagnose_json(job.pids, OBSERVE_S)
    top = doc["findings"][0]
    assert (top["kind"], top["ranks"], top["component"]) == ("input_straggler", [3], "input"), doc["findings"]
    assert top["function"] == "rank.py:load_batch"
    assert 0.15 < top["cost"] < 0.45, top  # 20 ms of a ~68 ms step


def test_gc_pauses_are_python_gc(sim_job):
    job = sim_job(4, faults=("gc:2",))
    doc = diagnose_json(job.pids, OBSERVE_S)
    top = doc["findings"][0]
    assert (top["kind"], top["ranks"], top["component"]) == ("python_gc", [2], "python"), doc["findings"]
    assert top["function"] == "gc_collect_main"


def test_every_collective_enqueued_before_a_sync_completes_there(sim_job, tmp_path):
    """NCCL's calls only enqueue: a step's 12 bucket all-reduces all complete at its one synchronization. The
    kernel completed the last 8 there, so the analyzer saw 8 a step among 12 calls (an H200 NCCL job with 14 a
    step: its step read at half the job's)."""
    job = sim_job(4, buckets=12)
    saved = tmp_path / "window.msgpack"
    diagnose_json(job.pids, OBSERVE_S, "--save-patterns", str(saved))
    for p in decode_patterns(saved.read_bytes()):
        done = p.collectives.instants[:, 1]
        _, per_sync = np.unique(done[done > 0], return_counts=True)
        # Whole steps only: the shipped records' first step may be cut, the last one still pending.
        assert len(per_sync) >= 3 and (per_sync[1:-1] == 12).all(), per_sync
