"""cpu_contention versus compute_straggler on synthetic jobs: where a slow rank's extra time goes decides."""
from pathlib import Path

import pytest
from test_analyzer import WINDOW, findings, simulate

from rankscope.schema.patterns import Neighbour, ThreadTimes
from rankscope.schema.wire import decode_patterns

STEP = 0.048
BASE_RUNQ = 0.0004  # every rank waits a little for a CPU each step


def with_sched(patterns, runq_extra: dict[int, float], neighbour: Neighbour | None = None):
    steps = WINDOW / STEP
    for p in patterns:
        runq = (BASE_RUNQ + runq_extra.get(p.rank, 0.0)) * steps
        p.sched = {"main": ThreadTimes("main", 1, on_cpu_s=0.3, runq_s=runq, sleep_s=1.5, io_s=0.0, reclaim_s=0.0,
                                       preempted=40, runq_p99_s=0.004),
                   "other": ThreadTimes("other", 3, 0.01, 0.0, 1.9, 0.0, 0.0, 1, 0.0)}
        if neighbour and p.rank in runq_extra:
            p.neighbours = [neighbour, Neighbour("kworker/1:1", 40, "", 0.001)]
    return patterns


HOG = Neighbour("stress-ng", 4242, "kubepods/pod-noisy", 0.9)


def test_waiting_for_a_cpu_is_contention_and_names_the_neighbour():
    pats = with_sched(simulate(4, host_extra={3: 0.015}), runq_extra={3: 0.014}, neighbour=HOG)
    found = findings(pats)
    assert [(f["kind"], f["ranks"]) for f in found] == [("cpu_contention", [3])], found
    f = found[0]
    assert f["component"] == "cpu" and 0.2 < f["cost"] < 0.4
    assert f["evidence"]["neighbours"][0]["name"] == "stress-ng"
    assert "stress-ng (pid 4242)" in f["summary"]


def test_two_ranks_the_contended_one_is_named():
    """Of two ranks, each is compared with the other: the runq difference is not halved by a median of both."""
    pats = with_sched(simulate(2, host_extra={1: 0.015}), runq_extra={1: 0.012}, neighbour=HOG)
    found = findings(pats)
    assert [(f["kind"], f["ranks"]) for f in found] == [("cpu_contention", [1])], found
    # The peer is rank 0 alone: its run-queue wait per step of the job (slowed by rank 1's 15 ms).
    assert found[0]["evidence"]["peers_runq_s"] == pytest.approx(BASE_RUNQ * (STEP + 0.015) / STEP, rel=0.02)


def test_computing_longer_stays_a_compute_straggler():
    pats = with_sched(simulate(4, host_extra={3: 0.015}), runq_extra={3: 0.001})
    found = findings(pats)
    assert [(f["kind"], f["ranks"], f["component"]) for f in found] == [("compute_straggler", [3], "cpu")], found


def test_contention_without_lost_time_is_no_finding():
    """A rank that waits for a CPU but keeps pace costs the job nothing: nothing to report."""
    pats = with_sched(simulate(4), runq_extra={1: 0.010}, neighbour=HOG)
    assert findings(pats) == []


def test_no_scheduler_view_keeps_the_compute_verdict():
    found = findings(simulate(4, host_extra={2: 0.015}))
    assert [(f["kind"], f["ranks"]) for f in found] == [("compute_straggler", [2])]


def test_cost_counts_the_wait_for_a_cpu_inside_collectives():
    """A victim arrives 8 ms late but its main thread waited 16 ms more for a CPU than its peers: the rest of
    the wait stretched the collectives themselves, which every rank pays (a hog on a gloo rank's CPU)."""
    pats = with_sched(simulate(4, host_extra={3: 0.008}), runq_extra={3: 0.016}, neighbour=HOG)
    [f] = findings(pats)
    assert f["kind"] == "cpu_contention"
    ev = f["evidence"]
    waited_for_cpu = ev["runq_s"] - ev["peers_runq_s"]  # per step of the job (with_sched spreads it per 48 ms)
    assert waited_for_cpu > 2 * 0.008
    assert f["cost"] == pytest.approx(waited_for_cpu / ev["step_time_s"], rel=0.02)


