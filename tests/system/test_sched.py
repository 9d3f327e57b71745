"""The scheduler tracepoints' accounting of a watched thread (real sched tracepoints, real eBPF): a thread
that alternates computing and sleeping is seen on the CPU and asleep for as long as it was."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from rankscope.agent.session import Session
from rankscope.sim.build import build_libraries

CYCLES, SLICE_S = 40, 0.02
TARGET = f"""
import ctypes, sys, time
ctypes.CDLL(sys.argv[1])  # a probed library: the agent takes it for a GPU process
print("ready", flush=True)
sys.stdin.readline()
for _ in range({CYCLES}):
    end = time.thread_time() + {SLICE_S}
    while time.thread_time() < end:
        pass
    time.sleep({SLICE_S})
print("done", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def target() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen([sys.executable, "-c", TARGET, str(build_libraries() / "libcuda.so.1")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    yield p
    p.kill()
    p.wait()


def test_time_on_cpu_and_asleep_is_accounted(target):
    session = Session()
    try:
        session.add(target.pid)
        session.window()  # from here on
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "done"
        main = next(p for p in session.window() if p.pid == target.pid).sched["main"]
    finally:
        session.close()
    busy = CYCLES * SLICE_S
    assert busy * 0.9 <= main.on_cpu_s <= busy * 1.2, main  # computing (its wait for a CPU depends on the load)
    assert busy * 0.9 <= main.sleep_s <= busy * 1.5, main  # the sleeps (and the wait for "go")
    assert main.io_s < 0.05 * busy, main
