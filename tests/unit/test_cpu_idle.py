"""The host facts each pattern carries (agent/sources/host.py): the CPUs' idle share (agent/host/cpu_idle.py,
read from /proc/stat) and major page faults."""
import os
import subprocess
import sys
import time

from rankscope.agent.host.cpu_idle import CpuIdle
from rankscope.agent.sources.host import HostFacts
from rankscope.schema.patterns import RankPattern


def test_a_busy_cpu_reads_as_not_idle_and_the_share_is_over_the_process_cpus():
    spinner = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
    try:
        deadline = time.monotonic() + 10
        while os.sched_getaffinity(spinner.pid) != {0}:  # pinned itself
            assert time.monotonic() < deadline
        idle = CpuIdle()
        time.sleep(0.5)  # the measured window, not a synchronization
        idle.advance()
        count, share = idle.of(spinner.pid)
        assert count == 1 and share < 0.1
        count, share = idle.of(os.getpid())
        assert count == len(os.sched_getaffinity(0)) and 0.0 <= share <= 1.0
    finally:
        spinner.kill()
        spinner.wait()
    assert idle.of(spinner.pid) is None  # gone: unknown, not an error


def test_before_a_window_closes_nothing_is_known():
    assert CpuIdle().of(os.getpid()) is None


def _pattern(pid: int) -> RankPattern:
    return RankPattern(job="j", rank=0, world_size=1, pid=pid, host="h", window_start=0.0, window_end=1.0)


def test_host_facts_count_from_the_first_window_and_forget_a_gone_process(monkeypatch):
    faults = {os.getpid(): 100}
    monkeypatch.setattr("rankscope.agent.sources.host.major_faults", lambda pid: faults.get(pid, 0))
    facts = HostFacts()
    first = _pattern(os.getpid())
    facts.fill([first])  # faults before it was watched are not the window's
    assert first.major_faults == 0
    assert first.cpus is not None and first.cpus.count == len(os.sched_getaffinity(0))
    faults[os.getpid()] = 107
    second = _pattern(os.getpid())
    facts.fill([second])
    assert second.major_faults == 7
    facts.forget(os.getpid())
    faults[os.getpid()] = 110
    again = _pattern(os.getpid())
    facts.fill([again])  # watched anew: counts from here again
    assert again.major_faults == 0