def test_working_longer_on_a_loaded_host_is_not_contention():
    """On a host loaded several deep a rank that works 15 ms longer also waits longer for a CPU, here more than
    it ran: it ran 6 ms of its extra time beyond its peers, which a victim of a hog never does."""
    pats = with_sched(simulate(4, host_extra={3: 0.015}), runq_extra={3: 0.009})
    steps = WINDOW / STEP
    pats[3].sched["main"].on_cpu_s += 0.006 * steps
    found = findings(pats)
    assert [(f["kind"], f["ranks"]) for f in found] == [("compute_straggler", [3])], found


def test_waiting_for_the_jobs_own_processes_is_no_finding():
    """A job with more busy processes than CPUs waits for itself: behind its own ranks and DataLoader workers,
    a rank's wait is neither contention from other work nor computing longer."""
    workers = Neighbour("pt_data_worker", 4243, "", 0.9, job=True)
    pats = with_sched(simulate(4, host_extra={3: 0.015}), runq_extra={3: 0.014}, neighbour=workers)
    assert findings(pats) == []


def test_a_healthy_job_that_waits_for_itself_is_not_contended_nor_behind_a_slow_link():
    """An agent's window of cnn-3 (3 ranks, 6 DataLoader workers, 2 CPUs): rank 0 waited 25 ms a step more
    than its peers for a CPU, behind rank 2 and two workers (neighbours of the job, as the agent now marks
    them), and arrived late at the all-reduces for it. Before: `cpu_contention` [0], confirmed; named
    without that wait, its links read slow."""
    window = Path(__file__).resolve().parents[1] / "data" / "agent-windows" / "cnn-3-healthy-waits-for-itself.msgpack"
    pats = decode_patterns(window.read_bytes())
    assert findings(pats) == []
    for n in (n for p in pats for n in p.neighbours):
        n.job = False  # the same waits behind strangers: other work took the CPU
    assert [(f["kind"], f["ranks"]) for f in findings(pats)] == [("cpu_contention", [0])]


@pytest.mark.parametrize("job", [True, False])
def test_a_rank_held_back_by_its_own_jobs_ranks_is_no_compute_straggler(job):
    """4 ranks on 2 CPUs: rank 3 arrives 8 ms late, all of it waiting for a CPU, and ran 2 ms longer than its
    peers (a quarter of its lateness: not cpu_contention's victim, which runs no longer). Behind its own job's
    ranks that is the job oversubscribing its host, not rank 3 computing more; behind a stranger's process it
    stays the compute straggler it was read as."""
    holder = Neighbour("python", 4300, "", 0.9, job=job)
    pats = with_sched(simulate(4, host_extra={3: 0.008}), runq_extra={3: 0.008}, neighbour=holder)
    pats[3].sched["main"].on_cpu_s += 0.002 * WINDOW / STEP
    found = findings(pats)
    assert [(f["kind"], f["ranks"]) for f in found] == ([] if job else [("compute_straggler", [3])]), found


def test_a_rank_that_runs_longer_behind_its_own_jobs_ranks_stays_a_compute_straggler():
    """The same wait behind its own job, but it ran 6 ms longer than its peers (over the straggler bar): it
    has more work to do, whoever else holds the CPUs."""
    holder = Neighbour("python", 4300, "", 0.9, job=True)
    pats = with_sched(simulate(4, host_extra={3: 0.015}), runq_extra={3: 0.010}, neighbour=holder)
    pats[3].sched["main"].on_cpu_s += 0.006 * WINDOW / STEP
    found = findings(pats)
    assert [(f["kind"], f["ranks"]) for f in found] == [("compute_straggler", [3])], found
