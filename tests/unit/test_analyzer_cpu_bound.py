"""A straggler's cost on a CPU-saturated host: bounded by what its CPUs could have run without its extra work."""
import pytest
from test_analyzer import WINDOW, findings, simulate

from rankscope.schema.patterns import HostCpus, ThreadTimes
from rankscope.schema.wire import PatternDecodeError, decode_patterns, encode_patterns

EXTRA = 0.015  # seconds a step the straggler computes longer
STEP = 0.048 + EXTRA  # the job's step with it


def on_host(patterns, cpus: HostCpus | None, straggler: int = 3):
    """Each rank's main thread runs 30 ms a step, the straggler EXTRA more; all on CPUs `cpus`."""
    steps = WINDOW / STEP
    for p in patterns:
        ran = (0.030 + (EXTRA if p.rank == straggler else 0.0)) * steps
        p.sched = {"main": ThreadTimes("main", 1, on_cpu_s=ran, runq_s=0.0004 * steps, sleep_s=0.5, io_s=0.0,
                                       reclaim_s=0.0, preempted=40, runq_p99_s=0.004)}
        p.cpus = cpus
    return patterns


def straggler_cost(cpus: HostCpus | None) -> float:
    found = findings(on_host(simulate(4, host_extra={3: EXTRA}), cpus))
    assert [(f["kind"], f["ranks"]) for f in found] == [("compute_straggler", [3])], found
    return found[0]["cost"]


def test_on_a_saturated_host_the_cost_is_what_the_cpus_could_gain():
    """Two busy CPUs, 5% idle: without the straggler's 15 ms the CPUs still have the rest to run, so the step
    shrinks by at most 5% + 15 ms / 2 CPUs of it, not by the whole wait."""
    waited = straggler_cost(None)
    assert waited == pytest.approx(EXTRA / STEP, rel=0.15)
    bounded = straggler_cost(HostCpus(2, 0.05))
    assert bounded == pytest.approx(0.05 + EXTRA / (2 * STEP), rel=0.15)
    assert bounded < 0.75 * waited


def test_idle_cpus_leave_the_wait_as_the_cost():
    assert straggler_cost(HostCpus(16, 0.7)) == straggler_cost(None)


def test_a_pinned_straggler_alone_on_its_cpu_loses_all_its_extra():
    """Its one CPU idles only while it waits for the others: the bound is about its whole extra time."""
    assert straggler_cost(HostCpus(1, 0.02)) == pytest.approx(straggler_cost(None), rel=0.15)


def test_host_cpus_cross_the_wire_and_bad_values_are_refused():
    p = simulate(2)[0]
    p.cpus = HostCpus(8, 0.25)
    assert decode_patterns(encode_patterns([p]))[0].cpus == HostCpus(8, 0.25)
    p.cpus = HostCpus(8, 1.5)
    with pytest.raises(PatternDecodeError, match="above 1"):
        decode_patterns(encode_patterns([p]))
