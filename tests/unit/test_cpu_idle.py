"""The host facts each pattern carries (agent/sources/host.py): the CPUs' idle share (agent/host/cpu_idle.py,
read from /proc/stat), major page faults, and the main thread's minor page faults and time in the kernel."""
import os
import subprocess
import sys
import mmap
import time

from rankscope.agent.host.cpu_idle import CpuIdle
from rankscope.agent.host.targets import Target
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


def _fault_in(pages: int) -> None:
    """Touch `pages` fresh anonymous pages: each one a minor fault the kernel handles on this thread."""
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as m:
        for i in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
            m[i] = 1


def test_the_main_threads_page_faults_and_kernel_time_count_from_attach():
    facts = HostFacts()
    unwatched = _pattern(os.getpid())
    facts.fill([unwatched])  # never read before: unknown, not zero
    assert unwatched.minor_faults is None and unwatched.kernel_s is None
    facts.forget(os.getpid())
    facts.attach(Target(pid=os.getpid(), name="test", start_time=0))
    _fault_in(20_000)  # 80 MB: ~20,000 faults, ~50-100 ms of kernel time on this VM
    first = _pattern(os.getpid())
    facts.fill([first])
    assert first.minor_faults >= 20_000
    assert first.kernel_s > 0.0  # system time is tick-sampled: some, not a figure
    second = _pattern(os.getpid())
    facts.fill([second])  # nothing faulted in between
    assert second.minor_faults < 1_000
