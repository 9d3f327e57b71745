"""Where stalled processes' main threads are (agent/host/thread_state.py), every process read in each round."""
import subprocess
import sys
import time

from rankscope.agent.host.thread_state import settled, where


def test_each_process_gets_its_own_state_and_a_gone_one_is_unknown():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE)
    reader = subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        sleeper.stdout.readline(), reader.stdout.readline()  # both past start-up, about to block
        deadline = time.monotonic() + 10
        while True:  # wait until both are blocked where they stay
            states = where([sleeper.pid, reader.pid, gone.pid], samples=3, interval_s=0.001)
            if states[sleeper.pid].startswith(("clock_nanosleep", "select", "nanosleep")) and \
                    states[reader.pid].startswith("read"):
                break
            assert time.monotonic() < deadline, states
        assert states[reader.pid].endswith(" from pipe"), states  # what it reads: its stdin, a pipe
        assert states[gone.pid] == ""
        assert where([]) == {}
    finally:
        for p in (sleeper, reader):
            p.kill()
            p.wait()


def test_a_spinning_thread_is_running():
    spinner = subprocess.Popen([sys.executable, "-c", "print(flush=True)\nwhile True: pass"], stdout=subprocess.PIPE)
    try:
        spinner.stdout.readline()
        assert where([spinner.pid], samples=5, interval_s=0.002)[spinner.pid] == "running"
    finally:
        spinner.kill()
        spinner.wait()


def test_running_counts_only_for_a_thread_that_used_the_cpu():
    polled = ["running", "futex (futex_do_wait)", "running", "running", "futex (futex_do_wait)"]
    # A waiter that polls, found runnable (waiting for a CPU) in most samples: it waits in futex.
    assert settled(polled, busy=False) == "futex (futex_do_wait)"
    # The same samples of a thread that computed meanwhile: running, with a GIL hand-off now and then.
    assert settled(polled, busy=True) == "running"
    # Never seen blocked: running however little CPU it got.
    assert settled(["running"] * 5, busy=False) == "running"
    assert settled(["", ""], busy=False) == ""
