"""The scheduler's view on the simulated job (real sched tracepoints): waiting for a CPU vs computing.

Ranks 0 and 1 share CPU 0; rank 2 has CPU 1 to itself, unless a CPU hog (conftest's `hog`) is pinned there.
The ranks run above the machine's other load (conftest's `above_other_load`), so that only the hog decides who waits.
"""

from collections.abc import Callable

from conftest import diagnose_json

HOST_CPU_S = 0.008  # CPU work per step of every rank, so that losing the CPU costs time (a hog took 44-65% of
# the step from rank 2 in 20 runs of 20, late in every step; with 4 ms, 5-29%, late in 53-100% of the steps)
OBSERVE_S = 4.0


def _pin(pin: Callable[[int, int], None], pids: list[int]) -> None:
    for rank, pid in enumerate(pids):
        pin(pid, 0 if rank < 2 else 1)


def _kinds(doc: dict) -> list[tuple[str, list[int]]]:
    return [(f["kind"], f["ranks"]) for f in doc["findings"]]


def test_a_hog_on_a_ranks_cpu_is_cpu_contention_naming_it(sim_job, hog, above_other_load):
    job = sim_job(3, host_cpu_s=HOST_CPU_S)
    _pin(above_other_load, job.pids)
    doc = diagnose_json(job.pids, OBSERVE_S)
    assert _kinds(doc) == [("cpu_contention", [2])], doc["findings"]
    f = doc["findings"][0]
    assert f["component"] == "cpu"
    # Among those that held the rank's CPU (first on an idle machine; see test_torch's twin for a loaded one).
    assert hog.pid in [n["pid"] for n in f["evidence"]["neighbours"]], f["evidence"]["neighbours"]
    # Its peers wait for a CPU too (ranks 0 and 1 share CPU 0), by how much depends on the machine's load.
    assert f["evidence"]["runq_s"] > f["evidence"]["peers_runq_s"]


def test_computing_longer_on_its_own_cpu_is_a_compute_straggler(sim_job, above_other_load):
    job = sim_job(3, faults=("slow-cpu:2:5",), host_cpu_s=HOST_CPU_S)
    _pin(above_other_load, job.pids)
    doc = diagnose_json(job.pids, OBSERVE_S)
    assert _kinds(doc) == [("compute_straggler", [2])], doc["findings"]
    assert doc["findings"][0]["component"] == "cpu"


def test_pinned_without_a_hog_is_healthy(sim_job, above_other_load):
    job = sim_job(3, host_cpu_s=HOST_CPU_S)
    _pin(above_other_load, job.pids)
    assert diagnose_json(job.pids, OBSERVE_S)["findings"] == []
