"""The CPUs' idle share the collector ships with each pattern (agent/host/cpu_idle.py), read from /proc/stat."""
import os
import subprocess
import sys
import time

from rankscope.agent.host.cpu_idle import CpuIdle


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
